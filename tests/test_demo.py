"""The demo as a user runs it: the full pretraining config learns beyond the majority class.

About two minutes on two CPU cores, so it is marked slow: `make test-slow`.
"""

from __future__ import annotations

import subprocess
import sys

import pytest
from workspace import ROOT, environment, time_limit

from mpp.outputs.wandb_records import history


@pytest.mark.slow
def test_demo_pretraining_beats_the_majority_class(tmp_path):
    env = environment()
    result = subprocess.run(
        [sys.executable, "-m", "mpp", "fit", "--config", "configs/pretrain/demo.yaml",
         "--trainer.default_root_dir", str(tmp_path), "--trainer.enable_progress_bar", "false"],
        cwd=ROOT, env=env, capture_output=True, text=True, timeout=time_limit(1800),
    )
    assert result.returncode == 0, result.stderr[-3000:]
    (run,) = (tmp_path / "wandb").glob("offline-run-*")
    validations = [row for row in history(run) if "val/mpp_accuracy" in row]
    first, last = validations[0], validations[-1]
    assert last["trainer/global_step"] == 199  # logged during the 200th step
    assert last["val/mpp_accuracy"] > last["val/majority_accuracy"] + 0.10
    assert last["val/mpp_accuracy"] > first["val/mpp_accuracy"]
    assert last["val/loss"] < first["val/loss"]
