"""``source: self`` (Magpie-style self-synthesis, speculators.data.selfsynth), per-source mixing weights and
the per-source data report.

The synthesis tests use a MARKOV target: a tiny random Llama whose attention and MLP outputs are zeroed,
so the final hidden state depends only on the current token, and whose (untied) ``lm_head`` is solved so
that the next-token distribution after token ``a`` is a chosen distribution over a few tokens (every
other token is ~e^-25 less likely). Sampling it at temperature 1 writes short random questions, so the
tests know which kinds of messages (cut off, with template markers, duplicates, ...) it produces.
"""

from __future__ import annotations

import json
import math
from collections import Counter
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch
import yaml

from speculators.data import selfsynth
from speculators.data.chat import render_prompt
from speculators.data.pipeline import (apply_weights, load_data, prepare_data, report_markdown,
                                       source_labels)
from speculators.data.selfsynth import (DROP_REASONS, PromptFilter, SynthSettings, normalize_prompt,
                                        synthesize_prompts, user_turn_template)
from speculators.data.sources import Conversation, SourceError, load_source
from speculators.errors import SpeculatorsError
from speculators.target import Target, build_tiny_target
from test_data_faults import recipe  # the tiny recipe with the given data sources

TINY = Path(__file__).resolve().parents[2] / "recipes" / "tiny-eagle3.yaml"
IM_START, IM_END, NL = 1, 2, 198  # SmolLM2 ChatML ids ("\n" ends the user header and the generation prompt)
CUT, MARKERS, SHORT, LONG, UNPRINTABLE, LETTERS, ASCII, COPY, DUPLICATE = DROP_REASONS


def ids(tok, text: str) -> list[int]:
    return tok(text, add_special_tokens=False)["input_ids"]


def markov_target(tok, chain: dict[int, dict[int, float]], seed: int = 0) -> Target:
    """A target whose next-token distribution after token ``a`` is ``chain[a]`` (whatever the context)."""
    t = build_tiny_target(vocab_size=len(tok), hidden_size=64, num_layers=2, seed=seed)
    m = t.model
    states = sorted(set(chain) | {b for d in chain.values() for b in d})
    assert len(states) <= 64
    with torch.no_grad():
        for layer in m.model.layers:
            layer.self_attn.o_proj.weight.zero_()
            layer.mlp.down_proj.weight.zero_()
        emb = m.get_input_embeddings().weight
        U = m.model.norm(emb[states]).double()  # [S, H]: the final hidden state after each state token
        L = torch.zeros(len(states), len(states), dtype=torch.float64)  # L[a, b]: logit of b after a
        for i, a in enumerate(states):
            for j, b in enumerate(states):
                p = chain.get(a, {}).get(b, 0.0)
                L[i, j] = 25.0 + math.log(p) if p > 0 else -25.0
        Wb = torch.linalg.lstsq(U, L).solution.T  # [S, H]: U @ Wb.T == L
        W = torch.zeros_like(emb)
        W[states] = Wb.to(W.dtype)
        m.lm_head.weight = torch.nn.Parameter(W, requires_grad=False)  # untied
    return Target(m, tok, name_or_path=f"markov-{seed}-{sorted((a, sorted(d.items())) for a, d in chain.items())}")


@pytest.fixture(scope="module")
def tok(smol_tokenizer):
    return smol_tokenizer


