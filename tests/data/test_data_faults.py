"""Data-pipeline faults: empty answers, truncated regenerations, stop tokens
that are not the tokenizer's EOS, and ``--resume`` / caches keyed by content rather than by names.

Regeneration tests use a SCRIPTED target: a tiny Llama whose attention and MLP outputs are zeroed, so
the residual stream is the current token's embedding, and whose (untied) ``lm_head`` maps each token of
a chosen chain to its successor. Its greedy continuation is therefore known exactly.
"""

from __future__ import annotations

from collections import Counter

import copy
import json
from pathlib import Path

import pytest
import torch
import yaml

from speculators.data.chat import render_prompt
from speculators.data.pipeline import (check_run_identity, load_data, prepare_data, record_run_identity,
                                       tokenize)
from speculators.data.regenerate import regenerate
from speculators.data.sources import Conversation, has_textless_assistant_turn
from speculators.errors import SpeculatorsError
from speculators.recipe import recipe_from_dict
from speculators.target import Target, build_tiny_target

TINY = Path(__file__).resolve().parents[2] / "recipes" / "tiny-eagle3.yaml"
IM_START, IM_END, ENDOFTEXT, NL = 1, 2, 0, 198  # SmolLM2 ChatML ids ("\n" ends the generation prompt)


def scripted_target(tokenizer, chain: dict[int, int], seed: int = 0) -> Target:
    """A target whose greedy next token after token ``a`` is ``chain[a]`` (whatever the context)."""
    t = build_tiny_target(vocab_size=len(tokenizer), hidden_size=64, num_layers=2, seed=seed)
    m = t.model
    with torch.no_grad():
        for layer in m.model.layers:
            layer.self_attn.o_proj.weight.zero_()
            layer.mlp.down_proj.weight.zero_()
        emb = m.get_input_embeddings().weight
        u = m.model.norm(emb[list(chain)])  # the final hidden state after each chain token
        W = torch.zeros_like(emb)
        for (a, b), ua in zip(chain.items(), u):
            W[b] += 10.0 * ua / ua.norm()
        m.lm_head.weight = torch.nn.Parameter(W, requires_grad=False)  # untied
    return Target(m, tokenizer, name_or_path=f"scripted-{seed}-{sorted(chain.items())}")


def recipe(sources, **data):
    raw = yaml.safe_load(TINY.read_text())
    raw["target"]["model"] = "unused"
    raw["data"]["sources"] = sources
    raw["data"].update(data)
    return recipe_from_dict(raw, "test")


def ids_of(tok, text):
    return tok(text, add_special_tokens=False)["input_ids"]


# ----------------------------------------------------------------------------- 1. empty answers


