"""What differs between transformers versions in the KV-cache API, read once at import.

* :data:`_CACHE_KW`: the name of the cache argument of a model forward (``cache`` in transformers >= 5.2x,
  ``past_key_values`` before);
* :data:`_CROP_TAKES_COUNT`: ``DynamicCache.crop`` takes the number of tokens to remove (>= 5.2x) or the
  length to keep (before);
* :data:`_TAKES_CACHE_POSITION`: the decoder forward still takes ``cache_position`` (< 5.2x);
* :func:`_pad_slots`: a layer's keys or values padded along the slot axis (the batch session's
  ragged cache).
"""

from __future__ import annotations

import torch

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
