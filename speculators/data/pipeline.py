"""The data pipeline of a recipe: sources -> split -> regeneration -> rendering -> features -> draft vocab.

Everything expensive is cached on disk (regenerations, features), so a second run of the same
recipe starts training within seconds of loading the target.

The functions take the recipe's data spec (:class:`speculators.recipe.DataSpec`, or one of its
sections), never the whole recipe, and this module imports nothing from ``speculators.drafters``:
the draft vocabulary is :class:`speculators.data.vocab.DraftVocab`.
"""

from __future__ import annotations

import json
from collections import Counter
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch

from ..errors import SpeculatorsError
from ..utils import atomic_write_text
from .chat import prompt_messages, render_prompt, render_with_mask
from .features import FeatureStore, TokenizedExample, extract_features
from .regenerate import regenerate
from .sources import (Conversation, conversations_identity, has_textless_assistant_turn, held_out_split,
                      load_source)
from .vocab import DraftVocab

if TYPE_CHECKING:  # types only: the recipe module imports the drafters (its drafter section is typed)
    from ..recipe import DataSpec, HeldOutSpec

RUN_IDENTITY_FILE = "data_identity.json"


@dataclass
class PreparedData:
    """Output of :func:`prepare_data`.

    Attributes:
        train: features of the training conversations.
        held_out: features of the held-out conversations (same prompts never in ``train``), or None.
        eval_prompts: one per distinct held-out prompt, :func:`held_out_prompts` (the list
            ``speculators eval`` decodes by default).
        vocab: draft vocabulary built from assistant-token frequencies of ``train``.
        token_counts: ``[V]`` int64 assistant-token frequencies.
        identity: content hash of every source's loaded conversations (:func:`load_data`), recorded
            in the run directory so that ``--resume`` refuses changed data.
    """

    train: FeatureStore
    held_out: FeatureStore | None
    eval_prompts: list[dict]
    vocab: DraftVocab
    token_counts: torch.Tensor
    identity: dict[str, str] = field(default_factory=dict)


def _source_label(spec) -> str:
    return spec if isinstance(spec, str) else json.dumps(spec, sort_keys=True, default=str)


def load_data(data_spec: DataSpec, log=None) -> tuple[list[tuple[Conversation, bool]], dict[str, str]]:
    """Load every source of ``data_spec`` (a recipe's ``data`` section): its conversations with their
    ``regenerate`` flag, and the identity of the data.

    Ids are suffixed by mode (``#regen`` / ``#orig``) so that one source may be listed twice, once
    regenerated and once off-policy. A conversation with an assistant turn that carries no text
    (content null, missing, ``""``, whitespace, a content-part list without text) is dropped and
    counted, one log line per source: off-policy it would train only the end-of-turn token; when
    regenerated only the turns kept in the prompt are checked (the final answer is rewritten).

    Returns:
        ``(pairs, identity)``: ``pairs`` is a list of ``(Conversation, regenerate)``; ``identity`` maps
        ``"data.sources.I (SOURCE)"`` to the content hash of that source's conversations as loaded
        (ids + messages, before dropping: :func:`speculators.data.sources.conversations_identity`).

    Raises:
        SpeculatorsError: a source cannot be loaded (see :func:`speculators.data.sources.load_source`).
    """
    out, identity = [], {}
    for n, s in enumerate(data_spec.sources):
        regen = data_spec.regenerate if s.regenerate is None else s.regenerate
        try:
            convs = load_source(s.source, max_examples=s.max_examples)
        except SpeculatorsError:
            raise
        except ValueError as e:
            raise SpeculatorsError(str(e)) from None
        label = _source_label(s.source)
        identity[f"data.sources.{n} ({label})"] = conversations_identity(convs)
        kept = [c for c in convs if not has_textless_assistant_turn(c.messages, prompt_only=regen)]
        if len(kept) < len(convs) and log is not None:
            log(f"data: dropped {len(convs) - len(kept)} conversations of {label}: assistant turn without text")
        tag = "regen" if regen else "orig"
        out.extend((replace(c, id=f"{c.id}#{tag}"), regen) for c in kept)
    return out, identity


