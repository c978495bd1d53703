"""What a run says is true: the settings it runs with, where its checkpoints and W&B records are, and how
to go on after a stop, whatever the config leaves out (W&B disabled, no callbacks, no checkpoint yet)."""

from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
from pathlib import Path

import pytest
import yaml
from workspace import ROOT, TESTS, environment, time_limit

DEMO = "configs/pretrain/demo.yaml"
CHECKPOINT = TESTS / "fixtures" / "before-layout" / "pretrain.ckpt"  # corruption ratio 0.5
QUICK = ["--data.batch_size", "8", "--data.num_workers", "0", "--trainer.limit_val_batches", "1",
         "--trainer.enable_progress_bar", "false", "--trainer.num_sanity_val_steps", "0",
         "--trainer.precision", "32-true"]


def mpp(*args: str, root: Path, **env: str) -> tuple[int, list[str]]:
    """`mpp <args>` in a subprocess with its run under `root` -> (exit code, its `mpp:` lines)."""
    code, out = console(*args, root=root, **env)
    lines = [line for line in out if line.startswith("mpp: ")]
    assert lines, "\n".join(out[-40:])
    return code, lines


def console(*args: str, root: Path, **env: str) -> tuple[int, list[str]]:
    """`mpp <args>` in a subprocess with its run under `root` -> (exit code, the lines it printed on stdout and
    stderr, in the order printed, without colours)."""
    command = [sys.executable, "-m", "mpp", *args, *QUICK, "--trainer.default_root_dir", str(root)]
    done = subprocess.run(command, cwd=ROOT, env=environment(PYTHONUNBUFFERED="1", **env), stdout=subprocess.PIPE,
                          stderr=subprocess.STDOUT, text=True, timeout=time_limit(300))
    return done.returncode, re.sub(r"\x1b\[[\d;]*m", "", done.stdout).splitlines()


# A warning of W&B's after the run is finished, from the run's own process, as W&B's at its exit would be.
LATE_WARNING = """
import atexit

import pytorch_lightning as pl
import wandb


class LateWandbWarning(pl.Callback):
    def on_train_end(self, trainer, pl_module):
        atexit.register(wandb.termwarn, "a warning after the run")
"""


def test_a_model_setting_given_with_a_checkpoint_is_applied_and_said(tmp_path: Path) -> None:
    # Lightning lays the checkpoint's hyperparameters over the command line: the run took 0.5, silently.
    code, lines = mpp("validate", "--config", DEMO, "--ckpt_path", str(CHECKPOINT),
                      "--model.init_args.corruption.ratio", "1.0", root=tmp_path)
    assert code == 0, lines
    assert "mpp: --model.init_args.corruption.ratio 1.0 from the command line, over the checkpoint's 0.5" in lines
    saved = yaml.safe_load((tmp_path / "config.yaml").read_text())
    assert saved["model"]["init_args"]["corruption"]["ratio"] == 1.0
    # The checkpoint's other settings stay: its encoder, not the config's.
    assert saved["model"]["init_args"]["encoder"]["dim"] == 16


def test_a_run_without_wandb_or_configured_checkpoints_says_where_its_checkpoint_is(tmp_path: Path) -> None:
    # Lightning's own checkpoint callback, with W&B disabled: the header said "checkpoints in none", the
    # last line named a W&B folder that was never written, and `--ckpt_path last` with nothing to resume
    # from started at step 0 with Lightning's warning alone.
    code, lines = mpp("fit", "--config", DEMO, "--trainer.callbacks", "null", "--trainer.max_steps", "2",
                      "--trainer.val_check_interval", "2", "--ckpt_path", "last", root=tmp_path, WANDB_MODE="disabled")
    assert code == 0, lines
    folder = tmp_path / "checkpoints"
    assert f"mpp: run folder {tmp_path}; checkpoints in {folder}" in lines
    assert f"mpp: --ckpt_path last: no checkpoint in {folder}: the run starts at step 0" in lines
    assert "mpp: W&B disabled (WANDB_MODE=disabled): the run logs nothing to W&B" in lines
    (written,) = folder.glob("*.ckpt")  # Lightning's name: no last.ckpt, so `--ckpt_path last` would find nothing
    assert lines[-1] == f"mpp: checkpoint {written} (resume with --ckpt_path {written})"
    assert not any("W&B run" in line for line in lines)


