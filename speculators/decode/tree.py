"""The decoding loop's draft, verify and keep steps for DRAFT TREES (EAGLE-2, SpecInfer, vLLM tree decoding).

:func:`speculators.decode.loop.speculative_generate` with ``tree=`` runs the same continuous-batching loop
(join, draft, verify, keep, retire) with these three steps in place of the chain's:

1. :func:`draft_trees`: ONE batched ``propose_tree`` (a proposer that declares ``drafts_trees``, e.g. the
   EAGLE-3 drafter: EAGLE-2's dynamic tree or a static ``speculative_token_tree``); any other proposer
   drafts its chain of ``depth`` tokens, verified as a one-branch tree. Request i's tree keeps only the
   nodes at depth ``<= max_new_i - generated_i - 1`` (nothing that could not be emitted is verified);
2. :func:`verify_trees`: ONE target forward over every live request's ``[last token, tree nodes]``
   (:meth:`speculators.target.BatchDecodeSession.forward_tree`: node j at position ``length + depth_j``,
   attending to the context and its ancestors only), then ONE call of the tree verifier
   (:func:`speculators.verify.tree.tree_rejection_sample`: greedy follows the target's argmax down the
   tree; sampling is multi-candidate recursive rejection), which accepts a root-to-node path per request
   and emits a recovered or bonus token after it;
3. :func:`keep_trees`: per request the path's tokens and the final token are emitted (up to a stop token
   or ``max_new_tokens``), the step is recorded (``drafted`` = tree nodes verified,
   ``verifier_accepted`` = path length, ``tree_ranks`` = the accepted children's ranks), only the path's
   KV entries stay in the target's cache (:meth:`keep_tree`), and the proposer is advanced with the path
   exactly as after a chain step (the path's target features are what a chain forward over it computes).

Greedy tree decoding therefore equals plain greedy decoding token for token, as chains do.
"""

from __future__ import annotations

import torch

from ..errors import SpeculatorsError
from ..target.features import TargetFeatures
from ..verify.tree import DraftTree, tree_rejection_sample
from .inputs import select_rows
from .state import Kept, RunState


def chain_tree(token_ids: torch.Tensor, probs: torch.Tensor | None = None) -> DraftTree:
    """A chain of K drafts as a one-branch tree: parents ``[-1, 0, 1, .., K-2]``."""
    k = int(token_ids.numel())
    return DraftTree(token_ids.reshape(-1).to(device="cpu", dtype=torch.int64),
                     torch.arange(-1, k - 1, dtype=torch.int64), probs)


def cut_tree(tree: DraftTree, max_depth: int) -> DraftTree:
    """``tree`` without its nodes deeper than ``max_depth`` (parents re-indexed; a valid tree)."""
    depth = tree.depths()
    keep = (depth <= max_depth).nonzero().reshape(-1)
    if keep.numel() == tree.token_ids.numel():
        return tree
    where = torch.full((tree.token_ids.numel(),), -1, dtype=torch.int64)
    where[keep] = torch.arange(keep.numel())
    par = tree.parents[keep]
    par = torch.where(par >= 0, where[par.clamp(min=0)], par)
    return DraftTree(tree.token_ids[keep], par, None if tree.probs is None else tree.probs[keep])


def draft_trees(proposer, states: list, spec, caps: list[int], sampling, gens: list,
                vocab: int | None = None) -> list[DraftTree]:
    """One tree per request (see the module docstring); request i's nodes reach depth ``caps[i]`` at most
    (deeper nodes a proposer returns are cut off: :func:`cut_tree`).

    Raises:
        SpeculatorsError: the proposer returned not one tree per request, or a tree that is not a valid
            :class:`DraftTree` over ``vocab`` target ids (:meth:`DraftTree.validate`: parents, token ids,
            draft distributions of shape ``[N, vocab]`` summing to 1), naming the proposer.
    """
    if getattr(proposer, "drafts_trees", False):
        trees = proposer.propose_tree(states, spec, caps, sampling, gens)
    else:
        ks = [min(spec.depth, c) for c in caps]
        trees = [chain_tree(p.token_ids, p.probs) for p in proposer.propose(states, ks, sampling, gens)]
    if not isinstance(trees, (list, tuple)) or len(trees) != len(states):
        raise SpeculatorsError(f"proposer {type(proposer).__name__}: propose_tree must return one DraftTree per "
                               f"request ({len(states)})")
    out = []
    for t, cap in zip(trees, caps):
        if not isinstance(t, DraftTree):
            raise SpeculatorsError(f"proposer {type(proposer).__name__}: propose_tree returned a "
                                   f"{type(t).__name__}, expected speculators.verify.tree.DraftTree")
        if vocab is not None:
            try:
                t.validate(vocab)
            except SpeculatorsError as e:
                raise SpeculatorsError(f"proposer {type(proposer).__name__}: {e}") from None
        if t.token_ids.numel() and int(t.depths().max()) > cap:
            t = cut_tree(t, cap)
        out.append(t)
    return out


