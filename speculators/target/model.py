"""The target (verifier) model itself: the frozen causal LM the drafters read and the verifier decodes with.

:class:`Target` wraps a transformers ``*ForCausalLM`` and exposes exactly what drafters, the data
pipeline and the decoding loop need:

* facts: sizes, ``aux_layer_ids``, ``fingerprint`` (cache key), ``verifier_name``, ``architecture``,
  ``layer_config_dict()``, where it lives (``device``, ``placement``, ``spread``);
* ``features(input_ids)``: aux hidden states (multi-layer fusion taps, :mod:`speculators.target.features`),
  the final (post-norm) hidden state and optionally logits, in one forward;
* ``embed`` / ``lm_head`` / ``final_norm``: the frozen token embedding, output head and final norm (over
  several devices their outputs come back to the input's device);
* stop tokens (:attr:`Target.stop_token_ids`): the tokenizer's EOS, ``generation_config.eos_token_id``
  and the chat template's end-of-turn token, used by regeneration and by plain / speculative decoding;
* decoding: ``generate_batch`` (:mod:`speculators.target.generation`), ``session()`` /
  ``batch_session(max_batch)`` (:mod:`speculators.target.sessions`);
* LoRA for joint training (:mod:`speculators.target.lora`, a base class of :class:`Target`).

``Target.load`` reads a model reference (:mod:`speculators.target.loading`).
"""

from __future__ import annotations

from pathlib import Path
from typing import Iterable, Sequence

import torch

from ..errors import SpeculatorsError
from ..utils import stable_hash
from .architecture import apply_logits_rule, decoder, logits_rule
from .architecture import final_norm as _final_norm
from .features import TargetFeatures, default_aux_layer_ids
from .features import tap_layers as _tap_layers
from .generation import Generation
from .generation import generate_batch as _generate_batch
from .loading import ALIAS_HUB_IDS, _placement, load_target
from .lora import LoraTarget
from .masks import AttentionLayout
from .sessions import BatchDecodeSession, DecodeSession


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


