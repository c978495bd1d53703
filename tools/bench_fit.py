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
             folder; for a GPU machine (tools/bench_gpu.py adds the compute-only step and MFU).

    python tools/bench_fit.py                                   # demo, 2 fits of each arm
    python tools/bench_fit.py --workers 2 --repeats 3
    python tools/bench_fit.py --setting vit_b16 --batch 64 --workers 12 --steps 60
"""

from __future__ import annotations

import argparse
import logging
import os
import platform
import statistics
import tempfile
import time
import warnings
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np
import pytorch_lightning as pl
import torch
import yaml
from PIL import Image
from torch.utils.data import DataLoader, Dataset

from mpp import MaskedPatchPretraining, ShardDataModule
from mpp.model.pixels import pair
from mpp.shards.sources import Source
from mpp.shards.writer import WriteOptions, write_shards

ROOT = Path(__file__).resolve().parents[1]
SETTINGS = {"demo": ROOT / "configs/pretrain/demo.yaml", "vit_b16": ROOT / "configs/pretrain/vit_b16.yaml"}
TARGET = 0.90  # shards must keep at least this share of the synthetic arm's throughput
Rates = tuple[float, float]  # (window img/s, img/s at the median step) of one fit


def load_run_config(setting: str) -> dict[str, Any]:
    """The run config of a setting: {"trainer": ..., "model": init_args, "data": ...}."""
    config = yaml.safe_load(SETTINGS[setting].read_text())
    return {"trainer": config["trainer"], "model": config["model"]["init_args"], "data": dict(config["data"])}


def random_photo(rng: np.random.Generator, side: int) -> Image.Image:
    """An RGB image of about `side` px: smooth colour gradients plus grain, so it encodes like a photo."""
    width, height = (int(side * f) for f in rng.uniform(0.9, 1.3, size=2))
    coarse = Image.fromarray(rng.integers(0, 256, (5, 5, 3), dtype=np.uint8))
    smooth = np.asarray(coarse.resize((width, height), Image.Resampling.BICUBIC), dtype=np.int16)
    grain = rng.integers(-10, 11, smooth.shape, dtype=np.int16)
    return Image.fromarray(np.clip(smooth + grain, 0, 255).astype(np.uint8))


def write_photo_shards(folder: Path, *, images: int, per_shard: int, side: int, seed: int = 0) -> str:
    """Write `images` random JPEGs (quality 90) with mpp's shard writer; returns their brace pattern."""
    def load(index: int) -> Image.Image:
        return random_photo(np.random.default_rng([seed, index]), side)

    source = Source(labels=[None] * images, load=load, origin=lambda i: f"random photo {i}", classes=None)
    sidecar, _ = write_shards(source, folder, "bench", WriteOptions(shard_samples=per_shard, image_format="jpg",
                                                                    quality=90, progress=False))
    return str(folder / f"bench-{{000000..{len(sidecar['shards']) - 1:06d}}}.tar")


class FixedBatches(Dataset):
    """`length` batches cycled from a few fixed random ones, shaped like ShardDataModule's batches."""

    def __init__(self, *, batch_size: int, channels: int, image_size: int, length: int, distinct: int = 4) -> None:
        generator = torch.Generator().manual_seed(0)
        self.batch_size, self.length = batch_size, length
        self.batches = [
            {"image": torch.randint(0, 256, (batch_size, channels, image_size, image_size), dtype=torch.uint8,
                                    generator=generator),
             "label": torch.full((batch_size,), -1, dtype=torch.int64),
             "skipped": torch.tensor(0, dtype=torch.int64)}
            for _ in range(distinct)
        ]

    def __len__(self) -> int:
        return self.length

    def __getitem__(self, index: int) -> dict[str, torch.Tensor]:
        return self.batches[index % len(self.batches)]


class SyntheticData(pl.LightningDataModule):
    """In-memory batches in the main process: what the model trains at when data costs nothing."""

    def __init__(self, batches: FixedBatches) -> None:
        super().__init__()
        self.batches = batches
        self.batch_size = batches.batch_size  # read by configure_optimizers to scale the lr, as ShardDataModule's

    def train_dataloader(self) -> DataLoader:
        # batch_size=None: the items are whole batches; pinned like ShardDataModule's on a GPU.
        return DataLoader(self.batches, batch_size=None, num_workers=0, pin_memory=torch.cuda.is_available())


class SteadyRate(pl.Callback):
    """Images per second after step `skip`: over the whole window (end of step `skip` to the end
    of the last step), and at the median step time, which other processes' bursts move less."""

    def __init__(self, skip: int) -> None:
        self.skip = skip
        self.images = 0
        self.ends: list[float] = []

    def on_train_batch_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule, outputs: Any, batch: Any,
                           batch_idx: int) -> None:
        if trainer.global_step < self.skip:
            return
        if pl_module.device.type == "cuda" and trainer.global_step in (self.skip, trainer.max_steps):
            # Only at the window's ends: a sync every step would keep the host from queueing ahead.
            torch.cuda.synchronize(pl_module.device)
        self.ends.append(time.perf_counter())
        if trainer.global_step > self.skip:
            self.images += batch["image"].shape[0]

    def rates(self) -> Rates:
        """(window img/s, img/s at the median step)."""
        if len(self.ends) < 2:
            raise RuntimeError(f"no step was timed: --steps must exceed --warmup ({self.skip})")
        steps = np.diff(self.ends)
        return self.images / (self.ends[-1] - self.ends[0]), self.images / len(steps) / float(np.median(steps))


