"""Does masked patch prediction help, with error bars? A study of arms over seeds and label budgets,
each run an `mpp fit` of the shipped configs with overrides, in worker processes, resumable.

Arms (`ARMS`): from scratch (the fine-tuning steps); from scratch with matched compute (pretraining
plus fine-tuning steps); MPP pretrained on the unlabelled pool, then fine-tuned; supervised pretraining
on labelled images the fine-tuning set does not hold, then fine-tuned; and the hybrid encoder (the
ViT on a ResNet stem) from scratch and MPP pretrained, then fine-tuned. Every choice (each arm's learning
rate, from its grid, with the first seed) is made on a validation split held out from the training
pool; the test set is read only after every choice is made, once per final run (and once per frozen
pretrained encoder). The ablation of the pretraining objective (`VARIANTS`) is judged by few-shot
accuracy of the frozen encoder on the validation split.

A run's folder holds its checkpoints, metrics.csv and result.json; a study started again skips the
runs with a result and resumes the others from their last checkpoint (exactly, mpp.data.resume). A
study may be started again with arms added (`extends`): arms.json records when each arm joined, and
the test set must then have been read after every choice of the arms the study had at that time.
"""

from __future__ import annotations

import contextlib
import csv
import json
import math
import os
import shutil
import signal
import sys
import time
from collections.abc import Iterator, Sequence
from concurrent.futures import FIRST_COMPLETED, Future, ProcessPoolExecutor, wait
from dataclasses import asdict, dataclass, field
from multiprocessing import get_context
from pathlib import Path
from typing import Any

from mpp.eval.stats import paired, summarise

ARMS = {
    "scratch": "from scratch",
    "matched": "from scratch, matched compute",
    "mpp": "MPP pretrained, fine-tuned",
    "supervised": "supervised pretrained, fine-tuned",
    "hybrid_scratch": "hybrid from scratch",
    "hybrid_mpp": "hybrid MPP pretrained, fine-tuned",
}
# The run config (a key of Settings.configs) of each arm's fine-tuning or from-scratch runs.
ARM_CONFIGS = {"scratch": "scratch", "matched": "scratch", "mpp": "finetune", "supervised": "finetune",
               "hybrid_scratch": "hybrid_scratch", "hybrid_mpp": "hybrid_finetune"}  # fmt: skip
FROM_SCRATCH = ("scratch", "matched", "hybrid_scratch")
PRETRAINED = ("mpp", "supervised", "hybrid_mpp")
# The paired differences reported, first − second, where a budget has both arms.
PAIRS = [("mpp", "scratch"), ("mpp", "matched"), ("supervised", "mpp"), ("hybrid_mpp", "hybrid_scratch"),
         ("hybrid_mpp", "mpp"), ("hybrid_scratch", "scratch")]  # fmt: skip
# The arms of a study saved before settings named their arms.
FIRST_ARMS = ("scratch", "matched", "mpp", "supervised")
WATCH_SECONDS = 1.0  # how often a worker looks whether its study is still there
STOP_GRACE_SECONDS = 30.0  # then a worker whose study is gone exits, stopped or not


@dataclass(frozen=True)
class Variant:
    """A pretraining objective of the ablation: overrides of the pretraining config."""

    name: str
    label: str
    overrides: tuple[str, ...] = ()


TARGET = "--model.init_args.target."
VARIANTS = (
    Variant("colour3", "3-bit mean colour, 50% corrupted (default)"),
    Variant("ratio15", "3-bit mean colour, 15% corrupted", ("--model.init_args.corruption.ratio", "0.15")),
    Variant(
        "downsized4",
        "4×4 downsized patch, 3-bit colours",
        (TARGET + "kind", "downsized_colour", TARGET + "cells", "4"),
    ),
    Variant("pixels", "L2 on normalised pixels", (TARGET + "kind", "pixels")),
    Variant("grey5", "5-bit mean colour (32 grey levels)", (TARGET + "bits", "5")),
)
DEFAULT_VARIANT = VARIANTS[0].name


@dataclass(frozen=True)
class Splits:
    """Shard specs of every split. `labels[b]`: the fine-tuning set of label budget b;
    `supervised[b]`: labelled images not in `labels[b]` for supervised pretraining (a budget without
    one has no supervised arm); `pool`: the unlabelled pretraining images; `val`: every choice."""

    pool: str
    val: str
    test: str
    labels: dict[int, str]
    supervised: dict[int, str]


