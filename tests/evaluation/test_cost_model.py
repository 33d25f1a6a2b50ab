"""The cost model's predictor on hand-computable cases (no timing is asserted), and its block in a tiny eval."""

from __future__ import annotations

import json
import math

import pytest
import torch

from speculators.evaluation.settings import EvalSettings, PassKey
from speculators.evaluation import cost_model as cm
from speculators.evaluation import costs as co
from speculators.errors import SpeculatorsError
from speculators.evaluation.acceptance import AcceptanceStats
from speculators.evaluation.runner import run_eval
from speculators.target import build_tiny_target


def test_expected_tokens_is_leviathans_formula_in_the_iid_case():
    a = 0.5
    s = cm.survival([a, a, a])
    assert s == [0.5, 0.25, 0.125]
    assert cm.expected_tokens(s, 3) == pytest.approx((1 - a ** 4) / (1 - a)) == 1.875
    assert cm.expected_tokens(s, 0) == 1.0
    with pytest.raises(SpeculatorsError, match="above the 3 measured"):
        cm.expected_tokens(s, 4)


def test_survival_uses_per_position_conditional_and_continuation():
    # falling acceptance: 0.8, then 0.5; the proposer drafts position 1 in half the steps only
    assert cm.survival([0.8, 0.5], [0.5, 1.0]) == pytest.approx([0.4, 0.2])
    assert cm.survival([0.5, None, 1.0]) == [0.5, 0.0, 0.0]  # a position never reached: nothing after it
    with pytest.raises(SpeculatorsError, match=r"\[0, 1\]"):
        cm.survival([1.2])
    with pytest.raises(SpeculatorsError, match="continuation"):
        cm.survival([0.5], [1.0, 1.0])


def test_acceptance_profile_from_counts():
    # 10 steps; 8 drafted 2 tokens; 6 accepted draft 1, 5 of those went on to draft 2, 3 accepted it
    p = cm.acceptance_profile(10, [10, 8], [6, 3], [10, 5])
    assert p["conditional"] == pytest.approx([0.6, 0.6])
    assert p["continuation"] == pytest.approx([1.0, 5 / 6])
    assert p["survival"] == pytest.approx([0.6, 0.3])
    assert p["survival"] == pytest.approx(cm.survival(p["conditional"], p["continuation"]))
    assert p["drafted_at_least"] == pytest.approx([1.0, 0.8])
    assert cm.acceptance_profile(0, [0], [0], [0]) is None  # no step: every ratio would divide by zero
    assert cm.acceptance_profile(4, [4], [0], [0])["conditional"] == [None] and \
        cm.acceptance_profile(4, [4], [0], [4])["conditional"] == [0.0]
    with pytest.raises(SpeculatorsError, match="different lengths"):
        cm.acceptance_profile(1, [1], [1, 0], [1])


def test_emitted_distribution_and_expected_steps():
    assert cm.emitted_distribution([0.5, 0.25], 2) == pytest.approx([0.5, 0.25, 0.25])
    assert cm.emitted_distribution([0.5, 0.25], 1) == pytest.approx([0.5, 0.5])
    # every draft accepted at K=2: each step emits 3 tokens, the last one cut
    assert cm.expected_steps([0.0, 0.0, 1.0], 7) == [0, 1, 1, 1, 2, 2, 2, 3]
    # X = 1 or 2 with probability 1/2: f(1) = 1, f(2) = 1 + f(1)/2, f(3) = 1 + (f(2) + f(1))/2
    assert cm.expected_steps([0.5, 0.5], 3) == pytest.approx([0.0, 1.0, 1.5, 2.25])
    with pytest.raises(SpeculatorsError, match="probability distribution"):
        cm.expected_steps([0.5, 0.4], 3)


def test_batch_schedule_is_continuous_batching():
    assert cm.batch_schedule([3, 1, 2], 1) == [(1, 3), (1, 1), (1, 2)]
    # request 2 takes request 1's slot when it leaves at step 1
    assert cm.batch_schedule([3, 1, 2], 2) == [(2, 1), (2, 2)]
    assert cm.batch_schedule([3, 1, 2], 3) == [(3, 1), (2, 1), (1, 1)]
    assert cm.batch_schedule([0, 2], 1) == [(1, 2)]
    with pytest.raises(SpeculatorsError, match="batch_size"):
        cm.batch_schedule([1], 0)


