"""The study (experiments.study and its harness): its statistics against known values, its plan (which runs,
in which order, what each reads), and --quick end to end: every arm present, the JSON complete, no
choice made on the test set, a second invocation resuming instead of rerunning."""

from __future__ import annotations

import json
import subprocess
import sys
import time
from dataclasses import replace
from pathlib import Path

import pytest
import yaml
from workspace import ROOT, environment, help_of, time_limit

from experiments.jobs import keep_metrics, metric_curve, read_results
from experiments.plan import Plan, outline
from experiments.report import audit_test_reads
from experiments.reuse import covers, extends, note_arms, reuse_runs
from experiments.settings import ARMS, FIRST_ARMS, VARIANTS, Settings, Splits
from experiments.stats import paired, summarise, t_cdf, t_quantile

STUDIES = ["compare", "study", "curve", "screen", "levers", "leakage", "pages"]


def test_the_experiments_are_the_studies_and_their_harness() -> None:
    run = sorted(p.stem for p in (ROOT / "experiments").glob("*.py") if "__main__" in p.read_text())
    assert run == sorted(STUDIES)


@pytest.mark.parametrize("name", STUDIES)
@pytest.mark.filterwarnings("ignore:.*found in sys.modules:RuntimeWarning")  # imported above, run again
def test_every_study_says_how_to_use_it(name: str, monkeypatch, capsys) -> None:
    assert help_of(f"experiments.{name}", monkeypatch, capsys).startswith("usage:")

# Student's t quantiles to 13 digits (the standard tables, e.g. scipy.stats.t.ppf): 97.5%, 95% and 99.5%.
T_TABLE = [(0.975, 1, 12.70620473617), (0.975, 2, 4.302652729749), (0.975, 3, 3.182446305284),
           (0.975, 4, 2.776445105198), (0.975, 9, 2.262157162798), (0.975, 29, 2.045229642133),
           (0.975, 100, 1.983971518524), (0.95, 1, 6.313751514675), (0.95, 5, 2.015048373333),
           (0.995, 2, 9.924843200918), (0.995, 30, 2.749995653567)]


@pytest.mark.parametrize(("p", "df", "expected"), T_TABLE)
def test_t_quantiles_are_the_tables(p: float, df: int, expected: float) -> None:
    assert t_quantile(p, df) == pytest.approx(expected, rel=1e-11)
    assert t_cdf(expected, df) == pytest.approx(p, abs=1e-12)
    assert t_cdf(-expected, df) == pytest.approx(1 - p, abs=1e-12)


def test_the_t_distribution_is_symmetric_and_refuses_what_it_has_no_value_for() -> None:
    assert t_cdf(0.0, 7) == 0.5 and t_quantile(0.5, 7) == pytest.approx(0.0, abs=1e-12)
    with pytest.raises(ValueError):
        t_quantile(0.4, 3)
    with pytest.raises(ValueError):
        t_quantile(0.975, 0)


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
    configs = {"pretrain": "p.yaml", "finetune": "f.yaml", "scratch": "s.yaml", "hybrid_pretrain": "hp.yaml",
               "hybrid_finetune": "hf.yaml", "hybrid_scratch": "hs.yaml"}
    base = dict(splits=splits, configs=configs,
                seeds=(0, 1, 2), pretrain_steps=600, finetune_steps=500, finetune_lrs=(0.01, 0.03),
                scratch_lrs=(1e-3, 3e-3), ablation=("pixels",), ablation_seeds=2)
    return Settings(**{**base, **changes})  # type: ignore[arg-type]


def option(job, name: str) -> str:
    return job.overrides[len(job.overrides) - 1 - job.overrides[::-1].index(name) + 1]


