"""What the hardware at hand does fast: bf16 matrix units (CUDA with bf16, or a CPU with AVX512-BF16 / AMX),
and what ``auto`` resolves to from it: the training precision (``train.precision: auto``) and the target's
dtype (``target.dtype: auto``, ``speculators eval --dtype auto``). Both are resolved here and nowhere else."""

from __future__ import annotations

from pathlib import Path

import torch

from .errors import SpeculatorsError


def fast_bf16(device: str | torch.device | None = None) -> bool:
    """True when bf16 matmuls are faster than fp32 here: a CUDA device with bf16 support, or a CPU with
    native bf16 matrix instructions (``avx512_bf16`` or ``amx_bf16`` in ``/proc/cpuinfo``). On an
    AVX2-only CPU torch emulates bf16 matmuls, ~10x slower than fp32 (measured on this project's AMD EPYC
    machines).

    Args:
        device: the device that will run the model (``"cpu"``, ``"cuda"``, ``"cuda:1"``, a ``torch.device``);
            None = CUDA when available, else the CPU (the default placement of ``Target.load``). Any other
            device type (``mps``, ...) counts as not fast.
    """
    try:
        kind = torch.device(device).type if device is not None else ("cuda" if torch.cuda.is_available() else "cpu")
    except (RuntimeError, TypeError):  # not a device string: Target.load names the fault
        return False
    if kind == "cuda":
        return bool(torch.cuda.is_available() and torch.cuda.is_bf16_supported())
    if kind != "cpu":
        return False
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


#: the target dtypes a recipe (``target.dtype``) and ``speculators eval --dtype`` accept
TARGET_DTYPES = ("auto", "float32", "bfloat16", "float16")


def resolve_target_dtype(dtype: str, device: str | torch.device | None = None, log=None) -> str:
    """``target.dtype`` -> the dtype name the target is loaded in (``"float32"``, ``"bfloat16"`` or ``"float16"``).

    ``"auto"`` is ``"bfloat16"`` where :func:`fast_bf16` holds for ``device`` (a GPU with bf16, a CPU with
    AVX512-BF16 or AMX: there a forward over K+1 tokens costs little more than one, as on a GPU, so
    speculation pays), else ``"float32"`` (an AVX2-only CPU, where torch emulates bf16 matmuls). Other names
    are returned as given. The same rule serves regeneration, feature extraction (the training labels are
    the target's logits in this dtype) and eval, so a drafter is trained and measured against one target.

    Args:
        dtype: ``"auto"``, ``"float32"``, ``"bfloat16"`` or ``"float16"``.
        device: where the target will run (see :func:`fast_bf16`).
        log: ``log(line)`` told what ``auto`` decided (None = silent).
    Raises:
        SpeculatorsError: any other name (naming what is allowed).
    """
    if dtype not in TARGET_DTYPES:
        raise SpeculatorsError(f"target dtype {dtype!r}: allowed {', '.join(TARGET_DTYPES)}")
    if dtype != "auto":
        return dtype
    resolved = "bfloat16" if fast_bf16(device) else "float32"
    if log is not None:
        log(f"target dtype: auto -> {resolved} ("
            + ("bf16 matrix units here" if resolved == "bfloat16" else "no bf16 matrix units here") + ")")
    return resolved
