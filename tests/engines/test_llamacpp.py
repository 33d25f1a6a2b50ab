"""llama.cpp as a serving engine: the build, the GGUF export, the server and the engine eval.

The first part needs no llama.cpp: the engine's counts -> tau, the near-tie rule, the report, which families
have a llama.cpp path, the server's start-up errors (a fake binary) and the build's exit codes. The second part
runs the real ``llama-server`` (``make llama-cpp`` builds it): a tiny EAGLE-3 run is trained, converted with
llama.cpp's own converter and measured inside the engine, whose greedy outputs with the drafter must equal its
plain ones. Without a build those tests skip saying why; under ``CI=true`` they fail instead.
"""

from __future__ import annotations

import json
import stat
from pathlib import Path

import pytest
import torch

from speculators.engines import llamacpp_build
from speculators.engines.gguf_export import spec_type_of
from speculators.engines.llamacpp_build import LlamaCpp, LlamaCppUnavailable, find_llama_cpp
from speculators.engines.llamacpp_bench import (break_even_taus, curve_lines, step_cost_lines, step_costs,
                                                verify_cost_curve)
from speculators.engines.llamacpp_eval import (EnginePass, EngineSettings, best_setting, classify_engine_mismatch,
                                               engine_row, fastest_setting, loop_comparison, render_markdown, timings)
from speculators.evaluation.greedy_check import first_diff
from speculators.engines.llamacpp_server import Completion, LlamaServer
from speculators.errors import SpeculatorsError

ROOT = Path(__file__).resolve().parents[2]
TINY = ROOT / "recipes" / "tiny-eagle3.yaml"


def _c(tokens, drafted=0, accepted=0, seconds=1.0) -> Completion:
    return Completion(tokens=list(tokens), seconds=seconds, prompt_seconds=0.1, draft_n=drafted,
                      draft_accepted=accepted, stop="limit", top_logprobs=[])


# ----------------------------------------------------------------------------- without llama.cpp


def test_engine_row_counts_tau_from_the_servers_own_counts():
    """tau = tokens of decode steps / decode steps, the prompt's forward and its first token left out as our loop
    counts (steps = tokens - 1 - accepted drafts: every step emits its accepted drafts plus one target token);
    acceptance = accepted / drafted; no drafts -> n/a, not 0; no step -> tau n/a."""
    p = EnginePass("drafter", k=3, draft_outtype="f16")
    row = engine_row(p, [_c(range(10), drafted=9, accepted=6), _c(range(8), drafted=6, accepted=2)], wall=2.0)
    assert row["tokens"] == 18 and row["steps"] == (9 - 6) + (7 - 2)
    assert row["tau"] == pytest.approx(16 / 8) and row["acceptance_rate"] == pytest.approx(8 / 15)
    assert row["tokens_per_s"] == pytest.approx(9.0) and row["decode_tokens_per_s"] == pytest.approx(9.0)
    lo, hi = row["tau_ci"]
    assert lo <= row["tau"] <= hi and row["engine"] == "llama.cpp" and row["label"] == "drafter k=3 t=0"
    plain = engine_row(EnginePass("plain"), [_c(range(5))], wall=1.0)
    assert plain["tau"] == 1.0 and plain["acceptance_rate"] is None
    empty = engine_row(EnginePass("plain"), [_c([])], wall=0.0)
    assert empty["tau"] is None and empty["tau_ci"] is None and empty["tokens_per_s"] is None
    eos = engine_row(p, [_c(range(3), drafted=3, accepted=3)], wall=1.0)  # drafts counted after a stop
    assert eos["steps"] == 0 and eos["tau"] is None


def test_pass_labels_are_unique_per_setting():
    passes = [EnginePass("plain"), EnginePass("plain", temperature=1.0), EnginePass("plain", parallel=4),
              EnginePass("drafter", k=2, draft_outtype="f16"), EnginePass("drafter", k=2, draft_outtype="q8_0"),
              EnginePass("drafter", k=2, draft_outtype="f16", p_min=0.5), EnginePass("ngram-mod")]
    assert len({p.label for p in passes}) == len(passes)


@pytest.mark.parametrize("bad, match", [({"ks": (0,)}, r"\(-k\)"), ({"temperatures": (1.0,)}, r"\(-t\) must include 0"),
                                        ({"parallel": (2,)}, "--slots"), ({"p_mins": (1.5,)}, "--p-min"),
                                        ({"draft_outtypes": ()}, "--draft-outtypes"),
                                        ({"max_new_tokens": 0}, "--max-new-tokens"),
                                        ({"draft_threads": (0,)}, "--draft-threads")])
def test_engine_settings_refuse_bad_values(bad, match):
    with pytest.raises(SpeculatorsError, match=match):
        EngineSettings(**bad)


