"""Greedy losslessness in low precision (``speculators.evaluation.greedy_check``): every mismatch with plain greedy
decoding is classified at its first diverging position, as a near-tie of the target's logits (within the
eval dtype's rounding) or as a verifier failure, and only failures fail the check.

* A forced near-tie: a tiny bfloat16 target whose tied embedding rows come in identical pairs (token
  ``2i + 1`` is a copy of ``2i``), so every greedy token ``2i`` has a twin with EXACTLY its logit; an output
  that took the twin is a near-tie (gap 0), listed and counted, and the check passes. The same output from a
  float32 target is a failure (float32: every mismatch is).
* A broken verifier: the rejection sampler is replaced by one that emits the target's LEAST likely token
  whenever drafts are verified: the mismatches are failures (their logit gap is far beyond the bound).
"""

from __future__ import annotations

import pytest
import torch

from speculators.evaluation.settings import EvalSettings
from speculators.decode.proposal import Proposal
from speculators.evaluation.report import render_markdown
from speculators.evaluation.runner import run_eval
from speculators.evaluation.greedy_check import classify_mismatch, greedy_summary, next_token_logits
from speculators.target import build_tiny_target

V = 64


class RandomDrafter:
    """A batched drafter of uniformly random tokens (every step drafts: the verifier always runs)."""

    def start(self, input_ids, features):
        return None

    def propose(self, states, ks, sampling=None, generators=None):
        return [Proposal(torch.randint(0, V, (k,), generator=g), torch.full((k, V), 1.0 / V))
                for k, g in zip(ks, generators or [None] * len(ks))]

    def advance(self, states, new_ids, features):
        pass


def twin_target(dtype: torch.dtype):
    """A tiny target whose (tied) embedding rows 2i and 2i+1 are equal: logits of twins tie exactly."""
    t = build_tiny_target(vocab_size=V, hidden_size=32, num_layers=2, seed=3)
    with torch.no_grad():
        w = t.model.get_input_embeddings().weight
        w[1::2] = w[0::2]
    t.model.to(dtype)
    return t


PROMPTS = [{"id": f"p{i}", "input_ids": torch.randint(0, V, (4 + 3 * i,),
                                                      generator=torch.Generator().manual_seed(10 + i)).tolist()}
           for i in range(3)]


def _take_the_twin(monkeypatch, position: int = 3):
    """Every ngram pass's output of the second prompt takes the twin of plain greedy's token at ``position``."""
    import speculators.evaluation.runner as ev

    real = ev._generate

    def twin(target, proposer, ids, k, *a, **kw):
        out = real(target, proposer, ids, k, *a, **kw)
        if type(proposer).__name__ == "NGramProposer" and len(ids) > 1:  # not the warm-up
            toks = out.results[1].tokens
            toks[position] = toks[position] ^ 1  # 2i <-> 2i + 1
        return out

    monkeypatch.setattr(ev, "_generate", twin)


def test_greedy_tokens_of_the_twin_target_are_even():
    """The premise of the forced tie: both twins have the same logit and argmax takes the first (even) one."""
    t = twin_target(torch.bfloat16)
    logits = next_token_logits(t, PROMPTS[0]["input_ids"], [], 1)
    assert logits.dtype == torch.float32 and logits.shape == (V,)
    assert torch.equal(logits[0::2], logits[1::2])
    assert int(logits.argmax()) % 2 == 0


def test_a_forced_near_tie_in_bfloat16_is_a_near_tie_and_the_check_passes(monkeypatch):
    t = twin_target(torch.bfloat16)
    _take_the_twin(monkeypatch)
    rep = run_eval(t, None, PROMPTS, EvalSettings([2], 8, eos_ids=set(), methods=("ngram",)))
    mm = rep["greedy_mismatches"]
    assert len(mm) == 1  # listed, never hidden
    m = mm[0]
    assert m["prompt"] == "p1" and m["proposer"] == "ngram" and m["first_diff"] == 3
    assert m["output_token"] == m["reference_token"] ^ 1 and m["dtype"] == "bfloat16"
    assert m["near_tie"] is True and m["logit_gap"] == 0.0 and m["rounding_bound"] > 0
    assert set(m["shapes"]) == {"sequential", "verify"}
    assert all(s["argmax"] == m["reference_token"] for s in m["shapes"].values())
    gc = rep["greedy_check"]
    assert gc == {"dtype": "bfloat16", "mismatches": 1, "near_tie": 1, "failures": 0, "passed": True,
                  "by_proposer": {"ngram": {"mismatches": 1, "near_tie": 1, "failures": 0}}}
    md = render_markdown(rep)
    assert "1 mismatches, 1 on near-ties" in md and "ERROR" not in md


def test_the_same_tie_in_float32_is_a_failure(monkeypatch):
    t = twin_target(torch.float32)
    _take_the_twin(monkeypatch)
    rep = run_eval(t, None, PROMPTS, EvalSettings([2], 8, eos_ids=set(), methods=("ngram",)))
    (m,) = rep["greedy_mismatches"]
    assert m["dtype"] == "float32" and m["logit_gap"] == 0.0 and m["near_tie"] is False
    assert rep["greedy_check"]["failures"] == 1 and rep["greedy_check"]["passed"] is False
    assert "ERROR: 1 mismatches are not near-ties" in render_markdown(rep)


