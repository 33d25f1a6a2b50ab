"""Confidence-gated verification: the gate's rule, its losslessness, and the eval's gated rows.

The gate (:class:`speculators.decode.gating.ConfidenceGate`) cuts a proposal to the drafts before the first
whose survival ``prod_{i<=k} sigmoid(z_i / T_i)`` falls below the threshold. It reads only the drafter's
outputs, so the output distribution must stay the target's; the statistical test below checks that on
a tiny random target with the chi-square machinery of the verifier tests, and checks that the same test
REJECTS a deliberately leaky gate that truncates exactly where the verifier is about to reject (it
peeks at the verifier's random numbers through a clone of the request's generator).

Synthetic proposers with confidence logits stand in for DSpark's head (its family has its own tests).
"""

from __future__ import annotations

import pytest
import torch

from speculators.evaluation.settings import EvalSettings
from speculators.decode.proposal import Proposal
from speculators.errors import SpeculatorsError
from speculators.evaluation.report import render_markdown as report_markdown
from speculators.evaluation.acceptance import AcceptanceStats
from speculators.evaluation.runner import run_eval
from speculators.decode.gating import ConfidenceGate, check_confidence_threshold, survival_probabilities
from speculators.decode.loop import plain_decode, speculative_generate
from speculators.decode.proposers import NGramProposer
from speculators.recipe import eval_spec_with
from speculators.verify import SamplingParams, rejection_sample
from speculators.verify.testing import assert_distribution, chi2_check
from test_batched import V, _exact_first_tokens, rand_prompt, untied_target


@pytest.fixture(scope="module")
def target():
    return untied_target()


class SharpTargetProposer:
    """Drafts from a sharpened copy of the target, ``q(.|ctx) = softmax(target_logits(ctx) / 0.6)`` (drawn with
    the request's own generator; ``probs`` given for even-length states, point masses for odd ones), with
    confidence logits that read only the drafter's own state BEFORE draft k is drawn (as DSpark's ``c_k`` reads
    ``h_k`` and ``x_{k-1}``): ``z_k = 3 * logit(max_t q_k(t))``. (A confidence that read draft k itself, e.g.
    ``logit(q(d_k))``, would let a gate keep a sampled draft because of its own value, which biases speculative
    sampling with ``probs``.) Its state is the token list; it records every call so tests can check what
    ``advance`` received."""

    def __init__(self, target, sharpen: float = 0.6):
        self.target, self.sharpen = target, sharpen
        self.cache: dict[tuple, torch.Tensor] = {}
        self.last_states, self.last_generators, self.last_props = [], [], []
        self.advanced: list[tuple[list[int], list[int]]] = []  # (drafts proposed, new ids) per advance
        self.steps = 0

    def confidence_calibration(self):
        """The declared drafter interface: (temperatures, shifts), the raw confidences here."""
        return torch.ones(8), torch.zeros(8)

    def q(self, ctx: list[int]) -> torch.Tensor:
        key = tuple(ctx)
        if key not in self.cache:
            logits = self.target.features(torch.tensor([ctx]), with_logits=True).logits[0, -1].float()
            self.cache[key] = torch.softmax(logits / self.sharpen, -1)
        return self.cache[key]

    def start(self, input_ids, features=None):
        return input_ids.reshape(-1).tolist()

    def propose(self, states, ks, sampling=None, generators=None):
        self.last_states, self.last_generators, self.last_props = list(states), list(generators or []), []
        for i, (s, k) in enumerate(zip(states, ks)):
            g = generators[i] if generators is not None else None
            ctx, toks, probs = list(s), [], []
            for _ in range(k):
                q = self.q(ctx)
                t = int(torch.multinomial(q, 1, generator=g))
                toks.append(t)
                probs.append(q)
                ctx.append(t)
            qd = torch.tensor([float(p.max()) for p in probs]).clamp(1e-6, 1 - 1e-6)  # not q(d_k): see the class
            z = 3.0 * torch.log(qd / (1 - qd))
            point = len(s) % 2 == 1 or not toks
            self.last_props.append(Proposal(torch.tensor(toks, dtype=torch.int64),
                                            None if point else torch.stack(probs), z if toks else None))
        return list(self.last_props)

    def advance(self, states, new_ids, features):
        by_state = {id(s): p for s, p in zip(self.last_states, self.last_props)}
        for s, ids in zip(states, new_ids):
            p = by_state[id(s)]
            self.advanced.append((p.token_ids.tolist(), ids.tolist()))
            s.extend(ids.tolist())


