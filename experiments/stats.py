"""Summaries over seeds: mean, sample standard deviation, and the 95% interval of a mean (Student's t),
for a study's accuracies and the paired differences between its arms."""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import asdict, dataclass


def t_cdf(t: float, df: int) -> float:
    """P(T <= t) for Student's t with a whole number `df` of degrees of freedom, in closed form
    (Abramowitz and Stegun 26.7.3-4): with theta = atan(|t| / sqrt(df)), c = cos(theta),
    P(|T| <= |t|) is (2 / pi)(theta + sin(theta) c (1 + 2/3 c^2 + 2 4/(3 5) c^4 + ...)) for odd df and
    sin(theta) (1 + 1/2 c^2 + 1 3/(2 4) c^4 + ...) for even df, each sum ending at the power df - 2."""
    if df < 1:
        raise ValueError(f"t_cdf needs df >= 1, got {df}")
    theta = math.atan(abs(t) / math.sqrt(df))
    sin, cos = math.sin(theta), math.cos(theta)
    term, total = 1.0, 1.0
    for k in range(1, (df - 1) // 2 if df % 2 else df // 2):
        term *= cos * cos * ((2 * k) / (2 * k + 1) if df % 2 else (2 * k - 1) / (2 * k))
        total += term
    inside = 2 / math.pi * (theta + (sin * cos * total if df > 1 else 0.0)) if df % 2 else sin * total
    return 0.5 + math.copysign(inside, t) / 2


def t_quantile(p: float, df: int) -> float:
    """The t value with P(T <= t) = p of Student's t with `df` degrees of freedom: t_cdf inverted by
    bisection on theta = atan(t / sqrt(df)) in [0, pi/2), where P rises from 0.5 towards 1."""
    if not 0.5 <= p < 1 or df < 1:
        raise ValueError(f"t_quantile needs 0.5 <= p < 1 and df >= 1, got p={p}, df={df}")
    low, high = 0.0, math.pi / 2
    for _ in range(200):  # the interval halves each time: it ends at the floats' resolution
        middle = (low + high) / 2
        if middle in (low, high):
            break
        low, high = (middle, high) if t_cdf(math.sqrt(df) * math.tan(middle), df) < p else (low, middle)
    return math.sqrt(df) * math.tan((low + high) / 2)


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
