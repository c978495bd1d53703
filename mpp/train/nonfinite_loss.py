"""What training does with a loss that is not finite (NaN or inf): never train on silently.

- `stop` (the default): the run stops with an error naming the batch. The loss is checked on
  the device in every step; the host reads the result only at logging steps and before every
  checkpoint is written, so the steps in between stay free of host-device syncs and no
  checkpoint ever holds the broken weights.
- `skip`: a step whose loss is not finite on any rank is dropped on every rank (no backward,
  no optimiser update) and counted. Every rank must agree before the backward, which costs one
  sync per step.
"""

from __future__ import annotations

import logging
from typing import Any, Literal

import pytorch_lightning as pl
import torch
from pytorch_lightning.trainer.states import TrainerFn
from torch import Tensor, nn

from mpp.train.steps import log_interval

log = logging.getLogger(__name__)

Policy = Literal["stop", "skip"]


class NonFiniteLossError(RuntimeError):
    """The training loss became NaN or infinite under the `stop` policy."""


class LossGuard(nn.Module):
    """Watches the training loss of one module; `forward(loss)` returns the loss, or None to skip.

    Args:
        policy: `stop` or `skip` (see the module docstring).
    """

    batches: Tensor  # buffers, registered in __init__
    first_bad: Tensor

    def __init__(self, policy: Policy = "stop") -> None:
        super().__init__()
        if policy not in ("stop", "skip"):
            raise ValueError(f"nonfinite_loss must be 'stop' or 'skip', got {policy!r}")
        self.policy = policy
        self.skipped = 0
        # Training batches seen since fit started, and the index of the first non-finite one (-1: none).
        self.register_buffer("batches", torch.zeros((), dtype=torch.long), persistent=False)
        self.register_buffer("first_bad", torch.full((), -1, dtype=torch.long), persistent=False)
        self.start_step = 0

    def forward(self, loss: Tensor, trainer: pl.Trainer) -> Tensor | None:
        bad = ~torch.isfinite(loss.detach())
        if self.policy == "skip":
            if trainer.strategy.reduce_boolean_decision(bool(bad), all=False):
                self.skipped += 1
                log.warning(
                    "skipped training step %d: the loss was not finite on at least one rank (%d steps skipped so far)",
                    trainer.global_step,
                    self.skipped,
                )
                return None
            return loss
        self.first_bad.copy_(torch.where(bad & (self.first_bad < 0), self.batches, self.first_bad))
        self.batches += 1
        return loss

    def start(self, trainer: pl.Trainer) -> None:
        """Reset the tallies when fit starts (or resumes)."""
        self.batches.zero_()
        self.first_bad.fill_(-1)
        self.start_step = trainer.global_step

    def check(self, trainer: pl.Trainer, when: str) -> None:
        """Stop the run if any rank saw a non-finite loss since fit started (one host read)."""
        if self.policy != "stop":
            return
        first = int(self.first_bad)
        if not trainer.strategy.reduce_boolean_decision(first >= 0, all=False):
            return
        where = (
            f"first at training batch {first} of this run (near global step "
            f"{self.start_step + first // trainer.accumulate_grad_batches})"
            if first >= 0
            else "on another rank"
        )
        raise NonFiniteLossError(
            f"the training loss was NaN or infinite, {where}; stopping {when} so that no checkpoint holds "
            "the broken weights (the last checkpoint is from before). Lower optimizer.lr or lengthen "
            "optimizer.warmup_steps, check the data, or set model.init_args.nonfinite_loss: skip to drop such steps."
        )


class LossGuardCheck(pl.Callback):
    """Reads a module's LossGuard on the host at logging steps, before checkpoints and at the end."""

    def __init__(self, guard: LossGuard) -> None:
        self.guard = guard

    def on_train_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        self.guard.start(trainer)

    def on_train_batch_end(
        self, trainer: pl.Trainer, pl_module: pl.LightningModule, outputs: Any, batch: Any, batch_idx: int
    ) -> None:
        if trainer.global_step % log_interval(trainer) == 0:
            self.guard.check(trainer, f"at step {trainer.global_step}")

    def on_save_checkpoint(
        self, trainer: pl.Trainer, pl_module: pl.LightningModule, checkpoint: dict[str, Any]
    ) -> None:
        if trainer.state.fn == TrainerFn.FITTING:
            self.guard.check(trainer, f"before writing the checkpoint of step {trainer.global_step}")

    def on_train_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        self.guard.check(trainer, "at the end of training")
