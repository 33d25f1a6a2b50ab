"""Batched generation from the target with batch compaction (used by regeneration and self-synthesis).

Prompts are left-padded and prefilled in one forward; then each step samples (greedy or vLLM-style
temperature / top-p through :func:`speculators.verify.apply_sampling`), records the tokens, drops the
rows that stopped from the batch and its KV cache (``batch_select_indices``; in groups of at least an
eighth of the batch, :data:`COMPACT_DIVISOR`), and runs one forward over the rows left: the cost follows
the generated tokens, not ``batch x longest response``. The KV cache of every layer is reserved at the prefill for the whole response
(:class:`_ReservedLayer`): a step writes its position in place instead of copying the cache into a new
tensor (``DynamicLayer``'s concatenation), so no per-step work but attention itself scales with the width.
Callers bucket prompts by length first (:func:`speculators.data.batching.generation_batches`) so a batch
pads little.
"""

from __future__ import annotations

from typing import Iterable, NamedTuple, Sequence

import torch
from transformers.cache_utils import DynamicLayer

from ..errors import SpeculatorsError
from .cache import _CACHE_KW


# Finished rows leave the batch once they are 1/COMPACT_DIVISOR of it (at once in a batch under that many rows):
# each compaction copies the kept rows' KV cache, so a large batch drops rows in groups rather than one copy
# per finished row; until then a finished row is computed and its tokens ignored.
COMPACT_DIVISOR = 8


class Generation(NamedTuple):
    """One response of :meth:`Target.generate_batch`.

    Attributes:
        ids: the generated token ids, without the prompt and without the stop token.
        stop: the stop token id that ended the response, or None when it was cut by ``max_new_tokens``.
    """

    ids: list[int]
    stop: int | None


