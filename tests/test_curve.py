"""The pretraining-budget curve (experiments.curve): which runs it makes and in which order, how its
learning-rate grids extend past their edge, how the from-scratch plateau and the matched-compute arm are
read from one grid of step counts, and that only final evaluations read the test set (a final run's
test after its point's choice). Run end to end (--quick) by tests/test_readme.py, as docs/studies.md writes it."""

from __future__ import annotations

import argparse
import dataclasses
import json
from pathlib import Path

import pytest
import torch

from experiments.curve import curve_from, extends, without_time
from experiments.curve_page import render, within_budgets
from experiments.curve_plan import Curve, CurvePlan, next_lr, outline, val_every
from experiments.curve_report import (
    conclusions,
    hybrid_plateau,
    loss_correlation,
    summarise_curve,
)
from experiments.finals import audit
from experiments.jobs import (
    checkpoint_of,
    last_checkpoint,
    needs_remake,
    read_results,
    remake_first,
    run_folder,
    run_job,
    steps_done,
)
from experiments.ledger import ledger_of, restore, write_ledger
from experiments.plan import Job
from experiments.runner import record_choices, run_study
from experiments.timing import elapsed, estimate, fitting


def full(**changes: object) -> Curve:
    args = argparse.Namespace(quick=False, budgets=None, seeds=None, supervised=True, hybrid=True)
    for key, value in changes.items():
        setattr(args, key, value)
    return curve_from(args)


def finish(results: dict[str, dict], name: str, val: float | None = 0.5, **more: object) -> None:
    results[name] = {"name": name, "kind": "fit", "val_accuracy": val, "wall_seconds": 1.0, **more}


def test_the_default_curve_its_points_and_its_outline() -> None:
    curve = full()
    assert curve.budgets == (600, 2400, 9600) and curve.study.seeds == (0, 1, 2)
    # The from-scratch step grid: the fine-tuning steps alone, and matched to each budget's pretraining.
    assert curve.scratch_steps == [500, 1100, 2900, 10100]
    assert "scratch/s1100" in curve.points() and "supervised/p9600" in curve.points()
    assert "mpp/p600" in full(supervised=False).points() and "supervised/p600" not in full(supervised=False).points()
    lines = outline(curve)
    assert "pretrain: 9 runs, 37,800 steps" in lines and "b1000/scratch: 16 runs, 58,400 steps" in lines


@pytest.mark.parametrize(("steps", "every"), [(500, 100), (600, 100), (1100, 100), (2900, 116), (9600, 384),
                                              (10100, 404), (4, 4), (7, 7)])  # fmt: skip
def test_every_run_validates_often_and_at_its_last_step(steps: int, every: int) -> None:
    assert val_every(steps) == every and steps % every == 0


def test_a_grid_extends_past_the_edge_its_best_is_at_until_the_best_is_inside() -> None:
    plan, results = CurvePlan(full()), {}
    point = "mpp/p600"
    assert plan.grid(point, results) == ([0.03, 0.06], None)
    finish(results, plan.fit(point, 0.03, 0).name, 0.70)
    finish(results, plan.fit(point, 0.06, 0).name, 0.72)
    lrs, choice = plan.grid(point, results)
    assert lrs == [0.03, 0.06, 0.12] and choice is None  # the best at the top: one more, twice as large
    finish(results, plan.fit(point, 0.12, 0).name, 0.71)
    lrs, choice = plan.grid(point, results)
    assert lrs == [0.03, 0.06, 0.12] and choice is not None
    assert choice["lr"] == 0.06 and choice["extended"] == 1 and not choice["edge"]
    # At the bottom it extends downwards; after `extensions` it stops, and says it stopped at the edge.
    scratch = "scratch/s500"
    for lr in (1e-3, 3e-3):
        finish(results, plan.fit(scratch, lr, 0).name, 0.8 if lr == 1e-3 else 0.7)
    three = CurvePlan(dataclasses.replace(full(), extensions=3))
    for low in (3.33e-4, 1.11e-4, 3.7e-5):
        assert three.grid(scratch, results)[0][0] == low == plan.grid(scratch, results)[0][0]
        finish(results, plan.fit(scratch, low, 0).name, 0.9)
    lrs, choice = three.grid(scratch, results)
    assert lrs == [3.7e-5, 1.11e-4, 3.33e-4, 1e-3, 3e-3] and choice is not None
    assert choice["lr"] == 3.7e-5 and choice["edge"] and choice["extended"] == 3  # ties go to the smaller lr
    assert plan.c.extensions == 6 and plan.grid(scratch, results) == ([1.23e-5, *lrs], None)  # the default goes on
    assert next_lr(0.03, 0.06) == 0.12 and next_lr(3e-3, 1e-3) == 0.000333