def quiet_lightning() -> None:
    """Keep Lightning's start-up banners and hints (no validation, few workers in the in-memory arm,
    deprecations) out of the table."""
    for name in ("pytorch_lightning", "lightning.pytorch", "lightning.fabric"):
        logging.getLogger(name).setLevel(logging.ERROR)
    for message in (".*does not have many workers.*", ".*no `val_dataloader`.*", ".*is deprecated.*"):
        warnings.filterwarnings("ignore", message=message)


def fit_rates(model: MaskedPatchPretraining, data: pl.LightningDataModule, trainer_config: dict[str, Any], *,
              steps: int, warmup: int) -> Rates:
    """One `Trainer.fit` of `steps` steps -> its steady-state rates after `warmup` steps."""
    rate = SteadyRate(warmup)
    trainer = pl.Trainer(accelerator="auto", devices=1, logger=False, enable_checkpointing=False,
                         enable_progress_bar=False, enable_model_summary=False, max_steps=steps,
                         limit_val_batches=0, precision=trainer_config.get("precision", "32-true"),
                         gradient_clip_val=trainer_config.get("gradient_clip_val"),
                         log_every_n_steps=trainer_config.get("log_every_n_steps", 50), callbacks=[rate])
    trainer.fit(model, datamodule=data)
    return rate.rates()


def alternate(arms: dict[str, Callable[[], Rates]], repeats: int) -> dict[str, list[Rates]]:
    """Run each arm `repeats` times, A B B A A B ... (A B C C B A ... for three): the order reverses every round."""
    results: dict[str, list[Rates]] = {name: [] for name in arms}
    order = list(arms)
    for repeat in range(repeats):
        for name in order if repeat % 2 == 0 else reversed(order):
            results[name].append(arms[name]())
    return results


def fit_arms(model: MaskedPatchPretraining, run: dict[str, Any], *, shards: str, batch: int, workers: int,
             steps: int, warmup: int) -> dict[str, Callable[[], Rates]]:
    """The two arms: a fit of `model` on `shards` through ShardDataModule, and one on in-memory batches."""
    data_options = {**run["data"], "train": shards, "batch_size": batch, "num_workers": workers}
    data_options.pop("val", None)
    image_size, channels = pair(model.encoder_config.image_size)[0], model.encoder_config.channels
    if data_options.get("resampled"):
        batches_per_epoch = data_options["samples_per_epoch"] // batch
    else:
        batches_per_epoch = steps
    # The same epoch length in both arms, so that both pay Lightning's epoch boundaries alike.
    synthetic = SyntheticData(FixedBatches(batch_size=batch, channels=channels, image_size=image_size,
                                           length=batches_per_epoch))

    def shard_arm() -> Rates:
        return fit_rates(model, ShardDataModule(**data_options), run["trainer"], steps=steps, warmup=warmup)

    def synthetic_arm() -> Rates:
        return fit_rates(model, synthetic, run["trainer"], steps=steps, warmup=warmup)

    return {"shards (ShardDataModule)": shard_arm, "synthetic (in memory)": synthetic_arm}


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
        print(f"fits of one arm differ by up to {spread:.2f}x: other load on the machine; the ratio at the median "
              f"step is the steadier figure, more --repeats the remedy")
    ratio = shards / synthetic
    verdict = "meets" if ratio >= TARGET else "MISSES"
    print(f"ratio shards / synthetic: {ratio:.3f}x (at the median step {shards_step / synthetic_step:.3f}x); "
          f"{verdict} the target >= {TARGET:.2f}x")
    return ratio


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                     formatter_class=argparse.RawDescriptionHelpFormatter,
                                     epilog="\n\n".join(__doc__.split("\n\n")[1:]))
    parser.add_argument("--setting", choices=sorted(SETTINGS), default="demo")
    parser.add_argument("--batch", type=int, help="batch size (default: the config's; vit_b16: 64)")
    parser.add_argument("--workers", type=int,
                        help="DataLoader workers of the shard arm (default: the config's, demo 1, vit_b16 8; but 0 "
                             "where torch's threads already take every core, as on 2 cores: a worker there competes "
                             "with the model for the same cores and measured slower than decoding in the main "
                             "process)")
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
        arms = fit_arms(model, run, shards=shards, batch=batch, workers=workers, steps=args.steps,
                        warmup=args.warmup)
        results = alternate(arms, args.repeats)
        elapsed = time.perf_counter() - started

    device = "cuda: " + torch.cuda.get_device_name() if torch.cuda.is_available() else "cpu"
    encoder = run["model"]["encoder"]
    header = (f"{args.setting}: ViT dim {encoder['dim']} depth {encoder['depth']}, {encoder['image_size']} px x "
              f"{encoder['channels']} ch, batch {batch}, {run['trainer'].get('precision', '32-true')}; shards: "
              f"{described}, {workers} workers{why}\ntorch {torch.__version__}, Lightning {pl.__version__}, {device}, "
              f"{torch.get_num_threads()} threads, {platform.processor() or platform.machine()}\n"
              f"{args.steps} steps per fit, timed after step {args.warmup}; {args.repeats} fits per arm alternating; "
              f"{elapsed:.0f} s\n")
    report(results, header=header)


if __name__ == "__main__":
    main()