class Target(LoraTarget):
    """A frozen causal LM used as the verifier and as the source of drafter training features.

    Args:
        model: a decoder-only transformers ``*ForCausalLM`` (any architecture whose layers are full or
            sliding-window or chunked attention: :func:`speculators.target.architecture.check_supported`); its decoder
            stack, layers, final norm, embedding and head are read through its own accessors
            (:mod:`speculators.target.architecture`).
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
        self.decoder = decoder(model)
        self.attention = AttentionLayout(model)
        self.logits_rule = logits_rule(self.config)
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
            dtype: weight dtype name (:func:`torch_dtype`), or ``auto`` (:func:`speculators.hardware.resolve_target_dtype`:
                bfloat16 where this device is fast in it, else float32).
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
        return load_target(cls, ref, dtype, aux_layer_ids, log, device, device_map)

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
    def cache_identity(self) -> str:
        """Key of the caches of what this target computes (regenerations, self-synthesized prompts, features):
        :attr:`fingerprint`, plus the compute dtype when it is not float32 (``"<fingerprint>:bfloat16"``).
        Weights stored in bf16 have the same fingerprint in either dtype, but a bf16 forward rounds its
        logits differently, so a bf16 run never reads a float32 run's outputs (float32 keys are unchanged)."""
        name = str(self.dtype).removeprefix("torch.")
        return self.fingerprint if name == "float32" else f"{self.fingerprint}:{name}"

    @property
    def verifier_name(self) -> str:
        """Name recorded as ``verifier.name_or_path`` in exported configs: the hub id for a built-in alias."""
        return ALIAS_HUB_IDS.get(self.name_or_path, self.name_or_path)

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
        norm = _final_norm(self.model)
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
        dtype, on ``top``'s device (computed on the head's device when a ``device_map`` put it elsewhere),
        after the architecture's :attr:`logits_rule` (Gemma's soft-capping, Granite's / Cohere's scaling),
        so they equal the logits of the model's own forward."""
        w = self.lm_head_weight
        # one [N, H] x [H, V] product: a 3-D or strided input can make oneDNN expand the head per row (25 GB
        # for Gemma 3's 262k x 640 head at 77 rows), and once that allocation fails torch takes its ~10x slower
        # bf16 matmul for the rest of the process
        flat = top.reshape(-1, top.shape[-1]).contiguous()
        if w.device != top.device:
            logits = torch.nn.functional.linear(flat.to(w.device), w.to(top.dtype)).to(top.device)
        else:
            logits = torch.nn.functional.linear(flat, w.to(top.dtype))
        return apply_logits_rule(logits.view(*top.shape[:-1], -1), self.logits_rule)

    @torch.no_grad()
    def check_logits_rule(self, tokens: int = 8) -> None:
        """Check that :meth:`lm_head` on the decoder's output reproduces the model's own forward (the
        architecture's :attr:`logits_rule` is the transform its forward applies), on the first ``tokens``
        token ids; :meth:`load` runs it once.

        Raises:
            SpeculatorsError: the logits differ by more than 1% of their largest magnitude (an architecture
                that transforms its logits in a way :func:`~speculators.target.architecture.logits_rule`
                does not know; naming it).
        """
        ids = torch.arange(min(tokens, self.vocab_size)).unsqueeze(0).to(self.device)
        ours = self.features(ids, with_logits=True).logits.float()
        want = self.model(input_ids=ids).logits.to(ours.device).float()
        err = float((ours - want).abs().max())
        if err > 1e-2 * max(1.0, float(want.abs().max())):
            raise SpeculatorsError(f"target {self.name_or_path!r} ({self.architecture}): its forward transforms the "
                                   f"output head's logits in a way this project does not apply ({self.logits_rule}; "
                                   f"max difference {err:.3g}); this architecture is not supported yet")

    def new_cache(self):
        """A fresh KV cache for a decoder forward (:meth:`AttentionLayout.new_cache`)."""
        return self.attention.new_cache()

    def layer_config_dict(self) -> dict:
        """The target's HF config as a plain dict, recorded in drafter checkpoints (``target_config``); a
        drafter's layer config is BUILT from it by an allow-list (:func:`speculators.drafters.layers.layer_config`)."""
        d = self.config.to_dict()
        d.pop("quantization_config", None)
        return d

    def save_pretrained(self, directory: str | Path) -> None:
        """Write the target as a Hugging Face directory (``save_pretrained``'s layout: config, weights in the
        model's own dtype, and the tokenizer when there is one) into ``directory``, for an engine that loads
        a directory (vLLM). The caller owns atomicity (:func:`speculators.utils.atomic_dir`)."""
        self.model.save_pretrained(str(directory))
        if self.tokenizer is not None:
            self.tokenizer.save_pretrained(str(directory))

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
            out = self.decoder(input_ids=input_ids.to(self.device),
                               attention_mask=None if attention_mask is None else attention_mask.to(self.device),
                               use_cache=False)
        top = out.last_hidden_state.to(self.device)
        return TargetFeatures(taps.aux(), top, self.lm_head(top) if with_logits else None)

    def tap_layers(self):
        """Record the PRE-norm output of every aux layer during the forwards run inside the block.

        Forward hooks on the decoder layers ``i`` (removed on exit) capture the residual stream each
        tapped decoder layer returns, for every id including ``L - 1`` (transformers'
        ``hidden_states[L]`` is post-norm: it is NOT used).

        Yields:
            an object whose ``aux()`` returns ``[B, T, n_aux * H]``: the last captured output of each
            aux layer, concatenated in ``aux_layer_ids`` order, on :attr:`device` (each tap is moved
            there from its layer's device when a ``device_map`` spread the layers).
        """
        return _tap_layers(self)

    def generate_batch(self, prompts: list[list[int]], max_new_tokens: int,
                       stop_token_ids: Iterable[int] | int | None = None,
                       temperature: float = 0.0, top_p: float = 1.0,
                       generator: torch.Generator | Sequence[torch.Generator] | None = None,
                       pad_token_id: int = 0) -> list[Generation]:
        """Batched generation with batch compaction: finished rows leave the batch (and the KV cache).

        :func:`speculators.target.generation.generate_batch` with this target (arguments, the one
        :class:`Generation` per prompt it returns, and the errors it raises are documented there).
        """
        return _generate_batch(self, prompts, max_new_tokens, stop_token_ids, temperature, top_p, generator,
                               pad_token_id)

    def session(self) -> "DecodeSession":
        """A fresh batch-1 incremental decoding session with its own KV cache."""
        return DecodeSession(self)

    def batch_session(self, max_batch: int) -> "BatchDecodeSession":
        """A fresh ragged-batch decoding session (:class:`BatchDecodeSession`) for at most ``max_batch``
        requests at a time (continuous batching: requests join and leave between forwards).

        Every supported target batches: sliding-window and chunked layers keep plain ``DynamicLayer`` caches
        and get their masks by position (:class:`~speculators.target.masks.AttentionLayout`).

        Raises:
            SpeculatorsError: ``max_batch`` is not an integer >= 1.
        """
        return BatchDecodeSession(self, max_batch)


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
