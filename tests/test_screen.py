"""The screen of levers (experiments.screen): which runs it makes, how each value's lr grid extends past
its edge, that each lever keeps the value best on validation (ties keep the one before), that an ordered
lever stops at the first value that does not beat the one before, that a recipe met again is not run
again, and that nothing reads the test set. Run end to end (--quick) by tests/test_readme.py, as
docs/training.md writes it."""

from __future__ import annotations

import argparse
import json
import re
from collections.abc import Callable

import pytest

from experiments.confirm_plan import ConfirmPlan
from experiments.plan import Job
from experiments.report import machine_counts
from experiments.screen import outline, screen_from
from experiments.screen_page import decimals, precision, render, render_confirmation
from experiments.screen_plan import ScreenPlan

Scores = Callable[[str], float]


def plan(quick: bool = False) -> ScreenPlan:
    return ScreenPlan(screen_from(argparse.Namespace(quick=quick)))


def option(job: Job, flag: str) -> str:
    return job.overrides[job.overrides.index(flag) + 1]


def run_until_ended(
    screen: ScreenPlan | ConfirmPlan, score: Scores, limit: int = 400, each: Callable[[dict], object] = lambda results: None
) -> dict[str, dict]:
    """Finish every ready job until the plan ends: a fit with validation top-1 `score(name)`, a test with
    test top-1 `score(name)`, a frozen evaluation with k-NN and probe top-1 `score(name)`; `each(results)`
    at every turn."""
    results: dict[str, dict] = {}
    for _ in range(limit):
        screen.all_choices(results)  # as the runner records them at every turn
        each(results)
        ready, ended = screen.ready(results)
        if ended:
            return results
        assert ready, "the screen waits for nothing"
        for job in ready:
            result = {"name": job.name, "kind": job.kind, "wall_seconds": 1}
            if job.kind == "test":
                result["test_accuracy"] = score(job.name)
            elif job.kind == "frozen":
                result["frozen"] = {"knn": score(job.name), "linear": score(job.name)}
            else:  # pretraining: a loss, no top-1
                top1 = job.name.startswith("b1000/")
                result |= {"val_accuracy": score(job.name) if top1 else None, "val_loss": None if top1 else 0.5}
            results[job.name] = result
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
        "machines": machine_counts(ran_on(True, False), pinned=precision(screen.c.as_dict())),
        "test_reads": 0,
        "wall_hours": 0.1,
        "invocations": 1,
        "run_hours": 0.2,
    }
    table = render(record)
    assert "| mpp | ratio | 0.5 | 0.12 (0.12: 50.0) | 50.0 | yes |" in table
    assert "| mpp | ratio | 0.75 | 0.12 (0.12: 50.0) | 50.0 |  |" in table  # a tie keeps today's value
    assert "Kept so far: mpp: ratio=0.5; scratch: none yet." in table and "The screen has ended." in table
    assert "Test set: read 0 times" in table
    assert "Runs computed on: a CPU (with bf16 instructions; 32-true, 1 thread, torch 2): 1 run; " in table
    assert "a CPU (without bf16 instructions; 32-true, 1 thread, torch 2): 1 run." in table


def ran_on(*bf16s: bool) -> dict[str, dict]:
    """Results of one run per machine entry, each on a CPU with or without bf16 instructions."""
    machine = {"cpu": "a CPU", "threads": 1, "torch": "2"}
    return {f"run{i}": {"machines": [{**machine, "bf16": bf16, "precision": "bf16-mixed" if bf16 else "32-true"}]}
            for i, bf16 in enumerate(bf16s)}  # fmt: skip


def test_machine_counts_name_the_precision_a_study_pins_and_else_the_one_the_cpu_takes():
    assert machine_counts(ran_on(True, False)) == {
        "a CPU (bf16-mixed, 1 thread, torch 2)": 1, "a CPU (32-true, 1 thread, torch 2)": 1}  # fmt: skip
    assert machine_counts(ran_on(True, True), pinned="32-true") == {
        "a CPU (with bf16 instructions; 32-true, 1 thread, torch 2)": 2}  # fmt: skip


