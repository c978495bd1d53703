"""What a screen of levers (experiments.screen) runs and keeps: the levers (`all_levers`), its settings
(`Screen`) and its planner (`ScreenPlan`): each value a recipe with its own lr grid, a lever's winner the
recipe of the next, the jobs wanted given what has finished."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from typing import Any

from experiments.curve_plan import LABELS, val_every
from experiments.plan import Job, Plan, lr_name, seeded
from experiments.settings import Settings

M = "--model.init_args."
# Every run in float32, whichever CPU it lands on (bf16-mixed where the CPU has bf16 otherwise): a value's
# lead must not be a machine's, and a screen may go on over sessions on different machines.
PRECISION = ("--trainer.precision", "32-true")


@dataclass(frozen=True)
class Lever:
    """A choice a recipe makes: its values (the first is today's), where it applies (`pretrain`: MPP's
    pretraining run; `fit`: the fine-tuning or from-scratch run) and its overrides for a value."""

    name: str
    values: tuple[str, ...]
    part: str
    flags: Callable[[str], tuple[str, ...]] = lambda value: ()
    ordered: bool = False  # the next value is tried only while each beat the one before
    lr: dict[str, float] = field(default_factory=dict)  # a value's own lr centre (another optimiser)


def optimiser(value: str) -> tuple[str, ...]:
    """SGD as the paper fine-tunes, or AdamW with weight decay 0.05 as MAE fine-tunes."""
    return (M + "optimizer.name", value) + ((M + "optimizer.weight_decay", "0.05") if value == "adamw" else ())


def target(value: str) -> tuple[str, ...]:
    """The 3-bit mean colour of a patch, or the paper's 4 x 4 downsized patch in 3-bit colours."""
    return (M + "target.kind", value) + ((M + "target.cells", "4") if value == "downsized_colour" else ())


def all_levers(quick: bool) -> dict[str, tuple[Lever, ...]]:
    """{arm: its levers in the order the screen takes them}."""
    drop_path = Lever("drop_path", ("0", "0.1"), "fit", lambda v: (M + "encoder.drop_path", v))
    mpp = (
        Lever("ratio", ("0.5", "0.75"), "pretrain", lambda v: (M + "corruption.ratio", v)),
        Lever("layout", ("scattered", "blocks"), "pretrain", lambda v: (M + "corruption.layout", v)),
        Lever("target", ("mean_colour", "downsized_colour"), "pretrain", target),
        Lever("layer_decay", ("1", "0.85", "0.75", "0.65"), "fit", lambda v: (M + "optimizer.layer_decay", v)),
        Lever("optimizer", ("sgd", "adamw"), "fit", optimiser, lr={"adamw": 1e-3}),
        drop_path,
        Lever("steps", ("4", "8") if quick else ("500", "1100", "2900", "10100"), "fit", ordered=True),
    )
    scratch = (drop_path, Lever("steps", ("8", "16") if quick else ("10100", "20100"), "fit", ordered=True))
    if quick:  # a pretraining lever and the steps; from scratch, a flag and the steps
        return {"mpp": (mpp[0], mpp[-1]), "scratch": scratch}
    return {"mpp": mpp, "scratch": scratch}


@dataclass(frozen=True)
class Confirm:
    """What confirms the recipes a screen kept (experiments.confirm_plan): MPP's pretraining budgets, the
    seeds of every point, and the seeds added to both points of a difference with from scratch whose 95%
    interval holds zero at a budget in `widen`."""

    budgets: tuple[int, ...] = (9600, 38400)
    seeds: tuple[int, ...] = (0, 1, 2)
    more_seeds: int = 2
    widen: tuple[int, ...] = (9600,)


@dataclass(frozen=True)
class Screen:
    """What a screen runs: the study's splits, configs and overrides (seed: its first), MPP's pretraining
    steps, each arm's first lr, the lr grid (`points` values a factor `factor` apart, `extensions`), and
    what confirms its recipes once it has ended."""

    study: Settings
    pretrain_steps: int
    quick: bool
    lrs: dict[str, float]
    points: int = 3
    factor: float = 2.0
    extensions: int = 2
    confirm: Confirm = Confirm()

    @property
    def levers(self) -> dict[str, tuple[Lever, ...]]:
        return all_levers(self.quick)

    def as_dict(self) -> dict[str, Any]:
        levers = {arm: [{"name": lever.name, "values": list(lever.values)} for lever in found]
                  for arm, found in self.levers.items()}  # fmt: skip
        return {**asdict(self), "study": self.study.as_dict(), "levers": levers}


