"""Incremental decoding over the target's KV cache, rolled back after rejected drafts.

* :class:`DecodeSession` (``Target.session()``): batch 1, a croppable cache (as a serving engine frees
  the KV slots of rejected tokens);
* :class:`BatchDecodeSession` (``Target.batch_session(max_batch)``): a ragged batch of requests over
  ONE cache, requests joining and leaving between forwards (continuous batching, as vLLM's / TGI's
  ragged batches, on a padded cache instead of paged blocks);

Every forward returns the logits and the :class:`~speculators.target.features.TargetFeatures` (aux taps,
post-norm top hidden state) of the new positions, on the target's device.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch

from ..errors import SpeculatorsError
from .cache import _CACHE_KW, _CROP_TAKES_COUNT, _TAKES_CACHE_POSITION, _pad_slots
from .features import TargetFeatures
from .masks import causal_by_slot, slot_positions, with_self
from .tree_session import BatchTreeMixin, DecodeTreeMixin

if TYPE_CHECKING:
    from .model import Target


class DecodeSession(DecodeTreeMixin):
    """Batch-1 incremental decoding with a KV cache that can be cropped (rolled back).

    ``forward(ids)`` appends ``ids`` at the end of the cached sequence and returns logits and features
    for those positions; ``crop(n)`` keeps the first ``n`` cached positions (after rejected drafts),
    the way a serving engine frees the KV slots of rejected tokens. ``forward_tree`` / ``keep_tree``
    (:mod:`.tree_session`) verify a draft tree; while one is pending ``forward`` and ``crop`` are refused.
    """

    def __init__(self, target: Target):
        self.target = target
        self.cache = target.new_cache()
        self.length = 0
        self._tree: list[int] | None = None  # parents of the pending tree forward

    @torch.no_grad()
    def forward(self, ids: torch.Tensor) -> tuple[torch.Tensor, TargetFeatures]:
        """Append ``ids`` (``[m]`` or ``[1, m]`` int64) and run them through the target.

        Returns:
            logits ``[m, V]`` float32 and TargetFeatures with batch dimension 1 (``aux [1, m, nH]``).
        """
        if self._tree is not None:
            self._refuse_if_tree("forward")
        ids = ids.reshape(1, -1).to(self.target.device)
        m = ids.shape[1]
        pos = torch.arange(self.length, self.length + m, device=ids.device)
        kw = {}
        if self.target.attention.windowed:  # slots are positions here: a causal mask with the windows
            k_pos = torch.arange(self.length + m, device=ids.device).unsqueeze(0)
            kw["attention_mask"] = self.target.attention.mask(causal_by_slot(1, m, self.length, ids.device),
                                                              pos.unsqueeze(0), k_pos, self.target.dtype)
        with self.target.tap_layers() as taps:  # pre-norm outputs of every aux layer, L - 1 included
            out = self.target.decoder(input_ids=ids, use_cache=True, **{_CACHE_KW: self.cache},
                                      cache_position=pos, position_ids=pos.unsqueeze(0), **kw)
        self.length += m
        top = out.last_hidden_state.to(self.target.device)
        feats = TargetFeatures(taps.aux(), top)
        logits = self.target.lm_head(top)[0].float()
        return logits, feats

    def crop(self, n: int) -> None:
        """Keep only the first ``n`` positions of the KV cache."""
        if self._tree is not None:
            self._refuse_if_tree("crop")
        if n < self.length:
            if _CROP_TAKES_COUNT:  # transformers >= 5.2x: crop(-tokens_to_remove)
                self.cache.crop(n - self.length)
            else:  # older transformers: crop(max_length)
                self.cache.crop(n)
            self.length = n


class BatchDecodeSession(BatchTreeMixin):
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
    * :meth:`forward_tree` / :meth:`keep_tree` verify draft trees (:mod:`.tree_session`); while a request
      has a tree pending, its ``forward`` / ``keep`` / ``forward_tree`` and :meth:`compact` are refused,
      the automatic compaction waits, :meth:`remove` drops the tree;
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
            plain ``DynamicLayer`` s (:meth:`Target.new_cache` gives every supported target such a
            cache; another cache cannot be gathered and padded per slot).
    """

    def __init__(self, target: Target, max_batch: int, slack: int = 16):
        for name, v, lo in (("max_batch", max_batch, 1), ("slack", slack, 0)):
            if isinstance(v, bool) or not isinstance(v, int) or v < lo:
                raise SpeculatorsError(f"batch_session: {name} must be an integer >= {lo}, got {v!r}")
        self.target = target
        self.max_batch = max_batch
        self.slack = slack
        self._check_layers(target.new_cache())
        self.cache = None  # the batch's DynamicCache (None while the batch is empty)
        self._rows: list = []  # request id of each cache row
        self._lengths: list[int] = []  # valid tokens per row (= the next token's position)
        self.valid = torch.zeros(0, 0, dtype=torch.bool, device=target.device)
        self.compactions = 0  # automatic + explicit re-packs (for tests and diagnostics)
        self._trees: dict = {}  # request id -> (first slot, parents) of its pending tree forward

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

    def _run(self, ids: torch.Tensor, cache, pos: torch.Tensor, attention_mask=None, start_slot: int = 0,
             visible: torch.Tensor | None = None, old_valid: torch.Tensor | None = None):
        """One decoder forward with the aux taps: ``ids [B, M]``, ``pos [B, M]`` -> (top, aux).

        For a windowed target (:class:`~.masks.AttentionLayout`) the mask is built from ``visible``
        (``[B, M, start_slot + M]`` bool, the full-attention rule) with each slot's position: the cached
        slots' from ``old_valid [B, start_slot]``, the new ones' from ``pos``; ``attention_mask`` is unused."""
        kw = {_CACHE_KW: cache}
        if _TAKES_CACHE_POSITION:
            kw["cache_position"] = torch.arange(start_slot, start_slot + ids.shape[1], device=ids.device)
        if self.target.attention.windowed:
            k_pos = pos if old_valid is None else torch.cat([slot_positions(old_valid), pos], dim=1)
            attention_mask = self.target.attention.mask(visible, pos, k_pos, self.target.dtype)
        with self.target.tap_layers() as taps:
            out = self.target.decoder(input_ids=ids, attention_mask=attention_mask, position_ids=pos,
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
        cache = self.target.new_cache()
        top, aux = self._run(inp.to(dev), cache, steps.unsqueeze(0).expand(J, T),
                             attention_mask=None if min(n) == T else valid,
                             visible=with_self(causal_by_slot(J, T, 0, dev) & valid.unsqueeze(1), 0))
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
        if self._trees:
            for r in request_ids:
                self._refuse_if_tree(r, "forward")
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
        top, aux = self._run(inp, self.cache, pos, attention_mask=mask, start_slot=self.width,
                             visible=with_self(causal_by_slot(B, M, self.width, dev) & mask.unsqueeze(1), self.width),
                             old_valid=self.valid)
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
        if self._trees:
            self._refuse_if_tree(request_id, "keep")
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
        self._trees.pop(request_id, None)
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
        if self.cache is not None and not self._trees:  # a pending tree's slots are invisible: keep them
            longest = max(self._lengths)
            if self.width - longest > max(self.slack, longest // 8):
                self.compact()

    @torch.no_grad()
    def compact(self, repack: bool = True) -> None:
        """Reclaim cache slots: drop the slots no row uses and, with ``repack`` (default), move every
        row's valid slots to the front in order (width = the longest row's valid tokens). Visible
        tokens, their order and their positions are unchanged, so logits and features are too.

        Raises:
            SpeculatorsError: a request has a tree forward pending (its invisible slots would be lost).
        """
        if self._trees:
            raise SpeculatorsError(f"batch session compact: requests {list(self._trees)} have a tree forward "
                                   f"pending; call keep_tree first")
        if self.cache is None:
            return
        if repack:
            width = max(self._lengths)
            # the valid slots of each row first, in slot order (stable sort of "invalid" flags)
            order = torch.sort((~self.valid).to(torch.uint8), dim=1, stable=True).indices[:, :width]
            lengths = torch.tensor(self._lengths, device=self.valid.device)
            self.valid = torch.arange(width, device=self.valid.device).unsqueeze(0) < lengths.unsqueeze(1)
            for layer in self._check_layers(self.cache):  # keys and values may differ in width (MLA)
                layer.keys = _gather_slots(layer.keys, order)
                layer.values = _gather_slots(layer.values, order)
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


def _gather_slots(x: torch.Tensor, order: torch.Tensor) -> torch.Tensor:
    """``x [B, H, S, D]`` -> ``[B, H, W, D]``: row b's slots ``order[b]`` (``order [B, W]`` int64)."""
    B, Hk, _, D = x.shape
    return x.gather(2, order[:, None, :, None].expand(B, Hk, order.shape[1], D).to(x.device))
