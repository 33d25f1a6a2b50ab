"""The data pipeline of a recipe: sources -> split -> regeneration -> rendering -> features -> draft vocab.

Everything expensive is cached on disk (regenerations, features), so a second run of the same
recipe starts training within seconds of loading the target. With ``data.features: online`` the
features are not cached: the stores hold token ids and masks only and the frozen target runs inside
every training step (:class:`speculators.train.unit.TrainingUnit`).

The functions take the recipe's data spec (:class:`speculators.recipe.DataSpec`, or one of its
sections), never the whole recipe, and this module imports nothing from ``speculators.drafters``:
the draft vocabulary is :class:`speculators.data.vocab.DraftVocab`.
"""

from __future__ import annotations

import hashlib
import json
from collections import Counter
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch

from ..errors import SpeculatorsError
from ..utils import atomic_write_text
from .chat import prompt_messages, render_prompt, render_with_mask
from .features import DEFAULT_FEATURE_DTYPE, FeatureStore, TokenizedExample, extract_features
from .regenerate import regenerate
from .server_regen import PYTORCH_PRODUCER, regeneration_server
from .selfsynth import SELF_SOURCE, synthesis_identity, synthesize_prompts
from .sources import (Conversation, conversations_identity, has_textless_assistant_turn, held_out_split,
                      load_source, split_group)
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
        report: per recipe source (its label, :func:`source_labels`), what it contributed and what was
            dropped: :func:`data_report` (logged by :func:`prepare_data`, written in the run card).
        producer: who regenerated the answers (:data:`speculators.data.server_regen.PYTORCH_PRODUCER` or a
            server's identity; None when nothing was regenerated): the run card and ``config.json`` record it.
    """

    train: FeatureStore
    held_out: FeatureStore | None
    eval_prompts: list[dict]
    vocab: DraftVocab
    token_counts: torch.Tensor
    identity: dict[str, str] = field(default_factory=dict)
    report: dict[str, dict] = field(default_factory=dict)
    producer: dict[str, Any] | None = None


def _source_label(spec) -> str:
    return spec if isinstance(spec, str) else json.dumps(spec, sort_keys=True, default=str)


def source_labels(data_spec: DataSpec) -> list[str]:
    """The name of each ``data.sources`` entry in logs and reports: the source spec
    (``humaneval``, a path, ``self``), with `` (data.sources.I)`` appended when two entries share it."""
    base = [_source_label(s.source) for s in data_spec.sources]
    return [b if base.count(b) == 1 else f"{b} (data.sources.{i})" for i, b in enumerate(base)]


class LoadedData(tuple):
    """``(pairs, identity)`` of :func:`load_data` (it unpacks as that 2-tuple), plus ``stats``:
    ``{label: {"conversations": int, "dropped": Counter(reason -> rows)}}`` per recipe source, and
    ``dropped_groups``: the held-out split groups (:func:`speculators.data.sources.split_group`) of the
    conversations dropped at load, which the split still counts (:func:`split_conversations`)."""

    stats: dict[str, dict]
    dropped_groups: frozenset

    def __new__(cls, pairs, identity, stats, dropped_groups=frozenset()):
        obj = super().__new__(cls, (pairs, identity))
        obj.stats = stats
        obj.dropped_groups = frozenset(dropped_groups)
        return obj


def _has_self_pairs(pairs) -> bool:
    return any(c.id.startswith(f"{SELF_SOURCE}:") for c, _ in pairs)


def synthesize_self_sources(data_spec: DataSpec, target, stats: dict | None = None, log=None,
                            progress=None) -> list[tuple[Conversation, bool]]:
    """The ``(Conversation, True)`` pairs of every ``source: self`` entry of ``data_spec``: prompts the
    target writes (:func:`speculators.data.selfsynth.synthesize_prompts`, cached), answers to regenerate.

    Args:
        stats: :attr:`LoadedData.stats` to fill (kept prompts, filter drops as ``self-synthesis: REASON``).
    Raises:
        SpeculatorsError: every sampled prompt was dropped, bad settings or template (the message names
            the source).
    """
    out = []
    for label, s in zip(source_labels(data_spec), data_spec.sources):
        if s.source != SELF_SOURCE:
            continue
        try:
            res = synthesize_prompts(target, s.synth, chat_template=data_spec.chat_template,
                                     log=log or (lambda m: None),
                                     progress=progress("self-synthesis") if progress else None)
        except SpeculatorsError:
            raise
        except ValueError as e:
            raise SpeculatorsError(str(e)) from None
        if stats is not None:
            st = stats.setdefault(label, {"conversations": 0, "dropped": Counter()})
            st["conversations"] = len(res.conversations)
            st["sampled"] = res.samples
            st["dropped"].update({f"self-synthesis: {r}": n for r, n in res.drops.items()})
        out.extend((replace(c, id=f"{c.id}#regen", label=label), True) for c in res.conversations)
    return out


def load_data(data_spec: DataSpec, log=None, *, target=None, progress=None) -> LoadedData:
    """Load every source of ``data_spec`` (a recipe's ``data`` section): its conversations with their
    ``regenerate`` flag, and the identity of the data.

    Ids are suffixed by mode (``#regen`` / ``#orig``) so that one source may be listed twice, once
    regenerated and once off-policy. A conversation that cannot give an example is dropped and
    counted here, before the held-out split, one log line per source and reason
    (:func:`unusable_reason`): an assistant turn that carries no text (content null, missing, ``""``,
    whitespace, a content-part list without text; off-policy it would train only the end-of-turn
    token; when regenerated only the turns kept in the prompt are checked, the final answer is
    rewritten), an off-policy conversation that does not end with an answer, a regenerated one with
    no user turn to answer. Every conversation's ``label`` is its entry's name (:func:`source_labels`). The rows a source's
    loader skipped (empty conversations, duplicates of chatterbot and chitchat, malformed entries,
    unreadable files: the ``drops`` of :func:`speculators.data.sources.load_source`) are counted the
    same way, one log line ``data: dropped N conversations of SOURCE: REASON`` per reason, before the
    empty-answer line. ``max_examples`` is a cap, not a filter: rows after it are not counted.

    ``source: self`` entries need the target: with ``target`` their prompts are synthesized (or read
    from the cache) and appended after the other sources' (:func:`synthesize_self_sources`); without
    it they are left out (:func:`prepare_data` adds them). Their identity is the hash of their
    settings either way (:func:`speculators.data.selfsynth.synthesis_identity`).

    Returns:
        :class:`LoadedData` ``(pairs, identity)``: ``pairs`` is a list of ``(Conversation, regenerate)``;
        ``stats[label]`` is ``{"conversations": kept, "dropped": Counter(reason -> rows)}``;
        ``identity`` maps ``"data.sources.I (SOURCE)"`` to the content hash of that source's
        conversations as loaded (ids + messages, before dropping:
        :func:`speculators.data.sources.conversations_identity`).

    Raises:
        SpeculatorsError: a source cannot be loaded (see :func:`speculators.data.sources.load_source`);
            a ``regenerate: false`` source none of whose conversations ends with an answer.
    """
    out, identity, stats, dropped_groups = [], {}, {}, set()
    labels = source_labels(data_spec)
    modes = [(s.source, data_spec.regenerate if s.regenerate is None else s.regenerate) for s in data_spec.sources]
    for n, s in enumerate(data_spec.sources):
        regen = modes[n][1]
        # id suffix: the mode, and the entry's index when one source is listed twice in one mode
        tag = ("regen" if regen else "orig") + (f"@{n}" if modes.count(modes[n]) > 1 else "")
        if s.source == SELF_SOURCE:
            identity[f"data.sources.{n} ({SELF_SOURCE})"] = synthesis_identity(s.synth)
            stats[labels[n]] = {"conversations": 0, "dropped": Counter()}
            continue
        load_drops: Counter = Counter()
        try:
            convs = load_source(s.source, max_examples=s.max_examples, drops=load_drops)
        except SpeculatorsError:
            raise
        except ValueError as e:
            raise SpeculatorsError(str(e)) from None
        label = _source_label(s.source)
        identity[f"data.sources.{n} ({label})"] = conversations_identity(convs)
        dropped = Counter({r: k for r, k in load_drops.items() if k > 0})  # skipped by the loader
        kept = []
        for c in convs:
            why = unusable_reason(c.messages, regen)
            if why is None:
                kept.append(c)
            else:
                dropped[why] += 1
                dropped_groups.add(split_group(replace(c, id=f"{c.id}#{tag}")))
        if convs and not kept and dropped[DROP_NO_REFERENCE] == len(convs):
            raise SpeculatorsError(
                f"data.sources.{n} ({label}): none of its {len(convs)} conversations ends with an assistant "
                "answer; set regenerate: true for this source (the target writes the answers)")
        if log is not None:
            for reason, k in dropped.items():
                log(f"data: dropped {k} conversations of {label}: {reason}")
        stats[labels[n]] = {"conversations": len(kept), "dropped": dropped}
        out.extend((replace(c, id=f"{c.id}#{tag}", label=labels[n]), regen) for c in kept)
    if target is not None:
        out.extend(synthesize_self_sources(data_spec, target, stats, log, progress))
    return LoadedData(out, identity, stats, dropped_groups)


DROP_TEXTLESS = "assistant turn without text"
DROP_NO_REFERENCE = "no reference answer (regenerate: false)"
DROP_NO_PROMPT = "no user turn before the answer"


def unusable_reason(messages: list[dict], regenerate: bool) -> str | None:
    """Why a loaded conversation cannot give a training or held-out example (None: it can). Checked at
    load time, before the held-out split, so a row is dropped and counted the same way on either side:

    * ``assistant turn without text``: an assistant turn with no text that would be trained as an
      empty answer (with ``regenerate``, only the turns kept in the prompt count: the final answer is
      replaced by the target's);
    * ``no reference answer (regenerate: false)``: the data's own answer is trained, and the
      conversation does not end with one;
    * ``no user turn before the answer`` (``regenerate``): nothing but system messages is left for the
      target to answer.
    """
    if has_textless_assistant_turn(messages, prompt_only=regenerate):
        return DROP_TEXTLESS
    if not regenerate:
        return None if messages and messages[-1].get("role") == "assistant" else DROP_NO_REFERENCE
    if not any(m.get("role") != "system" for m in prompt_messages(messages)):
        return DROP_NO_PROMPT
    return None


def apply_weights(pairs: list[tuple[Conversation, bool]], data_spec: DataSpec, log=None
                  ) -> list[tuple[Conversation, bool]]:
    """Mix the training rows by the sources' ``weight`` (``data.sources[i].weight``).

    A source with ``n`` training rows (train side of the held-out split) and weight ``w`` contributes
    ``m = round(w * n)`` rows: ``m // n`` full copies of its rows plus ``m % n`` rows drawn without
    replacement, the ones ranking first by ``sha256(f"{data.mix_seed}:{label}:{id}")`` (deterministic
    under the seed, independent of the order of the rows). So ``w = 1`` keeps the source as it is,
    ``w = 0.5`` keeps half of its rows, ``w = 2.5`` repeats each row twice and a seeded half a third
    time, and ``w = 0`` leaves it out of training (its held-out rows are still evaluated). Copies after
    the first get ``#wK`` appended to their id (K = 2, 3, ...) and follow their row; regeneration and
    features are computed once per distinct prompt / token sequence, so copies cost no target time.

    Args:
        pairs: ``(Conversation, regenerate)`` pairs of the train side (each conversation's ``label``
            names its source entry; None = its ``source``).
        data_spec: the recipe's ``data`` section (``sources[i].weight``, ``mix_seed``).
    Returns:
        The mixed pairs, in input order (copies next to their row).
    """
    weights = dict(zip(source_labels(data_spec), (float(s.weight) for s in data_spec.sources)))
    by_label: dict[str, list[str]] = {}
    for c, _ in pairs:
        by_label.setdefault(c.label or c.source, []).append(c.id)
    copies: dict[str, int] = {}
    for label, ids in by_label.items():
        w = weights.get(label, 1.0)
        if w == 1.0:
            continue
        n = len(ids)
        q, r = divmod(round(w * n), n)

        def rank(i: str) -> str:
            return hashlib.sha256(f"{data_spec.mix_seed}:{label}:{i}".encode("utf-8")).hexdigest()

        extra = set(sorted(ids, key=rank)[:r])
        for i in ids:
            copies[i] = q + (i in extra)
        if log is not None:
            log(f"data: weight {w:g} on {label}: {n} train rows -> {q * n + r}")
    out = []
    for c, regen in pairs:
        for k in range(copies.get(c.id, 1)):
            out.append((c if k == 0 else replace(c, id=f"{c.id}#w{k + 1}"), regen))
    return out


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


def split_conversations(pairs: list[tuple[Conversation, bool]], held_out_spec: HeldOutSpec,
                        dropped_groups=frozenset()
                        ) -> tuple[list[tuple[Conversation, bool]], list[tuple[Conversation, bool]]]:
    """Held-out split BY PROMPT over all sources (a prompt never lands on both sides).

    Args:
        pairs: ``(Conversation, regenerate)`` pairs of :func:`load_data`.
        held_out_spec: the recipe's ``data.held_out`` (``fraction``, ``seed``).
        dropped_groups: :attr:`LoadedData.dropped_groups`: the split is made over every conversation
            loaded, so a row dropped at load moves no other row across it.
    Returns:
        ``(train_pairs, held_out_pairs)``, each pair keeping its ``regenerate`` flag
        (:func:`speculators.data.sources.held_out_split`).
    """
    convs = [c for c, _ in pairs]
    flags = {c.id: r for c, r in pairs}
    train, held = held_out_split(convs, held_out_spec.fraction, held_out_spec.seed, dropped_groups)
    return [(c, flags[c.id]) for c in train], [(c, flags[c.id]) for c in held]


def train_subset(train_pairs: list, fraction: float, seed: int) -> list:
    """``data.train_fraction``: ``round(fraction * n)`` (at least one) of the ``n`` training pairs, drawn with
    ``random.Random(seed)`` and kept in their order; all of them at 1.0. A smaller fraction's subset is a prefix
    of the same seeded permutation, so the sizes of a learning curve are nested."""
    if fraction >= 1.0 or not train_pairs:
        return train_pairs
    import random

    order = list(range(len(train_pairs)))
    random.Random(seed).shuffle(order)
    keep = set(order[:max(1, round(fraction * len(train_pairs)))])
    return [p for i, p in enumerate(train_pairs) if i in keep]


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
        ``[{"id", "source", "messages", "input_ids"}]``: ``source`` is the conversation's source name
        (:attr:`Conversation.source`, for the eval's per-source table); ``input_ids`` is a list of int
        token ids of the rendered prompt with the generation prompt
        (:func:`speculators.data.chat.render_prompt`).
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
        out.append({"id": c.id, "source": c.source, "messages": pm,
                    "input_ids": render_prompt(tokenizer, pm, chat_template)})
    return out


def held_out_prompts(data_spec: DataSpec, tokenizer: Any, loaded_pairs: list[tuple[Conversation, bool]],
                     limit: int | None = None, dropped_groups=frozenset()) -> list[dict]:
    """The held-out prompts of a recipe's data: the ONE definition used by :func:`prepare_data`
    (``PreparedData.eval_prompts``) and by ``speculators eval`` (its default prompts).

    Args:
        data_spec: the recipe's ``data`` section (its ``held_out`` split and ``chat_template``).
        tokenizer: the target's tokenizer.
        loaded_pairs: ``(Conversation, regenerate)`` pairs of :func:`load_data` for ``data_spec``.
        limit: at most this many prompts (None = all).
        dropped_groups: :attr:`LoadedData.dropped_groups` of the same load.
    Returns:
        :func:`unique_prompts` of the held-out side of :func:`split_conversations`, in split order.
    """
    _, held = split_conversations(loaded_pairs, data_spec.held_out, dropped_groups)
    return unique_prompts([c for c, _ in held], tokenizer, data_spec.chat_template, limit=limit)


def _materialise(target, pairs, data_spec: DataSpec, log, progress, server=None) -> list[Conversation]:
    """Regenerate the flagged conversations (per source: pre-tokenized, exactly the ids the target
    produced; through ``server`` when given), keep the others' own assistant text."""
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
                            progress=progress(f"regenerating {source}") if progress else None,
                            max_length=data_spec.max_length, server=server):
            out[c.id] = c
    return [out[c.id] for c, _ in pairs]


def tokenize(target, convs: list[Conversation], data_spec: DataSpec, log=None,
             split: str = "train", drop_counts: Counter | None = None) -> list[TokenizedExample]:
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
        drop_counts: when given, incremented by ``(label or source, reason)`` for every drop.
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
            reason = _drop_reason(target, c, data_spec)
            drops[(c.source, reason)] += 1
            if drop_counts is not None:
                drop_counts[(c.label or c.source, reason)] += 1
    if log is not None:
        for (source, reason), n in sorted(drops.items()):
            log(f"data: dropped {n} {split} conversations of {source}: {reason}")
    return exs


def _drop_reason(target, c: Conversation, data_spec: DataSpec) -> str:
    """Why ``c`` has no loss token within ``data.max_length`` (the reasons of :func:`tokenize`)."""
    if c.input_ids is not None:
        full = list(c.loss_mask)
        # pre-tokenized ids that reach the window's end lost their tail: the answer, or (a prompt that fills
        # the window, not regenerated) the answer that was never generated
        if len(c.input_ids) >= data_spec.max_length:
            return f"whole answer beyond data.max_length={data_spec.max_length}"
    elif not any(m.get("role") == "assistant" for m in c.messages):
        return "no assistant turn"
    else:  # render again without the cut: were there assistant tokens past it?
        _, full = render_with_mask(target.tokenizer, c.messages, data_spec.chat_template)
        if not any(full):
            return "assistant turns render to no tokens"
    if any(full):
        return f"whole answer beyond data.max_length={data_spec.max_length}"
    return "no assistant turn"


def _features(target, examples: list[TokenizedExample], data_spec: DataSpec, log, progress) -> FeatureStore:
    """The :class:`FeatureStore` of ``examples`` for ``data.features``: ``offline`` extracts (or reads) the
    on-disk cache in ``data.feature_dtype`` (:func:`speculators.data.features.extract_features`);
    ``online`` keeps the token ids and masks only (:meth:`FeatureStore.tokens_only`): the frozen target
    computes the features inside each training step."""
    mode = getattr(data_spec, "features", "offline")
    dtype = getattr(data_spec, "feature_dtype", DEFAULT_FEATURE_DTYPE)
    if mode == "online":
        return FeatureStore.tokens_only(examples, dtype)
    if mode != "offline":
        raise SpeculatorsError(f"data.features: {mode!r} is not a feature mode; allowed: ['offline', 'online']")
    return extract_features(target, examples, data_spec.feature_batch_tokens, log=log, progress=progress,
                            dtype=dtype)


def prepare_data(data_spec: DataSpec, target, *, draft_vocab_size: int | None, log=print, progress=None,
                 loaded=None, regen_server=None) -> PreparedData:
    """Run the whole data pipeline of ``data_spec`` (a recipe's ``data`` section) for ``target``
    (all steps cached on disk).

    Sets ``target.chat_template`` to ``data_spec.chat_template`` (its stop tokens follow it). The feature
    stores follow ``data.features``: ``offline`` (cached on disk in ``data.feature_dtype``) or ``online``
    (tokens only, :meth:`speculators.data.features.FeatureStore.tokens_only`).

    Args:
        data_spec: the recipe's ``data`` section.
        target: the loaded :class:`speculators.target.Target`.
        draft_vocab_size: N of the draft vocabulary (the recipe's ``drafter.draft_vocab_size``; None =
            the target's whole vocabulary).
        log: callable for log lines. progress: ``make(description) -> callable(done, total)`` or None.
        loaded: the result of :func:`load_data` when the caller already loaded the sources.
        regen_server: a started :class:`speculators.data.server_regen.RegenerationServer` for
            ``data.regeneration.server.engine`` (None: a ``url`` is talked to directly, no server: our loop).

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
    if loaded is None:
        loaded = load_data(data_spec, log, target=target, progress=progress)
    pairs, identity = loaded
    stats = {k: {**v, "dropped": Counter(v["dropped"])} for k, v in getattr(loaded, "stats", {}).items()}
    if any(s.source == SELF_SOURCE for s in data_spec.sources) and not _has_self_pairs(pairs):
        pairs = list(pairs) + synthesize_self_sources(data_spec, target, stats, log, progress)
    dropped_groups = getattr(loaded, "dropped_groups", frozenset())
    train_pairs, held_pairs = split_conversations(pairs, data_spec.held_out, dropped_groups)
    train_pairs = train_subset(train_pairs, getattr(data_spec, "train_fraction", 1.0), data_spec.held_out.seed)
    log(f"data: {len(pairs)} conversations from {len(data_spec.sources)} source(s): "
        f"{len(train_pairs)} train, {len(held_pairs)} held-out (split by prompt)")
    unweighted = train_pairs
    train_pairs = apply_weights(train_pairs, data_spec, log)
    drop_counts: Counter = Counter()
    server = regeneration_server(getattr(data_spec.regeneration, "server", None), regen_server)
    train_convs = _materialise(target, train_pairs, data_spec, log, progress, server)
    train_ex = tokenize(target, train_convs, data_spec, log=log, split="train", drop_counts=drop_counts)
    if not train_ex:
        raise SpeculatorsError("data: the sources yield zero training examples with assistant tokens")
    if getattr(data_spec, "features", "offline") == "online":
        log(f"data: data.features: online: no feature cache; the frozen target computes the features of "
            f"every batch inside the training step ({getattr(data_spec, 'feature_dtype', DEFAULT_FEATURE_DTYPE)} "
            f"rounding, as the offline cache would store them)")
    train = _features(target, train_ex, data_spec, log, progress("target features") if progress else None)
    held = None
    if held_pairs:
        # the held-out examples are what the drafter is trained on: the target's own answers for the
        # regenerated sources (cached like the train side's), the data's answers for the others
        held_convs = _materialise(target, held_pairs, data_spec, log, progress, server)
        held_ex, seen_ids = [], set()
        held_drops: Counter = Counter()
        label = {c.id: c.label or c.source for c in held_convs}
        for e in tokenize(target, held_convs, data_spec, log=log, split="held-out", drop_counts=held_drops):
            if tuple(e.input_ids) in seen_ids:  # one sequence listed twice (e.g. a prompt in two sources)
                held_drops[(label[e.id], "duplicate of another held-out example")] += 1
                continue
            seen_ids.add(tuple(e.input_ids))
            held_ex.append(e)
        if held_ex:
            held = _features(target, held_ex, data_spec, log, None)
        drop_counts.update({(lab, f"held-out: {why}"): n for (lab, why), n in held_drops.items()})
    eval_prompts = held_out_prompts(data_spec, target.tokenizer, pairs,  # for generation: one per prompt
                                    dropped_groups=dropped_groups)
    counts = torch.bincount(train.input_ids[train.loss_mask], minlength=target.vocab_size)[:target.vocab_size]
    vocab = DraftVocab.from_counts(counts, draft_vocab_size)
    covered = float(counts[vocab.t2d].sum() / counts.sum().clamp(min=1))
    report = data_report(data_spec, stats, unweighted, train_pairs, held_pairs, train_convs, train_ex, drop_counts)
    for line in report_lines(report):
        log(line)
    log(f"data: {train.num_tokens} train tokens ({train.num_loss_tokens} assistant), draft vocab "
        f"{vocab.size} covering {covered:.1%} of assistant tokens, {len(eval_prompts)} held-out prompts")
    producer = None if not any(r for _, r in pairs) else server.identity(target, log) if server else PYTORCH_PRODUCER
    return PreparedData(train, held, eval_prompts, vocab, counts, identity, report, producer)


def data_report(data_spec: DataSpec, stats: dict, train_pairs, weighted_pairs, held_pairs,
                train_convs: list[Conversation], train_ex: list[TokenizedExample], drop_counts: Counter
                ) -> dict[str, dict]:
    """What each recipe source contributed to the training set, and what was dropped, by filter.

    Args:
        stats: :attr:`LoadedData.stats` (conversations loaded, load-time and self-synthesis drops).
        train_pairs / weighted_pairs: the train side before / after :func:`apply_weights`.
        held_pairs: the held-out side. train_convs: the (regenerated) training conversations.
        train_ex: the tokenized training examples. drop_counts: ``(label, reason) -> rows`` of
            :func:`tokenize` (held-out drops prefixed ``held-out: ``).
    Returns:
        ``{label: {"weight", "conversations", "held_out_rows", "train_rows", "train_rows_weighted",
        "train_examples", "train_tokens", "train_loss_tokens", "dropped": {reason: rows}}}`` in the
        order of ``data.sources`` (tokens count every token of the kept examples after
        ``data.max_length``; loss tokens the assistant tokens among them).
    """
    def lab(c: Conversation) -> str:
        return c.label or c.source

    labels = source_labels(data_spec)
    rep = {}
    for label, spec in zip(labels, data_spec.sources):
        st = stats.get(label, {})
        rep[label] = {"weight": float(spec.weight), "conversations": int(st.get("conversations", 0)),
                      "held_out_rows": 0, "train_rows": 0, "train_rows_weighted": 0, "train_examples": 0,
                      "train_tokens": 0, "train_loss_tokens": 0, "dropped": dict(Counter(st.get("dropped", {})))}
        if "sampled" in st:
            rep[label]["sampled"] = int(st["sampled"])

    def row(label: str) -> dict:
        return rep.setdefault(label, {"weight": 1.0, "conversations": 0, "held_out_rows": 0, "train_rows": 0,
                                      "train_rows_weighted": 0, "train_examples": 0, "train_tokens": 0,
                                      "train_loss_tokens": 0, "dropped": {}})

    for key, group in (("train_rows", train_pairs), ("train_rows_weighted", weighted_pairs),
                       ("held_out_rows", held_pairs)):
        for c, _ in group:
            row(lab(c))[key] += 1
    label_of = {c.id: lab(c) for c in train_convs}
    for e in train_ex:
        r = row(label_of.get(e.id, "?"))
        r["train_examples"] += 1
        r["train_tokens"] += len(e.input_ids)
        r["train_loss_tokens"] += int(sum(e.loss_mask))
    for (label, why), n in drop_counts.items():
        d = row(label)["dropped"]
        d[why] = d.get(why, 0) + n
    return rep


def report_lines(report: dict[str, dict]) -> list[str]:
    """One log line per source of :func:`data_report`:
    ``data: source LABEL: N conversations (N held out), weight W -> N train rows, N examples, N tokens
    (N assistant, P% of all); dropped: REASON: N, ...``."""
    total = sum(r["train_tokens"] for r in report.values()) or 1
    out = []
    for label, r in report.items():
        drops = ", ".join(f"{k}: {v}" for k, v in sorted(r["dropped"].items(), key=lambda kv: -kv[1])) or "none"
        sampled = f" of {r['sampled']} sampled" if "sampled" in r else ""
        out.append(f"data: source {label}: {r['conversations']} conversations{sampled} ({r['held_out_rows']} held "
                   f"out), weight {r['weight']:g} -> {r['train_rows_weighted']} train rows, {r['train_examples']} "
                   f"examples, {r['train_tokens']} tokens ({r['train_loss_tokens']} assistant, "
                   f"{r['train_tokens'] / total:.1%} of all); dropped: {drops}")
    return out


def report_markdown(report: dict[str, dict]) -> list[str]:
    """The run card's data section (markdown lines) of :func:`data_report`: one table row per source
    (rows, weight, tokens) and one row per (source, filter) that dropped something."""
    if not report:
        return []
    total = sum(r["train_tokens"] for r in report.values()) or 1
    lines = ["## Training data", "",
             "| source | conversations | held out | weight | train rows | train tokens | assistant tokens | share |",
             "|---|---|---|---|---|---|---|---|"]
    for label, r in report.items():
        lines.append(f"| `{label}` | {r['conversations']} | {r['held_out_rows']} | {r['weight']:g} | "
                     f"{r['train_rows_weighted']} | {r['train_tokens']} | {r['train_loss_tokens']} | "
                     f"{r['train_tokens'] / total:.1%} |")
    drops = [(label, why, n) for label, r in report.items() for why, n in sorted(r["dropped"].items())]
    lines.append("")
    if drops:
        lines += ["| source | dropped by | rows |", "|---|---|---|"]
        lines += [f"| `{label}` | {why} | {n} |" for label, why, n in drops]
    else:
        lines.append("No row was dropped by a filter.")
    return lines + [""]


def counter_summary(c: Counter) -> str:
    return ", ".join(f"{k}: {v}" for k, v in c.most_common())