class PeekingGate:
    """LEAKY on purpose: runs the verifier ahead of time on a CLONE of each request's generator and the
    target's own logits, and truncates each proposal to the drafts the verifier is going to accept (so the
    real verifier never sees a draft it would reject). This uses target information, which a gate must not."""

    def __init__(self, target, temperature: float):
        self.target, self.temperature = target, temperature

    def keep(self, proposer, proposals):
        out = []
        for s, g, p in zip(proposer.last_states, proposer.last_generators, proposals):
            n = int(p.token_ids.numel())
            if n == 0:
                out.append(None)
                continue
            ids = torch.tensor([list(s) + p.token_ids.tolist()])
            logits = self.target.features(ids, with_logits=True).logits[0, -(n + 1):].float()
            clone = torch.Generator().set_state(g.get_state())
            sp = SamplingParams(temperature=torch.tensor([self.temperature]), generators=[clone])
            res = rejection_sample(p.token_ids, [n], p.probs, logits, sp)
            out.append(int(res.num_accepted[0]))
        return out


# ----------------------------------------------------------------------------- the rule
def test_survival_is_the_running_product_of_calibrated_confidences():
    z = torch.tensor([2.0, -1.0, 0.5])
    T = torch.tensor([2.0, 0.5, 1.0, 7.0])
    c = torch.sigmoid(z / T[:3])
    expected = torch.tensor([c[0], c[0] * c[1], c[0] * c[1] * c[2]])
    assert torch.allclose(survival_probabilities(z, T), expected)
    assert torch.allclose(survival_probabilities(z), torch.cumprod(torch.sigmoid(z), 0))
    with pytest.raises(SpeculatorsError, match="confidence_temperature"):
        survival_probabilities(z, torch.tensor([1.0, 1.0]))  # shorter than the drafts
    b = torch.tensor([0.5, -0.25, 1.0, 9.0])  # Platt shifts: c_i = sigmoid(z_i / T_i + b_i)
    cb = torch.sigmoid(z / T[:3] + b[:3])
    assert torch.allclose(survival_probabilities(z, T, b), torch.cumprod(cb, 0))
    assert torch.allclose(survival_probabilities(z, None, b), torch.cumprod(torch.sigmoid(z + b[:3]), 0))
    for bad in (torch.tensor([0.0, 0.0]), torch.tensor([0.0, float("nan"), 0.0])):
        with pytest.raises(SpeculatorsError, match="confidence_bias"):
            survival_probabilities(z, T, bad)


def test_threshold_keeps_the_drafts_before_the_first_survival_below_it():
    gate = ConfidenceGate(0.5)
    assert gate.keep_length(torch.tensor([0.9, 0.6, 0.5, 0.4, 0.3])) == 3  # 0.5 is not below 0.5
    assert gate.keep_length(torch.tensor([0.49, 0.4])) == 0
    assert gate.keep_length(torch.tensor([0.99, 0.98])) == 2
    # the gate reads the proposer's temperatures: raw survival [0.731, 0.534, 0.144] keeps 1 draft at 0.6;
    # with T = 0.25 (logit 1 -> sigmoid(4) = 0.982) it is [0.982, 0.964, 0.017]: 2 drafts
    class P:  # the declared interface (Drafter.confidence_calibration), not buffer names
        confidence_bias = torch.zeros(3)

        def confidence_calibration(self):
            return torch.tensor([0.25, 0.25, 0.25]), self.confidence_bias
    prop = Proposal(torch.tensor([5, 6, 7]), None, torch.tensor([1.0, 1.0, -1.0]))
    gate = ConfidenceGate(0.6)
    assert gate.keep(P(), [prop, None, Proposal(torch.tensor([1]))]) == [2, None, None]
    assert gate.keep(object(), [prop]) == [1]
    # and its shifts (z / T = [4, 4, -4]): b_2 = -4 gives c_2 = sigmoid(0) = 0.5, S_2 = 0.491 < 0.6: 1 draft;
    # b_2 = -3 gives c_2 = sigmoid(1) = 0.731, S_2 = 0.718: 2 drafts
    class PB(P):
        confidence_bias = torch.tensor([0.0, -4.0, 0.0])
    assert gate.keep(PB(), [prop]) == [1]
    PB.confidence_bias = torch.tensor([0.0, -3.0, 0.0])
    assert gate.keep(PB(), [prop]) == [2]
    with pytest.raises(SpeculatorsError, match="confidence_logits has 2 entries for 3 drafts"):
        gate.keep(P(), [Proposal(torch.tensor([5, 6, 7]), None, torch.tensor([1.0, 1.0]))])


