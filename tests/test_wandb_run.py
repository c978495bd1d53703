"""A `mpp fit` killed with SIGKILL keeps its W&B records up to its last checkpoint, and a fit
resumed from that checkpoint continues the same W&B run: one run over both attempts' folders."""

from __future__ import annotations

import signal
import subprocess
from pathlib import Path

import pytest
import torch
import yaml
from workspace import console_script, run

from mpp.wandb_records import FILE_HEADER, history, read_records, records, run_folders, run_history

ROOT = Path(__file__).resolve().parents[1]
DEMO = ROOT / "configs" / "pretrain" / "demo.yaml"
EVERY, KILL, STEPS = 3, 7, 9  # checkpoints at steps 3 and 6; killed as step 7 begins
QUICK = ["--data.batch_size", "16", "--data.num_workers", "0", "--data.shuffle_buffer", "0",
         "--trainer.limit_val_batches", "0", "--trainer.log_every_n_steps", "1",
         "--trainer.enable_progress_bar", "false", "--trainer.max_steps", str(STEPS)]


def fit(root: Path, *args: str, kill_at_step: int | None = None) -> subprocess.CompletedProcess:
    """`mpp fit` of the demo, shrunk, with its run under `root`: a checkpoint every EVERY steps."""
    callbacks = [
        {"class_path": "pytorch_lightning.callbacks.ModelCheckpoint", "init_args": {
            "filename": "step{step:07d}", "auto_insert_metric_name": False, "every_n_train_steps": EVERY,
            "save_top_k": -1, "save_last": True, "enable_version_counter": False}},
        {"class_path": "probes.RunProbe", "init_args": {"out": str(root / "probe"), "tag": "fit",
                                                       "kill_at_step": kill_at_step}},
    ]
    config = root / f"callbacks-{kill_at_step}.yaml"
    config.write_text(yaml.safe_dump({"trainer": {"callbacks": callbacks}}))
    result, _ = run([console_script("mpp"), "fit", "--config", str(DEMO), "--config", str(config), *QUICK,
                     "--trainer.default_root_dir", str(root), *args], cwd=ROOT)
    return result


def run_ids(root: Path) -> set[str]:
    return {path.stem.removeprefix("run-") for path in (root / "wandb").glob("offline-run-*/run-*.wandb")}


def steps(folder: Path) -> list[int]:
    return [row["trainer/global_step"] for row in history(folder)]


@pytest.fixture(scope="module")
def killed(tmp_path_factory: pytest.TempPathFactory) -> Path:
    root = tmp_path_factory.mktemp("killed")
    result = fit(root, kill_at_step=KILL)
    assert result.returncode == -signal.SIGKILL, result.stderr[-3000:]
    return root


def test_a_killed_run_keeps_the_records_of_every_step_its_last_checkpoint_holds(killed: Path) -> None:
    saved = torch.load(killed / "checkpoints" / "last.ckpt", weights_only=True)
    assert saved["global_step"] == 6
    (run_id,) = run_ids(killed)
    first = run_folders(killed / "wandb", run_id)[0]
    assert set(range(saved["global_step"])) <= set(steps(first)), "rows of checkpointed steps were lost"
    assert saved["callbacks"]["WandbRun"]["run_id"] == run_id


def test_reading_on_where_a_growing_wandb_file_stopped_misses_no_record(killed: Path, tmp_path: Path) -> None:
    (run_id,) = run_ids(killed)
    path = run_folders(killed / "wandb", run_id)[0] / f"run-{run_id}.wandb"
    whole, growing = path.read_bytes(), tmp_path / path.name
    for cut in range(FILE_HEADER, len(whole), 97):  # as wandb left it at some moment, mid-record mostly
        growing.write_bytes(whole[:cut])
        before, offset = read_records(growing)
        growing.write_bytes(whole)
        after, _ = read_records(growing, offset)
        assert [r.num for r in before + after] == [r.num for r in records(path)]


def test_a_fit_resumed_from_last_continues_the_same_wandb_run(killed: Path) -> None:
    resumed = fit(killed, "--ckpt_path", "last")
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    (run_id,) = run_ids(killed)
    first, second = run_folders(killed / "wandb", run_id)
    before, after = steps(first), steps(second)
    assert len(set(before)) == len(before) and len(set(after)) == len(after), "a step logged twice in one attempt"
    assert after == list(range(6, STEPS)), "the resumed attempt starts at its checkpoint"
    # Killed as step 7 began, the first attempt may hold step 6, which the second takes again: W&B keeps both.
    assert set(before) - set(range(6)) <= {6}
    assert sorted(set(before + after)) == list(range(STEPS))
    assert [row["trainer/global_step"] for row in run_history(killed / "wandb", run_id)] == before + after
    # The record `wandb sync` reads to upload the second folder as a continuation of the first.
    (record,) = [r for r in records(second / f"run-{run_id}.wandb") if r.WhichOneof("record_type") == "run"]
    assert record.run.resume
    # The run's closing lines name both folders for `wandb sync`.
    assert f"(upload with `wandb sync {killed / 'wandb' / f'offline-run-*-{run_id}'}`)" in resumed.stdout
