"""One job of a study in a folder of its own (`run_folder`): an `mpp fit` or `mpp test` (and frozen
evaluations) run in this process, resumed from its last checkpoint; its log, config, checkpoints,
metrics.csv (or, run as configured, its W&B run), the machines it ran on and its result.json; and the
study's record of test-set reads."""

from __future__ import annotations

import contextlib
import csv
import json
import os
import sys
import time
from collections.abc import Iterator, Sequence
from dataclasses import replace
from pathlib import Path
from typing import Any

from experiments.plan import Job, steps_of
from experiments.settings import Settings

# A study folder holding this file keeps each run's folder directly under it, not under runs/:
# experiments.compare, whose runs are where the demo configs put them (runs/demo/<arm>).
FLAT = "flat-layout.json"


def runs_root(out: Path) -> Path:
    return out if (out / FLAT).exists() else out / "runs"


def run_folder(out: Path, name: str) -> Path:
    return runs_root(out) / name


def last_checkpoint(out: Path, name: str) -> Path:
    return run_folder(out, name) / "checkpoints" / "last.ckpt"


def read_results(out: Path) -> dict[str, dict]:
    """{job name: result} of every finished job under `out`."""
    runs = runs_root(out)
    found = {}
    for path in runs.glob("**/result.json") if runs.is_dir() else []:
        result = json.loads(path.read_text())
        found[result["name"]] = result
    return found


def metric_curve(path: Path, metric: str) -> list[tuple[int, float]]:
    """(step, value) of a metric in a CSV logger's metrics.csv, and in the files `keep_metrics` kept
    beside it from earlier attempts, the step counted from 1 (the logger writes the number of steps
    before, so a run of 500 validates last at 499); a step logged twice (a resumed run repeats the
    steps after its checkpoint) keeps its last value."""
    values: dict[int, float] = {}
    for part in [*sorted(path.parent.glob(f"{path.stem}.attempt*{path.suffix}")), path]:
        if not part.exists():
            continue
        with part.open(newline="") as file:
            for row in csv.DictReader(file):
                if row.get(metric) not in (None, ""):
                    values[int(row["step"]) + 1] = float(row[metric])
    return sorted(values.items())


def keep_metrics(path: Path) -> None:
    """Lightning's CSV logger deletes the metrics.csv it finds: before a run resumes, move it aside
    (metrics.attempt001.csv, ...), so that its curve keeps the steps before the resume."""
    if path.exists():
        count = len(list(path.parent.glob(f"{path.stem}.attempt*{path.suffix}")))
        path.rename(path.with_name(f"{path.stem}.attempt{count + 1:03d}{path.suffix}"))


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
    from mpp.commands import main

    given, sys.argv = sys.argv, ["mpp", *args]  # the command line the run reads and records, not the study's
    try:
        main()
    except SystemExit as stop:
        if stop.code not in (0, None):
            raise RuntimeError(f"mpp {args[0]} exited with {stop.code}") from None
    finally:
        sys.argv = given


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


def steps_done(out: Path, job: Job) -> int:
    """The optimiser steps a fit resumes from: its last checkpoint's (0 without one, or for an evaluation)."""
    path = last_checkpoint(out, job.name)
    if job.kind != "fit" or not path.exists():
        return 0
    import torch

    return int(torch.load(path, map_location="cpu", weights_only=False, mmap=True)["global_step"])


def checkpoint_of(out: Path, name: str) -> Path:
    """The last checkpoint of the finished run `name`, which a job starts from or evaluates, or the
    checkpoint file `name` names (ending in .ckpt), made elsewhere."""
    if name.endswith(".ckpt"):
        return Path(name)
    path = last_checkpoint(out, name)
    if not path.exists():  # e.g. restored from a ledger (experiments.ledger): its numbers, not its weights
        raise FileNotFoundError(f"{name} has no checkpoint in {path.parent}: run it again (delete its result.json)")
    return path