def test_sharegpt_rows_without_answer_text_are_dropped_and_counted(tmp_path, smol_tokenizer):
    rows = [
        {"id": "good", "conversations": [{"from": "human", "value": "Hi"}, {"from": "gpt", "value": "Hello!"}]},
        {"id": "null", "conversations": [{"from": "human", "value": "A"}, {"from": "gpt", "value": None}]},
        {"id": "empty", "conversations": [{"from": "human", "value": "B"}, {"from": "gpt", "value": ""}]},
        {"id": "missing", "conversations": [{"from": "human", "value": "C"}, {"from": "gpt"}]},
        {"id": "blank", "conversations": [{"from": "human", "value": "D"}, {"from": "gpt", "value": " \n "}]},
        {"id": "early", "conversations": [{"from": "human", "value": "E"}, {"from": "gpt", "value": None},
                                          {"from": "human", "value": "F"}, {"from": "gpt", "value": "ok"}]},
    ]
    openai = [
        {"id": "parts", "messages": [{"role": "user", "content": "G"},
                                     {"role": "assistant", "content": [{"type": "text", "text": " "}]}]},
        {"id": "noparts", "messages": [{"role": "user", "content": "H"}, {"role": "assistant", "content": []}]},
        {"id": "tool", "messages": [{"role": "user", "content": "I"}, {"role": "assistant", "content": None,
                                                                        "tool_calls": []}]},
        {"id": "fine", "messages": [{"role": "user", "content": "J"}, {"role": "assistant", "content": "Sure."}]},
    ]
    prompts = [  # regenerated: a missing final answer is fine, an empty EARLIER answer is not
        {"id": "p1", "messages": [{"role": "user", "content": "K"}]},
        {"id": "p2", "messages": [{"role": "user", "content": "L"}, {"role": "assistant", "content": ""}]},
        {"id": "p3", "messages": [{"role": "user", "content": "M"}, {"role": "assistant", "content": ""},
                                  {"role": "user", "content": "N"}]},
    ]
    for name, data in (("sharegpt.jsonl", rows), ("openai.jsonl", openai), ("prompts.jsonl", prompts)):
        (tmp_path / name).write_text("".join(json.dumps(r) + "\n" for r in data))
    rec = recipe([{"source": str(tmp_path / "sharegpt.jsonl"), "regenerate": False},
                  {"source": str(tmp_path / "openai.jsonl"), "regenerate": False},
                  {"source": str(tmp_path / "prompts.jsonl"), "regenerate": True}])
    logs = []
    pairs, _ = load_data(rec.data, logs.append)
    kept = sorted(c.id for c, _ in pairs)
    assert kept == ["openai/fine#orig", "prompts/p1#regen", "prompts/p2#regen", "sharegpt/good#orig"]
    drops = [x for x in logs if x.startswith("data: dropped")]
    assert drops == [f"data: dropped 5 conversations of {tmp_path / 'sharegpt.jsonl'}: assistant turn without text",
                     f"data: dropped 3 conversations of {tmp_path / 'openai.jsonl'}: assistant turn without text",
                     f"data: dropped 1 conversations of {tmp_path / 'prompts.jsonl'}: assistant turn without text"]
    # what is kept off-policy trains real answer tokens, not only the end-of-turn marker
    for ex in tokenize(type("T", (), {"tokenizer": smol_tokenizer})(), [c for c, r in pairs if not r], rec.data):
        assert sum(ex.loss_mask) >= 3


def test_tokenize_counts_every_dropped_conversation_by_source_and_reason(smol_tokenizer):
    """Review finding: ``tokenize`` dropped conversations without loss tokens (``if sum(mask) > 0``)
    with no count. Each drop is now counted by source and reason, one log line per pair."""
    rec = recipe([{"source": "chatterbot"}], max_length=40)
    tok = type("T", (), {"tokenizer": smol_tokenizer})()
    long_q = "Please tell me, in great detail and at length, everything you know about cats and dogs."
    assert len(render_prompt(smol_tokenizer, [{"role": "user", "content": long_q}])) > 40  # 49 tokens
    assert len(render_prompt(smol_tokenizer, [{"role": "user", "content": "Hi"}])) < 36  # 31 (system prompt)
    ok = [{"role": "user", "content": "Hi"}, {"role": "assistant", "content": "Hello!"}]
    beyond = [{"role": "user", "content": long_q}, {"role": "assistant", "content": "Yes."}]
    convs = [
        Conversation("a/ok", "a", ok),
        Conversation("a/long1", "a", beyond),  # the whole answer lies past data.max_length
        Conversation("a/long2", "a", beyond[:1] + [{"role": "assistant", "content": "No."}]),
        Conversation("b/none", "b", [{"role": "user", "content": "Hi"}]),  # off-policy, no assistant turn
        Conversation("b/regen", "b", beyond, input_ids=[5] * 45 + [7, 8], loss_mask=[0] * 45 + [1, 1]),
        Conversation("b/ok", "b", ok, input_ids=[5] * 10 + [7, 8], loss_mask=[0] * 10 + [1, 1]),
    ]
    logs = []
    exs = tokenize(tok, convs, rec.data, log=logs.append)
    assert [e.id for e in exs] == ["a/ok", "b/ok"]
    assert all(len(e.input_ids) <= 40 and sum(e.loss_mask) > 0 for e in exs)
    assert logs == ["data: dropped 2 train conversations of a: whole answer beyond data.max_length=40",
                    "data: dropped 1 train conversations of b: no assistant turn",
                    "data: dropped 1 train conversations of b: whole answer beyond data.max_length=40"]
    assert [e.id for e in tokenize(tok, convs, rec.data)] == ["a/ok", "b/ok"]  # no log: same result


