"""What differs between decoder-only architectures, read through the model's own accessors.

The rest of the project never reaches past the model's own accessors: the decoder stack, its layers and its final
norm come from here (``get_decoder()``, then the stack's ``layers`` / ``h`` and its final norm by the names
transformers' decoder-only models use), and so do the rules an architecture applies around the shared
pieces a drafter reuses:

* :func:`logits_rule` / :func:`apply_logits_rule`: what the model's forward does to ``lm_head(top)``
  (Gemma 2 / 3 ``final_logit_softcapping``, Granite ``logits_scaling``, Cohere ``logit_scale``), so that
  the verifier's logits equal the model's own;
* :func:`attention_kinds`: each decoder layer's attention (full, or a sliding window of W positions), the
  masks the sessions build from it (:mod:`speculators.target.masks`);
* :func:`check_supported`: one clear refusal, before any weight is read, for what the project cannot
  verify with (encoder-decoder models, multimodal configs, a layer kind outside an allow-list of full,
  sliding-window and chunked attention read from every per-layer field the config declares
  (:func:`declared_layer_kinds`), ALiBi, a layout or an output head the project does not read).

The rules per architecture are written in docs/FORMATS.md ("Targets").
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from ..errors import SpeculatorsError

_LAYER_LISTS = ("layers", "h", "blocks")
_FINAL_NORMS = ("norm", "final_layer_norm", "ln_f", "final_layernorm", "final_norm")
SUPPORTED_ATTENTION = ("full_attention", "sliding_attention", "chunked_attention")

#: config fields that declare each decoder layer's kind, beside transformers' own ``layer_types``: RecurrentGemma's
#: ``block_types``, Zamba's / Nemotron-H's ``layers_block_type``, MiniMax's ``attn_type_list`` (0 = linear "lightning"
#: attention, 1 = softmax attention), Nemotron-H's older ``hybrid_override_pattern`` (one character a layer: ``M``
#: Mamba, ``*`` attention, ``-`` MLP, ``E`` MoE); any other field named ``*layer_types`` is read too
#: (:func:`declared_layer_kinds`), so a kind nobody listed here is refused by its name, not by an accident later
KIND_FIELDS = ("layer_types", "block_types", "layers_block_type", "attn_type_list", "hybrid_override_pattern")
#: prefixes of other ``*layer_types`` fields that describe the MLPs, not the attention, of the decoder's layers (a
#: ``*layers_block_type`` field with a prefix describes extra prediction layers, not the decoder's: not read)
_NOT_LAYER_KINDS = ("mlp_",)
#: names a config gives to a layer of full causal softmax attention
_FULL_SYNONYMS = {"attention": "full_attention", "full": "full_attention", "global": "full_attention",
                  "global_attention": "full_attention", "*": "full_attention", 1: "full_attention"}
_PATTERN = {"M": "mamba", "*": "full_attention", "-": "mlp", "E": "moe"}


def decoder(model) -> torch.nn.Module:
    """The decoder stack of a transformers ``*ForCausalLM`` (``model.get_decoder()``: ``LlamaModel``,
    ``GPTNeoXModel``, ``Gemma3TextModel``, ...), the module whose forward returns ``last_hidden_state``
    after the final norm.

    Raises:
        SpeculatorsError: the model has no ``get_decoder`` returning a module.
    """
    get = getattr(model, "get_decoder", None)
    dec = get() if callable(get) else None
    if not isinstance(dec, torch.nn.Module) or dec is model:  # transformers' lookup missed (e.g. Llama 4 text)
        for name in (getattr(model, "base_model_prefix", None), "model", "transformer"):
            cand = getattr(model, name, None) if name else None
            if isinstance(cand, torch.nn.Module) and cand is not model:
                dec = cand
                break
    if not isinstance(dec, torch.nn.Module) or dec is model:
        raise SpeculatorsError(f"target: {type(model).__name__} exposes no decoder stack (get_decoder()); a "
                               f"decoder-only *ForCausalLM is needed")
    return dec


def decoder_layers(model) -> torch.nn.ModuleList:
    """The decoder layers of ``model`` in order (``get_decoder().layers``, or ``.h`` / ``.blocks``).

    Raises:
        SpeculatorsError: no such list of layers.
    """
    dec = decoder(model)
    for name in _LAYER_LISTS:
        layers = getattr(dec, name, None)
        if isinstance(layers, torch.nn.ModuleList) and len(layers):
            return layers
    raise SpeculatorsError(f"target: {type(dec).__name__} has no decoder-layer list (looked for {_LAYER_LISTS})")


def final_norm(model) -> torch.nn.Module:
    """The decoder stack's final norm (input of the output head): ``norm`` (Llama, Qwen, Gemma, ...),
    ``final_layer_norm`` (GPT-NeoX), ``ln_f`` (GPT-2 style), ``final_layernorm`` (Phi-1/2).

    Raises:
        SpeculatorsError: none of these names is a module of the decoder stack.
    """
    dec = decoder(model)
    for name in _FINAL_NORMS:
        norm = getattr(dec, name, None)
        if isinstance(norm, torch.nn.Module):
            return norm
    raise SpeculatorsError(f"target: {type(dec).__name__} has no final norm (looked for {_FINAL_NORMS})")


@dataclass(frozen=True)
class LogitsRule:
    """What an architecture's forward does to ``lm_head(top)`` (applied in this order):
    ``logits * scale``, then ``cap * tanh(logits / cap)`` when ``softcap`` is set.

    Attributes:
        scale: a multiplier (Granite ``1 / logits_scaling``, Cohere ``logit_scale``); 1.0 for most.
        softcap: Gemma 2 / 3 ``final_logit_softcapping``; None when the model has none.
    """

    scale: float = 1.0
    softcap: float | None = None

    @property
    def identity(self) -> bool:
        return self.scale == 1.0 and self.softcap is None


def logits_rule(config) -> LogitsRule:
    """The :class:`LogitsRule` of a transformers config, read from the fields the model's forward uses:
    ``logits_scaling`` (Granite, GraniteMoE: logits divided by it), ``logit_scale`` (Cohere: multiplied),
    ``final_logit_softcapping`` (Gemma 2 / 3: ``cap * tanh(logits / cap)``)."""
    cfg = config.get_text_config(decoder=True) if hasattr(config, "get_text_config") else config
    scale = 1.0
    if getattr(cfg, "logits_scaling", None):
        scale /= float(cfg.logits_scaling)
    if getattr(cfg, "logit_scale", None) is not None:
        scale *= float(cfg.logit_scale)
    cap = getattr(cfg, "final_logit_softcapping", None)
    return LogitsRule(scale, float(cap) if cap else None)


def apply_logits_rule(logits: torch.Tensor, rule: LogitsRule) -> torch.Tensor:
    """``logits [..., V]`` after ``rule`` (same dtype); returned unchanged for the identity rule."""
    if rule.scale != 1.0:
        logits = logits * rule.scale
    if rule.softcap is not None:
        logits = torch.tanh(logits / rule.softcap) * rule.softcap
    return logits


def declared_layer_kinds(config) -> dict[str, list[str]]:
    """Every per-layer kind the config declares, by field: ``{field: [kind of layer 0, 1, ...]}`` with the kinds
    as named there (full-attention synonyms such as ``attention`` or MiniMax's ``1`` read as ``full_attention``).

    Reads :data:`KIND_FIELDS` and any other field named ``*layer_types`` holding a list (minus the MLP kinds of
    :data:`_NOT_LAYER_KINDS`); LFM2's ``full_attn_idxs`` (attention layers; the others are short convolutions) when
    it has no ``layer_types``. A config that declares none gives ``{}``.
    """
    cfg = config.get_text_config(decoder=True) if hasattr(config, "get_text_config") else config
    fields = dict.fromkeys(KIND_FIELDS)
    for name in vars(cfg):
        if name.endswith("layer_types") and not name.startswith(_NOT_LAYER_KINDS):
            fields.setdefault(name)
    out: dict[str, list[str]] = {}
    for name in fields:
        value = getattr(cfg, name, None)
        if name == "hybrid_override_pattern" and isinstance(value, str):
            out[name] = [_PATTERN.get(c, c) for c in value]
        elif isinstance(value, (list, tuple)) and value:
            out[name] = [_FULL_SYNONYMS.get(v, "linear_attention" if name == "attn_type_list" and v == 0 else v)
                         if isinstance(v, (str, int)) else repr(v) for v in value]
    idxs = getattr(cfg, "full_attn_idxs", None)
    n = getattr(cfg, "num_hidden_layers", None)
    if "layer_types" not in out and isinstance(idxs, (list, tuple)) and isinstance(n, int):
        out["full_attn_idxs"] = ["full_attention" if i in set(idxs) else "conv" for i in range(n)]
    return out


def check_layer_kinds(config) -> None:
    """Refuse, by name, a layer kind the sessions do not implement: every kind :func:`declared_layer_kinds`
    reads must be one of :data:`SUPPORTED_ATTENTION` (an allow-list, so an unknown kind is refused too).

    Raises:
        SpeculatorsError: naming the kind, the field that declares it, how many layers have it, the architecture
            and the supported kinds.
    """
    for field, kinds in declared_layer_kinds(config).items():
        bad = [k for k in kinds if k not in SUPPORTED_ATTENTION]
        if bad:
            first = bad[0]
            raise SpeculatorsError(_unsupported(config, f"its decoder has {first!r} layers ({field}: "
                                                        f"{bad.count(first)} of {len(kinds)} layers"
                                                        + (f"; also {sorted(set(map(str, bad)) - {str(first)})}"
                                                           if len(set(map(str, bad))) > 1 else "")
                                                        + f"); the layer kinds verified here are "
                                                          f"{', '.join(SUPPORTED_ATTENTION)}"))


def attention_kinds(config) -> list[tuple[str, int | None]]:
    """Per decoder layer, ``(layer_type, size)``: ``("full_attention", None)`` = full causal attention,
    ``("sliding_attention", W)`` = a sliding window (a query at position p sees keys at positions
    ``p - W < q <= p``, transformers' and vLLM's rule), ``("chunked_attention", C)`` = Llama 4's chunked
    attention (a query sees the keys of its own chunk of C positions, ``q // C == p // C``).

    Read through transformers' own ``get_layer_types_and_kwargs`` (``layer_types`` when the config has it,
    else ``sliding_window`` per layer).

    Raises:
        SpeculatorsError: a layer of another kind (linear, state-space, compressed attention).
    """
    from transformers.cache_utils import get_layer_types_and_kwargs

    cfg = config.get_text_config(decoder=True) if hasattr(config, "get_text_config") else config
    try:
        types, kwargs = get_layer_types_and_kwargs(cfg)
    except Exception as e:  # noqa: BLE001 - a config transformers cannot describe per layer
        raise SpeculatorsError(_unsupported(cfg, f"the layer types of {type(cfg).__name__} cannot be read by "
                                                 f"transformers ({e})")) from None
    out: list[tuple[str, int | None]] = []
    for t, kw in zip(types, kwargs):
        if t not in SUPPORTED_ATTENTION:
            why = (" (transformers' name for a layer that keeps no cache of its own: it reuses another layer's "
                   "keys and values or has no attention)") if t == "dummy" else ""
            raise SpeculatorsError(_unsupported(cfg, f"its decoder has {t!r} layers{why}; the layer kinds verified "
                                                     f"here are {', '.join(SUPPORTED_ATTENTION)}"))
        out.append((t, None if t == "full_attention" else int(kw["sliding_window"])))
    return out


def _unsupported(cfg, why: str) -> str:
    arch = ", ".join(getattr(cfg, "architectures", None) or []) or type(cfg).__name__
    return (f"target architecture {arch} (model_type {getattr(cfg, 'model_type', '?')!r}) is not supported: {why}. "
            f"Supported: decoder-only causal LMs whose layers are full, sliding-window or chunked attention "
            f"(Llama, Qwen2/2.5/3, Qwen3-MoE, Mistral, Mixtral, Gemma 2/3, Phi-3, gpt-oss, DeepSeek-V3, "
            f"Granite, OLMo-2, GPT-NeoX and the like; README 'Targets')")


def check_supported(config) -> None:
    """Refuse, from the config alone (before any weight is read), a target the project cannot train
    drafters for or verify with.

    Raises:
        SpeculatorsError: naming the architecture and what is supported: an encoder-decoder model; a
            multimodal config without a text decoder ``transformers`` can load as a causal LM; a layer kind other
            than full, sliding-window or chunked attention (:func:`check_layer_kinds`, then transformers' own
            per-layer view in :func:`attention_kinds`); ALiBi attention; a layout whose decoder stack or final norm
            the project cannot read; an output head that is not a plain linear map over the input vocabulary.
    """
    if getattr(config, "is_encoder_decoder", False):
        raise SpeculatorsError(_unsupported(config, "it is an encoder-decoder model (speculative decoding here "
                                                    "verifies with a decoder-only causal LM)"))
    from transformers import MODEL_FOR_CAUSAL_LM_MAPPING

    from transformers import PreTrainedConfig

    subs = [k for k, v in vars(config).items()  # a sub-model's config for another modality: vision, audio, VQ
            if k.endswith("_config") and isinstance(v, PreTrainedConfig) and any(
                m in k for m in ("vision", "audio", "image", "visual", "video", "speech", "vq_"))]
    if subs:
        raise SpeculatorsError(_unsupported(config, f"it is a multimodal checkpoint ({', '.join(subs)}); load its "
                                                    f"text-only model (e.g. a *ForCausalLM of its text config)"))
    if type(config) not in MODEL_FOR_CAUSAL_LM_MAPPING:
        raise SpeculatorsError(_unsupported(config, "transformers has no causal-LM class for this config (a "
                                                    "vision-language or encoder-only model without a text-only "
                                                    "decoder path)"))
    check_layer_kinds(config)
    attention_kinds(config)
    if getattr(config, "alibi", False) or getattr(config, "model_type", "") in ("bloom", "mpt"):
        raise SpeculatorsError(_unsupported(config, "its attention adds ALiBi biases built from a 2-D padding "
                                                    "mask and takes no 4-D draft-tree mask"))
    from transformers import AutoModelForCausalLM

    try:
        with torch.device("meta"):  # the module tree only: no weight is allocated or read
            model = AutoModelForCausalLM.from_config(config)
    except Exception as e:  # noqa: BLE001 - transformers cannot build it
        raise SpeculatorsError(_unsupported(config, f"transformers cannot build it as a causal LM ({e})")) from None
    try:
        layers = decoder_layers(model)
        final_norm(model)
    except SpeculatorsError as e:  # an accessor the project reads through is missing
        raise SpeculatorsError(_unsupported(config, f"this architecture's layout is not one we read: {e} (a "
                                                    f"decoder-only stack of layers followed by a final norm and a "
                                                    f"linear output head)")) from None
    for i, layer in enumerate(layers):
        if not any(type(m).__name__.endswith("Attention") for m in layer.modules()):
            kinds = sorted({type(m).__name__ for m in layer.children()})
            raise SpeculatorsError(_unsupported(config, f"decoder layer {i} has no attention ({kinds}: a "
                                                        f"state-space or linear-attention layer)"))
    _check_output_head(model, config)


def _check_output_head(model, config) -> None:
    """The verifier computes ``lm_head(norm(top))`` itself (:meth:`Target.lm_head`), with the architecture's
    :func:`logits_rule`: the head must be a plain ``nn.Linear`` (no forward of its own) with one row per input
    embedding row."""
    head, emb = model.get_output_embeddings(), model.get_input_embeddings()
    if not isinstance(head, torch.nn.Linear) or type(head).forward is not torch.nn.Linear.forward:
        raise SpeculatorsError(_unsupported(config, f"its output head is not a plain linear map of the final "
                                                    f"hidden state ({type(head).__name__} computes the logits its "
                                                    f"own way)"))
    if isinstance(emb, torch.nn.Embedding) and emb.num_embeddings != head.out_features:
        raise SpeculatorsError(_unsupported(config, f"its input embeddings ({emb.num_embeddings} rows) and output "
                                                    f"head ({head.out_features} rows) cover different vocabularies"))