def test_interpolation_forward_cost_and_prediction():
    assert co.interpolate([(3, 30.0), (1, 10.0)], 2) == 20.0
    assert co.interpolate([(1, 10.0), (3, 30.0)], 0) == 10.0 and co.interpolate([(1, 10.0), (3, 30.0)], 5) == 30.0
    with pytest.raises(SpeculatorsError):
        co.interpolate([], 1)
    costs = {"batch_sizes": [1, 3], "seconds": {"1": [1.0, 2.0, 3.0], "3": [2.0, 4.0, 6.0]}}
    assert co.forward_seconds(costs, 2, 2) == 3.0  # halfway between batch 1 and batch 3
    assert co.forward_seconds(costs, 9, 1) == 3.0  # beyond the measured lengths: the last one
    one = {"batch_sizes": [1], "seconds": {"1": [1.0, 2.0, 3.0]}}
    # half the steps draft 2 tokens, the others 1: E = 0.5 * cost(2) + 0.5 * cost(3)
    assert co.expected_forward_seconds(one, [1.0, 0.5], 2, 1) == pytest.approx(2.5)
    # two rows: the forward is as long as the longer one: P(max d <= 1) = 0.5^2
    assert co.expected_forward_seconds(one, [1.0, 0.5], 2, 2) == pytest.approx(0.25 * 2 + 0.75 * 3)
    assert co.expected_forward_seconds(one, [1.0, 0.5], 1, 2) == pytest.approx(2.0)  # capped at K'=1
    seconds, steps, parts = cm.predict_seconds([2, 2], 1, 1.0, lambda live: (0.5, 1.0, 0.25))
    assert (seconds, steps, parts) == (8.0, 4, [2.0, 4.0, 1.0])


def test_ratios_with_zero_denominators_are_none():
    assert cm.relative_error(110.0, 100.0) == pytest.approx(0.1)
    assert cm.relative_error(1.0, 0.0) is None and cm.relative_error(None, 1.0) is None
    assert cm.relative_error(1.0, None) is None
    assert cm.tokens_per_s(10, 0.0) is None and cm.tokens_per_s(10, 4.0) == 2.5


def _stats(k, steps, drafted, accepted, reached):
    st = AcceptanceStats(k)
    st.steps, st.pos_drafted, st.pos_accepted, st.pos_reached = steps, drafted, accepted, reached
    return st


def _hand_report(verify_2_tokens: float):
    """Two requests of 5 tokens at batch 1: plain 8 steps; n-gram K=1 accepts every draft (4 steps).
    Plain: 10 s, of which 1 s prefill, 7 s verifying (6 s forwards, 1 s sampling: 0.125 s per step) and
    2 s of overhead (0.25 s per step). The n-gram pass samples for 0.4 s over 4 steps (0.1 s per step)."""
    plain = {"batch_size": 1, "tau": 1.0, "steps": 8, "tokens": 10, "seconds": 10.0, "tokens_per_s": 1.0,
             "draft_seconds": 0.0, "verify_seconds": 7.0, "prefill_seconds": 1.0, "forward_seconds": 6.0,
             "batched_steps": 8}
    row = {"method": "ngram", "k": 1, "batch_size": 1, "steps": 4, "tokens": 10, "seconds": 6.0, "tokens_per_s": 1.5,
           "draft_seconds": 0.4, "prefill_seconds": 1.0, "verify_seconds": 3.4, "forward_seconds": 3.0,
           "batched_steps": 4}
    report = {"methods": ["ngram"], "ks": [1], "batch_sizes": [1], "rows": [row], "plain_rows": [plain]}
    costs = {"k": 1, "context": 8, "reps": 1, "batch_sizes": [1], "seconds": {"1": [0.5, verify_2_tokens]}}
    stats = {PassKey("ngram", 1, 1): _stats(1, 4, [4], [4], [4])}
    return cm.cost_model_block(report, stats, {1: [5, 5]}, costs)


