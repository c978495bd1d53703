"""What the benchmark scripts share: synthetic photos and their shards, the A B B A alternation,
the two `Trainer.fit` arms (from shards, from in-memory batches) with their steady-state rates,
and the lines that describe the machine. The benchmarks run as modules from the project's folder
(`python -m benchmarks.bench_step`) and import it as `benchmarks.kit`. It imports no benchmark.
"""

from __future__ import annotations

import argparse
import contextlib
import functools
import logging
import platform
import time
import warnings
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any, TypeVar

import numpy as np
import pytorch_lightning as pl
import torch
from PIL import Image, ImageDraw, ImageFilter
from torch.utils.data import DataLoader, Dataset

from mpp.data.module import ShardDataModule
from mpp.model.pixels import pair
from mpp.precision import run_precision as fitted_precision
from mpp.shards.format import shard_pattern
from mpp.shards.sources import Source
from mpp.shards.writer import WriteOptions, write_shards

if TYPE_CHECKING:
    from mpp import MaskedPatchPretraining

ROOT = Path(__file__).resolve().parents[1]
SETTINGS = {"demo": ROOT / "configs/pretrain/demo.yaml", "vit_b16": ROOT / "configs/pretrain/vit_b16.yaml"}
SHARD_TARGET = 0.95  # a fit from shards must keep at least this share of the in-memory fit's img/s
SHARD_PREFIX = "bench"  # the shards written here are bench-000000.tar, ...
Rates = tuple[float, float]  # (window img/s, img/s at the median step) of one timed run
T = TypeVar("T")


def argument_parser(doc: str) -> argparse.ArgumentParser:
    """A parser described by a script's docstring: its first paragraph, then the rest as the epilog."""
    first, *rest = doc.split("\n\n")
    return argparse.ArgumentParser(
        description=first, epilog="\n\n".join(rest), formatter_class=argparse.RawDescriptionHelpFormatter
    )


def cpu_name() -> str:
    """The processor as the platform names it, else the machine type."""
    return platform.processor() or platform.machine()


def software(*, lightning: bool = True) -> str:
    """The versions that the numbers depend on: 'torch 2.x, Lightning 2.y'."""
    return f"torch {torch.__version__}" + (f", Lightning {pl.__version__}" if lightning else "")


def host_line(device: str, *, lightning: bool = False) -> str:
    """'torch 2.x[, Lightning 2.y], <device>, N threads, <CPU>': what a result was measured on."""
    return f"{software(lightning=lightning)}, {device}, {torch.get_num_threads()} threads, {cpu_name()}"


def quiet_lightning() -> None:
    """Keep Lightning's banners and hints (no validation, few workers, deprecations) out of the output."""
    for name in ("pytorch_lightning", "lightning.pytorch", "lightning.fabric"):
        logging.getLogger(name).setLevel(logging.ERROR)
    for message in (".*does not have many workers.*", ".*no `val_dataloader`.*", ".*is deprecated.*"):
        warnings.filterwarnings("ignore", message=message)