def rounded(value: float) -> float:
    return float(f"{value:.3g}")


class ScreenPlan:
    """The jobs of a screen given what has finished, and its choices: the planner of experiments.runner."""

    def __init__(self, screen: Screen) -> None:
        self.c, self.s = screen, screen.study

    @staticmethod
    def key(recipe: dict[str, str], levers: tuple[Lever, ...], part: str) -> str:
        """A recipe's name for one part: its values other than today's, or `paper`."""
        changed = [f"{lever.name}={recipe[lever.name]}" for lever in levers
                   if lever.part == part and recipe[lever.name] != lever.values[0]]  # fmt: skip
        return ",".join(changed) or "paper"

    def pretrain(self, recipe: dict[str, str], budget: int | None = None, seed: int | None = None) -> Job:
        """MPP's pretraining with `recipe` for `budget` steps (default the screen's) and `seed` (default its first)."""
        levers, seed = self.c.levers["mpp"], self.s.seeds[0] if seed is None else seed
        budget = budget or self.c.pretrain_steps
        flags = [flag for lever in levers if lever.part == "pretrain" for flag in lever.flags(recipe[lever.name])]
        overrides = ("--data.train", self.s.splits.pool, *self._seeded(seed, budget), *flags)
        name = f"pretrain/p{budget}/{self.key(recipe, levers, 'pretrain')}/seed{seed}"
        return Job(name, "fit", self.s.configs["pretrain"], overrides)

    def _seeded(self, seed: int, steps: int) -> tuple[str, ...]:
        return seeded(self.s, seed, steps, val_every(steps))

    def fit(
        self, arm: str, recipe: dict[str, str], lr: float, seed: int | None = None, budget: int | None = None
    ) -> Job:
        """A fine-tuning (mpp) or from-scratch run of `recipe` with `lr` and `seed` (default the first); MPP's
        pretrained for `budget` steps (default the screen's, which its name leaves out)."""
        levers, seed = self.c.levers[arm], self.s.seeds[0] if seed is None else seed
        flags = [flag for lever in levers if lever.part == "fit" for flag in lever.flags(recipe[lever.name])]
        overrides = [
            "--data.train", self.s.splits.labels[LABELS], *self._seeded(seed, int(recipe["steps"])),
            M + "optimizer.lr", f"{lr:g}", *flags,
        ]  # fmt: skip
        name = f"b{LABELS}/{arm}/{self.key(recipe, levers, 'fit')}/{lr_name(lr)}/seed{seed}"
        if arm == "mpp":
            pretrain = self.pretrain(recipe, budget, seed).name
            longer = f"p{budget}/" if budget and budget != self.c.pretrain_steps else ""
            name = f"b{LABELS}/mpp/{longer}{pretrain.split('/')[2]}/{name.split('/', 2)[2]}"
            overrides += [M + "pretrained", f"{{run:{pretrain}}}"]
        return Job(name, "fit", self.s.configs["finetune" if arm == "mpp" else "scratch"], tuple(overrides))

    def candidate(
        self,
        arm: str,
        recipe: dict[str, str],
        centre: float,
        results: dict[str, dict],
        wanted: list[Job],
        budget: int | None = None,
    ) -> dict[str, Any] | None:
        """A recipe's lr choice (the best validation top-1 of its grid, first seed; ties to the smaller lr),
        MPP's pretrained for `budget` steps, adding the jobs it needs to `wanted`; None until its grid has
        finished."""
        half = (self.c.points - 1) / 2
        lrs = [rounded(centre * self.c.factor ** (i - half)) for i in range(self.c.points)]
        if arm == "mpp":
            wanted.append(self.pretrain(recipe, budget))
        for extended in range(self.c.extensions + 1):
            jobs = [self.fit(arm, recipe, lr, budget=budget) for lr in lrs]
            wanted += jobs
            if any(job.name not in results for job in jobs):
                return None
            val = [results[job.name]["val_accuracy"] or 0.0 for job in jobs]
            best = max(range(len(lrs)), key=lambda i: (val[i], -i))
            edge = len(lrs) > 1 and best in (0, len(lrs) - 1)
            if not edge or extended == self.c.extensions:
                grid = {lr_name(lr): v for lr, v in zip(lrs, val)}
                return {"lr": lrs[best], "val_accuracy": val[best], "grid": grid, "edge": edge}
            lrs = [*lrs, rounded(lrs[-1] * self.c.factor)] if best else [rounded(lrs[0] / self.c.factor), *lrs]
        raise AssertionError("unreachable")

    def walk(self, arm: str, results: dict[str, dict], wanted: list[Job]) -> tuple[list[dict[str, Any]], bool]:
        """(a row per value tried so far, whether the arm's screen has ended), adding its jobs to `wanted`:
        the levers in order, each value a candidate, each lever's winner the recipe of the next."""
        levers = self.c.levers[arm]
        recipe = {lever.name: lever.values[0] for lever in levers}
        current = self.candidate(arm, recipe, self.c.lrs[arm], results, wanted)
        rows: list[dict[str, Any]] = []
        for lever in levers:
            if current is None:  # a pretraining lever's runs need no choice: they may run meanwhile
                wanted += [
                    self.pretrain({**recipe, lever.name: v}) for v in lever.values[1:] if lever.part == "pretrain"
                ]
                return rows, False
            values = lever.values
            tried: dict[str, dict[str, Any] | None] = {values[0]: current}
            for i, value in enumerate(values[1:], start=1):
                if lever.ordered and i >= 2 and not beats(tried[values[i - 1]], tried[values[i - 2]]):
                    break
                centre = lever.lr.get(value, current["lr"])
                tried[value] = self.candidate(arm, {**recipe, lever.name: value}, centre, results, wanted)
                if lever.ordered and tried[value] is None:
                    break  # whether to go on waits for it
            found = {value: choice for value, choice in tried.items() if choice is not None}
            if len(found) < len(tried):
                return rows + [{"arm": arm, "lever": lever.name, "value": v, **c, "chosen": False}
                               for v, c in found.items()], False  # fmt: skip
            chosen = max(found, key=lambda v: (found[v]["val_accuracy"], -values.index(v)))
            rows += [{"arm": arm, "lever": lever.name, "value": value, **choice, "chosen": value == chosen}
                     for value, choice in found.items()]  # fmt: skip
            recipe, current = {**recipe, lever.name: chosen}, found[chosen]
        return rows, current is not None

    def screen(self, results: dict[str, dict]) -> tuple[list[Job], list[dict[str, Any]], bool]:
        """(every job wanted so far, MPP's first, each row tried so far, whether the screen has ended)."""
        wanted: list[Job] = []
        rows: list[dict[str, Any]] = []
        ended = True
        for arm in self.c.levers:
            found, done = self.walk(arm, results, wanted)
            rows, ended = rows + found, ended and done
        return list({job.name: job for job in wanted}.values()), rows, ended

    def all_choices(self, results: dict[str, dict]) -> dict[str, dict[str, Any] | None]:
        """{arm/lever: the value kept and its lr} for each lever whose values have all been tried."""
        _, rows, _ = self.screen(results)
        chosen = {f"{row['arm']}/{row['lever']}": row for row in rows if row["chosen"]}
        return {
            key: {"value": row["value"], "lr": row["lr"], "val_accuracy": row["grid"]} for key, row in chosen.items()
        }

    def ready(self, results: dict[str, dict]) -> tuple[list[Job], bool]:
        wanted, _, ended = self.screen(results)
        todo = [job for job in wanted if job.name not in results]
        return [job for job in todo if all(name in results for name in Plan.needs(job))], ended and not todo

    def spares(self, results: dict[str, dict], running: set[str]) -> list[Job]:
        return []


def beats(a: dict[str, Any] | None, b: dict[str, Any] | None) -> bool:
    return a is not None and b is not None and a["val_accuracy"] > b["val_accuracy"]