def test_cost_model_block_by_hand():
    block = _hand_report(1.0)
    plain = block["plain"][0]
    # plain: 1 s prefill + 8 steps * (0.5 s forward + 0.125 s sampling + 0.25 s overhead) = 8 s for 10 tokens
    assert plain["predicted_tokens_per_s"] == pytest.approx(10 / 8.0)
    assert plain["relative_error"] == pytest.approx((10 / 8.0 - 1.0) / 1.0)
    assert block["overhead_ms_per_step"] == {"1": pytest.approx(250.0)}
    assert plain["sampling_ms_per_step"] == pytest.approx(125.0)
    (pred,) = block["predictions"]
    # n-gram K'=1: 2 tokens per step, 2 steps per request; 1 s + 4 * (0.1 draft + 1.0 forward + 0.1 sampling
    # + 0.25 overhead) = 6.8 s
    assert pred["expected_tokens_per_step"] == 2.0 and pred["measured"]
    assert pred["predicted_tokens_per_s"] == pytest.approx(10 / 6.8)
    assert pred["predicted_speedup"] == pytest.approx((10 / 6.8) / (10 / 8.0))
    assert pred["relative_error"] == pytest.approx((10 / 6.8 - 1.5) / 1.5)
    assert pred["sampling_ms_per_step"] == pytest.approx(100.0)
    assert pred["loop_forward_ms_per_step"] == pytest.approx(750.0) and plain["loop_forward_ms_per_step"] == 750.0
    assert pred["draft_ms_per_step"] == pytest.approx(100.0) and pred["forward_ms_per_step"] == pytest.approx(1000.0)
    assert block["best_k"] == {"1": {"ngram": 1}}
    assert block["break_even"]["ngram"]["batch_size"] is None  # pays at batch 1, the only measured one
    # the plain row's error (+25%) is the largest, and above 15%
    assert block["max_abs_relative_error"] == pytest.approx(0.25) and block["within_15_percent"] is False
    # a verify forward 4x the 1-token one: 1 + 4 * (0.1 + 2.0 + 0.1 + 0.25) = 10.8 s > plain's 8 s
    slow = _hand_report(2.0)
    assert slow["predictions"][0]["predicted_speedup"] == pytest.approx(8.0 / 10.8)
    assert slow["break_even"]["ngram"]["batch_size"] == 1
    assert "does not pay at batch size 1" in slow["break_even"]["ngram"]["note"]


def test_a_k_the_eval_did_not_run_reads_the_next_larger_measured_k():
    row = {"k": 2, "batch_size": 1, "steps": 4, "tokens": 10, "seconds": 6.0, "tokens_per_s": 1.5,
           "draft_seconds": 0.4, "prefill_seconds": 1.0, "verify_seconds": 3.0, "forward_seconds": 3.0,
           "batched_steps": 4}
    plain = {"batch_size": 1, "steps": 8, "tokens": 10, "seconds": 8.0, "tokens_per_s": 1.25,
             "prefill_seconds": 1.0, "verify_seconds": 5.0, "forward_seconds": 4.0, "batched_steps": 8}
    rows = [dict(row, method="ngram", k=1), dict(row, method="ngram", k=3)]
    report = {"methods": ["ngram"], "ks": [1, 3], "batch_sizes": [1], "rows": rows, "plain_rows": [plain]}
    costs = {"k": 3, "context": 8, "reps": 1, "batch_sizes": [1], "seconds": {"1": [0.5, 0.6, 0.7, 0.8]}}
    stats = {PassKey("ngram", 1, 1): _stats(1, 4, [4], [2], [4]),  # K=1: half the drafts accepted
             PassKey("ngram", 3, 1): _stats(3, 4, [4, 4, 4], [4, 4, 0], [4, 4, 4])}  # K=3: 2 accepted, the 3rd not
    preds = {p["k"]: p for p in cm.cost_model_block(report, stats, {1: [5, 5]}, costs)["predictions"]}
    assert preds[1]["expected_tokens_per_step"] == 1.5 and preds[1]["measured"]  # its own pass
    assert preds[2]["expected_tokens_per_step"] == 3.0 and not preds[2]["measured"]  # K=3's, capped at 2
    assert preds[2]["measured_tokens_per_s"] is None and preds[2]["relative_error"] is None
    assert preds[3]["expected_tokens_per_step"] == 3.0


