"""Which jobs a study runs, and in which order: every choice (each arm's learning rate, from its grid,
with the first seed) is made on a validation split held out from the training pool; the test set is read
only after every choice is made, once per final run (and once per frozen pretrained encoder)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from experiments.settings import ARM_CONFIGS, DEFAULT_VARIANT, PRETRAINED, VARIANTS, Settings


@dataclass(frozen=True)
class Job:
    """One unit of work in a folder of its own: `fit` (an mpp fit, then optionally a frozen evaluation
    of its encoder), `test` (mpp test of a fitted run and a frozen evaluation of its encoder), or
    `frozen` (a frozen evaluation of a checkpoint). `reads_test`: it reads the test set. `as_configured`:
    the run keeps its config's logger and callbacks (W&B, pictures, checkpoints, progress bar) and prints
    to the terminal, as a user's run does (experiments.compare); otherwise it is the studies' quiet run,
    logged to a CSV file and to its log.txt."""

    name: str
    kind: str
    config: str = ""
    overrides: tuple[str, ...] = ()
    checkpoint: str = ""  # test, frozen: the run (job name) whose last checkpoint is evaluated, or a .ckpt path
    frozen: tuple[str, str] | None = None  # (labelled train shards, test shards) of a frozen evaluation
    reads_test: bool = False
    as_configured: bool = False
    test: str = ""  # a test's shards, if not the study's test split


def steps_of(job: Job) -> int:
    """The optimiser steps a job takes: a fit's max_steps, 0 for an evaluation."""
    return int(job.overrides[job.overrides.index("--trainer.max_steps") + 1]) if job.kind == "fit" else 0


def kind_of(job: Job) -> str:
    """What a job counts as in wall times and outlines: pretrain, supervised, fine-tuning, test or frozen."""
    if job.kind != "fit":
        return job.kind
    first = job.name.split("/")[0]
    return "fine-tuning" if first.startswith("b") else first


def lr_name(lr: float) -> str:
    return f"lr{lr:g}"


def fit_name(budget: int, arm: str, lr: float, seed: int) -> str:
    return f"b{budget}/{arm}/{lr_name(lr)}/seed{seed}"


def pretrain_name(variant: str, seed: int) -> str:
    return f"pretrain/{variant}/seed{seed}"


def supervised_name(budget: int, seed: int) -> str:
    return f"supervised/b{budget}/seed{seed}"


def hybrid_pretrain_name(seed: int) -> str:
    return f"pretrain/hybrid/seed{seed}"


def seeded(s: Settings, seed: int, steps: int, val_every: int) -> tuple[str, ...]:
    """A fit's overrides for its seed and length: validation on the held-out split every `val_every`
    steps, no test set, and the study's overrides for every fit."""
    return (
        "--seed_everything", str(seed), "--data.seed", str(seed), "--trainer.max_steps", str(steps),
        "--data.val", s.splits.val, "--data.test", "null", "--trainer.val_check_interval", str(val_every),
        *s.overrides,
    )  # fmt: skip