def test_jobs_start_with_the_cheapest_points_and_no_fit_reads_the_test_set() -> None:
    plan = CurvePlan(full())
    ready, finished = plan.ready({})
    assert not finished
    names = [job.name for job in ready]
    # Before anything ran: the 500-step from-scratch grids (the ViT's, the hybrid's), then the 600-step
    # pretraining, ...
    assert names[:4] == [f"b1000/{arm}/s500/lr{lr}/seed0" for arm in ("scratch", "hybrid") for lr in ("0.001", "0.003")]
    assert names[4:10] == [f"{kind}/p600/seed{s}" for kind in ("pretrain", "supervised") for s in (0, 1, 2)]
    assert names[10:12] == ["b1000/scratch/s1100/lr0.001/seed0", "b1000/scratch/s1100/lr0.003/seed0"]
    assert names[-1].startswith("b1000/hybrid/s10100/")  # the longest runs last
    assert not any(job.reads_test for job in ready)
    for job in ready:
        assert job.kind == "fit" and "--data.test" in job.overrides
        assert job.overrides[job.overrides.index("--data.test") + 1] == "null"
        assert job.overrides[job.overrides.index("--data.val") + 1].endswith("train-{000055..000059}.tar")
    # A fine-tuning run waits for its pretraining run; it starts from that run's checkpoint.
    tune = plan.fit("mpp/p2400", 0.03, 1)
    assert plan.needs(tune) == ["pretrain/p2400/seed1"] and tune.name not in names
    assert tune.overrides[tune.overrides.index("--trainer.max_steps") + 1] == "500"
    supervised = next(job for job in plan.pretraining() if job.name == "supervised/p9600/seed2")
    assert supervised.overrides[supervised.overrides.index("--data.train") + 1].endswith("train-{000001..000054}.tar")


def made_up_test_accuracy(name: str) -> float:
    """A made-up test top-1: each arm its own, a little higher for each seed (so differences have std 0)."""
    seed = int(name.split("/seed")[1].split("/")[0])
    return {"mpp": 0.75, "supervised": 0.78, "scratch": 0.70, "hybrid": 0.73}[name.split("/")[1]] + 0.001 * seed


def choose_everything(
    plan: CurvePlan, results: dict[str, dict], val_by_steps: dict[int, float], test=made_up_test_accuracy
) -> None:
    """Finish every run a curve wants, the middle lr best, from-scratch validation by step count."""
    for _ in range(50):
        ready, finished = plan.ready(results)
        if finished:
            return
        for job in ready:
            if job.kind == "fit":
                steps = int(job.overrides[job.overrides.index("--trainer.max_steps") + 1])
                lr = (
                    float(job.overrides[job.overrides.index("--model.init_args.optimizer.lr") + 1])
                    if "/lr" in job.name
                    else 0
                )
                middle = lr in (0.06, 3e-3)
                finish(results, job.name, val_by_steps.get(steps, 0.5) + (0.01 if middle else 0), val_loss=1.0 / steps)
            elif job.kind == "test":
                results[job.name] = {
                    "name": job.name,
                    "kind": "test",
                    "test_accuracy": test(job.name),
                    "wall_seconds": 1.0,
                }
            else:
                results[job.name] = {"name": job.name, "kind": "frozen", "frozen": {"knn": 0.5, "linear": 0.6}}
    raise AssertionError("the curve never finished")


def summarise_points(plan: CurvePlan, results: dict[str, dict], choices: dict) -> dict[str, dict]:
    """The chosen points' numbers as the report has them (experiments.curve_report._point)."""
    from experiments.curve_report import _point

    return {point: _point(plan, point, choice, results, plan.c.study.seeds) for point, choice in choices.items()
            if choice and not point.endswith("/plateau")}  # fmt: skip