def resolve(overrides: Sequence[str], out: Path) -> list[str]:
    """`{run:NAME}` -> that run's last checkpoint."""
    return [str(checkpoint_of(out, arg[5:-1])) if arg.startswith("{run:") else arg for arg in overrides]


def frozen_scores(checkpoint: Path, shards: tuple[str, str], settings: Settings) -> dict[str, Any]:
    from mpp.eval.frozen import evaluate_checkpoint
    from mpp.eval.linear import DEFAULTS

    evaluation = replace(DEFAULTS, shots=settings.shots, max_train=settings.frozen_max_train)
    scores = evaluate_checkpoint(str(checkpoint), train=shards[0], test=shards[1], settings=evaluation)
    return {
        "fewshot": {str(n): a for n, a in scores.fewshot.items()},
        "knn": scores.knn,
        "linear": scores.linear,
        "linear_l2": scores.linear_l2,
        "train": scores.train,
        "test": scores.test,
    }


def outputs(job: Job, folder: Path, settings: Settings) -> list[str]:
    """Where a run writes: its folder, and for the studies' quiet runs the CSV logger (and a fit's
    checkpoints every `checkpoint_every` steps) in place of the config's logger and callbacks."""
    if job.as_configured:
        return ["--trainer.default_root_dir", str(folder)]
    return run_outputs(folder) + (checkpointing(folder, settings.checkpoint_every) if job.kind == "fit" else [])


def logged_curve(folder: Path, metric: str) -> list[tuple[int, float]]:
    """(step, value) of a metric over a run, from its metrics.csv, or from its W&B run folders (each
    attempt's, in order: a step logged again after a resume keeps its last value)."""
    if list(folder.glob("metrics*.csv")):
        return metric_curve(folder / "metrics.csv", metric)
    from mpp.outputs.wandb_records import run_history

    wandb = folder / "wandb"  # a resumed fit continues its W&B run; a test run again starts a new one
    runs = dict.fromkeys(path.stem.removeprefix("run-") for path in sorted(wandb.glob("*run-*/run-*.wandb")))
    rows = [row for run_id in runs for row in run_history(wandb, run_id) if metric in row]
    return sorted({int(row.get("trainer/global_step", 0)) + 1: float(row[metric]) for row in rows}.items())


def fit(job: Job, out: Path, settings: Settings) -> dict[str, Any]:
    """Run (or resume from its last checkpoint) the fit `job` in its folder; returns its validation."""
    folder = run_folder(out, job.name)
    resume = last_checkpoint(out, job.name)
    args = ["fit", "--config", job.config, *resolve(job.overrides, out), *outputs(job, folder, settings)]
    if resume.exists():
        keep_metrics(folder / "metrics.csv")
    cli(args + (["--ckpt_path", str(resume)] if resume.exists() else []))
    curve = logged_curve(folder, "val/accuracy")
    losses = logged_curve(folder, "val/loss")
    return {"val_curve": curve, "val_accuracy": curve[-1][1] if curve else None,
            "val_loss": losses[-1][1] if losses else None}  # fmt: skip


def remake_first(out: Path, job: Job) -> Job | None:
    """The fit `job` must make again before it runs (see needs_remake), or None: a test's fit, evaluated
    under the same recipe."""
    if job.kind != "test" or not job.checkpoint:
        return None
    source = Job(job.checkpoint, "fit", job.config, job.overrides)
    return source if needs_remake(out, source) else None


def needs_remake(out: Path, source: Job) -> bool:
    """Whether a test must first make its finished fit `source` again: restored from a ledger, the fit has
    its numbers but not its weights (no last checkpoint, or one short of its steps from a remake that
    stopped half way). The remake runs the same recipe and seed in the fit's folder, resumably; the fit's
    result.json keeps the numbers that its point's choices were made on."""
    finished = (run_folder(out, source.name) / "result.json").exists()
    return finished and steps_done(out, source) < steps_of(source)


