"""What a pretraining-budget curve (experiments.curve) runs and chooses: its settings (`Curve`), and its
planner (`CurvePlan`): the jobs wanted given what has finished, each point's lr grid and its extensions
past an edge, the from-scratch plateau, the seeds added where an interval holds zero, and the runs a slot
that would wait may run ahead."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import asdict, dataclass
from typing import Any

from experiments.plan import Job, Plan, lr_name, seeded, steps_of
from experiments.settings import Settings
from experiments.stats import paired

LABELS = 1000  # the label budget of every fine-tuning and from-scratch run
BUDGETS = (600, 2400, 9600)
FINETUNE_LRS = (0.03, 0.06)  # where the full study chose (0.06 at the top of 0.03, 0.06): extends upwards
SCRATCH_LRS = (1e-3, 3e-3)  # likewise 3e-3 at the top
SCRATCH_ARMS = {"scratch": "scratch", "hybrid": "hybrid_scratch"}  # arms trained from scratch: their configs


@dataclass(frozen=True)
class Curve:
    """What a curve runs: `study` holds the splits, configs, seeds, fine-tuning steps and the first lr
    grids (its pretrain_steps is the largest budget); `budgets` the pretraining steps of each point;
    `hybrid` adds the hybrid from scratch over the from-scratch step grid, to its own plateau."""

    study: Settings
    budgets: tuple[int, ...]
    supervised: bool = True
    hybrid: bool = True
    extensions: int = 6
    more_seeds: int = 2  # seeds added to both points of a paired difference whose interval holds zero

    @property
    def extra_seeds(self) -> tuple[int, ...]:
        first = len(self.study.seeds)
        return tuple(range(first, first + self.more_seeds))

    @property
    def scratch_steps(self) -> list[int]:
        """From-scratch step counts: the fine-tuning steps alone, and with each budget's pretraining."""
        tune = self.study.finetune_steps
        return sorted({tune, *(budget + tune for budget in self.budgets)})

    @property
    def from_scratch(self) -> tuple[str, ...]:
        """The arms trained from scratch over the step grid, each to its plateau."""
        return ("scratch", "hybrid") if self.hybrid else ("scratch",)

    def points(self) -> list[str]:
        """Every point that chooses a learning rate: mpp/p<budget>, supervised/p<budget>, scratch/s<steps>
        and hybrid/s<steps>."""
        pretrained = ["mpp", "supervised"] if self.supervised else ["mpp"]
        return [f"{arm}/p{b}" for b in self.budgets for arm in pretrained] + [
            f"{arm}/s{n}" for arm in self.from_scratch for n in self.scratch_steps
        ]

    def as_dict(self) -> dict[str, Any]:
        return {**asdict(self), "study": self.study.as_dict()}


