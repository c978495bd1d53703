"""Lightning callbacks that watch a run: throughput and skipped samples, a progress bar that
costs no sync, and the stage where ranks stalled (the pictures of the pretraining predictions:
mpp.outputs.prediction_pictures). Each reads the batch and the module's public outputs only."""

from __future__ import annotations

import re
import signal
import time
from typing import Any

import pytorch_lightning as pl
import torch
from pytorch_lightning.callbacks import TQDMProgressBar

from mpp.errors import add_note
from mpp.train.steps import log_interval


class ImageThroughput(pl.Callback):
    """Logs `train/throughput` (images per second over all ranks) and `data/skipped` (the
    total of samples the data pipeline skipped), every `trainer.log_every_n_steps` steps.

    Counting stays on the device between logging steps, so it adds no host-device sync.
    """

    def __init__(self) -> None:
        self.images = 0
        self.started: float | None = None
        self.skipped: torch.Tensor | None = None

    def on_train_batch_start(
        self, trainer: pl.Trainer, pl_module: pl.LightningModule, batch: Any, batch_idx: int
    ) -> None:
        if self.started is None:
            self.started = time.perf_counter()

    def on_train_batch_end(
        self, trainer: pl.Trainer, pl_module: pl.LightningModule, outputs: Any, batch: Any, batch_idx: int
    ) -> None:
        if isinstance(batch, dict):
            self.images += len(batch["image"])
            if "skipped" in batch:
                skipped = batch["skipped"].sum()
                self.skipped = skipped if self.skipped is None else self.skipped + skipped
        if trainer.global_step % log_interval(trainer) or self.started is None:
            return
        elapsed = time.perf_counter() - self.started
        if self.images and elapsed > 0:
            rate = self.images * trainer.world_size / elapsed
            pl_module.log("train/throughput", rate, on_step=True, on_epoch=False)
        if self.skipped is not None:
            # The running total of this rank, summed over ranks.
            pl_module.log(
                "data/skipped", self.skipped.float(), on_step=True, on_epoch=False, reduce_fx="sum", sync_dist=True
            )
        self.images, self.started = 0, time.perf_counter()


class ProgressBar(TQDMProgressBar):
    """Lightning's progress bar, counting the run's steps: the global step out of `max_steps`, and
    the time left at the rate of the steps this process ran (validation included), so that a resumed
    run starts at its step and plans by its own pace. Without `max_steps` it counts each epoch's
    batches, as Lightning's does.

    It shows the `train/...` metrics as of the last logging step: Lightning turns progress-bar
    metrics into Python numbers after every step, a host-device sync each time; mpp's modules log
    training metrics without `prog_bar` and this bar reads them only when they are logged anyway.
    """

    def __init__(self, refresh_rate: int = 1) -> None:
        super().__init__(refresh_rate=refresh_rate)
        self.shown: dict[str, str] = {}

    def on_train_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        super().on_train_start(trainer, pl_module)
        if trainer.max_steps >= 1:  # from the step it starts at (a resumed run's, mid-epoch too) to max_steps
            bar = self.train_progress_bar
            bar.reset(total=trainer.max_steps)
            bar.initial = bar.n = trainer.global_step
            bar.set_description(f"Epoch {trainer.current_epoch}, steps")

    def on_train_epoch_start(self, trainer: pl.Trainer, *args: Any) -> None:
        if trainer.max_steps < 1:
            super().on_train_epoch_start(trainer, *args)
        else:  # not called for the epoch a run resumes in the middle of
            self.train_progress_bar.set_description(f"Epoch {trainer.current_epoch}, steps")

    def on_train_batch_end(
        self, trainer: pl.Trainer, pl_module: pl.LightningModule, outputs: Any, batch: Any, batch_idx: int
    ) -> None:
        if trainer.global_step % log_interval(trainer) == 0:
            self.shown = {
                name.removeprefix("train/"): f"{float(value):.4g}"
                for name, value in trainer.callback_metrics.items()
                if name.startswith("train/") and name != "train/lr"
            }
        if trainer.max_steps < 1:
            super().on_train_batch_end(trainer, pl_module, outputs, batch, batch_idx)
            return
        bar, step = self.train_progress_bar, trainer.global_step
        if self.is_enabled and (step % self.refresh_rate == 0 or step == bar.total) and not bar.disable:
            bar.n = step
            bar.set_postfix(self.get_metrics(trainer, pl_module))  # refreshes the bar

    def get_metrics(
        self, trainer: pl.Trainer, pl_module: pl.LightningModule
    ) -> dict[str, int | str | float | dict[str, float]]:
        return {**super().get_metrics(trainer, pl_module), **self.shown}


_STAGES = {
    "sanity_check": "the sanity check of the validation set",
    "train": "training",
    "validate": "validation",
    "test": "testing",
    "predict": "prediction",
}


class RankFailure(pl.Callback):
    """When a rank fails: says in which stage a collective timed out, and stops the ranks it started.

    A rank that waits for the others (they stalled, or ran fewer steps) gives up after the
    strategy's timeout (`trainer.strategy.init_args.timeout` of DDPStrategy, 30 minutes unless
    set) with a bare "timed out" from the communication backend; the note names the stage.
    Lightning's own launcher (`mpp fit --trainer.devices N`, no torchrun or srun) leaves the
    processes it started running when the first rank fails, where they wait in a collective
    or go on alone: they are killed.
    """

    def on_exception(self, trainer: pl.Trainer, pl_module: pl.LightningModule, exception: BaseException) -> None:
        if trainer.world_size > 1 and is_collective_timeout(exception):
            running = trainer.state.stage.value if trainer.state.stage is not None else "setup"
            stage = _STAGES.get(running, running)
            add_note(
                exception,
                f"mpp: rank {trainer.global_rank} timed out waiting for the other ranks during {stage} "
                f"(global step {trainer.global_step}): one rank is stuck or ran a different number of steps; "
                "the timeout is trainer.strategy.init_args.timeout",
            )
        launcher = trainer.strategy.launcher  # the processes this one started, if it started any
        if launcher is not None:
            launcher.kill(signal.SIGKILL)


def is_collective_timeout(error: BaseException) -> bool:
    """Whether an error is a timed-out collective, as gloo and NCCL report it."""
    return isinstance(error, RuntimeError) and re.search(r"timed? ?out|timeout", str(error), re.IGNORECASE) is not None
