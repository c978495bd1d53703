"""The training step at scale: compiled without recompiles, free of host syncs between logging
steps, stopped or skipped on a non-finite loss, and its learning rate following the global batch."""

from __future__ import annotations

import traceback
from collections import defaultdict
from pathlib import Path

import pytest
import pytorch_lightning as pl
import torch
from test_pretrain import BlockImages, module
from torch.utils.data import DataLoader

from mpp import MaskedPatchPretraining, OptimizerConfig
from mpp.train.callbacks import ImageThroughput, ProgressBar
from mpp.train.nonfinite_loss import NonFiniteLossError


def trainer(tmp_path: Path, **overrides: object) -> pl.Trainer:
    settings = {"max_steps": 8, "accelerator": "cpu", "logger": pl.loggers.CSVLogger(tmp_path), "log_every_n_steps": 4,
                "enable_progress_bar": False, "enable_checkpointing": False, "default_root_dir": tmp_path}
    return pl.Trainer(**{**settings, **overrides})


def loader(count: int = 64) -> DataLoader:
    return DataLoader(BlockImages(count), batch_size=8, drop_last=True)


# Tensor methods that copy a device value to the host, and so wait for the device to finish.
SYNC_POINTS = ("item", "tolist", "numpy", "cpu", "__bool__", "__float__", "__int__", "__index__")


class SyncRecorder(pl.Callback):
    """Tallies host reads of tensors, and uploads of host scalars to the device, per training step."""

    def __init__(self) -> None:
        self.step: int | None = None
        self.calls: dict[int, list[str]] = defaultdict(list)

    def on_train_batch_start(self, trainer: pl.Trainer, *args: object) -> None:
        self.step = trainer.global_step

    def on_train_end(self, *args: object) -> None:
        self.step = None

    def record(self, what: str) -> None:
        if self.step is None:
            return
        # Two frames above the patched call; dynamo's wrappers (once torch._dynamo is imported, every
        # @torch._disable_dynamo function goes through one) are not callers.
        caller = [f for f in traceback.extract_stack() if "_dynamo" not in Path(f.filename).parts][-4]
        # On CPU, Adam counts steps in host tensors; the fused AdamW used on GPUs keeps them on the device.
        if Path(caller.filename).parent.parts[-2:] == ("torch", "optim"):
            return
        self.calls[self.step].append(f"{what} in {Path(caller.filename).name}:{caller.lineno}")


