"""Lossless verification of a DRAFT TREE: greedy walk and multi-candidate recursive rejection sampling.

A draft tree holds ``N`` nodes after the request's last emitted token (the *root*, which is not a
node). Node ``i`` has a token, a parent (``-1`` = a child of the root; a parent always has a smaller
index than its children) and, for sampled drafts, the draft distribution it was drawn from. The
target model scores all nodes in one forward (tree attention: node ``i`` attends to the context and
to its ancestors); its logits at the root and at every node decide, walking down from the root, which
children are accepted. Papers: SpecInfer (Miao et al., arXiv 2305.09781, multi-step speculative
sampling), EAGLE-2 (Li et al., arXiv 2406.16858, dynamic draft trees); siblings drawn without
replacement: Jeon et al., arXiv 2402.14160 (recursive speculative decoding). Static tree shapes use
vLLM's ``speculative_token_tree`` syntax (:func:`parse_token_tree`).

Public API::

    parse_token_tree(spec, *, sort=True) -> tuple of paths     # vLLM's speculative_token_tree
    tree_from_paths(paths) -> (parents [N] int64, ranks [N] int64)
    tree_depths(parents) -> [N] int64;  ancestor_mask(parents) -> [N, N] bool
    DraftTree, TreeVerifyOutput, tree_rejection_sample(trees, target_logits, sampling, generator)

The walk (per request; ``p`` = the target distribution at the current node ``u``, root ``u = -1``):

* greedy (temperature 0): ``a = first_argmax`` of the float32 target logits row (the chain verifier's
  rule); accept the first child (index order) whose token is ``a`` and continue from it; if there is
  none, emit ``a`` (recovered token, or bonus token when ``u`` has no children) and stop. The output is
  exactly plain greedy decoding of the target.
* sampled: ``p = apply_sampling(row)`` (temperature / top-k / top-p, vLLM semantics). Try the children
  ``c_1..c_m`` in index order with one uniform ``u_j`` each: accept ``c_j`` (token ``x_j``) when
  ``u_j * q_j(x_j) < p(x_j)``, i.e. with probability ``min(1, p(x_j) / q_j(x_j))``, where ``q_j`` is the
  distribution ``c_j`` was drawn from (``probs[c_j]``; ``probs=None``: a point mass on ``x_j``). On
  rejection ``p <- normalise(max(p - q_j, 0))`` (point mass: ``p[x_j] = 0``, renormalise) and the next
  sibling is tried against the updated ``p``. Accepted: continue from ``c_j`` with its own target row.
  All rejected (or no children): emit one token drawn from the final ``p``. Every emitted token then
  has exactly the target's distribution given the tokens before it (lossless): each accept / residual
  stage is the speculative-sampling lemma (Leviathan et al. arXiv 2211.17192) applied to the current
  ``p``, and it holds for any ``q_j``, including a sibling drawn without replacement whose ``q_j`` is
  the draft distribution with the earlier siblings removed and renormalised - a drafter must record,
  per child, the ``q`` that child was actually drawn from.
* residual that vanishes numerically: if ``max(p - q_j, 0)`` sums to 0 in float32 (the rejection had
  probability 0 up to rounding: ``p <= q_j`` everywhere means ``p(x_j) >= q_j(x_j)``), ``p`` is kept
  unchanged instead of dividing by 0. This only affects events of probability ~1e-7 or less.

A chain of ``K`` drafts is the tree with ``parents = [-1, 0, 1, ..., K - 2]``: the walk is then
:func:`~speculators.verify.rejection_sample`'s rule, token for token in greedy mode and in distribution
when sampling (the two consume their random numbers differently, see below).

Random numbers (sampled requests only; greedy ones draw none): request ``i`` draws from
``sampling.generators[i]`` if set, else from the ``generator`` argument, else from torch's global RNG
(on the logits' device), in walk order: one float32 uniform per child test, then one float64 uniform
for its final (recovered or bonus) token, which is drawn by the chain verifier's two-level inverse CDF
(:mod:`speculators.verify.rejection`). So a request with its own generator gives the same tokens
whatever else is in the batch.

Compute dtype float32 (float64 logits are rounded once); not differentiable (inputs detached). The
walk is a host loop over requests and tree levels (trees are small); the target side
(logits -> probabilities) is one vectorised :func:`apply_sampling` over all rows of the batch.
"""