@pytest.fixture(scope="module")
def chain(tok):
    """Short questions ("What is the sun?", "How do I cook and swim?", ...), a path through the chat
    template's own markers (``<|im_start|>user``), runs of "!!!" and " and" loops that get cut off."""
    w = {x: ids(tok, x)[0] for x in ("What", " is", " the", " a", " sun", " moon", " cat", " dog", "?", " and",
                                     "How", " do", " I", " cook", " swim", "user", "!!!")}
    nouns = {w[" sun"]: 0.25, w[" moon"]: 0.25, w[" cat"]: 0.25, w[" dog"]: 0.25}
    end = {w["?"]: 0.6, w[" and"]: 0.4}
    return {
        NL: {w["What"]: 0.45, w["How"]: 0.35, IM_START: 0.1, w["!!!"]: 0.1},
        w["What"]: {w[" is"]: 1.0}, w[" is"]: {w[" the"]: 0.5, w[" a"]: 0.5},
        w[" the"]: nouns, w[" a"]: nouns, **{n: end for n in nouns},
        w[" and"]: {w[" the"]: 0.5, w[" a"]: 0.5}, w["?"]: {IM_END: 1.0},
        w["How"]: {w[" do"]: 1.0}, w[" do"]: {w[" I"]: 1.0}, w[" I"]: {w[" cook"]: 0.5, w[" swim"]: 0.5},
        w[" cook"]: end, w[" swim"]: end,
        IM_START: {w["user"]: 1.0}, w["user"]: {IM_END: 1.0},
        w["!!!"]: {w["!!!"]: 0.5, IM_END: 0.5},
    }


@pytest.fixture(scope="module")
def target(tok, chain):
    return markov_target(tok, chain)


def count_calls(target, monkeypatch) -> list[int]:
    """Record the batch size of every ``target.generate_batch`` call."""
    calls: list[int] = []
    real = target.generate_batch
    monkeypatch.setattr(target, "generate_batch", lambda prompts, *a, **k: calls.append(len(prompts)) or
                        real(prompts, *a, **k))
    return calls


def user_texts(res) -> list[str]:
    return [c.messages[-1]["content"] for c in res.conversations]


SETTINGS = dict(num_prompts=12, seed=0, max_prompt_tokens=10, batch_size=8, max_samples=64)


# ----------------------------------------------------------------------------- the template up to a user turn


def test_user_turn_template_renders_up_to_the_user_content(target, tok):
    u = user_turn_template(target, None)
    assert u.prefix.endswith("<|im_start|>user\n")
    assert u.prefix.startswith("<|im_start|>system\n")  # SmolLM2's template writes its default system prompt
    assert u.prefix_ids == ids(tok, u.prefix) and u.prefix_ids[-1] == NL
    assert IM_END in u.stop_ids
    assert {"<|im_start|>", "<|im_end|>", "<|im_start|>user", "<|im_start|>assistant"} <= set(u.markers)
    s = user_turn_template(target, "Answer in French.")
    assert s.prefix == "<|im_start|>system\nAnswer in French.<|im_end|>\n<|im_start|>user\n"


# ----------------------------------------------------------------------------- filters


def test_each_filter_drops_its_case_and_keeps_a_near_miss():
    s = SynthSettings(min_chars=8, max_chars=60, min_printable_ratio=0.98, min_letter_ratio=0.5,
                      min_ascii_ratio=0.9, max_copy_overlap=0.8)
    marks = ["<|im_start|>", "<|im_end|>", "<|im_start|>user"]
    system = "You are a pirate who answers every question about ships."
    cases = [  # (reason, dropped (text, ids, stop), kept near miss)
        (CUT, ("What is the sun", [5], None), ("What is the sun", [5], IM_END)),
        (MARKERS, ("Hi<|im_start|>user there", [5], IM_END), ("Hi user there, how are you", [5], IM_END)),
        (MARKERS, ("Hello friend, how are you", [5, IM_START], IM_END), ("Hello friend, how are you", [5], IM_END)),
        (SHORT, ("Why not", [5], IM_END), ("Why not me", [5], IM_END)),
        (LONG, ("word " * 13, [5], IM_END), ("word " * 11, [5], IM_END)),
        (UNPRINTABLE, ("What is\x00\x01 the sun?" * 2, [5], IM_END), ("What is the sun?\tAnd the moon?", [5], IM_END)),
        (LETTERS, ("12 + 34 = ? ### !!!", [5], IM_END), ("Is 12 + 34 equal to 46?", [5], IM_END)),
        (ASCII, ("Что такое солнце?", [5], IM_END), ("What is a café?", [5], IM_END)),
        (COPY, ("You are a pirate who answers every question", [5], IM_END),
         ("Which pirate ships had the most guns?", [5], IM_END)),
        (COPY, ("every question about ships you are a pirate who answers", [5], IM_END),
         ("Tell me a question about pirate ships", [5], IM_END)),
    ]
    for reason, (text, tids, stop), (ok_text, ok_ids, ok_stop) in cases:
        f = PromptFilter(s, special_ids={IM_START, IM_END})
        assert f.reason(text, tids, stop, marks, system) == reason, (reason, text)
        assert f.reason(ok_text, ok_ids, ok_stop, marks, system) is None, (reason, ok_text)
    f = PromptFilter(s, special_ids={IM_START})
    assert f.reason("What is the sun?", [5], IM_END, marks, system) is None
    assert f.reason("  what IS the sun ?! ", [5], IM_END, marks, system) == DUPLICATE  # normalised content
    assert f.reason("What is the moon?", [5], IM_END, marks, system) is None
    assert normalize_prompt("  What  is\nthe SUN?? ") == "what is the sun"
    # the ASCII check is off by default (any script)
    assert PromptFilter(SynthSettings()).reason("Что такое солнце?", [5], IM_END, marks) is None


