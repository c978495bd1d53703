"""ViT-B/16 masked patch prediction on one GPU: training img/s in bf16-mixed with torch.compile,
its model-FLOPs utilisation, and end-to-end img/s from local shards next to in-memory batches.

Four arms, alternating (A B C D D C B A ...), on one model built from configs/pretrain/vit_b16.yaml
(its encoder, optimiser, corruption, target, precision and gradient clipping):

    compute     a plain loop of the module's training step on one GPU-resident uint8 batch:
              `module.loss(images)` (forward + prediction_loss) under bf16 autocast, backward,
              clipping, the project's fused AdamW (mpp.train.optim) and schedule. No Lightning and
              no host data, so its img/s is the model's own speed, and MFU is computed from it.
    fit/mem     pytorch_lightning.Trainer.fit of the same module (precision bf16-mixed) on pinned
              in-memory uint8 batches: what Lightning and the host-to-device copy cost.
    fit/shards  the same fit reading ~256 px JPEG shards, written here to a local temporary
              folder, through ShardDataModule (resampled, the config's crop and shuffle buffer).
    fit/shards (decode=device)  the same with ShardDataModule(decode="device"): the workers read
              JPEG headers only, the GPU decodes (batched nvjpeg), crops and resizes. It needs
              torchvision (the gpu-decode extra); without it the arm is skipped, saying so.

torch.compile is the config's `compile: true`: MaskedPatchPretraining compiles itself in place
(`module.compile()`, inductor, default mode), so its forward (targets, normalisation, patch
embedding, corruption, encoder, head) is compiled, and its backward through AOTAutograd; the
loss, clipping and optimiser step run eagerly. The module is shared by all arms, so it
compiles once. The plain loop leaves out the project's non-finite-loss guard (two tiny device
ops a step) and Lightning's hooks; the difference to the in-memory fit is Lightning's cost.

MFU = img/s x training FLOPs per image / peak. The FLOPs are counted from the encoder config
(matmuls only: patch embedding, qkv, attention scores and values, projection, MLP, the MPP
head; x 3 for forward + backward) and printed next to the usual ~105 GFLOPs of ViT-B/16 at
224 px. The last block computes only the outputs the loss uses, so the step executes fewer
FLOPs than the model count; that figure is printed too, MFU uses the model count.

    python -m benchmarks.bench_gpu           # ViT-B/16, batch 256, on the GPU
    python -m benchmarks.bench_gpu --batch 128 --no-compile
    python -m benchmarks.bench_gpu --smoke   # a tiny model on the CPU: checks the script runs
"""

from __future__ import annotations

import argparse
import datetime
import os
import platform
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np
import torch

from benchmarks.kit import (
    SHARD_TARGET,
    Rates,
    alternate,
    argument_parser,
    cpu_name,
    fit_arms,
    load_run_config,
    precision_context,
    quiet_lightning,
    software,
    steady_rates,
    synchronize,
    training_step,
    write_photo_shards,
)
from mpp import MaskedPatchPretraining
from mpp.data.device_decode import torchvision_io
from mpp.errors import ConfigError
from mpp.model.pixels import pair
from mpp.model.vit import ViTConfig
from mpp.train.optim import OptimizerConfig, configure_optimizer

COMPUTE, FIT_MEM, FIT_SHARDS = "compute (plain loop)", "fit/mem (Lightning)", "fit/shards (Lightning)"
FIT_DEVICE_DECODE = "fit/shards (decode=device)"
REFERENCE_GFLOPS = 105.0  # the usual figure for a ViT-B/16 training step at 224 px: 3 x 35 GFLOPs forward
SMOKE_ENCODER = {"image_size": 32, "patch_size": 8, "channels": 3, "dim": 64, "depth": 2, "heads": 2, "mlp_dim": 128}


def training_flops(config: ViTConfig, *, corrupted: int, outputs: int, last_block_queries: int | None = None) -> float:
    """Matmul FLOPs of one image's training step (3 x forward: backward costs two forwards).

    `last_block_queries` counts the last block as the encoder runs it for MPP: keys and values
    for every token, queries, projection and MLP for the class token and corrupted patches only.
    """
    tokens, dim, mlp = 1 + config.num_patches, config.dim, config.mlp_dim
    patch_h, patch_w = pair(config.patch_size)

    def block(queries: int) -> float:
        qkv = 2 * tokens * dim * 3 * dim
        attention = 2 * queries * tokens * dim * 2  # scores q·k and the weighted sum of values
        projection = 2 * queries * dim * dim
        feed_forward = 2 * queries * dim * mlp * 2
        return qkv + attention + projection + feed_forward

    blocks = (config.depth - 1) * block(tokens) + block(last_block_queries or tokens)
    embedding = 2 * config.num_patches * (patch_h * patch_w * config.channels) * dim
    forward = embedding + blocks + 2 * corrupted * dim * outputs
    return 3.0 * forward