from __future__ import annotations

import ast
from collections.abc import Sequence
from dataclasses import dataclass

import torch
from torch import Tensor

from ..errors import SpeculatorsError
from .layout import COMPUTE_DTYPE, VerifyInputError
from .rejection import _sample_row
from .sampling import SamplingParams, _shape, apply_sampling, effective_temperature, first_argmax

__all__ = [
    "DraftTree",
    "TreeVerifyOutput",
    "ancestor_mask",
    "parse_token_tree",
    "tree_depths",
    "tree_from_paths",
    "tree_rejection_sample",
]

_FIELD = "speculative_token_tree"


# --------------------------------------------------------------------------------------------------
# Tree shapes
# --------------------------------------------------------------------------------------------------


def parse_token_tree(spec: str | Sequence[Sequence[int]], *, sort: bool = True) -> tuple[tuple[int, ...], ...]:
    """Parse vLLM's ``speculative_token_tree``: a list of paths of child ranks.

    ``[(0,), (1,), (0, 0), (0, 1), (1, 0)]`` = the top-2 children of the root, then the top-2 after the
    first and the top-1 after the second. Path ``(r_1, ..., r_d)`` is the node at depth ``d`` reached by
    taking the rank-``r_1`` child of the root, then its rank-``r_2`` child, ... (rank 0 = the drafter's
    most likely token).

    What vLLM does (``vllm/config/speculative.py``, ``SpeculativeConfig``): ``ast.literal_eval`` of the
    string, then ``sorted(paths, key=lambda t: (len(t), t))`` - breadth-first, lexicographic within a
    depth - and that sorted order is the node order of the drafter and of the tree-attention metadata;
    it checks neither ranks nor parents. Its EAGLE drafter (``vllm/v1/spec_decode/eagle.py``,
    ``propose_tree``) derives ONE child count per level (nodes at depth ``d`` // nodes at depth
    ``d - 1``), so only trees with the same number of children for every node of a level are drafted
    as written there. This verifier accepts any tree.

    Args:
        spec: a Python-literal string (parsed with ``ast.literal_eval``, never ``eval``) or a list /
            tuple of sequences of ints.
        sort: ``True`` (vLLM's rule): return the paths sorted by ``(len(path), path)``; ``False``: keep
            the given order, which must list every parent before its children.

    Returns:
        tuple of paths (tuples of ints); node ``i`` of the tree is path ``i``. Any ranks ``>= 0`` are
        allowed, gaps included (``[(0,), (2,)]``): a rank only says which of the drafter's candidates
        a node is, the verifier tries siblings in node-index order.

    Raises:
        SpeculatorsError, naming ``speculative_token_tree`` and the offending path: not a literal,
        not a non-empty list of non-empty tuples of ints ``>= 0``, a duplicate path, a path whose
        parent (``path[:-1]``) is missing, or (``sort=False``) listed after it.
    """
    if isinstance(spec, str):
        try:
            spec = ast.literal_eval(spec.strip())
        except (ValueError, SyntaxError, TypeError, MemoryError, RecursionError) as e:
            raise SpeculatorsError(
                f"{_FIELD}: expected a Python literal list of tuples of ints such as "
                f"'[(0,), (1,), (0, 0)]', got {spec!r} ({type(e).__name__})"
            ) from None
    if not isinstance(spec, (list, tuple)) or not spec:
        raise SpeculatorsError(f"{_FIELD}: expected a non-empty list of paths (tuples of ints), got {spec!r}")
    paths = [_as_path(p) for p in spec]
    if sort:
        paths.sort(key=lambda t: (len(t), t))
    seen: set[tuple[int, ...]] = set()
    for path in paths:
        if path in seen:
            raise SpeculatorsError(f"{_FIELD}: duplicate path {path}")
        if len(path) > 1 and path[:-1] not in seen:
            where = "is missing" if path[:-1] not in paths else "must be listed before it"
            raise SpeculatorsError(f"{_FIELD}: the parent {path[:-1]} of path {path} {where}")
        seen.add(path)
    return tuple(paths)