@pytest.mark.parametrize(("stop_at", "said"), [
    (1, "no checkpoint in {folder} to resume from: running it again starts at step 0"),
    (3, "resume with --ckpt_path last"),
])
def test_a_run_stopped_by_sigterm_says_how_to_go_on(tmp_path: Path, stop_at: int, said: str) -> None:
    callbacks = {"trainer": {"callbacks": [
        {"class_path": "ModelCheckpoint", "init_args": {"every_n_train_steps": 2, "save_last": True}},
        {"class_path": "probes.Sigterm", "init_args": {"step": stop_at}},
    ]}}
    (tmp_path / "stop.yaml").write_text(yaml.safe_dump(callbacks))
    code, lines = mpp("fit", "--config", DEMO, "--config", str(tmp_path / "stop.yaml"), "--trainer.max_steps", "10",
                      root=tmp_path / "run", WANDB_MODE="disabled")
    assert code == 128 + signal.SIGTERM, lines
    assert lines[-1] == "mpp: stopped by SIGTERM; " + said.format(folder=tmp_path / "run" / "checkpoints")


def test_evaluating_ckpt_path_last_without_a_checkpoint_is_refused(tmp_path: Path) -> None:
    # Lightning evaluated the freshly initialised model instead, with a warning.
    code, lines = mpp("validate", "--config", DEMO, "--ckpt_path", "last", root=tmp_path / "empty",
                      WANDB_MODE="disabled")
    assert code == 2
    assert lines[-1] == (f"mpp: error: --ckpt_path last: no last checkpoint in {tmp_path / 'empty' / 'checkpoints'}; "
                         "give the checkpoint's path")


def test_a_finished_offline_run_says_where_its_wandb_run_is_once(tmp_path: Path) -> None:
    # W&B's closing lines repeated mpp's last: "You can sync this run to the cloud by running:",
    # "wandb sync <the run's folder>", "Find logs at: <the run's folder>/logs".
    (tmp_path / "late_warning.py").write_text(LATE_WARNING)
    code, out = console("fit", "--config", DEMO, "--trainer.callbacks+=late_warning.LateWandbWarning",
                        "--trainer.max_steps", "2",
                        root=tmp_path / "run", WANDB_SILENT="false",
                        PYTHONPATH=os.pathsep.join([str(tmp_path), str(TESTS)]))
    assert code == 0, "\n".join(out[-40:])
    (folder,) = (tmp_path / "run" / "wandb").glob("offline-run-*")
    closing = out[out.index("`Trainer.fit` stopped: `max_steps=2` reached.") + 1:]
    assert closing == [
        f"mpp: checkpoint {tmp_path / 'run' / 'checkpoints' / 'last.ckpt'} (resume with --ckpt_path last)",
        f"mpp: W&B run {folder} (upload with `wandb sync {folder}`)",
        "wandb: WARNING a warning after the run",
    ]
    assert sum(f"wandb sync {folder}" in line for line in out) == 1
    assert not any("You can sync this run" in line or "Find logs at" in line for line in out)


def test_a_stopped_offline_run_leaves_the_upload_hint_to_wandb(tmp_path: Path) -> None:
    # mpp names no W&B run when a fit stops: W&B's closing lines are then the one place that does.
    callbacks = {"trainer": {"callbacks": [{"class_path": "probes.Sigterm", "init_args": {"step": 1}}]}}
    (tmp_path / "stop.yaml").write_text(yaml.safe_dump(callbacks))
    code, out = console("fit", "--config", DEMO, "--config", str(tmp_path / "stop.yaml"), "--trainer.max_steps", "10",
                        root=tmp_path / "run", WANDB_SILENT="false")
    assert code == 128 + signal.SIGTERM, "\n".join(out[-40:])
    (folder,) = (tmp_path / "run" / "wandb").glob("offline-run-*")
    assert sum(f"wandb sync {folder}" in line for line in out) == 1
    assert out[-5].startswith("mpp: stopped by SIGTERM; ")
    assert out[-3:-1] == ["wandb: You can sync this run to the cloud by running:", f"wandb: wandb sync {folder}"]