def test_cost_aware_mode_maximises_expected_tokens_per_cost():
    s = torch.tensor([0.9, 0.8, 0.3])
    # expected emitted tokens for m = 0..3: 1, 1.9, 2.7, 3.0; per cost [1, 1.2, 1.5, 2.5]: 1, 1.583, 1.8, 1.2
    assert ConfidenceGate(verify_cost=[1.0, 1.2, 1.5, 2.5]).keep_length(s) == 2
    assert ConfidenceGate(verify_cost=[1.0, 1.0, 1.0, 1.0]).keep_length(s) == 3  # free verification: keep all
    assert ConfidenceGate(verify_cost=[1.0, 3.0]).keep_length(s) == 0  # beyond the model: its last entry
    assert ConfidenceGate(0.85, verify_cost=[1.0, 1.0, 1.0, 1.0]).keep_length(s) == 1  # capped by the threshold
    with pytest.raises(SpeculatorsError, match="verify_cost"):
        ConfidenceGate(verify_cost=[1.0, 0.0])


def test_cost_aware_mode_is_a_stopping_time():
    """Keeping draft j may depend only on S_1..S_j (drafts < j): never on S_{j+1}, which reads draft j itself
    (a global argmax over m does: with cost [1, 1.6, 1.6] and S_1 = 0.5 it keeps draft 1 iff S_2 is large,
    i.e. depending on draft 1's own value, which biases sampled output)."""
    gate = ConfidenceGate(verify_cost=[1.0, 1.6, 1.6])
    assert gate.keep_length(torch.tensor([0.5, 0.5])) == gate.keep_length(torch.tensor([0.5, 0.05])) == 0
    g = torch.Generator().manual_seed(0)
    for _ in range(300):
        n = int(torch.randint(1, 6, (1,), generator=g))
        s = torch.cumprod(torch.rand(n, generator=g), 0)
        cost = (1.0 + torch.rand(n + 1, generator=g).cumsum(0) * 0.5).tolist()
        gate = ConfidenceGate(verify_cost=cost)
        m = gate.keep_length(s)
        for j in range(1, n + 1):  # "draft j kept" is decided by the prefix S_1..S_j alone
            assert (m >= j) == (gate.keep_length(s[:j]) == j), (s.tolist(), cost, j)


@pytest.mark.parametrize("bad", [0, 0.0, 1, 1.0, -0.2, 1.5, float("nan"), "high", True])
def test_bad_thresholds_name_the_field(target, bad):
    with pytest.raises(SpeculatorsError, match="confidence_threshold"):
        check_confidence_threshold(bad)
    with pytest.raises(SpeculatorsError, match="confidence_threshold"):
        speculative_generate(target, NGramProposer(), [[1, 2, 3]], 2, 4, confidence_threshold=bad)
    if not isinstance(bad, str):
        with pytest.raises(SpeculatorsError, match=r"--confidence-threshold .*eval\.confidence_threshold"):
            eval_spec_with(None, {"confidence_threshold": bad}, {"confidence_threshold": "--confidence-threshold"})


def test_a_gate_that_keeps_more_drafts_than_proposed_is_refused(target):
    class Greedy:
        def keep(self, proposer, proposals):
            return [int(p.token_ids.numel()) + 1 for p in proposals]

    with pytest.raises(SpeculatorsError, match=r"keep\(\) must give an integer in \[0, 2\]"):
        speculative_generate(target, SharpTargetProposer(target), [rand_prompt(5, 3)], 2, 6, eos_ids=set(),
                             seeds=[0], gate=Greedy())
    with pytest.raises(SpeculatorsError, match="give one of them"):
        speculative_generate(target, SharpTargetProposer(target), [rand_prompt(5, 3)], 2, 6,
                             confidence_threshold=0.5, gate=ConfidenceGate(0.5))