def _as_path(p: object) -> tuple[int, ...]:
    if not isinstance(p, (list, tuple)) or not p:
        raise SpeculatorsError(f"{_FIELD}: each path must be a non-empty tuple of ints, got {p!r}")
    for r in p:
        if isinstance(r, bool) or not isinstance(r, int) or r < 0:
            raise SpeculatorsError(f"{_FIELD}: path {tuple(p)!r}: ranks must be ints >= 0, got {r!r}")
    return tuple(p)


def tree_from_paths(paths: Sequence[Sequence[int]]) -> tuple[Tensor, Tensor]:
    """Parents and ranks of the tree whose node ``i`` is ``paths[i]`` (e.g. from :func:`parse_token_tree`).

    Returns:
        ``(parents [N] int64, ranks [N] int64)``: ``parents[i]`` = index of ``paths[i][:-1]`` or ``-1``
        for depth-1 nodes (children of the root); ``ranks[i] = paths[i][-1]``.

    Raises:
        SpeculatorsError: the paths fail :func:`parse_token_tree`'s checks (order kept, ``sort=False``).
    """
    paths = parse_token_tree(paths, sort=False)
    index = {p: i for i, p in enumerate(paths)}
    parents = [index[p[:-1]] if len(p) > 1 else -1 for p in paths]
    ranks = [p[-1] for p in paths]
    return torch.tensor(parents, dtype=torch.int64), torch.tensor(ranks, dtype=torch.int64)


def _check_parents(parents: object, name: str = "parents") -> list[int]:
    """``parents`` as a list after checking it: a 1-D integer tensor with ``parents[i]`` in ``[-1, i - 1]``."""
    if not isinstance(parents, Tensor) or parents.dim() != 1 or parents.is_floating_point() or parents.is_complex():
        raise VerifyInputError(f"{name}: expected a 1-D integer tensor [N], got {_shape(parents)}")
    values = parents.tolist()
    for i, v in enumerate(values):
        if not -1 <= v < i:
            raise VerifyInputError(
                f"{name}: node {i} has parent {v}; a parent must precede its child (-1 <= parent < {i}; "
                f"-1 = child of the root)"
            )
    return values


def tree_depths(parents: Tensor) -> Tensor:
    """``[N]`` int64 depth of each node (children of the root: 1), from ``parents`` ``[N]`` int.

    Raises:
        VerifyInputError (a SpeculatorsError) naming ``parents``: not 1-D integer, or a parent that does
            not precede its child.
    """
    values = _check_parents(parents)
    depth: list[int] = []
    for v in values:
        depth.append(1 if v < 0 else depth[v] + 1)
    return torch.tensor(depth, dtype=torch.int64, device=parents.device)


def ancestor_mask(parents: Tensor) -> Tensor:
    """``[N, N]`` bool tree-attention mask: ``mask[i, j]`` is True iff ``j == i`` or ``j`` is an ancestor of ``i``.

    Row ``i`` is what node ``i`` attends to among the nodes (it also attends to the whole context).

    Raises:
        VerifyInputError (a SpeculatorsError) naming ``parents``, as :func:`tree_depths`.
    """
    values = _check_parents(parents)
    n = len(values)
    mask = torch.eye(n, dtype=torch.bool)
    for i, v in enumerate(values):
        if v >= 0:
            mask[i] |= mask[v]  # the parent's row is final: it precedes i
    return mask.to(parents.device)


def _children_lists(parents: list[int]) -> list[list[int]]:
    """``out[u + 1]`` = the children of node ``u`` (``u = -1``: the root) in index order."""
    out: list[list[int]] = [[] for _ in range(len(parents) + 1)]
    for i, v in enumerate(parents):
        out[v + 1].append(i)
    return out


# --------------------------------------------------------------------------------------------------
# Inputs and outputs
# --------------------------------------------------------------------------------------------------


