"""The benchmarks (`python -m benchmarks.bench_*`) run in their smallest modes and end with their
verdict, and each says how to use it; the FLOPs that MFU is computed from agree with torch's own FLOP
counter."""

from __future__ import annotations

import re
import subprocess
import sys
from collections.abc import Iterator

import pytest
import torch
from torch.nn.attention import SDPBackend, sdpa_kernel
from torch.utils.flop_counter import FlopCounterMode
from workspace import ROOT, help_of, time_limit

from benchmarks.bench_gpu import training_flops
from benchmarks.bench_precision import mpp_step
from benchmarks.kit import SETTINGS, SHARD_TARGET, load_run_config
from mpp import MaskedPatchPretraining, OptimizerConfig, ViTConfig

RATIO = r"(\d+\.\d+)x"
BENCHMARKS = sorted(path.stem for path in (ROOT / "benchmarks").glob("bench_*.py"))


SMALLEST = {
    "fit": ["-m", "benchmarks.bench_fit", "--steps", "3", "--warmup", "1", "--repeats", "1", "--workers", "0"],
    "memory": ["-m", "benchmarks.bench_memory", "--few", "1", "--many", "2", "--per-shard", "4", "--workers", "1",
               "--shuffle-buffers", "0", "--image-size", "8", "--side", "16", "--batch", "4"],
    "gpu": ["-m", "benchmarks.bench_gpu", "--smoke"],
    # Eager only: compiling even the demo model takes ~30 s an arm on two cores.
    "precision": ["-m", "benchmarks.bench_precision", "--batch", "4", "--repeats", "1", "--warmup", "1", "--no-compile"],
    "resume": ["-m", "benchmarks.bench_resume", "--shard-sizes", "2500", "--batches", "3", "--repeats", "1"],
    "reduction": ["-m", "benchmarks.bench_reduction", "--batch", "2", "--ranks", "3", "--repeats", "1", "--warmup", "1"],
}


@pytest.fixture(scope="module")
def runs() -> Iterator[dict[str, subprocess.Popen]]:
    """Every tool's smallest run, started at once: their imports and set-up overlap."""
    started = {name: subprocess.Popen([sys.executable, *args], cwd=ROOT, text=True, stdout=subprocess.PIPE,
                                      stderr=subprocess.PIPE) for name, args in SMALLEST.items()}
    yield started
    for process in started.values():
        if process.poll() is None:
            process.kill()
            process.wait()


def output(runs: dict[str, subprocess.Popen], name: str) -> str:
    out, err = runs[name].communicate(timeout=time_limit(120))
    assert runs[name].returncode == 0, err[-3000:]
    return out


def test_bench_fit_compares_shards_with_in_memory_batches(runs: dict[str, subprocess.Popen]) -> None:
    out = output(runs, "fit")
    shards = re.search(r"^shards \(ShardDataModule\) +(\d+\.\d+)", out, re.MULTILINE)
    synthetic = re.search(r"^synthetic \(in memory\) +(\d+\.\d+)", out, re.MULTILINE)
    ratio = re.search(rf"^ratio shards / synthetic: {RATIO} .*(meets|MISSES) the target >= {SHARD_TARGET:.2f}x$", out, re.MULTILINE)
    assert shards and synthetic and ratio, out
    # The ratio is of the arms' medians, which the table shows rounded to 0.1 img/s (the ratio to 0.001).
    shown_shards, shown_synthetic = float(shards[1]), float(synthetic[1])
    rounding = shown_shards / shown_synthetic * (0.05 / shown_shards + 0.05 / shown_synthetic) + 5e-4
    assert abs(float(ratio[1]) - shown_shards / shown_synthetic) <= 1.01 * rounding


def test_bench_precision_times_each_precision(runs: dict[str, subprocess.Popen]) -> None:
    out = output(runs, "precision")
    rows = re.findall(r"^\| (32-true|bf16-mixed), (eager|compiled) \| [\d.]+ \(1\) \| [\d.]+ \| [\d.]+ \| (\d+\.\d+)x \|$",
                      out, re.MULTILINE)
    assert [(precision, mode) for precision, mode, _ in rows] == [("32-true", "eager"), ("bf16-mixed", "eager")], out
    assert rows[0][2] == "1.00"  # the reference is the first arm


def test_bench_resume_times_the_replay_of_a_resumed_stream(runs: dict[str, subprocess.Popen]) -> None:
    out = output(runs, "resume")
    # 3 batches of 128 into 2,500-sample shards: the buffer and the next sample are in the first shard
    row = re.search(r"^ +2500 +1 +(\d+) +(\d+\.\d+)s +(\d+\.\d+)s +(-?\d+\.\d+)s$", out, re.MULTILINE)
    assert row, out
    assert int(row[1]) >= 3 * 128, "the replay reads at least the samples the stream had taken"
    assert float(row[4]) == pytest.approx(float(row[3]) - float(row[2]), abs=1.5e-3)