@dataclass(frozen=True)
class Settings:
    splits: Splits
    # run configs: pretrain, finetune, scratch, and for the hybrid arms hybrid_pretrain, hybrid_finetune, hybrid_scratch
    configs: dict[str, str]
    seeds: tuple[int, ...]
    pretrain_steps: int
    finetune_steps: int
    finetune_lrs: tuple[float, ...]
    scratch_lrs: tuple[float, ...]
    ablation: tuple[str, ...]  # variants besides the default, pretrained with the first ablation_seeds
    ablation_seeds: int
    shots: tuple[int, ...] = (10, 25)
    overrides: tuple[str, ...] = ()  # for every fit, e.g. a smaller batch
    checkpoint_every: int = 100
    frozen_max_train: int = 10000  # labelled images a frozen evaluation learns from, at most
    selected_arms: tuple[str, ...] = tuple(ARMS)  # supervised runs only for budgets with a supervised split

    @property
    def budgets(self) -> list[int]:
        return sorted(self.splits.labels)

    @property
    def val_every(self) -> int:
        """Validation interval: the largest divisor of every run's length up to 100, so that every
        run validates at its last step (matched compute runs pretrain + fine-tune steps)."""
        common = math.gcd(self.pretrain_steps, self.finetune_steps)
        return max(d for d in range(1, min(common, 100) + 1) if common % d == 0)

    def arms(self, budget: int) -> list[str]:
        return [
            arm
            for arm in ARMS
            if arm in self.selected_arms and (arm != "supervised" or budget in self.splits.supervised)
        ]

    def lrs(self, arm: str) -> tuple[float, ...]:
        return self.scratch_lrs if arm in FROM_SCRATCH else self.finetune_lrs

    def as_dict(self) -> dict[str, Any]:
        return asdict(self)

    @classmethod
    def from_dict(cls, values: dict[str, Any]) -> Settings:
        """The settings a study saved (settings.json), as they were: a study saved before settings named
        their arms has FIRST_ARMS."""
        splits = values["splits"]
        by_budget = {key: {int(b): shards for b, shards in splits[key].items()} for key in ("labels", "supervised")}
        tuples = ("seeds", "finetune_lrs", "scratch_lrs", "ablation", "shots", "overrides")
        return cls(
            **{
                **values,
                **{key: tuple(values[key]) for key in tuples if key in values},
                "splits": Splits(splits["pool"], splits["val"], splits["test"], **by_budget),
                "selected_arms": tuple(values.get("selected_arms", FIRST_ARMS)),
            }
        )


@dataclass(frozen=True)
class Job:
    """One unit of work in a folder of its own: `fit` (an mpp fit, then optionally a frozen evaluation
    of its encoder), `test` (mpp test of a fitted run and a frozen evaluation of its encoder), or
    `frozen` (a frozen evaluation of a checkpoint). `reads_test`: it reads the test set."""

    name: str
    kind: str
    config: str = ""
    overrides: tuple[str, ...] = ()
    checkpoint: str = ""  # test, frozen: the run (job name) whose last checkpoint is evaluated
    frozen: tuple[str, str] | None = None  # (labelled train shards, test shards) of a frozen evaluation
    reads_test: bool = False


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


def extends(saved: dict[str, Any], settings: dict[str, Any]) -> bool:
    """Whether a study saved with the settings `saved` goes on under `settings`: the same, or with arms
    (and the configs they run) added."""
    saved, settings = ({"selected_arms": list(FIRST_ARMS), **values} for values in (saved, settings))
    rest = [key for key in {**saved, **settings} if key not in ("selected_arms", "configs")]
    return (
        set(saved["selected_arms"]) <= set(settings["selected_arms"])
        and all(settings["configs"].get(key) == value for key, value in saved["configs"].items())
        and all(saved.get(key) == settings.get(key) for key in rest)
    )