def run_job(job: Job, out: Path, settings: Settings) -> dict[str, Any]:
    """Run one job (in a worker process) and write its result.json; returns the result."""
    folder = run_folder(out, job.name)
    folder.mkdir(parents=True, exist_ok=True)
    start = time.perf_counter()
    result: dict[str, Any] = {"name": job.name, "kind": job.kind, "machines": note_machine(folder)}
    # what experiments.timing estimates from: this attempt's wall seconds ran steps - resumed_from steps
    result |= {"config": job.config, "steps": steps_of(job), "resumed_from": steps_done(out, job)}
    with contextlib.nullcontext() if job.as_configured else output_to(folder / "log.txt"):
        if job.kind == "fit":
            result |= fit(job, out, settings)
        elif job.kind == "test":
            source = remake_first(out, job)
            if source is not None:
                result["remade"] = {"machines": note_machine(run_folder(out, source.name)),
                                    "resumed_from": steps_done(out, source)}  # fmt: skip
                result["remade"] |= fit(source, out, settings)
                result["remade"]["wall_seconds"] = time.perf_counter() - start
            args = ["test", "--config", job.config, *resolve(job.overrides, out), *outputs(job, folder, settings)]
            args += ["--data.test", job.test or settings.splits.test]
            args += ["--ckpt_path", str(checkpoint_of(out, job.checkpoint))]
            note_test_read(out, job.name)
            cli(args)
            [(_, accuracy)] = logged_curve(folder, "test/accuracy")[-1:]
            result["test_accuracy"] = accuracy
        if job.frozen is not None:
            checkpoint = checkpoint_of(out, job.checkpoint or job.name)
            if job.kind == "frozen":
                note_test_read(out, job.name)
            result["frozen"] = frozen_scores(checkpoint, job.frozen, settings)
    result["wall_seconds"] = time.perf_counter() - start
    result["finished"] = time.time()
    temporary = folder / "result.json.tmp"
    temporary.write_text(json.dumps(result, indent=1))
    temporary.replace(folder / "result.json")
    return result


def test_reads(out: Path) -> list[dict[str, Any]]:
    """The study's record of its test-set reads (note_test_read)."""
    path = out / "test_reads.jsonl"
    return [json.loads(line) for line in path.read_text().splitlines()] if path.exists() else []


def machine() -> dict[str, Any]:
    """What a run computes on: the CPU's name, whether it computes bf16 natively (so the precision a
    config without one takes), the threads and torch."""
    import torch

    from mpp.precision import cpu_has_bf16

    name = next((line.split(":", 1)[1].strip() for line in _cpuinfo() if line.startswith("model name")), "")
    bf16 = cpu_has_bf16()
    return {"cpu": name, "bf16": bf16, "precision": "bf16-mixed" if bf16 else "32-true",
            "threads": torch.get_num_threads(), "torch": torch.__version__}  # fmt: skip


def _cpuinfo() -> list[str]:
    path = Path("/proc/cpuinfo")
    return path.read_text().splitlines() if path.exists() else []


def note_machine(folder: Path) -> list[dict[str, Any]]:
    """Add this attempt's machine to the run's machines.jsonl (a resumed run may have run on several);
    returns the different machines the run has run on."""
    path = folder / "machines.jsonl"
    with path.open("a") as file:
        file.write(json.dumps(machine()) + "\n")
    seen = [json.loads(line) for line in path.read_text().splitlines()]
    return [dict(entry) for entry in {json.dumps(entry, sort_keys=True): entry for entry in seen}.values()]


def note_test_read(out: Path, name: str) -> None:
    """Append a read of the test set to the study's record (one line, appended atomically)."""
    line = json.dumps({"job": name, "time": time.time()}) + "\n"
    fd = os.open(out / "test_reads.jsonl", os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644)
    try:
        os.write(fd, line.encode())
    finally:
        os.close(fd)