def test_bench_reduction_times_both_reductions_per_rank_count(runs: dict[str, subprocess.Popen]) -> None:
    out = output(runs, "reduction")
    row = re.search(rf"^\| 3 \| (\d+\.\d+) \| (\d+\.\d+) \| {RATIO} \|$", out, re.MULTILINE)
    assert row, out
    ddp, ours, ratio = (float(value) for value in row.groups())
    assert ratio == pytest.approx(ours / ddp, abs=0.01 + 0.001 * ratio / min(ddp, ours))


def test_bench_memory_reads_every_sample_in_a_fresh_process(runs: dict[str, subprocess.Popen]) -> None:
    out = output(runs, "memory")
    rows = re.findall(r"^ +1 +0 +(\d) +(\d+) ", out, re.MULTILINE)
    assert sorted(rows) == [("1", "4"), ("2", "8")], out
    assert re.search(rf"peak 2 / 1 shards: self {RATIO}, children {RATIO}", out), out
    assert re.search(rf"^ratio peak RSS 2 / 1 shards, worst of all settings: {RATIO} .*target <= 1.10x", out,
                     re.MULTILINE), out


def test_bench_gpu_smoke_runs_every_arm_on_the_cpu(runs: dict[str, subprocess.Popen]) -> None:
    out = output(runs, "gpu")
    for arm in ("compute (plain loop)", "fit/mem (Lightning)", "fit/shards (Lightning)"):
        assert re.search(rf"^{re.escape(arm)} +\d+\.\d+ img/s", out, re.MULTILINE), out
    # The device-decode arm runs where torchvision is installed (the bench environment), else says why not.
    device = re.escape("fit/shards (decode=device)")
    assert re.search(rf"^{device} +(\d+\.\d+ img/s|skipped: .*gpu-decode)", out, re.MULTILINE), out
    assert "SMOKE" in out and re.search(r"^date +\d{4}-\d\d-\d\d", out, re.MULTILINE), out
    target = f"target >= {SHARD_TARGET:.2f}x"
    assert re.search(rf"^ratio shards / in-memory fit: {RATIO} .*{target}", out, re.MULTILINE), out


@pytest.mark.parametrize("setting", sorted(SETTINGS))
def test_bench_precision_builds_every_settings_step(setting: str) -> None:
    """Every --setting's step is built as a fit builds it (a config with a reference batch scales its lr
    by the benchmark's batch, here 1) and takes a step; float32 only, since the CPU may emulate bf16."""
    run = load_run_config(setting)
    step = mpp_step(run, batch=1, device=torch.device("cpu"), precision="32-true", compile=False)
    model, optimizer = step.args[:2]
    config = OptimizerConfig(**run["model"]["optimizer"])
    assert optimizer.defaults["lr"] == pytest.approx(config.lr * config.lr_factor(1))
    step()
    assert all(p.grad is not None for p in model.encoder.parameters())
    assert {int(state["step"]) for state in optimizer.state.values()} == {1}


def test_flop_count_matches_torch_flop_counter() -> None:
    config = ViTConfig(image_size=(16, 24), patch_size=4, channels=3, dim=32, depth=3, heads=4, mlp_dim=48)
    model = MaskedPatchPretraining(encoder=config, optimizer=OptimizerConfig(name="adamw", lr=1e-3))
    corrupted = model.corruption.num_corrupted(config.num_patches)
    counter = FlopCounterMode(display=False)
    # Attention through the math backend, whose matmuls the counter sees (it skips CPU flash attention).
    with counter, torch.no_grad(), sdpa_kernel(SDPBackend.MATH):
        model(torch.rand(2, 3, 16, 24))
    executed = training_flops(config, corrupted=corrupted, outputs=model.outputs, last_block_queries=1 + corrupted)
    assert counter.get_total_flops() / 2 == executed / 3  # per image, forward only
    vit_b16 = ViTConfig(image_size=224, patch_size=16, dim=768, depth=12, heads=12, mlp_dim=3072)
    assert abs(training_flops(vit_b16, corrupted=98, outputs=512) / 1e9 - 105.6) < 0.1


@pytest.mark.parametrize("name", BENCHMARKS)
@pytest.mark.filterwarnings("ignore:.*found in sys.modules:RuntimeWarning")  # imported above, run again
def test_every_benchmark_says_how_to_use_it(name: str, monkeypatch, capsys) -> None:
    assert help_of(f"benchmarks.{name}", monkeypatch, capsys).startswith("usage:")