def test_a_lever_won_by_less_than_the_page_rounds_to_prints_two_decimals() -> None:
    row = {"arm": "scratch", "lever": "drop_path", "lr": 1e-3, "grid": {"lr0.001": 0.8098}, "edge": False}
    rows = [{**row, "value": "0", "val_accuracy": 0.8098, "chosen": False},
            {**row, "value": "0.1", "val_accuracy": 0.8104, "chosen": True},
            {**row, "lever": "steps", "value": "500", "val_accuracy": 0.8104, "chosen": True}]  # fmt: skip
    assert decimals(rows) == {("scratch", "drop_path"): 2, ("scratch", "steps"): 1}


def test_the_plan_names_each_lever_and_counts_the_runs_of_the_first_grids() -> None:
    lines = outline(plan().c)
    assert "mpp: steps: 500 / 1100 / 2900 / 10100 (in order)" in lines
    assert "mpp: pretraining: 4 runs, 9,600 steps" in lines
    assert "scratch: fits: 9 runs, 120,900 steps" in lines
    assert "MPP's kept recipe pretrained 9,600 and 38,400 steps with seeds 0, 1, 2 (6 runs, 144,000 steps)" in lines[-1]


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
    assert remake_lost(ConfirmPlan(screen.c), tmp_path) == [first]
    assert set(read_results(tmp_path)) == {"pretrain/p2400/ratio=0.75/seed0"}
    assert (run_folder(tmp_path, first) / "result.restored.json").exists()
    assert first in [job.name for job in screen.ready(read_results(tmp_path))[0]]
    assert remake_lost(ConfirmPlan(screen.c), tmp_path) == []  # once: it is now a run to make like any other