def _rows():
    def row(method, tps, t=0.0, par=1, k=None, outtype=None, tau=1.0, tokens=100, forwards=100):
        p = EnginePass(method, temperature=t, parallel=par, k=k, draft_outtype=outtype)
        return {"label": p.label, "method": method, "temperature": t, "batch_size": par, "k": k, "p_min": None,
                "draft_outtype": outtype, "draft_threads": None, "tokens_per_s": tps, "decode_tokens_per_s": tps, "tau": tau,
                "tau_ci": [tau - 0.1, tau + 0.1], "tokens": tokens, "steps": forwards,
                "decode_seconds": tokens / tps}
    return [row("plain", 90.0), row("drafter", 50.0, k=1, outtype="f16", tau=1.3, forwards=77),
            row("drafter", 60.0, k=2, outtype="f16", tau=1.5, forwards=67), row("ngram-simple", 100.0),
            row("drafter", 95.0, t=1.0, k=2, outtype="f16"), row("plain", 80.0, t=1.0)]


def test_best_setting_is_the_fastest_greedy_single_slot_drafter_row():
    b = best_setting(_rows())
    assert b["row"] == "drafter k=2 t=0" and b["tokens_per_s"] == 60.0 and b["plain_tokens_per_s"] == 90.0
    assert b["ngram_best"] == "ngram-simple t=0" and not b["beats_plain"] and not b["beats_ngram"]
    t = timings({"rows": _rows(), "best": b})
    # 100 tokens in 100/60 s over 67 decode steps: 24.9 ms per step against 11.1 ms per plain step
    assert t["spec_ms_per_step"] == pytest.approx(1000 * 100 / 60 / 67)
    assert t["break_even_tau"] == pytest.approx(t["spec_ms_per_step"] / (1000 / 90))


def test_loop_comparison_sets_engine_tau_beside_the_loops_ci():
    engine = {"rows": [dict(r, p_min=None) for r in _rows()], "settings": {"draft_outtypes": ["f16"]}}
    loop = {"temperature": 0.0, "rows": [{"method": "drafter", "k": 2, "batch_size": 1, "tau": 1.45,
                                          "tau_ci": [1.4, 1.55]},
                                         {"method": "drafter", "k": 1, "batch_size": 1, "tau": 1.08, "tau_ci": [1.0, 1.15]}]}
    by_k = {c["k"]: c for c in loop_comparison(engine, loop)}
    assert by_k[2]["within_loop_ci"] and by_k[2]["cis_overlap"]
    assert not by_k[1]["within_loop_ci"] and not by_k[1]["cis_overlap"]  # 1.3 [1.2, 1.4] vs [1.0, 1.15]
    assert loop_comparison(engine, {**loop, "temperature": 1.0}) == [] and loop_comparison(engine, None) == []


class _FakeServer:
    """Answers ``complete``: a decode of ``n > 1`` tokens replays ``tokens`` with the prepared ``seq`` top
    log-probabilities; the one-token request after the prefix gets ``batch``."""

    def __init__(self, seq, batch, tokens=(5, 6, 7), chunk=None):
        self.seq, self.batch, self.tokens, self.chunk = seq, batch, list(tokens), chunk
        self.chunks = []

    def last_logprobs(self, prefix, chunk, n_probs):
        self.chunks.append(chunk)
        return self.batch if self.chunk is None else self.chunk

    def complete(self, prompt, n, n_probs=0, **kw):
        if n > 1:
            return Completion(self.tokens[:n], 0.0, 0.0, 0, 0, "limit", self.seq)
        return Completion([0], 0.0, 0.0, 0, 0, "limit", [self.batch])


def test_classify_engine_mismatch_near_tie_and_failure():
    """A gap within twice what the batch-shaped forward moved that pair is a near-tie (a flip in the batched
    forward always is); the same gap unmoved is a failure, as is a token outside the top lists or a replay that
    does not reproduce the plain prefix."""
    plain, spec = [5, 6, 7], [5, 6, 9]
    assert first_diff(plain, spec) == 2 and first_diff([1, 2], [1, 2, 3]) == 2
    seq = [{5: -0.1}, {6: -0.1}, {7: -0.70, 9: -0.72, 3: -3.0}]
    tie = classify_engine_mismatch(_FakeServer(seq, {7: -0.70, 9: -0.73, 3: -2.0}), [1], plain, spec)
    assert tie["position"] == 2 and tie["near_tie"] and tie["drift"] == pytest.approx(0.01)
    # the tail token moved a lot, the pair did not: not a near-tie
    fail = classify_engine_mismatch(_FakeServer(seq, {7: -0.80, 9: -0.82, 3: -1.0}), [1], plain, spec)
    assert not fail["near_tie"] and fail["gap"] == pytest.approx(0.02) and fail["drift"] == pytest.approx(0.0)
    flipped = classify_engine_mismatch(_FakeServer(seq, {7: -0.8, 9: -0.6}), [1], plain, spec)
    assert flipped["near_tie"] and flipped["shape_gaps"]["prefill"] < 0
    # only a verify-shaped forward (a chunk on a cached prefix) moves the pair: still a near-tie, found there
    srv = _FakeServer(seq, {7: -0.70, 9: -0.72, 3: -3.0}, chunk={7: -0.75, 9: -0.70, 3: -3.0})
    verify = classify_engine_mismatch(srv, [1, 2, 3, 4], plain, spec)
    assert verify["near_tie"] and verify["shape_gaps"]["chunk2"] < 0 and srv.chunks == [2, 3, 4, 5]
    absent = classify_engine_mismatch(_FakeServer(seq, {7: -0.1, 3: -3.0}), [1], plain, spec)
    assert not absent["near_tie"]
    replay = classify_engine_mismatch(_FakeServer(seq, {7: -0.8, 9: -0.6}, tokens=(5, 4, 7)), [1], plain, spec)
    assert not replay["near_tie"] and replay["replayed"] is False
    short = classify_engine_mismatch(_FakeServer(seq, {}), [1], plain, plain[:2])
    assert not short["near_tie"] and short["output_token"] is None


