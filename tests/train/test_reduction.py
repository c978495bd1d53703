"""The rank-order gradient reduction (mpp.train.reduction) on three gloo ranks: its result is the mean of the
ranks' gradients added rank 0 first, and a new DDP's first step, with its first bucket layout, reduces the same
as a later step of a DDP whose buckets were rebuilt, which DDP's own all-reduce does not (the reason for it).
A whole run killed and resumed on 3 and 4 ranks: tests/train/test_resume.py."""

from __future__ import annotations

import gc
import json
import re
import subprocess
import sys
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from torch.nn.parallel import DistributedDataParallel
from workspace import ROOT, environment, time_limit

from mpp.model.vit import ViT, ViTConfig
from mpp.train.reduction import applies, rank_order_allreduce

WORLD_SIZE = 3


def gradients(model: torch.nn.Module, images: torch.Tensor) -> list[torch.Tensor]:
    model.zero_grad(set_to_none=True)
    model(images).pow(2).mean().backward()
    return [p.grad.clone() for p in model.parameters()]  # type: ignore[union-attr]


def largest_difference(a: list[torch.Tensor], b: list[torch.Tensor]) -> float:
    return max(float((x - y).abs().max()) for x, y in zip(a, b))


def rank_main(rank: int, store: str, out: str) -> None:
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"file://{store}", rank=rank, world_size=WORLD_SIZE)
    torch.manual_seed(0)
    # The demo's encoder: two gradient buckets in DDP's first step, one after it rebuilds them.
    model = ViT(ViTConfig(dim=128, depth=4, heads=4, mlp_dim=512, image_size=28, patch_size=4, channels=1))
    torch.manual_seed(1 + rank)
    first, later = torch.randn(4, 1, 28, 28), torch.randn(4, 1, 28, 28)

    def step_after_rebuild_and_first_step(hook: bool) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
        """`later`'s reduced gradients in an old DDP (after a step on `first`) and in a new one."""
        results = []
        for warm in (True, False):
            ddp = DistributedDataParallel(model)
            if hook:
                ddp.register_comm_hook(None, rank_order_allreduce)
            if warm:
                gradients(ddp, first)
            results.append(gradients(ddp, later))
        return results[0], results[1]

    ours = step_after_rebuild_and_first_step(hook=True)
    ddps = step_after_rebuild_and_first_step(hook=False)
    local = gradients(model, later)  # this rank's own, unreduced
    gathered = [[torch.empty_like(g) for _ in range(WORLD_SIZE)] for g in local]
    for parts, gradient in zip(gathered, local):
        dist.all_gather(parts, gradient)
    by_hand = [(parts[0] + parts[1] + parts[2]) / WORLD_SIZE for parts in gathered]
    if rank == 0:
        Path(out).write_text(json.dumps({
            "ours: old against new": largest_difference(*ours),
            "ours against the mean by hand": largest_difference(ours[1], by_hand),
            "ddp's: old against new": largest_difference(*ddps),
        }))
    gc.collect()  # the DDP models are gone on every rank before the group is
    dist.barrier()
    dist.destroy_process_group()


def test_the_rank_order_mean_is_the_same_in_a_new_ddp_as_after_its_buckets_are_rebuilt(tmp_path: Path) -> None:
    out = tmp_path / "differences.json"
    mp.start_processes(rank_main, (str(tmp_path / "store"), str(out)), nprocs=WORLD_SIZE, start_method="spawn")
    differences = json.loads(out.read_text())
    assert differences["ours: old against new"] == 0
    assert differences["ours against the mean by hand"] == 0
    # Why the hook exists: if this fails, DDP's own all-reduce has become independent of its buckets.
    assert differences["ddp's: old against new"] > 0, "DDP's all-reduce now sums the same after a bucket rebuild"


def test_the_rank_order_applies_from_three_ranks_on_the_devices_asked_for() -> None:
    for when, devices in (("cpu", {"cpu"}), ("always", {"cpu", "cuda"}), ("never", set())):
        for device in ("cpu", "cuda"):
            assert [applies(when, device, ranks) for ranks in (1, 2, 3, 4)] == [False, False, *[device in devices] * 2]
    with pytest.raises(ValueError, match="when must be cpu, always or never, got 'gpu'"):
        applies("gpu", "cuda", 3)  # type: ignore[arg-type]


def test_the_switch_shown_in_the_docs_sets_when(tmp_path: Path) -> None:
    """docs/robustness.md's `--trainer.callbacks+=...RankOrderReduction --trainer.callbacks.when=never`, as printed."""
    page = (ROOT / "docs" / "robustness.md").read_text()
    (switch,) = re.findall(r"`(--trainer\.callbacks\+=mpp\.train\.reduction\.RankOrderReduction [^`]+)`", page)
    config = ROOT / "configs" / "pretrain" / "demo.yaml"
    shown = subprocess.run([sys.executable, "-m", "mpp", "fit", "--config", str(config), *switch.split(),
                            "--print_config"], cwd=tmp_path, env=environment(), capture_output=True, text=True,
                           timeout=time_limit(120))
    assert shown.returncode == 0, shown.stderr[-3000:]
    assert "- class_path: mpp.train.reduction.RankOrderReduction\n    init_args:\n      when: never\n" in shown.stdout
