"""Whole `mpp fit` runs in subprocesses: two DDP ranks on CPU (gloo), a run killed with SIGKILL
that resumes where it was, W&B history and run included, and a checkpoint write killed halfway."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import torch
import yaml
from probes import digest, records
from shardkit import write_shards
from workspace import environment, time_limit

from mpp.outputs.wandb_records import (
    FILE_HEADER,
    history,
    read_records,
    run_folders,
    run_history,
)
from mpp.outputs.wandb_records import records as wandb_records
from mpp.train.optim import warmup_cosine

PER_SHARD = 6


def mpp_fit(config: dict, tmp_path: Path, *args: str, timeout: float = 240) -> subprocess.CompletedProcess:
    path = tmp_path / f"config-{len(list(tmp_path.glob('config-*.yaml')))}.yaml"
    path.write_text(yaml.safe_dump(config))
    env = environment()  # without WANDB_SERVICE: a service of this process would hold the killed run's id
    command = [sys.executable, "-m", "mpp", "fit", "--config", str(path), *args]
    return subprocess.run(command, cwd=tmp_path, env=env, capture_output=True, text=True, timeout=time_limit(timeout))


def config(tmp_path: Path, shards: str, *, callbacks: list[dict], **trainer: object) -> dict:
    return {
        "seed_everything": 0,
        "trainer": {"accelerator": "cpu", "devices": 1, "logger": False, "enable_progress_bar": False,
                    "enable_checkpointing": False, "default_root_dir": str(tmp_path / "run"), "callbacks": callbacks,
                    **trainer},
        "model": {"class_path": "mpp.MaskedPatchPretraining", "init_args": {
            "encoder": {"image_size": 16, "patch_size": 4, "channels": 3, "dim": 32, "depth": 2, "heads": 2,
                        "mlp_dim": 64},
            "optimizer": {"name": "adamw", "lr": 1e-3, "weight_decay": 0.05, "warmup_steps": 4},
        }},
        "data": {"train": shards, "batch_size": 4, "num_workers": 1, "image_size": 16, "shuffle_buffer": 8,
                 "resampled": True, "samples_per_epoch": 48},
    }


def probe(tmp_path: Path, tag: str, **kw: object) -> dict:
    return {"class_path": "probes.RunProbe", "init_args": {"out": str(tmp_path / "probe"), "tag": tag, **kw}}


def test_two_ddp_ranks_read_disjoint_shards_and_end_with_the_same_weights(tmp_path: Path) -> None:
    shards = write_shards(tmp_path / "shards", shards=8, per_shard=PER_SHARD)
    run = config(tmp_path, shards, callbacks=[probe(tmp_path, "ddp")], devices=2, strategy="ddp", max_steps=6)
    result = mpp_fit(run, tmp_path)
    assert result.returncode == 0, result.stderr[-3000:]
    assert "world size 2" in result.stdout + result.stderr
    ranks = [records(tmp_path / "probe" / f"ddp-rank{rank}.jsonl") for rank in (0, 1)]
    shards_read = []
    for rank in ranks:
        start, *steps, end = rank
        assert start["world_size"] == 2 and start["global_step"] == 0
        assert [s["global_step"] for s in steps] == list(range(6)) and end["global_step"] == 6
        assert end["weights"] != start["weights"], "the rank did not train"
        shards_read.append({label // PER_SHARD for s in steps for label in s["labels"]})
    assert ranks[0][0]["weights"] == ranks[1][0]["weights"]
    assert ranks[0][-1]["weights"] == ranks[1][-1]["weights"], "the ranks ended with different weights"
    assert shards_read[0] and shards_read[1] and not shards_read[0] & shards_read[1], shards_read


@pytest.fixture(scope="module")
def sigkilled(tmp_path_factory: pytest.TempPathFactory) -> dict:
    """A fit logging to W&B (offline), checkpointing every 3 steps, SIGKILLed as step 5 begins; then the
    same fit resumed with `--ckpt_path last` to step 9."""
    tmp_path = tmp_path_factory.mktemp("sigkilled")
    shards = write_shards(tmp_path / "shards", shards=4, per_shard=PER_SHARD)
    checkpoints = {"class_path": "pytorch_lightning.callbacks.ModelCheckpoint", "init_args": {
        "dirpath": str(tmp_path / "ckpt"), "filename": "step{step}", "every_n_train_steps": 3, "save_top_k": -1,
        "save_last": True}}
    wandb = {"class_path": "pytorch_lightning.loggers.WandbLogger", "init_args": {"project": "mpp"}}
    common = {"max_steps": 9, "enable_checkpointing": True, "logger": wandb, "log_every_n_steps": 1}
    killed = mpp_fit(config(tmp_path, shards, callbacks=[checkpoints, probe(tmp_path, "killed", kill_at_step=5)],
                            **common), tmp_path)
    assert killed.returncode == -9, killed.stderr[-3000:]
    saved = torch.load(tmp_path / "ckpt" / "last.ckpt", weights_only=True)
    run_ids = {path.stem.removeprefix("run-") for path in (tmp_path / "run" / "wandb").glob("offline-run-*/run-*.wandb")}
    killed_rows = {run_id: history(folder) for run_id in run_ids for folder in run_folders(tmp_path / "run" / "wandb", run_id)}
    resumed = mpp_fit(config(tmp_path, shards, callbacks=[checkpoints, probe(tmp_path, "resumed")], **common),
                      tmp_path, "--ckpt_path", "last")
    return {"path": tmp_path, "saved": saved, "killed_rows": killed_rows, "resumed": resumed,
            "wandb": tmp_path / "run" / "wandb"}


def test_a_run_killed_with_sigkill_resumes_its_step_optimiser_and_schedule(sigkilled: dict) -> None:
    tmp_path, saved, resumed = sigkilled["path"], sigkilled["saved"], sigkilled["resumed"]
    assert saved["global_step"] == 3
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    start, *steps, end = records(tmp_path / "probe" / "resumed-rank0.jsonl")
    assert start["global_step"] == 3 and end["global_step"] == 9
    assert start["optimizer"] == digest(saved["optimizer_states"][0]["state"])
    assert start["scheduler"] == saved["lr_schedulers"][0]["last_epoch"] == 3
    before = {s["global_step"]: s["lr"] for s in records(tmp_path / "probe" / "killed-rank0.jsonl")[1:]}
    after = {s["global_step"]: s["lr"] for s in steps}
    assert sorted(before) == [0, 1, 2, 3, 4] and sorted(after) == list(range(3, 9))
    for step in (3, 4):  # the steps both runs took: the same learning rate
        assert after[step] == pytest.approx(before[step])
    for step, lr in after.items():  # and the schedule goes on as if nothing happened
        assert lr == pytest.approx(1e-3 * warmup_cosine(step, warmup_steps=4, total_steps=9, final_ratio=0.0))


def _steps(rows: list[dict]) -> list[int]:
    return [row["trainer/global_step"] for row in rows if "trainer/global_step" in row]


def test_a_killed_run_keeps_the_wandb_records_of_every_step_its_last_checkpoint_holds(sigkilled: dict) -> None:
    """wandb-core writes its log every 15 s by default and, its parent gone, exits without writing:
    26 steps once left the 7-byte header alone. Every checkpoint now waits for the rows before it."""
    ((run_id, rows),) = sigkilled["killed_rows"].items()
    assert set(range(sigkilled["saved"]["global_step"])) <= set(_steps(rows)), "rows of checkpointed steps were lost"
    assert sigkilled["saved"]["callbacks"]["WandbRun"]["run_id"] == run_id


def test_a_fit_resumed_from_last_continues_the_same_wandb_run(sigkilled: dict) -> None:
    (run_id,) = sigkilled["killed_rows"]
    first, second = run_folders(sigkilled["wandb"], run_id)  # one W&B run: a folder per attempt
    before, after = _steps(history(first)), _steps(history(second))
    assert len(set(before)) == len(before) and len(set(after)) == len(after), "a step logged twice in one attempt"
    assert after == list(range(3, 9)), "the resumed attempt starts at its checkpoint"
    # Killed as step 5 began, the first attempt holds steps 3 and 4, which the second takes again: W&B keeps both.
    assert sorted(set(before + after)) == list(range(9))
    assert _steps(run_history(sigkilled["wandb"], run_id)) == before + after
    # The record `wandb sync` reads to upload the second folder as a continuation of the first.
    (record,) = [r for r in wandb_records(second / f"run-{run_id}.wandb") if r.WhichOneof("record_type") == "run"]
    assert record.run.resume
    # The run's closing lines name both folders for `wandb sync`.
    assert f"(upload with `wandb sync {sigkilled['wandb'] / f'offline-run-*-{run_id}'}`)" in sigkilled["resumed"].stdout


def test_reading_on_where_a_growing_wandb_file_stopped_misses_no_record(sigkilled: dict, tmp_path: Path) -> None:
    (run_id,) = sigkilled["killed_rows"]
    path = run_folders(sigkilled["wandb"], run_id)[0] / f"run-{run_id}.wandb"
    whole, growing = path.read_bytes(), tmp_path / path.name
    for cut in range(FILE_HEADER, len(whole), 97):  # as wandb left it at some moment, mid-record mostly
        growing.write_bytes(whole[:cut])
        before, offset = read_records(growing)
        growing.write_bytes(whole)
        after, _ = read_records(growing, offset)
        assert [r.num for r in before + after] == [r.num for r in wandb_records(path)]


KILL_DURING_WRITE = textwrap.dedent("""
    import builtins, os, signal, sys
    import torch
    from pytorch_lightning.plugins.io import TorchCheckpointIO
    from mpp.outputs.checkpoint_io import AtomicCheckpointIO

    io = AtomicCheckpointIO() if sys.argv[1] == "atomic" else TorchCheckpointIO()
    path = os.path.abspath(sys.argv[2])
    io.save_checkpoint({"step": 1, "weights": torch.ones(1 << 16)}, path)
    real_open = builtins.open

    class HalfThenKill:
        def __init__(self, file):
            self.file = file
        def write(self, data):
            self.file.write(bytes(data)[: len(data) // 2])
            self.file.flush()
            os.kill(os.getpid(), signal.SIGKILL)
        def __getattr__(self, name):
            return getattr(self.file, name)
        def __enter__(self):
            return self
        def __exit__(self, *exc):
            self.file.close()

    def killing_open(file, mode="r", *args, **kwargs):
        opened = real_open(file, mode, *args, **kwargs)
        if "w" in mode and os.path.dirname(os.path.abspath(file)) == os.path.dirname(path):
            if os.path.abspath(file) == path:  # the good checkpoint is truncated: die before anything else
                os.kill(os.getpid(), signal.SIGKILL)
            return HalfThenKill(opened)
        return opened

    builtins.open = killing_open
    io.save_checkpoint({"step": 2, "weights": torch.zeros(1 << 16)}, path)
    print("the second save was not interrupted")
""")


def other_filesystem(path: Path) -> str | None:
    """A writable folder on another filesystem than `path` (a tmpfs), if the machine has one."""
    shm = Path("/dev/shm")
    if shm.is_dir() and os.access(shm, os.W_OK) and shm.stat().st_dev != path.stat().st_dev:
        return str(shm)
    return None


@pytest.mark.parametrize("io", ["atomic", "lightning"])
def test_a_kill_during_a_checkpoint_write_keeps_the_previous_checkpoint(tmp_path: Path, io: str) -> None:
    env = dict(os.environ)
    if io == "lightning":
        # Lightning's own write is atomic only where its temporary folder shares the checkpoint's filesystem.
        scratch = other_filesystem(tmp_path)
        if scratch is None:
            pytest.skip("no second filesystem to show the unprotected write failing")
        env["TMPDIR"] = scratch
    path = tmp_path / "ckpt" / "last.ckpt"
    result = subprocess.run([sys.executable, "-c", KILL_DURING_WRITE, io, str(path)], env=env, capture_output=True,
                            text=True, timeout=time_limit(120))
    assert result.returncode == -9, result.stdout + result.stderr[-2000:]
    if io == "atomic":
        assert torch.load(path, weights_only=True)["step"] == 1
        assert sorted(p.name for p in path.parent.glob("*.ckpt")) == ["last.ckpt"]
    else:  # without the protection the previous checkpoint is gone
        with pytest.raises((OSError, RuntimeError, EOFError)):  # gone, or cut short
            torch.load(path, weights_only=True)