# ----------------------------------------------------------------------------- greedy: never changes the output
@pytest.mark.parametrize("batch_size", [1, 4])
def test_gating_never_changes_greedy_output_and_advance_gets_only_what_was_accepted(target, batch_size):
    prompts = [rand_prompt(n, 50 + n) for n in (3, 6, 9, 12, 5)]
    plain = [plain_decode(target, p, 16, eos_ids=set()).tokens for p in prompts]
    verified = {}
    for thr in (None, 0.2, 0.6, 0.95):
        prop = SharpTargetProposer(target)
        out = speculative_generate(target, prop, prompts, 4, 16, None, batch_size, eos_ids=set(),
                                   seeds=list(range(len(prompts))), confidence_threshold=thr)
        for r, ref in zip(out.results, plain):
            assert r.tokens == ref, thr
            assert len(r.proposed) == len(r.drafted) and all(d <= p for d, p in zip(r.drafted, r.proposed))
            assert all(a <= d for a, d in zip(r.verifier_accepted, r.drafted))
        # the proposer was advanced with accepted drafts of the KEPT prefix + the target's token, never more
        for (drafts, new) in prop.advanced:
            assert new[:-1] == drafts[:len(new) - 1]
        verified[thr] = sum(sum(r.drafted) for r in out.results)
        proposed = sum(sum(r.proposed) for r in out.results)
        assert (verified[thr] == proposed) == (thr is None)
    assert verified[0.95] < verified[0.6] < verified[0.2] <= verified[None]


def test_on_step_sees_the_proposal_the_gate_kept(target):
    """The outcome hook gets the proposal as verified: cut by the gate (ids and confidence logits alike)."""
    prompts = [rand_prompt(n, 70 + n) for n in (4, 7, 5)]
    calls = []
    out = speculative_generate(target, SharpTargetProposer(target), prompts, 4, 12, None, 2, eos_ids=set(),
                               seeds=[1, 2, 3], confidence_threshold=0.6, on_step=lambda *a: calls.append(a))
    for i, r in enumerate(out.results):
        mine = [c for c in calls if c[0] == i]
        assert [int(c[1].token_ids.numel()) for c in mine] == r.drafted
        assert all(c[1].confidence_logits is None or c[1].confidence_logits.numel() == c[1].token_ids.numel()
                   for c in mine)
    assert sum(sum(r.proposed) for r in out.results) > sum(sum(r.drafted) for r in out.results)


def test_wrapper_proposers_declare_the_calibration_of_what_they_wrap():
    """HybridProposer and ArgmaxDrafts declare confidence_calibration() by delegating (the gate reads only
    the declared interface, never a wrapped proposer's attributes)."""
    from speculators.decode.gating import confidence_bias_of, confidence_temperature_of
    from speculators.decode.proposers import ArgmaxDrafts, HybridProposer

    class Calibrated:
        max_speculative_tokens = None

        def confidence_calibration(self):
            return torch.tensor([2.0, 3.0]), torch.tensor([0.5, -0.5])

    class Uncalibrated:
        max_speculative_tokens = None

    for wrap in (HybridProposer, ArgmaxDrafts):
        assert confidence_temperature_of(wrap(Calibrated())).tolist() == [2.0, 3.0]
        assert confidence_bias_of(wrap(Calibrated())).tolist() == [0.5, -0.5]
        assert confidence_temperature_of(wrap(Uncalibrated())) is None
        assert confidence_bias_of(wrap(Uncalibrated())) is None


def test_proposals_without_confidences_are_untouched(target):
    class NoConfidence(SharpTargetProposer):
        def propose(self, states, ks, sampling=None, generators=None):
            return [Proposal(p.token_ids, p.probs) for p in super().propose(states, ks, sampling, generators)]

    prompts = [rand_prompt(8, 7), rand_prompt(5, 8)]
    a = speculative_generate(target, NoConfidence(target), prompts, 3, 12, eos_ids=set(), seeds=[1, 2]).results
    b = speculative_generate(target, NoConfidence(target), prompts, 3, 12, eos_ids=set(), seeds=[1, 2],
                             confidence_threshold=0.9).results
    assert sum(sum(r.drafted) for r in a) > 0
    for ra, rb in zip(a, b):
        assert (ra.tokens, ra.drafted, ra.verifier_accepted) == (rb.tokens, rb.drafted, rb.verifier_accepted)
        assert rb.proposed == rb.drafted


