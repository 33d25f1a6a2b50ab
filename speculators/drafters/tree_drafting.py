"""Draft trees from an autoregressive drafter: EAGLE-2's dynamic expansion and vLLM's static trees.

The expansion is the same for every autoregressive family (EAGLE-1, EAGLE-3, MTP); a family gives
:func:`expand_tree` only its root logits and ONE callable that runs its decoder over a level of
nodes. Everything about choosing nodes lives here:

* **dynamic** (EAGLE-2, Li et al. arXiv 2406.16858, Algorithm "expansion + reranking"): the root's
  ``topk`` best children are depth 1 and the first frontier; at each next level the frontier (the
  ``topk`` nodes of the previous level with the best cumulative log-probability, the sum of the drafter's
  log-softmax along the path) is run through the drafter in ONE batched forward and each frontier node
  gets its ``topk`` best children (``topk**2`` candidates per level). After ``depth`` levels the
  ``total_tokens`` best candidates of all levels are kept (stable order: on equal scores the earlier level
  wins, and a child never scores above its parent, so the kept set is a tree);
* **static** (vLLM's ``speculative_token_tree``): node ``(r_1, .., r_d)`` is the ``r_d``-th best child of
  node ``(r_1, .., r_{d-1})``; a level forwards exactly the nodes that have children in the tree.

Children are the drafter's top-k tokens, a deterministic choice: the tree carries no draft
distributions (``DraftTree.probs = None``) and the verifier treats each child as a point mass
(:func:`speculators.verify.tree.tree_rejection_sample`), which is lossless at every temperature.

The decoder callable sees, per level, the tokens to run, each one's parent among the nodes run before
(-1: the root, i.e. the request's newest verified token, whose output the drafter already holds) and
a visibility matrix over all nodes run so far (ancestors and itself), so it can build the tree mask
over its own KV cache (the ancestors' keys only, never a sibling's).
"""

from __future__ import annotations

from typing import Callable

import torch

from ..losses import draft_to_target
from ..decode.tree_spec import TreeSpec
from ..verify.tree import DraftTree

# forward(tokens [R, F] int64 TARGET ids, parents [R, F] int64 (index into the nodes run before, -1 = the
# root), visible [R, F, n_run + F] bool (ancestors-or-self among all nodes run so far, this level last),
# depth (int, the depth of this level's nodes: 1 for the root's children)) -> logits [R, F, N] (draft vocab)
LevelForward = Callable[[torch.Tensor, torch.Tensor, torch.Tensor, int], torch.Tensor]


def _topk(logp: torch.Tensor, k: int) -> tuple[torch.Tensor, torch.Tensor]:
    """``[..., N]`` log-probabilities -> the ``k`` best ``(values, indices)`` (descending; k clipped to N)."""
    return torch.topk(logp, min(k, logp.shape[-1]), dim=-1, sorted=True)


class _Nodes:
    """The candidate nodes of R requests' trees, grown level by level (same count per request)."""

    def __init__(self, R: int):
        self.R = R
        self.draft_ids: list[torch.Tensor] = []   # per level [R, c] draft-vocab ids
        self.parents: list[torch.Tensor] = []     # per level [R, c] index into ALL candidates, -1 = root
        self.scores: list[torch.Tensor] = []      # per level [R, c] cumulative log-probability
        self.depth: list[int] = []                # per added group, its nodes' depth
        self.count = 0

    def add(self, draft_ids: torch.Tensor, parents: torch.Tensor, scores: torch.Tensor, depth: int) -> torch.Tensor:
        """Append ``c`` nodes of depth ``depth``; returns their global indices ``[c]``."""
        c = draft_ids.shape[1]
        self.depth.append(depth)
        self.draft_ids.append(draft_ids)
        self.parents.append(parents)
        self.scores.append(scores)
        idx = torch.arange(self.count, self.count + c)
        self.count += c
        return idx

    def flat(self) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
        """``(draft_ids, parents, scores, depth)``, each ``[R, count]`` in creation (level) order."""
        depth = torch.cat([torch.full((self.R, d.shape[1]), dep, dtype=torch.int64)
                           for dep, d in zip(self.depth, self.draft_ids)], dim=1)
        return torch.cat(self.draft_ids, 1), torch.cat(self.parents, 1), torch.cat(self.scores, 1), depth