def test_a_broken_verifier_is_a_failure_in_bfloat16(monkeypatch):
    """A verifier that emits the least likely token of the first verified position (instead of the
    target's choice) whenever drafts are verified: a real failure, even in bfloat16."""
    import speculators.decode.chain as gen  # the chain step's verifier call
    from speculators.verify import RejectionOutput

    real = gen.rejection_sample

    def broken(drafts, ns, probs, logits, *a, **kw):
        out = real(drafts, ns, probs, logits, *a, **kw)
        if sum(ns) == 0:  # plain decoding (the reference) and the prefill step are left alone
            return out
        ids = out.output_token_ids.clone()
        ids[0, 0] = int(logits[0].argmin())
        return RejectionOutput(ids, torch.zeros_like(out.num_accepted))

    monkeypatch.setattr(gen, "rejection_sample", broken)
    t = twin_target(torch.bfloat16)
    rep = run_eval(t, RandomDrafter(), PROMPTS, EvalSettings([2], 8, eos_ids=set(), methods=("drafter",)))
    mm = rep["greedy_mismatches"]
    assert mm, "the broken verifier changed no output"
    assert all(m["near_tie"] is False and m["logit_gap"] > m["rounding_bound"] for m in mm)
    gc = rep["greedy_check"]
    assert gc["failures"] == len(mm) and gc["near_tie"] == 0 and gc["passed"] is False
    assert "ERROR" in render_markdown(rep)


def test_a_length_difference_is_a_failure():
    """An output that is a strict prefix of plain greedy's has no diverging token: not a near-tie."""
    t = twin_target(torch.bfloat16)
    ref = [2, 4, 6]
    out = classify_mismatch(t, PROMPTS[0]["input_ids"], ref, ref[:2], 2)
    assert out == {"position": 2, "reference_token": 6, "output_token": None, "dtype": "bfloat16",
                   "near_tie": False}


def test_the_verify_shape_chunks_end_at_the_prefix():
    """Both shapes give the logits of the same position (float32: equal to rounding), which equal a single
    full forward of prompt + prefix."""
    t = twin_target(torch.float32)
    prompt, prefix = PROMPTS[2]["input_ids"], [2, 8, 10, 12, 14]
    seq = next_token_logits(t, prompt, prefix, 1)
    ver = next_token_logits(t, prompt, prefix, 3)
    full = t.model(torch.tensor([prompt + prefix])).logits[0, -1].float()
    assert torch.allclose(seq, full, atol=1e-5) and torch.allclose(ver, full, atol=1e-5)
    assert not torch.allclose(seq, next_token_logits(t, prompt, prefix[:-1], 1), atol=1e-3)


def test_greedy_summary_counts_per_proposer_and_checkpoint():
    mm = [{"proposer": "drafter", "near_tie": True}, {"proposer": "drafter", "near_tie": False},
          {"proposer": "drafter", "near_tie": True, "checkpoint": "other"}, {"proposer": "plain", "near_tie": True}]
    gc = greedy_summary(mm, "bfloat16")
    assert gc["mismatches"] == 4 and gc["near_tie"] == 3 and gc["failures"] == 1 and gc["passed"] is False
    assert gc["by_proposer"] == {"drafter": {"mismatches": 2, "near_tie": 1, "failures": 1},
                                 "drafter @ other": {"mismatches": 1, "near_tie": 1, "failures": 0},
                                 "plain": {"mismatches": 1, "near_tie": 1, "failures": 0}}
    assert greedy_summary([], "float32")["passed"] is True
    assert greedy_summary(None, "float32") is None


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_no_mismatch_no_classification(dtype):
    t = twin_target(dtype)
    rep = run_eval(t, None, PROMPTS, EvalSettings([2], 6, eos_ids=set(), methods=("ngram",)))
    assert rep["greedy_mismatches"] == [] and rep["greedy_check"]["passed"] is True


@pytest.mark.parametrize("near_tie,exit_code", [(True, 0), (False, 1)])
def test_eval_exits_1_only_on_a_verifier_failure(monkeypatch, tmp_path, near_tie, exit_code):
    """``speculators eval``: a near-tie mismatch is printed and does not fail the command; any other does."""
    from typer.testing import CliRunner

    import speculators.workflows as wf
    from speculators.cli import app

    t = twin_target(torch.bfloat16)
    if near_tie:
        _take_the_twin(monkeypatch)
    else:  # a corrupted output far from the target's choice: not a tie
        import speculators.evaluation.runner as ev

        real = ev._generate

        def corrupt(target, proposer, ids, k, *a, **kw):
            out = real(target, proposer, ids, k, *a, **kw)
            if type(proposer).__name__ == "NGramProposer" and len(ids) > 1:
                toks = out.results[1].tokens
                toks[3] = int(next_token_logits(target, PROMPTS[1]["input_ids"], toks[:3], 1).argmin())
            return out

        monkeypatch.setattr(ev, "_generate", corrupt)
    rep = run_eval(t, None, PROMPTS, EvalSettings([2], 8, eos_ids=set(), methods=("ngram",)))
    monkeypatch.setattr(wf, "eval_run", lambda *a, **kw: (rep, tmp_path))
    r = CliRunner().invoke(app, ["eval", str(tmp_path)])
    assert r.exit_code == exit_code, r.output
    assert "greedy losslessness (bfloat16): 1 mismatches" in r.output
    assert ("ERROR" in r.output) is (not near_tie)