def check_run_identity(run_dir: str | Path, identity: dict[str, str], prefix: str = "") -> bool:
    """Compare ``identity`` with the one recorded in ``run_dir`` (``--resume``).

    Args:
        run_dir: the run directory.
        identity: ``{name: content hash}`` of what the run trains on (the data sources of
            :func:`load_data`, the target's fingerprint, ...).
        prefix: compare only the entries whose name starts with it (e.g. ``"data."`` to check the
            data before the target is loaded).
    Returns:
        True when a recorded identity was found and matches; False when the run recorded none (a run
        directory from an older version).
    Raises:
        SpeculatorsError: an entry differs, naming every entry that changed, was added or removed.
    """
    f = Path(run_dir) / RUN_IDENTITY_FILE
    if not f.is_file():
        return False
    try:
        old = json.loads(f.read_text())
    except (OSError, json.JSONDecodeError) as e:
        raise SpeculatorsError(f"--resume: {f} is unreadable ({e}); use --overwrite") from None
    names = {k for k in set(old) | set(identity) if k.startswith(prefix)}
    changed = sorted(k for k in names if old.get(k) != identity.get(k))
    if changed:
        def how(k: str) -> str:
            return "changed" if k in old and k in identity else "added" if k in identity else "removed"
        what = "; ".join(f"{k}: content {how(k)}" for k in changed)
        raise SpeculatorsError(f"--resume: the data (or target) differ from what the run in {Path(run_dir)} was "
                               f"trained on ({what}; recorded in {f}); resume with the same data or use --overwrite")
    return True


def record_run_identity(run_dir: str | Path, identity: dict[str, str]) -> None:
    """Write ``identity`` to ``run_dir/data_identity.json`` (checked by :func:`check_run_identity`)."""
    atomic_write_text(Path(run_dir) / RUN_IDENTITY_FILE, json.dumps(identity, indent=1, sort_keys=True) + "\n")


def split_conversations(pairs: list[tuple[Conversation, bool]], held_out_spec: HeldOutSpec
                        ) -> tuple[list[tuple[Conversation, bool]], list[tuple[Conversation, bool]]]:
    """Held-out split BY PROMPT over all sources (a prompt never lands on both sides).

    Args:
        pairs: ``(Conversation, regenerate)`` pairs of :func:`load_data`.
        held_out_spec: the recipe's ``data.held_out`` (``fraction``, ``seed``).
    Returns:
        ``(train_pairs, held_out_pairs)``, each pair keeping its ``regenerate`` flag
        (:func:`speculators.data.sources.held_out_split`).
    """
    convs = [c for c, _ in pairs]
    flags = {c.id: r for c, r in pairs}
    train, held = held_out_split(convs, held_out_spec.fraction, held_out_spec.seed)
    return [(c, flags[c.id]) for c in train], [(c, flags[c.id]) for c in held]


def unique_prompts(convs: list[Conversation], tokenizer: Any, chat_template: str | None = None,
                   limit: int | None = None) -> list[dict]:
    """One generation prompt per distinct prompt of ``convs`` (first occurrence wins, order kept).

    The prompt of a conversation is its messages before the last assistant turn
    (:func:`speculators.data.chat.prompt_messages`); two conversations with the same prompt (a prompt
    listed by two sources, or once regenerated and once off-policy) give one entry.

    Args:
        tokenizer: the target's tokenizer. chat_template: the recipe's ``data.chat_template`` (None =
            the tokenizer's). limit: stop after this many prompts (None = all).
    Returns:
        ``[{"id", "messages", "input_ids"}]``: ``input_ids`` is a list of int token ids of the rendered
        prompt with the generation prompt (:func:`speculators.data.chat.render_prompt`).
    """
    seen, out = set(), []
    for c in convs:
        if limit is not None and len(out) >= limit:
            break
        pm = prompt_messages(c.messages)
        key = repr(pm)
        if key in seen:
            continue
        seen.add(key)
        out.append({"id": c.id, "messages": pm, "input_ids": render_prompt(tokenizer, pm, chat_template)})
    return out


def held_out_prompts(data_spec: DataSpec, tokenizer: Any, loaded_pairs: list[tuple[Conversation, bool]],
                     limit: int | None = None) -> list[dict]:
    """The held-out prompts of a recipe's data: the ONE definition used by :func:`prepare_data`
    (``PreparedData.eval_prompts``) and by ``speculators eval`` (its default prompts).

    Args:
        data_spec: the recipe's ``data`` section (its ``held_out`` split and ``chat_template``).
        tokenizer: the target's tokenizer.
        loaded_pairs: ``(Conversation, regenerate)`` pairs of :func:`load_data` for ``data_spec``.
        limit: at most this many prompts (None = all).
    Returns:
        :func:`unique_prompts` of the held-out side of :func:`split_conversations`, in split order.
    """
    _, held = split_conversations(loaded_pairs, data_spec.held_out)
    return unique_prompts([c for c, _ in held], tokenizer, data_spec.chat_template, limit=limit)