class _Run:
    """The nodes run through the drafter so far: their global candidate index and parent run-index."""

    def __init__(self, R: int):
        self.R = R
        self.node: list[torch.Tensor] = []  # per level [R, F] global candidate index of each run node
        self.run_parent = torch.empty(R, 0, dtype=torch.int64)  # [R, n_run] parent's run index, -1 = root

    @property
    def n(self) -> int:
        return int(self.run_parent.shape[1])

    def visible(self, parents: torch.Tensor) -> torch.Tensor:
        """``[R, F, n + F]`` ancestors-or-self of F new run nodes whose parents (run indices) are ``parents``."""
        R, F = parents.shape
        n = self.n
        vis = torch.zeros(R, F, n + F, dtype=torch.bool)
        vis[:, :, n:] = torch.eye(F, dtype=torch.bool)
        cur = parents.clone()
        for _ in range(n):  # walk up at most n ancestors
            ok = cur >= 0
            if not bool(ok.any()):
                break
            r, f = ok.nonzero(as_tuple=True)
            vis[r, f, cur[r, f]] = True
            nxt = torch.full_like(cur, -1)
            nxt[r, f] = self.run_parent[r, cur[r, f]]
            cur = nxt
        return vis

    def add(self, nodes: torch.Tensor, parents: torch.Tensor) -> None:
        self.node.append(nodes)
        self.run_parent = torch.cat([self.run_parent, parents], dim=1)

    def run_index_of(self, global_idx: torch.Tensor) -> torch.Tensor:
        """``[R, c]`` global candidate indices -> their run indices (-1 when not run)."""
        if not self.node:
            return torch.full_like(global_idx, -1)
        allnodes = torch.cat(self.node, 1)
        hit = allnodes.unsqueeze(1) == global_idx.unsqueeze(2)  # [R, c, n_run]
        return torch.where(hit.any(-1), hit.float().argmax(-1), torch.full_like(global_idx, -1))


def tree_extra_slots(spec: TreeSpec, depth_caps: list[int]) -> int:
    """Appended KV slots a level-by-level expansion needs for all the nodes it runs through the drafter:
    a static tree's node count, or ``topk`` per level but the deepest (0 when no level runs)."""
    runs = max(0, min(spec.depth, max((int(c) for c in depth_caps), default=0)) - 1)
    if runs == 0:
        return 0
    return spec.total_tokens if spec.is_static else runs * spec.topk


def level_inputs(root: torch.Tensor, outs: list[torch.Tensor], parents: torch.Tensor) -> torch.Tensor:
    """The hidden input of each node of a level: its parent's output (``outs[parent]``, ``[R, H]`` each, in
    run order) or, for the root's children (parent -1), the request's own ``root [R, 1, H]``.
    Returns ``[R, F, H]`` for ``parents [R, F]`` (on ``root``'s device)."""
    R, F = parents.shape
    par = parents.to(root.device)
    x = root.expand(R, F, -1).clone()
    if outs:
        done = torch.stack(outs, 1)  # [R, n_run, H]
        hit = par >= 0
        x[hit] = done[hit.nonzero(as_tuple=True)[0], par[hit]]
    return x


def level_mask(kv, visible: torch.Tensor) -> torch.Tensor:
    """The tree mask of a level over a padded :class:`~.layers.RaggedKV`: ``[R, 1, F, base + n_run + F]`` bool
    (True = attend): each node sees its request's own cached keys and, in the appended region, exactly the
    nodes ``visible [R, F, n_run + F]`` marks (its ancestors and itself)."""
    R, F, width = visible.shape
    dev = kv.lengths.device
    S = kv.base + width
    own = (torch.arange(S, device=dev)[None, :] < kv.lengths[:, None])[:, None, :].expand(R, F, S).clone()
    own[:, :, kv.base:] = visible.to(dev)
    return own.unsqueeze(1)


def expand_tree(root_logits: torch.Tensor, forward: LevelForward, spec: TreeSpec, d2t: torch.Tensor | None,
                depth_caps: list[int]) -> list[DraftTree]:
    """Draft trees for R requests from an autoregressive drafter (EAGLE-2 dynamic or vLLM static).

    Args:
        root_logits: ``[R, N]`` float drafter logits at each request's newest verified token (draft vocab).
        forward: the family's level forward (see :data:`LevelForward`); called ``depth - 1`` times at most.
        spec: the :class:`~speculators.decode.tree_spec.TreeSpec`.
        d2t: ``[N]`` int64 draft->target offsets (None: full vocabulary).
        depth_caps: per request, the deepest level it may keep (``max_new_tokens`` left; 0 = no tree).
    Returns:
        R :class:`~speculators.verify.tree.DraftTree` (CPU int64 target ids, parents in ``[-1, i)``, nodes in
        level order, ``probs`` None): the ``total_tokens`` best nodes (dynamic) or the static tree's nodes,
        without the nodes deeper than the request's cap.
    """
    R = root_logits.shape[0]
    depth = min(spec.depth, max(depth_caps, default=0))
    if R == 0 or depth == 0:
        return [_empty_tree() for _ in range(R)]
    nodes, run = _Nodes(R), _Run(R)
    logp = torch.log_softmax(root_logits.float(), -1).cpu()
    if spec.is_static:
        _static_levels(spec, logp, forward, d2t, nodes, run, depth)
        keep = torch.arange(nodes.count).expand(R, -1)
    else:
        _dynamic_levels(spec, logp, forward, d2t, nodes, run, depth)
        keep = _rerank(nodes, spec.total_tokens)
    return _trees(nodes, keep, d2t, depth_caps)


