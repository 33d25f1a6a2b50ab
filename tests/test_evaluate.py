"""Acceptance statistics the eval report prints, on hand-made step lists with values worked out by hand,
and run_eval's counts on a tiny target with an oracle drafter."""

from __future__ import annotations

import json

import pytest
import torch

from speculators.drafters.base import Proposal
from speculators.errors import SpeculatorsError
from speculators.evaluate import AcceptanceStats, report_markdown, run_eval
from speculators.generate import GenerationResult, NGramProposer, plain_decode
from speculators.target import build_tiny_target
from speculators.verify import SamplingParams


def result(steps, seconds, first=1):
    """A GenerationResult from ``steps = [(drafted, verifier_accepted, emitted)]``; tokens = the prefill
    token plus every emitted token (ids do not matter to the statistics)."""
    r = GenerationResult([first] * (1 + sum(e for _, _, e in steps)), seconds=seconds)
    for d, va, e in steps:
        r.add_step(d, va, e)
    return r


# K = 3. Request A: all accepted + bonus; rejected at draft 2; a K=0 step; a ragged K=2 step rejected at draft 1.
A = [(3, 3, 4), (3, 1, 2), (0, 0, 1), (2, 0, 1)]
# Request B: ragged K=2 with draft 2 rejected; then the stop token is draft 2 of a fully accepted block:
# the verifier accepted 3 drafts, the step emitted 2 tokens (drafts 1, 2), no bonus.
B = [(2, 1, 2), (3, 3, 2)]


@pytest.fixture()
def stats():
    s = AcceptanceStats(3)
    s.add(result(A, 0.5))
    s.add(result(B, 1.5))
    return s


def test_add_step_records_what_was_emitted():
    r = result(B, 1.0)
    assert r.drafted == [2, 3] and r.verifier_accepted == [1, 3] and r.emitted == [2, 2]
    assert r.accepted == [1, 2]  # accepted AND emitted: the 3rd accepted draft came after the stop token
    assert r.target_forwards == 2 and len(r.tokens) == 5


def test_tau_counts_emitted_tokens_per_step(stats):
    # emitted: A 4+2+1+1 = 8, B 2+2 = 4 over 6 steps
    assert stats.steps == 6 and stats.emitted == 12
    assert stats.tau == 12 / 6 == 2.0


def test_acceptance_rate_is_the_verifiers_view(stats):
    # drafted: A 3+3+0+2, B 2+3 = 13; verifier accepted: A 3+1+0+0, B 1+3 = 8
    assert stats.drafted == 13 and stats.verifier_accepted == 8
    assert stats.acceptance_rate == 8 / 13
    # accepted and emitted: A 3+1+0+0, B 1+2 = 7
    assert stats.accepted == 7


def test_per_position_acceptance(stats):
    # steps drafting >= 1, 2, 3 drafts: (A1 A2 A4 B1 B2)=5, (A1 A2 A4 B1 B2)=5, (A1 A2 B2)=3
    assert stats.pos_drafted == [5, 5, 3]
    # steps whose verifier accepted >= 1, 2, 3: (A1 A2 B1 B2)=4, (A1 B2)=2, (A1 B2)=2
    assert stats.pos_accepted == [4, 2, 2]
    assert stats.per_position == [4 / 5, 2 / 5, 2 / 3]
    # the acceptance rate is the drafted-weighted mean of acc_k
    assert sum(stats.pos_accepted) / sum(stats.pos_drafted) == stats.acceptance_rate


def test_conditional_acceptance(stats):
    # draft k judged = drafted >= k and drafts 1..k-1 accepted:
    # k=1: 5 steps; k=2: A1 A2 B1 B2 (A4 rejected draft 1) = 4; k=3: A1 B2 (A2 rejected draft 2) = 2
    assert stats.pos_reached == [5, 4, 2]
    assert stats.conditional == [4 / 5, 2 / 4, 2 / 2]


def test_tokens_per_second(stats):
    # tokens: A 1 + 8 = 9, B 1 + 4 = 5; 2.0 s
    assert stats.tokens == 14 and stats.seconds == 2.0
    assert stats.tokens_per_s == 7.0