def test_the_plan_holds_every_arm_and_no_fit_reads_the_test_set() -> None:
    s = settings()
    plan = Plan(s)
    assert s.arms(100) == list(ARMS)  # 900 labels leave no disjoint ones for supervised pretraining:
    assert s.arms(900) == ["scratch", "matched", "mpp", "hybrid_scratch", "hybrid_mpp"]
    assert s.val_every == 100 and settings(pretrain_steps=6, finetune_steps=4).val_every == 2
    ready, finished = plan.ready({})
    names = [job.name for job in ready]
    assert not finished
    # Nothing that needs a pretrained encoder starts before it exists; the test set waits for every choice.
    assert not [n for n in names if "mpp/" in n.removeprefix("pretrain/") or "/supervised/" in n.removeprefix("supervised/")]
    assert {"pretrain/hybrid/seed0", "pretrain/hybrid/seed2", "b100/hybrid_scratch/lr0.001/seed0"} <= set(names)
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
    hybrid = plan.fit(900, "hybrid_mpp", 0.01, 1)
    assert option(hybrid, "--model.init_args.pretrained") == "{run:pretrain/hybrid/seed1}" and hybrid.config == "hf.yaml"
    assert plan.fit(100, "hybrid_scratch", 1e-3, 0).config == "hs.yaml" and s.lrs("hybrid_scratch") == s.scratch_lrs
    assert next(j for j in plan.pretraining() if j.name == "pretrain/hybrid/seed2").config == "hp.yaml"
    assert option(plan.fit(100, "mpp", 0.03, 1), "--seed_everything") == option(plan.fit(100, "mpp", 0.03, 1), "--data.seed") == "1"


def test_choices_are_made_on_validation_with_the_first_seed_then_finals_and_tests_follow() -> None:
    s = settings()
    plan = Plan(s)
    results: dict[str, dict] = {job.name: {} for job in plan.pretraining()}
    val = {"scratch": {1e-3: 0.5, 3e-3: 0.6}, "matched": {1e-3: 0.7, 3e-3: 0.7}, "mpp": {0.01: 0.8, 0.03: 0.4},
           "supervised": {0.01: 0.1, 0.03: 0.9}, "hybrid_scratch": {1e-3: 0.3, 3e-3: 0.2},
           "hybrid_mpp": {0.01: 0.2, 0.03: 0.3}}
    for budget in s.budgets:
        for arm in s.arms(budget):
            assert plan.choose(budget, arm, results) is None
            for lr, job in zip(s.lrs(arm), plan.grid(budget, arm)):
                assert job.name.endswith("/seed0")
                results[job.name] = {"val_accuracy": val[arm][lr]}
    choices = plan.all_choices(results)
    assert {k: c["lr"] for k, c in choices.items()} == {
        "b100/scratch": 3e-3, "b100/matched": 1e-3, "b100/mpp": 0.01, "b100/supervised": 0.03,  # a tie: the first
        "b100/hybrid_scratch": 1e-3, "b100/hybrid_mpp": 0.03,
        "b900/scratch": 3e-3, "b900/matched": 1e-3, "b900/mpp": 0.01, "b900/hybrid_scratch": 1e-3, "b900/hybrid_mpp": 0.03}
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