# ----------------------------------------------------------------------------- synthesis


def test_synthesis_is_deterministic_under_the_seed(target, isolated_cache, monkeypatch):
    calls = count_calls(target, monkeypatch)
    a = synthesize_prompts(target, SynthSettings(**SETTINGS), log=lambda m: None)
    assert calls and len(a.conversations) == 12 and a.generated == a.samples
    for f in (isolated_cache / "selfsynth").glob("*.jsonl"):
        f.unlink()  # sample again, not from the cache
    b = synthesize_prompts(target, SynthSettings(**SETTINGS), log=lambda m: None)
    assert b.generated > 0
    assert [(c.id, c.messages) for c in a.conversations] == [(c.id, c.messages) for c in b.conversations]
    assert b.drops == a.drops
    other = synthesize_prompts(target, SynthSettings(**{**SETTINGS, "seed": 1}), log=lambda m: None)
    assert user_texts(other) != user_texts(a)
    assert other.cache_file != a.cache_file
    # the prompts are the target's: questions of its chain, prompt-only conversations of source "self"
    for c in a.conversations:
        assert c.source == "self" and c.id.startswith("self:") and [m["role"] for m in c.messages] == ["user"]
        assert c.messages[0]["content"].startswith(("What is", "How do I"))
    assert len({normalize_prompt(t) for t in user_texts(a)}) == 12  # deduplicated


def test_synthesis_drops_what_the_filters_catch(target, isolated_cache):
    res = synthesize_prompts(target, SynthSettings(**{**SETTINGS, "num_prompts": 40, "max_samples": 160}),
                             log=lambda m: None)
    # the chain writes cut-off " and" loops, "<|im_start|>user" turns, "!!!" runs and repeated questions
    for reason in (CUT, MARKERS, DUPLICATE):
        assert res.drops[reason] > 0, res.drops
    assert res.drops[SHORT] + res.drops[LETTERS] > 0  # "!!!" / "!!!!!!" runs
    assert sum(res.drops.values()) + len(res.conversations) == res.samples


def test_synthesized_prompts_never_include_template_markers(target, tok, isolated_cache):
    res = synthesize_prompts(target, SynthSettings(**{**SETTINGS, "num_prompts": 40, "max_samples": 160}),
                             log=lambda m: None)
    assert res.drops[MARKERS] > 0  # the target did write template markers: they were dropped
    specials = set(tok.all_special_tokens) | {"<|im_start|>", "<|im_end|>", "<|endoftext|>"}
    for c in res.conversations:
        text = c.messages[-1]["content"]
        assert not any(s in text for s in specials), text
        assert not any(t in tok.all_special_ids for t in ids(tok, text)), text
        rendered = tok.decode(render_prompt(tok, c.messages))
        assert rendered.count("<|im_start|>") == 3  # system, user, assistant header: nothing injected


