"""``source: self``: the target writes its own prompts (Magpie-style self-synthesis).

Following Magpie (Xu et al. 2024, "Magpie: Alignment Data Synthesis from Scratch by Prompting Aligned
LLMs with Nothing"): the target's chat template is rendered up to the point where a user message's
content starts (after an optional system prompt), and the target samples the user message itself,
token by token, until it ends the turn. The sampled messages are filtered (:class:`PromptFilter`) and
the kept ones become prompt-only conversations whose answers the data pipeline regenerates like any
other source's, so the data is on-policy on both sides and needs nothing but the target.

Steering (optional): ``system_prompts`` are real system prompts, kept in the conversation (the answer
is regenerated under them); ``topics`` steer only the sampling of the user message: the line
``topic_prompt.format(topic=...)`` is appended to the system prompt the target sees while it writes the
user message, and is not part of the conversation that gets answered. For sample ``j`` the system
prompt and topic are drawn by ``random.Random(f"{seed}:{j}")``.

Determinism and caching: batch ``b`` holds samples ``b*batch_size .. (b+1)*batch_size - 1`` and is
sampled with a ``torch.Generator`` on the target's device seeded from ``(seed, b)``, so a batch's
samples depend on nothing but the target, the settings, the seed, ``b`` (and the device type: CPU and
CUDA generators draw different streams). Raw samples (token ids and the stop id) are appended
to a JSONL cache, one line per batch, flushed after each batch, keyed by (format, target fingerprint,
chat template, stop ids, sampling settings, steering seeds, seed): an interrupted run resumes at the
first missing batch, a second run generates nothing, and changing only the filter thresholds or
``num_prompts`` re-filters cached samples (more batches are sampled only when more are needed).
"""

from __future__ import annotations

import json
import random
import re
import time
import unicodedata
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from ..utils import cache_root, open_jsonl_append, read_jsonl_records, stable_hash
from .chat import ChatError, KNOWN_END_MARKERS, end_markers, render_text
from .sources import Conversation, SourceError

__all__ = [
    "SELF_SOURCE",
    "SYNTH_FORMAT",
    "DROP_REASONS",
    "SynthSettings",
    "SynthResult",
    "UserTurnTemplate",
    "PromptFilter",
    "normalize_prompt",
    "user_turn_template",
    "synthesis_cache_file",
    "synthesis_identity",
    "synthesize_prompts",
]

SELF_SOURCE = "self"
SYNTH_FORMAT = 1  # version of the cache records: {"batch": b, "samples": [{"ids": [...], "stop": id | null}]}
_SENTINEL = "\ue000speculators-user-turn\ue001"

#: Filter reasons, in the order they are checked (a sample is counted under the first that applies).
DROP_REASONS = (
    "cut off (no end-of-turn within max_prompt_tokens)",
    "template markers or special tokens",
    "too short (< min_chars)",
    "too long (> max_chars)",
    "non-printable characters (< min_printable_ratio)",
    "too few letters (< min_letter_ratio)",
    "non-ASCII text (< min_ascii_ratio)",
    "copies the system prompt",
    "duplicate",
)
CUT, MARKERS, SHORT, LONG, UNPRINTABLE, LETTERS, ASCII, COPY, DUPLICATE = DROP_REASONS

# The sampling settings that make up the cache key (filters and num_prompts are applied to cached samples).
_SAMPLING_KEYS = ("seed", "temperature", "top_p", "max_prompt_tokens", "batch_size", "system_prompts",
                  "topics", "topic_prompt")