def note_arms(out: Path, saved: dict[str, Any] | None, settings: Settings) -> dict[str, float]:
    """arms.json: when each arm joined the study (0: with its first settings), updated for added arms."""
    path = out / "arms.json"
    if path.exists():
        joined = json.loads(path.read_text())
    else:
        first = settings.selected_arms if saved is None else saved.get("selected_arms", FIRST_ARMS)
        joined = dict.fromkeys(first, 0.0)
    now = time.time()
    joined.update({arm: now for arm in settings.selected_arms if arm not in joined})
    path.write_text(json.dumps(joined, indent=1))
    return joined


class Plan:
    """Which jobs a study runs, given what has finished: `ready(results)` lists the jobs whose inputs
    exist, in the order to start them; choices are made as soon as a grid is complete."""

    def __init__(self, settings: Settings) -> None:
        self.s = settings

    def _seeded(self, seed: int, steps: int) -> tuple[str, ...]:
        s = self.s
        return (
            "--seed_everything", str(seed), "--data.seed", str(seed), "--trainer.max_steps", str(steps),
            "--data.val", s.splits.val, "--data.test", "null", "--trainer.val_check_interval", str(s.val_every),
            *s.overrides,
        )  # fmt: skip

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
        """The jobs whose checkpoints a job reads."""
        named = [arg[5:-1] for arg in job.overrides if arg.startswith("{run:")]
        return named + ([job.checkpoint] if job.checkpoint else [])

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


# ---- running jobs ---------------------------------------------------------------------------------


def run_folder(out: Path, name: str) -> Path:
    return out / "runs" / name


def last_checkpoint(out: Path, name: str) -> Path:
    return run_folder(out, name) / "checkpoints" / "last.ckpt"


def read_results(out: Path) -> dict[str, dict]:
    """{job name: result} of every finished job under `out`."""
    runs = out / "runs"
    found = {}
    for path in runs.glob("**/result.json") if runs.is_dir() else []:
        result = json.loads(path.read_text())
        found[result["name"]] = result
    return found


def metric_curve(path: Path, metric: str) -> list[tuple[int, float]]:
    """(step, value) of a metric in a CSV logger's metrics.csv, the step counted from 1 (the logger
    writes the number of steps before, so a run of 500 validates last at 499); a step logged twice (a
    resumed run repeats the steps after its checkpoint) keeps its last value."""
    if not path.exists():
        return []
    values: dict[int, float] = {}
    with path.open(newline="") as file:
        for row in csv.DictReader(file):
            if row.get(metric) not in (None, ""):
                values[int(row["step"]) + 1] = float(row[metric])
    return sorted(values.items())


@contextlib.contextmanager
def output_to(path: Path) -> Iterator[None]:
    """Send this process's stdout and stderr (and its children's) to a file, at the descriptor level."""
    for stream in (sys.stdout, sys.stderr):
        stream.flush()
    saved = [os.dup(1), os.dup(2)]
    with path.open("a") as log:
        for fd in (1, 2):
            os.dup2(log.fileno(), fd)
        try:
            yield
        finally:
            for stream in (sys.stdout, sys.stderr):
                stream.flush()
            for fd, copy in zip((1, 2), saved):
                os.dup2(copy, fd)
                os.close(copy)


def cli(args: list[str]) -> None:
    """`mpp <args>` in this process; a failure raises."""
    from mpp.cli import main

    try:
        main(args)
    except SystemExit as stop:
        if stop.code not in (0, None):
            raise RuntimeError(f"mpp {args[0]} exited with {stop.code}") from None


def run_outputs(folder: Path) -> list[str]:
    """Overrides that keep a run's records, checkpoints and config in its folder: a CSV logger, and one
    checkpoint callback (the configs' pictures, analyses and few-shot callbacks are left out: the
    study evaluates every encoder itself)."""
    logger = {
        "class_path": "pytorch_lightning.loggers.CSVLogger",
        "init_args": {"save_dir": str(folder), "name": "", "version": ""},
    }
    return [
        "--trainer.default_root_dir", str(folder), "--trainer.logger", json.dumps(logger),
        "--trainer.enable_progress_bar", "false", "--trainer.enable_model_summary", "false",
    ]  # fmt: skip


