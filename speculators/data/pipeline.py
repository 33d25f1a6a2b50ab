"""The data pipeline of a recipe: sources -> split -> regeneration -> rendering -> features -> draft vocab.

Everything expensive is cached on disk (regenerations, features), so a second run of the same
recipe starts training within seconds of loading the target.
"""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass, replace

import torch

from ..drafters.base import DraftVocab
from ..errors import SpeculatorsError
from .chat import prompt_messages, render_prompt, render_with_mask
from .features import FeatureStore, TokenizedExample, extract_features
from .regenerate import regenerate
from .sources import Conversation, held_out_split, load_source


@dataclass
class PreparedData:
    """Output of :func:`prepare_data`.

    Attributes:
        train: features of the training conversations.
        held_out: features of the held-out conversations (same prompts never in ``train``), or None.
        eval_prompts: held-out prompts as token ids (with the generation prompt), for ``speculators eval``.
        vocab: draft vocabulary built from assistant-token frequencies of ``train``.
        token_counts: ``[V]`` int64 assistant-token frequencies.
    """

    train: FeatureStore
    held_out: FeatureStore | None
    eval_prompts: list[dict]
    vocab: DraftVocab
    token_counts: torch.Tensor


def load_conversations(recipe) -> list[tuple[Conversation, bool]]:
    """All source conversations with their ``regenerate`` flag (ids suffixed by mode so that one
    source may be listed twice, once regenerated and once off-policy)."""
    out = []
    for s in recipe.data.sources:
        regen = recipe.data.regenerate if s.regenerate is None else s.regenerate
        try:
            convs = load_source(s.source, max_examples=s.max_examples)
        except SpeculatorsError:
            raise
        except ValueError as e:
            raise SpeculatorsError(str(e)) from None
        tag = "regen" if regen else "orig"
        out.extend((replace(c, id=f"{c.id}#{tag}"), regen) for c in convs)
    return out


def split_conversations(pairs, recipe):
    """Held-out split BY PROMPT over all sources (a prompt never lands on both sides)."""
    convs = [c for c, _ in pairs]
    flags = {c.id: r for c, r in pairs}
    train, held = held_out_split(convs, recipe.data.held_out.fraction, recipe.data.held_out.seed)
    return [(c, flags[c.id]) for c in train], [(c, flags[c.id]) for c in held]


def _materialise(target, pairs, recipe, log, progress) -> list[Conversation]:
    """Regenerate the flagged conversations (per source), keep the others' own assistant text."""
    spec = recipe.data.regeneration
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
                            spec.batch_size, spec.seed, recipe.data.chat_template, log=log,
                            progress=progress(f"regenerating {source}") if progress else None):
            out[c.id] = c
    return [out[c.id] for c, _ in pairs]


def tokenize(target, convs: list[Conversation], recipe) -> list[TokenizedExample]:
    """Render with the chat template and the assistant-only loss mask; drop examples with no loss tokens."""
    exs = []
    for c in convs:
        ids, mask = render_with_mask(target.tokenizer, c.messages, recipe.data.chat_template,
                                     max_length=recipe.data.max_length)
        if sum(mask) > 0:
            exs.append(TokenizedExample(c.id, ids, mask))
    return exs


def prepare_data(recipe, target, log=print, progress=None) -> PreparedData:
    """Run the whole data pipeline of ``recipe`` for ``target`` (all steps cached on disk).

    Raises:
        SpeculatorsError: no chat template, a source with zero examples, or no trainable tokens.
    """
    if target.tokenizer is None:
        raise SpeculatorsError("target has no tokenizer")
    if recipe.data.chat_template is None and not getattr(target.tokenizer, "chat_template", None):
        raise SpeculatorsError(
            f"target {target.name_or_path!r} has no chat template; set data.chat_template in the recipe")
    pairs = load_conversations(recipe)
    train_pairs, held_pairs = split_conversations(pairs, recipe)
    log(f"data: {len(pairs)} conversations from {len(recipe.data.sources)} source(s): "
        f"{len(train_pairs)} train, {len(held_pairs)} held-out (split by prompt)")
    train_convs = _materialise(target, train_pairs, recipe, log, progress)
    train_ex = tokenize(target, train_convs, recipe)
    if not train_ex:
        raise SpeculatorsError("data: the sources yield zero training examples with assistant tokens")
    fb = recipe.data.feature_batch_tokens
    train = extract_features(target, train_ex, fb, log=log,
                             progress=progress("target features") if progress else None)
    held = None
    held_convs = [c for c, _ in held_pairs]
    held_with_answers = [c for c in held_convs if c.messages and c.messages[-1]["role"] == "assistant"]
    if held_with_answers:
        held_ex, seen_ids = [], set()
        for e in tokenize(target, held_with_answers, recipe):  # a prompt listed by two sources: once
            if tuple(e.input_ids) not in seen_ids:
                seen_ids.add(tuple(e.input_ids))
                held_ex.append(e)
        if held_ex:
            held = extract_features(target, held_ex, fb, log=log)
    # held-out prompts for generation: one per distinct prompt
    seen, eval_prompts = set(), []
    for c in held_convs:
        pm = prompt_messages(c.messages)
        key = repr(pm)
        if key in seen:
            continue
        seen.add(key)
        eval_prompts.append({"id": c.id, "messages": pm,
                             "input_ids": render_prompt(target.tokenizer, pm, recipe.data.chat_template)})
    counts = torch.bincount(train.input_ids[train.loss_mask], minlength=target.vocab_size)[:target.vocab_size]
    vocab = DraftVocab.from_counts(counts, recipe.drafter_config().draft_vocab_size)
    covered = float(counts[vocab.t2d].sum() / counts.sum().clamp(min=1))
    log(f"data: {train.num_tokens} train tokens ({train.num_loss_tokens} assistant), draft vocab "
        f"{vocab.size} covering {covered:.1%} of assistant tokens, {len(eval_prompts)} held-out prompts")
    return PreparedData(train, held, eval_prompts, vocab, counts)


def counter_summary(c: Counter) -> str:
    return ", ".join(f"{k}: {v}" for k, v in c.most_common())
