"""The run's optimiser steps as the trainer counts them: how many there are (the span of the
learning-rate schedule), the samples in each over all ranks, and which of them log."""

from __future__ import annotations

import math

import pytorch_lightning as pl


def total_steps(trainer: pl.Trainer) -> int:
    """Optimiser steps of the run, which the learning-rate schedule spans.

    Where the run's length is in epochs, Lightning counts the steps by loading the train loader,
    before it restores a checkpoint being resumed, and then never gives that loader the state the
    checkpoint holds for it (Lightning issue #20550): the epoch would start afresh. The loader it
    loaded is dropped here, so that the fit loop loads it again after the restore, with its state.
    """
    fit_loop = trainer.fit_loop
    loaded = fit_loop._combined_loader is not None
    steps = trainer.estimated_stepping_batches
    if not loaded and fit_loop._combined_loader is not None:  # a fresh run loads it twice
        if fit_loop._data_fetcher is not None:
            fit_loop._data_fetcher.teardown()
            fit_loop._data_fetcher = None
        fit_loop._combined_loader = None
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