def test_the_plateau_is_the_step_count_best_on_validation_and_matched_compute_is_read_from_the_same_grid() -> None:
    plan, results = CurvePlan(full(budgets=[600, 2400])), {}
    choose_everything(plan, results, {500: 0.60, 1100: 0.70, 2900: 0.70})
    choices = plan.all_choices(results)
    plateau = choices["scratch/plateau"]
    assert plateau is not None and plateau["steps"] == 1100 and not plateau["edge"]  # a tie goes to fewer steps
    assert plateau["lr"] == 3e-3 and set(plateau["val_accuracy"]) == {"500", "1100", "2900"}
    # The hybrid goes over the same step grid, from scratch with its own config, to its own plateau.
    hybrid = choices["hybrid/plateau"]
    assert hybrid is not None and hybrid["steps"] == 1100 and hybrid["lr"] == 3e-3
    job = plan.fit("hybrid/s2900", 1e-3, 1)
    assert job.config == "configs/scratch/demo_hybrid.yaml" and not plan.needs(job)
    assert job.overrides[job.overrides.index("--trainer.max_steps") + 1] == "2900"
    entry = hybrid_plateau(summarise_points(plan, results, choices), choices)
    assert entry is not None and entry["steps"] == 1100
    assert entry["hybrid - plateau"]["mean"] == pytest.approx(0.03) and entry["hybrid - plateau"]["n"] == 3
    assert not any(job.reads_test for job in plan.evaluations("hybrid/s1100", 3e-3) if job.kind == "frozen")
    # Every point's finals have a test; the pretrained points' encoders a frozen evaluation each.
    tests = [name for name in results if name.endswith("/test")]
    assert len(tests) == 3 * len(plan.c.points()) and len([n for n in results if n.startswith("frozen/")]) == 3 * 4
    # No extra runs for matched compute: a budget's matched arm is the from-scratch run of its length.
    assert not any("matched" in name for name in results)
    # With a step count added, the plateaus may move; the runs made stay.
    grown = CurvePlan(full(budgets=[600, 2400, 9600]))
    assert grown.all_choices(results)["scratch/plateau"] is None and grown.all_choices(results)["hybrid/plateau"] is None
    assert all(name in {j.name for j in grown.jobs(results)[0]} for name in results if "p9600" not in name)


def test_the_audit_flags_reads_that_are_no_evaluation_are_repeated_or_come_before_their_choice() -> None:
    plan, results = CurvePlan(full(budgets=[600])), {}
    choose_everything(plan, results, {})
    choices = {key: {**value, "time": 100.0} for key, value in plan.all_choices(results).items() if value}
    evaluations = [
        job.name for point in ("mpp/p600", "scratch/s500") for job in plan.evaluations(point, choices[point]["lr"])
    ]
    reads = [{"job": name, "time": 200.0} for name in evaluations]
    assert audit(plan, choices, reads)["problems"] == []
    late = audit(plan, choices, [*reads, {"job": "b1000/scratch/s500/lr0.001/seed0", "time": 300.0},
                                 {"job": evaluations[0], "time": 50.0}])  # fmt: skip
    assert late["problems"] == [
        "b1000/scratch/s500/lr0.001/seed0 read the test set but is no final evaluation",
        f"{evaluations[0]} read the test set before its point's choice",
        f"{evaluations[0]} read the test set 2 times",
    ]
    # A frozen encoder's evaluation depends on no choice: read before it, it is no problem.
    frozen = [{"job": read["job"], "time": 50.0 if read["job"].startswith("frozen/") else 200.0} for read in reads]
    assert any(read["time"] == 50.0 for read in frozen) and audit(plan, choices, frozen)["problems"] == []
    # A test of a final run whose point chose another lr after the read (its grid grew past its edge)
    other = "0.01" if choices["mpp/p600"]["lr"] != 0.01 else "0.02"
    stale = f"b1000/mpp/p600/lr{other}/seed1/test"
    assert audit(plan, choices, [*reads, {"job": stale, "time": 150.0}])["problems"] == [
        f"{stale} read the test set at lr{other}, which its point no longer chooses"
    ]


