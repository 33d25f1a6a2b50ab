"""Draft-tree verification forwards on the target's KV cache (EAGLE-2 / SpecInfer tree attention).

One target forward scores every node of a draft tree at once: node ``j`` of ``M`` new tokens sits at
position ``length + depth_j`` and attends to the request's visible context, its own ancestors and
itself, never to siblings or cousins (SpecInfer's topology-aware causal mask, EAGLE-2's tree mask, vLLM's
tree attention). The tree's KV slots stay invisible until ``keep_tree`` makes the accepted root-to-node
path visible; a path's slots increase with depth, so slot order is position order afterwards.

* :class:`BatchTreeMixin`: ``forward_tree`` / ``keep_tree`` of :class:`~.sessions.BatchDecodeSession`
  (a 4-D mask ``[B, 1, M, S + M]`` over the ragged batch cache);
* :class:`DecodeTreeMixin`: the same for the batch-1 :class:`~.sessions.DecodeSession` (``keep_tree``
  index-selects the kept slots out of the appended tail);

While a request has a tree forward pending, ``forward``, ``keep``, ``forward_tree`` for THAT request and
``compact`` are refused (SpeculatorsError); the automatic compaction waits; ``add`` of other requests,
forwards of other requests and ``remove`` (which drops the pending tree) stay allowed.
"""

from __future__ import annotations

import torch

from ..errors import SpeculatorsError
from .cache import _CACHE_KW, _TAKES_CACHE_POSITION
from .features import TargetFeatures
from .masks import as_attention_mask


def tree_structure(parents, m: int, what: str = "parents") -> tuple[list[int], list[int], torch.Tensor]:
    """Validate a tree's parent list and derive its depths and ancestor matrix.

    Args:
        parents: ``[m]`` integer parent indices, ``parents[j]`` in ``[-1, j - 1]`` (-1: the node attaches
            directly after the context; parents precede their children).
        m: the number of nodes (the length of the token list).
        what: the argument's name for error messages.
    Returns:
        ``(parents list[int], depths list[int], ancestors [m, m] bool)``: ``depth = 0`` for a -1 node,
        ``depth(parent) + 1`` otherwise; ``ancestors[j, k]`` is True when ``k`` is ``j`` or an ancestor
        of ``j`` (CPU tensor).
    Raises:
        SpeculatorsError: not a 1-D integer sequence of length ``m``, or a parent out of ``[-1, j - 1]``.
    """
    p = torch.as_tensor(parents)
    if p.dim() != 1 or p.numel() != m or (p.numel() and (p.is_floating_point() or p.dtype == torch.bool)):
        raise SpeculatorsError(f"tree forward: {what} must be a 1-D integer sequence of {m} parent indices, got "
                               f"{tuple(p.shape)} {p.dtype}")
    pl = [int(x) for x in p.tolist()]
    depth: list[int] = []
    anc = torch.eye(m, dtype=torch.bool)
    for j, q in enumerate(pl):
        if not -1 <= q < j:
            raise SpeculatorsError(f"tree forward: {what}[{j}] = {q} must be in [-1, {j - 1}] (-1 = after the "
                                   f"context; a parent precedes its children)")
        if q >= 0:
            anc[j] |= anc[q]
        depth.append(0 if q < 0 else depth[q] + 1)
    return pl, depth, anc


def check_path(nodes, parents: list[int], request) -> list[int]:
    """``nodes`` as a list of node indices forming a root-to-node path of the tree ``parents``
    (``nodes[0]`` has parent -1, each next node's parent is the previous node); ``[]`` is allowed.

    Raises:
        SpeculatorsError: naming ``nodes``: not integers, out of ``[0, len(parents))``, or not such a path.
    """
    try:
        seq = list(torch.as_tensor(nodes).reshape(-1).tolist()) if isinstance(nodes, torch.Tensor) else list(nodes)
    except TypeError:
        raise SpeculatorsError(f"keep_tree: nodes must be a list of node indices, got {nodes!r}") from None
    M = len(parents)
    out = []
    for k, x in enumerate(seq):
        if isinstance(x, bool) or not isinstance(x, int) or not 0 <= x < M:
            raise SpeculatorsError(f"keep_tree: nodes[{k}] = {x!r} of request {request!r} must be a node index in "
                                   f"[0, {M})")
        want = -1 if k == 0 else out[-1]
        if parents[x] != want:
            raise SpeculatorsError(f"keep_tree: nodes {seq} of request {request!r} is not a root-to-node path: the "
                                   f"parent of node {x} is {parents[x]}, not {want}")
        out.append(x)
    return out