@dataclass
class SynthSettings:
    """The settings of a ``source: self`` entry (the recipe's ``data.sources[i].synth``; any object with
    these attributes works, e.g. :class:`speculators.recipe.SelfSynthSpec`).

    Attributes:
        num_prompts: prompts kept after filtering (fewer when ``max_samples`` runs out first).
        seed: sampling seed.
        temperature, top_p: sampling of the user message (vLLM semantics, ``temperature > 0``).
        max_prompt_tokens: cap on a user message's tokens; a message that reaches it without ending
            its turn is dropped (cut off).
        batch_size: user messages sampled per ``Target.generate_batch`` call.
        max_samples: cap on sampled messages (None = ``4 * num_prompts``, at least one batch).
        system_prompts: system prompts to draw from (kept in the conversation); empty = none (the
            template's default, if it has one).
        topics: topics to draw from (steer the sampling only; see the module docstring).
        topic_prompt: the steering line, with ``{topic}``.
        min_chars, max_chars: length bounds of the stripped message, in characters.
        min_printable_ratio: printable characters / characters (whitespace counts as printable).
        min_letter_ratio: letters (Unicode category L*) / non-whitespace characters.
        min_ascii_ratio: ASCII characters / characters (0 = any script).
        max_copy_overlap: a message whose word set overlaps the system prompt's by at least this
            Jaccard similarity (or that is contained in it, or contains it) copies it.
    """

    num_prompts: int = 256
    seed: int = 0
    temperature: float = 1.0
    top_p: float = 1.0
    max_prompt_tokens: int = 128
    batch_size: int = 16
    max_samples: int | None = None
    system_prompts: list[str] = field(default_factory=list)
    topics: list[str] = field(default_factory=list)
    topic_prompt: str = "The user's next message is about {topic}."
    min_chars: int = 8
    max_chars: int = 2000
    min_printable_ratio: float = 0.98
    min_letter_ratio: float = 0.4
    min_ascii_ratio: float = 0.0
    max_copy_overlap: float = 0.8


@dataclass
class SynthResult:
    """What :func:`synthesize_prompts` produced.

    Attributes:
        conversations: prompt-only conversations ``[system?, user]`` of the kept messages, in sample order.
        drops: ``{reason: count}`` over :data:`DROP_REASONS` (only reasons that dropped something).
        samples: user messages looked at (cached or new). generated: of those, sampled in this call.
        cache_file: the JSONL cache.
    """

    conversations: list[Conversation]
    drops: Counter
    samples: int
    generated: int
    cache_file: Path


def _as_settings(settings: Any) -> SynthSettings:
    """Any settings object (pydantic spec, dict, :class:`SynthSettings`, None) -> :class:`SynthSettings`."""
    if settings is None:
        settings = SynthSettings()
    if isinstance(settings, SynthSettings):
        s = settings
    else:
        base = SynthSettings()
        out = {}
        for k in base.__dataclass_fields__:
            default = getattr(base, k)
            v = settings.get(k, default) if isinstance(settings, dict) else getattr(settings, k, default)
            out[k] = list(v) if isinstance(v, (list, tuple)) else v
        s = SynthSettings(**out)
    for name in ("num_prompts", "batch_size", "max_prompt_tokens"):
        if not isinstance(getattr(s, name), int) or getattr(s, name) < 1:
            raise SourceError(f"source self: synth.{name} must be a positive integer, got {getattr(s, name)!r}")
    if s.temperature <= 0:
        raise SourceError(f"source self: synth.temperature must be > 0 (the user messages are sampled), "
                          f"got {s.temperature}")
    if s.topics and "{topic}" not in s.topic_prompt:
        raise SourceError(f"source self: synth.topic_prompt must contain '{{topic}}', got {s.topic_prompt!r}")
    return s


def normalize_prompt(text: str) -> str:
    """The deduplication key of a prompt: NFKC, lower case, runs of non-word characters -> one space."""
    return re.sub(r"[\W_]+", " ", unicodedata.normalize("NFKC", text).lower()).strip()


# --------------------------------------------------------------------------------------------
# the template up to a user turn


@dataclass
class UserTurnTemplate:
    """How the chat template opens a user turn, for one system prompt.

    Attributes:
        prefix: the rendered text up to where the user message's content starts (template's BOS,
            system turn, user header).
        prefix_ids: its token ids (list of int), what the target continues.
        markers: strings that must never appear in a user message: the tokenizer's special tokens,
            the known end-of-turn markers and the template's own role headers (e.g. ``User:`` of a
            plain-text template).
        stop_ids: ids that end the sampled message (the target's stop ids plus the token that ends a
            user turn in this template, when it is a single token).
    """

    prefix: str
    prefix_ids: list[int]
    markers: list[str]
    stop_ids: list[int]


