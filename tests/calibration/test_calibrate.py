"""Confidence calibration: STS temperatures, ECE, the checkpoint rewrite, the report.

Known answers: a head whose raw logits are ``a_k`` times the true acceptance logits must get ``T_k ~ a_k``
and a lower ECE, both from synthetic records and through the real decoding loop (an oracle proposer on a
tiny target whose drafts are right with a known probability). The checkpoint round trip uses a tiny
DSpark drafter (the calibration in ``config.json``, never in ``model.safetensors``).
"""

from __future__ import annotations

import json
from types import SimpleNamespace

import pytest
import torch

from speculators.calibration import (
    ConfidenceRecord,
    calibrate_drafter,
    calibration_markdown,
    calibration_summary,
    choose_threshold,
    ece_noise_floor,
    ece_prompt_bootstrap,
    expected_calibration_error,
    fit_calibration,
    fit_temperatures,
    reliability_bins,
    store_temperatures,
    survival_pairs,
    threshold_sweep,
    write_calibration_report,
)
from speculators.data.vocab import DraftVocab
from speculators.drafters import registry
from speculators.decode.proposal import Proposal
from speculators.drafters.checkpoint import WEIGHTS_NAME
from speculators.errors import SpeculatorsError
from test_batched import rand_prompt, untied_target


def synthetic_record(scales, n_steps: int = 6000, seed: int = 0, shifts=None) -> ConfidenceRecord:
    """Steps of K = len(scales) drafts: true conditional acceptance logits ``u ~ N(0.8, 1.5^2)``, draft k
    accepted with probability sigmoid(u_k) once drafts 1..k-1 were; the head reports ``scales[k] * u_k +
    shifts[k]`` (shifts default 0), so the right calibration is ``T_k = scales[k]``, ``b_k = -shifts[k] /
    scales[k]``."""
    g = torch.Generator().manual_seed(seed)
    K = len(scales)
    u = torch.randn(n_steps, K, generator=g) * 1.5 + 0.8
    ok = torch.rand(n_steps, K, generator=g) < torch.sigmoid(u)
    accepted = torch.cumprod(ok.long(), 1).sum(1)
    drafted = torch.randint(1, K + 1, (n_steps,), generator=g)  # ragged steps (gating, max_new_tokens)
    accepted = torch.minimum(accepted, drafted)
    logits = u * torch.tensor(scales) + (torch.tensor(shifts) if shifts is not None else 0.0)
    logits[torch.arange(K)[None, :] >= drafted[:, None]] = float("nan")
    return ConfidenceRecord(logits, drafted, accepted)


def test_sts_recovers_known_temperatures_and_lowers_ece():
    scales = [3.0, 3.0, 0.5, 2.0]
    rec = synthetic_record(scales)
    T = fit_temperatures(rec)
    assert torch.allclose(T, torch.tensor(scales), rtol=0.12), T
    held_out = synthetic_record(scales, seed=1)
    before, after = calibration_summary(held_out, None), calibration_summary(held_out, T)
    assert after["ece"] < 0.5 * before["ece"] and after["ece"] < 0.02, (before["ece"], after["ece"])
    assert after["nll"] < before["nll"]
    # a calibrated head stays (about) where it is
    T1 = fit_temperatures(synthetic_record([1.0, 1.0, 1.0, 1.0], seed=2))
    assert torch.allclose(T1, torch.ones(4), rtol=0.12), T1


def test_per_position_ece_isolates_the_miscalibrated_slot():
    # slot 1 reports 3x its true logit (over-confident), slots 2-3 are calibrated: the per-position ECE
    # (over each slot's own survival pairs) picks slot 1 out, and fitting T brings it down
    rec = synthetic_record([3.0, 1.0, 1.0], seed=3)
    raw = calibration_summary(rec, None)
    from speculators.calibration import survival_pairs
    s, y, pos = survival_pairs(rec, None)
    for p in raw["per_position"]:
        m = pos == p["k"]
        assert p["ece"] == pytest.approx(expected_calibration_error(s[m], y[m]))
    ece = {p["k"]: p["ece"] for p in raw["per_position"]}
    assert ece[1] > 0.05 and ece[1] > 2 * ece[3], ece
    fitted = calibration_summary(synthetic_record([3.0, 1.0, 1.0], seed=4), fit_temperatures(rec))
    assert fitted["per_position"][0]["ece"] < 0.5 * ece[1], (fitted["per_position"][0]["ece"], ece[1])
    assert "| ECE_k before | ECE_k after |" in calibration_markdown(
        {**_markdown_report(raw, fitted), "k": 3})