@torch.no_grad()
def generate_batch(target, prompts: list[list[int]], max_new_tokens: int,
                   stop_token_ids: Iterable[int] | int | None = None,
                   temperature: float = 0.0, top_p: float = 1.0,
                   generator: torch.Generator | Sequence[torch.Generator] | None = None,
                   pad_token_id: int = 0) -> list[Generation]:
    """Batched generation with batch compaction (``target.generate_batch``): finished rows leave the
    batch (and the KV cache).

    Prompts are left-padded; each step runs only the rows still generating, so the cost follows
    the number of generated tokens rather than ``batch x longest response`` (what a static batch
    in ``model.generate`` pays).

    Args:
        target: the :class:`speculators.target.Target` (its model, device, config and stop tokens).
        prompts: token ids per prompt.
        max_new_tokens: cap per response.
        stop_token_ids: the SET of stop tokens (an int is one stop token); None = the target's
            ``stop_token_ids``; an empty collection = never stop before ``max_new_tokens``.
        temperature: 0 = greedy; otherwise sampling with ``top_p`` (vLLM semantics through
            :func:`speculators.verify.apply_sampling`).
        generator: RNG for sampling: one for the whole batch, or one per prompt (``len(prompts)`` of
            them, on the target's device), so that a prompt's random stream does not depend on which
            other prompts share its batch or on their order (its logits may still differ from a lone
            forward's in the last bits, so a draw at a boundary can flip).
        pad_token_id: id written in the left padding (masked out).

    Greedy responses (``temperature == 0``) do not depend on the batch: a row's logits are computed from
    its own tokens only (padding masked, positions from its own start). What can differ is the last bits of
    a batched matmul against a lone one (the kernels tile an ``[n, H]`` input by ``n``), so where the two
    best logits of a step are within that rounding the argmax can flip and the responses part there. In
    float32 this has not been seen on CPU. In bfloat16 (8 mantissa bits: one ulp is 1/128 of the logit's
    power of two) it happens: SmolLM2-135M-Instruct on an AVX512-BF16 CPU, 4 prompts (2 HumanEval, 2
    chatterbot) of a length-bucketed batch against each alone, 128 new tokens: 2 parted, at steps 35 and 70,
    where the two best logits alone were 15.6875 / 15.5625 (gap 2 ulps) and 33.25 / 33.0 (gap 1 ulp). Both
    responses are then the target's own greedy continuation of a tie it could break either way; the
    regeneration cache stores whichever the batch produced. ``tests/data/test_regen_batching.py`` checks token
    equality in both dtypes on a tiny target, and ``scripts/bench_regenerate.py --check-alone K`` on the
    real target prints every mismatch with its top-2 logit gap in ulps.
    Returns:
        One :class:`Generation` per prompt: ``ids`` (without the prompt and the stop token) and
        ``stop`` (the stop id that ended it, or None when cut by ``max_new_tokens``).
    Raises:
        SpeculatorsError: an empty prompt, ``max_new_tokens < 1`` or a generator list whose length is
            not ``len(prompts)``.
    """
    stops = _check_request(target, prompts, max_new_tokens, stop_token_ids, generator)
    B = len(prompts)
    per_row = generator is not None and not isinstance(generator, torch.Generator)
    if B == 0:
        return []
    cache, logits, att, last_pos = _prefill(target, prompts, pad_token_id, max_new_tokens)
    rows = torch.arange(B, device=target.device)  # original index of each row of the batch
    live = torch.ones(B, dtype=torch.bool, device=target.device)  # rows still generating
    results: list[list[int]] = [[] for _ in range(B)]
    stopped: list[int | None] = [None] * B
    for step in range(max_new_tokens):
        idx = live.nonzero()[:, 0]
        every = idx.numel() == rows.numel()
        tok = _next_tokens(logits if every else logits[idx], temperature, top_p, generator, per_row,
                           rows if every else rows[idx])
        done = _record(tok, rows if every else rows[idx], stops, results, stopped)
        n_live = idx.numel() - int(done.sum())
        if step + 1 == max_new_tokens or n_live == 0:
            break
        live[idx[done]] = False
        nxt = tok if every else torch.full_like(rows, pad_token_id).index_put_((idx,), tok)
        if rows.numel() - n_live >= max(1, rows.numel() // COMPACT_DIVISOR):  # finished rows leave
            keep = live.nonzero()[:, 0]
            cache.batch_select_indices(keep.cpu() if target.spread else keep)  # cpu: indexes every device
            rows, nxt, att, last_pos, live = rows[keep], nxt[keep], att[keep], last_pos[keep], live[keep]
        att = torch.cat([att, torch.ones_like(att[:, :1])], dim=1)
        last_pos = last_pos + 1
        out = target.decoder(input_ids=nxt[:, None], attention_mask=att, position_ids=last_pos[:, None],
                             use_cache=True, **{_CACHE_KW: cache})
        logits = target.lm_head(out.last_hidden_state[:, -1]).float()
    return [Generation(r, s_) for r, s_ in zip(results, stopped)]


def _check_request(target, prompts, max_new_tokens, stop_token_ids, generator) -> set[int]:
    """The set of stop ids of a :func:`generate_batch` call, after checking its arguments.

    Raises:
        SpeculatorsError: ``max_new_tokens < 1``, an empty prompt, or a generator list whose length is not
            ``len(prompts)``.
    """
    if max_new_tokens < 1:
        raise SpeculatorsError(f"max_new_tokens must be >= 1, got {max_new_tokens}")
    if any(len(p) == 0 for p in prompts):
        raise SpeculatorsError("generate_batch: every prompt needs at least one token")
    if stop_token_ids is None:
        stops = set(target.stop_token_ids)
    elif isinstance(stop_token_ids, int):
        stops = {int(stop_token_ids)}
    else:
        stops = {int(t) for t in stop_token_ids}
    B = len(prompts)
    per_row = generator is not None and not isinstance(generator, torch.Generator)
    if per_row and len(generator) != B:
        raise SpeculatorsError(f"generate_batch: {len(generator)} generators for {B} prompts (one per prompt)")
    return stops


def _prefill(target, prompts: list[list[int]], pad_token_id: int, max_new_tokens: int):
    """Left-pad ``prompts`` and run them through the target in one forward with a fresh ``DynamicCache`` whose
    layers reserve room for ``max_new_tokens`` more positions (:func:`_reserved_cache`).

    Returns:
        ``(cache, logits [B, V] float32 of the last position, attention mask [B, T] int64, last position
        id [B] int64)``, on the target's device.
    """
    from transformers import DynamicCache

    B = len(prompts)
    T = max(len(p) for p in prompts)
    ids = torch.full((B, T), pad_token_id, dtype=torch.long)
    att = torch.zeros(B, T, dtype=torch.long)
    for r, p in enumerate(prompts):
        ids[r, T - len(p):] = torch.tensor(p)
        att[r, T - len(p):] = 1
    dev = target.device
    ids, att = ids.to(dev), att.to(dev)
    pos = (att.cumsum(-1) - 1).clamp(min=0)
    cache = _reserved_cache(DynamicCache(config=target.config), T + max_new_tokens)
    out = target.decoder(input_ids=ids, attention_mask=att, position_ids=pos, use_cache=True, **{_CACHE_KW: cache})
    # the output head on the last position only, a [B, H] matrix (Target.lm_head: the model's own logits)
    return cache, target.lm_head(out.last_hidden_state[:, -1]).float(), att, pos[:, -1]


class _ReservedLayer(DynamicLayer):
    """A full-attention cache layer whose keys and values live in buffers ``[B, kv_heads, capacity, head_dim]``
    allocated at the prefill: a decode step writes its position in place and attends over a view of the
    filled part, where ``DynamicLayer`` concatenates (copies the whole cache into a new tensor every step).
    Dropping finished rows (``batch_select_indices``) copies the filled part of the kept rows only."""

    def __init__(self, capacity: int):
        super().__init__()
        self.capacity = capacity
        self._k = self._v = None
        self._len = 0

    def update(self, key_states: torch.Tensor, value_states: torch.Tensor, *args, **kwargs):
        if not self.is_initialized:
            B, H, _, D = key_states.shape
            self.device = key_states.device
            self._k = key_states.new_empty(B, H, self.capacity, D)
            self._v = value_states.new_empty(B, H, self.capacity, value_states.shape[-1])
            self.is_initialized = True
        end = self._len + key_states.shape[-2]
        if end > self.capacity:
            raise SpeculatorsError(f"generate_batch: {end} cached positions exceed the {self.capacity} reserved")
        self._k[:, :, self._len:end] = key_states
        self._v[:, :, self._len:end] = value_states
        self._len = end
        self.keys, self.values = self._k[:, :, :end], self._v[:, :, :end]
        return self.keys, self.values

    def batch_select_indices(self, indices: torch.Tensor) -> None:
        if self._len == 0:
            return
        k, v = self._k[indices, :, :self._len], self._v[indices, :, :self._len]
        self._k = k.new_empty(k.shape[0], k.shape[1], self.capacity, k.shape[-1])
        self._v = v.new_empty(v.shape[0], v.shape[1], self.capacity, v.shape[-1])
        self._k[:, :, :self._len], self._v[:, :, :self._len] = k, v
        self.keys, self.values = self._k[:, :, :self._len], self._v[:, :, :self._len]


def _reserved_cache(cache, capacity: int):
    """``cache`` (a fresh ``DynamicCache``) with every layer a :class:`_ReservedLayer` of ``capacity`` positions,
    when every layer is a plain full-attention ``DynamicLayer``; otherwise (sliding-window, linear-attention
    layers) ``cache`` as it is."""
    if not cache.layers or any(type(layer) is not DynamicLayer for layer in cache.layers):
        return cache
    cache.layers = [_ReservedLayer(capacity) for _ in cache.layers]
    return cache


def _next_tokens(logits: torch.Tensor, temperature: float, top_p: float, generator, per_row: bool,
                 rows: torch.Tensor) -> torch.Tensor:
    """The next token of every active row: ``logits [n, V]`` float32 -> ``[n]`` int64; greedy at
    ``temperature == 0``, else sampled (per-row generators indexed by the rows' original index)."""
    if temperature > 0:
        from ..verify import apply_sampling

        n = logits.shape[0]
        probs = apply_sampling(logits, torch.full((n,), temperature), None,
                               torch.full((n,), top_p) if top_p < 1 else None)
        if per_row:
            return torch.cat([torch.multinomial(probs[i:i + 1], 1, generator=generator[r])[:, 0]
                              for i, r in enumerate(rows.tolist())])
        return torch.multinomial(probs, 1, generator=generator)[:, 0]
    return logits.argmax(-1)


def _record(nxt: torch.Tensor, rows: torch.Tensor, stops: set[int], results: list[list[int]],
            stopped: list[int | None]) -> torch.Tensor:
    """Append each active row's token to its response, or record the stop id that ended it.

    Returns:
        ``[n]`` bool: True for the rows that stopped at this step.
    """
    done = torch.zeros_like(nxt, dtype=torch.bool)
    for i, (r, t) in enumerate(zip(rows.tolist(), nxt.tolist())):
        if t in stops:
            done[i] = True
            stopped[r] = t
        else:
            results[r].append(t)
    return done