def _special_strings(tok) -> set[str]:
    out = set(getattr(tok, "all_special_tokens", []) or [])
    try:
        out |= {str(t) for t in tok.added_tokens_decoder.values() if getattr(t, "special", False)}
    except Exception:  # noqa: BLE001 - slow tokenizers without added_tokens_decoder
        pass
    return {s for s in out if s}


def user_turn_template(target, system: str | None, chat_template: str | None = None) -> UserTurnTemplate:
    """Render the template up to the start of a user message (after ``system`` when given).

    Args:
        target: anything with ``tokenizer`` and ``stop_ids_for(chat_template)``.
        system: the system prompt the target sees, or None (the template's default, if any).
        chat_template: the recipe's ``data.chat_template`` (None = the tokenizer's).
    Raises:
        ChatError (a ValueError): no chat template, or one that does not emit the user content verbatim.
    """
    tok = target.tokenizer
    msgs = ([{"role": "system", "content": system}] if system else []) + [{"role": "user", "content": _SENTINEL}]
    text = render_text(tok, msgs, chat_template)
    at = text.find(_SENTINEL)
    if at < 0:
        raise ChatError("source self: the chat template does not emit the user message verbatim, so the "
                        "point where a user turn starts cannot be found")
    prefix, after = text[:at], text[at + len(_SENTINEL):]
    with_gen = render_text(tok, msgs, chat_template, add_generation_prompt=True)
    gen = with_gen[len(text):] if with_gen.startswith(text) else ""
    markers = _special_strings(tok) | set(KNOWN_END_MARKERS)
    header = prefix.rstrip().rsplit("\n", 1)[-1].strip()  # e.g. "<|im_start|>user" or "User:"
    for h in (header, gen.strip().rsplit("\n", 1)[-1].strip()):
        if len(h) >= 2:
            markers.add(h)
    stops = set(target.stop_ids_for(chat_template))
    rest = after.lstrip()
    for mk in end_markers(tok):
        if rest.startswith(mk):
            ids = tok(mk, add_special_tokens=False)["input_ids"]
            if len(ids) == 1:
                stops.add(int(ids[0]))
            break
    ids = list(tok(prefix, add_special_tokens=False)["input_ids"])
    if not ids:
        raise ChatError("source self: the chat template renders nothing before a user message")
    return UserTurnTemplate(prefix, ids, sorted(markers, key=lambda s: (-len(s), s)), sorted(stops))


# --------------------------------------------------------------------------------------------
# filters


class PromptFilter:
    """The filters of sampled user messages, with the deduplication state.

    ``reason(...)`` returns the first reason of :data:`DROP_REASONS` that applies, or None (kept, and
    remembered for deduplication).

    Args:
        settings: :class:`SynthSettings` (or any object with its attributes).
        special_ids: token ids that may never appear in a message (the tokenizer's special ids).
    """

    def __init__(self, settings: Any, special_ids: set[int] | None = None):
        self.s = _as_settings(settings)
        self.special_ids = set(special_ids or ())
        self.seen: set[str] = set()

    @staticmethod
    def _words(text: str) -> set[str]:
        return set(normalize_prompt(text).split())

    def copies(self, text: str, system_text: str) -> bool:
        """True when ``text`` copies ``system_text`` (contained in it, containing it, or a word-set
        Jaccard similarity >= ``max_copy_overlap``)."""
        a, b = normalize_prompt(text), normalize_prompt(system_text)
        if not a or not b:
            return False
        if a in b or b in a:
            return True
        wa, wb = set(a.split()), set(b.split())
        return len(wa & wb) / max(len(wa | wb), 1) >= self.s.max_copy_overlap

    def reason(self, text: str, ids: list[int], stop: int | None, markers: list[str],
               system_text: str = "") -> str | None:
        """Why the sampled message must be dropped, or None to keep it.

        Args:
            text: the decoded message (special tokens not skipped).
            ids: its token ids (without the stop id). stop: the stop id, or None when it was cut.
            markers: :attr:`UserTurnTemplate.markers`.
            system_text: what the target saw before the user turn, as text (the system prompt and
                steering line, or the template's default system prompt inside the rendered prefix).
        """
        s = self.s
        if stop is None:
            return CUT
        if any(i in self.special_ids for i in ids) or any(m in text for m in markers):
            return MARKERS
        t = text.strip()
        if len(t) < s.min_chars:
            return SHORT
        if len(t) > s.max_chars:
            return LONG
        n = len(t)
        if sum(c.isprintable() or c.isspace() for c in t) / n < s.min_printable_ratio:
            return UNPRINTABLE
        visible = [c for c in t if not c.isspace()]
        if sum(unicodedata.category(c).startswith("L") for c in visible) / max(len(visible), 1) < s.min_letter_ratio:
            return LETTERS
        if s.min_ascii_ratio > 0 and sum(c.isascii() for c in t) / n < s.min_ascii_ratio:
            return ASCII
        if system_text and self.copies(t, system_text):
            return COPY
        key = normalize_prompt(t)
        if key in self.seen:
            return DUPLICATE
        self.seen.add(key)
        return None


