"""The decoding loop's draft, verify and keep steps for DRAFT TREES (EAGLE-2, SpecInfer, vLLM tree decoding).

:func:`speculators.generate.speculative_generate` with ``tree=`` runs the same continuous-batching loop
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

from .errors import SpeculatorsError
from .verify.tree import DraftTree, tree_rejection_sample


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


def verify_trees(sess, live: list[int], last: dict, trees: list[DraftTree], sampling, vocab: int | None, clock):
    """ONE tree forward over the live requests and ONE tree verification.

    Returns:
        ``(out, feats, forward_seconds)``: the :class:`speculators.verify.tree.TreeVerifyOutput`, per request
        the :class:`speculators.target.TargetFeatures` of its ``[last token, nodes]`` rows, and the wall
        time of the forward alone (``clock()`` readings around it).
    Raises:
        SpeculatorsError: a tree node outside ``[0, vocab)``.
    """
    ids, parents = [], []
    for i, t in zip(live, trees):
        if vocab is not None and t.token_ids.numel() and (int(t.token_ids.min()) < 0
                                                           or int(t.token_ids.max()) >= vocab):
            raise SpeculatorsError(f"draft tree of request {i}: token ids outside [0, {vocab})")
        ids.append(torch.cat([torch.tensor([last[i]], dtype=torch.int64), t.token_ids]))
        # node j of the tree is row j + 1; the root (the last token) hangs off the context (-1)
        parents.append(torch.cat([torch.tensor([-1]), torch.where(t.parents >= 0, t.parents + 1, 0)]))
    t0 = clock()
    logits, feats = sess.forward_tree(live, ids, parents)
    forward_seconds = clock() - t0
    out = tree_rejection_sample(trees, logits, sampling, validate=False)
    return out, feats, forward_seconds


def path_rows(accepted_nodes: list[int]) -> list[int]:
    """The forward rows of an accepted path: the root (row 0) then each accepted node's row (node + 1)."""
    return [0] + [int(n) + 1 for n in accepted_nodes]


def path_features(feats, rows: list[int]):
    """The :class:`~speculators.target.TargetFeatures` of ``rows`` of one request's tree forward, in order."""
    from .target.features import TargetFeatures

    idx = torch.tensor(rows, device=feats.aux.device)
    return TargetFeatures(feats.aux.index_select(1, idx), feats.top.index_select(1, idx),
                          None if feats.logits is None else feats.logits.index_select(1, idx))


def tree_step(run, clock, emit_until, retire) -> None:
    """One tree step of :func:`speculators.generate.speculative_generate` over ``run.live`` (draft, verify,
    keep; see the module docstring), charging drafting, forward and verifying time as the chain's steps do.
    ``clock(device)``, ``emit_until(out, new, max_new, eos)`` and ``retire(run, i)`` are the loop's own
    (passed in: this module sits below :mod:`speculators.generate`)."""
    from .decode_args import select_rows

    _clock, _emit_until, _retire = clock, emit_until, retire

    live = run.live
    caps = [min(run.tree.depth, run.max_new[i] - len(run.results[i].tokens) - 1) for i in live]
    sp = select_rows(run.params, run.gens, live)
    tp = _clock(run.device)
    if run.proposer is not None and any(caps):
        trees = draft_trees(run.proposer, [run.states[i] for i in live], run.tree, caps, sp,
                            [run.gens[i] for i in live], run.vocab)
    else:
        trees = [chain_tree(torch.empty(0, dtype=torch.int64)) for _ in live]
    tv = _clock(run.device)
    out, feats, fs = verify_trees(run.sess, live, run.last, trees, sp, run.vocab, lambda: _clock(run.device))
    run.forwards += 1
    run.forward_s += fs
    run.width_sum, run.widths_read = run.width_sum + int(run.sess.width), run.widths_read + 1
    te = _clock(run.device)
    run.draft_s, run.verify_s = run.draft_s + (tv - tp), run.verify_s + (te - tv)
    still, adv = [], ([], [], [])
    for j, i in enumerate(live):
        nodes = out.accepted_nodes[j]
        a = len(nodes)
        new = out.output_token_ids[j].tolist()[:a + 1]
        r = run.results[i]
        r.draft_seconds += tv - tp
        r.verify_seconds += te - tv
        before = len(r.tokens)
        done = _emit_until(r.tokens, new, run.max_new[i], run.eos)
        r.add_step(int(trees[j].token_ids.numel()), a, len(r.tokens) - before)
        r.proposed.append(int(trees[j].token_ids.numel()))
        r.tree_ranks.append([int(x) for x in out.accepted_ranks[j]])
        if run.on_step is not None:
            run.on_step(i, trees[j], a, r.tokens[before:])
        if done:
            _retire(run, i)
            continue
        rows = path_rows(nodes)
        run.sess.keep_tree(i, rows)
        if run.proposer is not None:
            adv[0].append(run.states[i])
            adv[1].append(torch.tensor(new, dtype=torch.int64))
            adv[2].append(path_features(feats[j], rows))
        run.last[i] = new[-1]
        still.append(i)
    advance_timed(run, adv, still, _clock)


def advance_timed(run, adv: tuple[list, list, list], still: list[int], clock) -> None:
    """The end of a loop step, chain or tree: ONE batched ``advance`` of the proposer with the kept requests'
    states, new ids and target features (``adv``; nothing when empty), its wall time charged to the run's and
    each kept request's drafting time (``clock(device)``), and ``still`` becomes the live requests."""
    if adv[0]:
        ta = clock(run.device)
        run.proposer.advance(*adv)
        dt = clock(run.device) - ta
        run.draft_s += dt
        for i in still:
            run.results[i].draft_seconds += dt
    run.live = still