def _materialise(target, pairs, data_spec: DataSpec, log, progress) -> list[Conversation]:
    """Regenerate the flagged conversations (per source: pre-tokenized, exactly the ids the target
    produced), keep the others' own assistant text."""
    spec = data_spec.regeneration
    by_source: dict[str, list[Conversation]] = {}
    out: dict[str, Conversation] = {}
    for c, regen in pairs:
        if regen:
            by_source.setdefault(c.source, []).append(c)
        else:
            if not c.messages or c.messages[-1]["role"] != "assistant":
                raise SpeculatorsError(
                    f"data source {c.source!r}: conversation {c.id} has no assistant turn; "
                    "set regenerate: true for this source")
            out[c.id] = c
    for source, convs in by_source.items():
        for c in regenerate(target, convs, source, spec.max_new_tokens, spec.temperature, spec.top_p,
                            spec.batch_size, spec.seed, data_spec.chat_template, log=log,
                            progress=progress(f"regenerating {source}") if progress else None):
            out[c.id] = c
    return [out[c.id] for c, _ in pairs]


def tokenize(target, convs: list[Conversation], data_spec: DataSpec, log=None,
             split: str = "train") -> list[TokenizedExample]:
    """Token ids and assistant-only loss mask per conversation; drop (and count) examples with no
    loss tokens.

    A regenerated conversation carries its own ids (``Conversation.input_ids``: prompt ids + the
    target's response ids + its stop token when it stopped) and is only truncated to
    ``data.max_length``; the others are rendered with the chat template (:func:`render_with_mask`).

    A conversation left with no loss token is dropped, counted by source and reason, and logged with
    one line per source and reason, ``"data: dropped N SPLIT conversations of SOURCE: REASON"``:

    * ``no assistant turn``: nothing to train (rendered: no ``assistant`` message; regenerated: an
      all-zero loss mask);
    * ``whole answer beyond data.max_length=L``: the conversation has assistant tokens, but the first
      of them is at position >= L, so truncation removes all of them;
    * ``assistant turns render to no tokens``: assistant messages exist but the template emitted no
      masked token for them (e.g. empty contents).

    Args:
        target: anything with the target's ``tokenizer``.
        convs: the conversations (after regeneration).
        data_spec: the recipe's ``data`` section (``max_length``, ``chat_template``).
        log: callable for the drop lines (None: silent).
        split: ``"train"`` or ``"held-out"``, named in the log lines.
    Returns:
        One :class:`TokenizedExample` per kept conversation, in order: ``input_ids`` and ``loss_mask``
        are lists of ints of equal length ``<= data.max_length``.
    Raises:
        ValueError: a conversation cannot be rendered (see :func:`render_with_mask`).
    """
    exs = []
    drops: Counter = Counter()
    max_len = data_spec.max_length
    for c in convs:
        if c.input_ids is not None:
            ids, mask = list(c.input_ids)[:max_len], list(c.loss_mask)[:max_len]
        else:
            ids, mask = render_with_mask(target.tokenizer, c.messages, data_spec.chat_template,
                                         max_length=max_len)
        if sum(mask) > 0:
            exs.append(TokenizedExample(c.id, ids, mask))
        else:
            drops[(c.source, _drop_reason(target, c, data_spec))] += 1
    if log is not None:
        for (source, reason), n in sorted(drops.items()):
            log(f"data: dropped {n} {split} conversations of {source}: {reason}")
    return exs


def _drop_reason(target, c: Conversation, data_spec: DataSpec) -> str:
    """Why ``c`` has no loss token within ``data.max_length`` (the reasons of :func:`tokenize`)."""
    if c.input_ids is not None:
        full = list(c.loss_mask)
    elif not any(m.get("role") == "assistant" for m in c.messages):
        return "no assistant turn"
    else:  # render again without the cut: were there assistant tokens past it?
        _, full = render_with_mask(target.tokenizer, c.messages, data_spec.chat_template)
        if not any(full):
            return "assistant turns render to no tokens"
    if any(full):
        return f"whole answer beyond data.max_length={data_spec.max_length}"
    return "no assistant turn"