# --------------------------------------------------------------------------------------------
# synthesis


def _sampling_settings(s: SynthSettings) -> dict:
    return {k: getattr(s, k) for k in _SAMPLING_KEYS}


def synthesis_identity(settings: Any) -> str:
    """Identity of a ``source: self`` entry for ``--resume`` (before the target is loaded): the hash of
    all its settings. Its prompts are a function of these and of the target, whose fingerprint the run
    records separately."""
    s = _as_settings(settings)
    return "settings:" + stable_hash({"format": SYNTH_FORMAT, **s.__dict__})


def synthesis_cache_file(target, settings: Any, chat_template: str | None, stop_ids: list[int]) -> Path:
    """JSONL cache of one self-synthesis run: keyed by the format, the target's fingerprint (and compute dtype:
    :attr:`speculators.target.Target.cache_identity`), the chat
    template, the stop ids and the sampling settings (not the filters nor ``num_prompts``)."""
    s = _as_settings(settings)
    key = stable_hash({"format": SYNTH_FORMAT, "target": target.cache_identity, "template": chat_template,
                       "stops": list(stop_ids), "sampling": _sampling_settings(s)})
    return cache_root() / "selfsynth" / f"self-{key}.jsonl"


def _batch_generator(seed: int, b: int, device: torch.device | str = "cpu") -> torch.Generator:
    """The sampling RNG of batch ``b``, on the target's device (``torch.multinomial`` needs them to match)."""
    return torch.Generator(device=device).manual_seed(int(stable_hash({"seed": seed, "batch": b}), 16) % (2 ** 63))


def _steering(s: SynthSettings, j: int) -> tuple[str | None, str | None]:
    """(system prompt kept in the conversation, topic) of sample ``j``."""
    rng = random.Random(f"{s.seed}:{j}")
    system = s.system_prompts[rng.randrange(len(s.system_prompts))] if s.system_prompts else None
    topic = s.topics[rng.randrange(len(s.topics))] if s.topics else None
    return system, topic


def _read_cache(path: Path) -> dict[int, list[dict]]:
    return {rec["batch"]: rec["samples"] for rec in read_jsonl_records(path)
            if isinstance(rec.get("batch"), int) and isinstance(rec.get("samples"), list)}