class Plan:
    """Which jobs a study runs, given what has finished: `ready(results)` lists the jobs whose inputs
    exist, in the order to start them; choices are made as soon as a grid is complete."""

    def __init__(self, settings: Settings) -> None:
        self.s = settings

    def _seeded(self, seed: int, steps: int) -> tuple[str, ...]:
        return seeded(self.s, seed, steps, self.s.val_every)

    def pretraining(self) -> list[Job]:
        """MPP pretraining: the default objective with every seed, the ablation's with the first few;
        each frozen encoder is scored on the validation split (the ablation's yardstick)."""
        s = self.s
        jobs = []
        for variant in VARIANTS:
            if variant.name != DEFAULT_VARIANT and variant.name not in s.ablation:
                continue
            seeds = s.seeds if variant.name == DEFAULT_VARIANT else s.seeds[: s.ablation_seeds]
            for seed in seeds:
                overrides = (
                    "--data.train", s.splits.pool, *self._seeded(seed, s.pretrain_steps), *variant.overrides,
                )  # fmt: skip
                frozen = (s.splits.labels[s.budgets[0]], s.splits.val)
                jobs.append(
                    Job(pretrain_name(variant.name, seed), "fit", s.configs["pretrain"], overrides, frozen=frozen)
                )
        if "hybrid_mpp" in s.selected_arms:
            for seed in s.seeds:
                overrides = ("--data.train", s.splits.pool, *self._seeded(seed, s.pretrain_steps))
                frozen = (s.splits.labels[s.budgets[0]], s.splits.val)
                jobs.append(
                    Job(hybrid_pretrain_name(seed), "fit", s.configs["hybrid_pretrain"], overrides, frozen=frozen)
                )
        for budget, shards in sorted(s.splits.supervised.items() if "supervised" in s.selected_arms else []):
            for seed in s.seeds:
                overrides = ("--data.train", shards, *self._seeded(seed, s.pretrain_steps))
                jobs.append(Job(supervised_name(budget, seed), "fit", s.configs["scratch"], overrides))
        return jobs

    def fit(self, budget: int, arm: str, lr: float, seed: int) -> Job:
        """A fine-tuning (or from-scratch) run of an arm."""
        s = self.s
        steps = s.pretrain_steps + s.finetune_steps if arm == "matched" else s.finetune_steps
        overrides = [
            "--data.train", s.splits.labels[budget], *self._seeded(seed, steps),
            "--model.init_args.optimizer.lr", f"{lr:g}",
        ]  # fmt: skip
        if arm in PRETRAINED:
            overrides += ["--model.init_args.pretrained", f"{{run:{self.source(budget, arm, seed)}}}"]
        return Job(fit_name(budget, arm, lr, seed), "fit", s.configs[ARM_CONFIGS[arm]], tuple(overrides))

    @staticmethod
    def source(budget: int, arm: str, seed: int) -> str:
        """The pretraining run a pretrained arm's run with `seed` fine-tunes."""
        if arm == "supervised":
            return supervised_name(budget, seed)
        return hybrid_pretrain_name(seed) if arm == "hybrid_mpp" else pretrain_name(DEFAULT_VARIANT, seed)

    def pretrained_sources(self, budget: int) -> dict[str, list[str]]:
        """{pretrained arm: its pretraining runs, one per seed} for the arms of a budget."""
        return {arm: [self.source(budget, arm, seed) for seed in self.s.seeds]
                for arm in self.s.arms(budget) if arm in PRETRAINED}  # fmt: skip

    def fits(self) -> list[Job]:
        """Every fit the study may run, whichever learning rates are chosen."""
        s = self.s
        return self.pretraining() + [
            self.fit(budget, arm, lr, seed)
            for budget in s.budgets
            for arm in s.arms(budget)
            for lr in s.lrs(arm)
            for seed in s.seeds
        ]

    @staticmethod
    def needs(job: Job) -> list[str]:
        """The jobs whose checkpoints a job reads (a checkpoint named by its path is no job's)."""
        named = [arg[5:-1] for arg in job.overrides if arg.startswith("{run:")]
        return named + ([job.checkpoint] if job.checkpoint and not job.checkpoint.endswith(".ckpt") else [])

    def grid(self, budget: int, arm: str) -> list[Job]:
        return [self.fit(budget, arm, lr, self.s.seeds[0]) for lr in self.s.lrs(arm)]

    def choose(self, budget: int, arm: str, results: dict[str, dict]) -> dict[str, Any] | None:
        """The arm's learning rate: the best final validation accuracy of its grid (first seed); ties go
        to the earlier grid value. None until the whole grid has finished."""
        grid = self.grid(budget, arm)
        if any(job.name not in results for job in grid):
            return None
        val = {lr_name(lr): results[job.name]["val_accuracy"] for lr, job in zip(self.s.lrs(arm), grid)}
        best = max(range(len(grid)), key=lambda i: (val[lr_name(self.s.lrs(arm)[i])], -i))
        return {"val_accuracy": val, "lr": self.s.lrs(arm)[best], "seed": self.s.seeds[0]}

    def finals(self, budget: int, arm: str, lr: float) -> list[Job]:
        return [self.fit(budget, arm, lr, seed) for seed in self.s.seeds]

    def all_choices(self, results: dict[str, dict]) -> dict[str, dict[str, Any] | None]:
        return {
            f"b{budget}/{arm}": self.choose(budget, arm, results)
            for budget in self.s.budgets
            for arm in self.s.arms(budget)
        }

    def evaluations(self, choices: dict[str, dict[str, Any]]) -> list[Job]:
        """What reads the test set, once every choice is made: each final run's test accuracy and frozen
        scores, and the frozen scores of every pretrained encoder the final runs started from."""
        s, jobs = self.s, []
        for budget in s.budgets:
            labels = s.splits.labels[budget]
            for arm in s.arms(budget):
                for job in self.finals(budget, arm, choices[f"b{budget}/{arm}"]["lr"]):
                    config, overrides = job.config, job.overrides
                    jobs.append(
                        Job(job.name + "/test", "test", config, overrides, job.name, (labels, s.splits.test), True)
                    )
            for source in (name for names in self.pretrained_sources(budget).values() for name in names):
                jobs.append(
                    Job(
                        f"frozen/b{budget}/{source}",
                        "frozen",
                        checkpoint=source,
                        frozen=(labels, s.splits.test),
                        reads_test=True,
                    )
                )
        return jobs

    def spares(self, results: dict[str, dict], running: set[str]) -> list[Job]:
        """Nothing to run ahead: the study's grids are fixed, so every job it may want is ready or waits
        for a run that is running."""
        return []

    def ready(self, results: dict[str, dict]) -> tuple[list[Job], bool]:
        """(jobs to start now in this order, whether every job of the study has finished)."""
        s = self.s
        wanted = self.pretraining()
        choices = self.all_choices(results)
        for budget in s.budgets:
            for arm in sorted(s.arms(budget), key=lambda a: a != "matched"):  # the longest runs first
                wanted += self.grid(budget, arm)
                choice = choices[f"b{budget}/{arm}"]
                if choice is not None:
                    wanted += self.finals(budget, arm, choice["lr"])
        if all(choices.values()):
            wanted += self.evaluations(choices)  # type: ignore[arg-type]
        unique = list({job.name: job for job in wanted}.values())
        todo = [job for job in unique if job.name not in results]
        ready = [job for job in todo if all(name in results for name in self.needs(job))]
        return ready, not todo and all(choices.values())