def val_every(steps: int) -> int:
    """The validation interval of a run: at least 25 validations, each at most every max(100, steps/25)
    steps, and one at the last step."""
    return max(d for d in range(1, min(steps, max(100, steps // 25)) + 1) if steps % d == 0)


def pretrain_name(arm: str, budget: int, seed: int) -> str:
    return f"{'pretrain' if arm == 'mpp' else 'supervised'}/p{budget}/seed{seed}"


def fit_name(point: str, lr: float, seed: int) -> str:
    return f"b{LABELS}/{point}/{lr_name(lr)}/seed{seed}"


def next_lr(low: float, high: float) -> float:
    """The next value of a geometric grid beyond `high`, three significant digits."""
    return float(f"{high * high / low:.3g}")


class CurvePlan:
    """The jobs of a curve given what has finished (`ready`), and its choices (`all_choices`)."""

    def __init__(self, curve: Curve) -> None:
        self.c, self.s = curve, curve.study

    def _seeded(self, seed: int, steps: int) -> tuple[str, ...]:
        return seeded(self.s, seed, steps, val_every(steps))

    def pretrain(self, arm: str, budget: int, seed: int) -> Job:
        """MPP pretraining on the unlabelled pool, or supervised pretraining on the labelled images the
        fine-tuning set does not hold (the from-scratch config)."""
        s = self.s
        shards, config = (s.splits.pool, "pretrain") if arm == "mpp" else (s.splits.supervised[LABELS], "scratch")
        train = ("--data.train", shards, *self._seeded(seed, budget))
        return Job(pretrain_name(arm, budget, seed), "fit", s.configs[config], train)

    def pretraining(self) -> list[Job]:
        arms = ("mpp", "supervised") if self.c.supervised else ("mpp",)
        return [self.pretrain(arm, budget, seed) for budget in self.c.budgets for seed in self.s.seeds for arm in arms]

    def fit(self, point: str, lr: float, seed: int) -> Job:
        """A fine-tuning run (mpp/p<budget>, supervised/p<budget>) or a from-scratch run (scratch/s<steps>,
        hybrid/s<steps>)."""
        arm, size = point.split("/")
        steps = int(size[1:]) if arm in SCRATCH_ARMS else self.s.finetune_steps
        overrides = [
            "--data.train", self.s.splits.labels[LABELS], *self._seeded(seed, steps),
            "--model.init_args.optimizer.lr", f"{lr:g}",
        ]  # fmt: skip
        config = SCRATCH_ARMS.get(arm, "finetune")
        if arm not in SCRATCH_ARMS:
            overrides += ["--model.init_args.pretrained", f"{{run:{pretrain_name(arm, int(size[1:]), seed)}}}"]
        return Job(fit_name(point, lr, seed), "fit", self.s.configs[config], tuple(overrides))

    def first_grid(self, point: str) -> tuple[float, ...]:
        return self.s.scratch_lrs if point.split("/")[0] in SCRATCH_ARMS else self.s.finetune_lrs

    def grid(self, point: str, results: dict[str, dict]) -> tuple[list[float], dict[str, Any] | None]:
        """(the learning rates of a point's grid so far, its choice or None): the best final validation
        accuracy with the first seed (ties to the smaller lr); a best at the grid's edge extends the grid
        by the next geometric value on that side, up to `extensions` times, and is chosen after that."""
        lrs, seed = list(self.first_grid(point)), self.s.seeds[0]
        for extended in range(self.c.extensions + 1):
            runs = [results.get(self.fit(point, lr, seed).name) for lr in lrs]
            if any(run is None for run in runs):
                return lrs, None
            val = [run["val_accuracy"] if run["val_accuracy"] is not None else -1.0 for run in runs]  # type: ignore[index]
            best = max(range(len(lrs)), key=lambda i: (val[i], -i))
            edge = best == len(lrs) - 1 or best == 0
            if not edge or extended == self.c.extensions:
                by_lr = {lr_name(lr): v for lr, v in zip(lrs, val)}
                return lrs, {"lr": lrs[best], "seed": seed, "val_accuracy": by_lr, "extended": extended, "edge": edge}
            lrs = [*lrs, next_lr(lrs[-2], lrs[-1])] if best else [next_lr(lrs[1], lrs[0]), *lrs]
        raise AssertionError("unreachable")

    def finals(self, point: str, lr: float, seeds: Sequence[int] | None = None) -> list[Job]:
        return [self.fit(point, lr, seed) for seed in (self.s.seeds if seeds is None else seeds)]

    def pairs(self, choices: dict[str, Any]) -> list[tuple[str, str, str]]:
        """(budget, first point, second point) of every paired difference the curve reports; the hybrid's
        against the ViT's, each at its plateau, has the budget "plateau"."""
        plateau, tune, found = choices.get("scratch/plateau"), self.s.finetune_steps, []
        hybrid = choices.get("hybrid/plateau")
        if plateau and hybrid:
            found.append(("plateau", f"hybrid/s{hybrid['steps']}", f"scratch/s{plateau['steps']}"))
        for budget in self.c.budgets:
            mpp = f"mpp/p{budget}"
            if plateau:
                found.append((str(budget), mpp, f"scratch/s{plateau['steps']}"))
            found.append((str(budget), mpp, f"scratch/s{budget + tune}"))
            if self.c.supervised:
                found.append((str(budget), f"supervised/p{budget}", mpp))
        return found

    def tests(
        self, point: str, choices: dict[str, Any], results: dict[str, dict], seeds: Sequence[int]
    ) -> dict[int, float] | None:
        """{seed: test top-1} of a chosen point's final runs with `seeds`, or None until each has its test."""
        choice = choices.get(point)
        names = [job.name + "/test" for job in self.finals(point, choice["lr"], seeds)] if choice else []
        if not names or any(name not in results for name in names):
            return None
        return {seed: results[name]["test_accuracy"] for seed, name in zip(seeds, names)}

    def widened(self, choices: dict[str, Any], results: dict[str, dict]) -> set[str]:
        """The points that get `more_seeds` seeds: both of every paired difference whose 95% interval over
        the first seeds' test top-1 holds zero (decided on the first seeds only, so it does not move)."""
        found = set()
        for _, first, second in self.pairs(choices):
            a, b = (self.tests(point, choices, results, self.s.seeds) for point in (first, second))
            if a is not None and b is not None:
                diff = paired(a, b)
                if diff.low is not None and diff.high is not None and diff.low <= 0 <= diff.high:
                    found |= {first, second}
        return found

    def seeds(self, point: str, widened: set[str]) -> tuple[int, ...]:
        return self.s.seeds + (self.c.extra_seeds if point in widened else ())

    def plateau(self, results: dict[str, dict], choices: dict[str, Any], arm: str = "scratch") -> dict[str, Any] | None:
        """The step count of a from-scratch arm whose final runs are best on validation (mean over seeds;
        ties to fewer steps), once every step count's finals have finished."""
        means = {}
        for steps in self.c.scratch_steps:
            choice = choices.get(f"{arm}/s{steps}")
            runs = [results.get(job.name) for job in self.finals(f"{arm}/s{steps}", choice["lr"])] if choice else [None]
            if any(run is None for run in runs):
                return None
            means[steps] = sum(run["val_accuracy"] for run in runs) / len(runs)  # type: ignore[index]
        best = max(means, key=lambda n: (means[n], -n))
        return {"steps": best, "lr": choices[f"{arm}/s{best}"]["lr"], "val_accuracy": {str(n): v for n, v in means.items()},
                "edge": best == max(means)}  # fmt: skip

    def all_choices(self, results: dict[str, dict]) -> dict[str, dict[str, Any] | None]:
        choices = {point: self.grid(point, results)[1] for point in self.c.points()}
        for arm in self.c.from_scratch:
            choices[f"{arm}/plateau"] = self.plateau(results, choices, arm)
        return choices

    def evaluations(self, point: str, lr: float, seeds: Sequence[int] | None = None) -> list[Job]:
        """What reads the test set for a chosen point: each final run's test, and the frozen evaluation of
        each pretrained encoder the point fine-tunes."""
        labels, test = self.s.splits.labels[LABELS], self.s.splits.test
        seeds = self.s.seeds if seeds is None else seeds
        jobs = [Job(job.name + "/test", "test", job.config, job.overrides, job.name, reads_test=True)
                for job in self.finals(point, lr, seeds)]  # fmt: skip
        arm, size = point.split("/")
        if arm not in SCRATCH_ARMS:
            for seed in seeds:
                source = pretrain_name(arm, int(size[1:]), seed)
                jobs.append(
                    Job(f"frozen/{source}", "frozen", checkpoint=source, frozen=(labels, test), reads_test=True)
                )
        return jobs

    def order(self) -> list[str]:
        """The points, the cheapest first (a pretrained point counts its pretraining and fine-tuning steps)."""
        return sorted(
            self.c.points(), key=lambda p: int(p.split("/")[1][1:]) + (0 if "/p" in p else -self.s.finetune_steps)
        )

    def jobs(self, results: dict[str, dict]) -> tuple[list[Job], dict[str, dict[str, Any] | None]]:
        """Every job wanted so far, in the order to start them: the cheapest budgets first, the grids of
        each point, then its finals and evaluations once it is chosen."""
        choices = self.all_choices(results)
        widened = self.widened(choices, results)
        wanted = []
        for point in self.order():
            arm, size = point.split("/")
            seeds = self.seeds(point, widened)
            if arm not in SCRATCH_ARMS:
                wanted += [self.pretrain(arm, int(size[1:]), seed) for seed in seeds]
            lrs, choice = self.grid(point, results)
            wanted += [self.fit(point, lr, self.s.seeds[0]) for lr in lrs]
            if choice is not None:
                wanted += self.finals(point, choice["lr"], seeds) + self.evaluations(point, choice["lr"], seeds)
        return list({job.name: job for job in wanted}.values()), choices

    needs = staticmethod(Plan.needs)

    def ready(self, results: dict[str, dict]) -> tuple[list[Job], bool]:
        wanted, choices = self.jobs(results)
        todo = [job for job in wanted if job.name not in results]
        ready = [job for job in todo if all(name in results for name in self.needs(job))]
        return ready, not todo and all(choice is not None for choice in choices.values())

    def spares(self, results: dict[str, dict], running: set[str]) -> list[Job]:
        """Fits to run ahead in a slot that would otherwise wait: for each point whose lr grid so far has
        all started and still runs, the first seed at the lr its next extension would take: on the side
        the grid has extended, or for its first extension on the side the same arm chose at the nearest
        smaller point with a choice (upwards without one). A guess that misses costs one run in a slot
        that was idle: a choice reads only the runs its grid wants, so a run ahead it never wants changes
        nothing (the report names those runs)."""
        choices, seed, found = self.all_choices(results), self.s.seeds[0], []
        for point in self.order():
            lrs, choice = self.grid(point, results)
            names, first = [self.fit(point, lr, seed).name for lr in lrs], list(self.first_grid(point))
            if choice or len(lrs) - len(first) >= self.c.extensions:
                continue
            if all(name in results or name in running for name in names) and any(name in running for name in names):
                up = lrs[-1] > first[-1] or (lrs == first and self.leans_up(point, lrs, choices))
                found.append(self.fit(point, next_lr(lrs[-2], lrs[-1]) if up else next_lr(lrs[1], lrs[0]), seed))
        return [job for job in found if all(name in results for name in self.needs(job))]

    def leans_up(self, point: str, lrs: list[float], choices: dict[str, Any]) -> bool:
        """Whether the lr the arm of `point` chose at its nearest smaller point with a choice is at or above
        the middle of `lrs` (geometrically), or it chose none yet."""
        arm, size = point.split("/")
        smaller = [p for p in self.order() if p.split("/")[0] == arm and int(p.split("/")[1][1:]) < int(size[1:])]
        chosen = [choices[p]["lr"] for p in smaller if choices.get(p)]
        return not chosen or chosen[-1] * chosen[-1] >= lrs[0] * lrs[-1]

    def unwanted(self, results: dict[str, dict]) -> list[str]:
        """The fits run ahead (spares) that their point's grid does not want so far."""
        wanted = {
            self.fit(point, lr, self.s.seeds[0]).name
            for point in self.c.points()
            for lr in self.grid(point, results)[0]
        }
        prefixes = tuple(f"b{LABELS}/{point}/lr" for point in self.c.points())
        return sorted(name for name in results if name.startswith(prefixes) and name.endswith(f"/seed{self.s.seeds[0]}")
                      and name not in wanted)  # fmt: skip


def outline(curve: Curve) -> list[str]:
    """The runs a curve makes with its first grids (extensions add runs of a point's length)."""
    plan, s = CurvePlan(curve), curve.study
    jobs = plan.pretraining()
    for point in curve.points():
        grid = plan.first_grid(point)
        jobs += [plan.fit(point, lr, s.seeds[0]) for lr in grid] + plan.finals(point, grid[0])[1:]
    lines = [
        f"pretraining budgets {list(curve.budgets)}; from-scratch steps {curve.scratch_steps}; seeds {list(s.seeds)}"
    ]
    kinds = ("pretrain", "supervised", *(f"b{LABELS}/{arm}" for arm in ("mpp", "supervised", "scratch", "hybrid")))
    for kind in kinds:
        steps = [steps_of(job) for job in jobs if job.name.startswith(kind + "/")]
        if steps:
            lines.append(f"{kind}: {len(steps)} runs, {sum(steps):,} steps")
    return lines