def test_conclusions_say_no_more_than_the_intervals() -> None:
    def diff(low: float, high: float) -> dict[str, float]:
        return {"mean": (low + high) / 2, "low": low, "high": high}

    rows = {
        "600": {"differences": {"mpp - plateau": diff(-0.02, 0.01), "mpp - matched": diff(-0.05, -0.01)}},
        "2400": {"differences": {"mpp - plateau": diff(0.005, 0.03), "mpp - matched": diff(-0.02, 0.01)}},
    }
    found = conclusions(full(budgets=[600, 2400]), rows)
    assert found["mpp - plateau"].endswith(
        "ahead with a 95% interval clear of zero from 2,400 pretraining steps on; an interval that holds zero at "
        "600 pretraining steps"
    )
    assert found["mpp - matched"].endswith(
        "behind with a 95% interval clear of zero at 600 pretraining steps; an interval that holds zero at 2,400 "
        "pretraining steps"
    )
    assert found["supervised - mpp"].endswith("not measured yet")
    # "from N on" only where every budget from N on is measured and clear
    assert conclusions(full(budgets=[2400, 9600]), {"2400": rows["2400"]})["mpp - plateau"].endswith(
        "ahead with a 95% interval clear of zero at 2,400 pretraining steps; not measured yet at 9,600 pretraining steps"
    )
    rows["600"]["differences"]["mpp - plateau"] = diff(0.001, 0.02)
    assert conclusions(full(budgets=[600, 2400]), rows)["mpp - plateau"].endswith(
        "ahead with a 95% interval clear of zero from 600 pretraining steps on"
    )
    rows["2400"]["differences"]["mpp - plateau"] = diff(-0.01, 0.03)
    assert conclusions(full(budgets=[600, 2400]), rows)["mpp - plateau"].endswith(
        "ahead with a 95% interval clear of zero at 600 pretraining steps; an interval that holds zero at 2,400 "
        "pretraining steps"
    )
    points = {"mpp/p600": {"pretrain_val_loss": {"values": [1.0, 0.9]}, "test_accuracy": {"values": [0.6, 0.7]}}}
    assert loss_correlation(full(budgets=[600, 2400]), points) is None  # one budget: seeds only
    points["mpp/p2400"] = {"pretrain_val_loss": {"values": [0.8, 0.7]}, "test_accuracy": {"values": [0.8, 0.9]}}
    within = {"600": {"n": 2, "pearson_r": None}, "2400": {"n": 2, "pearson_r": None}}  # 2 seeds: no r of their own
    assert loss_correlation(full(budgets=[600, 2400]), points) == {"n": 4, "pearson_r": pytest.approx(-1.0), "within": within}
    # Within a budget of 3 seeds the loss may rank them the other way round from the budgets.
    points["mpp/p2400"] = {"pretrain_val_loss": {"values": [0.8, 0.7, 0.75]}, "test_accuracy": {"values": [0.9, 0.8, 0.85]}}
    correlation = loss_correlation(full(budgets=[600, 2400]), points)
    assert correlation is not None and correlation["pearson_r"] < 0
    assert correlation["within"]["2400"] == {"n": 3, "pearson_r": pytest.approx(1.0)}
    assert within_budgets(correlation["within"]) == "; within a budget (its seeds only): 2,400: +1.00 (3)"


def test_a_curve_goes_on_with_budgets_added_but_not_with_other_settings(tmp_path: Path) -> None:
    saved = json.loads(json.dumps(full(budgets=[600, 2400]).as_dict()))
    assert extends(saved, full(budgets=[600, 2400])) and extends(saved, full())
    assert not extends(saved, full(budgets=[600])) and not extends(saved, full(seeds=5))
    # A curve saved when its grids extended at most 3 times goes on with 6 (its grids at the edge grow on),
    # not the other way round.
    fewer = json.loads(json.dumps(dataclasses.replace(full(), extensions=3).as_dict()))
    assert extends(fewer, full()) and not extends(saved, dataclasses.replace(full(), extensions=3))
    # A curve saved before the hybrid was in it goes on with the hybrid added, not the other way round.
    before = {key: value for key, value in saved.items() if key != "hybrid"}
    assert extends(before, full(budgets=[600, 2400])) and not extends(saved, full(budgets=[600, 2400], hybrid=False))


def test_a_grid_that_grows_and_keeps_its_choice_keeps_the_time_it_was_made(tmp_path: Path, monkeypatch) -> None:
    """A test read after a point's choice stays after it when the grid grows past its edge and the new
    value loses; when the new value wins, the choice is new and so is its time."""
    clock = iter(range(100, 200))
    monkeypatch.setattr("experiments.runner.time.time", lambda: float(next(clock)))
    choice = {"lr": 0.00375, "seed": 0, "val_accuracy": {"lr0.00375": 0.86, "lr0.0075": 0.85}, "extended": 3,
              "edge": True}  # fmt: skip
    first = record_choices(tmp_path, {"supervised/p9600": choice})["supervised/p9600"]["time"]
    grown = {**choice, "val_accuracy": {"lr0.001875": 0.84, **choice["val_accuracy"]}, "extended": 4, "edge": False}
    kept = record_choices(tmp_path, {"supervised/p9600": None})["supervised/p9600"]  # while the grid grows
    assert kept["time"] == first and kept["extended"] == 3
    kept = record_choices(tmp_path, {"supervised/p9600": grown})["supervised/p9600"]
    assert kept["time"] == first and kept["extended"] == 4 and "lr0.001875" in kept["val_accuracy"]
    moved = {**grown, "lr": 0.001875, "val_accuracy": {**grown["val_accuracy"], "lr0.001875": 0.87}}
    assert record_choices(tmp_path, {"supervised/p9600": moved})["supervised/p9600"]["time"] > first
    plateau = {"steps": 2900, "lr": 0.001, "val_accuracy": {"2900": 0.79}, "edge": True}
    first = record_choices(tmp_path, {"scratch/plateau": plateau})["scratch/plateau"]["time"]
    longer = {**plateau, "steps": 10100, "val_accuracy": {"2900": 0.79, "10100": 0.80}}  # the same lr, not the same choice
    assert record_choices(tmp_path, {"scratch/plateau": longer})["scratch/plateau"]["time"] > first