def test_plain_and_empty_results():
    s = AcceptanceStats(2)
    s.add(result([(0, 0, 1)] * 3, 0.25))  # plain decoding: 4 tokens, 3 steps
    s.add(result([], 0.25))  # the prefill token was the stop token
    assert s.steps == 3 and s.tokens == 5 and s.tau == 1.0 and s.acceptance_rate == 0.0
    assert s.per_position == [0.0, 0.0] and s.conditional == [0.0, 0.0] and s.tokens_per_s == 10.0
    assert AcceptanceStats(2).tau == 1.0 and AcceptanceStats(2).tokens_per_s == 0.0


def test_as_dict_and_markdown(stats):
    d = stats.as_dict()
    assert d["tau"] == 2.0 and d["emitted"] == 12 and d["accepted"] == 7 and d["verifier_accepted"] == 8
    assert d["drafted"] == 13 and d["tokens_per_s"] == 7.0 and d["conditional"] == [0.8, 0.5, 1.0]
    json.dumps(d)
    rep = {"num_prompts": 2, "k": 3, "temperature": 0.0, "top_p": 1.0, "top_k": 0, "max_new_tokens": 9,
           "drafter": d, "ngram": d, "plain": {"tau": 1.0, "tokens_per_s": 3.5}, "speedup": 2.0,
           "ngram_speedup": 2.0, "greedy_mismatches": []}
    md = report_markdown(rep)
    assert "| drafter | 2.000 | 0.615 | 7.0 | 2.00x |" in md
    assert "| drafter cond acc_k | 0.800 | 0.500 | 1.000 |" in md


@pytest.mark.parametrize("mutate, match", [
    (lambda r: r.emitted.pop(), "one entry per step"),
    (lambda r: r.drafted.__setitem__(0, 4), "step 0"),  # more drafts than k
    (lambda r: r.emitted.__setitem__(1, 3), "step 1"),  # more than verifier_accepted + 1
    (lambda r: r.emitted.__setitem__(1, 0), "step 1"),  # a step emits at least one token
    (lambda r: r.accepted.__setitem__(0, 2), "step 0"),  # accepted != min(verifier_accepted, emitted)
    (lambda r: r.verifier_accepted.__setitem__(1, 4), "step 1"),  # accepted more than drafted
])
def test_inconsistent_steps_are_refused(mutate, match):
    r = result(A, 1.0)
    mutate(r)
    s = AcceptanceStats(3)
    with pytest.raises(SpeculatorsError, match=match):
        s.add(r)
    assert s.steps == 0 and s.tokens == 0  # nothing half-added


def test_run_eval_counts_what_was_emitted():
    """Issue 9 item 9 through the report: an oracle drafter (the target's greedy continuation, past the stop
    token) with K=6; the report's tau is emitted tokens / steps."""
    V, K = 96, 6
    target = build_tiny_target(vocab_size=V, hidden_size=64, num_layers=2, seed=1)
    # untied random lm_head: greedy continuations through several distinct tokens (tied: one token repeated)
    target.model.lm_head.weight = torch.nn.Parameter(torch.randn(V, 64, generator=torch.Generator().manual_seed(123)))
    for seed in range(10):
        prompt = torch.randint(0, V, (8,), generator=torch.Generator().manual_seed(seed)).tolist()
        cont = plain_decode(target, prompt, 24, eos_ids=set()).tokens
        js = [j for j in range(8, 13) if cont[j] not in cont[:j]]
        if js:
            j = js[0]
            break
    else:
        pytest.skip("no greedy continuation with a fresh token in range")

    class Oracle(NGramProposer):
        def propose(self, state, k, sampling=None, generator=None):
            n_gen = len(state.tokens) - len(prompt)
            return Proposal(torch.tensor(cont[n_gen:n_gen + k], dtype=torch.int64))

    rep = run_eval(target, Oracle(), [{"id": "p0", "input_ids": prompt}], K, 40, SamplingParams.uniform(1), eos_ids={cont[j]})
    d = rep["drafter"]
    assert rep["greedy_mismatches"] == [] and rep["stop_token_ids"] == [cont[j]]
    assert d["tokens"] == rep["plain"]["tokens"] == rep["ngram"]["tokens"] == j + 1
    assert d["steps"] == 2 and d["emitted"] == j
    assert d["tau"] == (d["tokens"] - 1) / d["steps"] == j / 2  # the old report said 7.0
    assert d["acceptance_rate"] == 1.0 and d["accepted"] == K + j - 7 and d["verifier_accepted"] == 2 * K
    assert rep["plain"]["tau"] == 1.0 and rep["plain"]["steps"] == j
    assert rep["ngram"]["emitted"] == j
