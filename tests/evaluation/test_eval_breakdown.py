"""The eval's breakdowns: drafting vs verifying time per decoding step (``speculative_generate`` ->
``BatchResult`` / ``GenerationResult`` -> report rows ``draft_ms_per_step`` / ``verify_ms_per_step``), and
tau per prompt source (``report["by_source"]``: ``speculators eval --prompts A --prompts B``, or the
held-out split of several recipe sources).

No speed is asserted: the time fields are checked for consistency (``draft + verify <= total``, drafting 0
for plain decoding) and for containing a known ``time.sleep`` inside the phase they measure (a lower
bound that holds on any machine)."""

from __future__ import annotations

import json
import time
from types import SimpleNamespace

import pytest
import torch
import yaml

from speculators.evaluation.settings import EvalSettings
from speculators.decode.proposal import Proposal
from speculators.evaluation.report import METHOD_LABELS, render_markdown as report_markdown
from speculators.evaluation.runner import run_eval
from speculators.evaluation.settings import DEFAULT_METHODS as METHODS  # the default set
from speculators.decode.loop import speculative_generate
from speculators.target import build_tiny_target

V = 64
NAP = 0.002  # seconds slept inside a measured phase


class RepeatDrafter:
    """Deterministic batched proposer: drafts ``k`` times the token after the request's last token id
    (a guess, mostly rejected), or, for a prompt of
    ``known`` (``{tuple(prompt ids): its plain greedy continuation}``), the continuation itself (all
    accepted). Depends only on the request's tokens, so a prompt decodes the same in any batch or prompt
    list. ``nap`` = ``{"propose" | "advance": seconds}``: those calls sleep that long (counted in
    ``calls``)."""

    def __init__(self, known: dict | None = None, nap: dict | None = None):
        self.known, self.nap, self.calls = known or {}, nap or {}, {"propose": 0, "advance": 0}

    def start(self, input_ids, features):
        ids = input_ids.reshape(-1).tolist()
        return {"tokens": ids, "cont": self.known.get(tuple(ids[:-1])), "n0": len(ids) - 1}

    def _sleep(self, what):
        self.calls[what] += 1
        if self.nap.get(what):
            time.sleep(self.nap[what])

    def propose(self, states, ks, sampling=None, generators=None):
        self._sleep("propose")
        out = []
        for s, k in zip(states, ks):
            if s["cont"] is None:
                ids = [(s["tokens"][-1] + 1) % V] * k
            else:
                done = len(s["tokens"]) - s["n0"]
                ids = (s["cont"][done:done + k] + [0] * k)[:k]
            out.append(Proposal(torch.tensor(ids, dtype=torch.int64)))
        return out

    def advance(self, states, new_ids, features):
        self._sleep("advance")
        for s, ids in zip(states, new_ids):
            s["tokens"].extend(ids.tolist())


@pytest.fixture(scope="module")
def target():
    return build_tiny_target(vocab_size=V, hidden_size=32, num_layers=2, seed=2)


def make_prompts(n: int, seed: int, source: str | None = None) -> list[dict]:
    g = torch.Generator().manual_seed(seed)
    out = []
    for i in range(n):
        p = {"id": f"{source}/{i}", "input_ids": torch.randint(0, V, (4 + 3 * i,), generator=g).tolist()}
        if source is not None:
            p["source"] = source
        out.append(p)
    return out


def slow_forwards(target, monkeypatch, nap: float) -> list[int]:
    """Make every decode-step target forward sleep ``nap`` s; returns the list counting them."""
    real, count = target.batch_session, []

    def session(n):
        s = real(n)
        fwd = s.forward

        def forward(*a, **kw):
            count.append(1)
            time.sleep(nap)
            return fwd(*a, **kw)

        s.forward = forward
        return s

    monkeypatch.setattr(target, "batch_session", session)
    return count


# ----------------------------------------------------------------------------- drafting time per step