def test_greedy_check_covers_every_greedy_pass_and_classifies_through_a_plain_server(monkeypatch):
    """Every temperature-0 pass but the one-slot plain one is compared (drafters, the negative control, plain with
    several slots); sampled passes are not; a mismatch is classified through a plain server."""
    import contextlib

    from speculators.engines import llamacpp_eval

    served = []

    @contextlib.contextmanager
    def fake_server(lc, models, p, st):
        served.append(p.label)
        yield _FakeServer([{5: -0.1}, {6: -0.5, 8: -0.51}], {6: -0.6, 8: -0.4}, tokens=(5, 6))

    monkeypatch.setattr(llamacpp_eval, "_server", fake_server)
    passes = {p.label: p for p in [EnginePass("plain"), EnginePass("drafter", k=2, draft_outtype="f16"),
                                   EnginePass("drafter-shifted-taps", k=2, draft_outtype="f16"),
                                   EnginePass("plain", parallel=2), EnginePass("drafter", k=2, temperature=1.0)]}
    same, other = [_c([5, 6, 7]), _c([1, 2])], [_c([5, 8, 7]), _c([1, 2])]
    outputs = {"plain t=0": same, "drafter k=2 t=0": other, "drafter-shifted-taps k=2 t=0": same,
               "plain t=0 x2": same, "drafter k=2 t=1": [_c([9]), _c([9])]}
    g = llamacpp_eval.greedy_check(None, None, [[1], [2]], EngineSettings(), outputs, passes)
    assert set(g["passes"]) == {"drafter k=2 t=0", "drafter-shifted-taps k=2 t=0", "plain t=0 x2"}
    assert g["passes"]["drafter k=2 t=0"] == {"prompts": 2, "mismatches": 1, "near_tie": 1, "failures": 0}
    assert g["mismatches"][0]["position"] == 1 and g["passed"] and served == ["plain t=0"]


def test_a_drafter_pass_that_drafted_nothing_is_refused_not_reported(monkeypatch):
    """llama-server serves on without speculation when it cannot use the draft GGUF (draft-simple: a vocabulary it
    finds incompatible): such a pass is plain decoding and must not be reported as the drafter's."""
    from speculators.engines import llamacpp_eval
    from speculators.engines.llamacpp_eval import EngineModels

    def fake_pass(lc, models, p, prompts, st):
        outs = [_c([5, 6, 7])]  # the server's counts: nothing drafted
        return engine_row(p, outs, 1.0), outs

    monkeypatch.setattr(llamacpp_eval, "run_pass", fake_pass)
    models = EngineModels(target=Path("t.gguf"), drafts={"f16": Path("d.gguf")}, spec_type="draft-simple")
    with pytest.raises(SpeculatorsError, match=r"drafted no token in pass 'drafter k=1 t=0'.*draft-simple"):
        llamacpp_eval.run_engine_eval(None, models, [[1, 2]], EngineSettings(ks=(1,), draft_outtypes=("f16",), curve_tokens=()))


def test_render_markdown_has_every_row_and_the_verdicts():
    rows = [dict(r, speedup=None, accepted=0, drafted=0) for r in _rows()]
    b = best_setting(rows)
    rep = {"llama_cpp_version": "0.3.36", "num_prompts": 3, "settings": {"max_new_tokens": 16}, "rows": rows,
           "greedy_check": {"mismatches": [], "near_tie": 0, "failures": 0, "passed": True}, "best": b,
           "negative_control": {"tap_shift": 4, "k": 2, "tau": 1.0, "drafter_tau": 1.5, "separated": True},
           "timings": timings({"rows": rows, "best": b})}
    md = render_markdown(rep)
    assert all(f"| {r['label']} |" in md for r in rows)
    assert "PASS" in md and "separated" in md and "break-even needs tau above" in md


