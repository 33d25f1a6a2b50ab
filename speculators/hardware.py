"""What the hardware at hand does fast: bf16 matrix units (CUDA with bf16, or a CPU with AVX512-BF16 / AMX),
and the training precision ``train.precision: auto`` resolves to from it."""

from __future__ import annotations

from pathlib import Path

import torch


def fast_bf16() -> bool:
    """True when bf16 autocast is faster than fp32 here: a CUDA device with bf16 support, or a CPU with
    native bf16 matrix instructions (``avx512_bf16`` or ``amx_bf16`` in ``/proc/cpuinfo``). On an
    AVX2-only CPU torch emulates bf16 matmuls, ~10x slower than fp32 (measured on this project's AMD EPYC
    machines)."""
    if torch.cuda.is_available():
        return bool(torch.cuda.is_bf16_supported())
    try:
        flags = Path("/proc/cpuinfo").read_text()
    except OSError:
        return False
    return "avx512_bf16" in flags or "amx_bf16" in flags


def resolve_precision(precision: str) -> str:
    """``train.precision`` -> ``"fp32"`` or ``"bf16"`` (``"auto"``: bf16 where :func:`fast_bf16`)."""
    if precision == "auto":
        return "bf16" if fast_bf16() else "fp32"
    return precision