@pytest.mark.parametrize("batch_size", [1, 3])
@pytest.mark.parametrize("phase", ["propose", "advance"])
def test_generation_splits_drafting_from_verifying_time(target, monkeypatch, batch_size, phase):
    ps = [p["input_ids"] for p in make_prompts(4, 0)]
    forwards = slow_forwards(target, monkeypatch, NAP)
    drafter = RepeatDrafter(nap={phase: 5 * NAP})  # only this phase sleeps: drafting time must contain it
    out = speculative_generate(target, drafter, ps, 3, 10, batch_size=batch_size, eos_ids=set())
    assert drafter.calls[phase] > 0 and len(forwards) == out.target_forwards > 0
    # each phase contains the sleeps made inside it
    assert out.draft_seconds >= 5 * NAP * drafter.calls[phase]
    assert out.verify_seconds >= NAP * out.target_forwards
    assert out.draft_seconds + out.verify_seconds <= out.seconds
    for r in out.results:
        assert r.target_forwards > 0 and r.draft_seconds > 0 and r.verify_seconds >= NAP * r.target_forwards
        assert r.draft_seconds + r.verify_seconds <= r.seconds
        # a request waits for every batched call of the steps it is live in, never more than the run's total
        assert r.draft_seconds <= out.draft_seconds and r.verify_seconds <= out.verify_seconds

    forwards.clear()
    plain = speculative_generate(target, None, ps, 3, 10, batch_size=batch_size, eos_ids=set())
    assert plain.draft_seconds == 0.0 and all(r.draft_seconds == 0.0 for r in plain.results)
    assert plain.verify_seconds >= NAP * plain.target_forwards and len(forwards) == plain.target_forwards
    assert plain.verify_seconds <= plain.seconds


def test_report_rows_carry_drafting_and_verifying_ms_per_step(target):
    prompts = make_prompts(3, 1)
    drafter = RepeatDrafter(nap={"propose": NAP})
    rep = run_eval(target, drafter, prompts, EvalSettings([1, 2], 8, eos_ids=set(), batch_size=2, bootstrap_resamples=50))
    for p in rep["plain_rows"]:
        assert p["draft_seconds"] == 0.0 and p["draft_ms_per_step"] == 0.0 and p["verify_ms_per_step"] > 0
        assert p["batched_steps"] > 0 and p["verify_seconds"] <= p["seconds"]
    for r in rep["rows"]:
        assert r["batched_steps"] > 0
        assert r["draft_ms_per_step"] == pytest.approx(1000 * r["draft_seconds"] / r["batched_steps"])
        assert r["verify_ms_per_step"] == pytest.approx(1000 * r["verify_seconds"] / r["batched_steps"])
        assert r["draft_seconds"] + r["verify_seconds"] <= r["seconds"]
        assert r["verify_ms_per_step"] > 0
        if r["method"] == "drafter" and r["batch_size"] == 1:
            # batch 1: the drafter proposes (and sleeps NAP) at nearly every step; a request's last step
            # may skip it (no budget left for a draft), so not EVERY step: half the nap per step is a
            # bound that a run which leaves drafting time out (~0 ms) still fails
            assert r["draft_ms_per_step"] >= 0.5 * 1000 * NAP
    md = report_markdown(rep)
    assert "| draft ms/step | verify ms/step |" in md
    head = rep["drafter"]
    assert f"{head['draft_ms_per_step']:.2f} | {head['verify_ms_per_step']:.2f} |" in md


# ----------------------------------------------------------------------------- tau per prompt source


SUM_KEYS = ("steps", "emitted", "drafted", "accepted", "accepted_emitted", "tokens")