def test_platt_recovers_a_known_scale_and_shift_where_a_temperature_cannot():
    """A head reporting ``2 u - 3`` (over-confident AND pessimistic): the temperature alone rescales around
    logit 0 and cannot undo the shift, so the survival ECE stays high; temperature plus shift recovers
    T = 2, b = 1.5 and cuts the held-out ECE to a fraction."""
    scales, shifts = [2.0, 2.0, 2.0], [-3.0, -3.0, -3.0]
    rec, held_out = synthetic_record(scales, shifts=shifts), synthetic_record(scales, seed=1, shifts=shifts)
    T, b = fit_calibration(rec)
    assert torch.allclose(T, torch.tensor(scales), rtol=0.12) and torch.allclose(b, torch.full((3,), 1.5), atol=0.15), (T, b)
    raw = calibration_summary(held_out, None)["ece"]
    sts = calibration_summary(held_out, fit_temperatures(rec))["ece"]
    platt = calibration_summary(held_out, T, bias=b)
    assert platt["ece"] < 0.2 * raw and platt["ece"] < 0.5 * sts and platt["ece"] < 0.02, (raw, sts, platt["ece"])
    assert all(p["ece"] < 0.03 for p in platt["per_position"]), platt["per_position"]
    # a head whose logit carries no information: the fit flattens it to the observed rate (T at its bound)
    noise = synthetic_record([1.0], seed=5)
    noise.logits = torch.randn(noise.logits.shape, generator=torch.Generator().manual_seed(6)) * 2.0 - 2.0
    Tn, bn = fit_calibration(noise)
    rate = float((noise.accepted >= 1).double().mean())
    assert float(Tn[0]) > 10.0 and float(torch.sigmoid(bn[0])) == pytest.approx(rate, abs=0.03), (Tn, bn, rate)
    # temperature-only leaves every shift 0; positions without enough data keep both
    assert fit_calibration(rec, fit_bias=False)[1].abs().max() == 0
    T4, b4 = fit_calibration(rec, torch.tensor([1.0, 1.0, 1.0, 3.0]), torch.tensor([0.0, 0.0, 0.0, -0.7]))
    assert float(T4[3]) == 3.0 and float(b4[3]) == pytest.approx(-0.7)
    with pytest.raises(SpeculatorsError, match="initial shifts"):
        fit_calibration(rec, torch.ones(4), torch.zeros(3))


def test_a_position_whose_outcomes_all_agree_gets_a_finite_calibration():
    """30 steps that all rejected draft 1 (or all accepted it): Platt's smoothed targets give
    c_1 ~ 1/32 (or 31/32), not sigmoid(-20) ~ 0, which would make the gate cut every draft at any threshold;
    the same for STS."""
    z = torch.linspace(-2.0, 1.0, 30).unsqueeze(1)
    for accepted, target in ((0, 1 / 32), (1, 31 / 32)):
        rec = ConfidenceRecord(z.clone(), torch.ones(30, dtype=torch.int64), torch.full((30,), accepted))
        for fit_bias in (True, False):
            T, b = fit_calibration(rec, fit_bias=fit_bias)
            c = torch.sigmoid(z[:, 0] / T[0] + b[0])
            assert bool(torch.isfinite(T).all() and torch.isfinite(b).all())
            assert 0.005 < float(c.min()) and float(c.max()) < 0.995, (accepted, fit_bias, T, b)
            if fit_bias:  # the best constant is the smoothed rate
                assert float(c.mean()) == pytest.approx(target, abs=0.02), (accepted, c.mean())