@dataclass
class DraftTree:
    """One request's draft tree.

    Attributes:
        token_ids: ``[N]`` int64 target-vocabulary token ids of the nodes.
        parents: ``[N]`` int64; ``-1`` = child of the root (the root is the request's last emitted
            token, not a node); otherwise the index of the parent, which precedes the child.
        probs: ``[N, V]`` float32 or ``None``. Row ``i`` = the draft distribution node ``i`` was drawn
            from, already through :func:`~speculators.verify.apply_sampling` (for siblings drawn
            without replacement: the distribution with the earlier siblings removed, renormalised).
            ``None`` = deterministic children (top-k / n-gram drafters), treated as point masses.

    Siblings are tried in index order (for :func:`parse_token_tree` trees that is rank order).
    """

    token_ids: Tensor
    parents: Tensor
    probs: Tensor | None = None

    @property
    def num_nodes(self) -> int:
        return int(self.token_ids.shape[0])

    def depths(self) -> Tensor:
        """``[N]`` int64 node depths (children of the root: 1), see :func:`tree_depths`."""
        return tree_depths(self.parents)

    def children(self, u: int) -> list[int]:
        """Children of node ``u`` (``-1``: the root) in index order, i.e. the order the verifier tries them."""
        if not -1 <= u < self.num_nodes:
            raise VerifyInputError(f"u: expected a node index in [-1, {self.num_nodes}), got {u}")
        return [i for i, v in enumerate(self.parents.tolist()) if v == u]

    def validate(self, vocab_size: int, *, name: str = "tree") -> None:
        """Check shapes, dtypes and values; ``vocab_size`` = the target vocabulary ``V``.

        Raises:
            VerifyInputError (a SpeculatorsError and a ValueError) naming the field
            (``{name}.token_ids`` / ``.parents`` / ``.probs``): wrong shape or dtype, ids outside
            ``[0, V)``, a parent that does not precede its child, probs rows not summing to 1 within
            1e-3, negative or non-finite, or giving a node's own token probability 0.
        """
        ids = self.token_ids
        if not isinstance(ids, Tensor) or ids.dim() != 1 or ids.is_floating_point() or ids.is_complex():
            raise VerifyInputError(f"{name}.token_ids: expected a 1-D integer tensor [N], got {_shape(ids)}")
        n = ids.shape[0]
        if not isinstance(self.parents, Tensor) or tuple(self.parents.shape) != (n,):
            raise VerifyInputError(f"{name}.parents: expected shape [{n}] (one per node), got {_shape(self.parents)}")
        _check_parents(self.parents, f"{name}.parents")
        if n and (int(ids.min()) < 0 or int(ids.max()) >= vocab_size):
            raise VerifyInputError(
                f"{name}.token_ids: ids must lie in [0, {vocab_size}), got min {int(ids.min())} max {int(ids.max())}"
            )
        if self.probs is None:
            return
        q = self.probs
        if not isinstance(q, Tensor) or not q.is_floating_point() or tuple(q.shape) != (n, vocab_size):
            raise VerifyInputError(
                f"{name}.probs: expected a float tensor [{n}, {vocab_size}] or None, got {_shape(q)}"
            )
        if not n:
            return
        sums = q.sum(dim=-1, dtype=torch.float32)
        bad = ((sums - 1).abs() > 1e-3) | ~torch.isfinite(sums)
        if bool(bad.any()):
            r = int(bad.nonzero()[0, 0])
            raise VerifyInputError(
                f"{name}.probs: every row must sum to 1 within 1e-3 (the distribution the node was drawn "
                f"from, after apply_sampling); row {r} sums to {float(sums[r])}"
            )
        if float(q.amin()) < 0:
            raise VerifyInputError(f"{name}.probs: entries must be >= 0")
        own = q.gather(1, ids.long().to(q.device).unsqueeze(1)).squeeze(1)
        if bool((own <= 0).any()):
            r = int((own <= 0).nonzero()[0, 0])
            raise VerifyInputError(
                f"{name}.probs: node {r}'s token {int(ids[r])} has probability 0 under the distribution it "
                f"was drawn from (row {r}); record the q each node was actually sampled from"
            )


