"""End-to-end training throughput: `Trainer.fit` of MaskedPatchPretraining reading shards through
ShardDataModule, next to the same fit fed fixed in-memory uint8 batches of the same shape.

Same model, batch, precision, gradient clipping and logging interval, same process; the arms
alternate (A B B A ...) so that machine noise hits both alike. Each fit is timed from the end
of its first `--warmup` steps to the end of its last step, so worker start-up, the first
batches and one-off allocations are left out and the number is steady-state images per
second, with the epoch boundaries that fall inside (a new shard epoch starts new DataLoader
workers and refills the shuffle buffer). The img/s at the median step time is printed too: it
moves less when other processes take the cores for a while. The model is built once and
trained on by every fit: its weights do not change the time a step takes.

Settings:
    demo     configs/pretrain/demo.yaml's model and data options (28 px grey FashionMNIST, ViT of
             width 128, batch 128, resampled epochs of 78 batches, so the default 100 steps
             cross one epoch boundary) on the embedded shards/fashion-mnist shards.
    vit_b16  configs/pretrain/vit_b16.yaml's model (224 px RGB ViT-B/16, compiled as the config
             says) and data options on ~256 px JPEG shards this tool writes to a temporary
             folder; for a GPU machine (benchmarks/bench_gpu.py adds the compute-only step and MFU).

    python -m benchmarks.bench_fit   # demo, 2 fits of each arm
    python -m benchmarks.bench_fit --workers 2 --repeats 3
    python -m benchmarks.bench_fit --setting vit_b16 --batch 64 --workers 12 --steps 60
"""

from __future__ import annotations

import os
import statistics
import tempfile
import time
from pathlib import Path

import torch

from benchmarks.kit import (
    ROOT,
    SETTINGS,
    SHARD_TARGET,
    Rates,
    alternate,
    argument_parser,
    fit_arms,
    host_line,
    load_run_config,
    quiet_lightning,
    run_precision,
    write_photo_shards,
)
from mpp import MaskedPatchPretraining


def report(results: dict[str, list[Rates]], *, header: str) -> float:
    """Print the table and the verdict; returns the ratio shards / synthetic of the median window rates."""
    print(header)
    print(f"{'arm':<26} {'img/s':>8} {'img/s at the median step':>25}   img/s of each fit, in order")
    medians = {}
    for name, rates in results.items():
        window, per_step = (statistics.median(r[i] for r in rates) for i in (0, 1))
        medians[name] = (window, per_step)
        print(f"{name:<26} {window:>8.1f} {per_step:>25.1f}   {' '.join(f'{r[0]:.1f}' for r in rates)}")
    (shards, shards_step), (synthetic, synthetic_step) = medians.values()
    spread = max(max(r[0] for r in rates) / min(r[0] for r in rates) for rates in results.values())
    if spread > 1.2:
        print(
            f"fits of one arm differ by up to {spread:.2f}x: other load on the machine; the ratio at the median "
            f"step is the steadier figure, more --repeats the remedy"
        )
    ratio = shards / synthetic
    verdict = "meets" if ratio >= SHARD_TARGET else "MISSES"
    print(
        f"ratio shards / synthetic: {ratio:.3f}x (at the median step {shards_step / synthetic_step:.3f}x); "
        f"{verdict} the target >= {SHARD_TARGET:.2f}x"
    )
    return ratio


def main() -> None:
    parser = argument_parser(__doc__)
    parser.add_argument("--setting", choices=sorted(SETTINGS), default="demo")
    parser.add_argument("--batch", type=int, help="batch size (default: the config's; vit_b16: 64)")
    parser.add_argument(
        "--workers",
        type=int,
        help="DataLoader workers of the shard arm (default: the config's, demo 1, vit_b16 8; but 0 "
        "where torch's threads already take every core, as on 2 cores: a worker there competes "
        "with the model for the same cores and measured slower than decoding in the main "
        "process)",
    )
    parser.add_argument("--steps", type=int, default=100, help="training steps per fit")
    parser.add_argument("--warmup", type=int, default=10, help="steps per fit left out of the timing")
    parser.add_argument("--repeats", type=int, default=2, help="fits of each arm, alternating A B B A ...")
    parser.add_argument("--images", type=int, default=2048, help="vit_b16: JPEGs to write")
    parser.add_argument("--per-shard", type=int, default=256, help="vit_b16: JPEGs per shard")
    parser.add_argument("--side", type=int, default=256, help="vit_b16: approximate JPEG side in px")
    args = parser.parse_args()
    quiet_lightning()
    run = load_run_config(args.setting)
    batch = args.batch or (64 if args.setting == "vit_b16" else run["data"]["batch_size"])
    workers, why = args.workers, ""
    if workers is None and (os.cpu_count() or 1) <= torch.get_num_threads():
        workers, why = 0, " (no core free of torch's threads)"
    elif workers is None:
        workers = run["data"]["num_workers"]
    torch.manual_seed(0)
    model = MaskedPatchPretraining(**run["model"])

    with tempfile.TemporaryDirectory() as tmp:
        if args.setting == "demo":
            shards = str(ROOT / run["data"]["train"])
            described = "the embedded FashionMNIST shards"
        else:
            shards = write_photo_shards(Path(tmp), images=args.images, per_shard=args.per_shard, side=args.side)
            described = f"{args.images} random ~{args.side} px JPEGs in shards of {args.per_shard}"
        started = time.perf_counter()
        arms = fit_arms(model, run, shards=shards, batch=batch, workers=workers, steps=args.steps, warmup=args.warmup)
        results = alternate(arms, args.repeats)
        elapsed = time.perf_counter() - started

    device = "cuda: " + torch.cuda.get_device_name() if torch.cuda.is_available() else "cpu"
    encoder = run["model"]["encoder"]
    header = (
        f"{args.setting}: ViT dim {encoder['dim']} depth {encoder['depth']}, {encoder['image_size']} px x "
        f"{encoder['channels']} ch, batch {batch}, {run_precision(run['trainer'])}; shards: "
        f"{described}, {workers} workers{why}\n{host_line(device, lightning=True)}\n"
        f"{args.steps} steps per fit, timed after step {args.warmup}; {args.repeats} fits per arm alternating; "
        f"{elapsed:.0f} s\n"
    )
    report(results, header=header)


if __name__ == "__main__":
    main()