def _empty_tree() -> DraftTree:
    return DraftTree(torch.empty(0, dtype=torch.int64), torch.empty(0, dtype=torch.int64))


def _target_ids(draft_ids: torch.Tensor, d2t: torch.Tensor | None) -> torch.Tensor:
    return draft_to_target(draft_ids.reshape(-1), None if d2t is None else d2t.cpu()).reshape(draft_ids.shape)


def _forward_level(forward: LevelForward, run: _Run, nodes_idx: torch.Tensor, parents_global: torch.Tensor,
                   tokens: torch.Tensor, d2t, level_depth: int) -> torch.Tensor:
    """Run ``nodes_idx [R, F]`` (global) through the drafter; returns their children's log-probs ``[R, F, N]``."""
    parents_run = run.run_index_of(parents_global)
    vis = run.visible(parents_run)
    logits = forward(_target_ids(tokens, d2t), parents_run, vis, level_depth)
    run.add(nodes_idx, parents_run)
    return torch.log_softmax(logits.float(), -1).cpu()


def _dynamic_levels(spec: TreeSpec, logp0: torch.Tensor, forward: LevelForward, d2t, nodes: _Nodes, run: _Run,
                    depth: int) -> None:
    R = logp0.shape[0]
    val, ids = _topk(logp0, spec.topk)
    front = nodes.add(ids, torch.full_like(ids, -1), val, 1).expand(R, -1)  # [R, F] global indices
    front_ids, front_par, front_score = ids, torch.full_like(ids, -1), val
    for d in range(2, depth + 1):
        logp = _forward_level(forward, run, front, front_par, front_ids, d2t, d - 1)  # [R, F, N]
        cv, ci = _topk(logp, spec.topk)  # [R, F, k]
        F, k = cv.shape[1], cv.shape[2]
        score = (front_score.unsqueeze(-1) + cv).reshape(R, F * k)
        par = front.unsqueeze(-1).expand(R, F, k).reshape(R, F * k)
        child = nodes.add(ci.reshape(R, F * k), par, score, d)  # [F*k]
        best = torch.topk(score, min(spec.topk, F * k), dim=-1, sorted=True).indices  # next frontier
        front = child[best]
        front_ids, front_par, front_score = ci.reshape(R, F * k).gather(1, best), par.gather(1, best), \
            score.gather(1, best)


def _static_levels(spec: TreeSpec, logp0: torch.Tensor, forward: LevelForward, d2t, nodes: _Nodes, run: _Run,
                   depth: int) -> None:
    R = logp0.shape[0]
    paths = [p for p in spec.paths if len(p) <= depth]
    index = {}  # path -> global index
    level_logp = {(): logp0.unsqueeze(1)}  # parent path -> [R, 1, N]
    for d in range(1, depth + 1):
        level = [p for p in paths if len(p) == d]
        if d > 1:  # run this level's parents (the nodes of depth d-1 that have children)
            pars = sorted({p[:-1] for p in level}, key=lambda q: index[q])
            if not pars:
                break
            gidx = torch.tensor([index[q] for q in pars]).expand(R, -1)
            flat_ids, flat_par, _, _ = nodes.flat()
            lp = _forward_level(forward, run, gidx, flat_par.gather(1, gidx), flat_ids.gather(1, gidx), d2t, d - 1)
            level_logp = {q: lp[:, j:j + 1] for j, q in enumerate(pars)}
        for p in level:
            lp = level_logp[p[:-1]][:, 0]  # [R, N]
            val, ids = _topk(lp, p[-1] + 1)
            parent = torch.full((R, 1), index[p[:-1]] if d > 1 else -1, dtype=torch.int64)
            index[p] = int(nodes.add(ids[:, -1:], parent, val[:, -1:], d)[0])


