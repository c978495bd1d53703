"""The comparison tool end to end on a tiny budget: pretrain, fine-tune, scratch, table and plot."""

from __future__ import annotations

import json
import subprocess
import sys

from PIL import Image
from workspace import ROOT, environment


def test_compare_runs_both_arms_and_writes_the_table_and_plot(tmp_path):
    env = environment()
    result = subprocess.run(
        [sys.executable, "tools/compare.py", "--pretrain-steps", "2", "--steps", "3", "--out", str(tmp_path),
         "--train", "shards/fashion-mnist/train-000000.tar", "--shots", "1", "5"],
        cwd=ROOT, env=env, capture_output=True, text=True, timeout=900,
    )
    assert result.returncode == 0, result.stderr[-3000:]
    table = (tmp_path / "comparison.md").read_text()
    assert "| MPP pretrained, fine-tuned |" in table and "| from scratch |" in table
    assert "top-1 (sample)" in table and "5-shot" in table and "difference" in table
    numbers = json.loads((tmp_path / "comparison.json").read_text())
    assert numbers["steps"] == {"finetune": 3, "scratch": 3}
    for arm in ("finetune", "scratch"):
        assert 0.0 <= numbers["test_accuracy"][arm]["sample"] <= 1.0
        assert set(numbers["fewshot"][arm]) == {"1", "5"}
    # The pretraining checkpoint was the one fine-tuned: its run folder holds it.
    assert (tmp_path / "pretrain" / "checkpoints" / "last.ckpt").is_file()
    with Image.open(tmp_path / "comparison.png") as plot:
        assert plot.size[0] > 300 and plot.size[1] > 200
    assert table in result.stdout
