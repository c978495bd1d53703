"""What the screen (experiments.screen_plan) runs to confirm the recipes it keeps, on the test set
(`ConfirmPlan`, a planner of experiments.runner).

MPP's recipe is pretrained for larger budgets (`Confirm.budgets`) with each seed; at each budget its lr is
chosen on validation with the first seed, from a grid around the lr the screen chose (extended past an
edge as the screen's are). From scratch's recipe runs at the lr the screen chose for it: its first seed is
the screen's own run. Then each final run's test, and each pretraining run's frozen evaluation, reads the
test set once. Where the paired difference of MPP at a budget in `Confirm.widen` and from scratch holds
zero over the first seeds, both get `more_seeds` seeds more.

The screen's own runs go first; so that no slot waits for them, what the confirmation will run anyway
starts as soon as it is known: MPP's longer pretraining once its pretraining levers are chosen (the levers
after them change only the fine-tuning), an arm's grids and final runs once its screen has ended. Nothing
reads the test set before the whole screen has ended."""

from __future__ import annotations

from typing import Any

from experiments.curve_plan import LABELS
from experiments.plan import Job, Plan
from experiments.screen_plan import Confirm, Screen, ScreenPlan
from experiments.stats import paired

Kept = dict[str, tuple[dict[str, str], float]]  # {arm: (the recipe it kept, its lr)}


class Confirmation:
    """The confirmation's jobs and choices, given the recipes kept so far: `recipes` of the arms whose screen
    has ended, `pretraining` the recipe whose pretraining values are all chosen (None before), `ended` whether
    the whole screen has. Its points: `mpp/p<budget>` and `scratch/s<steps>`."""

    def __init__(
        self, screen: ScreenPlan, confirm: Confirm, recipes: Kept, pretraining: dict[str, str] | None, ended: bool
    ) -> None:
        self.screen, self.c, self.recipes, self.pretrained, self.ended = screen, confirm, recipes, pretraining, ended

    def scratch(self) -> str | None:
        return f"scratch/s{self.recipes['scratch'][0]['steps']}" if "scratch" in self.recipes else None

    def points(self) -> list[str]:
        """The first budget, from scratch, then the larger budgets (the comparison the widening reads first),
        of the arms whose screen has ended."""
        first, *more = (f"mpp/p{budget}" for budget in self.c.budgets) if "mpp" in self.recipes else ("",)
        return [point for point in (first, self.scratch(), *more) if point]

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
        recipe = self.pretrained if arm == "mpp" else None
        return [self.screen.pretrain(recipe, int(size[1:]), seed) for seed in seeds] if recipe else []

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

    def tests(self, point: str | None, choices: dict[str, Any], results: dict[str, dict]) -> dict[int, float] | None:
        """{seed: test top-1} of a chosen point's first seeds, or None until each has its test."""
        choice = choices.get(point) if point else None
        names = [job.name + "/test" for job in self.finals(point, choice["lr"], self.c.seeds)] if choice else []  # type: ignore[arg-type]
        if not names or any(name not in results for name in names):
            return None
        return {seed: results[name]["test_accuracy"] for seed, name in zip(self.c.seeds, names)}

    def widened(self, choices: dict[str, Any], results: dict[str, dict]) -> set[str]:
        """Both points of every difference at a budget in `widen` whose 95% interval over the first seeds
        holds zero (decided on the first seeds only, so it does not move)."""
        found: set[str] = set()
        for budget in self.c.widen:
            mpp, scratch = f"mpp/p{budget}", self.scratch()
            a, b = self.tests(mpp, choices, results), self.tests(scratch, choices, results)
            if a is not None and b is not None and scratch:
                diff = paired(a, b)
                if diff.low is not None and diff.high is not None and diff.low <= 0 <= diff.high:
                    found |= {mpp, scratch}
        return found

    def jobs(self, results: dict[str, dict], wanted: list[Job]) -> dict[str, dict[str, Any] | None]:
        """Each point's choice, adding every job wanted so far to `wanted`: MPP's pretraining with the first
        seeds, then per point its grid, once chosen its final runs and, once the screen has ended, their
        evaluations (and the seeds a widening adds)."""
        first = [f"mpp/p{budget}" for budget in self.c.budgets]
        wanted += [job for point in first for job in self.pretraining(point, self.c.seeds)]
        choices = {point: self.choice(point, results, []) for point in self.points()}
        widened = self.widened(choices, results)
        for point in self.points():
            seeds = self.seeds(point, widened)
            wanted += self.pretraining(point, seeds)
            choice = self.choice(point, results, wanted)
            if choice is not None:
                wanted += self.finals(point, choice["lr"], seeds)
                wanted += self.evaluations(point, choice["lr"], seeds) if self.ended else []
        return choices


def kept(screen: ScreenPlan, rows: list[dict[str, Any]]) -> tuple[Kept, dict[str, str] | None]:
    """From the rows of a screen so far (ScreenPlan.screen): (each arm's recipe and lr, of the arms whose
    every lever has chosen: each lever's value and the lr of the last lever's, which the recipe of every
    value kept makes; MPP's recipe once each pretraining lever has chosen, or None)."""
    found: Kept = {}
    pretraining = None
    for arm, levers in screen.c.levers.items():
        chosen = {row["lever"]: row for row in rows if row["arm"] == arm and row["chosen"]}
        if all(lever.name in chosen for lever in levers):
            found[arm] = {lever.name: chosen[lever.name]["value"] for lever in levers}, chosen[levers[-1].name]["lr"]
        if arm == "mpp" and all(lever.name in chosen for lever in levers if lever.part == "pretrain"):
            pretraining = {lever.name: chosen[lever.name]["value"] if lever.name in chosen else lever.values[0]
                           for lever in levers}  # fmt: skip
    return found, pretraining


class ConfirmPlan:
    """The screen's planner, then (and, where it knows what it will run, beside it) the confirmation of what
    the screen kept."""

    def __init__(self, screen: Screen) -> None:
        self.screen, self.c = ScreenPlan(screen), screen.confirm

    def confirmation(self, results: dict[str, dict], rows: list[dict[str, Any]] | None = None) -> Confirmation | None:
        """What the confirmation knows it will run so far, given the screen's rows so far (made from
        `results` where not given); None before it knows anything."""
        recipes, pretraining = kept(self.screen, self.screen.screen(results)[1] if rows is None else rows)
        ended = set(recipes) == set(self.screen.c.levers)
        return Confirmation(self.screen, self.c, recipes, pretraining, ended) if recipes or pretraining else None

    def wanted(self, results: dict[str, dict]) -> tuple[list[Job], dict[str, dict[str, Any] | None], bool]:
        """(every job wanted so far, the screen's before the confirmation's; the confirmation's choices;
        whether the screen has ended)."""
        wanted, rows, ended = self.screen.screen(results)
        confirmation = self.confirmation(results, rows)
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