def test_arms_added_to_a_study_are_chosen_after_its_first_test_reads_and_audited_from_when_they_joined(tmp_path: Path):
    first = settings(selected_arms=FIRST_ARMS).as_dict()
    first.pop("selected_arms")  # as a study saved before settings named their arms
    first["configs"] = {k: v for k, v in first["configs"].items() if not k.startswith("hybrid")}
    s = settings()
    assert extends(first, s.as_dict()) and extends(s.as_dict(), s.as_dict())
    assert not extends(s.as_dict(), first)  # arms are only ever added
    assert not extends(first, settings(finetune_steps=400).as_dict())
    assert not extends(first, {**s.as_dict(), "configs": {**s.as_dict()["configs"], "pretrain": "other.yaml"}})
    joined = note_arms(tmp_path, first, s)
    assert {arm: joined[arm] for arm in FIRST_ARMS} == dict.fromkeys(FIRST_ARMS, 0.0)
    assert joined["hybrid_mpp"] == joined["hybrid_scratch"] > 0 and note_arms(tmp_path, s.as_dict(), s) == joined

    plan, added = Plan(s), joined["hybrid_mpp"]
    choices = {f"b{b}/{a}": {"lr": s.lrs(a)[0], "time": added + 100.0 if a.startswith("hybrid") else 100.0}
               for b in s.budgets for a in s.arms(b)}  # fmt: skip
    old = [{"job": job.name, "time": 200.0} for job in plan.evaluations(choices) if "hybrid" not in job.name]
    new = [{"job": job.name, "time": added + 200.0} for job in plan.evaluations(choices) if "hybrid" in job.name]
    audit = audit_test_reads(plan, choices, old + new, joined)
    assert audit["problems"] == [] and audit["arms_added_later"] == ["hybrid_mpp", "hybrid_scratch"]
    # Without the record of when they joined, the first reads came before the hybrid arms' choices.
    assert len(audit_test_reads(plan, choices, old + new)["problems"]) == len(old)
    # Once the hybrid arms joined, no read may come before their choices.
    early = [*old, {**new[0], "time": added + 50.0}, *new[1:]]
    assert audit_test_reads(plan, choices, early, joined)["problems"] == [f"{new[0]['job']} read the test set before the last choice"]


def finished_study(folder: Path, s: Settings, names: list[str]) -> None:
    """A study folder with `names` finished: each with a result, a checkpoint and its final run's test."""
    folder.mkdir(parents=True)
    (folder / "settings.json").write_text(json.dumps(s.as_dict()))
    for name in names:
        run = folder / "runs" / name
        (run / "checkpoints").mkdir(parents=True)
        (run / "checkpoints" / "last.ckpt").write_bytes(name.encode())
        (run / "result.json").write_text(json.dumps({"name": name, "kind": "fit", "val_accuracy": 0.5, "wall_seconds": 9}))
        (run / "test").mkdir()
        (run / "test" / "result.json").write_text(json.dumps({"name": name + "/test", "kind": "test", "wall_seconds": 1}))


def test_a_study_brings_over_only_the_finished_runs_it_would_run_exactly_as_they_ran(tmp_path: Path) -> None:
    source, out = tmp_path / "study", tmp_path / "longer"
    base = settings(selected_arms=("scratch", "mpp"), ablation=())
    assert Settings.from_dict(json.loads(json.dumps(base.as_dict()))) == base
    old = dict(json.loads(json.dumps(base.as_dict())))
    old.pop("selected_arms")
    assert Settings.from_dict(old).selected_arms == FIRST_ARMS  # saved before settings named their arms
    finished_study(source, base, [job.name for job in Plan(base).fits()])
    # Longer pretraining: the from-scratch runs are the same jobs; the pretraining, and every fine-tuning
    # that starts from it, is not.
    longer = settings(selected_arms=("scratch", "mpp"), ablation=(), pretrain_steps=1200)
    (out / "runs" / "b100/scratch/lr0.001/seed0").mkdir(parents=True)  # an unfinished run of its own
    brought = reuse_runs(longer, out, source, "runs/study")
    assert sorted(brought) == sorted(job.name for job in Plan(base).fits() if "/scratch/" in job.name)
    run = out / "runs" / "b100/scratch/lr0.001/seed0"
    assert (run / "checkpoints" / "last.ckpt").samefile(source / "runs" / "b100/scratch/lr0.001/seed0/checkpoints/last.ckpt")
    assert not (run / "test").exists()  # the test set is read by this study's own evaluations only
    assert json.loads((run / "result.json").read_text())["reused_from"] == "runs/study"
    assert "reused_from" not in json.loads((source / "runs" / "b100/scratch/lr0.001/seed0/result.json").read_text())
    assert set(read_results(out)) == set(brought) and not (out / "reusing").exists()
    assert reuse_runs(longer, out, source) == []  # nothing twice
    # A wider fine-tuning grid keeps the pretraining and the grid values the study had.
    wider = settings(selected_arms=("scratch", "mpp"), ablation=(), finetune_lrs=(0.03, 0.1))
    brought = reuse_runs(wider, tmp_path / "wider", source)
    assert {n for n in brought if n.startswith(("pretrain/", "b100/mpp/"))} == {
        *(f"pretrain/colour3/seed{seed}" for seed in (0, 1, 2)), *(f"b100/mpp/lr0.03/seed{seed}" for seed in (0, 1, 2))}
    # Another model shares nothing.
    patch = settings(selected_arms=("scratch", "mpp"), ablation=(), overrides=("--model.init_args.encoder.patch_size", "7"))
    assert reuse_runs(patch, tmp_path / "patch", source) == []


