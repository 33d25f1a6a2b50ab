"""vLLM's two draft-sampling conventions at temperature > 0 (``draft_sample_method``): argmax drafts
verified as point masses (vLLM's default, :class:`speculators.decode.proposers.ArgmaxDrafts`) and drafts sampled
from the drafter and verified with its distribution (``probabilistic``, a drafter as it is). Both must be
lossless, and the eval must report tau under both, naming the engine setting each needs."""

from __future__ import annotations

import json

import pytest
import torch

from speculators.evaluation.settings import EvalSettings
from speculators.decode.proposal import Proposal
from speculators.evaluation.report import ENGINE_SETTINGS, render_markdown as report_markdown
from speculators.evaluation.runner import run_eval
from speculators.decode.loop import speculative_generate
from speculators.decode.proposers import ArgmaxDrafts
from speculators.verify import SamplingParams
from speculators.verify.testing import assert_distribution, chi2_check
from test_batched import V, _exact_first_tokens, rand_prompt, untied_target


class PeakedDrafter:
    """A neural-style drafter: ``q(. | prev) = softmax(3 * T[prev])`` over the target vocabulary. Under a
    request's sampling settings it samples its drafts from ``q`` with the request's generator and returns
    ``q``; with ``sampling=None`` it drafts ``argmax q`` (greedy drafting, as every family does)."""

    def __init__(self, vocab: int = V, seed: int = 0, scale: float = 3.0):
        self.q = (torch.randn(vocab, vocab, generator=torch.Generator().manual_seed(seed)) * scale).softmax(-1)

    def start(self, input_ids, features=None):
        return input_ids.reshape(-1).tolist()

    def propose(self, states, ks, sampling=None, generators=None):
        out = []
        for i, (s, k) in enumerate(zip(states, ks)):
            g = generators[i] if generators is not None else None
            prev, toks, probs = s[-1], [], []
            for _ in range(k):
                q = self.q[prev]
                prev = int(q.argmax()) if sampling is None else int(torch.multinomial(q, 1, generator=g))
                toks.append(prev)
                probs.append(q)
            out.append(Proposal(torch.tensor(toks, dtype=torch.int64),
                                torch.stack(probs) if toks else None))
        return out

    def advance(self, states, new_ids, features):
        for s, ids in zip(states, new_ids):
            s.extend(ids.tolist())


class LeakyArgmax(PeakedDrafter):
    """The fault ArgmaxDrafts avoids: argmax drafts verified against the drafter's full ``q`` as if they
    had been sampled from it (accept with min(1, p/q) instead of p: too often where q is flat)."""

    def propose(self, states, ks, sampling=None, generators=None):
        return super().propose(states, ks, None, None)


@pytest.fixture(scope="module")
def target():
    return untied_target()


def test_argmax_drafts_are_the_argmax_as_point_masses_and_draw_nothing():
    d = PeakedDrafter()
    w = ArgmaxDrafts(d)
    states = [w.start(torch.tensor(rand_prompt(5, s)), None) for s in (1, 2)]
    gens = [torch.Generator().manual_seed(7), torch.Generator().manual_seed(8)]
    before = [g.get_state().clone() for g in gens]
    props = w.propose(states, [3, 0], SamplingParams.uniform(2, 0.9), gens)
    assert [p.probs for p in props] == [None, None]
    prev, want = states[0][-1], []
    for _ in range(3):
        prev = int(d.q[prev].argmax())
        want.append(prev)
    assert props[0].token_ids.tolist() == want and props[1].token_ids.numel() == 0
    assert all(torch.equal(g.get_state(), b) for g, b in zip(gens, before))  # nothing drawn
    sampled = d.propose(states, [3, 0], SamplingParams.uniform(2, 0.9), gens)
    assert sampled[0].probs is not None  # the wrapped drafter by itself keeps its distributions


def _first_tokens(target, proposer, prompt, temp, n, seed0):
    sp = SamplingParams.uniform(n, temp)
    out = speculative_generate(target, proposer, [prompt] * n, [3] * n, 3, sp, batch_size=32, eos_ids=set(),
                               seeds=[seed0 + i for i in range(n)])
    return torch.tensor([r.tokens[:2] for r in out.results]), out