def outline(settings: Settings) -> list[str]:
    """What a study will run, before it runs: its splits and, per kind of job, how many and how many
    optimiser steps (the final runs counted with any learning rate: their number does not depend on it)."""
    plan, s = Plan(settings), settings
    jobs = plan.pretraining()
    for budget in s.budgets:
        for arm in s.arms(budget):
            jobs += plan.grid(budget, arm) + plan.finals(budget, arm, s.lrs(arm)[0])[1:]
    jobs += plan.evaluations({f"b{b}/{a}": {"lr": s.lrs(a)[0]} for b in s.budgets for a in s.arms(b)})
    counts: dict[str, list[int]] = {}
    for job in jobs:
        kind = kind_of(job)
        counts.setdefault(kind, []).append(steps_of(job))
    splits = s.splits
    lines = [
        f"splits: pool {splits.pool}; validation {splits.val}; test {splits.test}",
        *(f"labels {b}: {splits.labels[b]}; arms {', '.join(s.arms(b))}" for b in s.budgets),
        *(f"supervised pretraining for {b} labels: {shards}" for b, shards in sorted(splits.supervised.items())),
        f"seeds {list(s.seeds)}; fine-tuning lrs {list(s.finetune_lrs)}; from-scratch lrs {list(s.scratch_lrs)}",
    ]
    lines += [f"{kind}: {len(steps)} runs, {sum(steps):,} steps" for kind, steps in counts.items()]
    lines.append(f"in all: {len(jobs)} runs, {sum(sum(v) for v in counts.values()):,} optimiser steps")
    return lines