def test_once_the_screen_has_ended_it_confirms_what_it_kept_on_the_test_set(tmp_path) -> None:
    from experiments.finals import audit
    from experiments.screen_page import confirmed

    screen = plan()
    confirm = ConfirmPlan(screen.c)
    # ratio 0.75, drop path and 2,900 fine-tuning steps help MPP; drop path helps from scratch. On the test set MPP at
    # 9,600 steps is level with from scratch (seed by seed +-1 point: the interval holds zero), at 38,400 ahead.
    wins = {"ratio=0.75": 0.02, "steps=1100": 0.01, "steps=2900": 0.02, "drop_path=0.1": 0.01}

    def score(name: str) -> float:
        if name.endswith("/test"):
            seed = int(name.split("/seed")[1].split("/")[0])
            mpp = "/mpp/" in name
            return 0.8 + (0.1 if "/p38400/" in name else (0.01 if seed % 2 else -0.01)) * mpp
        if name.startswith("frozen/"):
            return 0.7
        values = set(re.split("[/,]", name))
        return (0.7 if lr_of(name) in (1e-3, 0.12) else 0.6) + sum(wins.get(value, 0.0) for value in values)

    before = run_until_ended(screen, score)
    # Until the screen's last run has finished, nothing reads the test set. What the confirmation will run
    # anyway waits behind the screen's runs: MPP's longer pretraining once its pretraining levers have chosen.
    unfinished = dict(list(before.items())[:-1])
    wanted = [job.name for job in confirm.wanted(unfinished)[0]]
    assert not any(job.reads_test for job in confirm.wanted(unfinished)[0])
    own = list(dict.fromkeys(job.name for job in confirm.screen.screen(unfinished)[0]))
    assert wanted[: len(own)] == own
    assert wanted[len(own) : len(own) + 6] == [
        f"pretrain/p{budget}/ratio=0.75/seed{seed}" for budget in (9600, 38400) for seed in range(3)
    ]
    decided = {name: result for name, result in before.items() if "layer_decay" not in name and "optimizer" not in name
               and "drop_path" not in name and "steps=" not in name and not name.startswith("b1000/scratch/")}  # fmt: skip
    early = confirm.confirmation(decided)
    assert early is not None and early.recipes == {} and early.pretrained is not None
    assert "pretrain/p9600/ratio=0.75/seed0" in [job.name for job in confirm.wanted(decided)[0]]
    # From scratch's finals start once its own screen has ended, before MPP's has; their tests wait.
    scratch_done = {**decided, **{name: result for name, result in before.items() if name.startswith("b1000/scratch/")}}
    names = [job.name for job in confirm.wanted(scratch_done)[0]]
    assert "b1000/scratch/drop_path=0.1/lr0.001/seed1" in names and not any(name.endswith("/test") for name in names)
    pages = []  # the page at every turn, as a screen that stops there writes it

    def page(results: dict[str, dict]) -> None:
        found = confirmed(confirm, tmp_path, results)
        pages.append(render_confirmation(found, screen.c.as_dict()["confirm"]) if found else None)

    results = run_until_ended(confirm, score, each=page)
    assert set(before) <= set(results) and pages[0] is None and pages[-1] is not None
    found = confirm.confirmation(results)
    assert found is not None and found.recipes == {
        "mpp": ({"ratio": "0.75", "layout": "scattered", "target": "mean_colour", "layer_decay": "1",
                 "optimizer": "sgd", "drop_path": "0.1", "steps": "2900"}, 0.12),
        "scratch": ({"drop_path": "0.1", "steps": "10100"}, 1e-3),
    }  # fmt: skip
    new = sorted(set(results) - set(before))
    # MPP's recipe pretrained with each seed at both budgets; 9,600 widened to 5 seeds, 38,400 not.
    assert [n for n in new if n.startswith("pretrain/")] == [
        *(f"pretrain/p38400/ratio=0.75/seed{seed}" for seed in range(3)),
        *(f"pretrain/p9600/ratio=0.75/seed{seed}" for seed in range(5)),
    ]
    for name in (f"pretrain/p9600/ratio=0.75/seed{seed}" for seed in range(5)):
        job = next(job for job in confirm.wanted(results)[0] if job.name == name)
        assert option(job, "--trainer.max_steps") == "9600" and option(job, "--model.init_args.corruption.ratio") == "0.75"
    # Its lr chosen at each budget from a grid around the screen's (0.12), seed 0, then the finals.
    tuned = [n for n in new if n.startswith("b1000/mpp/p9600/") and not n.endswith("/test")]
    assert tuned == sorted(
        [f"b1000/mpp/p9600/ratio=0.75/drop_path=0.1,steps=2900/lr{lr}/seed0" for lr in ("0.06", "0.12", "0.24")]
        + [f"b1000/mpp/p9600/ratio=0.75/drop_path=0.1,steps=2900/lr0.12/seed{seed}" for seed in range(1, 5)]
    )
    fit = next(job for job in confirm.wanted(results)[0] if job.name.endswith("/lr0.12/seed4") and "p9600" in job.name)
    assert option(fit, "--model.init_args.pretrained") == "{run:pretrain/p9600/ratio=0.75/seed4}"
    assert option(fit, "--trainer.max_steps") == "2900"
    # From scratch: the screen's run is its first seed; seeds 1-4 at the screen's lr; the test of each.
    scratch = [n for n in new if n.startswith("b1000/scratch/")]
    assert scratch == sorted(
        ["b1000/scratch/drop_path=0.1/lr0.001/seed0/test"]
        + [f"b1000/scratch/drop_path=0.1/lr0.001/seed{seed}{test}" for seed in range(1, 5) for test in ("", "/test")]
    )
    # The test set: each final run's test and each pretraining run's frozen evaluation, once, after the choices.
    choices = {point: {**choice, "time": 0.0} for point, choice in found.jobs(results, []).items()}
    reads = [{"job": name, "time": 1.0} for name, result in results.items() if result["kind"] in ("test", "frozen")]
    widened = found.widened(choices, results)
    assert widened == {"mpp/p9600", "scratch/s10100"} and len(reads) == 5 + 3 + 5 + 3 + 5
    assert audit(found, choices, reads, widened)["problems"] == []
    assert not any(name.endswith("/test") or name.startswith("frozen/") for name in before)