def compute_arm(
    model: MaskedPatchPretraining, run: dict[str, Any], *, batch: int, steps: int, warmup: int
) -> Callable[[], Rates]:
    """The training step in a plain loop on one device-resident batch -> (window, median-step) img/s."""
    device = model.device
    encoder = ViTConfig(**run["model"]["encoder"])
    height, width = pair(encoder.image_size)
    images = torch.randint(0, 256, (batch, encoder.channels, height, width), dtype=torch.uint8, device=device)
    autocast = precision_context(str(run["trainer"].get("precision", "")), device)
    clip = run["trainer"].get("gradient_clip_val")

    def arm() -> Rates:
        model.to(device)  # a finished fit leaves the module on the CPU (Lightning's teardown)
        built = configure_optimizer(model, OptimizerConfig(**run["model"]["optimizer"]), warmup + steps, batch)
        optimizer, schedule = built["optimizer"], built["lr_scheduler"]["scheduler"]
        ends = []
        for step in range(warmup + steps):
            training_step(model, optimizer, images, autocast=autocast, clip=clip)
            schedule.step()
            if step == warmup - 1 or step == warmup + steps - 1:
                synchronize(device)  # only at the window's ends: a sync every step would stall the queue
            if step >= warmup - 1:
                ends.append(time.perf_counter())
        return steady_rates(ends, batch * steps)

    return arm


def smoke_run(run: dict[str, Any]) -> dict[str, Any]:
    """The vit_b16 run with a tiny encoder and small data, for a CPU check that everything runs."""
    data = {**run["data"], "shuffle_buffer": 16}
    return {**run, "model": {**run["model"], "encoder": SMOKE_ENCODER}, "data": data}


def print_summary(
    results: dict[str, list[Rates]],
    model: MaskedPatchPretraining,
    *,
    args: argparse.Namespace,
    run: dict[str, Any],
    compiled: str,
    started: float,
    skipped: str | None,
) -> None:
    """The final block: when, on what, which step, every arm's img/s (why the device-decode arm was
    `skipped`, if it was), FLOPs, MFU, and the verdict."""
    encoder = model.encoder_config
    corrupted = model.corruption.num_corrupted(encoder.num_patches)
    model_flops = training_flops(encoder, corrupted=corrupted, outputs=model.outputs)
    executed_flops = training_flops(
        encoder, corrupted=corrupted, outputs=model.outputs, last_block_queries=1 + corrupted
    )
    medians = {name: float(np.median([r[0] for r in rates])) for name, rates in results.items()}
    compute, in_memory, from_shards = medians[COMPUTE], medians[FIT_MEM], medians[FIT_SHARDS]
    on_gpu = torch.cuda.is_available() and not args.smoke
    mfu = compute * model_flops / (args.peak_tflops * 1e12) if on_gpu else None
    ratio = from_shards / in_memory
    if on_gpu:
        hardware = (
            f"{torch.cuda.get_device_name()}, CUDA {torch.version.cuda}, peak memory "
            f"{torch.cuda.max_memory_allocated() / 2**30:.1f} GiB"
        )
    else:
        hardware = f"CPU {cpu_name()}, {torch.get_num_threads()} threads"

    print(f"\n=== bench_gpu: ViT MPP training{' (SMOKE: tiny model on CPU)' if args.smoke else ''} ===")
    print(f"date            {datetime.datetime.now().astimezone().isoformat(timespec='seconds')}")
    print(f"hardware        {hardware}; {os.cpu_count()} CPU cores")
    print(f"software        {software()}, Python {platform.python_version()}")
    print(
        f"model           {encoder.image_size} px / {encoder.patch_size}, dim {encoder.dim}, depth {encoder.depth}, "
        f"heads {encoder.heads}, MLP {encoder.mlp_dim}, {encoder.channels} ch; {corrupted} corrupted patches"
    )
    print(
        f"step            batch {args.batch}, {run['trainer'].get('precision')}, clip "
        f"{run['trainer'].get('gradient_clip_val')}, compiled: {compiled}"
    )
    print(
        f"timing          {args.warmup} warm-up + {args.steps} timed steps per arm, {args.repeats} alternating "
        f"repeat(s); shard arms: {args.images} JPEGs, {args.workers} workers"
    )
    for name, rates in results.items():
        each = " ".join(f"{r[0]:.1f}" for r in rates)
        print(
            f"{name:<28}{medians[name]:>10.1f} img/s   (median step {np.median([r[1] for r in rates]):.1f}; "
            f"runs {each})"
        )
    if skipped is not None:
        print(f"{FIT_DEVICE_DECODE:<28}skipped: {skipped}")
    print(
        f"FLOPs / image   {model_flops / 1e9:.4g} G counted (model), {executed_flops / 1e9:.4g} G executed "
        f"(last block's skip); reference {REFERENCE_GFLOPS:.0f} G for ViT-B/16"
    )
    if mfu is not None:
        reference_mfu = compute * REFERENCE_GFLOPS * 1e9 / (args.peak_tflops * 1e12)
        print(
            f"MFU             {mfu:.1%} of {args.peak_tflops:.0f} TFLOP/s ({compute * model_flops / 1e12:.1f} "
            f"TFLOP/s); {reference_mfu:.1%} with the reference {REFERENCE_GFLOPS:.0f} G"
        )
    else:
        print("MFU             - (CPU: no MFU target)")
    print(f"Lightning       fit/mem / compute = {in_memory / compute:.3f}x")
    print(f"wall time       {time.perf_counter() - started:.0f} s")
    if FIT_DEVICE_DECODE in medians:
        on_device = medians[FIT_DEVICE_DECODE] / in_memory
        print(
            f"ratio shards (decode=device) / in-memory fit: {on_device:.3f}x "
            f"({'meets' if on_device >= SHARD_TARGET else 'MISSES'} the target >= {SHARD_TARGET:.2f}x)"
        )
    verdict = "meets" if ratio >= SHARD_TARGET else "MISSES"
    print(
        f"ratio shards / in-memory fit: {ratio:.3f}x ({verdict} the target >= {SHARD_TARGET:.2f}x); "
        + (f"MFU {mfu:.1%}" if mfu is not None else "MFU - (CPU smoke)")
    )