def _log_held_out_without_answers(held_convs: list[Conversation], log) -> None:
    """Log, per source and reason, the held-out conversations that give an eval prompt but no
    held-out loss example (no final assistant answer, or an assistant turn without text)."""
    drops: Counter = Counter()
    for c in held_convs:
        if not c.messages or c.messages[-1]["role"] != "assistant":
            drops[(c.source, "no reference answer (used as eval prompts only)")] += 1
        elif has_textless_assistant_turn(c.messages):
            drops[(c.source, "assistant turn without text (used as eval prompts only)")] += 1
    for (source, reason), n in sorted(drops.items()):
        log(f"data: {n} held-out conversations of {source} give no held-out loss example: {reason}")


def prepare_data(data_spec: DataSpec, target, *, draft_vocab_size: int | None, log=print, progress=None,
                 loaded=None) -> PreparedData:
    """Run the whole data pipeline of ``data_spec`` (a recipe's ``data`` section) for ``target``
    (all steps cached on disk).

    Sets ``target.chat_template`` to ``data_spec.chat_template`` (its stop tokens follow it).

    Args:
        data_spec: the recipe's ``data`` section.
        target: the loaded :class:`speculators.target.Target`.
        draft_vocab_size: N of the draft vocabulary (the recipe's ``drafter.draft_vocab_size``; None =
            the target's whole vocabulary).
        log: callable for log lines. progress: ``make(description) -> callable(done, total)`` or None.
        loaded: the result of :func:`load_data` when the caller already loaded the sources.

    Raises:
        SpeculatorsError: no chat template, a source with zero examples, no trainable tokens, or a
            ``draft_vocab_size`` above the target's vocabulary.
    """
    if target.tokenizer is None:
        raise SpeculatorsError("target has no tokenizer")
    if data_spec.chat_template is None and not getattr(target.tokenizer, "chat_template", None):
        raise SpeculatorsError(
            f"target {target.name_or_path!r} has no chat template; set data.chat_template in the recipe")
    target.chat_template = data_spec.chat_template
    pairs, identity = loaded if loaded is not None else load_data(data_spec, log)
    train_pairs, held_pairs = split_conversations(pairs, data_spec.held_out)
    log(f"data: {len(pairs)} conversations from {len(data_spec.sources)} source(s): "
        f"{len(train_pairs)} train, {len(held_pairs)} held-out (split by prompt)")
    train_convs = _materialise(target, train_pairs, data_spec, log, progress)
    train_ex = tokenize(target, train_convs, data_spec, log=log, split="train")
    if not train_ex:
        raise SpeculatorsError("data: the sources yield zero training examples with assistant tokens")
    fb = data_spec.feature_batch_tokens
    train = extract_features(target, train_ex, fb, log=log,
                             progress=progress("target features") if progress else None)
    held = None
    held_convs = [c for c, _ in held_pairs]
    held_with_answers = [c for c in held_convs if c.messages and c.messages[-1]["role"] == "assistant"
                         and not has_textless_assistant_turn(c.messages)]
    _log_held_out_without_answers(held_convs, log)
    if held_with_answers:
        held_ex, seen_ids = [], set()
        # a prompt listed by two sources: once
        for e in tokenize(target, held_with_answers, data_spec, log=log, split="held-out"):
            if tuple(e.input_ids) not in seen_ids:
                seen_ids.add(tuple(e.input_ids))
                held_ex.append(e)
        if held_ex:
            held = extract_features(target, held_ex, fb, log=log)
    eval_prompts = held_out_prompts(data_spec, target.tokenizer, pairs)  # for generation: one per prompt
    counts = torch.bincount(train.input_ids[train.loss_mask], minlength=target.vocab_size)[:target.vocab_size]
    vocab = DraftVocab.from_counts(counts, draft_vocab_size)
    covered = float(counts[vocab.t2d].sum() / counts.sum().clamp(min=1))
    log(f"data: {train.num_tokens} train tokens ({train.num_loss_tokens} assistant), draft vocab "
        f"{vocab.size} covering {covered:.1%} of assistant tokens, {len(eval_prompts)} held-out prompts")
    return PreparedData(train, held, eval_prompts, vocab, counts, identity)


def counter_summary(c: Counter) -> str:
    return ", ".join(f"{k}: {v}" for k, v in c.most_common())
