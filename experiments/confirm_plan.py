"""What the screen (experiments.screen_plan) runs once it has ended: the confirmation of the recipes it kept,
on the test set (`ConfirmPlan`, a planner of experiments.runner).

MPP's recipe is pretrained for larger budgets (`Confirm.budgets`) with each seed; at each budget its lr is
chosen on validation with the first seed, from a grid around the lr the screen chose (extended past an
edge as the screen's are). From scratch's recipe runs at the lr the screen chose for it: its first seed is
the screen's own run. Then each final run's test, and each pretraining run's frozen evaluation, reads the
test set once. Where the paired difference of MPP at a budget in `Confirm.widen` and from scratch holds
zero over the first seeds, both get `more_seeds` seeds more."""

from __future__ import annotations

from typing import Any

from experiments.curve_plan import LABELS
from experiments.plan import Job, Plan
from experiments.screen_plan import Confirm, Screen, ScreenPlan
from experiments.stats import paired

Kept = dict[str, tuple[dict[str, str], float]]  # {arm: (the recipe it kept, its lr)}


def kept(screen: ScreenPlan, rows: list[dict[str, Any]]) -> Kept:
    """Each arm's recipe and lr from the rows of an ended screen: each lever's chosen value, and the lr of
    the last lever's (the recipe every value kept so far makes)."""
    found = {}
    for arm in screen.c.levers:
        chosen = [row for row in rows if row["arm"] == arm and row["chosen"]]
        found[arm] = {row["lever"]: row["value"] for row in chosen}, chosen[-1]["lr"]
    return found


class Confirmation:
    """The confirmation's jobs and choices, given the recipes the screen kept. Its points: `mpp/p<budget>`
    and `scratch/s<steps>`."""

    def __init__(self, screen: ScreenPlan, confirm: Confirm, recipes: Kept) -> None:
        self.screen, self.c, self.recipes = screen, confirm, recipes

    def points(self) -> list[str]:
        """The first budget, from scratch, then the larger budgets: the comparison the widening reads first."""
        first, *more = (f"mpp/p{budget}" for budget in self.c.budgets)
        return [first, f"scratch/s{self.recipes['scratch'][0]['steps']}", *more]

    def choice(self, point: str, results: dict[str, dict], wanted: list[Job]) -> dict[str, Any] | None:
        """A point's lr: MPP's from its grid at its budget (adding the grid's jobs to `wanted`), from
        scratch's the screen's."""
        arm, size = point.split("/")
        recipe, lr = self.recipes[arm]
        if arm == "scratch":
            return {"lr": lr, "steps": int(size[1:])}
        return self.screen.candidate(arm, recipe, lr, results, wanted, budget=int(size[1:]))

    def finals(self, point: str, lr: float, seeds: tuple[int, ...]) -> list[Job]:
        arm, size = point.split("/")
        budget = int(size[1:]) if arm == "mpp" else None
        return [self.screen.fit(arm, self.recipes[arm][0], lr, seed, budget) for seed in seeds]

    def pretraining(self, point: str, seeds: tuple[int, ...]) -> list[Job]:
        arm, size = point.split("/")
        return (
            [self.screen.pretrain(self.recipes[arm][0], int(size[1:]), seed) for seed in seeds] if arm == "mpp" else []
        )

    def evaluations(self, point: str, lr: float, seeds: tuple[int, ...] | None = None) -> list[Job]:
        """What reads the test set for a chosen point: each final run's test, and the frozen evaluation of
        each pretraining run the point fine-tunes."""
        seeds = self.c.seeds if seeds is None else seeds
        splits = self.screen.s.splits
        tests = [Job(job.name + "/test", "test", job.config, job.overrides, job.name, reads_test=True)
                 for job in self.finals(point, lr, seeds)]  # fmt: skip
        frozen = (splits.labels[LABELS], splits.test)
        return tests + [Job(f"frozen/{job.name}", "frozen", checkpoint=job.name, frozen=frozen, reads_test=True)
                        for job in self.pretraining(point, seeds)]  # fmt: skip

    def seeds(self, point: str, widened: set[str]) -> tuple[int, ...]:
        first = self.c.seeds
        return first + (tuple(range(max(first) + 1, max(first) + 1 + self.c.more_seeds)) if point in widened else ())

    def tests(self, point: str, choice: dict[str, Any] | None, results: dict[str, dict]) -> dict[int, float] | None:
        """{seed: test top-1} of a chosen point's first seeds, or None until each has its test."""
        names = [job.name + "/test" for job in self.finals(point, choice["lr"], self.c.seeds)] if choice else []
        if not names or any(name not in results for name in names):
            return None
        return {seed: results[name]["test_accuracy"] for seed, name in zip(self.c.seeds, names)}

    def widened(self, choices: dict[str, Any], results: dict[str, dict]) -> set[str]:
        """Both points of every difference at a budget in `widen` whose 95% interval over the first seeds
        holds zero (decided on the first seeds only, so it does not move)."""
        scratch, found = self.points()[1], set()
        for budget in self.c.widen:
            mpp = f"mpp/p{budget}"
            a, b = self.tests(mpp, choices.get(mpp), results), self.tests(scratch, choices.get(scratch), results)
            if a is not None and b is not None:
                diff = paired(a, b)
                if diff.low is not None and diff.high is not None and diff.low <= 0 <= diff.high:
                    found |= {mpp, scratch}
        return found

    def jobs(self, results: dict[str, dict], wanted: list[Job]) -> dict[str, dict[str, Any] | None]:
        """Each point's choice, adding every job wanted so far to `wanted`: per point its pretraining runs,
        its grid, then once chosen its final runs and their evaluations."""
        choices = {point: self.choice(point, results, []) for point in self.points()}
        widened = self.widened(choices, results)
        for point in self.points():
            seeds = self.seeds(point, widened)
            wanted += self.pretraining(point, seeds)
            choice = self.choice(point, results, wanted)
            if choice is not None:
                wanted += self.finals(point, choice["lr"], seeds) + self.evaluations(point, choice["lr"], seeds)
        return choices


class ConfirmPlan:
    """The screen's planner until the screen has ended, then the confirmation of what it kept."""

    def __init__(self, screen: Screen) -> None:
        self.screen, self.c = ScreenPlan(screen), screen.confirm

    def confirmation(self, results: dict[str, dict]) -> Confirmation | None:
        _, rows, ended = self.screen.screen(results)
        return Confirmation(self.screen, self.c, kept(self.screen, rows)) if ended else None

    def wanted(self, results: dict[str, dict]) -> tuple[list[Job], dict[str, dict[str, Any] | None], bool]:
        """(every job wanted so far, the confirmation's choices, whether the screen has ended)."""
        wanted, _, ended = self.screen.screen(results)
        confirmation = self.confirmation(results) if ended else None
        choices = confirmation.jobs(results, wanted) if confirmation else {}
        return list({job.name: job for job in wanted}.values()), choices, ended

    def all_choices(self, results: dict[str, dict]) -> dict[str, dict[str, Any] | None]:
        return {**self.screen.all_choices(results), **self.wanted(results)[1]}

    def ready(self, results: dict[str, dict]) -> tuple[list[Job], bool]:
        wanted, choices, ended = self.wanted(results)
        todo = [job for job in wanted if job.name not in results]
        ready = [job for job in todo if all(name in results for name in Plan.needs(job))]
        return ready, ended and not todo and all(choice is not None for choice in choices.values())

    def spares(self, results: dict[str, dict], running: set[str]) -> list[Job]:
        return []
