"""Gradient clipping with the fused optimisers, in bf16-mixed, and under FSDP, where Lightning's
own plugins refuse it (mpp.train.base.EncoderModule.configure_gradient_clipping)."""

from __future__ import annotations

from pathlib import Path
from unittest import mock

import pytest
import pytorch_lightning as pl
import torch
from pytorch_lightning.strategies import FSDPStrategy
from test_pretrain import module
from test_steps import loader, trainer

from mpp.train.base import EncoderModule
from mpp.train.optim import OptimizerConfig, configure_optimizer


def grad_norm(model: torch.nn.Module) -> float:
    return float(torch.linalg.vector_norm(torch.stack([p.grad.norm() for p in model.parameters() if p.grad is not None])))


class Norms(pl.Callback):
    """The gradient norm before clipping and after it (the gradients stay until the next step's zero_grad)."""

    def __init__(self) -> None:
        self.before: list[float] = []
        self.after: list[float] = []
        self.fused: list[bool] = []

    def on_before_optimizer_step(self, trainer: pl.Trainer, pl_module: pl.LightningModule, optimizer) -> None:
        self.before.append(grad_norm(pl_module))  # Lightning calls this hook before it clips
        self.fused.append(bool(optimizer.defaults.get("fused")))

    def on_train_batch_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule, *args: object) -> None:
        self.after.append(grad_norm(pl_module))


@pytest.mark.parametrize("precision", ["bf16-mixed", "32-true"])
def test_a_fit_clips_the_gradients_of_its_fused_optimiser(tmp_path: Path, precision: str) -> None:
    norms = Norms()
    clip = 1e-3  # below every step's norm, so every step is clipped
    fit = trainer(tmp_path, max_steps=3, precision=precision, gradient_clip_val=clip, callbacks=[norms])
    fit.fit(module(), loader())
    assert norms.fused == [True] * 3, "the CPU run should use the fused AdamW"
    assert min(norms.before) > 10 * clip
    assert norms.after == pytest.approx([clip] * 3, rel=1e-3)


def test_clipping_by_value_works_in_bf16_too(tmp_path: Path) -> None:
    norms = Norms()
    fit = trainer(tmp_path, max_steps=2, precision="bf16-mixed", gradient_clip_val=1e-4,
                  gradient_clip_algorithm="value", callbacks=[norms])
    model = module()
    fit.fit(model, loader())
    assert max(float(p.grad.abs().max()) for p in model.parameters() if p.grad is not None) <= 1e-4


def test_fp16_with_a_grad_scaler_gets_no_fused_optimiser() -> None:
    model = module()
    for precision, fused in [("16-mixed", False), ("bf16-mixed", True), ("32-true", True)]:
        with mock.patch.object(EncoderModule, "trainer", new_callable=mock.PropertyMock) as fake:
            fake.return_value = mock.Mock(precision=precision, max_steps=10, estimated_stepping_batches=10,
                                          accumulate_grad_batches=1, world_size=1, num_devices=1, num_nodes=1,
                                          datamodule=None)
            optimizer = model.configure_optimizers()["optimizer"]
        assert bool(optimizer.defaults.get("fused")) is fused, precision
    plain = configure_optimizer(model, OptimizerConfig(name="sgd", lr=0.1), total_steps=10, fused=False)
    assert not plain["optimizer"].defaults.get("fused")


def test_under_fsdp_the_root_module_clips_by_the_norm_over_all_shards() -> None:
    model = module()
    strategy = FSDPStrategy()
    root = mock.Mock()
    with (mock.patch.object(FSDPStrategy, "model", new_callable=mock.PropertyMock, return_value=root),
          mock.patch.object(EncoderModule, "trainer", new_callable=mock.PropertyMock) as fake):
        fake.return_value = mock.Mock(strategy=strategy)
        model.configure_gradient_clipping(mock.Mock(), gradient_clip_val=0.5, gradient_clip_algorithm="norm")
        root.clip_grad_norm_.assert_called_once_with(0.5)
        model.configure_gradient_clipping(mock.Mock(), gradient_clip_val=None)  # no clipping asked: nothing done
        root.clip_grad_norm_.assert_called_once()