def test_outcome_files_refuse_what_they_cannot_read(tmp_path):
    from safetensors.torch import save_file

    rec = synthetic_record([1.0, 1.0], n_steps=50)
    path = ConfidenceRecord.save_many({"fit": rec}, tmp_path / "o.safetensors")
    back = ConfidenceRecord.load_many(path)["fit"]
    assert torch.equal(back.drafted, rec.drafted) and torch.equal(back.logits.isnan(), rec.logits.isnan())
    (tmp_path / "corrupt.safetensors").write_bytes(b"\x10\x00garbage")
    with pytest.raises(SpeculatorsError, match="not a confidence-outcomes file"):
        ConfidenceRecord.load_many(tmp_path / "corrupt.safetensors")
    save_file({"fit.logits": rec.logits, "fit.drafted": rec.drafted}, str(tmp_path / "missing.safetensors"))
    with pytest.raises(SpeculatorsError, match="lacks the tensor fit.accepted"):
        ConfidenceRecord.load_many(tmp_path / "missing.safetensors")
    save_file({"fit.logits": rec.logits, "fit.drafted": rec.drafted, "fit.accepted": rec.accepted[:3]},
              str(tmp_path / "shapes.safetensors"))
    with pytest.raises(SpeculatorsError, match="expected \\[N, K\\], \\[N\\], \\[N\\]"):
        ConfidenceRecord.load_many(tmp_path / "shapes.safetensors")
    with pytest.raises(SpeculatorsError, match="without dots"):
        ConfidenceRecord.save_many({"a.b": rec}, tmp_path / "x.safetensors")
    assert back.prompt is None  # a record without prompt indices (and files written before them) loads
    tagged = ConfidenceRecord(rec.logits, rec.drafted, rec.accepted, torch.arange(50) // 7)
    back = ConfidenceRecord.load_many(ConfidenceRecord.save_many({"eval": tagged}, tmp_path / "p.safetensors"))
    assert torch.equal(back["eval"].prompt, torch.arange(50) // 7)
    save_file({"fit.logits": rec.logits, "fit.drafted": rec.drafted, "fit.accepted": rec.accepted,
               "fit.prompt": torch.zeros(3, dtype=torch.int64)}, str(tmp_path / "pshape.safetensors"))
    with pytest.raises(SpeculatorsError, match="prompt \\(3,\\)"):
        ConfidenceRecord.load_many(tmp_path / "pshape.safetensors")
    assert torch.equal(ConfidenceRecord.from_steps([(torch.tensor([0.1]), 1, 4), (torch.tensor([0.2]), 0, 2)]).prompt,
                       torch.tensor([4, 2]))
    with pytest.raises(SpeculatorsError, match="some steps only"):
        ConfidenceRecord.from_steps([(torch.tensor([0.1]), 1, 4), (torch.tensor([0.2]), 0)])


def clustered_record(n_prompts: int = 40, steps_per_prompt: int = 100, seed: int = 0) -> ConfidenceRecord:
    """One draft per step and an uninformative head (about 0.5 each step, a little noise so that no two
    predictions tie), while each prompt's real acceptance rate is drawn from U(0.05, 0.95): calibrated on
    average, but the steps of one prompt share their rate."""
    g = torch.Generator().manual_seed(seed)
    rate = torch.rand(n_prompts, generator=g) * 0.9 + 0.05
    prompt = torch.arange(n_prompts).repeat_interleave(steps_per_prompt)
    accepted = (torch.rand(prompt.numel(), generator=g) < rate[prompt]).long()
    n = prompt.numel()
    return ConfidenceRecord(torch.randn(n, 1, generator=g) * 0.01, torch.ones(n, dtype=torch.int64), accepted, prompt)


def test_ece_prompt_bootstrap_resamples_whole_prompts():
    rec = synthetic_record([3.0, 3.0, 1.0], n_steps=1200, seed=4)
    rec.prompt = torch.arange(1200) // 20  # 60 prompts of 20 steps
    T = torch.tensor([3.0, 3.0, 1.0])
    boot = ece_prompt_bootstrap(rec, {"raw": (None, None), "fit": (T, None)}, "raw", resamples=200)
    assert boot["prompts"] == 60 and boot["resamples"] == 200 and set(boot["ratio"]) == {"fit"}
    for name, temps in (("raw", None), ("fit", T)):  # the point estimates are the plain ECEs
        s, y, _ = survival_pairs(rec, temps)
        e = boot["ece"][name]
        assert e["point"] == pytest.approx(expected_calibration_error(s, y)) and e["lo"] <= e["point"] <= e["hi"]
    r = boot["ratio"]["fit"]
    assert r["point"] == pytest.approx(boot["ece"]["fit"]["point"] / boot["ece"]["raw"]["point"])
    assert r["hi"] < 1.0  # the known temperatures beat the 3x-overconfident head on every resample band
    # correlated steps widen the interval: the same outcomes with every step its own prompt give a
    # far narrower band than with the 40 shared acceptance rates kept together
    clustered = clustered_record()
    spread = {}
    for name, prompt in (("clustered", clustered.prompt), ("independent", torch.arange(clustered.prompt.numel()))):
        rec2 = ConfidenceRecord(clustered.logits, clustered.drafted, clustered.accepted, prompt)
        e = ece_prompt_bootstrap(rec2, {"raw": (None, None)}, "raw", resamples=300, seed=1)["ece"]["raw"]
        spread[name] = e["hi"] - e["lo"]
    assert spread["clustered"] > 2.0 * spread["independent"], spread
    # nothing to resample: no prompt indices or one prompt; bad arguments are refused
    assert ece_prompt_bootstrap(synthetic_record([1.0], n_steps=50), {"raw": (None, None)}, "raw") is None
    one = ConfidenceRecord(rec.logits, rec.drafted, rec.accepted, torch.zeros(1200, dtype=torch.int64))
    assert ece_prompt_bootstrap(one, {"raw": (None, None)}, "raw") is None
    with pytest.raises(SpeculatorsError, match="reference 'x'"):
        ece_prompt_bootstrap(rec, {"raw": (None, None)}, "x")
    with pytest.raises(SpeculatorsError, match="resamples"):
        ece_prompt_bootstrap(rec, {"raw": (None, None)}, "raw", resamples=0)


def _markdown_report(before: dict, after: dict) -> dict:
    """The smallest report :func:`calibration_markdown` renders (no sweep, no plot)."""
    return {"num_prompts": 2, "fit_prompts": 1, "ece_prompts": 1, "split": "interleaved", "max_new_tokens": 8,
            "sampling": "greedy", "steps_fit": 1, "steps_eval": 1, "binning": "equal-mass bins",
            "temperatures_before": None, "temperatures_after": [1.0, 1.0, 1.0], "before": before, "after": after,
            "in_sample": {"before": 0.0, "after": 0.0}}


def test_positions_without_data_keep_their_temperature():
    rec = synthetic_record([2.0, 2.0])
    initial = torch.tensor([1.0, 1.0, 5.0, 7.0])  # the drafter's buffer is longer than K
    T = fit_temperatures(rec, initial)
    assert T.shape == (4,) and T[2:].tolist() == [5.0, 7.0]
    assert torch.allclose(T[:2], torch.tensor([2.0, 2.0]), rtol=0.15)
    few = ConfidenceRecord(rec.logits[:30], rec.drafted[:30], rec.accepted[:30])  # < 20 judged steps at k=2
    assert int(((few.drafted >= 2) & (few.accepted >= 1)).sum()) < 20
    assert fit_temperatures(few, initial)[1] == 1.0
    with pytest.raises(SpeculatorsError, match="initial temperatures"):
        fit_temperatures(rec, torch.tensor([1.0]))


def test_equal_mass_bins_and_ece_by_hand():
    p = torch.tensor([0.1, 0.2, 0.3, 0.4, 0.6, 0.7, 0.8, 0.9])
    y = torch.tensor([0.0, 0.0, 1.0, 0.0, 1.0, 1.0, 1.0, 1.0])
    bins = reliability_bins(p, y, bins=3)
    assert [b["count"] for b in bins] == [3, 3, 2]
    # bin means 0.2 / 0.5667 / 0.85 against frequencies 1/3, 2/3, 1
    expected = (3 * abs(0.2 - 1 / 3) + 3 * abs(0.5666667 - 2 / 3) + 2 * abs(0.85 - 1.0)) / 8
    assert expected_calibration_error(p, y, bins=3) == pytest.approx(expected, abs=1e-6)
    assert expected_calibration_error(torch.zeros(0), torch.zeros(0)) == 0.0
    with pytest.raises(SpeculatorsError, match="bins"):
        reliability_bins(p, y, bins=0)


def test_ece_noise_floor_is_the_ece_of_redrawn_outcomes():
    """By hand: each redraw's ECE through expected_calibration_error, with the floor's own draws."""
    p = torch.rand(301, generator=torch.Generator().manual_seed(3)) ** 2
    floor = ece_noise_floor(p, bins=7, draws=40, seed=11)
    ps = torch.sort(p.double()).values
    y = torch.bernoulli(ps.expand(40, ps.numel()), generator=torch.Generator().manual_seed(11))
    eces = torch.tensor([expected_calibration_error(ps, y[d], bins=7) for d in range(40)], dtype=torch.float64)
    assert floor["mean"] == pytest.approx(float(eces.mean()), abs=1e-12)
    assert floor["lo"] == pytest.approx(float(torch.quantile(eces, 0.05)), abs=1e-12)
    assert floor["hi"] == pytest.approx(float(torch.quantile(eces, 0.95)), abs=1e-12)
    assert 0.0 < floor["lo"] < floor["mean"] < floor["hi"]
    assert ece_noise_floor(torch.zeros(0)) == {"mean": 0.0, "lo": 0.0, "hi": 0.0}
    for bad in ({"bins": 0}, {"draws": 0}, {"draws": True}):
        with pytest.raises(SpeculatorsError, match=next(iter(bad))):
            ece_noise_floor(p, **bad)


def test_ece_noise_floor_separates_calibrated_from_miscalibrated_heads():
    """Outcomes drawn from the predictions (a calibrated head) score inside the band in ~90% of seeds; a
    head off by 0.1 everywhere scores far above it; more pairs narrow the band like 1/sqrt(n)."""
    g = torch.Generator().manual_seed(0)
    p = torch.rand(4000, generator=g) * 0.8 + 0.1
    floor = ece_noise_floor(p)
    inside = sum(floor["lo"] <= expected_calibration_error(p, torch.bernoulli(p, generator=g)) <= floor["hi"]
                 for _ in range(100))
    assert 75 <= inside <= 99, inside
    off = expected_calibration_error(p, torch.bernoulli((p + 0.1).clamp(max=1.0), generator=g))
    assert off > 2 * floor["hi"], (off, floor)
    big = ece_noise_floor(p.repeat(16))
    assert 0.15 < big["mean"] / floor["mean"] < 0.4, (big, floor)
    summary = calibration_summary(synthetic_record([1.0, 1.0]), None)
    assert summary["ece_floor"]["hi"] > 0 and all(q["ece_floor"]["hi"] > 0 for q in summary["per_position"])


# ----------------------------------------------------------------------------- through the decoding loop
class OracleWithKnownConfidence:
    """Greedy drafts that are the target's own argmax with probability sigmoid(u_k) (else a wrong token), with
    ``u_k`` drawn per draft and reported as ``scale * u_k``: at temperature 0 draft k is accepted with
    probability exactly sigmoid(u_k) given drafts 1..k-1 were, so the right temperature is ``scale``."""

    def __init__(self, target, scale: float, K: int = 4):
        self.target, self.scale = target, scale
        self.confidence_temperature, self.confidence_bias = torch.ones(K), torch.zeros(K)
        self.cache: dict[tuple, int] = {}

    def confidence_calibration(self):
        """The declared drafter interface: ``(temperatures [K], shifts [K])``."""
        return self.confidence_temperature, self.confidence_bias

    def argmax(self, ctx):
        key = tuple(ctx)
        if key not in self.cache:
            self.cache[key] = int(self.target.features(torch.tensor([ctx]), with_logits=True).logits[0, -1].argmax())
        return self.cache[key]

    def start(self, ids, features=None):
        return ids.reshape(-1).tolist()

    def propose(self, states, ks, sampling=None, generators=None):
        out = []
        for i, (s, k) in enumerate(zip(states, ks)):
            g = generators[i] if generators is not None else None
            ctx, toks, z = list(s), [], []
            for _ in range(k):
                u = float(torch.randn(1, generator=g)) * 1.5 + 1.0
                right = float(torch.rand(1, generator=g)) < float(torch.sigmoid(torch.tensor(u)))
                best = self.argmax(ctx)
                t = best if right else (best + 1) % self.target.vocab_size
                toks.append(t)
                z.append(self.scale * u)
                ctx.append(t)
            out.append(Proposal(torch.tensor(toks, dtype=torch.int64), None,
                                torch.tensor(z) if toks else None))
        return out

    def advance(self, states, new_ids, features):
        for s, ids in zip(states, new_ids):
            s.extend(ids.tolist())


def test_calibration_through_the_decoding_loop_finds_the_known_temperature(tmp_path):
    target = untied_target()
    prompts = [rand_prompt(4 + i % 5, 300 + i) for i in range(32)]
    res = calibrate_drafter(target, OracleWithKnownConfidence(target, 3.0), prompts, 4, 40, None,
                            batch_size=8, log=lambda m: None)
    T, report = res.temperature, res.report
    assert report["split"] == "held-out halves" and report["fit_prompts"] == 16
    assert report["steps_fit"] > 150 and report["steps_eval"] > 150
    assert 2.0 < float(T[0]) < 4.2 and 2.2 < float(T.mean()) < 3.8, T  # ~200 steps: the true T is 3
    assert float(res.bias.abs().max()) < 0.6, res.bias  # and the true shift 0
    # ECE on the OTHER half of the prompts (not fitted on)
    assert report["after"]["ece"] < 0.5 * report["before"]["ece"], (report["before"]["ece"], report["after"]["ece"])
    out = write_calibration_report(report, tmp_path / "calibration", res.records)
    saved = json.loads((out / "calibration.json").read_text())
    assert saved["temperatures_after"] == pytest.approx(T.tolist())
    assert saved["biases_after"] == pytest.approx(res.bias.tolist()) and saved["outcomes"] == "outcomes.safetensors"
    back = ConfidenceRecord.load_many(out / "outcomes.safetensors")  # refit without decoding again
    assert set(back) == {"fit", "eval"} and torch.equal(back["eval"].accepted, res.eval_record.accepted)
    assert torch.equal(fit_calibration(back["fit"])[0], T)
    md = (out / "calibration.md").read_text()
    assert "![reliability diagram](reliability.png)" in md and "equal-mass" in md
    boot = report["bootstrap"]  # the measuring prompts resampled whole
    assert boot["prompts"] == 16 and set(boot["ratio"]) == {"after"}
    assert boot["ece"]["uncalibrated"]["point"] == pytest.approx(report["uncalibrated"]["ece"])
    assert boot["ratio"]["after"]["hi"] < 1.0 and "ratio fitted / raw" in md
    assert torch.equal(back["eval"].prompt, res.eval_record.prompt)
    f = report["after"]["ece_floor"]  # the ECE's resolution, beside it
    assert f"| after | {report['after']['ece']:.4f} | {f['mean']:.4f} [{f['lo']:.4f}, {f['hi']:.4f}] |" in md
    # the raw 3x head is miscalibrated far beyond sampling noise; the fitted one is not
    assert report["before"]["ece"] > report["before"]["ece_floor"]["hi"] and report["after"]["ece"] < 2 * f["hi"]
    assert (out / "reliability.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_a_recalibration_reports_the_raw_head_beside_the_stored_temperatures(tmp_path):
    """A checkpoint that already holds fitted T: "before" is read under that T, "uncalibrated" under every
    T = 1 (the raw head, the issue's reference), and the Markdown shows both rows."""
    target = untied_target()
    prompts = [rand_prompt(4 + i % 5, 300 + i) for i in range(12)]
    drafter = OracleWithKnownConfidence(target, 3.0)
    drafter.confidence_temperature = torch.full((4,), 2.5)
    logged: list[str] = []
    report = calibrate_drafter(target, drafter, prompts, 4, 24, None, batch_size=4, log=logged.append).report
    assert f"(uncalibrated, T = 1, b = 0: {report['uncalibrated']['ece']:.4f})" in logged[-1]
    assert report["temperatures_before"] == pytest.approx([2.5] * 4)
    # an oracle whose logits are 3x the true ones: the raw head is the worst calibrated of the three
    assert report["uncalibrated"]["ece"] > report["before"]["ece"], (report["uncalibrated"], report["before"])
    assert report["uncalibrated"]["ece"] != pytest.approx(report["before"]["ece"])
    md = calibration_markdown(report)
    assert f"| uncalibrated (every T = 1, b = 0) | {report['uncalibrated']['ece']:.4f} |" in md
    assert f"| before (the checkpoint's calibration) | {report['before']['ece']:.4f} |" in md
    out = write_calibration_report(report, tmp_path / "recalibration")  # the diagram draws all three
    assert (out / "reliability.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    drafter.confidence_temperature = torch.ones(4)  # a raw head: the extra row would repeat "before"
    raw = calibrate_drafter(target, drafter, prompts[:4], 4, 16, None, batch_size=4, log=lambda m: None).report
    assert raw["uncalibrated"]["ece"] == pytest.approx(raw["before"]["ece"])
    assert "uncalibrated (every T = 1" not in calibration_markdown(raw) and "| before |" in calibration_markdown(raw)
    drafter.confidence_temperature = torch.tensor([1.0, 1.0, 2.5, 2.5])  # stored T only beyond the K measured
    k2 = calibrate_drafter(target, drafter, prompts[:4], 2, 16, None, batch_size=4, log=lambda m: None).report
    assert "uncalibrated (every T = 1" not in calibration_markdown(k2)
    drafter.confidence_temperature = torch.ones(4)
    drafter.confidence_bias = torch.tensor([0.5, 0.0, 0.0, 0.0])  # a stored shift alone is a calibration too
    shifted = calibrate_drafter(target, drafter, prompts[:4], 2, 16, None, batch_size=4, log=lambda m: None).report
    assert shifted["biases_before"] == pytest.approx([0.5, 0, 0, 0])
    assert "uncalibrated (every T = 1, b = 0)" in calibration_markdown(shifted)


def test_the_fit_and_measure_sides_interleave_the_prompts(monkeypatch):
    """Prompts listed source by source (8 of A, then 8 of B): both sides get 4 of each, not A to fit and B
    to measure; the split is even for other fractions too."""
    import speculators.calibration.run as cal

    assert cal.interleaved_split(10, 5) == [1, 3, 5, 7, 9]
    assert cal.interleaved_split(4, 4) == [0, 1, 2, 3] and cal.interleaved_split(4, 0) == []
    idx = cal.interleaved_split(12, 3)
    assert len(idx) == 3 and all(b - a == 4 for a, b in zip(idx, idx[1:]))
    with pytest.raises(SpeculatorsError, match="n_fit"):
        cal.interleaved_split(3, 4)
    seen: list[list[str]] = []

    def fake_collect(target, drafter, prompts, k, max_new_tokens, **kw):
        seen.append(list(prompts))
        return ConfidenceRecord.from_steps([(torch.tensor([0.5, -0.5]), i % 3) for i in range(30)])

    monkeypatch.setattr(cal, "collect_confidence_outcomes", fake_collect)
    prompts = [f"A{i}" for i in range(8)] + [f"B{i}" for i in range(8)]
    report = cal.calibrate_drafter(None, SimpleNamespace(), prompts, 2, 8, None, log=lambda m: None).report
    fit, measured = seen
    assert report["fit_prompts"] == 8 and sorted(fit + measured) == sorted(prompts)
    for side in (fit, measured):
        assert sum(p.startswith("A") for p in side) == 4 and sum(p.startswith("B") for p in side) == 4


def test_a_drafter_without_confidences_is_refused():
    target = untied_target()

    class NoConfidence(OracleWithKnownConfidence):
        def propose(self, *a, **kw):
            return [Proposal(p.token_ids) for p in super().propose(*a, **kw)]

    with pytest.raises(SpeculatorsError, match="no confidence logits"):
        calibrate_drafter(target, NoConfidence(target, 1.0), [rand_prompt(5, 1), rand_prompt(6, 2)], 3, 8, None,
                          log=lambda m: None)


def test_threshold_sweep_by_hand():
    """Three steps with known survivals (T = 1): sigmoid(z) = 0.9, 0.5, ... per position. Threshold 0.4
    keeps drafts while S_k >= 0.4: step 1 S = (0.9, 0.45, 0.225) keeps 2; step 2 S = (0.3, ...) keeps 0;
    step 3 S = (0.9, 0.81) keeps 2."""
    logit = lambda p: float(torch.logit(torch.tensor(p, dtype=torch.float64)))  # noqa: E731
    nan = float("nan")
    rec = ConfidenceRecord(torch.tensor([[logit(0.9), logit(0.5), logit(0.5)],
                                         [logit(0.3), logit(0.9), logit(0.9)],
                                         [logit(0.9), logit(0.9), nan]], dtype=torch.float32),
                           torch.tensor([3, 3, 2]), torch.tensor([3, 1, 0]))
    (row,) = threshold_sweep(rec, None, [0.4])
    kept, acc = [2, 0, 2], [3, 1, 0]
    assert row["verified_per_step"] == pytest.approx(sum(kept) / 3)
    assert row["verified_cut"] == pytest.approx(1 - (4 / 3) / (8 / 3))
    assert row["tau_est"] == pytest.approx(sum(1 + min(a, m) for a, m in zip(acc, kept)) / 3)  # (3 + 1 + 1) / 3
    assert row["tau_ratio"] == pytest.approx((5 / 3) / ((4 + 2 + 1) / 3))
    # a lower threshold never verifies fewer drafts, and the sweep is monotone in the cut
    rows = threshold_sweep(rec, None, [0.1, 0.4, 0.95])
    assert [r["verified_per_step"] for r in rows] == sorted((r["verified_per_step"] for r in rows), reverse=True)
    assert rows[-1]["verified_per_step"] == 0.0 and rows[-1]["tau_est"] == 1.0


def test_choose_threshold_keeps_tau_and_cuts_the_most():
    assert choose_threshold([{"threshold": 0.1, "verified_cut": 0.0, "tau_ratio": 1.0}], 0.97) is None  # no cut
    rows = [{"threshold": 0.1, "verified_cut": 0.1, "tau_ratio": 1.0},
            {"threshold": 0.3, "verified_cut": 0.4, "tau_ratio": 0.98},
            {"threshold": 0.5, "verified_cut": 0.6, "tau_ratio": 0.90}]
    assert choose_threshold(rows, 0.97)["threshold"] == 0.3
    assert choose_threshold(rows, 0.85)["threshold"] == 0.5
    assert choose_threshold(rows, 1.01) is None


def test_calibrate_report_recommends_a_threshold_that_cuts_verified_drafts():
    """On a synthetic head with known temperatures, the recommended threshold (chosen on the record) cuts
    verified drafts while the simulated tau stays within the bound."""
    rec = synthetic_record([1.0, 1.0, 1.0, 1.0], n_steps=3000, seed=3)
    rows = threshold_sweep(rec, None)
    chosen = choose_threshold(rows, 0.97)
    assert chosen is not None and chosen["tau_ratio"] >= 0.97 and chosen["verified_cut"] > 0.1


# ----------------------------------------------------------------------------- the checkpoint
@pytest.fixture()
def confident_checkpoint(tmp_path):
    """A tiny DSpark checkpoint (block 4: a calibration of 4 positions, ones / zeros until calibrated)."""
    target = untied_target()
    torch.manual_seed(0)
    fam = registry.get("dspark")
    cfg = fam.config_class(block_size=4, num_layers=1, markov_rank=4)
    d = fam.from_target(cfg, target, DraftVocab.full(target.vocab_size))
    return d.save_pretrained(tmp_path / "ckpt"), fam


def _calibration_entry(path):
    return json.loads((path / "config.json").read_text())["speculators_training"]["confidence_calibration"]


def test_temperatures_round_trip_through_the_checkpoint(confident_checkpoint):
    """The calibration goes to config.json (speculators_training.confidence_calibration); the weights file,
    which holds only what vLLM places, is not touched."""
    from speculators.drafters import Drafter

    path, _ = confident_checkpoint
    before = (path / WEIGHTS_NAME).read_bytes()
    T = torch.tensor([2.5, 1.75, 0.5, 3.0])
    store_temperatures(path, T)
    loaded = Drafter.from_pretrained(path)
    assert torch.equal(loaded.confidence_calibration()[0], T) and torch.equal(loaded.confidence_calibration()[1],
                                                                              torch.zeros(4))
    assert _calibration_entry(path) == {"temperature": T.tolist(), "bias": [0.0] * 4}
    assert (path / WEIGHTS_NAME).read_bytes() == before
    assert not [p.name for p in path.iterdir() if p.name.startswith(".")]  # no temporary file left


def test_temperatures_stored_in_a_published_bf16_checkpoint_stay_exact(confident_checkpoint, tmp_path):
    """``final/`` (train.save_dtype bfloat16) is what calibrate rewrites: T is kept exactly (float32 values
    in config.json), never in the bf16 weights file."""
    from safetensors.torch import load_file

    from speculators.drafters import Drafter
    from speculators.drafters.checkpoint import save_pretrained

    path, _ = confident_checkpoint
    final = save_pretrained(Drafter.from_pretrained(path), tmp_path / "final", dtype="bfloat16", frozen_copies=False)
    T = torch.tensor([1.2345, 0.7031, 2.9999, 1.0001])
    store_temperatures(final, T)
    after = load_file(str(final / WEIGHTS_NAME))
    assert "confidence_temperature" not in after and after["fc.weight"].dtype == torch.bfloat16
    assert torch.equal(Drafter.from_pretrained(final).confidence_calibration()[0], T)


def test_a_bad_temperature_leaves_the_checkpoint_as_it_was(confident_checkpoint):
    path, _ = confident_checkpoint
    raw, cfg = (path / WEIGHTS_NAME).read_bytes(), (path / "config.json").read_bytes()
    for bad in (torch.tensor([1.0, 2.0]), torch.tensor([1.0, 0.0, 1.0, 1.0]), torch.tensor([1.0, float("nan"), 1, 1])):
        with pytest.raises(SpeculatorsError, match="confidence_temperature must be"):
            store_temperatures(path, bad)
        assert (path / WEIGHTS_NAME).read_bytes() == raw and (path / "config.json").read_bytes() == cfg


def test_a_checkpoint_without_a_confidence_head_is_refused(tmp_path):
    target = untied_target(layers=3)  # EAGLE-3 takes three distinct taps
    cls = registry.get("eagle3")
    d = cls.from_target(cls.config_class(algorithm="eagle3"), target, DraftVocab.full(target.vocab_size))
    path = d.save_pretrained(tmp_path / "plain")
    raw = (path / WEIGHTS_NAME).read_bytes()
    with pytest.raises(SpeculatorsError, match="no confidence head"):
        store_temperatures(path, torch.ones(4))
    assert (path / WEIGHTS_NAME).read_bytes() == raw


# ----------------------------------------------------------------------------- the command
def test_calibrate_run_skips_the_prompts_the_eval_scores(tiny_target_dir, isolated_cache, tmp_path, monkeypatch):
    """``speculators calibrate RUN`` fits T (and chooses the gate threshold) on held-out prompts AFTER the
    ones ``speculators eval`` scores by default (eval.num_prompts), so the eval's tau is not measured on
    the data the threshold was chosen on; ``--skip-prompts 0`` uses them; a skip past the end is an error."""
    from pathlib import Path

    from typer.testing import CliRunner

    from speculators import calibration as cal
    from speculators import workflows
    from speculators.evaluation import loading
    from speculators.recipe import load_recipe
    from speculators.train.run_dir import RUN_RECIPE
    from speculators.cli import app

    recipe = Path(__file__).resolve().parents[2] / "recipes" / "tiny-dspark.yaml"
    out = tmp_path / "run"
    runner = CliRunner()
    r = runner.invoke(app, ["train", str(recipe), f"target.model={tiny_target_dir}", "train.steps=2",
                            "eval.num_prompts=2", "-o", str(out)])
    assert r.exit_code == 0, r.output
    seen = []

    def fake(target, drafter, prompts, *a, **kw):  # record the prompts; no decoding needed here
        seen.append([tuple(p) for p in prompts])
        sweeps = {f"{w}_{t}": [] if w == "threshold_sweep" else None
                  for w in ("threshold_sweep", "recommended_threshold") for t in ("fitted", "current")}
        return SimpleNamespace(temperature=torch.ones(4), bias=torch.zeros(4), records={}, report={
            "k": 1, "before": {"ece": 0.0}, "after": {"ece": 0.0}, "split": "x", "temperatures_after": [1.0],
            "biases_after": [0.0], **sweeps})

    monkeypatch.setattr(cal, "calibrate_drafter", fake)
    monkeypatch.setattr(cal, "write_calibration_report", lambda report, output, records=None: Path(output))
    rec = load_recipe(out / "final" / RUN_RECIPE)
    workflows.calibrate_run(out, store=False, log=lambda m: None)
    workflows.calibrate_run(out, store=False, log=lambda m: None, skip_prompts=0)
    _, target, _ = loading.load_for_eval(out / "final", rec, None, None, lambda m: None, None)
    evald = [tuple(p["input_ids"]) for p in loading.eval_prompts(None, rec, target, 2)[0]]
    assert len(seen[1]) == 2 and seen[1] == evald  # --skip-prompts 0: the eval's own prompts
    assert seen[0] and not set(seen[0]) & set(evald)  # default: disjoint from what eval scores
    with pytest.raises(SpeculatorsError, match="no prompts left"):
        workflows.calibrate_run(out, store=False, log=lambda m: None, skip_prompts=10_000)
    # several --prompts sources: each keeps up to num_prompts after its own skip (as the eval takes each)
    seen.clear()
    workflows.calibrate_run(out, store=False, log=lambda m: None, prompts=["chatterbot", "humaneval"],
                            skip_prompts=1, eval_overrides={"num_prompts": 2})
    per = {}
    for src in ("chatterbot", "humaneval"):
        per[src] = [tuple(p["input_ids"]) for p in loading.eval_prompts([src], rec, target, 3)[0]]
    assert seen[0] == per["chatterbot"][1:3] + per["humaneval"][1:3]
    # temperatures that RAISE the held-out ECE are not stored, and the threshold is read under the old T
    stored = []
    monkeypatch.setattr(cal, "store_temperatures", lambda ckpt, T, b=None: stored.append(T))
    for after, expect in ((0.2, []), (0.05, [1])):
        def fake2(*a, after=after, **kw):
            res = fake(*a, **kw)
            res.report.update(before={"ece": 0.1}, after={"ece": after}, split="held-out halves",
                              recommended_threshold_fitted={"threshold": 0.3},
                              recommended_threshold_current={"threshold": 0.1})
            return res
        monkeypatch.setattr(cal, "calibrate_drafter", fake2)
        stored.clear()
        rep, _ = workflows.calibrate_run(out, store=True, log=lambda m: None)
        assert len(stored) == len(expect) and rep["stored"] == bool(expect)
        assert rep["recommended_threshold"]["threshold"] == (0.3 if expect else 0.1)
        assert ("not_stored" in rep) == (not expect)


def test_calibrate_command_end_to_end(tiny_target_dir, isolated_cache, tmp_path):
    """``speculators calibrate`` on a (tiny, barely trained) DSpark run: the default fits a temperature and
    a shift per position, ``--temperature-only`` leaves every shift 0; the report, the raw outcomes
    (reloadable, as many steps as the report counts) and the checkpoint agree."""
    from pathlib import Path

    from safetensors.torch import load_file
    from typer.testing import CliRunner

    from speculators.calibration import METHOD_PLATT, METHOD_STS
    from speculators.cli import app

    recipe = Path(__file__).resolve().parents[2] / "recipes" / "tiny-dspark.yaml"
    out = tmp_path / "run"
    runner = CliRunner()
    r = runner.invoke(app, ["train", str(recipe), f"target.model={tiny_target_dir}", "train.steps=2", "-o", str(out)])
    assert r.exit_code == 0, r.output
    common = ["--prompts", "chatterbot", "--num-prompts", "8", "--max-new-tokens", "12", "--skip-prompts", "0"]
    # in-sample (--fit-fraction 1): always stored; then temperature-only on held-out halves, not stored
    for flags, method in ((["--fit-fraction", "1"], METHOD_PLATT),
                          (["--temperature-only", "--no-store", "--min-tau-ratio", "0.5"], METHOD_STS)):
        rep_dir = tmp_path / f"cal{len(flags)}"
        r = runner.invoke(app, ["calibrate", str(out), *common, *flags, "--output", str(rep_dir)])
        assert r.exit_code == 0, r.output
        report = json.loads((rep_dir / "calibration.json").read_text())
        assert report["method"] == method and len(report["biases_after"]) == 4
        assert report["min_tau_ratio"] == (0.97 if method == METHOD_PLATT else 0.5)
        assert ("b = [" in r.output) == (method == METHOD_PLATT)
        records = ConfidenceRecord.load_many(rep_dir / "outcomes.safetensors")
        assert len(records["fit"]) == report["steps_fit"]
        assert len(records.get("eval", records["fit"])) == report["steps_eval"]
        weights = load_file(str(out / "final" / WEIGHTS_NAME))
        assert not any(k.startswith("confidence_temperature") or k.startswith("confidence_bias") for k in weights)
        stored = _calibration_entry(out / "final")  # config.json, where vLLM does not look
        weights = {"confidence_temperature": torch.tensor(stored["temperature"]),
                   "confidence_bias": torch.tensor(stored["bias"])}
        if method == METHOD_PLATT:  # what was fitted is what the checkpoint now holds
            assert report["stored"] is True and set(records) == {"fit"}
            assert weights["confidence_bias"].tolist() == pytest.approx(report["biases_after"])
            assert weights["confidence_temperature"].tolist() == pytest.approx(report["temperatures_after"])
        else:  # not stored: the checkpoint keeps the Platt calibration of the first run
            assert report["stored"] is False
            for k in range(report["k"]):  # a fitted position has b = 0; one with too few steps keeps both
                kept = (report["temperatures_after"][k] == report["temperatures_before"][k]
                        and report["biases_after"][k] == report["biases_before"][k])
                assert report["biases_after"][k] == 0.0 or kept, k
            assert report["biases_before"] == pytest.approx(weights["confidence_bias"].tolist())
            assert set(records) == {"fit", "eval"}


class PromptTagger(OracleWithKnownConfidence):
    """Reports each draft's confidence logit as its request's prompt length, so a step's prompt index can
    be checked against the logits it recorded."""

    def start(self, ids, features=None):
        return {"ctx": ids.reshape(-1).tolist(), "len": ids.numel() - 1}

    def propose(self, states, ks, sampling=None, generators=None):
        props = super().propose([s["ctx"] for s in states], ks, sampling, generators)
        return [Proposal(p.token_ids, None, torch.full((p.token_ids.numel(),), float(s["len"])))
                for s, p in zip(states, props)]

    def advance(self, states, new_ids, features):
        super().advance([s["ctx"] for s in states], new_ids, features)


def test_every_recorded_step_knows_its_prompt():
    """Steps carry the index of the prompt they decoded (batched, requests joining as others finish),
    identical prompts included: the tagger's logit (its prompt's length) matches the indexed prompt."""
    from speculators.calibration import collect_confidence_outcomes

    target = untied_target()
    prompts = [rand_prompt(3 + i, 500 + i) for i in range(7)]
    prompts.insert(3, list(prompts[1]))  # the same prompt twice: both requests get their own index
    rec = collect_confidence_outcomes(target, PromptTagger(target, 1.0), prompts, 3, 12, batch_size=3)
    assert rec.prompt is not None and set(rec.prompt.tolist()) == set(range(len(prompts)))
    for z, p in zip(rec.logits[:, 0].tolist(), rec.prompt.tolist()):
        assert z == len(prompts[p])
