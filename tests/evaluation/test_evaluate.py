"""Acceptance statistics the eval report prints, on hand-made step lists with values worked out by hand,
and run_eval's counts on a tiny target with an oracle drafter."""

from __future__ import annotations

import json

import pytest
import torch

from speculators.evaluation.settings import DEFAULT_METHODS, EvalSettings
from speculators.decode.proposal import Proposal
from speculators.errors import SpeculatorsError
from speculators.evaluation.report import render_markdown as report_markdown
from speculators.evaluation.acceptance import AcceptanceStats
from speculators.evaluation.runner import run_eval
from speculators.decode.state import GenerationResult
from speculators.decode.loop import plain_decode
from speculators.decode.proposers import SuffixProposer
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
    assert stats.drafted == 13 and stats.accepted == stats.verifier_accepted == 8
    assert stats.acceptance_rate == 8 / 13 == stats.accepted / stats.drafted
    # accepted and emitted: A 3+1+0+0, B 1+2 = 7 (B's 3rd accepted draft came after the stop token)
    assert stats.accepted_emitted == 7


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
    # ratios whose denominator is zero are n/a (None), never 0
    assert s.steps == 3 and s.tokens == 5 and s.tau == 1.0 and s.acceptance_rate is None
    assert s.per_position == [None, None] and s.conditional == [None, None] and s.tokens_per_s == 10.0
    assert AcceptanceStats(2).tau == 1.0 and AcceptanceStats(2).tokens_per_s is None
    d = AcceptanceStats(2).as_dict()
    assert d["drafted_per_step"] is None and d["verified_per_step"] is None


def test_zero_denominators_render_as_na():
    """A plain-like row (nothing drafted) and a pass without time render as n/a in every format."""
    from speculators.evaluation.report import fmt, render_markdown

    assert fmt(None, ".3f") == "n/a" and fmt(0.5, ".2f", "x") == "0.50x"
    s = AcceptanceStats(1)
    s.add(result([(0, 0, 1)] * 2, 0.0))
    row = {"method": "ngram", "k": 1, "batch_size": 1, "best_k": True, "tau_ci": [1.0, 1.0], "speedup": None,
           **s.as_dict()}
    rep = {"num_prompts": 1, "k": 1, "ks": [1], "batch_size": 1, "batch_sizes": [1], "temperature": 0.0,
           "top_p": 1.0, "top_k": 0, "max_new_tokens": 4, "methods": ["ngram"], "rows": [row],
           "plain_rows": [{"batch_size": 1, "tau": 1.0, "tokens_per_s": None}], "ngram": row,
           "headline": {"batch_size": 1, "k": 1}, "bootstrap": {"resamples": 10}, "greedy_mismatches": []}
    md = render_markdown(rep)
    assert "| n-gram (prompt lookup) | 1 ★ | 1.000 [1.000, 1.000] | n/a | n/a | n/a |" in md
    assert "| ngram acc_k | n/a |" in md


def test_as_dict_and_markdown(stats):
    d = stats.as_dict()
    assert d["tau"] == 2.0 and d["emitted"] == 12 and d["accepted"] == 8 and d["accepted_emitted"] == 7
    assert d["drafted"] == 13 and d["tokens_per_s"] == 7.0 and d["conditional"] == [0.8, 0.5, 1.0]
    json.dumps(d)
    row = {**d, "method": "drafter", "k": 3, "batch_size": 1, "tau_ci": [1.5, 2.5], "speedup": 2.0, "best_k": True}
    rep = {"num_prompts": 2, "k": 3, "ks": [3], "batch_size": 1, "batch_sizes": [1], "temperature": 0.0,
           "top_p": 1.0, "top_k": 0, "max_new_tokens": 9, "methods": ["drafter"], "rows": [row],
           "plain_rows": [{"batch_size": 1, "tau": 1.0, "tokens_per_s": 3.5}], "headline": {"batch_size": 1, "k": 3},
           "bootstrap": {"resamples": 1000}, "drafter": row, "greedy_mismatches": []}
    md = report_markdown(rep, plots={"per_position": "pp.png"})
    assert "| drafter | 3 ★ | 2.000 [1.500, 2.500] | 0.615 | 7.0 | 2.00x |" in md  # tau with its CI; best K
    assert "| plain target | - | 1.000 | - | 3.5 | 1.00x |" in md
    assert "![per-position acceptance](pp.png)" in md and "tau_vs_k" not in md
    assert "| drafter cond acc_k | 0.800 | 0.500 | 1.000 |" in md
    assert "| drafter | 6 | 13 | 8 | 7 | 12 |" in md  # steps, drafted, accepted, accepted & emitted, emitted


