"""The study (tools/study.py, mpp.eval.study): its statistics against known values, its plan (which runs,
in which order, what each reads), and --quick end to end: every arm present, the JSON complete, no
choice made on the test set, a second invocation resuming instead of rerunning."""

from __future__ import annotations

import json
import subprocess
import sys
import time
from pathlib import Path

import pytest
import yaml
from workspace import ROOT, environment

from mpp.eval.stats import paired, summarise, t_quantile
from mpp.eval.study import ARMS, VARIANTS, Plan, Settings, Splits, audit_test_reads, metric_curve, outline


@pytest.mark.parametrize(("df", "expected"), [(1, 12.7062), (2, 4.3027), (4, 2.7764), (9, 2.2622), (30, 2.0423)])
def test_t_quantiles_are_the_tables(df: int, expected: float) -> None:
    assert t_quantile(0.975, df) == pytest.approx(expected, abs=5e-4)
    assert t_quantile(0.95, 1) == pytest.approx(6.3138, abs=5e-4)


def test_summaries_and_paired_differences() -> None:
    s = summarise([0.70, 0.72, 0.74])
    assert (s.n, s.mean, s.std) == (3, pytest.approx(0.72), pytest.approx(0.02))
    assert s.high - s.mean == pytest.approx(4.3027 * 0.02 / 3**0.5, abs=1e-5)
    one = summarise([0.5])
    assert (one.std, one.low, one.high) == (0.0, None, None)
    # Paired by seed: a constant difference has no spread, whatever each arm's own spread.
    d = paired({0: 0.70, 1: 0.60, 2: 0.80, 7: 0.1}, {0: 0.65, 1: 0.55, 2: 0.75})
    assert (d.n, d.mean, d.std) == (3, pytest.approx(0.05), pytest.approx(0.0, abs=1e-12))
    with pytest.raises(ValueError):
        summarise([])


def settings(**changes: object) -> Settings:
    splits = Splits(pool="pool.tar", val="val.tar", test="test.tar", labels={100: "l100.tar", 900: "l900.tar"},
                    supervised={100: "sup.tar"})
    base = dict(splits=splits, configs={"pretrain": "p.yaml", "finetune": "f.yaml", "scratch": "s.yaml"},
                seeds=(0, 1, 2), pretrain_steps=600, finetune_steps=500, finetune_lrs=(0.01, 0.03),
                scratch_lrs=(1e-3, 3e-3), ablation=("pixels",), ablation_seeds=2)
    return Settings(**{**base, **changes})  # type: ignore[arg-type]


def option(job, name: str) -> str:
    return job.overrides[len(job.overrides) - 1 - job.overrides[::-1].index(name) + 1]


def test_the_plan_holds_every_arm_and_no_fit_reads_the_test_set() -> None:
    s = settings()
    plan = Plan(s)
    assert s.arms(100) == list(ARMS) and s.arms(900) == ["scratch", "matched", "mpp"]  # no disjoint labels
    assert s.val_every == 100 and settings(pretrain_steps=6, finetune_steps=4).val_every == 2
    ready, finished = plan.ready({})
    names = [job.name for job in ready]
    assert not finished
    # Nothing that needs a pretrained encoder starts before it exists; the test set waits for every choice.
    assert not [n for n in names if "/mpp/" in n or "/supervised/" in n.removeprefix("supervised/")]
    assert not [job for job in ready if job.reads_test]
    assert names.index("pretrain/colour3/seed0") == 0
    assert {"pretrain/pixels/seed0", "pretrain/pixels/seed1"} <= set(names) and "pretrain/pixels/seed2" not in names
    jobs = plan.pretraining() + [plan.fit(b, a, lr, seed) for b in s.budgets for a in s.arms(b) for lr in s.lrs(a)
                                 for seed in s.seeds]
    for job in jobs:
        assert option(job, "--data.test") == "null" and option(job, "--data.val") == "val.tar"
        assert "test.tar" not in job.overrides and not job.reads_test
    matched, scratch = plan.fit(100, "matched", 1e-3, 0), plan.fit(100, "scratch", 1e-3, 0)
    assert (option(matched, "--trainer.max_steps"), option(scratch, "--trainer.max_steps")) == ("1100", "500")
    assert option(plan.fit(900, "mpp", 0.01, 2), "--model.init_args.pretrained") == "{run:pretrain/colour3/seed2}"
    assert option(plan.fit(100, "supervised", 0.01, 1), "--model.init_args.pretrained") == "{run:supervised/b100/seed1}"
    assert option(plan.fit(100, "mpp", 0.03, 1), "--seed_everything") == option(plan.fit(100, "mpp", 0.03, 1), "--data.seed") == "1"