def test_by_source_splits_every_method_and_adds_up(target):
    a, b = make_prompts(3, 10, "alpha"), make_prompts(2, 11, "beta")
    prompts = [a[0], b[0], a[1], a[2], b[1]]  # interleaved: grouping is by name, not by position
    # the drafter knows alpha's answers (every draft accepted) and guesses on beta's: the taus differ
    plain = speculative_generate(target, None, [p["input_ids"] for p in a], 0, 10, eos_ids=set())
    known = {tuple(p["input_ids"]): r.tokens for p, r in zip(a, plain.results)}
    rep = run_eval(target, RepeatDrafter(known), prompts, EvalSettings(3, 10, eos_ids=set(), batch_size=2, bootstrap_resamples=50))
    by = rep["by_source"]
    assert by["alpha"]["drafter"]["acceptance_rate"] == 1.0 > by["beta"]["drafter"]["acceptance_rate"]
    assert list(by) == ["alpha", "beta"]
    for m in METHODS:
        whole = rep[m]
        for key in SUM_KEYS:
            assert by["alpha"][m][key] + by["beta"][m][key] == whole[key], (m, key)
        for name, n in (("alpha", 3), ("beta", 2)):
            s = by[name][m]
            assert s["num_prompts"] == n and s["k"] == rep["headline"]["k"]
            assert s["batch_size"] == rep["headline"]["batch_size"]
            assert s["tau"] == pytest.approx(s["emitted"] / s["steps"])
            assert s["tau_ci"][0] <= s["tau"] <= s["tau_ci"][1] and len(s["per_position"]) == s["k"]
    # each source's numbers are exactly what an eval of that source alone gives (greedy, deterministic drafts;
    # at batch 1: a greedy request decodes the same at any batch size)
    for name, sub in (("alpha", a), ("beta", b)):
        alone = run_eval(target, RepeatDrafter(known), sub, EvalSettings(3, 10, eos_ids=set(), batch_size=1, bootstrap_resamples=50))
        for m in METHODS:
            for key in (*SUM_KEYS, "tau", "acceptance_rate", "per_position"):
                assert by[name][m][key] == alone[m][key], (name, m, key)
    md = report_markdown(rep)
    assert "## By prompt source (batch size 2, K=3)" in md
    section = md.split("## By prompt source")[1].split("\n## ")[0]
    for name in ("alpha", "beta"):
        for m in METHODS:
            r = by[name][m]
            assert f"| {name} | {r['num_prompts']} | {METHOD_LABELS[m]} | {r['tau']:.3f} [" in section
    json.dumps(rep)


def test_unlabelled_prompts_are_one_source_without_a_table(target):
    rep = run_eval(target, RepeatDrafter(), make_prompts(2, 3), EvalSettings(2, 6, eos_ids=set(), methods=("drafter", "ngram"), bootstrap_resamples=20))
    assert list(rep["by_source"]) == ["prompts"]
    assert rep["by_source"]["prompts"]["drafter"]["steps"] == rep["drafter"]["steps"]
    assert "By prompt source" not in report_markdown(rep)


# ----------------------------------------------------------------------------- where the source names come from


def chat_file(path, questions):
    path.write_text("".join(json.dumps({"messages": [{"role": "user", "content": q},
                                                     {"role": "assistant", "content": "Fine."}]}) + "\n"
                            for q in questions))
    return path


def test_held_out_prompts_of_several_recipe_sources_keep_their_source(tmp_path, smol_tokenizer):
    from pathlib import Path

    from speculators.recipe import recipe_from_dict
    from speculators.evaluation.loading import eval_prompts

    raw = yaml.safe_load((Path(__file__).resolve().parents[2] / "recipes" / "tiny-eagle3.yaml").read_text())
    raw["target"]["model"] = "unused"
    raw["data"]["sources"] = [
        {"source": str(chat_file(tmp_path / "maths.jsonl", [f"What is {i} + {i}?" for i in range(10)])),
         "regenerate": False},
        {"source": str(chat_file(tmp_path / "poems.jsonl", [f"Write a poem about {w}." for w in "abcdefghij"])),
         "regenerate": False}]
    raw["data"]["held_out"] = {"fraction": 0.5, "seed": 0}
    rec = recipe_from_dict(raw, "test")
    plist, label = eval_prompts(None, rec, SimpleNamespace(tokenizer=smol_tokenizer), 100)
    assert "held-out" in label and {p["source"] for p in plist} == {"maths", "poems"}
    for p in plist:  # the source is the conversation's own, not a guess
        assert p["messages"][0]["content"].startswith("What is" if p["source"] == "maths" else "Write a poem")