def _rerank(nodes: _Nodes, total: int) -> torch.Tensor:
    """``[R, <= total]`` global indices of the best candidates by cumulative log-probability, stable (an
    earlier-created node wins a tie, so no child is kept without its parent)."""
    _, _, scores, _ = nodes.flat()
    order = torch.sort(-scores, dim=1, stable=True).indices
    return order[:, :min(total, scores.shape[1])]


def _trees(nodes: _Nodes, keep: torch.Tensor, d2t, depth_caps: list[int]) -> list[DraftTree]:
    """The kept nodes of each request as a DraftTree in creation order (parents before children)."""
    ids, parents, _, depth = nodes.flat()
    tgt = _target_ids(ids, d2t)
    out = []
    for r in range(ids.shape[0]):
        kept = sorted(int(i) for i in keep[r] if int(depth[r, i]) <= depth_caps[r])
        where = {g: j for j, g in enumerate(kept)}
        par = []
        for g in kept:
            pg = int(parents[r, g])
            if pg >= 0 and pg not in where:  # cannot happen with a stable rerank; a cut tree must stay a tree
                raise AssertionError("draft tree: a kept node lost its parent")
            par.append(-1 if pg < 0 else where[pg])
        out.append(DraftTree(tgt[r, kept].to(torch.int64).clone(), torch.tensor(par, dtype=torch.int64)))
    return out


# child_logits(depth (int, the children's depth, >= 2), parent_tokens [R, F] int64 TARGET ids) -> [R, F, N] logits
ChildLogits = Callable[[int, torch.Tensor], torch.Tensor]


def slot_tree(slot_logits: torch.Tensor, spec: TreeSpec, d2t: torch.Tensor | None, depth_caps: list[int],
              child_logits: ChildLogits | None = None) -> list[DraftTree]:
    """Draft trees for R requests from a PARALLEL drafter's D per-slot distributions (Medusa trees, Cai et
    al. arXiv 2401.10774; P-EAGLE's parallel depths; DFlash's block).

    Slot ``d`` (0-based) drafts depth ``d + 1``; its distribution does not depend on the earlier drafts, so
    a node at depth ``d + 1`` takes one of slot ``d``'s top-k tokens whatever its parent is, and a node's
    score is the sum of the per-slot log-softmax along its path. The node choice is :func:`expand_tree`'s
    (dynamic: EAGLE-2's frontier of ``topk`` per level, ``topk`` children each, the ``total_tokens`` best
    of all levels kept by the same stable rerank; static: node ``(r_1..r_d)`` = slot d's rank-``r_d``
    token), with a "level forward" that only looks the slot up: no drafter forward runs here, every slot
    comes from the family's one parallel forward.

    Args:
        slot_logits: ``[R, D, N]`` float draft-vocabulary logits, slot ``d`` = depth ``d + 1``.
        spec: the :class:`~speculators.decode.tree_spec.TreeSpec`; levels deeper than ``D`` are not drafted.
        d2t: ``[N]`` int64 draft->target offsets (None: full vocabulary).
        depth_caps: per request the deepest level kept (0 = an empty tree); clipped to ``D``.
        child_logits: optional, for a drafter whose slot distribution depends on the PREVIOUS token
            (DSpark's Markov head): ``(depth, parent_tokens [R, F] int64 target ids) -> [R, F, N]`` logits of
            the children at ``depth >= 2`` of each frontier node; depth 1 still reads ``slot_logits[:, 0]``
            (the caller conditions it on the request's newest token).
    Returns:
        R :class:`~speculators.verify.tree.DraftTree` as :func:`expand_tree` returns them (``probs`` None).
    Raises:
        ValueError: ``slot_logits`` not 3-D, or ``depth_caps`` not one entry per request.
    """
    if slot_logits.dim() != 3:
        raise ValueError(f"slot_tree: slot_logits must be [R, D, N], got shape {tuple(slot_logits.shape)}")
    R, D, _ = slot_logits.shape
    if len(depth_caps) != R:
        raise ValueError(f"slot_tree: {len(depth_caps)} depth caps for {R} requests")
    caps = [max(0, min(int(c), D)) for c in depth_caps]

    def forward(tokens: torch.Tensor, parents: torch.Tensor, visible: torch.Tensor, depth: int) -> torch.Tensor:
        if child_logits is not None:
            return child_logits(depth + 1, tokens)
        return slot_logits[:, depth].unsqueeze(1).expand(-1, tokens.shape[1], -1)

    return expand_tree(slot_logits[:, 0] if D else slot_logits.new_zeros(R, 1), forward, spec, d2t, caps)