def test_prepare_data_logs_held_out_conversations_without_loss_examples(tmp_path, smol_tokenizer, isolated_cache):
    """The held-out side: prompts without a reference answer serve as eval prompts only, and that is
    logged per source; a held-out answer past data.max_length is logged as a drop."""
    long_q = "Please tell me, in great detail and at length, everything you know about cats and dogs."
    chat = [{"id": i, "messages": [{"role": "user", "content": f"Question {i}?"},
                                   {"role": "assistant", "content": f"Answer number {i}."}]} for i in range(6)]
    chat.append({"id": "long", "messages": [{"role": "user", "content": long_q},
                                            {"role": "assistant", "content": "Yes."}]})
    (tmp_path / "chat.jsonl").write_text("".join(json.dumps(r) + "\n" for r in chat))
    rec = recipe([{"source": str(tmp_path / "chat.jsonl"), "regenerate": False}], max_length=40,
                 held_out={"fraction": 0.5, "seed": 0})
    pairs, _ = load_data(rec.data)
    # the held-out side must hold the long conversation and at least one ordinary one: pick the seed
    from speculators.data.pipeline import split_conversations
    for seed in range(50):
        rec.data.held_out.seed = seed
        train, held = split_conversations(pairs, rec.data.held_out)
        held_ids = {c.id for c, _ in held}
        if "chat/long#orig" in held_ids and len(held_ids) >= 2 and train:
            break
    else:
        pytest.skip("no split with the long conversation held out")
    target = build_tiny_target(vocab_size=len(smol_tokenizer), hidden_size=32, num_layers=2, seed=0)
    target.tokenizer = smol_tokenizer
    logs = []
    data = prepare_data(rec.data, target, draft_vocab_size=None, log=logs.append)
    assert data.held_out is not None
    assert "data: dropped 1 held-out conversations of chat: whole answer beyond data.max_length=40" in logs


def test_held_out_examples_of_regenerated_sources_are_the_targets_answers(tmp_path, smol_tokenizer, isolated_cache):
    """Review finding: held-out examples were rendered from the data's own answers even for sources
    whose training rows are regenerated, so the held-out loss and acceptance measured text the target
    never wrote (and self-synthesized prompts gave none). They are regenerated now (cached), exactly
    like the training side; an off-policy source keeps its answers; a sequence listed twice is counted."""
    hello, bang = ids_of(smol_tokenizer, "Hello!")
    target = scripted_target(smol_tokenizer, {NL: hello, hello: bang, bang: IM_END})
    rows = [{"id": i, "messages": [{"role": "user", "content": f"Question {i}?"},
                                   {"role": "assistant", "content": f"The original answer number {i}."}]}
            for i in range(8)]
    (tmp_path / "chat.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    rec = recipe([{"source": str(tmp_path / "chat.jsonl"), "regenerate": True},
                  {"source": str(tmp_path / "chat.jsonl"), "regenerate": False},
                  {"source": str(tmp_path / "chat.jsonl"), "regenerate": False}],
                 held_out={"fraction": 0.5, "seed": 1})
    logs = []
    data = prepare_data(rec.data, target, draft_vocab_size=None, log=logs.append)
    held = data.held_out
    n_prompts = len(data.eval_prompts)
    assert 1 <= n_prompts <= 7
    examples = [held.example(i)["input_ids"].tolist() for i in range(len(held))]
    answers = [ids_of(smol_tokenizer, r["messages"][1]["content"]) for r in rows]
    regenerated = [e for e in examples if e[-3:] == [hello, bang, IM_END]]
    original = [e for e in examples if any(e[-len(a) - 2:-2] == a for a in answers)]  # answer, <|im_end|>, \n
    assert len(regenerated) == n_prompts and len(original) == n_prompts and len(examples) == 2 * n_prompts
    rep = {n: data.report[f"{tmp_path / 'chat.jsonl'} (data.sources.{n})"] for n in (1, 2)}
    assert rep[2]["dropped"] == {"held-out: duplicate of another held-out example": n_prompts}, data.report
    # one source listed twice in one mode: its own ids (#orig@1, #orig@2), so each entry counts its own rows
    assert rep[1]["dropped"] == {} and rep[1]["train_examples"] == rep[2]["train_examples"] == 8 - n_prompts


