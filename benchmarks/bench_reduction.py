"""What the rank-order gradient reduction costs: a DDP training step with mpp.train.reduction's hook
against the same step with DDP's own all-reduce, on the CPU (gloo), per number of ranks.

Each rank count is one process group (`--ranks`, started on this machine). Every rank holds two copies
of the setting's model with the same weights, each wrapped in DDP: one reducing with DDP's all-reduce,
one with `rank_order_allreduce`. Each copy trains on one fixed random batch per rank (forward + loss,
backward with the reduction, clipping at the config's norm, the project's optimiser), the arms
alternating (A B B A ...) after untimed steps that let DDP rebuild its buckets. Rank 0 times each step
after a barrier; the table gives the median. The ranks share the machine's cores (threads per rank:
cores / ranks), as the tests' DDP runs do.

    python -m benchmarks.bench_reduction                     # demo: batch 128 a rank, 2 and 4 ranks
    python -m benchmarks.bench_reduction --setting vit_b16 --batch 2 --repeats 6
"""

from __future__ import annotations

import gc
import os
import statistics
import tempfile
import time
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from torch.nn.parallel import DistributedDataParallel

from benchmarks.kit import alternate, argument_parser, host_line, load_run_config, precision_context, run_precision
from mpp import MaskedPatchPretraining
from mpp.model.pixels import pair, to_unit_range
from mpp.model.targets import prediction_loss
from mpp.train.optim import OptimizerConfig, configure_optimizer
from mpp.train.reduction import rank_order_allreduce

ARMS = ("DDP all-reduce", "rank-order all-reduce")


def rank_main(rank: int, world_size: int, store: str, args: Any, out: Any) -> None:
    """One rank, its process group met at the file `store`; rank 0 puts each arm's median on `out`."""
    torch.set_num_threads(max(1, (os.cpu_count() or 1) // world_size))
    dist.init_process_group("gloo", init_method=f"file://{store}", rank=rank, world_size=world_size)
    medians = timed_arms(rank, world_size, args)
    # Every rank's DDP models are gone (with timed_arms' frame) before the group is: a reducer outliving
    # its process group, or a peer's, can hang the process at its exit.
    gc.collect()
    dist.barrier()
    if rank == 0:
        out.put(medians)
    dist.destroy_process_group()


def timed_arms(rank: int, world_size: int, args: Any) -> dict[str, float]:
    """Both arms' models on this rank, their alternating timed steps -> each arm's median seconds."""
    run = load_run_config(args.setting)
    autocast = precision_context(run_precision(run["trainer"]), torch.device("cpu"))
    clip = run["trainer"].get("gradient_clip_val")
    encoder = run["model"]["encoder"]
    height, width = pair(encoder["image_size"])
    generator = torch.Generator().manual_seed(rank)
    images = torch.randint(0, 256, (args.batch, encoder["channels"], height, width), generator=generator).to(
        torch.uint8
    )

    def arm(hook: bool) -> Any:
        torch.manual_seed(0)
        model = MaskedPatchPretraining(**run["model"])
        optimizer = configure_optimizer(
            model, OptimizerConfig(**run["model"]["optimizer"]), 10**6, args.batch * world_size
        )["optimizer"]
        ddp = DistributedDataParallel(model)
        if hook:
            ddp.register_comm_hook(None, rank_order_allreduce)

        def step() -> float:
            dist.barrier()
            start = time.perf_counter()
            with autocast():
                output = ddp(to_unit_range(images))  # through DDP's forward, which readies its reduction
                loss = prediction_loss(output.predictions, output.targets)
            optimizer.zero_grad(set_to_none=True)
            loss.backward()
            if clip:
                torch.nn.utils.clip_grad_norm_(model.parameters(), clip)
            optimizer.step()
            return time.perf_counter() - start

        for _ in range(args.warmup):  # DDP rebuilds its buckets after the first
            step()
        return step

    steps = {name: arm(hook) for name, hook in zip(ARMS, (False, True))}
    seconds = alternate(steps, args.repeats)
    return {name: statistics.median(times) for name, times in seconds.items()}


def main() -> None:
    parser = argument_parser(__doc__)
    parser.add_argument("--setting", choices=("demo", "vit_b16"), default="demo")
    parser.add_argument("--batch", type=int, help="images per rank and step (default: the config's data.batch_size)")
    parser.add_argument("--ranks", type=int, nargs="+", default=[2, 4], help="the process groups' sizes")
    parser.add_argument("--repeats", type=int, default=10, help="timed steps of each arm, alternating")
    parser.add_argument("--warmup", type=int, default=2, help="untimed steps of each arm first")
    args = parser.parse_args()
    run = load_run_config(args.setting)
    args.batch = args.batch or run["data"]["batch_size"]
    encoder = run["model"]["encoder"]
    print(host_line("cpu, gloo", lightning=False))
    print(
        f"{args.setting}: ViT dim {encoder['dim']} depth {encoder['depth']}, {run_precision(run['trainer'])}, batch "
        f"{args.batch} a rank; {args.repeats} alternating repeats, median step time on rank 0\n"
    )
    print(f"| ranks | {ARMS[0]}, s/step | {ARMS[1]}, s/step | rank-order vs DDP's |\n|---|---|---|---|")
    context = mp.get_context("spawn")
    for world_size in args.ranks:
        out = context.SimpleQueue()
        with tempfile.TemporaryDirectory() as folder:  # where the ranks meet: a file, no port to collide on
            store = str(Path(folder) / "store")
            mp.start_processes(rank_main, (world_size, store, args, out), nprocs=world_size, start_method="spawn")
        medians = out.get()
        ddp, ours = (medians[name] for name in ARMS)
        print(f"| {world_size} | {ddp:.3f} | {ours:.3f} | {ours / ddp:.2f}x |", flush=True)


if __name__ == "__main__":
    main()
