"""Summaries over seeds: mean, sample standard deviation, and the 95% interval of a mean (Student's t),
for a study's accuracies and the paired differences between its arms."""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import asdict, dataclass
from functools import cache


def t_density(x: float, df: int) -> float:
    """Student's t probability density with `df` degrees of freedom."""
    log_norm = math.lgamma((df + 1) / 2) - math.lgamma(df / 2) - 0.5 * math.log(df * math.pi)
    return math.exp(log_norm - (df + 1) / 2 * math.log1p(x * x / df))


def t_cdf(x: float, df: int) -> float:
    """P(T <= x) for x >= 0: 1/2 plus the density integrated from 0 to x in the variable u = atan(t),
    whose integrand is smooth and bounded (Simpson's rule, 2,000 intervals: ~1e-10 for df >= 1)."""
    end, steps = math.atan(x), 2000
    width = end / steps

    def integrand(u: float) -> float:
        return t_density(math.tan(u), df) / math.cos(u) ** 2

    total = integrand(0.0) + integrand(end)
    total += sum((4 if i % 2 else 2) * integrand(i * width) for i in range(1, steps))
    return 0.5 + total * width / 3


@cache
def t_quantile(p: float, df: int) -> float:
    """The t value with P(T <= t) = p, for 0.5 <= p < 1 (bisection on t_cdf). Kept per (p, df): each takes
    some 0.07 s, and a study's plan and report ask for the same few hundreds of times."""
    if not 0.5 <= p < 1 or df < 1:
        raise ValueError(f"t_quantile needs 0.5 <= p < 1 and df >= 1, got p={p}, df={df}")
    low, high = 0.0, 1.0
    while t_cdf(high, df) < p:
        low, high = high, 2 * high
    for _ in range(60):
        middle = (low + high) / 2
        low, high = (middle, high) if t_cdf(middle, df) < p else (low, middle)
    return (low + high) / 2


@dataclass(frozen=True)
class Summary:
    """Values over seeds: n, mean, sample std (ddof 1; 0 for one value) and the mean's 95% interval
    [low, high] by Student's t (None for one value)."""

    n: int
    mean: float
    std: float
    low: float | None
    high: float | None
    values: tuple[float, ...]

    def as_dict(self) -> dict[str, object]:
        return {**asdict(self), "values": list(self.values)}


def summarise(values: Sequence[float], *, confidence: float = 0.95) -> Summary:
    """Mean, std and the t interval of the mean of `values` (one per seed)."""
    if not values:
        raise ValueError("nothing to summarise: no values")
    n = len(values)
    mean = sum(values) / n
    if n == 1:
        return Summary(1, mean, 0.0, None, None, tuple(values))
    std = math.sqrt(sum((v - mean) ** 2 for v in values) / (n - 1))
    half = t_quantile(0.5 + confidence / 2, n - 1) * std / math.sqrt(n)
    return Summary(n, mean, std, mean - half, mean + half, tuple(values))


def paired(first: dict[int, float], second: dict[int, float]) -> Summary:
    """first − second over the seeds both have ({seed: value} each): the paired difference."""
    seeds = sorted(set(first) & set(second))
    if not seeds:
        raise ValueError("no seed in common to pair")
    return summarise([first[s] - second[s] for s in seeds])