def test_rows_that_cannot_give_an_example_are_dropped_at_load_on_both_sides(tmp_path):
    """Review finding: an off-policy row without an answer aborted the run when it fell on the train side
    and was kept as an eval prompt on the held-out side (the split decided); an assistant-only row of a
    regenerated source failed inside the chat template with no file or row named. Both are dropped and
    counted at load, before the split; a regenerate: false source with no answer at all is an error."""
    rows = [{"prompt": "Hi", "response": "Hello"}, {"prompt": "Bye", "response": None},
            {"messages": [{"role": "user", "content": "Q"}]}]
    (tmp_path / "pr.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    (tmp_path / "lone.jsonl").write_text(json.dumps({"messages": [{"role": "assistant", "content": "only"}]}) + "\n"
                                         + json.dumps({"messages": [{"role": "system", "content": "S"},
                                                                    {"role": "assistant", "content": "x"}]}) + "\n"
                                         + json.dumps({"messages": [{"role": "user", "content": "U"}]}) + "\n")
    logs = []
    pairs, _ = load_data(recipe([{"source": str(tmp_path / "pr.jsonl"), "regenerate": False},
                                 {"source": str(tmp_path / "lone.jsonl"), "regenerate": True}]).data, logs.append)
    assert sorted(c.id.split("#")[0].split("/")[-1] for c, _ in pairs) == ["1", "3"]  # ids: line numbers
    assert any(x.endswith("conversations of " + str(tmp_path / "lone.jsonl") + ": no user turn before the answer")
               and "dropped 2" in x for x in logs), logs
    assert any("no reference answer (regenerate: false)" in x and "pr.jsonl" in x and "dropped 2" in x
               for x in logs), logs
    (tmp_path / "prompts.jsonl").write_text(json.dumps({"messages": [{"role": "user", "content": "Q"}]}) + "\n")
    with pytest.raises(SpeculatorsError, match=r"data\.sources\.0 .*set regenerate: true"):
        load_data(recipe([{"source": str(tmp_path / "prompts.jsonl"), "regenerate": False}]).data)