def _tiny_checkpoint(tmp_path: Path, algorithm: str, **kw) -> Path:
    from speculators.data.vocab import DraftVocab
    from speculators.drafters import registry
    from speculators.target import build_tiny_target

    target = build_tiny_target(vocab_size=128, hidden_size=64, num_layers=4, seed=1)
    cls = registry.get(algorithm)
    cfg = cls.config_class(algorithm=algorithm, **kw)
    target.aux_layer_ids = cls.serving.default_aux_layer_ids(4, cfg)
    torch.manual_seed(0)
    d = cls.from_target(cfg, target, DraftVocab.from_counts(torch.arange(128, 0, -1), 64 if algorithm in ("eagle3", "medusa") else None))
    return d.save_pretrained(tmp_path / algorithm)


def test_every_family_has_a_llamacpp_spec_type_or_says_why_not(tmp_path):
    from speculators.drafters import registry

    served = {}
    for name in registry.names():
        ckpt = _tiny_checkpoint(tmp_path, name)
        try:
            served[name] = spec_type_of(ckpt)
        except SpeculatorsError as e:
            assert f"no llama.cpp path for {name}, because " in str(e), e
    assert served.get("eagle3") == "draft-eagle3"
    assert served.get("dflash") == "draft-dflash" and served.get("dspark") == "draft-dspark"
    for name, spec in served.items():
        assert spec == registry.get(name).serving.llamacpp_spec_type


def test_export_refuses_what_llamacpp_would_silently_serve_differently(tmp_path):
    from speculators.engines.gguf_export import export_gguf

    ckpt = _tiny_checkpoint(tmp_path, "eagle3", norm_output=True)
    lc = LlamaCpp(Path("/nonexistent/llama-server"), Path("/nonexistent"), "0")
    with pytest.raises(SpeculatorsError, match="norm_output"):
        export_gguf(ckpt, tmp_path / "d.gguf", tmp_path, lc)
    assert not (tmp_path / "d.gguf").exists()


def test_dspark_export_refuses_a_confidence_head_llamacpp_cannot_load(tmp_path):
    from speculators.engines.gguf_export import export_gguf

    ckpt = _tiny_checkpoint(tmp_path, "dspark", enable_confidence_head=True, confidence_head_with_markov=False)
    lc = LlamaCpp(Path("/nonexistent/llama-server"), Path("/nonexistent"), "0")
    with pytest.raises(SpeculatorsError, match="confidence_head_with_markov"):
        export_gguf(ckpt, tmp_path / "d.gguf", tmp_path, lc)
    assert not (tmp_path / "d.gguf").exists()


def test_engine_settings_follow_the_drafters_bounds_in_llamacpp(tmp_path):
    """K defaults to 1..4 plus the drafter's own K, never above what llama.cpp serves it with (it would clamp
    --spec-draft-n-max silently); a given K above is refused; no p_min pass where the format cannot use one."""
    from speculators.drafters import registry

    dflash = registry.get("dflash").serving
    cfg = {"block_size": 8}
    st = EngineSettings().for_drafter(dflash.speculative_tokens(cfg), dflash.llamacpp_max_draft(cfg),
                                      dflash.llamacpp_p_min_note(cfg))
    assert st.ks == (1, 2, 3, 4, 7) and st.p_mins == (0.2, 0.5, 0.8)
    assert EngineSettings().for_drafter(3, 3, None).ks == (1, 2, 3)
    with pytest.raises(SpeculatorsError, match=r"-k \[8\].*at most K=7"):
        EngineSettings(ks=(2, 8)).for_drafter(7, 7, None)
    dspark = registry.get("dspark").serving
    off = {"block_size": 4, "enable_confidence_head": False}
    assert dspark.llamacpp_max_draft(off) == 4 and "confidence head" in dspark.llamacpp_p_min_note(off)
    assert EngineSettings().for_drafter(4, 4, dspark.llamacpp_p_min_note(off)).p_mins == ()
    assert EngineSettings().for_drafter(None, None, None).ks == (1, 2, 3, 4)


def test_server_that_dies_at_start_is_one_clear_error(tmp_path):
    fake = tmp_path / "bin" / "llama-server"
    fake.parent.mkdir()
    fake.write_text("#!/bin/sh\necho '0.00.2 E llama_init_from_model: failed (this warning is normal during memory "
                    "fitting)' >&2\necho 'error: failed to load model' >&2\nexit 3\n")
    fake.chmod(fake.stat().st_mode | stat.S_IEXEC)
    lc = LlamaCpp(fake, tmp_path, "0")
    with pytest.raises(SpeculatorsError, match=r"exited with status 3.*failed to load model") as e:
        with LlamaServer(lc, tmp_path / "m.gguf", startup_timeout=20):
            pass
    assert "warning is normal" not in str(e.value)  # a DFlash draft's benign memory-fitting line is no cause


