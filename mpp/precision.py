"""The precision a run takes: the config's where the device computes it natively, else 32-true.

A config that names no precision gets bf16-mixed where the hardware computes bf16 natively and
32-true elsewhere (Lightning's own default is 32-true whatever the machine). A config that names a
bf16 precision (the ViT-B/16 recipes, the GPU presets) runs in 32-true on a device without bf16,
and says so: there bf16 is emulated, an order of magnitude slower than float32 (ViT-B/16 at 224 px,
one forward and backward on a 2-core AVX2 CPU: 8.8 s in float32, 151 s in bf16 autocast).

A CPU computes bf16 natively with AVX-512 BF16 or AMX, unless oneDNN or ATen are held below those
instructions (ONEDNN_MAX_CPU_ISA, ATEN_CPU_CAPABILITY), which then emulate it too.
"""

from __future__ import annotations

import os
from typing import Any

import torch

# oneDNN's ISA caps (ONEDNN_MAX_CPU_ISA) below AVX512_CORE_BF16, where its bf16 matrix products are emulated.
NO_BF16_ISAS = {"SSE41", "AVX", "AVX2", "AVX2_VNNI", "AVX2_VNNI_2", "AVX512_CORE", "AVX512_CORE_VNNI"}
# ATen's kernel levels (ATEN_CPU_CAPABILITY) without AVX-512, whose bf16 kernels convert through float32.
NO_BF16_CAPABILITIES = {"default", "avx2", "zvector"}


def cpu_has_bf16() -> bool:
    """Whether this CPU computes bf16 natively (AVX-512 BF16 or AMX tiles, as PyTorch sees them) and
    the kernels are allowed to use it."""
    if os.environ.get("ONEDNN_MAX_CPU_ISA", "").upper() in NO_BF16_ISAS:
        return False
    if os.environ.get("ATEN_CPU_CAPABILITY", "").lower() in NO_BF16_CAPABILITIES:
        return False
    checks = ("_is_avx512_bf16_supported", "_is_amx_tile_supported")
    return any(getattr(torch.cpu, name, lambda: False)() for name in checks)


def device_computes_bf16(accelerator: Any) -> tuple[bool | None, str]:
    """(whether the device a trainer on `accelerator` uses computes bf16 natively, the device in words);
    None for a device other than a CPU or a CUDA GPU (a TPU, Apple's MPS), which is left to Lightning.

    `accelerator` is a Trainer's: "auto", "cpu", "gpu", "cuda", ... or an Accelerator instance.
    """
    name = accelerator if isinstance(accelerator, str) else type(accelerator).__name__.lower()
    on_cuda = name in ("gpu", "cuda") or "cuda" in name or (name == "auto" and torch.cuda.is_available())
    if on_cuda and torch.cuda.is_available():
        return torch.cuda.is_bf16_supported(including_emulation=False), "the GPU"
    if "cpu" in name or name == "auto":  # "cpu", or a CPUAccelerator instance
        return cpu_has_bf16(), "the CPU"
    return None, name


def default_precision(accelerator: Any) -> tuple[str, str]:
    """(precision, why) for a trainer on `accelerator` whose config names no precision."""
    native, device = device_computes_bf16(accelerator)
    if native is None:
        return "32-true", f"Lightning's default on {device}"
    if native:
        return "bf16-mixed", f"{device} computes bf16" if device == "the GPU" else "the CPU has bf16 instructions"
    return "32-true", "the GPU has no bf16" if device == "the GPU" else "the CPU has no bf16 instructions"


def run_precision(requested: Any, accelerator: Any) -> tuple[str, str]:
    """(the precision a run takes, a note on why for the first log lines; "" where it is the config's own).

    None takes the machine's (default_precision); a bf16 precision on a device without bf16 takes 32-true.
    """
    if requested is None:
        chosen, why = default_precision(accelerator)
        return chosen, f"trainer.precision unset: {why}"
    asked = str(requested)
    if asked.startswith("bf16"):
        native, device = device_computes_bf16(accelerator)
        if native is False:
            reason = "no bf16 instructions (AVX-512 BF16 or AMX)" if device == "the CPU" else "no bf16"
            return "32-true", (
                f"{asked} asked for, but {device} has {reason} and would emulate it an order of magnitude "
                f"slower than float32"
            )
    return requested, ""