def test_rows_dropped_at_load_move_no_other_row_across_the_held_out_split(tmp_path):
    """Review finding: the split ranked only the rows kept, so dropping a held-out row pulled a training
    row onto the held-out side (and trained rows became eval prompts). The dropped rows' groups still
    count: the split of the kept rows is the split of everything loaded, minus the dropped rows."""
    from speculators.data.pipeline import split_conversations
    from speculators.data.sources import held_out_split

    rows = [{"prompt": f"Question {i}?", "response": None if i in (3, 17, 29) else f"Answer {i}."} for i in range(40)]
    (tmp_path / "qa.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    rec = recipe([{"source": str(tmp_path / "qa.jsonl"), "regenerate": False}], held_out={"fraction": 0.2, "seed": 0})
    loaded = load_data(rec.data)
    assert len(loaded[0]) == 37 and len(loaded.dropped_groups) == 3
    _, held = split_conversations(loaded[0], rec.data.held_out, loaded.dropped_groups)
    everything = [Conversation(f"x/{i}", "x", [{"role": "user", "content": f"Question {i}?"}]) for i in range(40)]
    _, full_held = held_out_split(everything, 0.2, 0)
    expected = {c.messages[0]["content"] for c in full_held} - {f"Question {i}?" for i in (3, 17, 29)}
    assert {c.messages[0]["content"] for c, _ in held} == expected
    # without the dropped groups the split would differ (the test can fail)
    _, naive = split_conversations(loaded[0], rec.data.held_out)
    assert {c.messages[0]["content"] for c, _ in naive} != expected


def test_textless_assistant_turn_kinds():
    assert has_textless_assistant_turn([{"role": "user", "content": "x"}, {"role": "assistant", "content": None}])
    assert has_textless_assistant_turn([{"role": "user", "content": "x"}, {"role": "assistant"}])
    assert has_textless_assistant_turn([{"role": "assistant", "content": [{"type": "text", "text": ""}]}])
    assert not has_textless_assistant_turn([{"role": "user", "content": ""}, {"role": "assistant", "content": "a"}])
    tail = [{"role": "user", "content": "x"}, {"role": "assistant", "content": ""}]
    assert not has_textless_assistant_turn(tail, prompt_only=True)
    assert has_textless_assistant_turn(tail + [{"role": "user", "content": "y"}], prompt_only=True)


# ----------------------------------------------------------------------------- 2. truncated regeneration


def test_truncated_regeneration_trains_exactly_the_generated_ids(smol_tokenizer, isolated_cache):
    hello, bang = ids_of(smol_tokenizer, "Hello!")
    target = scripted_target(smol_tokenizer, {NL: hello, hello: bang, bang: hello})  # never stops
    convs = [Conversation("s/0", "s", [{"role": "user", "content": "Hi"}]),
             Conversation("s/1", "s", [{"role": "user", "content": "What is two plus two?"},
                                       {"role": "assistant", "content": "Four."}])]
    rec = recipe([{"source": "chatterbot"}], regeneration={"max_new_tokens": 8})
    for attempt in range(2):  # generated, then read back from the cache
        logs = []
        out = regenerate(target, convs, "s", max_new_tokens=8, log=logs.append)
        assert ("cache hit" in logs[0]) == (attempt == 1)
        exs = tokenize(target, out, rec.data)
        for c, ex in zip(convs, exs):
            prompt = render_prompt(smol_tokenizer, c.messages)
            gen = [hello, bang] * 4
            assert ex.input_ids == prompt + gen  # no end-of-turn appended after the 8th token
            assert ex.loss_mask == [0] * len(prompt) + [1] * 8
            assert IM_END not in ex.input_ids[len(prompt):]


def test_regeneration_that_stops_trains_its_stop_token(smol_tokenizer, isolated_cache):
    hello, bang = ids_of(smol_tokenizer, "Hello!")
    target = scripted_target(smol_tokenizer, {NL: hello, hello: bang, bang: IM_END})
    c = Conversation("s/0", "s", [{"role": "user", "content": "Hi"}, {"role": "assistant", "content": "Yo"},
                                  {"role": "user", "content": "Again"}])
    (out,) = regenerate(target, [c], "s", max_new_tokens=8, log=lambda m: None)
    prompt = render_prompt(smol_tokenizer, c.messages)
    assert out.input_ids == prompt + [hello, bang, IM_END]
    assert out.loss_mask[-3:] == [1, 1, 1]
    # the earlier answer "Yo" (+ its <|im_end|>) keeps its mask inside the prompt
    yo = ids_of(smol_tokenizer, "Yo")
    masked = [t for t, m in zip(out.input_ids[:len(prompt)], out.loss_mask) if m]
    assert masked == yo + [IM_END]
    assert out.messages[-1] == {"role": "assistant", "content": "Hello!"}


def test_a_prompt_that_fills_the_training_window_is_not_generated(smol_tokenizer, isolated_cache):
    # a long multi-turn history once asked the batched prefill for 27.6 GB; no token of its answer could be
    # trained, so it is not generated: the earlier answer inside the window still trains, nothing else does
    hello, bang = ids_of(smol_tokenizer, "Hello!")
    target = scripted_target(smol_tokenizer, {NL: hello, hello: bang, bang: IM_END})
    history = [{"role": "user", "content": "Tell me"}, {"role": "assistant", "content": "Yo"},
               {"role": "user", "content": "word " * 60}]
    long_c = Conversation("s/long", "s", history)
    only_user = Conversation("s/user", "s", [{"role": "user", "content": "word " * 60}])
    short = Conversation("s/short", "s", [{"role": "user", "content": "Hi"}])
    limit = 40
    assert len(render_prompt(smol_tokenizer, history)) >= limit > len(render_prompt(smol_tokenizer, short.messages))
    seen = []
    real = target.generate_batch
    target.generate_batch = lambda prompts, *a, **k: seen.extend(prompts) or real(prompts, *a, **k)
    logs = []
    out_long, out_user, out_short = regenerate(target, [long_c, only_user, short], "s", max_new_tokens=8,
                                               log=logs.append, max_length=limit)
    assert seen == [render_prompt(smol_tokenizer, short.messages)]  # the long prompts never reach the target
    assert any("2 of 3 prompts of 's' not generated" in m and "max_length" in m for m in logs), logs
    assert out_short.input_ids[-3:] == [hello, bang, IM_END]
    prompt = render_prompt(smol_tokenizer, history)
    assert out_long.input_ids == prompt and out_long.messages == history  # no response at all
    rec = recipe([{"source": "chatterbot"}], regeneration={"max_new_tokens": 8}, max_length=limit)
    drops = Counter()
    exs = tokenize(target, [out_long, out_user, out_short], rec.data, drop_counts=drops)
    yo = ids_of(smol_tokenizer, "Yo")
    kept = {e.id: e for e in exs}
    assert set(kept) == {"s/long", "s/short"}
    assert [t for t, m in zip(kept["s/long"].input_ids, kept["s/long"].loss_mask) if m] == yo + [IM_END]
    assert drops == Counter({("s", f"whole answer beyond data.max_length={limit}"): 1})


# ----------------------------------------------------------------------------- 3. stop ids


@pytest.fixture(scope="module")
def gemma_style_tokenizer(smol_tokenizer, tmp_path_factory):
    """SmolLM2's tokenizer repackaged: eos_token is <|endoftext|>, turns still end with <|im_end|>."""
    from transformers import AutoTokenizer

    d = tmp_path_factory.mktemp("tok")
    smol_tokenizer.save_pretrained(d)
    tok = AutoTokenizer.from_pretrained(d, eos_token="<|endoftext|>")
    assert tok.eos_token_id == ENDOFTEXT
    return tok


def test_stop_ids_include_the_end_of_turn_marker(gemma_style_tokenizer, isolated_cache):
    tok = gemma_style_tokenizer
    hello, bang = ids_of(tok, "Hello!")
    user = ids_of(tok, "user")[0]
    # the target ends its turn, then (if not stopped) invents a user turn and an answer, forever
    chain = {NL: hello, hello: bang, bang: IM_END, IM_END: IM_START, IM_START: user, user: NL}
    target = scripted_target(tok, chain)
    target.model.generation_config.eos_token_id = [ENDOFTEXT, IM_END]
    assert target.stop_token_ids == [ENDOFTEXT, IM_END]
    # without the generation config, the chat template's end-of-turn marker is still found
    target.model.generation_config.eos_token_id = None
    assert target.stop_token_ids == [ENDOFTEXT, IM_END]
    assert target.stop_ids_for("{% for m in messages %}{{ m['content'] }}<|endoftext|>{% endfor %}") == [ENDOFTEXT]
    c = Conversation("s/0", "s", [{"role": "user", "content": "Hi"}])
    (out,) = regenerate(target, [c], "s", max_new_tokens=24, log=lambda m: None)
    prompt = render_prompt(tok, c.messages)
    assert out.input_ids == prompt + [hello, bang, IM_END]
    assert out.messages[-1]["content"] == "Hello!"
    assert "user" not in out.messages[-1]["content"]
    record = json.loads(next((isolated_cache / "regen").glob("*.jsonl")).read_text().splitlines()[0])
    assert record["ids"] == [hello, bang] and record["stop"] == IM_END


# ----------------------------------------------------------------------------- 4. identity by content


def test_regeneration_cache_is_keyed_by_prompt_content(smol_tokenizer, isolated_cache, monkeypatch):
    hello, bang = ids_of(smol_tokenizer, "Hello!")
    target = scripted_target(smol_tokenizer, {NL: hello, hello: bang, bang: IM_END})
    generated = []
    real = target.generate_batch
    monkeypatch.setattr(target, "generate_batch",
                        lambda prompts, *a, **k: generated.extend(prompts) or real(prompts, *a, **k))
    a = Conversation("src/1", "src", [{"role": "user", "content": "Tell me a story about a cat."}])
    b = Conversation("src/1", "src", [{"role": "user", "content": "What is the capital of France?"}])  # same id
    kw = dict(max_new_tokens=6, log=lambda m: None)
    (ra,) = regenerate(target, [a], "src", **kw)
    (rb,) = regenerate(target, [b], "src", **kw)  # the id is cached, this prompt is not: generate it
    pa, pb = (render_prompt(smol_tokenizer, c.messages) for c in (a, b))
    assert generated == [pa, pb]
    assert rb.input_ids == pb + [hello, bang, IM_END]
    (again,) = regenerate(target, [Conversation("src/7", "src", b.messages)], "src", **kw)  # new id, same prompt
    assert generated == [pa, pb] and again.input_ids == rb.input_ids


def test_regeneration_resumes_after_a_torn_last_line(smol_tokenizer, isolated_cache):
    """An interrupted run leaves a partial last line; the next run's first record must not be glued to
    it (it was, and was lost once more on every resume)."""
    hello, bang = ids_of(smol_tokenizer, "Hello!")
    target = scripted_target(smol_tokenizer, {NL: hello, hello: bang, bang: IM_END})
    a = Conversation("s/0", "s", [{"role": "user", "content": "Tell me a story about a cat."}])
    b = Conversation("s/1", "s", [{"role": "user", "content": "What is the capital of France?"}])
    kw = dict(max_new_tokens=6, log=lambda m: None)
    regenerate(target, [a], "s", **kw)
    (cache,) = (isolated_cache / "regen").glob("*.jsonl")
    cache.write_text(cache.read_text() + '{"key": "torn", "ids": [1, ')  # killed mid-write
    regenerate(target, [a, b], "s", **kw)  # b is new: appended after the torn line
    logs = []
    (ra, rb) = regenerate(target, [a, b], "s", max_new_tokens=6, log=logs.append)
    assert "cache hit" in logs[0], logs  # b's record was read back, not lost to the torn line
    assert rb.input_ids == render_prompt(smol_tokenizer, b.messages) + [hello, bang, IM_END]


def test_sampled_regeneration_does_not_depend_on_batching_or_resuming(smol_tokenizer, isolated_cache):
    """At temperature > 0 each prompt samples from its own generator (seed, prompt key): the responses of
    an uninterrupted run, of one prompt per batch, and of a run resumed after its first batch are the
    same, and no two prompts replay one random stream (they did: batch i was seeded seed + i of the
    prompts still to generate, so a resumed run gave prompts 3-4 the samples of prompts 1-2)."""
    target = build_tiny_target(vocab_size=len(smol_tokenizer), hidden_size=32, num_layers=2, seed=0)
    target.tokenizer = smol_tokenizer
    convs = [Conversation(f"s/{i}", "s", [{"role": "user", "content": f"Question number {i}?"}]) for i in range(5)]
    kw = dict(max_new_tokens=6, temperature=30.0, seed=3, log=lambda m: None)  # the tiny target is peaked

    def responses(batches, batch_size):
        for part in batches:
            out = regenerate(target, part, "s", batch_size=batch_size, **kw)
        for f in (isolated_cache / "regen").glob("*.jsonl"):
            f.unlink()
        return [c.input_ids for c in out]

    whole = responses([convs], 4)
    assert responses([convs], 1) == whole  # one prompt per batch
    assert responses([convs[:2], convs], 2) == whole  # resumed after two prompts were cached
    news = [ids[len(render_prompt(smol_tokenizer, c.messages)):] for c, ids in zip(convs, whole)]
    assert len({tuple(n) for n in news}) == len(news), news  # no stream replayed
    other = regenerate(target, convs[:1], "s", batch_size=4, **{**kw, "seed": 4})[0].input_ids
    assert other != whole[0]  # the recipe's seed still matters


def test_data_identity_follows_file_content(tmp_path):
    f = tmp_path / "chat.jsonl"
    row = {"messages": [{"role": "user", "content": "Hi"}, {"role": "assistant", "content": "Hello"}]}
    f.write_text(json.dumps(row) + "\n")
    rec = recipe([{"source": str(f), "regenerate": False}, {"source": "humaneval", "max_examples": 2}])
    _, ident = load_data(rec.data)
    run = tmp_path / "run"
    record_run_identity(run, {**ident, "target": "abc"})
    assert check_run_identity(run, ident, prefix="data.")
    assert check_run_identity(run, {**load_data(rec.data)[1], "target": "abc"})
    row2 = copy.deepcopy(row)
    row2["messages"][1]["content"] = "Hello there"
    f.write_text(json.dumps(row2) + "\n")  # same path, same id, new content
    _, ident2 = load_data(rec.data)
    with pytest.raises(SpeculatorsError, match=r"data\.sources\.0 .*chat\.jsonl.*changed") as e:
        check_run_identity(run, ident2, prefix="data.")
    assert "humaneval" not in str(e.value) and "--overwrite" in str(e.value)
    with pytest.raises(SpeculatorsError, match="target: content changed"):
        check_run_identity(run, {**ident, "target": "other"})
    assert not check_run_identity(tmp_path / "no-run", ident)


def test_resume_refuses_changed_data(tmp_path, tiny_target_dir, isolated_cache):
    from typer.testing import CliRunner

    from speculators.cli import app

    f = tmp_path / "chat.jsonl"
    rows = [{"id": i, "messages": [{"role": "user", "content": f"Question {i}?"},
                                   {"role": "assistant", "content": f"Answer number {i}."}]} for i in range(6)]
    f.write_text("".join(json.dumps(r) + "\n" for r in rows))
    raw = yaml.safe_load(TINY.read_text())
    raw["data"]["sources"] = [{"source": str(f), "regenerate": False}]
    raw["data"]["held_out"] = {"fraction": 0.0, "seed": 0}
    rp = tmp_path / "r.yaml"
    rp.write_text(yaml.safe_dump(raw))
    out = tmp_path / "run"
    args = ["train", str(rp), f"target.model={tiny_target_dir}", "train.steps=1", "train.eval_every=1000",
            "-o", str(out)]
    r = CliRunner().invoke(app, args)
    assert r.exit_code == 0, f"{r.exception!r}\n{r.output}"
    assert (out / "data_identity.json").is_file()
    rows[3]["messages"][1]["content"] = "A different answer."
    f.write_text("".join(json.dumps(r) + "\n" for r in rows))
    r = CliRunner().invoke(app, args + ["--resume"])
    assert r.exit_code == 2, r.output
    assert "data.sources.0" in r.output and "changed" in r.output and "Traceback" not in r.output