@dataclass
class TreeVerifyOutput:
    """Result of :func:`tree_rejection_sample` (host tensors and lists; one entry per request).

    Attributes:
        accepted_nodes: per request, the node indices of the accepted path from the root's child
            downward (depth order; empty when the first level is rejected).
        output_token_ids: per request, ``[len(path) + 1]`` int64: the accepted nodes' tokens, then the
            recovered token (some child was tried and none accepted) or the bonus token (the last
            accepted node, or the root, has no children).
        num_accepted: ``[B]`` int64, ``len(accepted_nodes[i])``.
        accepted_ranks: per request, for each accepted node its 0-based position among its siblings
            in index order (per-rank acceptance statistics).
    """

    accepted_nodes: list[list[int]]
    output_token_ids: list[Tensor]
    num_accepted: Tensor
    accepted_ranks: list[list[int]]

    @property
    def num_emitted(self) -> Tensor:
        """``[B]`` int64, tokens emitted per request (accepted + recovered / bonus)."""
        return self.num_accepted + 1

    def tolist(self) -> list[list[int]]:
        """Emitted token ids per request."""
        return [t.tolist() for t in self.output_token_ids]


# --------------------------------------------------------------------------------------------------
# Verification
# --------------------------------------------------------------------------------------------------


def tree_rejection_sample(
    trees: Sequence[DraftTree],
    target_logits: Sequence[Tensor],
    sampling: SamplingParams,
    generator: torch.Generator | None = None,
    *,
    validate: bool = True,
) -> TreeVerifyOutput:
    """Verify one draft tree per request against the target's logits (lossless; see the module docstring).

    Greedy requests follow the argmax (the output equals plain greedy decoding, token for token);
    sampled requests use multi-candidate recursive rejection sampling (SpecInfer, arXiv 2305.09781;
    EAGLE-2, arXiv 2406.16858), so every emitted token has exactly the target's distribution under
    ``sampling`` (vLLM's temperature / top-k / top-p semantics, as the chain verifier). A chain of
    ``K`` drafts (``parents = [-1, 0, ..., K - 2]``) gives :func:`~speculators.verify.rejection_sample`'s
    result: the same tokens in greedy mode, the same distribution when sampling.

    Args:
        trees: ``B`` :class:`DraftTree` (``N_i`` nodes each, ``N_i >= 0``; token ids in the target
            vocabulary).
        target_logits: ``B`` float tensors ``[N_i + 1, V]`` (the same ``V`` and device for all): row 0 =
            the target's logits at the root (the distribution over depth-1 nodes), row ``1 + u`` = at
            node ``u`` (over ``u``'s children, or the bonus token after ``u``). Any float dtype,
            computed in float32 (float64 is rounded once). Detached.
        sampling: :class:`SamplingParams` with ``B`` requests (temperature 0 = greedy).
        generator: RNG of the sampled requests without their own ``sampling.generators[i]`` (default:
            torch's global RNG on the logits' device). Per sampled request, in walk order: one float32
            uniform per child tested, then one float64 uniform for the final token (two-level inverse
            CDF of :mod:`speculators.verify.rejection`). Greedy requests draw nothing.
        validate: run the value checks below (per-tree host syncs); shape checks always run.

    Returns:
        :class:`TreeVerifyOutput` (host tensors): accepted node indices, emitted tokens
        (``[num_accepted_i + 1]`` int64 each), ``num_accepted [B]`` int64, accepted sibling ranks.

    Raises:
        VerifyInputError (a SpeculatorsError and a ValueError), naming the argument: ``trees`` /
            ``target_logits`` not sequences of the same length as the batch, a ``target_logits[i]`` not
            ``[N_i + 1, V]`` float (or on another device, or with a NaN / +inf / all -inf row when
            ``validate``), a ``trees[i]`` failing :meth:`DraftTree.validate` (when ``validate``), bad
            ``sampling`` values.
    """
    logits = _check_inputs(trees, target_logits, sampling, validate)
    batch = len(logits)
    if batch == 0:
        return TreeVerifyOutput([], [], torch.zeros(0, dtype=torch.int64), [])
    device = logits[0].device
    temps = effective_temperature(sampling.temperature, warn=False).tolist()
    counts = [int(x.shape[0]) for x in logits]
    rows = torch.cat(logits).to(COMPUTE_DTYPE)  # [R, V], R = sum(N_i + 1)
    target = _target_side(rows, counts, temps, sampling)
    gens = sampling.generators or [None] * batch
    nodes: list[list[int]] = []
    ranks: list[list[int]] = []
    out: list[Tensor] = []
    for i, tree in enumerate(trees):
        kids = _children_lists(tree.parents.tolist())
        tokens = tree.token_ids.tolist()
        if temps[i] == 0:
            path, rk, last = _greedy_walk(kids, tokens, target[i])
        else:
            probs = None if tree.probs is None else tree.probs.detach().to(device, COMPUTE_DTYPE)
            rng = _Draws(gens[i] if gens[i] is not None else generator, device)
            path, rk, last = _sampled_walk(kids, tokens, target[i], probs, rng)
        nodes.append(path)
        ranks.append(rk)
        out.append(torch.tensor([tokens[c] for c in path] + [last], dtype=torch.int64))
    num_acc = torch.tensor([len(p) for p in nodes], dtype=torch.int64)
    return TreeVerifyOutput(nodes, out, num_acc, ranks)


