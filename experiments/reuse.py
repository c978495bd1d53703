"""What a study takes from work already done: its own folder under settings with arms added
(`extends`, arms.json), the finished runs of another study that it would run exactly alike (`reuse_runs`,
hard links), or the numbers of a finished study that ran, chose and scored all of its runs alike (`covers`)."""

from __future__ import annotations

import json
import os
import shutil
import time
from pathlib import Path
from typing import Any

from experiments.jobs import read_results, run_folder
from experiments.plan import Job, Plan
from experiments.settings import FIRST_ARMS, Settings


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