def test_a_finished_study_covers_a_smaller_study_only_where_it_ran_chose_and_scored_alike() -> None:
    """The levers take the numbers of a finished study that ran every run of theirs alike (the default
    study's from-scratch and MPP arms at 1,000 labels) instead of running them again."""
    whole = settings()
    study = {"settings": json.loads(json.dumps(whole.as_dict())),
             "budgets": {str(b): {"arms": dict.fromkeys(whole.arms(b), {})} for b in whole.budgets}}  # fmt: skip
    one_budget = replace(whole.splits, labels={100: "l100.tar"})
    lever = settings(splits=one_budget, selected_arms=("scratch", "mpp"), ablation=())
    assert covers(study, lever)
    assert not covers(study, replace(lever, pretrain_steps=1200))  # other runs
    assert not covers(study, replace(lever, overrides=("--model.init_args.encoder.patch_size", "7")))
    assert not covers(study, replace(lever, finetune_lrs=(0.01,)))  # its runs, but another choice
    assert not covers(study, replace(lever, seeds=(0, 1)))  # its runs, but other seeds' numbers
    assert not covers(study, replace(lever, splits=replace(one_budget, test="other.tar")))
    assert not covers(study, replace(lever, shots=(5,)))
    # The 900-label budget's pretraining evaluates on the first budget's labels: other runs.
    assert not covers(study, replace(lever, splits=replace(whole.splits, labels={900: "l900.tar"})))
    del study["budgets"]["100"]["arms"]["mpp"]  # a study that did not measure the arm
    assert not covers(study, lever)


def test_metric_curves_count_steps_from_one_and_keep_the_last_of_a_repeated_step(tmp_path: Path) -> None:
    path = tmp_path / "metrics.csv"
    path.write_text("epoch,step,train/loss,val/accuracy\n0,9,1.0,\n0,99,,0.5\n0,199,,0.6\n0,99,,0.55\n0,199,,0.65\n")
    assert metric_curve(path, "val/accuracy") == [(100, 0.55), (200, 0.65)]
    assert metric_curve(tmp_path / "missing.csv", "val/accuracy") == []
    # Before a run resumes, its metrics.csv is moved aside (Lightning's CSV logger deletes the one it
    # finds); the curve reads both, the later attempt's values last.
    keep_metrics(path)
    assert not path.exists() and (tmp_path / "metrics.attempt001.csv").exists()
    path.write_text("epoch,step,val/accuracy\n0,199,0.7\n0,299,0.75\n")
    assert metric_curve(path, "val/accuracy") == [(100, 0.55), (200, 0.7), (300, 0.75)]
    keep_metrics(path)
    assert (tmp_path / "metrics.attempt002.csv").exists() and metric_curve(path, "val/accuracy")[-1] == (300, 0.75)