def verify_trees(run: RunState, trees: list[DraftTree], sampling):
    """ONE tree forward over the live requests and ONE tree verification.

    Returns:
        ``(out, feats)``: the :class:`speculators.verify.tree.TreeVerifyOutput` and, per request, the
        :class:`speculators.target.TargetFeatures` of its ``[last token, nodes]`` rows.
    Raises:
        SpeculatorsError: a tree node outside ``[0, vocab)``.
    """
    ids, parents = [], []
    vocab = run.vocab
    for i, t in zip(run.live, trees):
        if vocab is not None and t.token_ids.numel() and (int(t.token_ids.min()) < 0
                                                           or int(t.token_ids.max()) >= vocab):
            raise SpeculatorsError(f"draft tree of request {i}: token ids outside [0, {vocab})")
        ids.append(torch.cat([torch.tensor([run.last[i]], dtype=torch.int64), t.token_ids]))
        # node j of the tree is row j + 1; the root (the last token) hangs off the context (-1)
        parents.append(torch.cat([torch.tensor([-1]), torch.where(t.parents >= 0, t.parents + 1, 0)]))
    with run.recorder.forward(run.session):
        logits, feats = run.session.forward_tree(run.live, ids, parents)
    return tree_rejection_sample(trees, logits, sampling, validate=False), feats


def path_rows(accepted_nodes: list[int]) -> list[int]:
    """The forward rows of an accepted path: the root (row 0) then each accepted node's row (node + 1)."""
    return [0] + [int(n) + 1 for n in accepted_nodes]


def path_features(feats, rows: list[int]):
    """The :class:`~speculators.target.TargetFeatures` of ``rows`` of one request's tree forward, in order."""
    idx = torch.tensor(rows, device=feats.aux.device)
    return TargetFeatures(feats.aux.index_select(1, idx), feats.top.index_select(1, idx),
                          None if feats.logits is None else feats.logits.index_select(1, idx))


def step(run: RunState) -> None:
    """One tree step of :func:`speculators.decode.loop.speculative_generate` over ``run.live`` (draft, verify,
    keep; see the module docstring); the run's recorder times drafting and verifying as for chains."""
    live = list(run.live)
    sampling = select_rows(run.sampling, run.generators, live)
    caps = [min(run.tree.depth, run.room(i)) for i in live]
    with run.recorder.drafting(live):
        if run.proposer is not None and any(caps):
            trees = draft_trees(run.proposer, [run.states[i] for i in live], run.tree, caps, sampling,
                                [run.generators[i] for i in live], run.vocab)
        else:
            trees = [chain_tree(torch.empty(0, dtype=torch.int64)) for _ in live]
    with run.recorder.verifying(live):
        out, feats = verify_trees(run, trees, sampling)
    keep_trees(run, trees, out, feats)


def keep_trees(run: RunState, trees: list[DraftTree], out, feats) -> None:
    """Per live request: emit the accepted path and the final token, record the step (``drafted`` = nodes
    verified, ``tree_ranks`` = the accepted children's ranks) and tell ``on_step``, retire a finished request,
    else keep only the path's KV entries; then ONE batched ``advance`` of the proposer with the paths."""
    kept = Kept()
    for j, i in enumerate(run.live):
        nodes = out.accepted_nodes[j]
        a = len(nodes)
        new = out.output_token_ids[j].tolist()[:a + 1]
        emitted, done = run.emit(i, new)
        r = run.results[i]
        r.add_step(int(trees[j].token_ids.numel()), a, len(emitted))
        r.proposed.append(int(trees[j].token_ids.numel()))
        r.tree_ranks.append([int(x) for x in out.accepted_ranks[j]])
        if run.on_step is not None:
            run.on_step(i, trees[j], a, emitted)
        if done:
            run.retire(i)
            continue
        rows = path_rows(nodes)
        run.session.keep_tree(i, rows)
        run.keep(kept, i, new, path_features(feats[j], rows) if run.proposer is not None else None)
    run.advance(kept)