def test_system_prompts_are_kept_and_copies_of_them_dropped(target, isolated_cache):
    sp = "What is the sun?"  # the chain writes this question often: as a user message it copies the system prompt
    res = synthesize_prompts(target, SynthSettings(**{**SETTINGS, "num_prompts": 20, "max_samples": 120,
                                                      "system_prompts": [sp]}), log=lambda m: None)
    assert res.drops[COPY] > 0
    for c in res.conversations:
        assert c.messages[0] == {"role": "system", "content": sp}
        assert normalize_prompt(c.messages[1]["content"]) != normalize_prompt(sp)
    # topics steer the sampling only: the steering line is not in the conversation
    res = synthesize_prompts(target, SynthSettings(**{**SETTINGS, "topics": ["astronomy", "pets"]}),
                             log=lambda m: None)
    assert all([m["role"] for m in c.messages] == ["user"] for c in res.conversations)


def test_synthesis_cache_is_reused_and_resumed(target, isolated_cache, monkeypatch):
    calls = count_calls(target, monkeypatch)
    first = synthesize_prompts(target, SynthSettings(**SETTINGS), log=lambda m: None)
    n_batches = len(calls)
    assert n_batches >= 2 and first.cache_file.is_file()
    logs = []
    again = synthesize_prompts(target, SynthSettings(**SETTINGS), log=logs.append)
    assert len(calls) == n_batches and again.generated == 0  # no target call at all
    assert "all from the cache" in logs[0]
    assert [c.messages for c in again.conversations] == [c.messages for c in first.conversations]
    # an interrupted run: only the first batch and a torn line were written -> the rest is sampled again
    lines = first.cache_file.read_text().splitlines()
    first.cache_file.write_text(lines[0] + "\n" + lines[1][: len(lines[1]) // 2])
    resumed = synthesize_prompts(target, SynthSettings(**SETTINGS), log=lambda m: None)
    assert len(calls) == 2 * n_batches - 1
    assert [c.messages for c in resumed.conversations] == [c.messages for c in first.conversations]
    # the filters and num_prompts are applied to cached samples: changing them samples nothing new
    fewer = synthesize_prompts(target, SynthSettings(**{**SETTINGS, "num_prompts": 5, "min_chars": 15}),
                               log=lambda m: None)
    assert len(calls) == 2 * n_batches - 1 and len(fewer.conversations) == 5
    assert all(len(t) >= 15 for t in user_texts(fewer))
    # another target never reads this cache
    other = markov_target(target.tokenizer, {NL: {IM_END: 1.0}}, seed=1)
    assert selfsynth.synthesis_cache_file(other, SynthSettings(**SETTINGS), None, [IM_END]) != first.cache_file


def test_all_dropped_is_a_clear_error(tok, isolated_cache):
    loop = markov_target(tok, {NL: {NL: 1.0}})  # never ends its turn
    with pytest.raises(SourceError, match=r"source self: all 16 .*cut off"):
        synthesize_prompts(loop, SynthSettings(num_prompts=4, max_prompt_tokens=4, batch_size=8, max_samples=16),
                           log=lambda m: None)
    with pytest.raises(SourceError, match="temperature must be > 0"):
        synthesize_prompts(loop, SynthSettings(temperature=0.0), log=lambda m: None)


# ----------------------------------------------------------------------------- recipe


def test_recipe_self_source_validation():
    r = recipe([{"source": "self", "synth": {"num_prompts": 7, "topics": ["cooking"]}}])
    assert r.data.sources[0].synth.num_prompts == 7 and r.data.sources[0].synth.temperature == 1.0
    assert recipe(["self"]).data.sources[0].synth.num_prompts == 256  # defaults filled in
    with pytest.raises(SpeculatorsError, match=r"data\.sources\.0.*always regenerated.*remove regenerate: false"):
        recipe([{"source": "self", "regenerate": False}])
    with pytest.raises(SpeculatorsError, match=r"source: self needs its answers regenerated.*data\.regenerate"):
        recipe(["self"], regenerate=False)
    with pytest.raises(SpeculatorsError, match=r"synth: is only for source: self"):
        recipe([{"source": "humaneval", "synth": {"num_prompts": 3}}])
    with pytest.raises(SpeculatorsError, match=r"synth\.temperature"):
        recipe([{"source": "self", "synth": {"temperature": 0}}])
    with pytest.raises(SpeculatorsError, match=r"weight"):
        recipe([{"source": "humaneval", "weight": -1}])
    with pytest.raises(SourceError, match="synthesized by the target"):
        load_source("self")


# ----------------------------------------------------------------------------- mixing weights


def _pairs(label: str, n: int) -> list[tuple[Conversation, bool]]:
    return [(Conversation(f"{label}/{i}", label, [{"role": "user", "content": f"{label} {i}"}], label=label), True)
            for i in range(n)]


def test_weights_mix_rows_deterministically():
    rec = recipe([{"source": "a.jsonl", "weight": 0.5}, {"source": "b.jsonl", "weight": 2.5},
                  {"source": "c.jsonl", "weight": 0}, {"source": "d.jsonl"}])
    labels = source_labels(rec.data)
    pairs = [p for lab, n in zip(labels, (10, 10, 4, 3)) for p in _pairs(lab, n)]
    out = apply_weights(pairs, rec.data)
    by = Counter(c.label for c, _ in out)
    assert by == {"a.jsonl": 5, "b.jsonl": 25, "d.jsonl": 3}  # round(w * n); weight 0 leaves c out
    assert len({c.id for c, _ in out}) == len(out)  # copies get their own ids
    b_ids = Counter(c.id.split("#")[0] for c, _ in out if c.label == "b.jsonl")
    assert sorted(b_ids.values()) == [2] * 5 + [3] * 5  # two full copies + a seeded half a third time
    assert [c.id for c, _ in apply_weights(pairs, rec.data)] == [c.id for c, _ in out]  # deterministic
    assert [c for c, _ in out if c.label == "d.jsonl"] == [c for c, _ in pairs if c.label == "d.jsonl"]
    # the draw does not depend on the order of the rows, and follows data.mix_seed
    rev = {c.id for c, _ in apply_weights(list(reversed(pairs)), rec.data)}
    assert rev == {c.id for c, _ in out}
    rec.data.mix_seed = 1
    assert {c.id for c, _ in apply_weights(pairs, rec.data) if c.label == "a.jsonl"} != \
           {c.id for c, _ in out if c.label == "a.jsonl"}
    # one source listed twice: each entry keeps its own weight
    twice = recipe([{"source": "a.jsonl", "weight": 2}, {"source": "a.jsonl", "regenerate": False}])
    assert source_labels(twice.data) == ["a.jsonl (data.sources.0)", "a.jsonl (data.sources.1)"]


# ----------------------------------------------------------------------------- the whole pipeline


def test_prepare_data_reports_tokens_and_drops_per_source(tmp_path, target, isolated_cache, monkeypatch):
    chat = [{"id": i, "messages": [{"role": "user", "content": f"Question number {i}?"},
                                   {"role": "assistant", "content": f"Answer {i}."}]} for i in range(8)]
    chat.append({"id": "empty", "messages": [{"role": "user", "content": "Hm?"}, {"role": "assistant", "content": ""}]})
    (tmp_path / "chat.jsonl").write_text("".join(json.dumps(r) + "\n" for r in chat))
    rec = recipe([{"source": str(tmp_path / "chat.jsonl"), "regenerate": False, "weight": 2.0},
                  {"source": "self", "synth": SETTINGS}],
                 held_out={"fraction": 0.2, "seed": 0}, regeneration={"max_new_tokens": 12, "batch_size": 8})
    calls = count_calls(target, monkeypatch)
    loaded = load_data(rec.data)  # no target: the self source is left for prepare_data
    assert not any(c.source == "self" for c, _ in loaded[0])
    assert list(loaded[1]) == [f"data.sources.0 ({tmp_path / 'chat.jsonl'})", "data.sources.1 (self)"]
    assert loaded[1]["data.sources.1 (self)"] == load_data(rec.data)[1]["data.sources.1 (self)"]
    logs = []
    data = prepare_data(rec.data, target, draft_vocab_size=None, log=logs.append, loaded=loaded)
    rep = data.report
    file_label, self_label = str(tmp_path / "chat.jsonl"), "self"
    assert list(rep) == [file_label, self_label]
    assert rep[file_label]["conversations"] == 8 and rep[file_label]["dropped"] == {"assistant turn without text": 1}
    assert rep[file_label]["train_rows_weighted"] == 2 * rep[file_label]["train_rows"]
    assert rep[self_label]["conversations"] == 12 and rep[self_label]["sampled"] >= 12
    assert sum(rep[self_label]["dropped"].values()) == rep[self_label]["sampled"] - 12
    assert all(k.startswith("self-synthesis: ") for k in rep[self_label]["dropped"])
    assert rep[self_label]["train_rows"] + rep[self_label]["held_out_rows"] == 12
    # tokens per source add up to the training set
    assert sum(r["train_tokens"] for r in rep.values()) == data.train.num_tokens
    assert sum(r["train_loss_tokens"] for r in rep.values()) == data.train.num_loss_tokens
    assert sum(r["train_examples"] for r in rep.values()) == len(data.train)
    assert rep[file_label]["train_examples"] == rep[file_label]["train_rows_weighted"]
    lines = [x for x in logs if x.startswith("data: source ")]
    assert len(lines) == 2 and "weight 2 ->" in lines[0] and "self-synthesis: " in lines[1]
    # the self prompts are on-policy: regenerated, and the eval prompts include them
    assert any(p["id"].startswith("self:") for p in data.eval_prompts) or rep[self_label]["held_out_rows"] == 0
    md = "\n".join(report_markdown(rep))
    assert f"| `{file_label}` | 8 |" in md and "| `self` | self-synthesis: " in md
    # the run card carries the table
    from speculators.train.run_dir import model_card
    unit = SimpleNamespace(drafter=SimpleNamespace(meta=SimpleNamespace(name_or_path="t"), algorithm="eagle3"),
                           card_lines=lambda b, a: [])
    card = model_card(unit, 1, 10, 1.0, {}, {}, data_report=rep)
    assert "## Training data" in card and "assistant turn without text" in card
    # a second run reads every self prompt and answer from the caches
    n = len(calls)
    prepare_data(rec.data, target, draft_vocab_size=None, log=lambda m: None)
    assert len(calls) == n


def test_cli_train_with_a_self_source_that_keeps_nothing_is_one_error_line(tmp_path, tiny_target_dir,
                                                                          isolated_cache):
    """Through ``speculators train``: the self source is synthesized after the target loads; a random
    target never ends its user turn within 4 tokens, so every message is dropped: one ``error:`` line."""
    from typer.testing import CliRunner

    from speculators.cli import app

    raw = yaml.safe_load(TINY.read_text())
    raw["data"]["sources"] = [{"source": "self", "synth": {"num_prompts": 2, "max_prompt_tokens": 4,
                                                           "batch_size": 4, "max_samples": 4}}]
    rp = tmp_path / "r.yaml"
    rp.write_text(yaml.safe_dump(raw))
    r = CliRunner().invoke(app, ["train", str(rp), f"target.model={tiny_target_dir}", "-o", str(tmp_path / "run")])
    assert r.exit_code == 2, r.output
    assert "source self: all 4 user messages" in r.output and "cut off" in r.output
    assert "Traceback" not in r.output
