"""The comparison (python -m experiments.compare) end to end on a tiny budget: pretrain, fine-tune, scratch, table and plot."""

from __future__ import annotations

import json
import subprocess
import sys

from PIL import Image
from workspace import ROOT, environment, time_limit

from mpp.eval.linear import DEFAULTS


def test_compare_runs_both_arms_and_writes_the_table_and_plot(tmp_path):
    env = environment()
    result = subprocess.run(
        [sys.executable, "-m", "experiments.compare", "--pretrain-steps", "2", "--steps", "3", "--out", str(tmp_path),
         "--train", "shards/fashion-mnist/train-000000.tar", "--shots", "1", "5", "--frozen-train", "300"],
        cwd=ROOT, env=env, capture_output=True, text=True, timeout=time_limit(900),
    )
    assert result.returncode == 0, result.stderr[-3000:]
    table = (tmp_path / "comparison.md").read_text()
    assert "| MPP pretrained, fine-tuned |" in table and "| from scratch |" in table
    assert "top-1 (sample)" in table and "5-shot" in table and "difference" in table
    assert "| 1-shot | 5-shot | k-NN | linear probe | steps |" in table
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