def test_the_points_of_a_difference_whose_interval_holds_zero_get_two_more_seeds() -> None:
    """MPP and supervised alike on every seed: their difference's interval holds zero, so both get seeds 3
    and 4 (pretraining, fine-tuning, tests, frozen encoders); the from-scratch points, clear of MPP, do not."""
    plan, results = CurvePlan(full(budgets=[600])), {}

    def alike(name: str) -> float:
        return made_up_test_accuracy(name.replace("/supervised/", "/mpp/"))

    choose_everything(plan, results, {500: 0.6}, test=alike)
    choices = {key: {**value, "time": 0.0} for key, value in plan.all_choices(results).items() if value}
    assert plan.widened(choices, results) == {"mpp/p600", "supervised/p600"}
    for seed in (3, 4):
        assert f"pretrain/p600/seed{seed}" in results and f"supervised/p600/seed{seed}" in results
        assert f"frozen/pretrain/p600/seed{seed}" in results
        assert f"b1000/mpp/p600/lr0.06/seed{seed}/test" in results
    assert not any("seed3" in name for name in results if "/scratch/" in name or "/hybrid/" in name)
    assert ("plateau", "hybrid/s500", "scratch/s500") in plan.pairs(choices)  # clear of zero: 3 seeds each
    reads = [{"job": name, "time": 1.0} for name in results if name.endswith("/test") or name.startswith("frozen/")]
    assert audit(plan, choices, reads, plan.widened(choices, results))["problems"] == []
    assert (
        "frozen/pretrain/p600/seed4 read the test set but is no final evaluation"
        in audit(plan, choices, reads)["problems"]
    )
    # The hybrid and the ViT from scratch alike at their plateaus: both get seeds 3 and 4 there.
    plan, results = CurvePlan(full(budgets=[600], supervised=False)), {}
    choose_everything(plan, results, {500: 0.6}, test=lambda name: made_up_test_accuracy(name.replace("/hybrid/", "/scratch/")))
    choices = {key: {**value, "time": 0.0} for key, value in plan.all_choices(results).items() if value}
    assert {"hybrid/s500", "scratch/s500"} <= plan.widened(choices, results)
    assert "b1000/hybrid/s500/lr0.003/seed4/test" in results and "b1000/scratch/s500/lr0.003/seed4/test" in results


def test_a_ledger_brings_a_curves_finished_runs_to_a_fresh_run_folder(tmp_path: Path) -> None:
    """What a run folder knows (results, choices with their times, test reads, invocations) comes back from
    its ledger alone into an empty folder, and into one that holds some of it, without doubling anything;
    the plan then wants nothing more. A restored run has no checkpoint: a job starting from it says so."""
    curve = full(budgets=[600])
    plan, results, settings = CurvePlan(curve), {}, json.loads(json.dumps(curve.as_dict()))
    choose_everything(plan, results, {500: 0.6, 1100: 0.7})
    made = tmp_path / "made"
    for name, result in results.items():
        run_folder(made, name).mkdir(parents=True)
        (run_folder(made, name) / "result.json").write_text(json.dumps(result))
    choices = {key: {**value, "time": 1.0} for key, value in plan.all_choices(results).items() if value}
    (made / "choices.json").write_text(json.dumps(choices))
    reads = [{"job": name, "time": 2.0} for name in results if name.endswith("/test") or name.startswith("frozen/")]
    (made / "test_reads.jsonl").write_text("".join(json.dumps(read) + "\n" for read in reads))
    (made / "attempts.json").write_text(json.dumps([{"start": 0.0, "end": 5.0, "finished": sorted(results)}]))
    ledger = json.loads(write_ledger(made, settings, tmp_path / "results").read_text())

    fresh, partial = tmp_path / "fresh", tmp_path / "partial"
    assert sorted(restore(ledger, fresh)) == sorted(results)
    some = sorted(results)[::2]
    for name in some:  # this folder finished half the runs itself, and made one choice and one read
        run_folder(partial, name).mkdir(parents=True)
        (run_folder(partial, name) / "result.json").write_text(json.dumps(results[name]))
    (partial / "test_reads.jsonl").write_text(json.dumps(reads[0]) + "\n")
    (partial / "attempts.json").write_text(json.dumps([{"start": 0.0, "end": 1.0, "finished": []}]))  # then went on
    assert sorted(restore(ledger, partial)) == sorted(set(results) - set(some))
    assert json.loads((partial / "attempts.json").read_text()) == [{"start": 0.0, "end": 1.0, "finished": []}]
    (partial / "attempts.json").write_text(json.dumps(ledger["attempts"]))
    for folder in (fresh, partial):
        assert restore(ledger, folder) == []  # a second time: nothing new
        assert ledger_of(folder, settings) == ledger
        assert plan.ready(read_results(folder)) == ([], True)
    with pytest.raises(FileNotFoundError, match="pretrain/p600/seed0 has no checkpoint"):
        checkpoint_of(fresh, "pretrain/p600/seed0")


