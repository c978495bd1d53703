"""How long a study's jobs take, from the ones that have finished: so that an invocation given a time
(`--within`) starts only the runs that can finish in it, longest first, instead of a run it would leave
half done.

A fit's estimate comes from the finished fits of the same config with the step count nearest its own:
the median of their seconds per step (an attempt that resumed counts the steps it ran), times the steps
the fit has left (a run validates about 25 times whatever its length, so seconds per step differ
between short and long runs); an evaluation's is the median wall time of its kind, less any fit it made
again first. A test that must make its fit again (restored without weights) adds that fit's estimate.
A job like none that has finished has no estimate and counts as fitting. And how long a study has
taken: the wall-clock time its invocations cover, those that ran side by side counted once.
"""

from __future__ import annotations

from collections.abc import Callable
from math import log
from statistics import median
from typing import Any

from experiments.plan import Job, steps_of


def estimate(job: Job, results: dict[str, dict], done: int = 0) -> float | None:
    """Seconds `job` should take, `done` of its steps made, judged by `results` (None when nothing like it
    has finished)."""
    if job.kind == "fit":
        steps = steps_of(job)
        alike = []  # (steps, seconds per step run) of the finished fits of its config
        for r in results.values():
            ran = r.get("steps", 0) - r.get("resumed_from", 0)
            if r["kind"] == "fit" and r.get("config") == job.config and ran > 0:
                alike.append((r["steps"], r["wall_seconds"] / ran))
        if not alike:
            return None
        nearest = min(abs(log(n / steps)) for n, _ in alike)
        return median(rate for n, rate in alike if abs(log(n / steps)) == nearest) * (steps - done)
    own = [
        r["wall_seconds"] - r.get("remade", {}).get("wall_seconds", 0.0)
        for r in results.values()
        if r["kind"] == job.kind
    ]
    return median(own) if own else None


def fitting(
    jobs: list[Job],
    results: dict[str, dict],
    seconds: float,
    done: Callable[[Job], int] = lambda job: 0,
    first: Callable[[Job], Job | None] = lambda job: None,
) -> list[Job]:
    """The jobs whose estimate is within `seconds` (`done(job)`: the steps a fit has made; `first(job)`: a
    fit that `job` must make again before it runs, or None), longest first (unknown ones last, in their
    order)."""

    def cost(job: Job) -> float | None:
        own, before = estimate(job, results, done(job)), first(job)
        if own is None or before is None:
            return own
        extra = estimate(before, results, done(before))
        return None if extra is None else own + extra

    known = [(cost(job), i, job) for i, job in enumerate(jobs)]
    fits = [(s if s is not None else -1.0, i, job) for s, i, job in known if s is None or s <= seconds]
    return [job for _, _, job in sorted(fits, key=lambda item: (-item[0], item[1]))]


def elapsed(attempts: list[dict[str, Any]]) -> float:
    """The seconds covered by at least one invocation ({"start", "end"}; an end of None is its start)."""
    total, reached = 0.0, float("-inf")
    for start, end in sorted((a["start"], a["end"] or a["start"]) for a in attempts):
        total += max(0.0, end - max(start, reached))
        reached = max(reached, end)
    return total