def test_eval_prompt_sources_log_the_rows_their_loader_dropped(tmp_path, smol_tokenizer):
    """``--prompts FILE``: a row the loader skips (no non-system message) is counted in the log, per
    source and reason, and the other rows are still the eval's prompts."""
    from speculators.data.sources import DROP_EMPTY_CONVERSATION
    from speculators.evaluation.loading import eval_prompts

    path = chat_file(tmp_path / "qa.jsonl", ["What is two plus two?", "Name a color."])
    with open(path, "a") as f:
        f.write(json.dumps({"messages": [{"role": "system", "content": "Be brief."}]}) + "\n")
        f.write(json.dumps({"messages": []}) + "\n")
    lines: list[str] = []
    plist, _ = eval_prompts([str(path)], None, SimpleNamespace(tokenizer=smol_tokenizer), 10, lines.append)
    assert [p["messages"][0]["content"] for p in plist] == ["What is two plus two?", "Name a color."]
    assert lines == [f"eval prompts: dropped 2 of {path} (the whole source, before --num-prompts): "
                     f"{DROP_EMPTY_CONVERSATION}"]
    clean = chat_file(tmp_path / "clean.jsonl", ["Is water wet?"])
    lines.clear()
    eval_prompts([str(clean)], None, SimpleNamespace(tokenizer=smol_tokenizer), 10, lines.append)
    assert lines == []  # nothing dropped, nothing logged


def test_eval_with_two_prompt_files_reports_tau_per_file(tiny_target_dir, tmp_path):
    """``speculators eval --prompts A --prompts B`` end to end on a tiny target: one run, every method
    broken down by file (named as given), at most ``num_prompts`` from EACH file, no prompt twice."""
    from typer.testing import CliRunner

    from speculators.cli import app
    from speculators.data.vocab import DraftVocab
    from speculators.drafters import registry
    from speculators.target import Target

    target = Target.load(str(tiny_target_dir), "float32")
    fam = registry.get("eagle3")
    torch.manual_seed(0)
    d = fam.from_target(fam.config_class(algorithm="eagle3", draft_vocab_size=256), target,
                        DraftVocab.from_counts(torch.arange(target.vocab_size, 0, -1), 256))
    ckpt = d.save_pretrained(tmp_path / "ckpt")
    qa = chat_file(tmp_path / "qa.jsonl", ["What is two plus two?", "Name a color.", "Who wrote Hamlet?",
                                           "Is water wet?"])
    code = chat_file(tmp_path / "code.jsonl", ["Name a color.", "Write a Python loop.", "Sort a list in C."])
    r = CliRunner().invoke(app, ["eval", str(ckpt), "--target", str(tiny_target_dir), "--prompts", str(qa),
                                 "--prompts", str(code), "--num-prompts", "3", "-k", "2", "--max-new-tokens", "4",
                                 "--batch-size", "2", "--temperature", "0", "--output", str(tmp_path / "rep")])
    assert r.exit_code == 0, f"{r.exception!r}\n{r.output}"
    rep = json.loads((tmp_path / "rep" / "report.json").read_text())
    assert rep["num_prompts"] == 5  # 3 of qa (the limit), 2 of code ("Name a color." only once, under qa)
    assert list(rep["by_source"]) == [str(qa), str(code)]
    assert [rep["by_source"][s]["drafter"]["num_prompts"] for s in rep["by_source"]] == [3, 2]
    assert set(rep["by_source"][str(code)]) == set(rep["methods"]) == set(METHODS)
    for m in METHODS:
        assert sum(rep["by_source"][s][m]["steps"] for s in rep["by_source"]) == rep[m]["steps"]
    md = (tmp_path / "rep" / "report.md").read_text()
    assert "## By prompt source" in md and f"| {code} | 2 | {METHOD_LABELS['hybrid']} |" in md
    assert rep["greedy_mismatches"] == []