def test_cost_model_block_refuses_costs_that_miss_a_batch_size():
    report = {"methods": [], "ks": [2], "batch_sizes": [1, 4], "rows": [], "plain_rows": []}
    with pytest.raises(SpeculatorsError, match="batch sizes"):
        cm.cost_model_block(report, {}, {}, {"k": 2, "batch_sizes": [1], "seconds": {"1": [1.0, 1.0, 1.0]}})


def test_forward_cost_is_linear_in_the_cache_width():
    # batch 1: 1.0 s at 10 slots, 2.0 s at 20 (m = 1); batch 3: 2.0 s at 10, 4.0 s at 20
    costs = {"k": 0, "batch_sizes": [1, 3], "seconds": {"1": [1.0], "3": [2.0]}, "width": {"1": [10.0], "3": [10.0]},
             "long_seconds": {"1": [2.0], "3": [4.0]}, "long_width": {"1": [20.0], "3": [20.0]}}
    assert co.forward_seconds(costs, 1, 1, 15.0) == pytest.approx(1.5)
    assert co.forward_seconds(costs, 1, 1, 40.0) == pytest.approx(4.0)  # extrapolated along the line
    assert co.forward_seconds(costs, 1, 2, 30.0) == pytest.approx((3.0 + 6.0) / 2)  # then linear in live
    assert co.forward_seconds(costs, 1, 1) == 1.0  # no width: the measured context, as before
    old = {k: v for k, v in costs.items() if not k.startswith("long") and k != "width"}
    assert co.forward_seconds(old, 1, 1, 40.0) == 1.0  # one measured context: no slope to charge
    # a shorter forward at the long context (noise) is not a negative slope
    noisy = dict(costs, long_seconds={"1": [0.5], "3": [4.0]})
    assert co.forward_seconds(noisy, 1, 1, 40.0) == 1.0
    assert co.expected_forward_seconds(costs, [], 0, 1, 30.0) == pytest.approx(3.0)


def _width_report(charge: bool):
    """Batch 1, two requests of 5 tokens, the forward 0.5 s at 10 slots + 0.05 s per slot (m = 1; 1.0 s at
    10 slots for m = 2). Plain ran at a mean width of 20 slots: 8 steps of (1.0 s forward + 0.125 s sampling
    + 0.25 s overhead) + 1 s prefill = 12 s; n-gram K=1 (every draft accepted) at 21 slots: 4 steps of
    (0.1 draft + 1.5 forward + 0.1 sampling + 0.25 overhead) + 1 s = 8.8 s. ``charge=False``: the rows
    carry no width (a report from before widths were recorded)."""
    w = (lambda x: {"cache_width": x}) if charge else (lambda x: {})
    plain = {"batch_size": 1, "tau": 1.0, "steps": 8, "tokens": 10, "seconds": 12.0, "tokens_per_s": 10 / 12.0,
             "draft_seconds": 0.0, "verify_seconds": 9.0, "prefill_seconds": 1.0, "forward_seconds": 8.0,
             "batched_steps": 8, **w(20.0)}
    row = {"method": "ngram", "k": 1, "batch_size": 1, "steps": 4, "tokens": 10, "seconds": 8.8,
           "tokens_per_s": 10 / 8.8, "draft_seconds": 0.4, "prefill_seconds": 1.0, "verify_seconds": 6.4,
           "forward_seconds": 6.0, "batched_steps": 4, **w(21.0)}
    report = {"methods": ["ngram"], "ks": [1], "batch_sizes": [1], "rows": [row], "plain_rows": [plain]}
    costs = {"k": 1, "context": 8, "reps": 1, "batch_sizes": [1], "seconds": {"1": [0.5, 1.0]},
             "width": {"1": [10.0, 11.0]}, "long_context": 18, "long_seconds": {"1": [1.0, 1.5]},
             "long_width": {"1": [20.0, 21.0]}}
    return cm.cost_model_block(report, {PassKey("ngram", 1, 1): _stats(1, 4, [4], [4], [4])}, {1: [5, 5]}, costs)


