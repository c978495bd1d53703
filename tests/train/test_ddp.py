"""DDP ranks (gloo, CPU) through every stage of the shipped demo configs — fit with its
validation, validate, test — on shard counts and sizes that 2, 3 and 4 ranks do not divide evenly.

Every rank must run the same number of evaluation batches (or a collective waits forever),
and the metrics must still count each sample once: on the same checkpoint, 2, 3 and 4 ranks give
the 1-rank metrics, the classifier's and (with a corruption that draws nothing) the pretraining
module's.
"""

from __future__ import annotations

import json
import subprocess
import sys
import time
from pathlib import Path

import pytest
from probes import records
from shardkit import sample, write_shard
from workspace import ROOT, environment, time_limit

from mpp.shards.format import shard_name, shard_pattern

DDP = ["--trainer.accelerator", "cpu", "--trainer.devices", "2", "--trainer.strategy", "ddp"]
RANK_COUNTS = (1, 2, 3, 4)


def ranks(devices: int) -> list[str]:
    """One process, or `devices` DDP ranks, on the CPU, in float32: each rank's batches differ with the
    rank count, and float32 keeps a sample's numbers the same in any batch to within rounding."""
    return ["--trainer.accelerator", "cpu", "--trainer.devices", str(devices), "--trainer.precision", "32-true",
            *(["--trainer.strategy", "ddp"] if devices > 1 else [])]


def labelled_shards(folder: Path, prefix: str, sizes: list[int], *, first: int = 0) -> str:
    """Shards of `sizes` samples numbered from `first`, label = number % 10 (ten classes, as the demo)."""
    folder.mkdir(parents=True, exist_ok=True)
    index = first
    for number, size in enumerate(sizes):
        samples = []
        for i in range(index, index + size):
            record = sample(i, size=(14, 14))
            record["cls"] = str(i % 10).encode()
            record["__key__"] = f"{prefix}{i:06d}"
            samples.append(record)
        write_shard(folder / shard_name(prefix, number), samples)
        index += size
    return str(folder / shard_pattern(prefix, len(sizes)))


def mpp(*args: str, cwd: Path, timeout: float = 300) -> subprocess.CompletedProcess:
    env = environment()
    return subprocess.run([sys.executable, "-m", "mpp", *args], cwd=cwd, env=env, capture_output=True,
                          text=True, timeout=time_limit(timeout))


def probe(out: Path, tag: str) -> str:
    return "--trainer.callbacks+=" + json.dumps({"class_path": "probes.RunProbe",
                                                 "init_args": {"out": str(out), "tag": tag}})


def events(out: Path, tag: str, rank: int, kind: str) -> list[dict]:
    return [r for r in records(out / f"{tag}-rank{rank}.jsonl") if r["event"] == kind]


@pytest.fixture(scope="module")
def data(tmp_path_factory: pytest.TempPathFactory) -> dict[str, str]:
    root = tmp_path_factory.mktemp("shards")
    return {
        "train": labelled_shards(root, "train", [8, 8, 8]),
        # 3 shards for 2 ranks, of 5 + 4 samples on rank 0 and 6 on rank 1: 3 and 2 batches of 4;
        # on 4 ranks, rank 3 has none
        "val": labelled_shards(root, "val", [5, 6, 4], first=1000),
        # 22 samples: 10, 10 and 2 on 3 ranks, 4, 9, 2 and 7 on 4
        "test": labelled_shards(root, "test", [3, 9, 2, 7, 1], first=2000),
    }


def shrink(data: dict[str, str], *splits: str) -> list[str]:
    """Overrides that make a demo config a seconds-long run on the shards above."""
    args = ["--data.batch_size", "4", "--data.num_workers", "0", "--data.samples_per_epoch", "16",
            "--trainer.enable_progress_bar", "false", "--trainer.log_every_n_steps", "1"]
    for split in splits:
        args += [f"--data.{split}", data[split]]
    return args