def checkpointing(folder: Path, every: int) -> list[str]:
    callback = {
        "class_path": "pytorch_lightning.callbacks.ModelCheckpoint",
        "init_args": {
            "dirpath": str(folder / "checkpoints"), "filename": "step{step:07d}", "auto_insert_metric_name": False,
            "every_n_train_steps": every, "save_top_k": 0, "save_last": True, "enable_version_counter": False,
        },
    }  # fmt: skip
    return ["--trainer.callbacks", json.dumps([callback])]


def resolve(overrides: Sequence[str], out: Path) -> list[str]:
    """`{run:NAME}` -> that run's last checkpoint."""
    return [str(last_checkpoint(out, arg[5:-1])) if arg.startswith("{run:") else arg for arg in overrides]


def frozen_scores(checkpoint: Path, shards: tuple[str, str], settings: Settings) -> dict[str, Any]:
    from mpp.eval.frozen import evaluate_checkpoint

    scores = evaluate_checkpoint(
        str(checkpoint), train=shards[0], test=shards[1], shots=settings.shots, max_train=settings.frozen_max_train
    )
    return {
        "fewshot": {str(n): a for n, a in scores.fewshot.items()},
        "knn": scores.knn,
        "linear": scores.linear,
        "linear_l2": scores.linear_l2,
        "train": scores.train,
        "test": scores.test,
    }


def run_job(job: Job, out: Path, settings: Settings) -> dict[str, Any]:
    """Run one job (in a worker process) and write its result.json; returns the result."""
    folder = run_folder(out, job.name)
    folder.mkdir(parents=True, exist_ok=True)
    start = time.perf_counter()
    result: dict[str, Any] = {"name": job.name, "kind": job.kind}
    with output_to(folder / "log.txt"):
        if job.kind == "fit":
            resume = last_checkpoint(out, job.name)
            args = ["fit", "--config", job.config, *resolve(job.overrides, out), *run_outputs(folder)]
            args += checkpointing(folder, settings.checkpoint_every)
            cli(args + (["--ckpt_path", str(resume)] if resume.exists() else []))
            curve = metric_curve(folder / "metrics.csv", "val/accuracy")
            result["val_curve"] = curve
            result["val_accuracy"] = curve[-1][1] if curve else None
        elif job.kind == "test":
            args = ["test", "--config", job.config, *resolve(job.overrides, out), *run_outputs(folder)]
            args += ["--data.test", settings.splits.test, "--ckpt_path", str(last_checkpoint(out, job.checkpoint))]
            note_test_read(out, job.name)
            cli(args)
            [(_, accuracy)] = metric_curve(folder / "metrics.csv", "test/accuracy")[-1:]
            result["test_accuracy"] = accuracy
        if job.frozen is not None:
            checkpoint = last_checkpoint(out, job.checkpoint or job.name)
            if job.kind == "frozen":
                note_test_read(out, job.name)
            result["frozen"] = frozen_scores(checkpoint, job.frozen, settings)
    result["wall_seconds"] = time.perf_counter() - start
    result["finished"] = time.time()
    temporary = folder / "result.json.tmp"
    temporary.write_text(json.dumps(result, indent=1))
    temporary.replace(folder / "result.json")
    return result


def shared_runs(settings: Settings, source: Path) -> list[Job]:
    """The finished fits of the study in `source` that a study with `settings` would run exactly as they
    ran there: the same job (config and overrides, seed and steps among them), whose inputs are shared too."""
    saved = Settings.from_dict(json.loads((source / "settings.json").read_text()))
    theirs = {job.name: job for job in Plan(saved).fits()}
    mine = {job.name: job for job in Plan(settings).fits()}
    finished = read_results(source)
    same: dict[str, bool] = {}

    def identical(name: str) -> bool:
        if name not in same:
            job = mine[name]
            same[name] = (
                theirs.get(name) == job and name in finished and all(identical(need) for need in Plan.needs(job))
            )
        return same[name]

    return [job for name, job in mine.items() if identical(name)]