def test_a_final_test_of_a_restored_fit_makes_it_again_and_keeps_the_numbers_that_chose(tmp_path: Path) -> None:
    """A restored fit has no weights: its test first makes it again (same recipe and seed, in its folder)
    and records the remake's machine and validation beside the test; the fit's own result, which its
    point's choice read, stays. A checkpoint short of the fit's steps (a remake stopped half way) is no
    fit's weights either; a made fit's test makes nothing again."""
    curve = curve_from(argparse.Namespace(quick=True, budgets=None, seeds=None, supervised=True, hybrid=True))
    plan, settings = CurvePlan(curve), curve.study
    job = plan.fit("scratch/s4", 1e-3, 0)
    [test] = plan.evaluations("scratch/s4", 1e-3, [0])
    made, fresh = tmp_path / "made", tmp_path / "fresh"
    first = run_job(job, made, settings)
    restore(ledger_of(made, {}), fresh)
    assert not last_checkpoint(fresh, job.name).exists() and needs_remake(fresh, job)
    tested = run_job(test, fresh, settings)
    assert steps_done(fresh, job) == 4 and not needs_remake(fresh, job)
    assert tested["remade"]["resumed_from"] == 0 and len(tested["remade"]["machines"]) == 1
    assert tested["remade"]["val_accuracy"] == pytest.approx(first["val_accuracy"], abs=0.05)
    assert 0 < tested["remade"]["wall_seconds"] < tested["wall_seconds"]  # what --within leaves out of a test's time
    assert read_results(fresh)[job.name] == json.loads(json.dumps(first))  # the numbers that chose, not the remake's
    assert 0.0 <= tested["test_accuracy"] <= 1.0
    record = summarise_curve(curve, plan, fresh)
    [(cpu, remade_cpu)] = [entry["cpu"] for entry in record["remade"].values()]
    assert record["remade"][job.name]["val_accuracy"] == [first["val_accuracy"], tested["remade"]["val_accuracy"]]
    assert cpu == remade_cpu and f"- {job.name}: made again for its test" in render(record, "python -m experiments.curve")
    assert "remade" not in run_job(test, made, settings)  # its own weights are there
    torch.save({"global_step": 2}, last_checkpoint(fresh, job.name))
    assert needs_remake(fresh, job)