def test_a_real_drafters_state_stays_consistent_under_gating():
    """A trained tiny EAGLE-3 (KV cache and features in its state) behind a wrapper that adds confidence
    logits from its own drafts: gated at several thresholds, its greedy output equals plain decoding at batch 1
    and 3 (a drafter advanced with tokens it never drafted, or with a stale cache, would diverge)."""
    from test_contracts import build_drafter, prompts as contract_prompts

    target, drafter = build_drafter("eagle3", False, train_steps=10)
    table = torch.randn(target.vocab_size, generator=torch.Generator().manual_seed(5)) * 2 + 1

    class WithConfidence:
        def __init__(self, d):
            self.drafter = d

        def start(self, ids, f):
            return self.drafter.start(ids, f)

        def propose(self, states, ks, sampling=None, generators=None):
            props = self.drafter.propose(states, ks, sampling, generators)
            return [Proposal(p.token_ids, p.probs, table[p.token_ids] if p.token_ids.numel() else None) for p in props]

        def advance(self, states, new_ids, features):
            self.drafter.advance(states, new_ids, features)

    ps = contract_prompts()
    plain = [plain_decode(target, p, 14, eos_ids=set()).tokens for p in ps]
    cut = 0
    for thr in (0.3, 0.7):
        for b in (1, 3):
            out = speculative_generate(target, WithConfidence(drafter), ps, 4, 14, None, b, eos_ids=set(),
                                       confidence_threshold=thr)
            assert [r.tokens for r in out.results] == plain, (thr, b)
            cut += sum(sum(r.proposed) - sum(r.drafted) for r in out.results)
    assert cut > 0  # the gate did cut drafts


# ----------------------------------------------------------------------------- sampling: statistically lossless
N_SAMPLES = 600
TEMP = 1.0


def _sampled_tokens(target, gate=None, threshold=None, seed0=5000):
    prompt = rand_prompt(6, 11)
    prop = SharpTargetProposer(target)
    gens = [torch.Generator().manual_seed(seed0 + i) for i in range(N_SAMPLES)]
    sp = SamplingParams(temperature=torch.full((N_SAMPLES,), TEMP), generators=gens)
    out = speculative_generate(target, prop, [prompt] * N_SAMPLES, 3, 5, sp, batch_size=64, eos_ids=set(),
                               confidence_threshold=threshold, gate=gate)
    toks = torch.tensor([r.tokens[:3] for r in out.results])
    proposed = sum(sum(r.proposed) for r in out.results)
    verified = sum(sum(r.drafted) for r in out.results)
    accepted = sum(sum(r.verifier_accepted) for r in out.results)
    return prompt, toks, proposed, verified, accepted


def test_gated_sampling_has_the_targets_distribution(target):
    """With a threshold that cuts a good share of the drafts, the first two tokens (jointly) and the third
    follow the exact plain-sampling distributions (chi-square, p < 1e-6, fixed seeds)."""
    prompt, toks, proposed, verified, accepted = _sampled_tokens(target, threshold=0.8)  # ~35% of drafts cut
    assert 0 < verified < 0.9 * proposed and accepted > 0
    joint12, p3 = _exact_first_tokens(target, prompt, TEMP, 0, 1.0)
    assert_distribution(toks[:, 0] * V + toks[:, 1], joint12, "gated: (t1, t2)")
    assert_distribution(toks[:, 2], p3, "gated: t3")


def test_cost_aware_gated_sampling_has_the_targets_distribution(target):
    """The cost-aware rule (a stopping time over the survival probabilities) passes the same chi-square check."""
    prompt, toks, proposed, verified, accepted = _sampled_tokens(target, gate=ConfidenceGate(verify_cost=[1.0, 1.8, 2.6, 3.4]))
    assert 0 < verified < 0.9 * proposed and accepted > 0  # ~35% of the drafts cut
    joint12, p3 = _exact_first_tokens(target, prompt, TEMP, 0, 1.0)
    assert_distribution(toks[:, 0] * V + toks[:, 1], joint12, "cost-aware gated: (t1, t2)")
    assert_distribution(toks[:, 2], p3, "cost-aware gated: t3")


def test_a_leaky_gate_that_peeks_at_the_verifier_fails_the_same_test(target):
    """The test above has power: a gate that truncates exactly where the verifier would reject (it looks at
    the target's logits and the verifier's random numbers) biases the output towards the drafts, and the
    same chi-square check rejects it."""
    prompt, toks, proposed, verified, accepted = _sampled_tokens(target, gate=PeekingGate(target, TEMP))
    assert verified == accepted  # the leaky gate only lets through drafts that get accepted
    joint12, p3 = _exact_first_tokens(target, prompt, TEMP, 0, 1.0)
    stat, thr, tv, _ = chi2_check(toks[:, 0] * V + toks[:, 1], joint12)
    assert stat > thr, (stat, thr, tv)