class BatchTreeMixin:
    """Tree verification for :class:`~.sessions.BatchDecodeSession` (needs its ``_rows``, ``_lengths``,
    ``valid``, ``cache``, ``_run``, ``_ids``, ``_row``, ``_maybe_compact`` and a ``_trees`` dict)."""

    def _refuse_if_tree(self, request_id, what: str) -> None:
        if request_id in self._trees:
            raise SpeculatorsError(f"batch session {what}: request {request_id!r} has a tree forward pending; "
                                   f"call keep_tree(request_id, nodes) first (nodes=[] drops the tree)")

    def _tree_mask(self, M: int, ancestors: dict) -> torch.Tensor:
        """Boolean ``[B, 1, M, S + M]``: every query sees its row's valid cached slots and its own new
        slot (so padded queries and unlisted rows never see no key, no NaN); a listed row's node ``j``
        also sees its ancestors (``ancestors[row] [M_i, M_i]``)."""
        B, S = self.valid.shape
        dev = self.valid.device
        mask = torch.zeros(B, M, S + M, dtype=torch.bool, device=dev)
        mask[:, :, :S] = self.valid.unsqueeze(1)
        mask[:, :, S:] = torch.eye(M, dtype=torch.bool, device=dev)
        for row, anc in ancestors.items():
            mask[row, :anc.shape[0], S:S + anc.shape[0]] = anc.to(dev)
        return mask.unsqueeze(1)

    @torch.no_grad()
    def forward_tree(self, request_ids: list, ids_list: list,
                     parents_list: list) -> tuple[list[torch.Tensor], list[TargetFeatures]]:
        """ONE target forward over a draft TREE per listed request (SpecInfer / EAGLE-2 tree attention,
        as vLLM's tree verification): node ``j`` sits at position ``length + depth_j`` and attends to the
        request's visible tokens, its ancestors and itself (a 4-D mask ``[B, 1, M, S + M]``,
        ``M = max M_i``). The ``M`` appended slots stay invisible (the visible length does not grow)
        until :meth:`keep_tree`; rows not listed carry padding only.

        Args:
            request_ids: requests in the batch, each at most once, none with a tree pending.
            ids_list: per listed request, ``[M_i]`` int64 token ids (``M_i >= 1``); node 0 is normally
                the request's last emitted token (parent -1) and the drafts hang under it.
            parents_list: per listed request, ``[M_i]`` int64 parents, ``parents[j]`` in ``[-1, j - 1]``.
        Returns:
            per listed request, in order: ``logits [M_i, V]`` float32 and :class:`TargetFeatures`
            (``aux [1, M_i, n_aux * H]``, ``top [1, M_i, H]`` in the model's dtype), node order, as
            :meth:`forward` returns them.
        Raises:
            SpeculatorsError: unknown, repeated or tree-pending requests, lists of different lengths,
                bad token ids, an empty tree, bad ``parents``, or an attention implementation that takes
                no 4-D mask.
        """
        if not len(request_ids) == len(ids_list) == len(parents_list):
            raise SpeculatorsError(f"batch session forward_tree: {len(request_ids)} request ids, {len(ids_list)} "
                                   f"token lists and {len(parents_list)} parent lists")
        rows = [self._row(r) for r in request_ids]
        if len(set(rows)) != len(rows):
            raise SpeculatorsError(f"batch session forward_tree: a request is listed twice in {list(request_ids)}")
        trees = {}
        for r, row, x, p in zip(request_ids, rows, ids_list, parents_list):
            self._refuse_if_tree(r, "forward_tree")
            t = self._ids(x, f"tree tokens of request {r!r}")
            if t.numel() == 0:
                raise SpeculatorsError(f"batch session forward_tree: the tree of request {r!r} is empty")
            trees[row] = (t, *tree_structure(p, t.numel(), f"parents of request {r!r}"))
        if not rows:
            return [], []
        self._maybe_compact()
        B, S = self.valid.shape
        m = [0] * B
        for row, (t, _, _, _) in trees.items():
            m[row] = int(t.numel())
        M = max(m)
        dev = self.target.device
        inp = torch.zeros(B, M, dtype=torch.int64)
        depth = torch.zeros(B, M, dtype=torch.int64)
        for row, (t, _, d, _) in trees.items():
            inp[row, :m[row]] = t
            depth[row, :m[row]] = torch.tensor(d)
        pos = torch.tensor(self._lengths).unsqueeze(1) + depth
        mask = self._tree_mask(M, {row: anc for row, (_, _, _, anc) in trees.items()})
        attn = None if self.target.attention.windowed else as_attention_mask(self.target.model, mask, self.target.dtype)
        top, aux = self._run(inp.to(dev), self.cache, pos.to(dev), attention_mask=attn, start_slot=S,
                             visible=mask[:, 0], old_valid=self.valid)
        self.valid = torch.cat([self.valid, torch.zeros(B, M, dtype=torch.bool, device=self.valid.device)], dim=1)
        for r, row in zip(request_ids, rows):
            self._trees[r] = (S, trees[row][1])
        real = torch.arange(M).unsqueeze(0) < torch.tensor(m).unsqueeze(1)  # [B, M]
        logits_rows = self.target.lm_head(top[real.to(top.device)]).float().split(m)
        logits = [logits_rows[row] for row in rows]
        feats = [TargetFeatures(aux[row:row + 1, :m[row]], top[row:row + 1, :m[row]]) for row in rows]
        return logits, feats

    def keep_tree(self, request_id, nodes: list) -> None:
        """After :meth:`forward_tree`, make visible exactly the slots of ``nodes`` (the accepted
        root-to-node path, in depth order) and nothing else of that tree; ``length += len(nodes)``.
        ``nodes=[]`` drops the tree. The kept slots follow every visible slot of the row and increase
        with depth, so slot order is position order (:meth:`compact` keeps them in order).

        Args:
            request_id: a request in the batch with a tree forward pending.
            nodes: node indices of its last tree forward; ``nodes[0]`` has parent -1 and each next
                node's parent is the previous node.
        Raises:
            SpeculatorsError: the request is not in the batch or has no tree forward pending, or
                ``nodes`` is not such a path (the tree then stays pending).
        """
        row = self._row(request_id)
        if request_id not in self._trees:
            raise SpeculatorsError(f"batch session keep_tree: request {request_id!r} has no tree forward pending "
                                   f"(nodes={nodes!r})")
        start, parents = self._trees[request_id]
        path = check_path(nodes, parents, request_id)
        if path:
            idx = torch.tensor(path, device=self.valid.device) + start
            self.valid[row, idx] = True
            self._lengths[row] += len(path)
        del self._trees[request_id]


