"""Running a study: its jobs (experiments.jobs), each in a worker process, as many at a time as asked,
in the order its planner says, resumable.

A study started again skips the jobs with a result and resumes the others from their last checkpoint
(exactly, mpp.data.resume). Workers stop their run when the study that started them is gone.
"""

from __future__ import annotations

import json
import os
import signal
import time
from concurrent.futures import FIRST_COMPLETED, Future, ProcessPoolExecutor, wait
from dataclasses import asdict, dataclass, field
from multiprocessing import get_context
from pathlib import Path
from typing import Any, Protocol

from experiments.jobs import read_results, remake_first, run_folder, run_job, steps_done
from experiments.plan import Job, Plan
from experiments.settings import Settings
from experiments.timing import fitting

WATCH_SECONDS = 1.0  # how often a worker looks whether its study is still there
STOP_GRACE_SECONDS = 30.0  # then a worker whose study is gone exits, stopped or not
NOTE_SECONDS = 60.0  # how often a study notes that it is still running (attempts.json)


def _start_worker(threads: int, parent: int) -> None:
    """A worker's set-up: its share of the cores, and a watch on the study that started it. A study killed
    without the chance to stop its workers (`kill`, SIGKILL, a closed terminal) leaves them to init: they
    would go on training and writing into run folders that a new invocation is already using. A worker
    whose parent has changed stops its run with SIGTERM, as a scheduler would; the run resumes later."""
    import multiprocessing
    import threading

    import torch

    torch.set_num_threads(threads)
    # A process started with spawn takes spawn as its default start method too, so its runs' data loaders
    # would spawn their workers, each importing torch and mpp again at every validation: a demo fit took
    # 1.5-2x as long. The worker's runs start theirs as an `mpp` command does, the platform's default way.
    multiprocessing.set_start_method(None, force=True)

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


def decided(choice: dict[str, Any]) -> dict[str, Any]:
    """What a choice chose, less the record of the grid it chose from and the time it was made."""
    return {key: value for key, value in choice.items() if key not in ("time", "val_accuracy", "extended", "edge")}


def record_choices(out: Path, choices: dict[str, dict[str, Any] | None]) -> dict[str, dict[str, Any]]:
    """Write every choice made so far to choices.json, each with the time it was first made: a grid that
    grew past its edge and kept what it chose (its lr, or the plateau's steps) keeps that time."""
    path = out / "choices.json"
    known = json.loads(path.read_text()) if path.exists() else {}
    for key, choice in choices.items():
        if choice is None:
            continue
        if key in known and decided(known[key]) == decided(choice):
            choice = {**choice, "time": known[key]["time"]}
        known[key] = {**choice, "time": choice.get("time", time.time())}
    path.write_text(json.dumps(known, indent=1))
    return known


class Planner(Protocol):
    """What decides a study's jobs: experiments.plan.Plan, or another (experiments.curve.CurvePlan)."""

    def all_choices(self, results: dict[str, dict]) -> dict[str, dict[str, Any] | None]: ...

    def ready(self, results: dict[str, dict]) -> tuple[list[Job], bool]: ...

    def spares(self, results: dict[str, dict], running: set[str]) -> list[Job]: ...


class InOrder:
    """A plan of given jobs (experiments.compare's, experiments.leakage's): each once the runs it starts from
    or evaluates have finished, in the order given; nothing is chosen."""

    def __init__(self, jobs: list[Job]) -> None:
        self.jobs = jobs

    def all_choices(self, results: dict[str, dict]) -> dict[str, dict[str, Any] | None]:
        return {}

    def ready(self, results: dict[str, dict]) -> tuple[list[Job], bool]:
        left = [job for job in self.jobs if job.name not in results]
        return [job for job in left if all(name in results for name in Plan.needs(job))], not left

    def spares(self, results: dict[str, dict], running: set[str]) -> list[Job]:
        return []


def run_study(
    settings: Settings,
    out: Path,
    *,
    jobs: int,
    say: Any = print,
    plan: Planner | None = None,
    until: float | None = None,
) -> dict[str, dict]:
    """Run every job of the study not yet finished under `out`, `jobs` at a time, as `plan` (default
    the study's Plan) decides; returns all results. A slot that no ready job takes runs a job the plan
    may want later (its `spares`), and the study ends when those have ended too. With `until` (a
    time.time()), start only the jobs that experiments.timing expects to finish by then, longest first,
    and stop when none does."""
    out.mkdir(parents=True, exist_ok=True)
    plan = plan or Plan(settings)
    results = read_results(out)
    progress = Progress()
    attempts_path = out / "attempts.json"
    attempts = json.loads(attempts_path.read_text()) if attempts_path.exists() else []

    def note_progress() -> None:  # every job and minute too, so that a killed invocation still counts
        progress.end = time.time()
        attempts_path.write_text(json.dumps([*attempts, asdict(progress)], indent=1))

    note_progress()
    running: dict[str, Future[dict[str, Any]]] = {}
    failures: list[str] = []
    with worker_pool(jobs) as pool:
        while True:
            record_choices(out, plan.all_choices(results))
            ready, finished = plan.ready(results)
            if (finished or failures) and not running:
                break
            ahead = [name for name in running if name not in {job.name for job in ready}]  # spares not yet wanted
            spares = [job for job in plan.spares(results, set(running)) if job.name not in results]
            if until is not None:
                # a running job's checkpoint may be half written, and its estimate is not needed
                made = lambda job: 0 if job.name in running else steps_done(out, job)  # noqa: E731
                first = lambda job: None if job.name in running else remake_first(out, job)  # noqa: E731
                ready = fitting(ready, results, until - time.time(), made, first)
                spares = fitting(spares, results, until - time.time(), made, first)
            for job, spare in [(job, False) for job in ready] + [(job, True) for job in spares[:1]]:
                if len(running) >= jobs or failures or (spare and ahead):  # one spare at a time
                    break
                if job.name not in running:
                    say(f"study: start {job.name}" + (" (ahead: the plan may want it)" if spare else ""))
                    running[job.name] = pool.submit(run_job, job, out, settings)
            if not running and until is not None:
                say("study: no job that is ready can finish in the time left; stopping")
                break
            if not running:
                raise RuntimeError("the study cannot go on: no job is ready and none is running")
            done, _ = wait(list(running.values()), timeout=NOTE_SECONDS, return_when=FIRST_COMPLETED)
            note_progress()
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