# ----------------------------------------------------------------------------- the eval's gated rows
def test_eval_reports_gated_and_ungated_rows(target):
    prompts = [{"id": i, "input_ids": rand_prompt(n, 70 + i)} for i, n in enumerate((4, 7, 10))]
    rep = run_eval(target, SharpTargetProposer(target), prompts, EvalSettings(3, 10, eos_ids=set(), batch_size=2, methods=("drafter", "ngram"), bootstrap_resamples=50, confidence_threshold=0.7), log=lambda m: None)
    assert rep["greedy_mismatches"] == []  # gated outputs are checked too
    assert {(r["batch_size"], r["k"]) for r in rep["gated_rows"]} == {(1, 3), (2, 3)}
    for r in rep["rows"] + rep["gated_rows"]:
        for key in ("tau", "drafted_per_step", "verified_per_step", "per_position", "tokens_per_s", "speedup"):
            assert key in r
    g, u = rep["gating"]["headline"]["gated"], rep["gating"]["headline"]["ungated"]
    assert rep["gating"]["threshold"] == 0.7 and rep["gating"]["confidences"]
    assert g["verified_per_step"] < g["drafted_per_step"]
    assert u["verified_per_step"] == pytest.approx(u["drafted_per_step"])
    md = report_markdown(rep)
    assert "Confidence-gated verification" in md and "| gated | 2 | 3 |" in md
    # without a threshold the report has no gating keys (the schema other readers use is unchanged)
    plain_rep = run_eval(target, SharpTargetProposer(target), prompts, EvalSettings(3, 6, eos_ids=set(), batch_size=1, methods=("drafter",), bootstrap_resamples=20), log=lambda m: None)
    assert "gating" not in plain_rep and "gated_rows" not in plain_rep


def test_acceptance_stats_count_proposed_and_verified_drafts():
    from speculators.decode.state import GenerationResult

    r = GenerationResult([1, 2, 3, 4, 5])
    for drafted, acc, emitted, proposed in ((2, 2, 3, 4), (1, 0, 1, 3)):
        r.add_step(drafted, acc, emitted)
        r.proposed.append(proposed)
    st = AcceptanceStats(4)
    st.add(r)
    d = st.as_dict()
    assert (d["proposed"], d["drafted"], d["drafted_per_step"], d["verified_per_step"]) == (7, 3, 3.5, 1.5)


def test_cli_names_a_bad_confidence_threshold(tmp_path):
    from typer.testing import CliRunner

    from speculators.cli import app

    ckpt = tmp_path / "ckpt"
    ckpt.mkdir()
    (ckpt / "config.json").write_text("{}")  # resolved as a checkpoint; the options fail before it is loaded
    res = CliRunner().invoke(app, ["eval", str(ckpt), "--confidence-threshold", "1.5", "--target", "x",
                                   "--prompts", "y"])
    assert res.exit_code == 2
    assert "--confidence-threshold 1.5: eval.confidence_threshold" in " ".join(res.output.split())


def test_cost_aware_gating_in_eval_with_a_measured_cost_model(target):
    from speculators.evaluation.forward_cost import measure_verify_cost

    cost = measure_verify_cost(target, 3, reps=1)
    assert len(cost) == 4 and all(c > 0 for c in cost)
    prompts = [{"id": i, "input_ids": rand_prompt(n, 90 + i)} for i, n in enumerate((5, 8))]
    steep = [1.0, 10.0, 20.0, 30.0]  # verifying any draft costs far more than it can return: nothing is verified
    rep = run_eval(target, SharpTargetProposer(target), prompts, EvalSettings(3, 8, eos_ids=set(), batch_size=1, methods=("drafter",), bootstrap_resamples=20, verify_cost=steep), log=lambda m: None)
    assert rep["gating"]["cost_aware"] and rep["gating"]["threshold"] is None
    assert rep["greedy_mismatches"] == []
    g = rep["gating"]["headline"]["gated"]
    assert g["verified_per_step"] == 0.0 and g["drafted_per_step"] > 0 and g["tau"] == 1.0
