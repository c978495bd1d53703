"""Summaries over seeds: mean, sample standard deviation, and the 95% interval of a mean (Student's t),
for a study's accuracies and the paired differences between its arms."""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import asdict, dataclass

from scipy import stats


def t_quantile(p: float, df: int) -> float:
    """The t value with P(T <= t) = p of Student's t with `df` degrees of freedom (scipy.stats.t)."""
    if not 0.5 <= p < 1 or df < 1:
        raise ValueError(f"t_quantile needs 0.5 <= p < 1 and df >= 1, got p={p}, df={df}")
    return float(stats.t.ppf(p, df))


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