class DecodeTreeMixin:
    """Tree verification for the batch-1 :class:`~.sessions.DecodeSession` (needs ``target``, ``cache``,
    ``length`` and a ``_tree`` attribute): the tree's K/V is appended after the ``length`` cached slots
    and :meth:`keep_tree` index-selects the kept path's slots back onto the context."""

    def _refuse_if_tree(self, what: str) -> None:
        if self._tree is not None:
            raise SpeculatorsError(f"decode session {what}: a tree forward is pending; call keep_tree(nodes) "
                                   f"first (nodes=[] drops the tree)")

    def _plain_layers(self) -> list:
        from transformers.cache_utils import DynamicLayer

        layers = getattr(self.cache, "layers", None)
        if layers is None or any(type(layer) is not DynamicLayer for layer in layers):
            kinds = sorted({type(layer).__name__ for layer in layers or []}) or [type(self.cache).__name__]
            raise SpeculatorsError(f"tree verification: {type(self.target.model).__name__} uses KV-cache layers "
                                   f"{kinds}; a tree forward needs plain full-attention DynamicLayer caches")
        return list(layers)

    @torch.no_grad()
    def forward_tree(self, ids, parents) -> tuple[torch.Tensor, TargetFeatures]:
        """ONE target forward over a draft tree after the cached context (SpecInfer / EAGLE-2 tree
        attention): node ``j`` at position ``length + depth_j`` sees the context, its ancestors and
        itself (4-D mask ``[1, 1, M, length + M]``). ``length`` does not grow until :meth:`keep_tree`.

        Args:
            ids: ``[M]`` int64 token ids (``M >= 1``).
            parents: ``[M]`` int64, ``parents[j]`` in ``[-1, j - 1]``.
        Returns:
            ``logits [M, V]`` float32 and TargetFeatures (``aux [1, M, n_aux * H]``, ``top [1, M, H]``).
        Raises:
            SpeculatorsError: a tree already pending, bad ``ids`` / ``parents``, a cache that is not
                plain full attention, or an attention implementation that takes no 4-D mask.
        """
        self._refuse_if_tree("forward_tree")
        self._plain_layers()
        ids = torch.as_tensor(ids)
        if ids.dim() > 1:
            ids = ids.reshape(-1)
        if ids.dim() != 1 or ids.numel() == 0 or ids.is_floating_point() or ids.dtype == torch.bool:
            raise SpeculatorsError(f"decode session forward_tree: ids must be a non-empty 1-D sequence of token "
                                   f"ids, got {tuple(ids.shape)} {ids.dtype}")
        M, L = int(ids.numel()), self.length
        plist, depth, anc = tree_structure(parents, M)
        dev = self.target.device
        mask = torch.ones(1, 1, M, L + M, dtype=torch.bool, device=dev)
        mask[0, 0, :, L:] = anc.to(dev)
        kw = {_CACHE_KW: self.cache}
        if _TAKES_CACHE_POSITION:
            kw["cache_position"] = torch.arange(L, L + M, device=dev)
        pos = (torch.tensor(depth) + L).unsqueeze(0).to(dev)
        if self.target.attention.windowed:  # the context's slots are its positions
            k_pos = torch.cat([torch.arange(L, device=dev).unsqueeze(0), pos], dim=1)
            attn = self.target.attention.mask(mask[:, 0], pos, k_pos, self.target.dtype)
        else:
            attn = as_attention_mask(self.target.model, mask, self.target.dtype)
        with self.target.tap_layers() as taps:
            out = self.target.decoder(input_ids=ids.to(torch.int64).reshape(1, -1).to(dev), use_cache=True,
                                      attention_mask=attn, position_ids=pos, **kw)
        self._tree = plist
        top = out.last_hidden_state.to(dev)
        return self.target.lm_head(top)[0].float(), TargetFeatures(taps.aux(), top)

    def keep_tree(self, nodes: list) -> None:
        """Keep the context plus the slots of ``nodes`` (a root-to-node path of the pending tree, see
        :meth:`BatchTreeMixin.keep_tree`; ``[]`` drops the tree); ``length += len(nodes)``.

        Raises:
            SpeculatorsError: no tree forward pending, or ``nodes`` not such a path (the tree stays pending).
        """
        if self._tree is None:
            raise SpeculatorsError(f"decode session keep_tree: no tree forward is pending (nodes={nodes!r})")
        path = check_path(nodes, self._tree, "of the session")
        L = self.length
        for layer in self._plain_layers():
            idx = torch.cat([torch.arange(L), torch.tensor(path, dtype=torch.int64) + L]).to(layer.keys.device)
            layer.keys = layer.keys.index_select(2, idx)
            layer.values = layer.values.index_select(2, idx)
        self.length += len(path)
        self._tree = None
