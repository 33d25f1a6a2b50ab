"""Attention masks that respect each decoder layer's kind: full causal, a sliding window, or chunks.

The decode and tree sessions keep a ragged cache (rejected drafts and other requests' padding stay in it,
invisible; a pending tree's nodes sit at ``length + depth``), so a slot's index is not its position. For a
target whose layers are all full attention the sessions pass transformers a 2-D (or tree 4-D) mask and
let it build the causal part. A target with sliding-window layers (Mistral, Qwen2 with
``use_sliding_window``, Gemma 2 / 3, gpt-oss) needs the window measured in POSITIONS: here every forward
gets, per layer kind, a 4-D mask ``visible & (q_pos - k_pos < W)`` (transformers' and vLLM's window: a
query at position ``p`` sees keys at ``p - W < q <= p``; Llama 4's chunked layers: keys of the same chunk
of C positions). Mixed models (full and sliding layers) get
them as the ``{layer_type: mask}`` dict their forward accepts (Gemma 2 / 3, gpt-oss, Qwen2); a model
whose layers are all of one kind gets the one mask. Their KV caches are plain ``DynamicLayer`` s (every
position kept, so a rolled-back or re-packed cache still holds each key a window may need).
"""

from __future__ import annotations

import torch

from ..errors import SpeculatorsError
from .architecture import attention_kinds


class AttentionLayout:
    """The attention kinds of a model's decoder layers and the masks that follow from them.

    Args:
        model: a transformers ``*ForCausalLM``.
    Attributes:
        kinds: ``{layer_type: size or None}`` of the kinds present (``full_attention``: None,
            ``sliding_attention``: the window W, ``chunked_attention``: the chunk C).
    Raises:
        SpeculatorsError: a layer kind other than full, sliding or chunked attention, or two sizes of one kind.
    """

    def __init__(self, model):
        self.model = model
        self.kinds: dict[str, int | None] = {}
        for kind, size in attention_kinds(model.config):
            if self.kinds.setdefault(kind, size) != size:
                raise SpeculatorsError(f"target: {kind} layers of sizes {self.kinds[kind]} and {size} in one "
                                       f"model are not supported")

    @property
    def windows(self) -> list[int]:
        """The sliding window of the sliding-window layers (``[]`` without such layers)."""
        return [w for k, w in self.kinds.items() if k == "sliding_attention"]

    @property
    def windowed(self) -> bool:
        """True when some layer is not full attention (the sessions then build every mask here)."""
        return any(size is not None for size in self.kinds.values())

    def new_cache(self):
        """A fresh KV cache: transformers' ``DynamicCache(config=...)`` for full attention; for a windowed
        model plain ``DynamicLayer`` s (no sliding-window layer drops keys behind the sessions' back)."""
        from transformers import DynamicCache

        return DynamicCache() if self.windowed else DynamicCache(config=self.model.config)

    def mask(self, visible: torch.Tensor, q_pos: torch.Tensor, k_pos: torch.Tensor, dtype: torch.dtype):
        """The ``attention_mask`` argument of a decoder forward.

        Args:
            visible: ``[B, Q, K]`` bool, True where query q may see key slot k under full attention (the
                caller's causal / tree / validity rule); every query must see at least itself.
            q_pos: ``[B, Q]`` int64 positions of the queries.
            k_pos: ``[B, K]`` int64 positions of the key slots (any value where ``visible`` is False).
            dtype: the model's dtype (eager attention takes an additive mask in it).
        Returns:
            a ``[B, 1, Q, K]`` mask, or ``{layer_type: mask}`` for a model with full and sliding layers, in
            the form the model's attention implementation takes (:func:`as_attention_mask`).
        """
        out = {}
        for kind, size in self.kinds.items():
            m = visible
            if kind == "sliding_attention":
                m = visible & ((q_pos[:, :, None] - k_pos[:, None, :]) < size)
            elif kind == "chunked_attention":
                m = visible & ((q_pos[:, :, None] // size) == (k_pos[:, None, :] // size))
            out[kind] = as_attention_mask(self.model, m.unsqueeze(1), dtype)
        return next(iter(out.values())) if len(out) == 1 else out


def as_attention_mask(model, mask: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """The boolean 4-D mask ``[B, 1, Q, K]`` (True = attend) in the form the model's attention takes
    as-is (transformers returns an already prepared 4-D mask unchanged): boolean for ``sdpa``, additive
    (0 / the dtype's minimum, as transformers' own eager masks) in ``dtype`` for ``eager``.

    Raises:
        SpeculatorsError: another attention implementation (flash attention takes no 4-D mask).
    """
    impl = getattr(model.config, "_attn_implementation", None) or "eager"
    if impl == "sdpa":
        return mask
    if impl == "eager":
        return torch.zeros(mask.shape, dtype=dtype, device=mask.device).masked_fill_(~mask, torch.finfo(dtype).min)
    raise SpeculatorsError(f"target: attention implementation {impl!r} takes no 4-D mask (draft trees, sliding "
                           f"windows or chunks in a ragged batch); load the target with attn_implementation 'sdpa' "
                           f"or 'eager'")


def slot_positions(valid: torch.Tensor) -> torch.Tensor:
    """``valid [B, S]`` bool -> ``[B, S]`` int64: each valid slot's position in its row's sequence (the
    number of valid slots before it); invalid slots get the position of the next valid one (never read)."""
    return valid.long().cumsum(1) - valid.long()


def causal_by_slot(B: int, Q: int, S: int, device) -> torch.Tensor:
    """``[B, Q, S + Q]`` bool: query q (written at slot ``S + q``) sees every slot up to its own (callers AND
    it with the rows' valid slots and then :func:`with_self` so that padded queries still see one key)."""
    s = torch.arange(S + Q, device=device)
    return (s[None, :] <= (torch.arange(Q, device=device)[:, None] + S)).unsqueeze(0).expand(B, Q, S + Q)


def with_self(visible: torch.Tensor, S: int) -> torch.Tensor:
    """``visible [B, Q, S + Q]`` with every query's own slot ``S + q`` made visible (a padding query whose
    valid keys all fall outside a window would otherwise see none: NaN rows in eager attention)."""
    Q = visible.shape[1]
    eye = torch.zeros_like(visible)
    eye[:, torch.arange(Q), S + torch.arange(Q)] = True
    return visible | eye
