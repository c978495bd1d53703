"""A step's random draws are a function of (run seed, global step, micro-batch, rank), whatever ran before."""

from __future__ import annotations

import torch

from mpp.model.corruption import corrupt_patches
from mpp.train.step_seeds import CHECKPOINT_KEY, StepDraws


def draw() -> torch.Tensor:
    patches = torch.zeros(2, 16, 4)
    corrupted = corrupt_patches(patches, mask_token=torch.ones(4))
    return torch.cat([corrupted.positions, corrupted.kinds, corrupted.sources], dim=1)


def test_a_step_draws_the_same_whatever_was_drawn_before() -> None:
    draws = StepDraws()
    draws.seed = 7
    draws.training_batch(step=5, rank=0)
    first = draw()
    torch.rand(1000)  # other work in between: another step, a validation, a callback
    fresh = StepDraws()
    fresh.seed = 7
    fresh.training_batch(step=5, rank=0)
    assert torch.equal(draw(), first)


def test_steps_ranks_micro_batches_and_stages_draw_apart() -> None:
    draws = StepDraws()
    draws.seed = 7
    seen = []
    for step, rank in ((5, 0), (6, 0), (5, 1)):
        draws.training_batch(step=step, rank=rank)
        seen.append(draw())
    draws.training_batch(step=5, rank=1)  # the second micro-batch of step 5 (gradient accumulation)
    seen.append(draw())
    draws.evaluation("val", step=5, rank=1)
    seen.append(draw())
    assert all(not torch.equal(a, b) for i, a in enumerate(seen) for b in seen[i + 1 :])


def test_the_run_seed_goes_into_the_checkpoint_and_comes_back() -> None:
    torch.manual_seed(123)
    draws = StepDraws()
    checkpoint: dict = {}
    draws.save(checkpoint)
    assert checkpoint[CHECKPOINT_KEY] == 123
    resumed = StepDraws()
    torch.manual_seed(999)  # a resumed run seeded otherwise still takes the checkpoint's seed
    resumed.load(checkpoint)
    assert resumed.run_seed() == 123
