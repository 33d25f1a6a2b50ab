"""A small causal LM of the target's own architecture: the model of a distilled draft model.

* :func:`build_small_lm`: a transformers ``*ForCausalLM`` built from the target's config (the same class,
  RoPE, norms, vocabulary and head) with fewer decoder layers (``layer_types`` cut to match);
* :func:`layer_skip_init`: its weights copied from the target, decoder layer ``i`` from the target's layer
  ``layer_ids[i]`` (LayerSkip / "early exit" initialisation: the first N layers, the embedding, the final
  norm and the output head), so that it starts as the target's own shallow sub-network;
* :class:`SmallLMDecoder`: incremental decoding over the model's own KV cache, rolled back (cropped) after
  drafts, and level-by-level draft trees over the same cache with a 4-D tree mask (each node sees the
  context, its ancestors and itself), windowed layers included (:class:`~.masks.AttentionLayout`).

Everything here is a plain transformers model: what is exported is ``save_pretrained``'s layout
(:func:`checkpoint_state_dict`, read back by :func:`load_checkpoint_state_dict`), which
``AutoModelForCausalLM``, vLLM's ``draft_model`` method and llama.cpp's converter read as they read any model
of that architecture.
"""

from __future__ import annotations

import re

import torch

from ..errors import SpeculatorsError
from ..export import model_config_fields
from .cache import _CACHE_KW, _CROP_TAKES_COUNT, _TAKES_CACHE_POSITION
from .masks import AttentionLayout, as_attention_mask, causal_by_slot

#: keys of a saved HF config that describe a file, not the model (never copied into a new config)
_LAYER_RE = re.compile(r"^(.*\.layers\.)(\d+)(\..+)$")


def build_small_lm(target_config: dict, num_layers: int, attn_implementation: str | None = None):
    """A randomly initialised ``*ForCausalLM`` of the target's architecture with ``num_layers`` decoder layers.

    Args:
        target_config: the target's HF config as a dict (``PretrainedConfig.to_dict()``; a checkpoint's
            ``target_config`` or a draft model's own ``config.json``), with ``model_type``.
        num_layers: decoder layers (>= 1); a per-layer ``layer_types`` list is cut to its first ``num_layers``.
        attn_implementation: transformers' attention implementation (None: its default, ``sdpa`` on CPU).
    Returns:
        the model in float32, in train mode.
    Raises:
        SpeculatorsError: no ``model_type``, a ``model_type`` transformers does not know, or ``num_layers`` < 1.
    """
    from transformers import AutoConfig, AutoModelForCausalLM

    if int(num_layers) < 1:
        raise SpeculatorsError(f"drafter.num_layers: {num_layers}; a draft model needs at least one decoder layer")
    d = model_config_fields(target_config)
    model_type = d.pop("model_type", None)
    if not isinstance(model_type, str):
        raise SpeculatorsError("draft model: the target config has no model_type (cannot build its architecture)")
    d["num_hidden_layers"] = int(num_layers)
    if isinstance(d.get("layer_types"), list):
        d["layer_types"] = d["layer_types"][:num_layers]
    try:
        cfg = AutoConfig.for_model(model_type, **d)
    except (ValueError, KeyError) as e:
        raise SpeculatorsError(f"draft model: transformers cannot build a {model_type!r} config ({e})") from None
    kw = {"attn_implementation": attn_implementation} if attn_implementation else {}
    return AutoModelForCausalLM.from_config(cfg, dtype=torch.float32, **kw).train()


