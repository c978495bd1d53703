"""python -m experiments.levers --quick end to end: the default lever and longer pretraining, studies of the from-scratch
and MPP arms side by side; the longer pretraining brings the default's from-scratch runs over instead of
running them again, and the lever is chosen on validation, not test."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
from workspace import ROOT, environment, time_limit


@pytest.mark.slow  # two quick studies, minutes on two cores
def test_quick_levers_share_the_runs_they_have_in_common_and_choose_on_validation(tmp_path: Path) -> None:
    out = tmp_path / "levers"
    command = [sys.executable, "-m", "experiments.levers", "--quick", "--levers", "pretrain", "--out", str(out),
               "--reuse", str(tmp_path / "no-study"), "--results", str(tmp_path / "results")]  # fmt: skip
    result = subprocess.run(command, cwd=ROOT, env=environment(), capture_output=True, text=True, timeout=time_limit(900))
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    summary = json.loads((tmp_path / "results" / "levers.json").read_text())
    assert list(summary["levers"]) == ["default", "pretrain"]
    validation = {name: lever["arms"]["mpp"]["validation"]["mean"] for name, lever in summary["levers"].items()}
    assert summary["chosen_on_validation"] == max(validation, key=lambda name: validation[name])
    for name, lever in summary["levers"].items():
        study = json.loads((out / name / "study.json").read_text())
        assert lever["arms"]["mpp"]["test"] == study["budgets"]["1000"]["arms"]["mpp"]["test_accuracy"]
        assert lever["mpp - scratch"]["n"] == 2 and lever["test_set"]["problems"] == []
        assert list(study["budgets"]) == ["1000"] and list(study["budgets"]["1000"]["arms"]) == ["scratch", "mpp"]
        assert (tmp_path / "results" / name / "study.md").is_file()
    longer = json.loads((out / "pretrain" / "study.json").read_text())
    assert longer["settings"]["pretrain_steps"] == 18 and longer["budgets"]["1000"]["arms"]["mpp"]["pretrain_steps"] == 18
    # The from-scratch runs (a grid of 2, then the other seed) came from the default lever, the rest ran.
    assert longer["reused"] == {"runs": 3, "from": [str(out / "default")]}
    for path in (out / "pretrain" / "runs").glob("**/result.json"):
        found = json.loads(path.read_text())
        assert ("reused_from" in found) == ("/scratch/" in found["name"] and found["kind"] == "fit"), found["name"]
    table = (tmp_path / "results" / "levers.md").read_text()
    assert "| pretrain: longer pretraining (18 steps) |" in table and "Chosen on validation" in table
    assert "3 finished runs brought from" in (out / "pretrain" / "study.md").read_text()