def photo(rng: np.random.Generator, side: int) -> Image.Image:
    """A photo-like RGB image of about `side` px: smooth colour fields, shapes, soft edges and grain."""
    width, height = (int(side * f) for f in rng.uniform(0.85, 1.25, size=2))
    coarse = Image.fromarray(rng.integers(0, 256, (6, 6, 3), dtype=np.uint8))
    field = coarse.resize((width, height), Image.Resampling.BICUBIC)
    draw = ImageDraw.Draw(field)
    for _ in range(int(rng.integers(4, 12))):
        x, y = rng.integers(0, width), rng.integers(0, height)
        r = int(rng.integers(max(1, side // 16), max(2, side // 3)))
        fill = tuple(int(v) for v in rng.integers(0, 256, 3))
        (draw.ellipse if rng.random() < 0.5 else draw.rectangle)((x - r, y - r, x + r, y + r), fill=fill)
    field = field.filter(ImageFilter.GaussianBlur(float(rng.uniform(0.5, 2.0))))
    grain = rng.normal(0, 6, (height, width, 3))
    return Image.fromarray(np.clip(np.asarray(field, dtype=np.float32) + grain, 0, 255).astype(np.uint8))


def write_photo_shards(folder: Path, *, images: int, per_shard: int, side: int, seed: int = 0) -> str:
    """Write `images` photos as JPEGs (quality 90) with mpp's shard writer; returns the shards' pattern."""
    source = Source(
        labels=[None] * images,
        load=lambda index: photo(np.random.default_rng([seed, index]), side),
        origin=lambda index: f"synthetic photo {index}",
        classes=None,
    )
    options = WriteOptions(shard_samples=per_shard, image_format="jpg", quality=90, progress=False)
    sidecar, _ = write_shards(source, folder, SHARD_PREFIX, options)
    return str(folder / shard_pattern(SHARD_PREFIX, len(sidecar["shards"])))


def alternate(arms: dict[str, Callable[[], T]], repeats: int) -> dict[str, list[T]]:
    """Run each arm `repeats` times, A B B A A B ... (A B C C B A ... for three): the order reverses every round."""
    results: dict[str, list[T]] = {name: [] for name in arms}
    order = list(arms)
    for repeat in range(repeats):
        for name in order if repeat % 2 == 0 else reversed(order):
            results[name].append(arms[name]())
    return results


def precision_context(precision: str, device: torch.device) -> Callable[[], contextlib.AbstractContextManager]:
    """What a step's forward runs under: nothing for 32-true, bf16 autocast for bf16-mixed, entered as
    Lightning's bf16-mixed enters it (no weight-cast cache, so a compiled forward is reused)."""
    if "bf16" in precision:
        return functools.partial(torch.autocast, device.type, dtype=torch.bfloat16, cache_enabled=False)
    return contextlib.nullcontext


def training_step(
    model: MaskedPatchPretraining,
    optimizer: torch.optim.Optimizer,
    images: torch.Tensor,
    *,
    autocast: Callable[[], contextlib.AbstractContextManager],
    clip: float | None = None,
) -> None:
    """One MPP training step without Lightning: loss under `autocast`, backward, clipping at norm `clip`, update."""
    with autocast():
        loss = model.loss(images)
    optimizer.zero_grad(set_to_none=True)
    loss.backward()
    if clip:
        torch.nn.utils.clip_grad_norm_(model.parameters(), clip)
    optimizer.step()


def timed(step: Callable[[], None], device: torch.device) -> float:
    """Seconds one call of `step` takes, synchronised on GPUs."""
    synchronize(device)
    start = time.perf_counter()
    step()
    synchronize(device)
    return time.perf_counter() - start


def synchronize(device: torch.device) -> None:
    """Wait for the device's queued work (a no-op off CUDA), so that a clock read after it is honest."""
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def steady_rates(ends: Sequence[float], images: int) -> Rates:
    """`images` read in the steps between the times `ends` -> (window img/s, img/s at the median step)."""
    steps = np.diff(ends)
    return images / (ends[-1] - ends[0]), images / len(steps) / float(np.median(steps))


def run_precision(trainer_config: dict[str, Any]) -> str:
    """The precision `mpp fit` gives a run config: its own where the device computes it, else this
    machine's (mpp.precision)."""
    return fitted_precision(trainer_config.get("precision"), trainer_config.get("accelerator", "auto"))[0]


def load_run_config(setting: str) -> dict[str, Any]:
    """The run config of a setting, `__base__` files merged in: {"trainer": ..., "model": init_args, "data": ...}."""
    from mpp.config import read_config  # here: jsonargparse and omegaconf would join bench_memory's measured passes

    config = read_config(SETTINGS[setting])
    return {"trainer": config["trainer"], "model": config["model"]["init_args"], "data": dict(config["data"])}


class FixedBatches(Dataset):
    """`length` batches cycled from a few fixed random ones, shaped like ShardDataModule's batches."""

    def __init__(self, *, batch_size: int, channels: int, image_size: int, length: int, distinct: int = 4) -> None:
        generator = torch.Generator().manual_seed(0)
        self.batch_size, self.length = batch_size, length
        self.batches = [
            {
                "image": torch.randint(
                    0, 256, (batch_size, channels, image_size, image_size), dtype=torch.uint8, generator=generator
                ),
                "label": torch.full((batch_size,), -1, dtype=torch.int64),
                "skipped": torch.tensor(0, dtype=torch.int64),
            }
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

    def on_train_batch_end(
        self, trainer: pl.Trainer, pl_module: pl.LightningModule, outputs: Any, batch: Any, batch_idx: int
    ) -> None:
        if trainer.global_step < self.skip:
            return
        if trainer.global_step in (self.skip, trainer.max_steps):
            # Only at the window's ends: a sync every step would keep the host from queueing ahead.
            synchronize(pl_module.device)
        self.ends.append(time.perf_counter())
        if trainer.global_step > self.skip:
            self.images += batch["image"].shape[0]

    def rates(self) -> Rates:
        """(window img/s, img/s at the median step)."""
        if len(self.ends) < 2:
            raise RuntimeError(f"no step was timed: --steps must exceed --warmup ({self.skip})")
        return steady_rates(self.ends, self.images)


def fit_rates(
    model: MaskedPatchPretraining,
    data: pl.LightningDataModule,
    trainer_config: dict[str, Any],
    *,
    steps: int,
    warmup: int,
) -> Rates:
    """One `Trainer.fit` of `steps` steps -> its steady-state rates after `warmup` steps."""
    rate = SteadyRate(warmup)
    trainer = pl.Trainer(
        accelerator="auto",
        devices=1,
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        max_steps=steps,
        limit_val_batches=0,
        precision=run_precision(trainer_config),
        gradient_clip_val=trainer_config.get("gradient_clip_val"),
        log_every_n_steps=trainer_config.get("log_every_n_steps", 50),
        callbacks=[rate],
    )
    trainer.fit(model, datamodule=data)
    return rate.rates()


def fit_arms(
    model: MaskedPatchPretraining,
    run: dict[str, Any],
    *,
    shards: str,
    batch: int,
    workers: int,
    steps: int,
    warmup: int,
    data: dict[str, Any] | None = None,
) -> dict[str, Callable[[], Rates]]:
    """The two arms: a fit of `model` on `shards` through ShardDataModule (`data`: options over the
    run's, e.g. {"decode": "device"}), and one on in-memory batches."""
    data_options = {**run["data"], **(data or {}), "train": shards, "batch_size": batch, "num_workers": workers}
    data_options.pop("val", None)
    image_size, channels = pair(model.encoder_config.image_size)[0], model.encoder_config.channels
    if data_options.get("resampled"):
        batches_per_epoch = data_options["samples_per_epoch"] // batch
    else:
        batches_per_epoch = steps
    # The same epoch length in both arms, so that both pay Lightning's epoch boundaries alike.
    synthetic = SyntheticData(
        FixedBatches(batch_size=batch, channels=channels, image_size=image_size, length=batches_per_epoch)
    )

    def shard_arm() -> Rates:
        return fit_rates(model, ShardDataModule(**data_options), run["trainer"], steps=steps, warmup=warmup)

    def synthetic_arm() -> Rates:
        return fit_rates(model, synthetic, run["trainer"], steps=steps, warmup=warmup)

    return {"shards (ShardDataModule)": shard_arm, "synthetic (in memory)": synthetic_arm}