def test_build_location_and_exit_codes(tmp_path, monkeypatch):
    monkeypatch.setenv(llamacpp_build.ENV_VAR, str(tmp_path / "nowhere"))
    with pytest.raises(LlamaCppUnavailable, match="holds no bin/llama-server"):
        find_llama_cpp()
    monkeypatch.delenv(llamacpp_build.ENV_VAR)
    monkeypatch.setenv("SPECULATORS_CACHE", str(tmp_path / "cache"))
    assert find_llama_cpp() is None
    assert llamacpp_build.build_dir().name == f"build-{llamacpp_build.LLAMA_CPP_PYTHON_VERSION}-{llamacpp_build.cpu_key()}"

    def offline(*a, **k):
        raise LlamaCppUnavailable("no network")

    monkeypatch.setattr(llamacpp_build, "build", offline)
    monkeypatch.setenv("CI", "true")
    assert llamacpp_build.main([]) == 1
    monkeypatch.setenv("CI", "false")
    assert llamacpp_build.main([]) == 0


def _fake_bench(tmp_path, script: str) -> LlamaCpp:
    """A build whose llama-server is a stub and whose llama-bench runs ``script`` (sh)."""
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir(parents=True, exist_ok=True)
    for name, body in (("llama-server", "exit 0\n"), ("llama-bench", script)):
        f = bin_dir / name
        f.write_text("#!/bin/sh\n" + body)
        f.chmod(f.stat().st_mode | stat.S_IEXEC)
    return LlamaCpp(bin_dir / "llama-server", tmp_path, "0")


def test_verify_cost_curve_reads_llama_bench_and_gives_break_even(tmp_path):
    """T(n) from llama-bench's JSON (prompt tests only, n_gen 0), ratios against n = 1, the target-only break-even
    tau T(K+1)/T(1) per K (None where K+1 was not timed), and llama-bench's own failure quoted."""
    rows = [{"n_prompt": n, "n_gen": 0, "avg_ns": ms * 1e6, "stddev_ns": 1e5, "model_type": "llama ?B Q4_0"}
            for n, ms in ((1, 10.0), (2, 11.0), (3, 12.5), (5, 20.0))]
    lc = _fake_bench(tmp_path, f"echo '{json.dumps(rows)}'\n")
    curve = verify_cost_curve(lc, tmp_path / "t.gguf", tokens=(2, 3, 5), depth=64, threads=2, log=lambda m: None)
    assert curve["tokens"] == [1, 2, 3, 5] and curve["ratio"] == pytest.approx([1.0, 1.1, 1.25, 2.0])
    assert "-p 1,2,3,5 -n 0 -d 64" in curve["command"] and curve["model_type"] == "llama ?B Q4_0"
    assert break_even_taus(curve, (1, 2, 3, 4)) == {1: pytest.approx(1.1), 2: pytest.approx(1.25), 3: None,
                                                   4: pytest.approx(2.0)}
    md = "\n".join(curve_lines(curve, (1, 2, 4)))
    assert "| 5 | 20.00" in md and "K=4 2.00" in md and "K=3" not in md
    with pytest.raises(SpeculatorsError, match=r"no result for n = \[8\]"):
        verify_cost_curve(lc, tmp_path / "t.gguf", tokens=(2, 8), log=lambda m: None)
    with pytest.raises(SpeculatorsError, match="must be >= 1"):
        verify_cost_curve(lc, tmp_path / "t.gguf", tokens=(0, 2), log=lambda m: None)
    bad = _fake_bench(tmp_path / "bad", "echo 'error: failed to load model' >&2\nexit 1\n")
    with pytest.raises(SpeculatorsError, match="exit 1.*failed to load model"):
        verify_cost_curve(bad, tmp_path / "t.gguf", log=lambda m: None)
    with pytest.raises(LlamaCppUnavailable, match="no llama-quantize"):
        lc.tool("llama-quantize")


def test_step_costs_split_a_speculative_step_into_the_target_forward_and_the_rest():
    """Per K of the sweep: ms per step from the server's times, the verify forward's share from the curve (plain ms
    x T(K+1)/T(1)), the rest, and the break-even taus; rows with p_min, another draft type or slots are left out."""
    def row(k=None, method="drafter", secs=1.0, steps=100, tau=1.5, **kw):
        return {"method": method, "k": k, "temperature": 0.0, "batch_size": 1, "p_min": None, "draft_threads": None,
                "draft_outtype": "f16", "decode_seconds": secs, "steps": steps, "tau": tau, **kw}

    rows = [row(method="plain", secs=1.0, steps=100, tau=1.0), row(k=1, secs=1.8), row(k=3, secs=3.0),
            row(k=1, secs=1.0, p_min=0.5), row(k=1, secs=1.0, draft_outtype="q8_0"), row(k=2, steps=0)]
    curve = {"tokens": [1, 2, 3, 4], "ratio": [1.0, 1.2, 1.5, 1.9]}
    costs = step_costs(rows, curve, "f16")
    assert [c["k"] for c in costs] == [1, 3]
    c1, c3 = costs
    assert c1["plain_ms"] == pytest.approx(10.0) and c1["step_ms"] == pytest.approx(18.0)
    assert c1["target_ms"] == pytest.approx(12.0) and c1["rest_ms"] == pytest.approx(6.0)
    assert c1["break_even_tau"] == pytest.approx(1.8) and c1["free_draft_tau"] == pytest.approx(1.2)
    assert c3["target_ms"] == pytest.approx(19.0) and c3["rest_ms"] == pytest.approx(11.0)
    no_curve = step_costs(rows, None, "f16")
    assert no_curve[0]["target_ms"] is None and no_curve[0]["rest_ms"] is None
    assert "| 1 | 1.500 | 18.00 | 12.00 | 6.00 | 1.80 | 1.20 |" in "\n".join(step_cost_lines(costs))
    assert step_costs([row(k=1)], curve) == [] and step_cost_lines([]) == []


