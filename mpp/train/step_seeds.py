"""The random draws of a step (which patches are corrupted and how, dropout) seeded by the step itself.

Before each training batch, torch's generators (the CPU's and every accelerator's) are seeded from
(run seed, global step, micro-batch within the step, rank); before each evaluation, from (run seed,
stage, global step, rank). A step's draws are then a function of where it is in the run, not of
what ran before it in the process: a run resumed from a checkpoint draws, at every step, what the
run that was never stopped drew, with no generator state to save. Validation in the middle of
training does not shift the training draws either.

The run seed is torch's initial seed when the module first needs it (Lightning's
`seed_everything`, which the CLI calls with the config's `seed_everything`), and a resumed run
takes the one its checkpoint holds.
"""

from __future__ import annotations

import hashlib
from typing import Any

import torch

CHECKPOINT_KEY = "mpp_draws_seed"


def derived_seed(*parts: object) -> int:
    """A 63-bit seed from any parts, stable across processes and Python versions."""
    digest = hashlib.blake2b("/".join(map(str, parts)).encode(), digest_size=8).digest()
    return int.from_bytes(digest, "little") & ((1 << 63) - 1)


class StepDraws:
    """Seeds torch's generators before each training batch and each evaluation (see the module's text)."""

    def __init__(self) -> None:
        self.seed: int | None = None
        self._step, self._micro = -1, 0

    def run_seed(self) -> int:
        if self.seed is None:
            self.seed = torch.initial_seed()
        return self.seed

    def training_batch(self, step: int, rank: int) -> None:
        """Before a training batch: the micro-batches of one optimiser step (gradient accumulation) each
        draw anew; a checkpoint is written between steps, so a resumed run starts at micro-batch 0."""
        self._micro = self._micro + 1 if step == self._step else 0
        self._step = step
        torch.manual_seed(derived_seed(self.run_seed(), "train", step, self._micro, rank))

    def evaluation(self, stage: str, step: int, rank: int) -> None:
        torch.manual_seed(derived_seed(self.run_seed(), stage, step, rank))

    def save(self, checkpoint: dict[str, Any]) -> None:
        checkpoint[CHECKPOINT_KEY] = self.run_seed()

    def load(self, checkpoint: dict[str, Any]) -> None:
        if CHECKPOINT_KEY in checkpoint:
            self.seed = int(checkpoint[CHECKPOINT_KEY])