def main() -> None:
    parser = argument_parser(__doc__)
    parser.add_argument("--batch", type=int, default=256, help="images per step (256: the config's batch per GPU)")
    parser.add_argument("--steps", type=int, default=60, help="timed steps of every arm, per repeat")
    parser.add_argument("--warmup", type=int, default=15, help="untimed steps first (compilation happens here)")
    parser.add_argument("--repeats", type=int, default=2, help="runs of each arm, alternating")
    parser.add_argument(
        "--workers",
        type=int,
        default=max(1, min(16, os.cpu_count() or 1) - 2),
        help="ShardDataModule workers (default: CPU cores - 2, at most 14)",
    )
    parser.add_argument("--images", type=int, default=2048, help="JPEGs written to the local shards")
    parser.add_argument("--peak-tflops", type=float, default=989.0, help="the device's dense bf16 peak (H200 SXM: 989)")
    parser.add_argument("--no-compile", dest="compile", action="store_false", help="run the module eagerly")
    parser.add_argument(
        "--no-device-decode", dest="device_decode", action="store_false", help="leave out the decode=device arm"
    )
    parser.add_argument(
        "--smoke",
        action="store_true",
        help="tiny model, few steps, compiled with the aot_eager backend: runs on a CPU in seconds",
    )
    args = parser.parse_args()
    if args.smoke:
        args.batch, args.steps, args.warmup, args.repeats, args.images = 8, 3, 2, 1, 48
        args.workers = min(args.workers, 1)
    elif not torch.cuda.is_available():
        parser.error("no CUDA device: this benchmark is for a GPU; --smoke checks that it runs on a CPU")
    quiet_lightning()
    torch.set_float32_matmul_precision("high")  # TF32 for whatever matmuls stay in float32
    started = time.perf_counter()

    run = load_run_config("vit_b16")
    run = smoke_run(run) if args.smoke else run
    torch.manual_seed(0)
    device = torch.device("cuda" if torch.cuda.is_available() and not args.smoke else "cpu")
    # The smoke run traces with dynamo but skips inductor's code generation, slow on a CPU.
    run["model"]["compile"] = args.compile and not args.smoke
    model = MaskedPatchPretraining(**run["model"]).to(device)
    if args.compile and args.smoke:
        model.compile(backend="aot_eager")
    compiled = (
        "no"
        if not args.compile
        else ("MaskedPatchPretraining.forward in place, " + ("aot_eager backend" if args.smoke else "inductor"))
    )

    with tempfile.TemporaryDirectory() as tmp:
        shards = write_photo_shards(
            Path(tmp), images=args.images, per_shard=max(16, args.images // 32), side=40 if args.smoke else 256
        )
        arms = {COMPUTE: compute_arm(model, run, batch=args.batch, steps=args.steps, warmup=args.warmup)}
        fit_options: dict[str, Any] = {
            "shards": shards,
            "batch": args.batch,
            "workers": args.workers,
            "steps": args.warmup + args.steps,
            "warmup": args.warmup,
        }
        fits = fit_arms(model, run, **fit_options)
        arms[FIT_MEM] = fits["synthetic (in memory)"]
        arms[FIT_SHARDS] = fits["shards (ShardDataModule)"]
        skipped = None if args.device_decode else "--no-device-decode"
        if skipped is None:
            try:
                torchvision_io()
            except ConfigError as error:
                skipped = str(error)
        if skipped is None:
            device_fits = fit_arms(model, run, **fit_options, data={"decode": "device"})
            arms[FIT_DEVICE_DECODE] = device_fits["shards (ShardDataModule)"]
        results = alternate(arms, args.repeats)

    print_summary(results, model, args=args, run=run, compiled=compiled, started=started, skipped=skipped)


if __name__ == "__main__":
    main()
