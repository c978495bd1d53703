"""A callback that `mpp fit` subprocesses load (PYTHONPATH=tests) to report what each rank did."""

from __future__ import annotations

import hashlib
import json
import os
import signal
import time
from pathlib import Path
from typing import Any

import pytorch_lightning as pl
import torch


def digest(tree: Any) -> str:
    """A hash of every tensor and number in a nested structure, in key order."""
    sha = hashlib.sha256()

    def walk(node: Any) -> None:
        if isinstance(node, torch.Tensor):
            sha.update(node.detach().cpu().contiguous().reshape(-1).view(torch.uint8).numpy().tobytes())
        elif isinstance(node, dict):
            for key in sorted(node, key=str):
                sha.update(str(key).encode())
                walk(node[key])
        elif isinstance(node, (list, tuple)):
            for item in node:
                walk(item)
        else:
            sha.update(repr(node).encode())

    walk(tree)
    return sha.hexdigest()


class RunProbe(pl.Callback):
    """Writes `<out>/<tag>-rank<r>.jsonl`: one record when training starts, one per step, one at the end.

    Args:
        out: folder of the records.
        tag: names this run's records.
        kill_at_step: SIGKILL this process when the step with this global step begins.
        losses: also write a "step_end" record with each batch's training loss.
    """

    def __init__(self, out: str, tag: str, kill_at_step: int | None = None, losses: bool = False) -> None:
        self.out, self.tag, self.kill_at_step, self.losses = Path(out), tag, kill_at_step, losses

    def write(self, trainer: pl.Trainer, record: dict[str, Any]) -> None:
        self.out.mkdir(parents=True, exist_ok=True)
        with open(self.out / f"{self.tag}-rank{trainer.global_rank}.jsonl", "a") as file:
            file.write(json.dumps(record) + "\n")
            file.flush()
            os.fsync(file.fileno())

    def on_train_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        self.write(trainer, {
            "event": "start", "world_size": trainer.world_size, "global_step": trainer.global_step,
            "lr": trainer.optimizers[0].param_groups[0]["lr"],
            "initial_lr": [group["initial_lr"] for group in trainer.optimizers[0].param_groups],
            "scheduler": trainer.lr_scheduler_configs[0].scheduler.state_dict()["last_epoch"],
            "optimizer": digest(trainer.optimizers[0].state_dict()["state"]),
            "weights": digest(pl_module.state_dict()),
        })

    def on_train_batch_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule, batch: Any,
                             batch_idx: int) -> None:
        if trainer.global_step == self.kill_at_step:
            os.kill(os.getpid(), signal.SIGKILL)
        self.write(trainer, {"event": "step", "global_step": trainer.global_step, "labels": batch["label"].tolist(),
                             "lr": trainer.optimizers[0].param_groups[0]["lr"], "time": time.monotonic()})

    def on_train_batch_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule, outputs: Any, batch: Any,
                           batch_idx: int) -> None:
        if not self.losses:
            return
        loss = outputs["loss"] if isinstance(outputs, dict) else outputs
        self.write(trainer, {"event": "step_end", "global_step": trainer.global_step,
                             "loss": None if loss is None else float(loss)})

    def on_train_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        self.write(trainer, {"event": "end", "global_step": trainer.global_step, "weights": digest(pl_module.state_dict())})

    def on_validation_batch_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule, batch: Any,
                                  batch_idx: int, dataloader_idx: int = 0) -> None:
        stage = "sanity" if trainer.sanity_checking else "val"
        self.write(trainer, {"event": stage, "global_step": trainer.global_step, "labels": batch["label"].tolist()})

    def on_test_batch_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule, batch: Any, batch_idx: int,
                            dataloader_idx: int = 0) -> None:
        self.write(trainer, {"event": "test", "labels": batch["label"].tolist()})

    def on_validation_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        self.write(trainer, {"event": "val_end", "global_step": trainer.global_step,
                             "metrics": {k: float(v) for k, v in trainer.callback_metrics.items()}})

    def on_test_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        self.write(trainer, {"event": "test_end", "metrics": {k: float(v) for k, v in trainer.callback_metrics.items()}})


def records(path: Path) -> list[dict[str, Any]]:
    return [json.loads(line) for line in path.read_text().splitlines()]


class Stall(pl.Callback):
    """Holds one rank in its first validation batch for `seconds`, as a stuck rank would be."""

    def __init__(self, rank: int, seconds: float) -> None:
        self.rank, self.seconds = rank, seconds

    def on_validation_batch_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule, batch: Any,
                                  batch_idx: int, dataloader_idx: int = 0) -> None:
        if trainer.global_rank == self.rank and batch_idx == 0:
            time.sleep(self.seconds)


class Sigterm(pl.Callback):
    """Sends its own process SIGTERM after training step `step`, as a scheduler stopping the job would."""

    def __init__(self, step: int) -> None:
        self.step = step

    def on_train_batch_end(self, trainer: pl.Trainer, *args: Any) -> None:
        if trainer.global_step == self.step:
            os.kill(os.getpid(), signal.SIGTERM)