def test_engine_eval_without_llama_bench_reports_no_curve_and_the_fastest_command(tmp_path, monkeypatch):
    """A build from elsewhere without llama-bench: the eval runs on, says why it has no verify-cost curve, and still
    names the fastest setting with the llama-server command of that pass (here the drafter, the fastest row)."""
    from speculators.engines import llamacpp_eval
    from speculators.engines.llamacpp_eval import EngineModels

    fake = tmp_path / "bin" / "llama-server"
    fake.parent.mkdir()
    fake.write_text("#!/bin/sh\nexit 0\n")
    lc = LlamaCpp(fake, tmp_path, "0")

    def fake_pass(lc, models, p, prompts, st):
        outs = [_c([5, 6, 7, 8], drafted=3 if p.method == "drafter" else 0, accepted=2 if p.method == "drafter" else 0)]
        return engine_row(p, outs, 0.5 if p.method == "drafter" else 1.0), outs

    monkeypatch.setattr(llamacpp_eval, "run_pass", fake_pass)
    models = EngineModels(target=tmp_path / "t.gguf", drafts={"f16": tmp_path / "d.gguf"}, spec_type="draft-eagle3")
    logged = []
    rep = llamacpp_eval.run_engine_eval(lc, models, [[1, 2]], EngineSettings(
        ks=(2,), temperatures=(0.0,), parallel=(1,), p_mins=(), draft_outtypes=("f16",), negative_control=False),
        log=logged.append)
    assert rep["verify_cost"] is None and any("no verify-cost curve" in m and "llama-bench" in m for m in logged)
    assert rep["fastest"]["row"] == "drafter k=2 t=0" and "--spec-draft-n-max 2" in rep["fastest"]["serve"]
    assert "--port 8080" in rep["fastest"]["serve"] and "Verify-cost curve" not in render_markdown(
        dict(rep, target_gguf="t.gguf", draft_spec_type="draft-eagle3", timings=None))
    assert fastest_setting([])["row"] is None


def test_fastest_setting_counts_every_method_and_target_types_are_checked():
    """The fastest setting overall may be plain decoding or a model-free type; a pass that failed the greedy
    check and the negative control are never it. A target type outside llama.cpp's tools is refused by name."""
    def row(label, method, tps, t=0.0, par=1):
        return {"label": label, "method": method, "tokens_per_s": tps, "temperature": t, "batch_size": par,
                "speedup": tps / 50.0}

    rows = [row("plain t=0", "plain", 50.0), row("drafter k=1 t=0", "drafter", 45.0),
            row("ngram-mod t=0", "ngram-mod", 49.0), row("drafter-shifted-taps k=1 t=0", "drafter-shifted-taps", 60.0),
            row("plain t=1", "plain", 70.0, t=1.0), row("plain t=0 x4", "plain", 90.0, par=4)]
    assert fastest_setting(rows)["row"] == "plain t=0"
    rows.append(row("drafter k=2 t=0", "drafter", 55.0))
    assert fastest_setting(rows)["row"] == "drafter k=2 t=0"
    assert fastest_setting(rows, {"drafter k=2 t=0"})["row"] == "plain t=0"
    with pytest.raises(SpeculatorsError, match=r"--target-type\) 'q3_k'.*allowed: f32, f16, bf16, q8_0, q4_0"):
        EngineSettings(target_type="q3_k")
    assert EngineSettings(target_type="Q4_0").target_type == "q4_0"


def test_cli_refuses_an_unknown_engine(tmp_path):
    from typer.testing import CliRunner

    from speculators.cli import app

    r = CliRunner().invoke(app, ["eval", str(tmp_path), "--engine", "tgi"])
    assert r.exit_code == 2 and "allowed: llama.cpp" in r.output
    r = CliRunner().invoke(app, ["eval", str(tmp_path), "--engine", "llama.cpp", "--slots", "1,x"])
    assert r.exit_code == 2 and "--slots 1,x" in r.output
    r = CliRunner().invoke(app, ["eval", str(tmp_path), "--engine", "llama.cpp", "--batch-size", "4", "--tree", "x"])
    assert r.exit_code == 2 and "--batch-size, --tree: not used by --engine" in r.output
    r = CliRunner().invoke(app, ["eval", str(tmp_path), "--p-min", "0.5"])
    assert r.exit_code == 2 and "--p-min: only with --engine llama.cpp" in r.output