def test_choices_are_made_on_validation_with_the_first_seed_then_finals_and_tests_follow() -> None:
    s = settings()
    plan = Plan(s)
    results: dict[str, dict] = {job.name: {} for job in plan.pretraining()}
    val = {"scratch": {1e-3: 0.5, 3e-3: 0.6}, "matched": {1e-3: 0.7, 3e-3: 0.7}, "mpp": {0.01: 0.8, 0.03: 0.4},
           "supervised": {0.01: 0.1, 0.03: 0.9}}
    for budget in s.budgets:
        for arm in s.arms(budget):
            assert plan.choose(budget, arm, results) is None
            for lr, job in zip(s.lrs(arm), plan.grid(budget, arm)):
                assert job.name.endswith("/seed0")
                results[job.name] = {"val_accuracy": val[arm][lr]}
    choices = plan.all_choices(results)
    assert {k: c["lr"] for k, c in choices.items()} == {
        "b100/scratch": 3e-3, "b100/matched": 1e-3, "b100/mpp": 0.01, "b100/supervised": 0.03,  # a tie: the first
        "b900/scratch": 3e-3, "b900/matched": 1e-3, "b900/mpp": 0.01}
    ready, _ = plan.ready(results)
    finals = {job.name for job in ready if job.kind == "fit"}
    assert "b100/mpp/lr0.01/seed1" in finals and "b100/mpp/lr0.03/seed1" not in finals
    evaluations = [job for job in ready if job.reads_test]
    assert "b100/mpp/lr0.01/seed0/test" in {job.name for job in evaluations}  # the grid's run is seed 0's final
    # A later seed's evaluation waits for its fit.
    assert "b100/mpp/lr0.01/seed1/test" not in {job.name for job in evaluations}
    test = next(job for job in plan.evaluations(choices) if job.name == "b100/mpp/lr0.01/seed1/test")  # type: ignore[arg-type]
    assert test.checkpoint == "b100/mpp/lr0.01/seed1" and "b100/mpp/lr0.01/seed1" in plan.needs(test)
    for job in ready:
        results[job.name] = {}
    later, finished = plan.ready(results)
    waiting = {job.name for job in plan.evaluations(choices) if job.name not in results}  # type: ignore[arg-type]
    assert not finished and "b100/mpp/lr0.01/seed1/test" in waiting and {job.name for job in later} == waiting
    for job in later:
        results[job.name] = {}
    assert plan.ready(results) == ([], True)


def test_the_audit_flags_a_test_read_before_a_choice_or_by_a_run_that_is_no_evaluation() -> None:
    s = settings()
    plan = Plan(s)
    choices = {f"b{b}/{a}": {"lr": s.lrs(a)[0], "time": 100.0} for b in s.budgets for a in s.arms(b)}
    evaluations = [job.name for job in plan.evaluations(choices)]
    clean = [{"job": name, "time": 200.0} for name in evaluations]
    assert audit_test_reads(plan, choices, clean)["problems"] == []
    early = [{**clean[0], "time": 50.0}, *clean[1:]]
    assert audit_test_reads(plan, choices, early)["problems"] == [f"{clean[0]['job']} read the test set before the last choice"]
    grid = [*clean, {"job": "b100/mpp/lr0.03/seed0", "time": 300.0}]
    assert audit_test_reads(plan, choices, grid)["problems"] == ["b100/mpp/lr0.03/seed0 read the test set but is no final evaluation"]
    assert audit_test_reads(plan, choices, clean[1:])["problems"] == [f"{clean[0]['job']} never read the test set"]


def test_metric_curves_count_steps_from_one_and_keep_the_last_of_a_repeated_step(tmp_path: Path) -> None:
    path = tmp_path / "metrics.csv"
    path.write_text("epoch,step,train/loss,val/accuracy\n0,9,1.0,\n0,99,,0.5\n0,199,,0.6\n0,99,,0.55\n0,199,,0.65\n")
    assert metric_curve(path, "val/accuracy") == [(100, 0.55), (200, 0.65)]
    assert metric_curve(tmp_path / "missing.csv", "val/accuracy") == []