def test_the_forward_is_charged_at_the_width_the_loop_ran_at():
    block = _width_report(True)
    (plain,), (pred,) = block["plain"], block["predictions"]
    assert plain["cache_width"] == 20.0 and pred["cache_width"] == 21.0
    assert plain["forward_ms_per_step"] == pytest.approx(1000.0) and pred["forward_ms_per_step"] == pytest.approx(1500.0)
    assert plain["relative_error"] == pytest.approx(0.0, abs=1e-9) and pred["relative_error"] == pytest.approx(0.0, abs=1e-9)
    # the same eval without widths charges the measured context's forwards: too fast by a third or more
    old = _width_report(False)
    assert old["plain"][0]["cache_width"] is None and old["predictions"][0]["cache_width"] is None
    assert old["plain"][0]["relative_error"] == pytest.approx(12.0 / 8.0 - 1)
    assert old["predictions"][0]["relative_error"] == pytest.approx(8.8 / 6.8 - 1)


def _drift_report(adjacent: bool):
    """Batch 1, two requests of 5 tokens; every second of a pass is its target forwards. The plain pass ran
    while a 1-token forward took 0.5 s (as the eval's costs measured it): 8 steps = 4.0 s. The n-gram pass
    (K=1, every draft accepted: 4 steps of 2-token forwards) ran while the machine was 1.6x slower: 4 * 1.6
    = 6.4 s. The suffix pass ran at the eval's speed (4 * 1.0 s) and recorded no adjacent costs.
    ``adjacent=False``: no pass recorded its costs (an older report, or ``adjacent_costs=False``)."""
    fast, slow = {"1": [0.5, 1.0]}, {"1": [0.8, 1.6]}
    pc = (lambda sec: {"pass_costs": {"k": 1, "context": 8, "reps": 3, "batch_sizes": [1], "seconds": sec}}) \
        if adjacent else (lambda sec: {})
    plain = {"batch_size": 1, "tau": 1.0, "steps": 8, "tokens": 10, "seconds": 4.0, "tokens_per_s": 2.5,
             "draft_seconds": 0.0, "verify_seconds": 4.0, "prefill_seconds": 0.0, "forward_seconds": 4.0,
             "batched_steps": 8, **pc(fast)}
    row = {"k": 1, "batch_size": 1, "steps": 4, "tokens": 10, "draft_seconds": 0.0, "prefill_seconds": 0.0,
           "batched_steps": 4}
    rows = [dict(row, method="ngram", seconds=6.4, tokens_per_s=10 / 6.4, verify_seconds=6.4, forward_seconds=6.4,
                 **pc(slow)),
            dict(row, method="suffix", seconds=4.0, tokens_per_s=2.5, verify_seconds=4.0, forward_seconds=4.0)]
    report = {"methods": ["ngram", "suffix"], "ks": [1], "batch_sizes": [1], "rows": rows, "plain_rows": [plain]}
    costs = {"k": 1, "context": 8, "reps": 5, "batch_sizes": [1], "seconds": fast}
    stats = {PassKey(m, 1, 1): _stats(1, 4, [4], [4], [4]) for m in ("ngram", "suffix")}
    block = cm.cost_model_block(report, stats, {1: [5, 5]}, costs)
    return block["plain"][0], {p["method"]: p for p in block["predictions"]}, block


def test_each_pass_is_predicted_from_the_forwards_measured_next_to_it():
    plain, preds, block = _drift_report(True)
    assert plain["costs_source"] == "adjacent" and plain["relative_error"] == pytest.approx(0.0, abs=1e-12)
    ngram = preds["ngram"]
    assert ngram["costs_source"] == "adjacent" and ngram["forward_ms_per_step"] == pytest.approx(1600.0)
    assert ngram["predicted_tokens_per_s"] == pytest.approx(10 / 6.4)
    assert ngram["relative_error"] == pytest.approx(0.0, abs=1e-12)
    assert preds["suffix"]["costs_source"] == "eval" and preds["suffix"]["relative_error"] == pytest.approx(0.0)
    # comparisons stay at one machine speed: the eval's costs say n-gram K=1 runs exactly as fast as plain
    assert ngram["eval_costs_tokens_per_s"] == pytest.approx(2.5) and ngram["predicted_speedup"] == pytest.approx(1.0)
    assert block["max_abs_relative_error"] == pytest.approx(0.0, abs=1e-12) and block["within_15_percent"]
    # the same passes predicted from the one measurement: the slow pass is predicted 60% too fast
    plain, preds, block = _drift_report(False)
    assert {p["costs_source"] for p in [plain, *preds.values()]} == {"eval"}
    assert preds["ngram"]["relative_error"] == pytest.approx(6.4 / 4.0 - 1) == pytest.approx(0.6)
    assert preds["ngram"]["predicted_speedup"] == pytest.approx(1.0)
    assert block["max_abs_relative_error"] == pytest.approx(0.6) and block["within_15_percent"] is False