def _target_side(rows: Tensor, counts: list[int], temps: list[float], sampling: SamplingParams) -> list:
    """Per request: the argmax list of its rows (greedy) or its ``[N_i + 1, V]`` sampling distributions
    ``p`` (one vectorised :func:`apply_sampling` over the rows of all sampled requests)."""
    device = rows.device
    batch = len(counts)
    greedy = torch.tensor([t == 0 for t in temps], device=device)
    n_rows = torch.tensor(counts, device=device)
    row_greedy = greedy.repeat_interleave(n_rows, output_size=rows.shape[0])
    target: list = [None] * batch
    if bool(greedy.any()):
        am = first_argmax(rows[row_greedy]).tolist()
        at = 0
        for i in range(batch):
            if temps[i] == 0:
                target[i], at = am[at : at + counts[i]], at + counts[i]
    if not bool(greedy.all()):
        sampled, rep = ~greedy, n_rows[~greedy]

        def per_row(x: Tensor | None) -> Tensor | None:
            return None if x is None else x.to(device)[sampled].repeat_interleave(rep)

        p = apply_sampling(
            rows[~row_greedy], per_row(sampling.temperature), per_row(sampling.top_k), per_row(sampling.top_p),
            validate=False,
        )
        at = 0
        for i in range(batch):
            if temps[i] != 0:
                target[i], at = p[at : at + counts[i]], at + counts[i]
    return target


def _greedy_walk(kids: list[list[int]], tokens: list[int], argmax: list[int]) -> tuple[list[int], list[int], int]:
    """Follow the argmax: ``(accepted nodes, their sibling ranks, the recovered / bonus token)``."""
    path: list[int] = []
    ranks: list[int] = []
    u = -1
    while True:
        a = argmax[u + 1]
        nxt = next(((j, c) for j, c in enumerate(kids[u + 1]) if tokens[c] == a), None)
        if nxt is None:
            return path, ranks, a
        ranks.append(nxt[0])
        path.append(nxt[1])
        u = nxt[1]


class _Draws:
    """The random numbers of one sampled request, drawn on demand from one generator (or the global RNG)."""

    def __init__(self, generator: torch.Generator | None, device: torch.device) -> None:
        self.generator = generator
        self.device = generator.device if generator is not None else device

    def accept_uniform(self) -> float:
        return torch.rand(1, generator=self.generator, device=self.device).item()

    def sample_uniform(self) -> float:
        return torch.rand(1, generator=self.generator, device=self.device, dtype=torch.float64).item()