def test_the_outline_counts_every_run() -> None:
    s = settings()
    lines = outline(s)
    # 3 seeds of the default objective + 2 of pixels; 3 supervised; grids of 2 and 2 more seeds per arm.
    assert "pretrain: 5 runs, 3,000 steps" in lines and "supervised: 3 runs, 1,800 steps" in lines
    fits = {"scratch": 500, "matched": 1100, "mpp": 500, "supervised": 500}
    steps = sum(3 * fits[a] + fits[a] for b in s.budgets for a in s.arms(b))  # 2 grid lrs (1 is seed 0) + 2 seeds
    assert f"fine-tuning: {sum(4 for b in s.budgets for _ in s.arms(b))} runs, {steps:,} steps" in lines
    assert len(VARIANTS) == 5


def test_quick_study_end_to_end(tmp_path: Path) -> None:
    out = tmp_path / "study"
    command = [sys.executable, "tools/study.py", "--quick", "--out", str(out)]
    started = time.time()
    result = subprocess.run(command, cwd=ROOT, env=environment(), capture_output=True, text=True, timeout=900)
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    study = json.loads((out / "study.json").read_text())
    assert set(study["budgets"]) == {"1000", "9000"}
    assert list(study["budgets"]["1000"]["arms"]) == list(ARMS)
    assert list(study["budgets"]["9000"]["arms"]) == ["scratch", "matched", "mpp"]
    for budget, numbers in study["budgets"].items():
        for arm, found in numbers["arms"].items():
            assert found["test_accuracy"]["n"] == 2 and len(found["test_accuracy_by_seed"]) == 2
            assert 0.0 <= found["test_accuracy"]["mean"] <= 1.0
            assert set(found["frozen"]) == {"10-shot", "25-shot", "k-NN", "linear probe"}
            grid = found["val_accuracy_by_lr"]
            assert found["lr"] == float(max(grid, key=lambda lr: grid[lr])[2:])  # the best on validation
            assert found["steps"] == (10 if arm == "matched" else 4)
            assert [step for step, _ in found["val_curves"]["0"]][-1] == found["pretrain_steps"] + found["steps"]
        assert set(numbers["differences"]) == {"mpp - scratch", "mpp - matched"} | (
            {"supervised - mpp"} if budget == "1000" else set())
        for diff in numbers["differences"].values():
            assert diff["n"] == 2 and diff["low"] <= diff["mean"] <= diff["high"]
    assert set(study["ablation"]) == {v.name for v in VARIANTS}
    for variant in study["ablation"].values():
        assert variant["validation"]["10-shot"]["n"] == 2
    # No choice read the test set: every read came from a final evaluation, after the last choice...
    audit = study["test_set"]
    assert audit["problems"] == [] and audit["reads"] == audit["evaluations"] == 20
    reads = [json.loads(line) for line in (out / "test_reads.jsonl").read_text().splitlines()]
    choices = json.loads((out / "choices.json").read_text())
    assert len(choices) == 7 and min(r["time"] for r in reads) >= max(c["time"] for c in choices.values()) >= started
    assert all(r["job"].endswith("/test") or r["job"].startswith("frozen/") for r in reads)
    # ...and no fit was given the test set: each saved config validates on the held-out split.
    configs = [p for p in (out / "runs").glob("**/config.yaml") if p.parent.name != "test"]
    assert len(configs) == 12 + 14 + 7  # pretraining, grids, other seeds' finals
    for path in configs:
        data = yaml.safe_load(path.read_text())["data"]
        assert data["test"] is None and data["val"] == "shards/fashion-mnist/train-000009.tar"
        assert "test-" not in str(data["train"])
    table = (out / "study.md").read_text()
    assert "| MPP pretrained, fine-tuned − from scratch, matched compute |" in table and "### Ablation" in table
    assert (out / "accuracy.png").stat().st_size > 10_000 and (out / "curves.png").stat().st_size > 10_000
    # The same command again resumes: nothing is run twice, the numbers stay.
    again = subprocess.run(command, cwd=ROOT, env=environment(), capture_output=True, text=True, timeout=300)
    assert again.returncode == 0, again.stderr[-3000:]
    assert "study: start" not in again.stdout
    assert json.loads((out / "study.json").read_text())["budgets"] == study["budgets"]
    assert json.loads((out / "study.json").read_text())["wall_seconds"]["attempts"] == 2