def test_the_confirmation_says_each_point_over_its_seeds_and_the_difference_it_measured(tmp_path) -> None:
    from experiments.screen_page import confirmed

    screen = plan(quick=True)
    confirm = ConfirmPlan(screen.c)
    results = run_until_ended(confirm, lambda name: 0.9 if "/mpp/" in name and name.endswith("/test") else 0.5)
    from experiments.jobs import run_folder

    for name, result in results.items():
        run_folder(tmp_path, name).mkdir(parents=True, exist_ok=True)
        (run_folder(tmp_path, name) / "result.json").write_text(json.dumps(result))
    found = confirmed(confirm, tmp_path, results)
    assert found is not None and list(found["points"]) == ["mpp/p8", "scratch/s8"]
    assert found["differences"]["8"]["mean"] == pytest.approx(0.4) and found["test_set"]["reads"] == 0
    assert found["test_set"]["evaluations"] == 2 + 2 + 2  # two tests each, two frozen encoders
    record = {"settings": screen.c.as_dict(), "confirmation": found}
    lines = render_confirmation(found, record["settings"]["confirm"])
    assert "| MPP pretrained 8 steps | 0.12 (0.12: 50.0) | 2 | 50.0 ± 0.0 | 90.0 ± 0.0 [90.0, 90.0] | 50.0 ± 0.0 | 50.0 ± 0.0 |" in lines
    assert "| from scratch, 8 steps | 0.001 (the screen's) | 2 | 50.0 ± 0.0 | 50.0 ± 0.0 [50.0, 50.0] |  |  |" in lines
    assert "MPP − from scratch (test top-1, paired over seeds): pretrained 8 steps: +40.0 pts [+40.0, +40.0]." in lines


def test_the_run_time_is_told_by_part() -> None:
    from experiments.screen_page import run_hours_by_part

    results = {name: {"kind": kind, "wall_seconds": 1800} for name, kind in (
        ("pretrain/p2400/paper/seed0", "fit"), ("pretrain/p9600/paper/seed1", "fit"),
        ("b1000/mpp/paper/paper/lr0.12/seed0", "fit"), ("b1000/mpp/p9600/paper/paper/lr0.12/seed1/test", "test"),
        ("b1000/scratch/paper/lr0.001/seed0", "fit"), ("frozen/pretrain/p9600/paper/seed1", "frozen"))}  # fmt: skip
    assert run_hours_by_part(results) == {
        "MPP pretraining": 1.0, "MPP fine-tuning": 0.5, "test-set evaluations": 1.0, "from scratch": 0.5,
    }  # fmt: skip


def test_a_confirmation_under_way_says_what_it_knows(tmp_path) -> None:
    """From scratch's screen has ended, MPP's has not: its recipe and no point yet, and a page to show."""
    from experiments.screen_page import confirmed

    screen = plan()
    confirm = ConfirmPlan(screen.c)
    before = run_until_ended(screen, lambda name: 0.7 if lr_of(name) in (1e-3, 0.12) else 0.6)
    partial = {name: result for name, result in before.items() if not ("/mpp/" in name and "steps=" in name)}
    found = confirmed(confirm, tmp_path, partial)
    assert found is not None and list(found["recipes"]) == ["scratch"] and found["points"] == {}
    lines = render_confirmation(found, screen.c.as_dict()["confirm"])
    assert "The recipes kept: scratch drop_path=0, steps=10100 (lr 0.001)." in lines[2]
    assert any(line.startswith("| no point measured yet") for line in lines)
    assert "MPP − from scratch (test top-1, paired over seeds): not measured yet." in lines
