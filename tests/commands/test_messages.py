"""What a user who gives a command the wrong thing reads: one line naming the file or flag and what to give
instead, and exit code 2, for a file that is not an mpp checkpoint (to `mpp evaluate`, and as the encoder to
start from), shots that are not positive, and an output that is a file where a folder is written."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
import torch
from workspace import ROOT

from mpp.commands import main

NOT_A_CHECKPOINT = "is not an mpp checkpoint (torch cannot read it as one): give a checkpoint written by mpp fit"
DEMO = {name: str(ROOT / "configs" / name / "demo.yaml") for name in ("pretrain", "finetune")}
SHARDS = ["--train", str(ROOT / "shards" / "fashion-mnist" / "train-000000.tar"),
          "--test", str(ROOT / "shards" / "fashion-mnist" / "test-000000.tar")]


def last_line(args: list[str], capfd: pytest.CaptureFixture, monkeypatch: pytest.MonkeyPatch) -> str:
    """`mpp <args>` in this process: its exit code must be 2; its last line."""
    monkeypatch.setattr(sys, "argv", ["mpp"])
    with pytest.raises(SystemExit) as exit_:
        main(args)
    out, err = capfd.readouterr()
    assert exit_.value.code == 2, out + err
    return [line for line in (out + err).splitlines() if line.strip()][-1]


@pytest.fixture
def notes(tmp_path: Path) -> Path:
    path = tmp_path / "notes.md"
    path.write_text("# not a checkpoint\n")
    return path


def test_evaluate_says_a_file_is_not_an_mpp_checkpoint(notes, capfd, monkeypatch) -> None:
    line = last_line(["evaluate", str(notes), *SHARDS], capfd, monkeypatch)
    assert line == f"mpp: error: {notes} {NOT_A_CHECKPOINT}, e.g. runs/<run>/checkpoints/last.ckpt"


@pytest.mark.parametrize("config", ["pretrain", "finetune"])
def test_an_encoder_to_start_from_that_is_not_an_mpp_checkpoint_is_named(config, notes, capfd, monkeypatch,
                                                                          tmp_path) -> None:
    args = ["fit", "--config", DEMO[config], "--model.init_args.pretrained", str(notes),
            "--trainer.default_root_dir", str(tmp_path / "run")]
    line = last_line(args, capfd, monkeypatch)
    assert line == f"mpp: error: {notes} {NOT_A_CHECKPOINT}, e.g. runs/<run>/checkpoints/last.ckpt"


@pytest.mark.parametrize("shots, given", [(["0", "-3"], "0"), (["5", "-3"], "-3"), (["two"], "two")])
def test_evaluate_takes_positive_shots_only(shots, given, tmp_path, capfd, monkeypatch) -> None:
    checkpoint = tmp_path / "last.ckpt"
    checkpoint.write_bytes(b"")  # the options are refused before the checkpoint is read
    line = last_line(["evaluate", str(checkpoint), *SHARDS, "--shots", *shots], capfd, monkeypatch)
    assert line == (f"mpp: error: mpp evaluate: argument --shots: must be a positive whole number, got {given}; "
                    "`mpp evaluate --help` says how to use it")


def test_export_and_predict_say_their_output_must_be_a_folder(notes, tmp_path, capfd, monkeypatch) -> None:
    checkpoint = tmp_path / "last.ckpt"
    torch.save({"state_dict": {}}, checkpoint)  # the output is refused before the checkpoint is read
    line = last_line(["export", str(checkpoint), "--format", "hf", "--out", str(notes)], capfd, monkeypatch)
    assert line == f"mpp: error: --out {notes} is a file: give a folder to write the export into (made if missing)"
    args = ["predict", "--config", DEMO["pretrain"], "--ckpt_path", str(checkpoint), "--predictions.out", str(notes)]
    line = last_line(args, capfd, monkeypatch)
    assert line == (f"mpp: error: predictions.out {notes} is a file: give a folder to write the predictions into "
                    "(made if missing)")