# ----------------------------------------------------------------------------- with the real llama-server


@pytest.fixture()
def lc(llama_cpp):
    return llama_cpp


@pytest.mark.slow
def test_tiny_eagle3_trains_converts_and_serves_losslessly_in_llamacpp(lc, tmp_path, tiny_target_dir, isolated_cache,
                                                                      monkeypatch):
    """train -> eval (our loop) -> export gguf -> eval --engine llama.cpp, all through the CLI: llama.cpp's
    converter takes our EAGLE-3 export as written, llama-server serves it with --spec-type draft-eagle3, drafts
    and verifies (its counts), and every greedy output with the drafter equals the engine's plain output."""
    from conftest import cli_train_then_eval
    from typer.testing import CliRunner

    from speculators.cli import app

    monkeypatch.setenv(llamacpp_build.ENV_VAR, str(lc.server.parent.parent))  # the cache is this test's own
    monkeypatch.setenv(llamacpp_build.SOURCE_ENV_VAR, str(lc.source))
    run = tmp_path / "run"
    cli_train_then_eval(TINY, tiny_target_dir, run, "train.steps=4")
    r = CliRunner().invoke(app, ["export", "gguf", str(run), "--outtype", "f32"])
    assert r.exit_code == 0, r.output
    assert (run / "gguf" / "draft-f32.gguf").stat().st_size > 0 and (run / "gguf" / "target-f16.gguf").exists()
    assert "--spec-type draft-eagle3" in r.output
    r = CliRunner().invoke(app, ["eval", str(run), "--engine", "llama.cpp", "-k", "1,3", "--slots", "1,2",
                                 "--p-min", "0.3", "--draft-outtypes", "f32,q8_0", "--temperature", "1.0",
                                 "--draft-threads", "1"])
    assert r.exit_code == 0, f"{r.exception!r}\n{r.output}"
    rep = json.loads((run / "eval-llamacpp" / "report.json").read_text())
    labels = {row["label"] for row in rep["rows"]}
    k = rep["best"]["row"].split()[1]
    for want in ["plain t=0", "drafter k=1 f32 t=0", "drafter k=3 f32 t=0", "ngram-simple t=0", "ngram-mod t=0",
                 f"drafter {k} q8_0 t=0", f"drafter {k} f32 p_min=0.3 t=0", f"drafter {k} f32 draft_threads=1 t=0",
                 f"drafter-shifted-taps {k} f32 t=0", "plain t=1", f"drafter {k} f32 t=1", "plain t=0 x2",
                 f"drafter {k} f32 t=0 x2"]:
        assert want in labels, (want, sorted(labels))
    for row in rep["rows"]:
        if row["method"].startswith("drafter"):
            assert row["drafted"] > 0 and 0 <= row["accepted"] <= row["drafted"]
        if row["method"] == "plain":
            assert row["tau"] == 1.0 and row["drafted"] == 0
        assert row["tokens"] > 0 and row["tokens_per_s"] > 0
    assert rep["greedy_check"]["passes"] and rep["greedy_check"]["passed"], rep["greedy_check"]
    assert rep["loop_comparison"], "the loop's greedy report beside the run was not found"
    md = (run / "eval-llamacpp" / "report.md").read_text()
    assert md.count("| drafter") >= 4
    # without a flag: the target's verify-cost curve (llama-bench), the break-even per K, the fastest setting
    curve = rep["verify_cost"]
    assert curve["tokens"] == [1, 2, 3, 4, 5, 8] and all(m > 0 for m in curve["ms"]) and curve["ratio"][0] == 1.0
    assert curve["openmp"] in ("ON", "OFF")  # read from the build's CMakeCache.txt
    assert [c["k"] for c in rep["step_costs"]] == [1, 3] and all(c["target_ms"] > 0 for c in rep["step_costs"])
    assert set(curve["break_even"]) == {"1", "3"} and curve["break_even"]["1"] == curve["ratio"][1]
    fastest = rep["fastest"]
    assert fastest["row"] in labels and "--port 8080" in fastest["serve"] and "Break-even tau" in md
    assert fastest["tokens_per_s"] == max(r["tokens_per_s"] for r in rep["rows"] if r["temperature"] == 0
                                          and r["batch_size"] == 1 and r["method"] != "drafter-shifted-taps")