def test_ddp_pretraining_validates_with_every_rank_in_step(tmp_path: Path, data: dict[str, str]) -> None:
    config = str(ROOT / "configs" / "pretrain" / "demo.yaml")
    out = tmp_path / "probe"
    # Every patch masked: a validation that draws nothing, so that any rank count gives the same metrics.
    # (Set for the fit; the validations take them from its checkpoint.)
    fixed = ["--model.init_args.corruption.ratio", "1.0", "--model.init_args.corruption.mask", "1.0",
             "--model.init_args.corruption.random", "0.0", "--model.init_args.corruption.keep", "0.0"]
    fit = mpp("fit", "--config", config, *DDP, *shrink(data, "train", "val"), *fixed, "--trainer.max_steps", "4",
              "--trainer.val_check_interval", "2", "--trainer.default_root_dir", str(tmp_path / "run"),
              probe(out, "fit"), cwd=ROOT)
    assert fit.returncode == 0, fit.stderr[-4000:]
    for stage in ("sanity", "val"):
        batches = [events(out, "fit", rank, stage) for rank in (0, 1)]
        assert len(batches[0]) == len(batches[1]) > 0, f"{stage}: ranks ran different batch counts"
    val = [events(out, "fit", rank, "val") for rank in (0, 1)]
    # Two validations (steps 2 and 4) of 3 batches each, rank 1's third one empty.
    assert [len(b["labels"]) for b in val[0]] == [4, 4, 1] * 2
    assert [len(b["labels"]) for b in val[1]] == [4, 2, 0] * 2
    seen = [label for rank in val for b in rank[:3] for label in b["labels"]]
    assert sorted(seen) == sorted(i % 10 for i in range(1000, 1015)), "each sample once per validation"
    ends = [events(out, "fit", rank, "val_end")[-1]["metrics"] for rank in (0, 1)]
    assert {"val/loss", "val/mpp_accuracy", "val/majority_accuracy"} <= ends[0].keys()
    for name in ("val/loss", "val/mpp_accuracy", "val/majority_accuracy"):
        assert ends[0][name] == pytest.approx(ends[1][name]), f"{name} differs between ranks"

    checkpoint = str(tmp_path / "run" / "checkpoints" / "last.ckpt")
    metrics = {}
    for devices in RANK_COUNTS:
        tag = f"validate{devices}"
        validated = mpp("validate", "--config", config, *ranks(devices), *shrink(data, "val"),
                        "--ckpt_path", checkpoint, "--trainer.default_root_dir", str(tmp_path / tag),
                        probe(out, tag), cwd=ROOT)
        assert validated.returncode == 0, validated.stderr[-4000:]
        batches = [events(out, tag, rank, "val") for rank in range(devices)]
        assert len({len(b) for b in batches}) == 1, f"{devices} ranks ran different validation batch counts"
        seen = sorted(label for rank in batches for b in rank for label in b["labels"])
        assert seen == sorted(i % 10 for i in range(1000, 1015)), f"{devices} ranks: each sample once"
        assert "val/mpp_accuracy" in validated.stdout
        metrics[devices] = events(out, tag, 0, "val_end")[0]["metrics"]
    assert {"val/loss", "val/mpp_accuracy", "val/majority_accuracy"} <= metrics[1].keys()
    for devices in RANK_COUNTS[1:]:
        assert metrics[devices].keys() == metrics[1].keys()
        for name, value in metrics[1].items():
            assert metrics[devices][name] == pytest.approx(value, rel=1e-5), f"{name} on {devices} ranks"


def test_ddp_classifier_tests_each_sample_once(tmp_path: Path, data: dict[str, str]) -> None:
    config = str(ROOT / "configs" / "scratch" / "demo.yaml")
    out = tmp_path / "probe"
    fit = mpp("fit", "--config", config, *DDP, *shrink(data, "train", "val"), "--trainer.max_steps", "3",
              "--model.init_args.num_classes", "10",  # shards without an index: the config says
              "--trainer.default_root_dir", str(tmp_path / "run"), cwd=ROOT)
    assert fit.returncode == 0, fit.stderr[-4000:]
    checkpoint = str(tmp_path / "run" / "checkpoints" / "last.ckpt")
    accuracy = {}
    for devices in RANK_COUNTS:
        tag = f"test{devices}"
        tested = mpp("test", "--config", config, *ranks(devices), *shrink(data, "test"),
                     "--ckpt_path", checkpoint, "--trainer.default_root_dir", str(tmp_path / tag), probe(out, tag),
                     cwd=ROOT)
        assert tested.returncode == 0, tested.stderr[-4000:]
        batches = [events(out, tag, rank, "test") for rank in range(devices)]
        assert len({len(b) for b in batches}) == 1, "ranks ran different test batch counts"
        seen = sorted(label for rank in batches for b in rank for label in b["labels"])
        assert seen == sorted(i % 10 for i in range(2000, 2022)), "each test sample exactly once"
        accuracy[devices] = events(out, tag, 0, "test_end")[0]["metrics"]
    assert {"test/loss", "test/accuracy"} <= accuracy[1].keys()
    for devices in RANK_COUNTS[1:]:
        assert accuracy[devices].keys() == accuracy[1].keys()
        for name, value in accuracy[1].items():
            assert accuracy[devices][name] == pytest.approx(value, rel=1e-5), f"{name} on {devices} ranks"


@pytest.mark.slow  # waits out a DDP timeout (~20 s)
def test_a_stuck_rank_stops_the_run_within_the_timeout_naming_the_stage(tmp_path: Path, data: dict[str, str]) -> None:
    config = str(ROOT / "configs" / "pretrain" / "demo.yaml")
    short = tmp_path / "timeout.yaml"
    short.write_text("trainer:\n  strategy:\n    class_path: pytorch_lightning.strategies.DDPStrategy\n"
                     "    init_args:\n      timeout: '0:00:10'\n")
    stall = "--trainer.callbacks+=" + json.dumps({"class_path": "probes.Stall", "init_args": {"rank": 1, "seconds": 60}})
    start = time.monotonic()
    run = mpp("fit", "--config", config, "--config", str(short), *DDP[:4], *shrink(data, "train", "val"),
              "--trainer.max_steps", "2", "--trainer.logger", "false", "--trainer.default_root_dir", str(tmp_path),
              stall, cwd=ROOT, timeout=120)
    assert run.returncode != 0
    assert time.monotonic() - start < 60, "the run should stop at the 10 s timeout, not when the rank wakes up"
    assert "timed out waiting for the other ranks during the sanity check of the validation set" in run.stderr
