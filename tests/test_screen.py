"""The screen of levers (experiments.screen): which runs it makes, how each value's lr grid extends past
its edge, that each lever keeps the value best on validation (ties keep the one before), that an ordered
lever stops at the first value that does not beat the one before, that a recipe met again is not run
again, and that nothing reads the test set. Run end to end (--quick) by tests/test_readme.py, as
docs/training.md writes it."""

from __future__ import annotations

import argparse
import re
from collections.abc import Callable

from experiments.plan import Job
from experiments.screen import outline, screen_from
from experiments.screen_page import render
from experiments.screen_plan import ScreenPlan

Scores = Callable[[str], float]


def plan(quick: bool = False) -> ScreenPlan:
    return ScreenPlan(screen_from(argparse.Namespace(quick=quick)))


def option(job: Job, flag: str) -> str:
    return job.overrides[job.overrides.index(flag) + 1]


def run_until_ended(screen: ScreenPlan, score: Scores, limit: int = 400) -> dict[str, dict]:
    """Finish every ready job, a fit with validation top-1 `score(name)`, until the screen ends."""
    results: dict[str, dict] = {}
    for _ in range(limit):
        ready, ended = screen.ready(results)
        if ended:
            return results
        assert ready, "the screen waits for nothing"
        for job in ready:
            val = score(job.name) if job.name.startswith("b1000/") else None  # pretraining: no top-1
            results[job.name] = {"name": job.name, "kind": "fit", "val_accuracy": val, "wall_seconds": 1}
    raise AssertionError("the screen did not end")


def lr_of(name: str) -> float:
    return float(name.split("/lr")[1].split("/")[0])


def test_the_first_runs_are_todays_recipes_and_the_pretrainings_of_the_first_lever() -> None:
    screen = plan()
    ready, ended = screen.ready({})
    names = [job.name for job in ready]
    assert not ended
    # MPP first: the paper's pretraining and the first lever's other value, which need no choice; then
    # from scratch, the curve's plateau (10,100 steps), around the lr it chose there.
    assert names == [
        "pretrain/p2400/paper/seed0",
        "pretrain/p2400/ratio=0.75/seed0",
        *(f"b1000/scratch/paper/lr{lr}/seed0" for lr in ("0.0005", "0.001", "0.002")),
    ]
    assert [option(job, "--trainer.max_steps") for job in ready] == ["2400", "2400", "10100", "10100", "10100"]
    assert option(ready[1], "--model.init_args.corruption.ratio") == "0.75"
    for job in ready:
        assert not job.reads_test and option(job, "--data.test") == "null"
        assert option(job, "--data.val").endswith("train-{000055..000059}.tar")
        assert option(job, "--trainer.precision") == "32-true"
        assert int(option(job, "--trainer.max_steps")) % int(option(job, "--trainer.val_check_interval")) == 0
    # A fine-tuning run waits for its pretraining, and starts from its checkpoint.
    tune = screen.fit("mpp", {lever.name: lever.values[0] for lever in screen.c.levers["mpp"]}, 0.12)
    assert tune.name == "b1000/mpp/paper/paper/lr0.12/seed0"
    assert option(tune, "--model.init_args.pretrained") == "{run:pretrain/p2400/paper/seed0}"
    assert option(tune, "--trainer.max_steps") == "500" and option(tune, "--data.train").endswith("train-000000.tar")


def test_a_grid_whose_best_is_at_its_edge_extends_past_it_at_most_twice() -> None:
    screen = plan()
    recipe = {lever.name: lever.values[0] for lever in screen.c.levers["scratch"]}
    results: dict[str, dict] = {}

    def grid() -> tuple[list[float], dict | None]:
        wanted: list[Job] = []
        choice = screen.candidate("scratch", recipe, 1e-3, results, wanted)
        return list(dict.fromkeys(lr_of(job.name) for job in wanted)), choice

    lrs, choice = grid()
    assert lrs == [5e-4, 1e-3, 2e-3] and choice is None
    for lr in lrs:  # the larger the better: the grid grows upwards
        results[screen.fit("scratch", recipe, lr).name] = {"val_accuracy": lr}
    assert grid()[0][-1] == 4e-3
    results[screen.fit("scratch", recipe, 4e-3).name] = {"val_accuracy": 4e-3}
    results[screen.fit("scratch", recipe, 8e-3).name] = {"val_accuracy": 8e-3}
    lrs, choice = grid()
    assert lrs[-3:] == [2e-3, 4e-3, 8e-3] and len(lrs) == 5  # two extensions, then it chooses
    assert choice is not None and choice["lr"] == 8e-3 and choice["edge"]
    # A best inside the grid: chosen with no extension; equal scores go to the smaller lr.
    results.clear()
    for lr, val in zip([5e-4, 1e-3, 2e-3], [0.5, 0.7, 0.7]):
        results[screen.fit("scratch", recipe, lr).name] = {"val_accuracy": val}
    lrs, choice = grid()
    assert lrs == [5e-4, 1e-3, 2e-3] and choice == {
        "lr": 1e-3,
        "val_accuracy": 0.7,
        "grid": {"lr0.0005": 0.5, "lr0.001": 0.7, "lr0.002": 0.7},
        "edge": False,
    }