def layer_skip_init(lm, source, layer_ids: list[int]) -> None:
    """Copy ``source``'s weights into ``lm`` (both of one architecture): every non-layer weight (embedding,
    final norm, output head) by name, decoder layer ``i`` of ``lm`` from ``source``'s layer ``layer_ids[i]``.

    Args:
        lm: the small model (:func:`build_small_lm`). source: a :class:`~speculators.target.Target` or its
            ``*ForCausalLM`` (any dtype).
        layer_ids: one 0-based source layer per layer of ``lm``.
    Raises:
        SpeculatorsError: a weight of ``lm`` that ``source`` lacks or holds in another shape (naming it), or
            ``layer_ids`` not one id per layer.
    """
    n = int(lm.config.num_hidden_layers)
    if len(layer_ids) != n:
        raise SpeculatorsError(f"drafter.init_layers: {len(layer_ids)} layer ids for a draft model of {n} layers")
    src = (source if isinstance(source, torch.nn.Module) else source.model).state_dict()
    with torch.no_grad():
        for name, p in lm.state_dict().items():
            m = _LAYER_RE.match(name)
            sname = f"{m.group(1)}{layer_ids[int(m.group(2))]}{m.group(3)}" if m else name
            s = src.get(sname)
            if s is None or tuple(s.shape) != tuple(p.shape):
                got = "missing" if s is None else f"shape {list(s.shape)}"
                raise SpeculatorsError(f"draft model init: the target's {sname} is {got}, the draft model's "
                                       f"{name} is {list(p.shape)} (not the same architecture)")
            p.copy_(s.detach().to(device=p.device, dtype=p.dtype))


def _own_weights(lm) -> dict[str, torch.Tensor]:
    """``lm``'s state dict, a tensor shared under two names (a tied output head) kept under its first name."""
    seen, out = set(), {}
    for name, t in lm.state_dict().items():
        if t.data_ptr() in seen and t.device.type != "meta":
            continue
        seen.add(t.data_ptr())
        out[name] = t
    return out


def checkpoint_state_dict(lm) -> dict[str, torch.Tensor]:
    """``lm``'s weights under the names and shapes ``save_pretrained`` writes (transformers' checkpoint layout,
    which vLLM's loader of the architecture and llama.cpp's converter read): the in-memory layout with
    transformers' weight conversions reverted (``core_model_loading.revert_weight_conversion``: e.g. the fused
    ``experts.gate_up_proj [E, 2I, H]`` of Qwen3-MoE / DeepSeek-V3 / Mixtral back to per-expert
    ``experts.{e}.gate_proj.weight [I, H]``), a tied output head written once (as the embedding).

    Returns:
        name -> a contiguous copy (``lm``'s dtype and device).
    """
    from transformers.core_model_loading import revert_weight_conversion

    out = revert_weight_conversion(lm, dict(_own_weights(lm)))
    return {k: v.detach().clone().contiguous() for k, v in out.items()}


def load_checkpoint_state_dict(lm, sd: dict[str, torch.Tensor]) -> None:
    """Load weights named as :func:`checkpoint_state_dict` writes them into ``lm`` (in place), undoing the
    reverted conversions exactly: every in-memory weight whose name the checkpoint renames or reshapes gets a
    distinct float64 index per element, the same reversal maps those indices to checkpoint tensors, and each
    checkpoint element is written back at its index.

    Raises:
        SpeculatorsError: a missing or unexpected name, or a shape ``lm`` does not have (naming it).
    """
    from transformers.core_model_loading import revert_weight_conversion

    own = _own_weights(lm)
    want = revert_weight_conversion(lm, {k: torch.empty(v.shape, device="meta") for k, v in own.items()})
    missing, unexpected = sorted(set(want) - set(sd)), sorted(set(sd) - set(want))
    if missing or unexpected:
        raise SpeculatorsError(f"draft model checkpoint: missing weights {missing[:5]}, unexpected {unexpected[:5]}")
    for name, t in sd.items():
        if tuple(t.shape) != tuple(want[name].shape):
            raise SpeculatorsError(f"draft model checkpoint: {name} is {list(t.shape)}, this config's is "
                                   f"{list(want[name].shape)}")
    direct = {k for k, v in own.items() if k in want and tuple(want[k].shape) == tuple(v.shape)}
    converted = [k for k in own if k not in direct]
    with torch.no_grad():
        for k in direct:
            own[k].copy_(sd[k])
        if not converted:
            return
        offsets, index, start = {}, {}, 0
        for k in converted:
            n = own[k].numel()
            offsets[k] = (start, n)
            index[k] = torch.arange(start, start + n, dtype=torch.float64).view(own[k].shape)
            start += n
        flat = torch.empty(start, dtype=torch.float64)  # exact for every float dtype a weight is held in
        for name, idx in revert_weight_conversion(lm, index).items():
            flat[idx.reshape(-1).long()] = sd[name].detach().reshape(-1).to(device="cpu", dtype=torch.float64)
        for k in converted:
            a, n = offsets[k]
            own[k].copy_(flat[a:a + n].view(own[k].shape))