def test_the_outline_counts_every_run() -> None:
    s = settings()
    lines = outline(s)
    # 3 seeds of the default objective + 2 of pixels + 3 of the hybrid; 3 supervised; grids of 2 and 2 more
    # seeds per arm.
    assert "pretrain: 8 runs, 4,800 steps" in lines and "supervised: 3 runs, 1,800 steps" in lines
    fits = {"scratch": 500, "matched": 1100, "mpp": 500, "supervised": 500, "hybrid_scratch": 500, "hybrid_mpp": 500}
    steps = sum(3 * fits[a] + fits[a] for b in s.budgets for a in s.arms(b))  # 2 grid lrs (1 is seed 0) + 2 seeds
    assert f"fine-tuning: {sum(4 for b in s.budgets for _ in s.arms(b))} runs, {steps:,} steps" in lines
    assert len(VARIANTS) == 5
    assert "pretrain: 5 runs, 3,000 steps" in outline(settings(selected_arms=FIRST_ARMS))


STUDY_KILLED = """
import os, sys, time
from experiments.runner import worker_pool
pool = worker_pool(1)
print(pool.submit(os.getpid).result(), flush=True)
pool.submit(time.sleep, 600)  # a run that would go on long after the study
time.sleep(600)
"""


def gone(pid: int) -> bool:
    """No such process, or one that has ended and waits to be reaped."""
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0] == "Z"
    except FileNotFoundError:
        return True


@pytest.mark.skipif(not Path("/proc/self/stat").exists(), reason="reads process states from /proc")
def test_a_study_killed_outright_leaves_no_worker_running() -> None:
    """SIGKILL gives the study no chance to stop its workers: each sees its parent gone and stops its run."""
    study = subprocess.Popen([sys.executable, "-c", STUDY_KILLED], cwd=ROOT, env=environment(), text=True,
                             stdout=subprocess.PIPE)
    try:
        worker = int(study.stdout.readline())
        assert not gone(worker)
    finally:
        study.kill()
        study.wait()
    deadline = time.monotonic() + 30
    while not gone(worker) and time.monotonic() < deadline:
        time.sleep(0.2)
    assert gone(worker), f"worker {worker} outlived its study"


