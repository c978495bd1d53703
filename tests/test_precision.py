"""The precision a run takes when its config names none (mpp.precision)."""

from __future__ import annotations

import pytest
import torch

from mpp import precision
from mpp.precision import default_precision, run_precision


@pytest.fixture(autouse=True)
def kernels_as_built(monkeypatch) -> None:
    """No cap on oneDNN's or ATen's instructions from the machine's environment (the tests set their own)."""
    monkeypatch.delenv("ONEDNN_MAX_CPU_ISA", raising=False)
    monkeypatch.delenv("ATEN_CPU_CAPABILITY", raising=False)


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
    for check in ("_is_avx512_bf16_supported", "_is_amx_tile_supported"):  # the GPU decides, not the CPU
        monkeypatch.setattr(torch.cpu, check, lambda: not bf16)
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


@pytest.mark.parametrize("bf16", [True, False])
def test_a_configs_bf16_runs_only_where_the_device_computes_it(monkeypatch, bf16: bool) -> None:
    monkeypatch.setattr(precision, "cpu_has_bf16", lambda: bf16)
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    for asked in ("bf16-mixed", "bf16-true"):
        chosen, why = run_precision(asked, "cpu")
        if bf16:
            assert (chosen, why) == (asked, "")
        else:
            assert chosen == "32-true"
            assert why == (f"{asked} asked for, but the CPU has no bf16 instructions (AVX-512 BF16 or AMX) and would "
                           "emulate it an order of magnitude slower than float32")
    for asked in ("32-true", "16-mixed", "64-true"):  # what a config names otherwise is its own
        assert run_precision(asked, "cpu") == (asked, "")
    unset = "the CPU has bf16 instructions" if bf16 else "the CPU has no bf16 instructions"
    assert run_precision(None, "cpu") == ("bf16-mixed" if bf16 else "32-true", f"trainer.precision unset: {unset}")


@pytest.mark.parametrize(("bf16", "expected"), [(True, "bf16-mixed"), (False, "32-true")])
def test_a_gpus_bf16_is_what_it_computes_natively(monkeypatch, bf16: bool, expected: str) -> None:
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    asked_emulation = []
    monkeypatch.setattr(torch.cuda, "is_bf16_supported",
                        lambda including_emulation=True: asked_emulation.append(including_emulation) or bf16)
    assert run_precision("bf16-mixed", "gpu")[0] == expected
    assert asked_emulation == [False]  # a GPU that only emulates bf16 (a V100) does not count


def test_other_accelerators_keep_the_configs_bf16(monkeypatch) -> None:
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    assert run_precision("bf16-mixed", "tpu") == ("bf16-mixed", "")


@pytest.mark.parametrize(("variable", "value"), [("ONEDNN_MAX_CPU_ISA", "AVX2"), ("ONEDNN_MAX_CPU_ISA", "avx512_core"),
                                                 ("ATEN_CPU_CAPABILITY", "avx2"), ("ATEN_CPU_CAPABILITY", "default")])
def test_kernels_held_below_avx512_count_as_a_cpu_without_bf16(monkeypatch, variable: str, value: str) -> None:
    monkeypatch.setattr(torch.cpu, "_is_avx512_bf16_supported", lambda: True)
    assert precision.cpu_has_bf16()
    monkeypatch.setenv(variable, value)
    assert not precision.cpu_has_bf16()
    monkeypatch.setenv(variable, {"ONEDNN_MAX_CPU_ISA": "AVX512_CORE_AMX", "ATEN_CPU_CAPABILITY": "avx512"}[variable])
    assert precision.cpu_has_bf16()