def test_each_lever_keeps_the_value_best_on_validation_and_ties_keep_the_one_before() -> None:
    screen = plan()
    # blocks helps, and so does layer decay 0.75 (by more than 0.85); adamw ties with sgd (not kept);
    # fine-tuning 1,100 steps helps and 2,900 does not: 10,100 is never run.
    wins = {"layout=blocks": 0.02, "layer_decay=0.75": 0.03, "layer_decay=0.85": 0.01, "steps=1100": 0.01,
            "steps=2900": -0.05}  # fmt: skip

    def score(name: str) -> float:
        """0.7 at each grid's centre (0.12 for SGD, 1e-3 for Adam), 0.6 elsewhere, plus each value's gain."""
        values = set(re.split("[/,]", name))
        return (0.7 if lr_of(name) in (1e-3, 0.12) else 0.6) + sum(wins.get(value, 0.0) for value in values)

    results = run_until_ended(screen, score)
    kept = {key: choice["value"] for key, choice in screen.all_choices(results).items() if choice}
    assert kept == {
        "mpp/ratio": "0.5",
        "mpp/layout": "blocks",
        "mpp/target": "mean_colour",
        "mpp/layer_decay": "0.75",
        "mpp/optimizer": "sgd",
        "mpp/drop_path": "0",
        "mpp/steps": "1100",
        "scratch/drop_path": "0",
        "scratch/steps": "10100",
    }
    names = set(results)
    assert not any("steps=10100" in name for name in names if name.startswith("b1000/mpp/"))
    assert any("steps=2900" in name for name in names)
    # The pretraining of a kept value is met again by the next lever, not made again.
    assert sorted(n for n in names if n.startswith("pretrain/")) == [
        "pretrain/p2400/layout=blocks,target=downsized_colour/seed0",
        "pretrain/p2400/layout=blocks/seed0",
        "pretrain/p2400/paper/seed0",
        "pretrain/p2400/ratio=0.75/seed0",
    ]
    # AdamW's grid is its own, around 1e-3.
    assert {lr_of(n) for n in names if "optimizer=adamw" in n} == {5e-4, 1e-3, 2e-3}
    # From scratch, 20,100 steps did not beat 10,100 (a tie): the plateau stays.
    assert any("/scratch/steps=20100/" in name for name in names)


def test_the_table_says_what_was_kept_and_that_the_test_set_was_not_read(tmp_path) -> None:
    screen = plan(quick=True)
    results = run_until_ended(screen, lambda name: 0.5)
    _, rows, ended = screen.screen(results)
    record = {
        "command": "python -m experiments.screen --quick",
        "settings": screen.c.as_dict(),
        "rows": rows,
        "kept": {"mpp": {"ratio": "0.5"}, "scratch": {}},
        "ended": ended,
        "machines": {"a CPU (32-true, 1 thread, torch 2)": 11},
        "test_reads": 0,
        "wall_hours": 0.1,
        "invocations": 1,
        "run_hours": 0.2,
    }
    table = render(record)
    assert "| mpp | ratio | 0.5 | 0.12 (0.12: 50.0) | 50.0 | yes |" in table
    assert "| mpp | ratio | 0.75 | 0.12 (0.12: 50.0) | 50.0 |  |" in table  # a tie keeps today's value
    assert "Kept so far: mpp: ratio=0.5; scratch: none yet." in table and "The screen has ended." in table
    assert "Test set: read 0 times" in table and "every run here is 32-true" in table


def test_the_plan_names_each_lever_and_counts_the_runs_of_the_first_grids() -> None:
    lines = outline(plan().c)
    assert "mpp: steps: 500 / 1100 / 2900 / 10100 (in order)" in lines
    assert "mpp: pretraining: 4 runs, 9,600 steps" in lines
    assert "scratch: fits: 9 runs, 120,900 steps" in lines


def test_a_finished_run_a_fit_starts_from_is_made_again_where_its_weights_are_not_here(tmp_path) -> None:
    """As after a ledger restored the screen on another machine: the numbers are there, the checkpoints not."""
    import json

    from experiments.jobs import last_checkpoint, read_results, run_folder
    from experiments.screen import remake_lost

    screen = plan()
    first = "pretrain/p2400/paper/seed0"
    for name in (first, "pretrain/p2400/ratio=0.75/seed0"):
        run_folder(tmp_path, name).mkdir(parents=True)
        (run_folder(tmp_path, name) / "result.json").write_text(json.dumps({"name": name, "kind": "fit"}))
    last_checkpoint(tmp_path, "pretrain/p2400/ratio=0.75/seed0").parent.mkdir()
    last_checkpoint(tmp_path, "pretrain/p2400/ratio=0.75/seed0").write_bytes(b"")
    # The paper's fine-tuning grid waits to start from the first; the other has its weights.
    assert remake_lost(screen, tmp_path) == [first]
    assert set(read_results(tmp_path)) == {"pretrain/p2400/ratio=0.75/seed0"}
    assert (run_folder(tmp_path, first) / "result.restored.json").exists()
    assert first in [job.name for job in screen.ready(read_results(tmp_path))[0]]
    assert remake_lost(screen, tmp_path) == []  # once: it is now a run to make like any other