def test_within_a_time_only_the_runs_that_can_finish_start_longest_first(tmp_path: Path, capsys) -> None:
    """--within: a fit takes what the finished fits of its config and nearest step count took, scaled to
    its steps; an evaluation the wall time of its kind; those that fit start, longest first; a job like
    none finished counts as fitting. When nothing ready fits and nothing runs, the invocation stops."""
    plan = CurvePlan(full())
    results = {
        "a": {"kind": "fit", "config": plan.fit("scratch/s500", 1e-3, 0).config, "steps": 500, "wall_seconds": 200.0},
        "b": {"kind": "fit", "config": plan.fit("scratch/s500", 1e-3, 0).config, "steps": 5000, "wall_seconds": 1500.0},
        "e": {"kind": "fit", "config": plan.fit("scratch/s500", 1e-3, 0).config, "steps": 5000, "wall_seconds": 2500.0},
        "c": {"kind": "test", "wall_seconds": 10.0},
        "d": {"kind": "fit", "wall_seconds": 5.0},  # restored before runs recorded their steps: not used
        "f": {"kind": "fit", "config": plan.fit("scratch/s500", 1e-3, 0).config, "steps": 5000, "wall_seconds": 800.0,
              "resumed_from": 3000},  # this attempt ran 2,000 steps, 0.4 s each
    }
    long, short = plan.fit("scratch/s10100", 1e-3, 0), plan.fit("scratch/s1100", 1e-3, 0)
    tuned, test = plan.fit("mpp/p600", 0.03, 0), Job("x/test", "test")
    assert estimate(long, results) == pytest.approx(0.4 * 10100)  # from the 5,000-step runs, 2,000 s
    assert estimate(short, results) == pytest.approx(1100 * 200 / 500)  # from the 500-step run
    assert estimate(test, results) == 10.0 and estimate(tuned, results) is None
    jobs = [test, tuned, short, long]
    assert fitting(jobs, results, 6000) == [long, short, test, tuned]
    assert fitting(jobs, results, 1000) == [short, test, tuned]
    assert fitting(jobs, results, 4000) == [short, test, tuned]
    assert fitting(jobs, results, 5) == [tuned]
    assert estimate(long, results, done=5050) == pytest.approx(0.4 * 5050)  # half of it made
    assert fitting(jobs, results, 3000, lambda job: 5050 if job is long else 0) == [long, short, test, tuned]
    # a test whose fit was restored without weights makes it again first: that fit's estimate counts too
    results["c"]["remade"] = {"wall_seconds": 4.0}  # a remade test's own time is its wall less its remake
    assert estimate(test, results) == 6.0
    assert fitting([test], results, 100, first=lambda job: short) == []  # 6 s + 440 s of the 1,100-step fit
    assert fitting([test], results, 500, first=lambda job: short) == [test]
    assert fitting([test], results, 100, lambda job: 1000 if job is short else 0, lambda job: short) == [test]

    class Waiting:  # one job ready, never finished
        def all_choices(self, results: dict) -> dict:
            return {}

        def ready(self, results: dict) -> tuple[list[Job], bool]:
            return [short], False

        def spares(self, results: dict, running: set[str]) -> list[Job]:
            return [long]

    (run_folder(tmp_path, "a")).mkdir(parents=True)
    (run_folder(tmp_path, "a") / "result.json").write_text(json.dumps({"name": "a", **results["a"]}))
    run_study(full().study, tmp_path, jobs=1, plan=Waiting(), until=0.0)
    assert "no job that is ready can finish in the time left" in capsys.readouterr().out
    assert not run_folder(tmp_path, short.name).exists() and not run_folder(tmp_path, long.name).exists()
    assert without_time(["--within", "2", "--results", "r", "--within=1", "--report"]) == ["--results", "r"]
    last_checkpoint(tmp_path, long.name).parent.mkdir(parents=True)
    torch.save({"global_step": 5050}, last_checkpoint(tmp_path, long.name))  # a fit stopped half way
    assert [steps_done(tmp_path, job) for job in (long, short, Job(long.name + "/test", "test", checkpoint=long.name))] == [5050, 0, 0]
    # the runner's side: a test's fit needs making again when finished without its weights, or short of them
    retest = Job(long.name + "/test", "test", long.config, long.overrides, checkpoint=long.name)
    assert remake_first(tmp_path, retest) is None  # its fit has not finished: no test yet
    (run_folder(tmp_path, long.name) / "result.json").write_text(json.dumps({"name": long.name}))
    assert remake_first(tmp_path, retest) == long  # finished, but its checkpoint is 5,050 of 10,100 steps
    torch.save({"global_step": 10100}, last_checkpoint(tmp_path, long.name))
    assert remake_first(tmp_path, retest) is None and remake_first(tmp_path, long) is None


def test_a_slot_that_would_wait_runs_ahead_the_lr_a_grid_may_want_next() -> None:
    """While a point's grid runs, a free slot takes its next extension: the first on the side its arm chose
    at the nearest smaller point, a later one on the side the grid went; the choice never reads a run ahead
    that its grid does not want."""
    plan, results = CurvePlan(full()), {}
    point = "hybrid/s2900"
    first = [plan.fit(point, lr, 0).name for lr in (1e-3, 3e-3)]
    assert plan.spares(results, set()) == [] and plan.spares(results, {first[0]}) == []  # all started first
    assert plan.spares(results, set(first)) == [plan.fit(point, 9e-3, 0)]  # nothing chosen below it: upwards
    for lr, val in ((1e-3, 0.8), (3e-3, 0.7), (3.33e-4, 0.75)):
        finish(results, plan.fit("hybrid/s1100", lr, 0).name, val)
    assert plan.grid("hybrid/s1100", results)[1]["lr"] == 1e-3  # type: ignore[index]
    finish(results, first[0], 0.8)
    assert plan.spares(results, {first[1]}) == [plan.fit(point, 3.33e-4, 0)]  # 1e-3 chosen below: downwards
    finish(results, plan.fit(point, 3.33e-4, 0).name, 0.9)  # run ahead, and best of all
    finish(results, first[1], 0.85)
    assert plan.grid(point, results) == ([1e-3, 3e-3, 9e-3], None)  # the grid went the other way
    assert plan.spares(results, {plan.fit(point, 9e-3, 0).name}) == [plan.fit(point, 0.027, 0)]  # its side known
    assert CurvePlan(dataclasses.replace(full(), extensions=1)).spares(results, {plan.fit(point, 9e-3, 0).name}) == []
    finish(results, plan.fit(point, 9e-3, 0).name, 0.6)
    assert plan.grid(point, results)[1]["lr"] == 3e-3  # type: ignore[index]
    assert plan.unwanted(results) == [plan.fit(point, 3.33e-4, 0).name]
    pretrained = [plan.fit("mpp/p600", lr, 0).name for lr in (0.03, 0.06)]
    assert plan.spares({}, set(pretrained)) == []  # a fine-tuning run ahead waits for its pretraining too