@pytest.mark.parametrize("temp", [0.7, 1.2])
def test_both_conventions_are_lossless_and_the_leaky_one_is_not(target, temp):
    """Argmax drafts verified as point masses and sampled drafts verified with q both give the target's
    own sampling distribution of the first two tokens (chi-square, fixed seeds); argmax drafts verified
    against q (the leak) do not."""
    prompt = rand_prompt(6, 11)
    joint12, _ = _exact_first_tokens(target, prompt, temp, 0, 1.0)
    for name, proposer in (("argmax", ArgmaxDrafts(PeakedDrafter())), ("probabilistic", PeakedDrafter())):
        toks, out = _first_tokens(target, proposer, prompt, temp, 500, 3000)
        assert_distribution(toks[:, 0] * V + toks[:, 1], joint12, f"{name} drafts at T={temp}")
        acc = sum(sum(r.verifier_accepted) for r in out.results)
        assert 0 < acc < sum(sum(r.drafted) for r in out.results)
    toks, _ = _first_tokens(target, LeakyArgmax(scale=0.5), prompt, temp, 1500, 3000)
    stat, thr, tv, _ = chi2_check(toks[:, 0] * V + toks[:, 1], joint12)
    assert stat > thr, (stat, thr, tv)


def test_eval_reports_tau_under_both_conventions_at_temperature_above_zero(target, monkeypatch):
    import speculators.evaluation.runner as ev

    seen, real = [], ev._generate

    def spy(target, proposer, ids, k, *a, **kw):
        seen.append((type(proposer).__name__, len(ids)))
        return real(target, proposer, ids, k, *a, **kw)

    monkeypatch.setattr(ev, "_generate", spy)
    prompts = [{"id": f"p{i}", "input_ids": rand_prompt(5 + i, 20 + i)} for i in range(3)]
    rep = run_eval(target, PeakedDrafter(), prompts, EvalSettings([2], 8, sampling=SamplingParams.uniform(1, 0.8), eos_ids=set(), methods=("drafter", "ngram")))
    assert rep["methods"] == ["drafter", "drafter_argmax", "ngram"]
    by = {r["method"]: r for r in rep["rows"]}
    assert by["drafter"]["draft_sample_method"] == "probabilistic"
    assert by["drafter_argmax"]["draft_sample_method"] == "greedy"
    assert by["ngram"]["draft_sample_method"] is None
    sc = rep["serving_conventions"]
    assert [r["method"] for r in sc["rows"]] == ["drafter_argmax", "drafter"]
    assert [r["engine_setting"] for r in sc["rows"]] == [ENGINE_SETTINGS["drafter_argmax"], ENGINE_SETTINGS["drafter"]]
    for r in sc["rows"]:
        assert r["tau"] == by[r["method"]]["tau"] and r["tau_ci"] == by[r["method"]]["tau_ci"]
    # measured passes (3 prompts): the drafter as it is, then wrapped in ArgmaxDrafts
    assert [n for n, m in seen if m == 3] == ["NoneType", "PeakedDrafter", "ArgmaxDrafts", "NGramProposer"]
    md = report_markdown(rep)
    assert "## Serving conventions" in md and 'draft_sample_method: "greedy"' in md
    assert 'draft_sample_method: "probabilistic"' in md
    json.dumps(rep)


def test_greedy_eval_has_one_drafter_row(target):
    """At temperature 0 both conventions are the same greedy decode: no second row, no section."""
    prompts = [{"id": "p0", "input_ids": rand_prompt(6, 30)}]
    rep = run_eval(target, PeakedDrafter(), prompts, EvalSettings([2], 6, eos_ids=set(), methods=("drafter",)))
    assert rep["methods"] == ["drafter"] and "serving_conventions" not in rep
    assert rep["rows"][0]["draft_sample_method"] is None and rep["greedy_mismatches"] == []
