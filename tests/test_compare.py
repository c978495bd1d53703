"""The comparison (python -m experiments.compare) end to end on a tiny budget: pretrain, fine-tune, scratch, table and plot."""

from __future__ import annotations

import json
import subprocess
import sys

from PIL import Image
from workspace import ROOT, environment, time_limit

from mpp.eval.linear import DEFAULTS


def compare(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "experiments.compare", *args], cwd=ROOT, env=environment(),
                          capture_output=True, text=True, timeout=time_limit(900))  # fmt: skip


def test_compare_runs_both_arms_and_writes_the_table_and_plot(tmp_path, capsys):
    args = ["--pretrain-steps", "2", "--steps", "3", "--out", str(tmp_path),
            "--train", "shards/fashion-mnist/train-000000.tar", "--shots", "1", "5", "--frozen-train", "300"]  # fmt: skip
    result = compare(*args)
    assert result.returncode == 0, result.stderr[-3000:]
    # One job of experiments.runner each, in its own folder where the configs' layout puts it.
    started = [line.split()[-1] for line in result.stdout.splitlines() if line.startswith("compare: start ")]
    assert started == ["pretrain", "frozen/pretrained", "finetune", "finetune/test-sample", "scratch",
                       "scratch/test-sample"]  # fmt: skip
    for run in ("pretrain", "finetune", "scratch", "finetune/test-sample", "scratch/test-sample"):
        assert list((tmp_path / run / "wandb").glob("offline-run-*/run-*.wandb")), f"{run} has no W&B run"
    assert [read["job"] for read in map(json.loads, (tmp_path / "test_reads.jsonl").read_text().splitlines())] == [
        "frozen/pretrained", "finetune/test-sample", "scratch/test-sample"]  # fmt: skip
    table = (tmp_path / "comparison.md").read_text()
    assert "| MPP pretrained, fine-tuned |" in table and "| from scratch |" in table
    assert "top-1 (sample)" in table and "5-shot" in table and "difference" in table
    assert "| 1-shot | 5-shot | k-NN | linear probe | steps |" in table
    assert table.rstrip().endswith("Recipe: pretraining corrupts 50% of the patches (scattered) and predicts the 3-bit mean "
                          "colour; fine-tuning sgd, layer decay 1, drop path 0; from scratch adamw, drop path 0.")
    numbers = json.loads((tmp_path / "comparison.json").read_text())
    assert numbers["steps"] == {"finetune": 3, "scratch": 3}
    for arm in ("finetune", "scratch"):
        assert 0.0 <= numbers["test_accuracy"][arm]["sample"] <= 1.0
    # Every encoder scored frozen: the pretrained one and both arms', each by few-shot, k-NN and the probe.
    for key in ("pretrained", "finetune", "scratch"):
        assert set(numbers["fewshot"][key]) == {"1", "5"}
        assert 0.0 <= numbers["knn"][key] <= 1.0 and 0.0 <= numbers["linear"][key] <= 1.0
        assert numbers["linear_l2"][key] in DEFAULTS.probe_l2s
    for arm, label in (("finetune", "MPP pretrained, fine-tuned"), ("scratch", "from scratch")):
        row = next(line for line in table.splitlines() if line.startswith(f"| {label} |"))
        assert f"| {100 * numbers['knn'][arm]:.1f}% | {100 * numbers['linear'][arm]:.1f}% | 3 |" in row
    pretrained = numbers["knn"]["pretrained"], numbers["linear"]["pretrained"]
    assert f"k-NN {100 * pretrained[0]:.1f}%, linear probe {100 * pretrained[1]:.1f}%" in table
    # The pretraining checkpoint was the one fine-tuned: its run folder holds it.
    assert (tmp_path / "pretrain" / "checkpoints" / "last.ckpt").is_file()
    with Image.open(tmp_path / "comparison.png") as plot:
        assert plot.size[0] > 300 and plot.size[1] > 200
    assert table in result.stdout
    # Run again, it keeps what finished: no run starts, and the table is the same.
    from experiments.compare import main

    assert main(args) == 0
    again = capsys.readouterr()
    assert "compare: start" not in again.out and table in again.out
    # Other arguments into the same folder are refused, naming what changed.
    assert main([("4" if arg == "3" else arg) for arg in args]) == 2
    other = capsys.readouterr()
    assert "--steps 3 -> 4" in other.err and "start" not in other.out


def test_a_comparison_from_a_given_checkpoint_runs_no_pretraining_and_starts_each_job_after_its_inputs(tmp_path):
    from experiments.compare import arguments, comparison
    from experiments.jobs import checkpoint_of
    from experiments.runner import InOrder

    given = str(tmp_path / "elsewhere" / "last.ckpt")
    settings, jobs = comparison(arguments(["--pretrained", given, "--steps", "5", "--test", "a=x.tar", "b=y.tar"]))
    assert [job.name for job in jobs] == ["frozen/pretrained", "finetune", "finetune/test-a", "finetune/test-b",
                                          "scratch", "scratch/test-a", "scratch/test-b"]  # fmt: skip
    jobs_by_name = {job.name: job for job in jobs}
    assert checkpoint_of(tmp_path, jobs_by_name["frozen/pretrained"].checkpoint) == tmp_path / "elsewhere" / "last.ckpt"
    assert given in jobs_by_name["finetune"].overrides and given not in jobs_by_name["scratch"].overrides
    assert all(jobs_by_name[name].as_configured for name in jobs_by_name)
    # Each arm's first test scores its encoder frozen; the tests read their own shards, the frozen ones the first.
    assert [job.test for job in jobs if job.kind == "test"] == ["x.tar", "y.tar"] * 2
    assert [job.frozen is not None for job in jobs if job.kind == "test"] == [True, False] * 2
    assert settings.splits.test == "x.tar" and settings.shots == (10, 25)

    plan = InOrder(jobs)
    ready, finished = plan.ready({})
    assert [job.name for job in ready] == ["frozen/pretrained", "finetune", "scratch"] and not finished
    ready, finished = plan.ready({"finetune": {}, "frozen/pretrained": {}})
    assert [job.name for job in ready] == ["finetune/test-a", "finetune/test-b", "scratch"]
    assert plan.ready({job.name: {} for job in jobs}) == ([], True)
