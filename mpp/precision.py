"""The precision a run takes when its config names none: bf16-mixed where the hardware computes
bf16 natively, 32-true elsewhere.

bf16 on a CPU without bf16 instructions is emulated and slower than float32; with them (AVX-512
BF16 or AMX), and on a GPU with bf16, the ViTs here train faster in bf16-mixed (README,
"Measured": the step against timm, precision and compile per model size). Lightning's own
default is 32-true whatever the machine.
"""

from __future__ import annotations

from typing import Any

import torch


def cpu_has_bf16() -> bool:
    """Whether this CPU has bf16 instructions (AVX-512 BF16 or AMX tiles), as PyTorch sees them."""
    checks = ("_is_avx512_bf16_supported", "_is_amx_tile_supported")
    return any(getattr(torch.cpu, name, lambda: False)() for name in checks)


def default_precision(accelerator: Any) -> tuple[str, str]:
    """(precision, why) for a trainer on `accelerator` ("auto", "cpu", "gpu", "cuda", ...)."""
    name = accelerator if isinstance(accelerator, str) else type(accelerator).__name__.lower()
    on_cuda = name in ("gpu", "cuda") or "cuda" in name or (name == "auto" and torch.cuda.is_available())
    if on_cuda and torch.cuda.is_available():
        if torch.cuda.is_bf16_supported(including_emulation=False):
            return "bf16-mixed", "the GPU computes bf16"
        return "32-true", "the GPU has no bf16"
    if "cpu" in name or name == "auto":  # "cpu", or a CPUAccelerator instance
        if cpu_has_bf16():
            return "bf16-mixed", "the CPU has bf16 instructions"
        return "32-true", "the CPU has no bf16 instructions"
    return "32-true", f"Lightning's default on {name}"
