"""The run's optimiser steps as the trainer counts them: how many there are (the span of the
learning-rate schedule), the samples in each over all ranks, and which of them log."""

from __future__ import annotations

import math

import pytorch_lightning as pl

from mpp.internals import drop_train_loader, train_loader_loaded


def total_steps(trainer: pl.Trainer) -> int:
    """Optimiser steps of the run, which the learning-rate schedule spans.

    Where the run's length is in epochs, Lightning counts the steps by loading the train loader
    before it restores a checkpoint being resumed (Lightning issue #20550): the loader it loaded for
    that is dropped (mpp.internals.drop_train_loader), so that it is loaded again with its state.
    """
    loaded = train_loader_loaded(trainer.fit_loop)
    steps = trainer.estimated_stepping_batches
    if not loaded and train_loader_loaded(trainer.fit_loop):  # a fresh run loads it twice
        drop_train_loader(trainer.fit_loop)
    if not math.isfinite(steps):
        raise ValueError("the run's length is unknown: set trainer.max_steps (the schedule decays over it)")
    return int(steps)


def global_batch_size(trainer: pl.Trainer, data: object | None = None) -> int | None:
    """Samples per optimiser step over all ranks: nodes x devices x batch x accumulation (None if the
    data module does not say its batch size).

    `data` is the run's data module where the trainer does not hold it yet (Lightning attaches it
    only once `fit` has started).
    """
    batch = getattr(data if data is not None else getattr(trainer, "datamodule", None), "batch_size", None)
    return None if batch is None else trainer.world_size * batch * trainer.accumulate_grad_batches


def log_interval(trainer: pl.Trainer) -> int:
    """`trainer.log_every_n_steps`, at least 1 (Lightning sets it on the trainer at run time, undeclared)."""
    return max(1, trainer.log_every_n_steps)  # type: ignore[attr-defined]


def logging_step(trainer: pl.Trainer) -> bool:
    """Whether the training step now running is one whose metrics go to the loggers."""
    return (trainer.global_step + 1) % log_interval(trainer) == 0
