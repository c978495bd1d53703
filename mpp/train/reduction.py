"""A gradient all-reduce whose sums do not depend on how DDP packs gradients into buckets.

DDP sums each rank's gradients bucket by bucket, and rebuilds its buckets once, after the first
step of each process, in the order the gradients became ready (the demo's ViT: two buckets in a
new process's first step, one from its second on). Gloo's ring all-reduce adds the ranks' values
of an element in an order set by the element's place in its bucket. On two ranks that order cannot matter
(a + b == b + a); on three or more it does, so the first step after a resume, reduced with a new
process's buckets, rounds differently from the same step of a run never stopped, and the two runs
drift apart.

`rank_order_allreduce` gathers every rank's bucket and adds them rank 0 first, the same order for
every element in every layout, so a resumed run ends equal to one never stopped. It moves
world_size / 2 times the bytes of a ring all-reduce (1.5x on 3 ranks, 2x on 4); docs/benchmarks.md
gives its measured step time. `RankOrderReduction`, which every `mpp fit` has, uses it where it is
cheap and exact resume is promised: DDP on the CPU with three or more ranks (`when: cpu`). On GPUs
some kernels sum in a varying order anyway; there `when: always` turns it on (Lightning registers a
strategy's own `ddp_comm_hook` on GPUs only: the two do not go together), and `when: never` leaves
DDP's all-reduce everywhere.
"""

# No `from __future__ import annotations`: DDP compares the hook's annotations with its own types.

from typing import Literal

import pytorch_lightning as pl
import torch
import torch.distributed as dist
from pytorch_lightning.strategies import DDPStrategy
from torch.nn.parallel import DistributedDataParallel


def rank_order_allreduce(
    process_group: dist.ProcessGroup | None, bucket: dist.GradBucket
) -> torch.futures.Future[torch.Tensor]:
    """DDP communication hook: the mean over ranks of a flat gradient bucket, summed in rank order."""
    group = process_group if process_group is not None else dist.group.WORLD
    world_size = dist.get_world_size(group)
    gradients = bucket.buffer()  # (n,) this rank's gradients
    gathered = [torch.empty_like(gradients) for _ in range(world_size)]
    done = dist.all_gather(gathered, gradients, group=group, async_op=True).get_future()

    def mean(_: torch.futures.Future[list[torch.Tensor]]) -> torch.Tensor:
        total = gathered[0]  # this hook's own buffer: summed into in place
        for rank_gradients in gathered[1:]:
            total += rank_gradients
        return total.div_(world_size)

    return done.then(mean)


When = Literal["cpu", "always", "never"]


def applies(when: When, device: str, world_size: int) -> bool:
    """Whether a DDP run of `world_size` ranks on `device` ("cpu", "cuda", ...) sums gradients in rank order."""
    if when not in ("cpu", "always", "never"):
        raise ValueError(f"RankOrderReduction's when must be cpu, always or never, got {when!r}")
    # On two ranks every order gives the same sum.
    return world_size >= 3 and (when == "always" or (when == "cpu" and device == "cpu"))


class RankOrderReduction(pl.Callback):
    """Registers `rank_order_allreduce` on a DDP run's model, where `applies`.

    `mpp fit` adds one with `when: cpu` unless the config's callbacks name one.

    Args:
        when: `cpu`: on the CPU with three or more ranks; `always`: on any device with three or more
            ranks; `never`.
    """

    def __init__(self, *, when: When = "cpu") -> None:
        applies(when, "cpu", 1)  # a bad `when` fails as the config is read
        self.when = when

    def on_fit_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        # After Lightning wrapped the module in DDP, before the first backward pass.
        strategy = trainer.strategy
        if not isinstance(strategy, DDPStrategy) or not isinstance(strategy.model, DistributedDataParallel):
            return
        if applies(self.when, strategy.root_device.type, trainer.world_size):
            strategy.model.register_comm_hook(None, rank_order_allreduce)
