"""Sampled TREE decoding through the batched loop is lossless: the emitted tokens follow the target's own
sampling distribution under each request's settings, for a drafter's dynamic tree (deterministic top-k
children: point masses) and for a proposer's sampled chain verified as a one-branch tree (drafts with their
q rows); and a tree verifier that skips the residual update fails the same check."""

from __future__ import annotations

import pytest
import torch

from speculators.data.vocab import DraftVocab
from speculators.drafters import registry
from speculators.decode.loop import plain_decode, speculative_generate
from speculators.decode.tree_spec import TreeSpec
from speculators.verify.testing import assert_distribution, chi2_check
from test_batched import V, TableProposer, _exact_first_tokens, _mixed_batch, rand_prompt, untied_target

KINDS = [(rand_prompt(6, 1), 0.8, 6, 1.0, 3), (rand_prompt(4, 2), 1.3, 0, 0.85, 2),
         (rand_prompt(9, 3), 1.0, 0, 1.0, 3), (rand_prompt(5, 4), 0.0, 0, 1.0, 2)]
TREE = TreeSpec(depth=3, topk=3, total_tokens=8)


@pytest.fixture(scope="module")
def target():
    return untied_target(layers=4)


def tree_drafter(target):
    torch.manual_seed(0)
    cfg = registry.get("eagle3").config_class(algorithm="eagle3", ttt_steps=2, draft_vocab_size=None)
    d = registry.get("eagle3").from_target(cfg, target, DraftVocab.from_counts(torch.arange(V, 0, -1), None))
    with torch.no_grad():
        for name, p in d.named_parameters():
            if p.requires_grad and "norm" not in name:
                p.normal_(0, 0.3)
    return d.eval()


def decode(target, proposer, kinds, n, seed0):
    order, ps, sp, seeds, _ = _mixed_batch(kinds, n, seed0)
    out = speculative_generate(target, proposer, ps, 0, 4, sp, batch_size=48, eos_ids=set(), seeds=seeds, tree=TREE)
    return order, out


@pytest.mark.parametrize("which", ["drafter tree", "sampled chain as a tree"])
def test_sampled_tree_decoding_is_lossless(target, which):
    proposer = tree_drafter(target) if which == "drafter tree" else TableProposer()
    order, out = decode(target, proposer, KINDS, 400, 3000)
    drafted = accepted = 0
    for j, (prompt, temp, top_k, top_p, _) in enumerate(KINDS):
        res = [r for r, o in zip(out.results, order) if o == j]
        toks = torch.tensor([r.tokens[:3] for r in res])
        drafted += sum(sum(r.drafted) for r in res)
        accepted += sum(sum(r.verifier_accepted) for r in res)
        if temp == 0:
            assert (toks == torch.tensor(plain_decode(target, prompt, 3, eos_ids=set()).tokens)).all()
            continue
        joint12, p3 = _exact_first_tokens(target, prompt, temp, top_k, top_p)
        assert_distribution(toks[:, 0] * V + toks[:, 1], joint12, f"{which}, kind {j}: (t1, t2)")
        assert_distribution(toks[:, 2], p3, f"{which}, kind {j}: t3")
    assert drafted > 0 and 0 < accepted < drafted


class OracleTree:
    """A tree proposer whose root children are the target's own 3 most likely next tokens (temperature 1):
    the children a verifier rejects most often are then likely under p, so a missing residual update
    (re-emitting a rejected child as the recovered token) shows at once."""

    drafts_trees = True

    def __init__(self, target):
        self.target = target

    def start(self, input_ids, features=None):
        return list(input_ids.tolist())

    def advance(self, states, new_ids, features):
        for s, ids in zip(states, new_ids):
            s.extend(ids.tolist())

    def propose(self, states, ks, sampling=None, generators=None):
        raise AssertionError("tree decoding asks for trees")

    def propose_tree(self, states, spec, caps, sampling=None, generators=None):
        from speculators.verify.tree import DraftTree

        out = []
        for s, cap in zip(states, caps):
            logits = self.target.features(torch.tensor([s]), with_logits=True).logits[0, -1].float()
            top = torch.topk(logits, 3).indices if cap else torch.empty(0, dtype=torch.int64)
            out.append(DraftTree(top.to(torch.int64), torch.full((top.numel(),), -1, dtype=torch.int64)))
        return out


@pytest.mark.parametrize("leaky", [False, True])
def test_the_check_has_power_against_a_tree_verifier_without_the_residual_update(target, monkeypatch, leaky):
    """Rejecting a child without removing it from the target's distribution (the recovered token may then be
    the rejected child again) is refused by the same chi-square check that the real verifier passes."""
    from speculators.verify import tree

    if leaky:
        monkeypatch.setattr(tree, "_residual", lambda p, q, token: p)
    kinds = [KINDS[2]]
    order, out = decode(target, OracleTree(target), kinds, 400, 4000)
    toks = torch.tensor([r.tokens[:2] for r in out.results])
    joint12, _ = _exact_first_tokens(target, kinds[0][0], 1.0, 0, 1.0)
    stat, thr, tv, _ = chi2_check(toks[:, 0] * V + toks[:, 1], joint12)
    assert (stat > thr) == leaky, (stat, thr, tv)