class SmallLMDecoder:
    """Incremental decoding of a small LM over caller-owned KV caches (one per request).

    A cache holds one slot per token fed, in order; the caller keeps its committed length and crops the
    drafts back off (:meth:`crop`), so that outside a draft or tree call slots are positions.

    Args:
        lm: a transformers ``*ForCausalLM`` (full, sliding-window or chunked attention layers).
    """

    def __init__(self, lm):
        self.lm = lm
        self.attention = AttentionLayout(lm)

    @staticmethod
    def new_cache():
        """An empty cache of plain ``DynamicLayer`` s (every key kept: a cropped or tree-extended cache of a
        windowed model still holds each key a window may need; the masks apply the windows)."""
        from transformers import DynamicCache

        return DynamicCache()

    @staticmethod
    def slots(cache) -> int:
        """Slots held by ``cache``."""
        return int(cache.get_seq_length())

    @staticmethod
    def crop(cache, n: int) -> None:
        """Keep the first ``n`` slots of ``cache``."""
        have = int(cache.get_seq_length())
        if n < have:
            cache.crop(n - have if _CROP_TAKES_COUNT else n)

    def forward(self, cache, ids: torch.Tensor, positions: torch.Tensor | None = None,
                visible: torch.Tensor | None = None, key_positions: torch.Tensor | None = None) -> torch.Tensor:
        """Append ``ids`` to ``cache`` and return their next-token logits.

        Args:
            cache: from :meth:`new_cache`, holding ``S`` slots.
            ids: ``[m]`` int64 token ids.
            positions: ``[m]`` int64 positions of the new tokens (default ``S .. S+m-1``: slots are positions).
            visible: ``[m, S + m]`` bool, which slots each new token attends to (default: causal over slots);
                a tree level passes its ancestors-or-self rows.
            key_positions: ``[S + m]`` int64 position of every slot (needed with ``visible`` on a windowed
                model; default: the slot index, then ``positions``).
        Returns:
            ``[m, V]`` float32 logits (the model's own forward: soft-capping or scaling included).
        """
        dev = self.lm.get_input_embeddings().weight.device
        ids = ids.reshape(-1).to(device=dev, dtype=torch.int64)
        S, m = self.slots(cache), int(ids.numel())
        pos = (torch.arange(S, S + m) if positions is None else positions.reshape(-1)).to(dev)
        kw = {_CACHE_KW: cache}
        if _TAKES_CACHE_POSITION:
            kw["cache_position"] = torch.arange(S, S + m, device=dev)
        if visible is not None or self.attention.windowed:
            vis = causal_by_slot(1, m, S, dev)[0] if visible is None else visible.to(dev)
            if self.attention.windowed:
                k_pos = torch.cat([torch.arange(S, device=dev), pos]) if key_positions is None else key_positions.to(dev)
                kw["attention_mask"] = self.attention.mask(vis[None], pos[None], k_pos[None], self.lm.dtype)
            else:
                kw["attention_mask"] = as_attention_mask(self.lm, vis[None, None], self.lm.dtype)
        out = self.lm(input_ids=ids[None], position_ids=pos[None], use_cache=True, **kw)
        return out.logits[0].float()


__all__ = ["SmallLMDecoder", "build_small_lm", "layer_skip_init"]