def test_drifted_costs_scale_the_other_batch_sizes_by_the_drift_at_the_pass():
    costs = {"k": 1, "batch_sizes": [1, 4], "seconds": {"1": [1.0, 2.0], "4": [2.0, 4.0]},
             "width": {"1": [10.0, 11.0], "4": [10.0, 11.0]}, "long_context": 20,
             "long_seconds": {"1": [2.0, 3.0], "4": [4.0, 6.0]}, "long_width": {"1": [20.0, 21.0], "4": [20.0, 21.0]}}
    adj = {"k": 1, "context": 10, "reps": 3, "batch_sizes": [4], "seconds": {"4": [3.0, 6.0]},
           "width": {"4": [12.0, 13.0]}, "long_context": 20, "long_seconds": {"4": [6.0, 9.0]},
           "long_width": {"4": [22.0, 23.0]}}
    out = co.drifted_costs(costs, adj, 4, 1)  # 24 s measured next to the pass where the eval measured 16: 1.5x
    assert out["batch_sizes"] == [1, 4] and out["seconds"] == {"1": [1.5, 3.0], "4": [3.0, 6.0]}
    assert out["long_seconds"] == {"1": [3.0, 4.5], "4": [6.0, 9.0]}
    assert out["width"] == {"1": [10.0, 11.0], "4": [12.0, 13.0]} and out["long_width"]["4"] == [22.0, 23.0]
    # the schedule's tail (fewer live requests) is charged the eval's costs at the pass's speed
    assert co.forward_seconds(out, 1, 1) == pytest.approx(1.5) and co.forward_seconds(out, 1, 4) == 3.0
    assert co.drifted_costs(costs, None, 4, 1) is None
    assert co.drifted_costs(costs, adj, 1, 1) is None  # measured at another batch size
    assert co.drifted_costs(costs, adj, 4, 2) is None  # too few lengths for K=2
    old = {k: costs[k] for k in ("k", "batch_sizes", "seconds")}  # one context: the drift over it alone
    assert co.drifted_costs(old, adj, 4, 1) == {"k": 1, "context": 10, "reps": 3, "batch_sizes": [1, 4],
                                                "seconds": {"1": [1.5, 3.0], "4": [3.0, 6.0]}}


def test_the_loop_records_the_cache_width_it_ran_at(monkeypatch):
    """Every batched forward's width is read: their mean is ``cache_width``, each >= the longest live row."""
    from speculators.decode.loop import speculative_generate
    from speculators.decode.proposers import NGramProposer

    target = build_tiny_target(vocab_size=64, hidden_size=32, num_layers=2, seed=3)
    real, seen = target.batch_session, []

    def spying(max_batch):
        sess = real(max_batch)
        forward = sess.forward

        def fwd(ids, tokens):
            out = forward(ids, tokens)
            seen.append((sess.width, max(sess.length(i) for i in sess.request_ids)))
            return out

        sess.forward = fwd
        return sess

    monkeypatch.setattr(target, "batch_session", spying)
    prompts = [[1, 2, 3, 4] * 5, [5, 6, 7], [1, 2, 3, 4, 1, 2], [9, 8] * 7]
    for proposer, k in ((None, 0), (NGramProposer(), 3)):
        seen.clear()
        out = speculative_generate(target, proposer, prompts, k, [12, 5, 9, 7], batch_size=2, eos_ids=set())
        assert out.target_forwards == len(seen) > 0
        assert all(width >= longest for width, longest in seen)
        assert out.cache_width == pytest.approx(sum(w for w, _ in seen) / len(seen))
        assert out.cache_width >= len(prompts[0])  # the longest prompt was live in the first forwards
        assert cm.step_times(out)["cache_width"] == out.cache_width


@pytest.fixture(scope="module")
def tiny():
    target = build_tiny_target(vocab_size=64, hidden_size=32, num_layers=2, seed=3)
    prompts = [{"id": f"p{i}", "input_ids": ([1, 2, 3, 4] * 3)[: 6 + i]} for i in range(3)]
    return target, prompts


