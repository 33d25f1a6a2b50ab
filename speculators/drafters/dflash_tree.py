"""Draft trees from the block drafters: DFlash's block slots and DSpark's block with its Markov head.

Both families draft a chain from ONE backbone forward of a block anchored at the request's newest token
(:meth:`speculators.drafters.dflash.DFlashDrafter.block_hidden`). A tree reuses that forward and chooses
its nodes with :func:`speculators.drafters.tree_drafting.slot_tree` (Medusa-style trees, Cai et al. arXiv
2401.10774; EAGLE-2's dynamic expansion and rerank, Li et al. arXiv 2406.16858, or vLLM's static
``speculative_token_tree``):

* **DFlash**: the block ``[x_n, MASK x D]`` (``D + 1`` slots, as the chain of ``D`` drafts builds it); the
  mask slots carry no token, so slot d's distribution is the same under every parent and a node at depth
  d takes one of slot d's top-k tokens;
* **DSpark**: the block of ``D`` slots (``sample_from_anchor``) and the Markov head
  ``logits_k = head(h_k) + W2(W1[x_{k-1}])``: slot k depends on the PREVIOUS token, so each frontier node's
  children are the top-k of ``head(h_d) + W2(W1[node's own token])``, ``h_d`` shared by the nodes of a
  depth (depth 1: the anchor ``x_n``, as the chain). This is exactly what the chain computes along each
  root-to-node path.

The block attends bidirectionally and vLLM serves ``num_speculative_tokens`` slots, so the tree of
request i uses the block its chain of ``D_i = min(spec.depth, depth_caps[i], K)`` drafts would use (K =
``max_speculative_tokens``): requests are grouped by ``D_i`` and each request runs its block once, as
the chain's per-request ``propose`` does. Children are top-k tokens (``DraftTree.probs`` None, point
masses for the verifier); the states are never written.
"""

from __future__ import annotations

from typing import Callable

import torch

from ..decode.proposal import check_batch
from ..verify.tree import DraftTree
from .tree_drafting import ChildLogits, slot_tree

# (states of one group, D) -> (slot logits [G, D, N] float, child logits callable or None)
_GroupSlots = Callable[[list, int], "tuple[torch.Tensor, ChildLogits | None]"]


def _grouped_trees(states: list, spec, caps: list[int], K: int, d2t, slots: _GroupSlots) -> list[DraftTree]:
    """One :func:`slot_tree` call per distinct chain depth ``D_i = min(spec.depth, caps[i], K)``."""
    depths = [min(spec.depth, c, K) for c in caps]
    out: list[DraftTree | None] = [None] * len(states)
    for D in sorted(set(depths)):
        group = [i for i, d in enumerate(depths) if d == D]
        if D == 0:
            for i in group:
                out[i] = DraftTree(torch.empty(0, dtype=torch.int64), torch.empty(0, dtype=torch.int64))
            continue
        logits, child = slots([states[i] for i in group], D)
        for i, t in zip(group, slot_tree(logits, spec, d2t, [caps[i] for i in group], child)):
            out[i] = t
    return out


@torch.no_grad()
def dflash_block_tree(drafter, states: list, spec, depth_caps: list[int], sampling=None,
                      generators=None) -> list[DraftTree]:
    """DFlash draft trees (module docstring): per request ONE forward of the block ``[x_n, MASK x D_i]``,
    slot d (1..D_i) = depth d.

    Args:
        drafter: a :class:`~speculators.drafters.dflash.DFlashDrafter`.
        states: B :class:`~speculators.drafters.dflash.DFlashState` (left as found).
        spec: a :class:`speculators.decode.tree_spec.TreeSpec`.
        depth_caps: per request the deepest level kept (>= 0); at most ``block_size - 1`` levels.
        sampling, generators: checked only (children are top-k tokens, nothing is drawn).
    Returns:
        B :class:`speculators.verify.tree.DraftTree` (int64 target ids, CPU, ``probs`` None).
    Raises:
        SpeculatorsError: ``depth_caps`` not one non-negative integer per state (naming ``propose_tree``).
    """
    caps = check_batch(states, depth_caps, sampling, generators, who="propose_tree", ks_name="depth_caps")

    def slots(group: list, D: int):
        logits = [drafter.head(drafter.block_hidden(s, D + 1)[1:]).float() for s in group]  # [D, N] each
        return torch.stack(logits), None

    d2t = drafter.d2t if drafter.reduced_vocab else None
    return _grouped_trees(list(states), spec, caps, drafter.block_size - 1, d2t, slots)


@torch.no_grad()
def dspark_markov_tree(drafter, states: list, spec, depth_caps: list[int], sampling=None,
                       generators=None) -> list[DraftTree]:
    """DSpark draft trees (module docstring): per request ONE backbone forward of the block of ``D_i``
    slots; a node's children at depth d are the top-k of ``head(h_{d-1}) + W2(W1[node's token])`` (slots
    0-based), the root's of ``head(h_0) + W2(W1[x_n])``. The confidence head is not read.

    Args:
        drafter: a :class:`~speculators.drafters.dspark.DSparkDrafter`.
        states: B :class:`~speculators.drafters.dflash.DFlashState` (left as found).
        spec: a :class:`speculators.decode.tree_spec.TreeSpec`.
        depth_caps: per request the deepest level kept (>= 0); at most ``block_size`` levels.
        sampling, generators: checked only (children are top-k tokens, nothing is drawn).
    Returns:
        B :class:`speculators.verify.tree.DraftTree` (int64 target ids, CPU, ``probs`` None).
    Raises:
        SpeculatorsError: ``depth_caps`` not one non-negative integer per state (naming ``propose_tree``).
    """
    caps = check_batch(states, depth_caps, sampling, generators, who="propose_tree", ks_name="depth_caps")

    def markov(prev: torch.Tensor) -> torch.Tensor:
        return drafter.markov_head(prev.to(dtype=torch.int64))[0].float()  # [..., N]

    def slots(group: list, D: int):
        base = torch.stack([drafter.head(drafter.block_hidden(s, D)).float() for s in group])  # [G, D, N]
        anchors = torch.tensor([s.last_id for s in group], dtype=torch.int64, device=base.device)
        root = base.clone()
        root[:, 0] = base[:, 0] + markov(anchors)

        def child(depth: int, parent_tokens: torch.Tensor) -> torch.Tensor:
            return base[:, depth - 1].unsqueeze(1) + markov(parent_tokens.to(base.device))  # [G, F, N]

        return root, child

    d2t = drafter.d2t if drafter.reduced_vocab else None
    return _grouped_trees(list(states), spec, caps, drafter.block_size, d2t, slots)