def _sampled_walk(
    kids: list[list[int]], tokens: list[int], p_rows: Tensor, probs: Tensor | None, rng: _Draws
) -> tuple[list[int], list[int], int]:
    """Multi-candidate recursive rejection down the tree: ``(accepted nodes, ranks, final token)``."""
    path: list[int] = []
    ranks: list[int] = []
    u = -1
    while True:
        p = p_rows[u + 1]
        accepted = None
        for j, c in enumerate(kids[u + 1]):
            x = tokens[c]
            q_x = 1.0 if probs is None else float(probs[c, x])
            if rng.accept_uniform() * q_x < float(p[x]):  # probability min(1, p(x) / q(x))
                accepted = (j, c)
                break
            p = _residual(p, None if probs is None else probs[c], x)
        if accepted is None:
            return path, ranks, _sample_row(p, p, rng.sample_uniform())
        ranks.append(accepted[0])
        path.append(accepted[1])
        u = accepted[1]


def _residual(p: Tensor, q: Tensor | None, token: int) -> Tensor:
    """``normalise(max(p - q, 0))`` after rejecting ``token`` drawn from ``q`` (``None``: point mass on
    ``token``, i.e. ``p`` with ``token`` zeroed). A new tensor; ``p`` itself (unchanged) if the residual
    sums to 0 in float32 (a rejection of probability 0 up to rounding)."""
    if q is None:
        r = p.clone()
        r[token] = 0.0
    else:
        r = (p - q).clamp_min_(0.0)
    total = float(r.sum())
    if not total > 0.0:
        return p
    return r.div_(total)


def _check_inputs(
    trees: Sequence[DraftTree], target_logits: Sequence[Tensor], sampling: SamplingParams, validate: bool
) -> list[Tensor]:
    """Shape / dtype / device checks (always) and value checks (``validate``); the logits, detached,
    float64 rounded to float32. Raises :class:`VerifyInputError` naming the argument."""
    if isinstance(trees, DraftTree) or not isinstance(trees, Sequence):
        raise VerifyInputError(f"trees: expected a list of DraftTree (one per request), got {type(trees)}")
    if isinstance(target_logits, Tensor) or not isinstance(target_logits, Sequence):
        raise VerifyInputError(
            f"target_logits: expected a list of [N_i + 1, V] tensors (one per request), got {_shape(target_logits)}"
        )
    batch = len(trees)
    if len(target_logits) != batch:
        raise VerifyInputError(f"target_logits: expected {batch} tensors (one per tree), got {len(target_logits)}")
    sampling.validate(batch, values=validate)
    out: list[Tensor] = []
    vocab = device = None
    for i, (tree, x) in enumerate(zip(trees, target_logits)):
        if not isinstance(tree, DraftTree) or not isinstance(tree.token_ids, Tensor) or tree.token_ids.dim() != 1:
            raise VerifyInputError(f"trees[{i}]: expected a DraftTree with token_ids [N], got {type(tree)}")
        n = tree.num_nodes
        if not isinstance(x, Tensor) or x.dim() != 2 or not x.is_floating_point() or x.shape[0] != n + 1:
            raise VerifyInputError(
                f"target_logits[{i}]: expected a float tensor [{n + 1}, V] (nodes + 1), got {_shape(x)}"
            )
        if vocab is None:
            vocab, device = int(x.shape[1]), x.device
        if x.shape[1] != vocab or vocab == 0:
            raise VerifyInputError(
                f"target_logits[{i}]: vocabulary {x.shape[1]} differs from target_logits[0]'s {vocab}"
            )
        if x.device != device:
            raise VerifyInputError(f"target_logits[{i}]: on {x.device}, expected target_logits[0]'s device {device}")
        if tuple(tree.parents.shape) != (n,):
            raise VerifyInputError(f"trees[{i}].parents: expected shape [{n}], got {_shape(tree.parents)}")
        x = x.detach()
        if x.dtype not in (torch.float32, torch.float16, torch.bfloat16):
            x = x.to(COMPUTE_DTYPE)
        if validate:
            tree.validate(vocab, name=f"trees[{i}]")
            if not bool(torch.isfinite(x.float().amax(dim=-1)).all()):
                raise VerifyInputError(
                    f"target_logits[{i}]: a row contains NaN or +inf (or is entirely -inf) in float32"
                )
        out.append(x)
    return out