def test_a_study_runs_a_spare_in_a_slot_no_ready_job_takes_and_ends_after_it(tmp_path: Path, capsys) -> None:
    wanted, spare = Job("wanted", "none"), Job("spare", "none")  # jobs that only record a result

    class OneJob:
        def all_choices(self, results: dict) -> dict:
            return {}

        def ready(self, results: dict) -> tuple[list[Job], bool]:
            return ([] if "wanted" in results else [wanted]), "wanted" in results

        def spares(self, results: dict, running: set[str]) -> list[Job]:
            return [spare]

    results = run_study(full().study, tmp_path, jobs=2, plan=OneJob())
    assert set(results) == {"wanted", "spare"} == set(read_results(tmp_path))
    assert "study: start spare (ahead: the plan may want it)" in capsys.readouterr().out
    results = run_study(full().study, tmp_path, jobs=2, plan=OneJob())  # nothing left: a spare done is not run again
    assert "study: start" not in capsys.readouterr().out


def test_wall_time_counts_invocations_side_by_side_once() -> None:
    attempts = [{"start": 0.0, "end": 100.0}, {"start": 50.0, "end": 120.0}, {"start": 60.0, "end": 70.0},
                {"start": 200.0, "end": None}, {"start": 300.0, "end": 310.0}]  # fmt: skip
    assert elapsed(attempts) == 130.0 and elapsed([]) == 0.0


def test_the_screens_confirmed_recipe_joins_the_table_and_the_picture(tmp_path: Path) -> None:
    """The committed curve with a confirmation beside it, as the screen's record gives it."""
    from experiments.curve_page import plot
    from experiments.curve_report import confirmed_recipe

    def summary(mean: float, spread: float) -> dict:
        return {"n": 3, "mean": mean, "std": spread, "low": mean - spread, "high": mean + spread, "values": [mean] * 3}

    frozen = {"k-NN": summary(0.70, 0.01), "linear probe": summary(0.75, 0.01)}
    points = {
        "mpp/p9600": {"lr": 0.06, "test_accuracy": summary(0.82, 0.01), "frozen": frozen},
        "scratch/s20100": {"lr": 1e-3, "test_accuracy": summary(0.81, 0.005)},
        "mpp/p38400": {"lr": 0.06, "test_accuracy": summary(0.84, 0.01), "frozen": frozen},
    }
    screen = tmp_path / "screen.json"
    assert confirmed_recipe(screen) is None  # no screen yet
    record = {"command": "python -m experiments.screen --results results/curve/screen", "confirmation": None}
    screen.write_text(json.dumps(record))
    assert confirmed_recipe(screen) is None  # a screen that has not confirmed yet
    record["confirmation"] = {
        "recipes": {"mpp": {"recipe": {"ratio": "0.75", "steps": "2900"}, "lr": 0.06},
                    "scratch": {"recipe": {"drop_path": "0.1", "steps": "20100"}, "lr": 1e-3}},
        "points": points, "differences": {"9600": summary(0.01, 0.012), "38400": summary(0.03, 0.01)},
    }  # fmt: skip
    screen.write_text(json.dumps(record))
    curve = json.loads((Path(__file__).parents[1] / "results" / "curve" / "curve.json").read_text())
    curve["recipe"] = confirmed_recipe(screen)
    table = render(curve, curve["command"])
    assert "MPP: ratio=0.75, steps=2900; from scratch: drop_path=0.1, steps=20100." in table
    assert "| 9,600 | 82.0 ± 1.0 [81.0, 83.0] (3 seeds) | 70.0 ± 1.0 | 75.0 ± 1.0 | 81.0 ± 0.5 [80.5, 81.5] (3 seeds) | +1.0 pts [-0.2, +2.2] |" in table
    assert "| 38,400 | 84.0 ± 1.0 [83.0, 85.0] (3 seeds) |" in table
    plot(curve, tmp_path / "curve.png")
    assert (tmp_path / "curve.png").stat().st_size > 10_000