@pytest.mark.slow  # three invocations, minutes on two cores; docs/studies.md's quick study runs by default (tests/test_readme.py)
def test_quick_study_end_to_end(tmp_path: Path) -> None:
    """--quick without the hybrid arms, then with them added to the same study, then again: nothing left."""
    out = tmp_path / "study"
    command = [sys.executable, "-m", "experiments.study", "--quick", "--out", str(out)]
    started = time.time()
    result = subprocess.run([*command, "--no-hybrid"], cwd=ROOT, env=environment(), capture_output=True, text=True,
                            timeout=time_limit(900))  # fmt: skip
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    first = json.loads((out / "study.json").read_text())
    assert list(first["budgets"]["1000"]["arms"]) == list(FIRST_ARMS) and first["test_set"]["problems"] == []
    first_reads = len((out / "test_reads.jsonl").read_text().splitlines())
    assert first_reads == first["test_set"]["evaluations"] == 20

    extended = subprocess.run(command, cwd=ROOT, env=environment(), capture_output=True, text=True, timeout=time_limit(900))
    assert extended.returncode == 0, extended.stdout[-3000:] + extended.stderr[-3000:]
    started_now = [line.split()[-1] for line in extended.stdout.splitlines() if line.startswith("study: start")]
    assert started_now and all("hybrid" in name for name in started_now)  # the first arms' runs are kept
    study = json.loads((out / "study.json").read_text())
    assert set(study["budgets"]) == {"1000", "9000"}
    assert list(study["budgets"]["1000"]["arms"]) == list(ARMS)
    assert list(study["budgets"]["9000"]["arms"]) == ["scratch", "matched", "mpp", "hybrid_scratch", "hybrid_mpp"]
    for budget, numbers in study["budgets"].items():
        for arm, found in numbers["arms"].items():
            assert found["test_accuracy"]["n"] == 2 and len(found["test_accuracy_by_seed"]) == 2
            assert 0.0 <= found["test_accuracy"]["mean"] <= 1.0
            assert set(found["frozen"]) == {"10-shot", "25-shot", "k-NN", "linear probe"}
            grid = found["val_accuracy_by_lr"]
            assert found["lr"] == float(max(grid, key=lambda lr: grid[lr])[2:])  # the best on validation
            assert found["steps"] == (10 if arm == "matched" else 4)
            assert [step for step, _ in found["val_curves"]["0"]][-1] == found["pretrain_steps"] + found["steps"]
            if arm in FIRST_ARMS:
                assert found == first["budgets"][budget]["arms"][arm]
        assert set(numbers["differences"]) == {"mpp - scratch", "mpp - matched", "hybrid_mpp - hybrid_scratch",
                                               "hybrid_mpp - mpp", "hybrid_scratch - scratch"} | (
            {"supervised - mpp"} if budget == "1000" else set())  # fmt: skip
        for diff in numbers["differences"].values():
            assert diff["n"] == 2 and diff["low"] <= diff["mean"] <= diff["high"]
        assert set(numbers["frozen_pretrained"]) == {"mpp", "hybrid_mpp"} | ({"supervised"} if budget == "1000" else set())
    assert set(study["ablation"]) == {v.name for v in VARIANTS}
    for variant in study["ablation"].values():
        assert variant["validation"]["10-shot"]["n"] == 2
    # No choice read the test set: every read came from a final evaluation, after the last choice of the
    # arms the study had then...
    audit = study["test_set"]
    assert audit["problems"] == [] and audit["reads"] == audit["evaluations"] == 20 + 12
    assert audit["arms_added_later"] == ["hybrid_mpp", "hybrid_scratch"]
    reads = [json.loads(line) for line in (out / "test_reads.jsonl").read_text().splitlines()]
    choices = json.loads((out / "choices.json").read_text())
    assert len(choices) == 11
    first_choices = [c["time"] for key, c in choices.items() if "hybrid" not in key]
    hybrid_choices = [c["time"] for key, c in choices.items() if "hybrid" in key]
    assert min(r["time"] for r in reads[:first_reads]) >= max(first_choices) >= started
    assert min(r["time"] for r in reads[first_reads:]) >= max(hybrid_choices) > max(r["time"] for r in reads[:first_reads])
    assert all(r["job"].endswith("/test") or r["job"].startswith("frozen/") for r in reads)
    # ...and no fit was given the test set: each saved config validates on the held-out split.
    configs = [p for p in (out / "runs").glob("**/config.yaml") if p.parent.name != "test"]
    assert len(configs) == 14 + 22 + 11  # pretraining, grids, other seeds' finals
    for path in configs:
        data = yaml.safe_load(path.read_text())["data"]
        assert data["test"] is None and data["val"] == "shards/fashion-mnist/train-000009.tar"
        assert "test-" not in str(data["train"])
    table = (out / "study.md").read_text()
    assert "| MPP pretrained, fine-tuned − from scratch, matched compute |" in table and "### Ablation" in table
    assert "| hybrid MPP pretrained, fine-tuned − hybrid from scratch |" in table and "| hybrid MPP |" in table
    assert "Arms added to the study later" in table
    assert (out / "accuracy.png").stat().st_size > 10_000 and (out / "curves.png").stat().st_size > 10_000
    # The same command again resumes: nothing is run twice, the numbers stay.
    again = subprocess.run(command, cwd=ROOT, env=environment(), capture_output=True, text=True, timeout=time_limit(300))
    assert again.returncode == 0, again.stderr[-3000:]
    assert "study: start" not in again.stdout
    assert json.loads((out / "study.json").read_text())["budgets"] == study["budgets"]
    assert json.loads((out / "study.json").read_text())["wall_seconds"]["attempts"] == 3


def test_a_workers_runs_start_their_processes_as_an_mpp_command_does() -> None:
    """The pool spawns its workers, and a spawned process would take spawn as its own default: its runs'
    data loaders would then spawn theirs, importing torch and mpp again at every validation."""
    import multiprocessing

    from experiments.runner import worker_pool

    with worker_pool(1) as pool:
        assert pool.submit(multiprocessing.get_start_method).result() == multiprocessing.get_all_start_methods()[0]