@pytest.mark.slow
@pytest.mark.parametrize("algorithm, spec, k", [("dflash", "draft-dflash", 3), ("dspark", "draft-dspark", 4)])
def test_tiny_block_drafter_serves_in_llamacpp_as_our_loop_drafts(lc, tmp_path, tiny_target_dir, isolated_cache,
                                                                  monkeypatch, algorithm, spec, k):
    """DFlash / DSpark: our export through llama.cpp's converter (DFlash read by its speculators-layout class),
    served with --spec-type draft-dflash / draft-dspark at the trained block's K: the engine accepts exactly
    what our loop accepts on the same prompts (f32 draft, the tiny target's f16 GGUF: the same drafts up to
    rounding), and stays lossless."""
    from conftest import cli_train_then_eval
    from typer.testing import CliRunner

    from speculators.cli import app

    monkeypatch.setenv(llamacpp_build.ENV_VAR, str(lc.server.parent.parent))
    monkeypatch.setenv(llamacpp_build.SOURCE_ENV_VAR, str(lc.source))
    run = tmp_path / "run"
    cli_train_then_eval(ROOT / "recipes" / f"tiny-{algorithm}.yaml", tiny_target_dir, run, "train.steps=30",
                        eval_args=("--temperature", "0", "-k", str(k)))
    r = CliRunner().invoke(app, ["eval", str(run), "--engine", "llama.cpp", "-k", str(k), "--slots", "1",
                                 "--temperature", "0", "--draft-outtypes", "f32", "--p-min", "0.5"])
    assert r.exit_code == 0, f"{r.exception!r}\n{r.output}"
    rep = json.loads((run / "eval-llamacpp" / "report.json").read_text())
    assert rep["draft_spec_type"] == spec and f"--spec-type {spec}" in rep["best"]["serve"]
    row = next(x for x in rep["rows"] if x["label"] == f"drafter k={k} f32 t=0")
    assert row["accepted"] > 0, row  # the parity below is not one of two drafters that never hit
    cmp = next(c for c in rep["loop_comparison"] if c["k"] == k)
    assert cmp["engine_tau"] == pytest.approx(cmp["loop_tau"], abs=0.05), cmp
    assert rep["greedy_check"]["passed"], rep["greedy_check"]


@pytest.mark.slow
def test_tiny_draft_model_converts_and_serves_as_draft_simple(lc, tmp_path, tiny_target_dir, isolated_cache,
                                                              monkeypatch):
    """Draft model: our export (a plain transformers Llama + the target's tokenizer) through llama.cpp's own
    converter, served with ``-md draft.gguf --spec-type draft-simple`` beside the target: llama.cpp accepts its
    vocabulary (it would otherwise serve without drafting), drafts and verifies (its counts), accepts what our
    loop accepts on the same prompts, and stays lossless."""
    from conftest import cli_train_then_eval
    from typer.testing import CliRunner

    from speculators.cli import app

    monkeypatch.setenv(llamacpp_build.ENV_VAR, str(lc.server.parent.parent))
    monkeypatch.setenv(llamacpp_build.SOURCE_ENV_VAR, str(lc.source))
    run = tmp_path / "run"
    cli_train_then_eval(ROOT / "recipes" / "tiny-draft_model.yaml", tiny_target_dir, run, "train.steps=30",
                        eval_args=("--temperature", "0", "-k", "3"))
    r = CliRunner().invoke(app, ["eval", str(run), "--engine", "llama.cpp", "-k", "3", "--slots", "1",
                                 "--temperature", "0", "--draft-outtypes", "f32"])
    assert r.exit_code == 0, f"{r.exception!r}\n{r.output}"
    rep = json.loads((run / "eval-llamacpp" / "report.json").read_text())
    assert rep["draft_spec_type"] == "draft-simple" and "--spec-type draft-simple" in rep["best"]["serve"]
    row = next(x for x in rep["rows"] if x["label"] == "drafter k=3 f32 t=0")
    assert row["drafted"] > 0 and row["accepted"] > 0, row
    cmp = next(c for c in rep["loop_comparison"] if c["k"] == 3)
    assert cmp["engine_tau"] == pytest.approx(cmp["loop_tau"], abs=0.05), cmp
    assert rep["greedy_check"]["passed"], rep["greedy_check"]


@pytest.mark.slow
def test_target_quantized_by_llama_quantize_is_served_and_timed(lc, tiny_target_dir, isolated_cache):
    """A target type the converter cannot write (Q4_0) is made by llama-quantize from the converted f16, cached
    (a second call reuses the file), served by llama-server, and timed by llama-bench as that type."""
    from speculators.engines.llamacpp_targets import engine_gguf
    from speculators.target import Target

    target = Target.load(str(tiny_target_dir), dtype="float32", log=lambda m: None)
    q = engine_gguf(target, lc, "q4_0", log=lambda m: None)
    assert q.name == "target-q4_0.gguf" and (q.parent / "target-f16.gguf").exists()
    assert q.stat().st_size < (q.parent / "target-f16.gguf").stat().st_size
    mtime = q.stat().st_mtime_ns
    assert engine_gguf(target, lc, "q4_0", log=lambda m: None) == q and q.stat().st_mtime_ns == mtime
    curve = verify_cost_curve(lc, q, tokens=(2, 3), depth=16, repetitions=2, log=lambda m: None)
    assert "Q4_0" in curve["model_type"] and len(curve["ms"]) == 3
    ids = target.tokenizer("Hello there")["input_ids"]
    with LlamaServer(lc, q) as srv:
        assert len(srv.complete(list(ids), 4).tokens) == 4