def test_no_host_sync_in_training_steps_between_logging_steps(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    recorder = SyncRecorder()
    for name in SYNC_POINTS:
        original = getattr(torch.Tensor, name)

        def patched(self, *args, _name=name, _original=original, **kwargs):
            recorder.record(f"Tensor.{_name}")
            return _original(self, *args, **kwargs)

        monkeypatch.setattr(torch.Tensor, name, patched)
    tensor = torch.tensor

    def upload(*args, **kwargs):
        if kwargs.get("device") is not None:
            recorder.record("torch.tensor(..., device=)")
        return tensor(*args, **kwargs)

    monkeypatch.setattr(torch, "tensor", upload)
    callbacks = [recorder, ImageThroughput(), ProgressBar()]
    trainer(tmp_path, callbacks=callbacks, enable_progress_bar=True).fit(module(), loader())
    assert recorder.calls[3] and recorder.calls[7], "the recorder saw no logging step: it checks nothing"
    quiet = {step: calls for step, calls in recorder.calls.items() if (step + 1) % 4}
    assert not quiet, f"host syncs outside logging steps: {quiet}"


@pytest.mark.slow  # compiles the model twice (~20 s on two cores)
def test_compiled_steps_do_not_recompile_after_warm_up(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    import torch._dynamo
    from torch._dynamo.utils import counters

    torch._dynamo.reset()
    counters.clear()

    class NoRecompiles(pl.Callback):
        def on_train_batch_end(self, trainer: pl.Trainer, *args: object) -> None:
            if trainer.global_step == 2:  # warm-up over: any further compilation is an error
                monkeypatch.setattr(torch._dynamo.config, "error_on_recompile", True)
                self.graphs = counters["stats"]["unique_graphs"]

    watcher = NoRecompiles()
    model = module(compile=True)
    trainer(tmp_path, max_steps=6, callbacks=[watcher]).fit(model, loader())
    assert watcher.graphs >= 1, "nothing was compiled"
    assert counters["stats"]["unique_graphs"] == watcher.graphs
    assert not counters["graph_break"], dict(counters["graph_break"])
    # Compiled in place: the checkpoint's parameter names are those of the eager module.
    assert set(model.state_dict()) == set(module().state_dict())


class Poisoned(MaskedPatchPretraining):
    """A pretraining module whose loss is NaN at global step 2."""

    def _step(self, batch, stage):
        loss = super()._step(batch, stage)
        return loss * float("nan") if stage == "train" and self.global_step == 2 else loss


def poisoned(**overrides: object) -> Poisoned:
    base = module()
    return Poisoned(**{**dict(base.hparams), **overrides})


def test_a_non_finite_loss_stops_the_run_before_a_checkpoint_holds_it(tmp_path: Path) -> None:
    checkpoints = pl.callbacks.ModelCheckpoint(dirpath=tmp_path / "ckpt", every_n_train_steps=1, save_top_k=-1,
                                               filename="{step}")
    run = trainer(tmp_path, callbacks=[checkpoints], enable_checkpointing=True, log_every_n_steps=50)
    with pytest.raises(NonFiniteLossError, match="training batch 2 .*global step 2"):
        run.fit(poisoned(), loader())
    saved = sorted(p.name for p in (tmp_path / "ckpt").glob("*.ckpt"))
    assert saved == ["step=1.ckpt", "step=2.ckpt"]
    for path in (tmp_path / "ckpt").glob("*.ckpt"):
        weights = torch.load(path, weights_only=True)["state_dict"]
        assert all(torch.isfinite(w).all() for w in weights.values()), path


def test_a_non_finite_loss_can_skip_the_step_instead(tmp_path: Path) -> None:
    class Watch(pl.Callback):
        def on_train_batch_start(self, trainer, pl_module, batch, batch_idx):
            self.before = {k: v.clone() for k, v in pl_module.state_dict().items()}

        def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
            if batch_idx == 2:
                after = pl_module.state_dict()
                self.unchanged = all(torch.equal(self.before[k], after[k]) for k in after)

    watch = Watch()
    model = poisoned(nonfinite_loss="skip")
    trainer(tmp_path, callbacks=[watch], max_steps=6).fit(model, loader())
    assert watch.unchanged, "the skipped step changed the weights"
    assert model.loss_guard.skipped == 1
    assert all(torch.isfinite(p).all() for p in model.parameters())


def test_the_learning_rate_follows_the_global_batch(tmp_path: Path) -> None:
    from mpp.train.steps import global_batch_size

    class Data(pl.LightningDataModule):
        batch_size = 8

        def train_dataloader(self) -> DataLoader:
            return loader()

    config = OptimizerConfig(name="adamw", lr=1e-3, reference_batch_size=4, warmup_steps=0)
    model = module(optimizer=config)
    run = trainer(tmp_path, max_steps=1, accumulate_grad_batches=2)
    run.fit(model, datamodule=Data())
    assert global_batch_size(run) == 16
    assert run.optimizers[0].param_groups[0]["initial_lr"] == pytest.approx(4e-3)  # 1e-3 x 16 / 4
    sqrt = OptimizerConfig(name="adamw", lr=1e-3, reference_batch_size=4, lr_scaling="sqrt")
    assert sqrt.lr_factor(16) == pytest.approx(2.0) and OptimizerConfig(name="sgd", lr=0.1).lr_factor(16) == 1.0
    with pytest.raises(ValueError, match="global batch is unknown"):
        config.lr_factor(None)


class BarWatch(pl.Callback):
    """The training bar's (count, total, start) after each step."""

    def __init__(self, bar: ProgressBar) -> None:
        self.bar, self.seen = bar, []

    def on_train_batch_end(self, *args: object) -> None:
        progress = self.bar.train_progress_bar
        self.seen.append((progress.n, progress.total, progress.initial))


def test_the_progress_bar_counts_the_runs_steps_across_epochs_and_a_resume(tmp_path: Path) -> None:
    bar = ProgressBar()
    watch = BarWatch(bar)
    first = trainer(tmp_path, max_steps=6, callbacks=[bar, watch], enable_progress_bar=True, enable_checkpointing=True)
    first.fit(module(), loader(32))  # 4 batches an epoch: the run's steps, not the epoch's batches
    assert watch.seen == [(step, 6, 0) for step in range(1, 7)]
    (checkpoint,) = tmp_path.rglob("*.ckpt")  # at step 6, in the middle of the second epoch
    bar = ProgressBar()
    watch = BarWatch(bar)
    resumed = trainer(tmp_path, max_steps=8, callbacks=[bar, watch], enable_progress_bar=True)
    resumed.fit(module(), loader(32), ckpt_path=checkpoint)
    assert watch.seen == [(step, 8, 6) for step in (7, 8)]  # from the step it resumes at