def test_report_counts_are_self_consistent(stats):
    """Review finding: the report's ``accepted`` counted only accepted-AND-emitted drafts (7 here), so
    accepted / drafted (7/13) disagreed with acceptance_rate (8/13). Now accepted / drafted is the rate,
    and the emitted view has its own field."""
    d = stats.as_dict()
    assert d["accepted"] / d["drafted"] == d["acceptance_rate"] == 8 / 13
    assert d["emitted"] / d["steps"] == d["tau"]
    assert d["accepted_emitted"] == 7 < d["accepted"]
    assert "verifier_accepted" not in d  # one name per count


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
    """The stop token through the report: an oracle drafter (the target's greedy continuation, past the stop
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

    class Oracle(SuffixProposer):  # batched protocol; the state's tokens are prompt + generated
        def propose(self, states, ks, sampling=None, generators=None):
            return [Proposal(torch.tensor(cont[len(s.tokens) - len(prompt):][:k], dtype=torch.int64))
                    for s, k in zip(states, ks)]

    rep = run_eval(target, Oracle(), [{"id": "p0", "input_ids": prompt}], EvalSettings(K, 40, sampling=SamplingParams.uniform(1), eos_ids={cont[j]}))
    d = rep["drafter"]
    assert rep["greedy_mismatches"] == [] and rep["stop_token_ids"] == [cont[j]]
    assert d["tokens"] == rep["plain"]["tokens"] == rep["ngram"]["tokens"] == j + 1
    assert d["steps"] == 2 and d["emitted"] == j
    assert d["tau"] == (d["tokens"] - 1) / d["steps"] == j / 2  # the old report said 7.0
    assert d["acceptance_rate"] == 1.0 and d["accepted"] == 2 * K and d["accepted_emitted"] == K + j - 7
    assert d["accepted"] / d["drafted"] == d["acceptance_rate"]
    assert rep["plain"]["tau"] == 1.0 and rep["plain"]["steps"] == j
    assert rep["ngram"]["emitted"] == j


# ----------------------------------------------------------------------------- the batched report


def test_bootstrap_ci_is_the_documented_percentile_bootstrap():
    """The CI equals a plain loop over the documented resamples (numpy default_rng(seed), prompts drawn
    with replacement, tau of a resample = its emitted / its steps), and behaves like a CI."""
    import numpy as np

    from speculators.evaluation.acceptance import bootstrap_tau_ci

    emitted, steps = [10, 4, 30, 7, 12], [5, 4, 10, 7, 3]
    lo, hi = bootstrap_tau_ci(emitted, steps, resamples=200, seed=3)
    idx = np.random.default_rng(3).integers(0, 5, size=(200, 5))
    taus = sorted(sum(emitted[i] for i in row) / sum(steps[i] for i in row) for row in idx)
    assert (lo, hi) == pytest.approx((float(np.quantile(taus, 0.025)), float(np.quantile(taus, 0.975))))
    assert lo < sum(emitted) / sum(steps) < hi
    assert bootstrap_tau_ci(emitted, steps, resamples=200, seed=3) == (lo, hi)  # fixed seed: reproducible
    assert bootstrap_tau_ci([6, 6, 6], [3, 3, 3]) == (2.0, 2.0)  # identical prompts: no spread
    assert bootstrap_tau_ci([], []) == (1.0, 1.0)
    with pytest.raises(SpeculatorsError, match="step counts"):
        bootstrap_tau_ci([1], [1, 2])


class RandomDrafter:
    """A batched drafter drafting from its own per-request generator with a uniform q (the neural path:
    probabilities given)."""

    def __init__(self, vocab):
        self.vocab = vocab

    def start(self, input_ids, features):
        return None

    def propose(self, states, ks, sampling=None, generators=None):
        out = []
        for i, k in enumerate(ks):
            g = generators[i] if generators else None
            ids = torch.randint(0, self.vocab, (k,), generator=g)
            out.append(Proposal(ids, torch.full((k, self.vocab), 1.0 / self.vocab)))
        return out

    def advance(self, states, new_ids, features):
        pass


@pytest.fixture(scope="module")
def tiny():
    target = build_tiny_target(vocab_size=64, hidden_size=32, num_layers=2, seed=2)
    prompts = [{"id": f"p{i}", "input_ids": torch.randint(0, 64, (5 + 2 * i,),
                                                          generator=torch.Generator().manual_seed(i)).tolist()}
               for i in range(3)]
    return target, prompts


def test_run_eval_sweeps_k_and_batch_sizes(tiny, monkeypatch):
    import speculators.evaluation.runner as ev

    target, prompts = tiny
    calls = []
    real = ev._generate

    def spy(target, proposer, ids, k, max_new, st, b, *a, **kw):  # + prompts, tokens, sampling
        calls.append((type(proposer).__name__, k, b, len(ids), max_new, (st.temperature, st.top_k, st.top_p)))
        return real(target, proposer, ids, k, max_new, st, b, *a, **kw)

    monkeypatch.setattr(ev, "_generate", spy)
    rep = run_eval(target, RandomDrafter(64), prompts, EvalSettings([2, 1], 8, eos_ids=set(), batch_size=2))
    # warm-up first: plain and every method once, 4 tokens of one prompt at the largest K (sampling as measured)
    warm, calls = calls[:5], calls[5:]
    assert [c[:5] for c in warm] == [("NoneType", 0, 1, 1, 4), ("RandomDrafter", 2, 1, 1, 4),
                                     ("NGramProposer", 2, 1, 1, 4), ("SuffixProposer", 2, 1, 1, 4),
                                     ("HybridProposer", 2, 1, 1, 4)]
    assert {c[5] for c in warm + calls} == {(0.0, 0, 1.0)}
    measured = [c[:3] for c in calls]
    # plain decoding runs ONCE per batch size; every method once per K and batch size
    assert [c for c in measured if c[0] == "NoneType"] == [("NoneType", 0, 1), ("NoneType", 0, 2)]
    assert len(measured) == 2 * (1 + 4 * 2)
    assert rep["ks"] == [1, 2] and rep["batch_sizes"] == [1, 2] and rep["methods"] == list(DEFAULT_METHODS)
    assert len(rep["rows"]) == 2 * 4 * 2
    assert rep["greedy_mismatches"] == []  # every proposer, K and batch size == plain greedy at batch 1
    for b in (1, 2):
        plain = next(p for p in rep["plain_rows"] if p["batch_size"] == b)
        for m in DEFAULT_METHODS:
            rows = [r for r in rep["rows"] if r["batch_size"] == b and r["method"] == m]
            assert sorted(r["k"] for r in rows) == [1, 2]
            best = [r for r in rows if r["best_k"]]
            assert len(best) == 1 and best[0]["speedup"] == max(r["speedup"] for r in rows)
            assert rep["best_k"][str(b)][m] == best[0]["k"]
            for r in rows:
                assert r["speedup"] == pytest.approx(r["tokens_per_s"] / plain["tokens_per_s"])  # same batch size
                assert r["tau_ci"][0] <= r["tau"] <= r["tau_ci"][1]
                assert r["tokens"] == plain["tokens"] == 3 * 8
                assert len(r["per_position"]) == r["k"]
    # headline: the largest batch size and the drafter's best K there
    assert rep["headline"] == {"batch_size": 2, "k": rep["best_k"]["2"]["drafter"]} and rep["k"] == rep["headline"]["k"]
    assert rep["drafter"]["batch_size"] == 2 and rep["plain"]["batch_size"] == 2
    hy = [r for r in rep["rows"] if r["method"] == "hybrid"]
    assert all(sum(r["proposals"].values()) > 0 for r in hy)
    # the warm-up's (and other passes') proposals are not counted in a row
    assert all(sum(r["proposals"].values()) <= r["steps"] for r in hy), hy  # at most one per request and step
    json.dumps(rep)
    # sampled: the warm-up samples like the measured passes (Triton's sampling kernels compile on first use)
    from speculators.verify import SamplingParams

    calls.clear()
    run_eval(target, RandomDrafter(64), prompts[:1], EvalSettings([1], 4, sampling=SamplingParams.uniform(1, 0.5, 5, 0.9), eos_ids=set(), methods=("ngram",)))
    assert [c[0] for c in calls] == ["NoneType", "NGramProposer", "NoneType", "NGramProposer"]
    assert {c[5] for c in calls} == {(0.5, 5, 0.9)}


def test_run_eval_reports_every_mismatch(tiny, monkeypatch):
    """The losslessness check can fail: a pass whose output differs from plain greedy is reported with its
    proposer, K and batch size."""
    import speculators.evaluation.runner as ev

    target, prompts = tiny
    real = ev._generate

    def corrupt(target, proposer, ids, k, *a, **kw):
        out = real(target, proposer, ids, k, *a, **kw)
        if type(proposer).__name__ == "SuffixProposer" and k == 2 and len(ids) > 1:  # not the warm-up
            out.results[1].tokens[3] = (out.results[1].tokens[3] + 1) % 64
        return out

    monkeypatch.setattr(ev, "_generate", corrupt)
    rep = run_eval(target, RandomDrafter(64), prompts, EvalSettings([1, 2], 6, eos_ids=set(), methods=("suffix",)))
    (m,) = rep["greedy_mismatches"]
    assert {k: m[k] for k in ("prompt", "proposer", "k", "batch_size", "first_diff")} == {
        "prompt": "p1", "proposer": "suffix", "k": 2, "batch_size": 1, "first_diff": 3}
    # classified at the diverging position (speculators.evaluation.greedy_check): float32, so a failure whatever the gap
    assert m["dtype"] == "float32" and m["near_tie"] is False and m["logit_gap"] >= 0.0
    assert rep["greedy_check"]["failures"] == 1 and rep["greedy_check"]["passed"] is False
    assert "ERROR: 1 mismatches are not near-ties" in report_markdown(rep)


def test_run_eval_sampled_has_no_greedy_check(tiny):
    target, prompts = tiny
    rep = run_eval(target, RandomDrafter(64), prompts, EvalSettings(2, 6, sampling=SamplingParams.uniform(1, 0.8), eos_ids=set(), methods=("drafter", "hybrid")))
    assert rep["greedy_mismatches"] is None and rep["temperature"] == pytest.approx(0.8)
    # sampled: the drafter also under vLLM's default draft_sample_method (argmax drafts, point masses)
    assert {r["method"] for r in rep["rows"]} == {"drafter", "drafter_argmax", "hybrid"} and "ngram" not in rep


@pytest.mark.parametrize("kw, match", [({"k": 0}, "k: expected"), ({"k": []}, "k: expected"),
                                       ({"batch_size": 0}, "batch_size"), ({"methods": ("medusa",)}, "allowed"),
                                       ({"prompts": []}, "no prompts")])
def test_run_eval_bad_arguments(tiny, kw, match):
    target, prompts = tiny
    args = {"k": 2, "prompts": prompts, **kw}
    with pytest.raises(SpeculatorsError, match=match):
        prompts = args.pop("prompts")
        run_eval(target, RandomDrafter(64), prompts, EvalSettings(args.pop("k"), 4, **args))


def test_write_report_embeds_the_plots(tiny, tmp_path):
    from speculators.evaluation.report import PLOT_FILES
    from speculators.evaluation.runner import write_report

    target, prompts = tiny
    rep = run_eval(target, RandomDrafter(64), prompts[:2], EvalSettings([1, 3], 6, eos_ids=set(), batch_size=2))
    out = write_report(rep, tmp_path / "rep")
    md = (out / "report.md").read_text()
    for name in PLOT_FILES.values():
        assert (out / name).read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
        assert f"]({name})" in md  # embedded with a relative link
    assert json.loads((out / "report.json").read_text())["plots"] == PLOT_FILES
    assert "## Batch size 1" in md and "## Batch size 2" in md and "suffix decoding" in md and "hybrid" in md
    assert md.count(" ★ |") == 2 * 4  # one best K per method and batch size


def test_compare_rows(tiny):
    from speculators.evaluation.report import compare_markdown
    from speculators.evaluation.runner import compare_rows

    target, prompts = tiny
    a = run_eval(target, RandomDrafter(64), prompts[:2], EvalSettings(1, 5, eos_ids=set()))
    b = run_eval(target, RandomDrafter(64), prompts[:2], EvalSettings(1, 5, eos_ids=set(), methods=("drafter", "hybrid")))
    rows = compare_rows([("A", a), ("B", b)])
    assert [(r["checkpoint"], r["method"]) for r in rows] == [
        ("A", "drafter"), ("-", "ngram"), ("-", "suffix"), ("A", "hybrid"), ("B", "drafter"), ("B", "hybrid")]
    assert "| B | drafter | 1 | 1 ★ |" in compare_markdown(rows)
    for r in rows:  # the drafting / verify split of every row travels into the compare table
        src = next(x for x in (a if r["checkpoint"] != "B" else b)["rows"] if x["method"] == r["method"])
        assert r["draft_ms_per_step"] == src["draft_ms_per_step"] and r["per_position"] == src["per_position"]
        assert f"| {r['draft_ms_per_step']:.2f} | {r['verify_ms_per_step']:.2f} |" in compare_markdown(rows)
    c = run_eval(target, RandomDrafter(64), prompts[:2], EvalSettings(1, 4, eos_ids=set(), methods=("drafter",)))
    with pytest.raises(SpeculatorsError, match="max_new_tokens"):
        compare_rows([("A", a), ("C", c)])


def test_precision_block_puts_batch_1_rows_against_the_faster_plain_decoding():
    """``precision_block``: the faster of two precisions' plain decoding is the baseline; batch-size-8 rows stay
    out; a baseline that took no time gives n/a (None), never 0."""
    from speculators.evaluation.runner import precision_block

    report = {"target": {"dtype": "bfloat16"},
              "plain_rows": [{"batch_size": 1, "tokens_per_s": 20.0}, {"batch_size": 8, "tokens_per_s": 90.0}],
              "rows": [{"method": "drafter", "k": 4, "batch_size": 1, "tokens_per_s": 30.0},
                       {"method": "drafter", "k": 4, "batch_size": 8, "tokens_per_s": 120.0}]}
    pb = precision_block(report, {"dtype": "float32", "tokens_per_s": 25.0})
    assert pb["fastest"] == "float32" and pb["plain_tokens_per_s"] == {"bfloat16": 20.0, "float32": 25.0}
    assert pb["rows"] == [{"method": "drafter", "k": 4, "tokens_per_s": 30.0, "speedup_vs_fastest_plain": 1.2}]
    pb = precision_block(report, {"dtype": "float32", "tokens_per_s": 10.0})
    assert pb["fastest"] == "bfloat16" and pb["rows"][0]["speedup_vs_fastest_plain"] == 1.5
    report["plain_rows"][0]["tokens_per_s"] = None
    pb = precision_block(report, {"dtype": "float32", "tokens_per_s": None})
    assert pb["rows"][0]["speedup_vs_fastest_plain"] is None