def covers(study: dict[str, Any], settings: Settings) -> bool:
    """Whether a finished study (its study.json) ran every fit a study with `settings` would run, exactly
    alike (config and overrides, seeds and steps among them), chose among the same learning rates with the
    same seeds, and scored them alike (test split, shots, frozen evaluations): then the numbers of that study are this one's, read for its budgets and arms."""
    theirs = Settings.from_dict(study["settings"])
    chosen_and_scored = ("seeds", "finetune_lrs", "scratch_lrs", "shots", "frozen_max_train")
    alike = theirs.splits.test == settings.splits.test and all(
        getattr(theirs, key) == getattr(settings, key) for key in chosen_and_scored
    )
    measured = all(
        arm in study["budgets"].get(str(budget), {}).get("arms", {})
        for budget in settings.budgets
        for arm in settings.arms(budget)
    )
    return alike and measured and set(Plan(settings).fits()) <= set(Plan(theirs).fits())


def reuse_runs(settings: Settings, out: Path, source: Path, label: str | None = None) -> list[str]:
    """Bring into the study `out` the runs it shares with the study in `source` (`shared_runs`) and has
    not finished itself. The files are hard links where the file system allows (a finished run is never
    written again), and result.json says where the run came from. No test or frozen evaluation is
    brought: the study reads the test set itself, after its own choices. `label`: the source as the
    study's record names it (default: its path). Returns the names brought."""
    finished, present = read_results(source), read_results(out)
    brought = []
    for name in (job.name for job in shared_runs(settings, source)):
        if name in present:
            continue
        folder, staging = run_folder(out, name), out / "reusing" / name
        shutil.rmtree(staging, ignore_errors=True)
        shutil.copytree(run_folder(source, name), staging, ignore=_other_runs, copy_function=_link_or_copy)
        result = {**finished[name], "reused_from": label or str(source)}
        (staging / "result.json").unlink()  # a link to the source's: a new file, not written through it
        (staging / "result.json").write_text(json.dumps(result, indent=1))
        shutil.rmtree(folder, ignore_errors=True)  # an unfinished run of its own
        folder.parent.mkdir(parents=True, exist_ok=True)
        staging.rename(folder)
        brought.append(name)
    shutil.rmtree(out / "reusing", ignore_errors=True)
    return brought


def _other_runs(folder: str, names: list[str]) -> list[str]:
    """What a run's folder holds besides the run: the folders of other runs (a final run's test)."""
    return [name for name in names if (Path(folder) / name).is_dir() and name != "checkpoints"]


def _link_or_copy(source: str, target: str) -> None:
    try:
        os.link(source, target)
    except OSError:
        shutil.copy2(source, target)


def note_test_read(out: Path, name: str) -> None:
    """Append a read of the test set to the study's record (one line, appended atomically)."""
    line = json.dumps({"job": name, "time": time.time()}) + "\n"
    fd = os.open(out / "test_reads.jsonl", os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644)
    try:
        os.write(fd, line.encode())
    finally:
        os.close(fd)


def _start_worker(threads: int, parent: int) -> None:
    """A worker's set-up: its share of the cores, and a watch on the study that started it. A study killed
    without the chance to stop its workers (`kill`, SIGKILL, a closed terminal) leaves them to init: they
    would go on training and writing into run folders that a new invocation is already using. A worker
    whose parent has changed stops its run with SIGTERM, as a scheduler would; the run resumes later."""
    import threading

    import torch

    torch.set_num_threads(threads)

    def watch() -> None:
        while os.getppid() == parent:
            time.sleep(WATCH_SECONDS)
        os.kill(os.getpid(), signal.SIGTERM)  # a fit stops at its next step, anything else at once
        time.sleep(STOP_GRACE_SECONDS)
        os._exit(128 + signal.SIGTERM)

    threading.Thread(target=watch, name="study-parent-watch", daemon=True).start()