def test_measure_costs_at_every_batch_size(tiny):
    target, _ = tiny
    costs = co.measure_costs(target, 2, [2, 1], reps=1, context=6)
    assert costs["batch_sizes"] == [1, 2] and set(costs["seconds"]) == {"1", "2"}
    assert all(len(v) == 3 and all(c > 0 and math.isfinite(c) for c in v) for v in costs["seconds"].values())
    assert co.gate_cost(costs) == costs["seconds"]["1"]
    assert costs["long_context"] == 12 and set(costs["long_seconds"]) == {"1", "2"}
    for b in ("1", "2"):  # the width each was timed at: the context and the new tokens at least
        assert all(w >= 6 + m + 1 for m, w in enumerate(costs["width"][b]))
        assert all(w >= 12 + m + 1 for m, w in enumerate(costs["long_width"][b]))
        assert all(c > 0 and math.isfinite(c) for c in costs["long_seconds"][b])
    with pytest.raises(SpeculatorsError, match="batch size"):
        co.measure_costs(target, 2, [0])
    with pytest.raises(SpeculatorsError, match="long_context"):
        co.measure_costs(target, 2, [1], context=6, long_context=6)


def test_every_eval_report_has_a_cost_model(tiny, monkeypatch):
    import speculators.evaluation.runner as ev
    from rich.console import Console

    from speculators.evaluation.report import BREAK_EVEN_COLUMNS, render_markdown, render_terminal

    target, prompts = tiny
    given = co.measure_costs(target, 2, [1, 2], reps=1, context=8)

    def refuse(*a, **kw):
        raise AssertionError("the eval measured the forward costs a second time")

    monkeypatch.setattr(ev, "measure_costs", refuse)
    rep = run_eval(target, None, prompts, EvalSettings([1, 2], 8, eos_ids=set(), batch_size=2, methods=("ngram", "suffix"), bootstrap_resamples=20), forward_costs=given, log=lambda m: None)
    block = rep["cost_model"]
    assert block["costs"] is given
    assert set(block) == {"costs", "overhead_ms_per_step", "plain", "predictions", "best_k", "break_even",
                          "max_abs_relative_error", "within_15_percent"}
    # one prediction per method, K' <= K and batch size; the ones the eval ran carry the measurement
    assert sorted((p["method"], p["k"], p["batch_size"]) for p in block["predictions"]) == sorted(
        (m, k, b) for m in ("ngram", "suffix") for k in (1, 2) for b in (1, 2))
    for p in block["predictions"] + block["plain"]:
        assert p["predicted_tokens_per_s"] > 0 and math.isfinite(p["predicted_tokens_per_s"])
        assert p["measured_tokens_per_s"] > 0 and math.isfinite(p["relative_error"])
    for p in block["predictions"]:
        assert p["measured"] and math.isfinite(p["predicted_speedup"]) and p["expected_tokens_per_step"] >= 1.0
    assert set(block["best_k"]) == {"1", "2"} and set(block["break_even"]) == {"ngram", "suffix"}
    for row in rep["rows"] + rep["plain_rows"]:
        assert 0 < row["forward_seconds"] <= row["verify_seconds"] and row["prefill_seconds"] > 0
    md = render_markdown(rep)
    assert "## Cost model and break-even" in md and "| " + " | ".join(BREAK_EVEN_COLUMNS) + " |" in md
    console = Console(record=True, width=200)
    render_terminal(rep, console)
    assert "break-even batch" in console.export_text()
    # the widths: recorded per pass, charged per prediction, rendered; a report without them still renders
    assert all(r["cache_width"] > 0 for r in rep["rows"] + rep["plain_rows"])
    assert all(p["cache_width"] > 0 for p in block["predictions"] + block["plain"])
    assert "tokens of context (the forward is charged linear in the KV-cache width" in md
    # the forwards measured right before every pass, at its batch size and the eval's contexts
    for r in rep["rows"] + rep["plain_rows"]:
        pc = r["pass_costs"]
        assert pc["batch_sizes"] == [r["batch_size"]] and pc["k"] == 2 and pc["reps"] == 3
        assert (pc["context"], pc["long_context"]) == (given["context"], given["long_context"])
        assert len(pc["seconds"][str(r["batch_size"])]) == 3
    assert {p["costs_source"] for p in block["predictions"] + block["plain"]} == {"adjacent"}
    old = json.loads(json.dumps(rep))
    for r in old["rows"] + old["plain_rows"] + old["cost_model"]["predictions"] + old["cost_model"]["plain"]:
        for key in ("cache_width", "pass_costs", "costs_source", "eval_costs_tokens_per_s"):
            r.pop(key, None)
    old["cost_model"]["costs"] = {k: v for k, v in given.items() if k == "context" or k in
                                  ("k", "reps", "batch_sizes", "seconds")}
    old_md = render_markdown(old)
    assert "## Cost model and break-even" in old_md and "KV-cache width" not in old_md
    render_terminal(old, Console(record=True, width=200))
    # without given costs the eval measures them itself (once)
    calls = []
    monkeypatch.setattr(ev, "measure_costs", lambda *a, **kw: calls.append(kw) or given)
    rep = run_eval(target, None, prompts[:1], EvalSettings([2], 4, eos_ids=set(), methods=("ngram",), bootstrap_resamples=20, adjacent_costs=False), log=lambda m: None)
    assert len(calls) == 1 and rep["cost_model"]["costs"] is given
    # adjacent_costs=False: nothing measured per pass, every row predicted from the eval's costs
    assert not any("pass_costs" in r for r in rep["rows"] + rep["plain_rows"])
    cmb = rep["cost_model"]
    assert {p["costs_source"] for p in cmb["predictions"] + cmb["plain"]} == {"eval"}


