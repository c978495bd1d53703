"""The precision a run takes when its config names none (mpp.precision)."""

from __future__ import annotations

import pytest
import torch

from mpp import precision
from mpp.precision import default_precision


@pytest.mark.parametrize(
    ("avx512_bf16", "amx", "expected"),
    [(True, False, "bf16-mixed"), (False, True, "bf16-mixed"), (False, False, "32-true")],
)
def test_a_cpu_takes_bf16_only_with_bf16_instructions(monkeypatch, avx512_bf16: bool, amx: bool, expected: str) -> None:
    monkeypatch.setattr(torch.cpu, "_is_avx512_bf16_supported", lambda: avx512_bf16)
    monkeypatch.setattr(torch.cpu, "_is_amx_tile_supported", lambda: amx)
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    for accelerator in ("cpu", "auto"):
        chosen, why = default_precision(accelerator)
        assert chosen == expected
        assert ("no bf16" in why) == (expected == "32-true")


def test_a_cpu_whose_torch_cannot_tell_takes_32_bit(monkeypatch) -> None:
    for name in ("_is_avx512_bf16_supported", "_is_amx_tile_supported"):
        monkeypatch.delattr(torch.cpu, name, raising=False)
    assert not precision.cpu_has_bf16()


@pytest.mark.parametrize(("bf16", "expected"), [(True, "bf16-mixed"), (False, "32-true")])
def test_a_gpu_takes_bf16_where_it_computes_it(monkeypatch, bf16: bool, expected: str) -> None:
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "is_bf16_supported", lambda including_emulation=True: bf16)
    monkeypatch.setattr(torch.cpu, "_is_avx512_bf16_supported", lambda: not bf16)  # the GPU decides, not the CPU
    for accelerator in ("gpu", "cuda", "auto"):
        assert default_precision(accelerator)[0] == expected
    # On a GPU machine a run put on the CPU goes by the CPU.
    assert default_precision("cpu")[0] == ("32-true" if bf16 else "bf16-mixed")


def test_an_accelerator_instance_counts_as_its_kind(monkeypatch) -> None:
    from pytorch_lightning.accelerators import CPUAccelerator

    monkeypatch.setattr(torch.cpu, "_is_avx512_bf16_supported", lambda: True)
    assert default_precision(CPUAccelerator())[0] == "bf16-mixed"


def test_other_accelerators_keep_lightnings_default(monkeypatch) -> None:
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    assert default_precision("mps") == ("32-true", "Lightning's default on mps")