def worker_pool(jobs: int) -> ProcessPoolExecutor:
    """`jobs` worker processes, each with its share of the cores, that stop when the study is gone."""
    threads = max(1, (os.cpu_count() or 1) // jobs)
    return ProcessPoolExecutor(
        jobs, mp_context=get_context("spawn"), initializer=_start_worker, initargs=(threads, os.getpid())
    )


@dataclass
class Progress:
    """What one invocation of the study ran: its start, its last record (its end once it ends) and the jobs it
    finished."""

    start: float = field(default_factory=time.time)
    end: float | None = None
    finished: list[str] = field(default_factory=list)


def record_choices(out: Path, choices: dict[str, dict[str, Any] | None]) -> dict[str, dict[str, Any]]:
    """Write every choice made so far to choices.json, each with the time it was first made."""
    path = out / "choices.json"
    known = json.loads(path.read_text()) if path.exists() else {}
    for key, choice in choices.items():
        if choice is None:
            continue
        if key in known and known[key]["lr"] == choice["lr"]:
            choice = {**choice, "time": known[key]["time"]}
        known[key] = {**choice, "time": choice.get("time", time.time())}
    path.write_text(json.dumps(known, indent=1))
    return known


def run_study(settings: Settings, out: Path, *, jobs: int, say: Any = print) -> dict[str, dict]:
    """Run every job of the study not yet finished under `out`, `jobs` at a time; returns all results."""
    out.mkdir(parents=True, exist_ok=True)
    plan = Plan(settings)
    results = read_results(out)
    progress = Progress()
    attempts_path = out / "attempts.json"
    attempts = json.loads(attempts_path.read_text()) if attempts_path.exists() else []

    def note_progress() -> None:  # after every job too, so that a killed invocation still counts
        progress.end = time.time()
        attempts_path.write_text(json.dumps([*attempts, asdict(progress)], indent=1))

    note_progress()
    running: dict[str, Future[dict[str, Any]]] = {}
    failures: list[str] = []
    with worker_pool(jobs) as pool:
        while True:
            record_choices(out, plan.all_choices(results))
            ready, finished = plan.ready(results)
            if finished or (failures and not running):
                break
            for job in ready:
                if len(running) >= jobs or failures:
                    break
                if job.name not in running:
                    say(f"study: start {job.name}")
                    running[job.name] = pool.submit(run_job, job, out, settings)
            if not running:
                raise RuntimeError("the study cannot go on: no job is ready and none is running")
            done, _ = wait(list(running.values()), return_when=FIRST_COMPLETED)
            for name in [n for n, f in running.items() if f in done]:
                future = running.pop(name)
                try:
                    results[name] = future.result()
                except Exception as error:  # the others finish; the study stops after them
                    failures.append(f"{name}: {error} (log: {run_folder(out, name) / 'log.txt'})")
                    continue
                progress.finished.append(name)
                note_progress()
                say(f"study: done {name} ({results[name]['wall_seconds']:.0f} s)")
    note_progress()
    if failures:
        raise RuntimeError("study runs failed:\n" + "\n".join(failures))
    return results


# ---- what came out ------------------------------------------------------------------------------


def test_reads(out: Path) -> list[dict[str, Any]]:
    path = out / "test_reads.jsonl"
    return [json.loads(line) for line in path.read_text().splitlines()] if path.exists() else []


def audit_test_reads(
    plan: Plan, choices: dict[str, dict[str, Any]], reads: list[dict[str, Any]], joined: dict[str, float] | None = None
) -> dict[str, Any]:
    """Whether the test set was read only by the evaluations of final runs and pretrained encoders, each
    once, and only after the last choice was made, of the arms the study had then (`joined`: when each
    arm joined the study, arms.json; None: all with its first settings)."""
    allowed = {job.name for job in plan.evaluations(choices)}
    joined = joined or dict.fromkeys(plan.s.selected_arms, 0.0)
    counts: dict[str, int] = {}
    for read in reads:
        counts[read["job"]] = counts.get(read["job"], 0) + 1
    problems = [f"{name} read the test set but is no final evaluation" for name in counts if name not in allowed]
    for read in reads:
        then = [
            choice["time"] for key, choice in choices.items() if joined.get(key.split("/", 1)[1], 0.0) <= read["time"]
        ]
        if read["time"] < max(then, default=0.0):
            problems.append(f"{read['job']} read the test set before the last choice")
    problems += [f"{name} never read the test set" for name in sorted(allowed - set(counts))]
    first = min(joined.values(), default=0.0)
    return {
        "reads": len(reads),
        "evaluations": len(allowed),
        "read_more_than_once": sorted(name for name, n in counts.items() if n > 1),
        "arms_added_later": sorted(arm for arm, time_ in joined.items() if time_ > first),
        "problems": problems,
    }


def _scores(results: dict[str, dict], names: dict[int, str], shots: Sequence[int]) -> dict[str, Any]:
    """Frozen scores of runs {seed: job name}, summarised over seeds."""
    frozen = {seed: results[name]["frozen"] for seed, name in names.items()}
    scores = {f"{n}-shot": summarise([f["fewshot"][str(n)] for f in frozen.values()]).as_dict() for n in shots}
    scores["k-NN"] = summarise([f["knn"] for f in frozen.values()]).as_dict()
    scores["linear probe"] = summarise([f["linear"] for f in frozen.values()]).as_dict()
    return scores


def summarise_study(settings: Settings, out: Path) -> dict[str, Any]:
    """Everything the study measured, as one JSON-able mapping."""
    plan, results = Plan(settings), read_results(out)
    choices = json.loads((out / "choices.json").read_text())
    joined = json.loads((out / "arms.json").read_text()) if (out / "arms.json").exists() else None
    seeds, pre = settings.seeds, settings.pretrain_steps
    budgets: dict[str, Any] = {}
    for budget in settings.budgets:
        arms: dict[str, Any] = {}
        for arm in settings.arms(budget):
            choice = choices[f"b{budget}/{arm}"]
            finals = dict(zip(seeds, plan.finals(budget, arm, choice["lr"])))
            test = {seed: results[job.name + "/test"]["test_accuracy"] for seed, job in finals.items()}
            offset = pre if arm in PRETRAINED else 0  # curves against all optimiser steps
            arms[arm] = {
                "label": ARMS[arm],
                "lr": choice["lr"],
                "val_accuracy_by_lr": choice["val_accuracy"],
                "test_accuracy": summarise(list(test.values())).as_dict(),
                "test_accuracy_by_seed": {str(s): v for s, v in test.items()},
                "frozen": _scores(results, {s: job.name + "/test" for s, job in finals.items()}, settings.shots),
                "pretrain_steps": offset,
                "steps": results[finals[seeds[0]].name]["val_curve"][-1][0],
                "val_curves": {
                    str(s): [(step + offset, v) for step, v in results[job.name]["val_curve"]]
                    for s, job in finals.items()
                },
                "wall_seconds": sum(results[job.name]["wall_seconds"] for job in finals.values()) / len(finals),
            }
        by_seed = {arm: {int(s): v for s, v in arms[arm]["test_accuracy_by_seed"].items()} for arm in arms}
        pairs = [(a, b) for a, b in PAIRS if a in arms and b in arms]
        pretrained = {arm: {seed: f"frozen/b{budget}/{name}" for seed, name in zip(seeds, names)}
                      for arm, names in plan.pretrained_sources(budget).items()}  # fmt: skip
        budgets[str(budget)] = {
            "labels": settings.splits.labels[budget],
            "arms": arms,
            "differences": {f"{a} - {b}": paired(by_seed[a], by_seed[b]).as_dict() for a, b in pairs},
            "frozen_pretrained": {key: _scores(results, names, settings.shots) for key, names in pretrained.items()},
        }
    ablation: dict[str, dict[str, Any]] = {}
    for variant in VARIANTS:
        if variant.name == DEFAULT_VARIANT or variant.name in settings.ablation:
            names = {s: pretrain_name(variant.name, s) for s in seeds[: settings.ablation_seeds]}
            ablation[variant.name] = {"label": variant.label, "overrides": list(variant.overrides)}
            ablation[variant.name]["validation"] = _scores(results, names, settings.shots)
    attempts = json.loads((out / "attempts.json").read_text()) if (out / "attempts.json").exists() else []
    wall_by_kind: dict[str, float] = {}
    reused = [result for result in results.values() if "reused_from" in result]
    for result in results.values():
        if "reused_from" in result:  # their time was spent, and counted, by the study they came from
            continue
        kind = kind_of(Job(result["name"], result["kind"]))
        wall_by_kind[kind] = wall_by_kind.get(kind, 0.0) + result["wall_seconds"]
    return {
        "settings": settings.as_dict(),
        "budgets": budgets,
        "ablation": ablation,
        "test_set": audit_test_reads(plan, choices, test_reads(out), joined),
        "wall_seconds": {
            "elapsed": sum((a["end"] or a["start"]) - a["start"] for a in attempts),
            "attempts": len(attempts),
            "jobs_by_kind": wall_by_kind,
        },
        "reused": {"runs": len(reused), "from": sorted({result["reused_from"] for result in reused})},
    }


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