def test_eval_measures_the_forwards_once_for_the_report_and_the_cost_aware_gate(tmp_path, tiny_target_dir,
                                                                                  isolated_cache, monkeypatch):
    """``speculators eval --cost-aware``: one measurement of the target forwards (one per batch size), read
    by the report's cost model and, at batch 1, by the gate."""
    from pathlib import Path

    from conftest import cli_train_then_eval

    import speculators.evaluation.forward_cost as fc

    calls = []
    real = fc.measure_forward_cost
    monkeypatch.setattr(fc, "measure_forward_cost",
                        lambda *a, **kw: calls.append(kw.get("batch_size")) or real(*a, **kw))
    recipe = Path(__file__).resolve().parents[2] / "recipes" / "tiny-eagle3.yaml"
    _, _, report = cli_train_then_eval(recipe, tiny_target_dir, tmp_path / "run", "train.steps=2",
                                       eval_args=("--temperature", "0", "--cost-aware", "-k", "2", "--batch-size", "2",
                                                  "--num-prompts", "2", "--max-new-tokens", "6"))
    assert sorted(calls[:4]) == [1, 1, 2, 2]  # once per eval: two context lengths
    # then right before every pass, at its batch size (two context lengths)
    passes = report["rows"] + report["plain_rows"] + report.get("gated_rows", [])
    assert passes and sorted(calls[4:]) == sorted(r["batch_size"] for r in passes for _ in range(2))
    assert all(r["pass_costs"]["batch_sizes"] == [r["batch_size"]] for r in passes)
    costs = report["cost_model"]["costs"]
    assert report["gating"]["verify_cost"] == costs["seconds"]["1"] and costs["batch_sizes"] == [1, 2]
    assert all(p["predicted_tokens_per_s"] > 0 for p in report["cost_model"]["predictions"])


def test_sampled_steps_match_the_expected_steps_and_a_deterministic_case():
    assert cm.sample_steps([0.0, 0.0, 1.0], [0, 1, 3, 7], 4).tolist() == [[0, 1, 1, 3]] * 4  # ceil(r / 3)
    draws = cm.sample_steps([0.5, 0.5], [3, 20], 4000, seed=1)
    f = cm.expected_steps([0.5, 0.5], 20)
    assert draws.shape == (4000, 2)
    assert draws[:, 0].mean() == pytest.approx(f[3], abs=0.05) and draws[:, 1].mean() == pytest.approx(f[20], abs=0.1)
    assert cm.sample_steps([0.5, 0.5], [20], 8, seed=1).tolist() == cm.sample_steps([0.5, 0.5], [20], 8, seed=1).tolist()
    with pytest.raises(SpeculatorsError, match="reps"):
        cm.sample_steps([1.0], [3], 0)