@torch.no_grad()
def synthesize_prompts(target, settings: Any = None, *, chat_template: str | None = None, log=print,
                       progress=None) -> SynthResult:
    """Let the target write ``settings.num_prompts`` user messages (Magpie), filtered and deduplicated.

    Args:
        target: :class:`speculators.target.Target` with a tokenizer (its ``generate_batch`` samples).
        settings: :class:`SynthSettings` or the recipe's ``synth`` section (None = defaults).
        chat_template: the recipe's ``data.chat_template`` (None = the tokenizer's).
        log: callable for log lines. progress: optional ``(kept, num_prompts)`` callable.
    Returns:
        :class:`SynthResult`: conversations ``[{"role": "system", ...}?, {"role": "user", "content":
        message}]`` with ids ``self:<cache key>/<sample index>`` and source ``"self"``, in sample
        order; at most ``num_prompts`` of them.
    Raises:
        SourceError: bad settings (temperature 0, a topic prompt without ``{topic}``), or every
            sampled message was dropped.
        ChatError: no chat template, or one that does not emit user contents verbatim.
    """
    s = _as_settings(settings)
    tok = target.tokenizer
    if tok is None:
        raise SourceError("source self: the target has no tokenizer")
    systems = [None] + list(dict.fromkeys(s.system_prompts))
    topics = [None] + list(dict.fromkeys(s.topics))
    templates: dict[tuple, UserTurnTemplate] = {}

    def template_for(system: str | None, topic: str | None) -> tuple[UserTurnTemplate, str]:
        seen_by_target = "\n".join(x for x in (system, s.topic_prompt.format(topic=topic) if topic else None) if x)
        k = (system, topic)
        if k not in templates:
            templates[k] = user_turn_template(target, seen_by_target or None, chat_template)
        return templates[k], seen_by_target

    base, _ = template_for(systems[1] if len(systems) > 1 else None, topics[1] if len(topics) > 1 else None)
    stops = base.stop_ids
    path = synthesis_cache_file(target, s, chat_template, stops)
    cached = _read_cache(path)
    specials = {int(i) for i in (getattr(tok, "all_special_ids", []) or [])} - set(stops)
    filt = PromptFilter(s, specials)
    pad = tok.pad_token_id if tok.pad_token_id is not None else stops[0] if stops else 0
    max_samples = s.max_samples if s.max_samples is not None else max(4 * s.num_prompts, s.batch_size)
    key8 = path.stem[-8:]
    kept: list[Conversation] = []
    drops: Counter = Counter()
    n_samples = n_generated = 0
    t0 = time.time()
    fh = None
    try:
        b = 0
        while len(kept) < s.num_prompts and n_samples < max_samples:
            js = list(range(b * s.batch_size, (b + 1) * s.batch_size))
            steer = [_steering(s, j) for j in js]
            tpls = [template_for(system, topic) for system, topic in steer]
            samples = cached.get(b)
            if samples is None or len(samples) != len(js):
                outs = target.generate_batch([t.prefix_ids for t, _ in tpls], s.max_prompt_tokens, stops,
                                             s.temperature, s.top_p, generator=_batch_generator(s.seed, b, target.device),
                                             pad_token_id=pad)
                samples = [{"ids": [int(t) for t in o.ids], "stop": None if o.stop is None else int(o.stop)}
                           for o in outs]
                if fh is None:
                    fh = open_jsonl_append(path)
                fh.write(json.dumps({"batch": b, "samples": samples}) + "\n")
                fh.flush()
                n_generated += len(samples)
            for j, (system, _topic), (tpl, seen_text), rec in zip(js, steer, tpls, samples):
                if len(kept) >= s.num_prompts or n_samples >= max_samples:
                    break
                n_samples += 1
                text = tok.decode(rec["ids"], skip_special_tokens=False)
                why = filt.reason(text, rec["ids"], rec["stop"], tpl.markers, seen_text or tpl.prefix)
                if why is not None:
                    drops[why] += 1
                    continue
                msgs = ([{"role": "system", "content": system}] if system else []) + \
                       [{"role": "user", "content": text.strip()}]
                kept.append(Conversation(id=f"{SELF_SOURCE}:{key8}/{j}", source=SELF_SOURCE, messages=msgs))
            if progress:
                progress(len(kept), s.num_prompts)
            b += 1
    finally:
        if fh is not None:
            fh.close()
    dt = time.time() - t0
    how = f"{n_generated} sampled in {dt:.1f}s" if n_generated else "all from the cache"
    why = ", ".join(f"{r}: {n}" for r, n in drops.most_common()) or "none"
    log(f"self-synthesis: kept {len(kept)} of {n_samples} user messages written by the target ({how}; "
        f"{path}); dropped: {why}")
    if not kept:
        raise SourceError(f"source self: all {n_samples} user messages the target wrote were dropped by the "
                          f"filters ({why}); raise synth.max_prompt_tokens / max_samples or loosen the filters")
    if len(kept) < s.num_prompts:
        log(f"self-synthesis: only {len(kept)} of synth.num_prompts={s.num_prompts} prompts kept after "
            f"synth.max_samples={max_samples} samples")
    return SynthResult(kept, drops, n_samples, n_generated, path)
