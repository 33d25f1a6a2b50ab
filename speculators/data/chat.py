"""Chat rendering with the target's chat template, and the assistant loss mask.

The loss mask marks exactly the tokens of each assistant turn's content plus the end-of-turn marker
the template emits right after it (``<|im_end|>`` for ChatML, ``<|eot_id|>`` for Llama 3, ``</s>``
for Zephyr, ...): the tokens the target generates, which are what a drafter learns to propose.
Nothing from system/user turns or from role headers is marked.

It works for any Jinja chat template that emits message contents verbatim (or ``trim``-ed):

1. render the whole conversation to a string (``apply_chat_template(tokenize=False)``);
2. locate the character span of every assistant content: render once more with each assistant content
   replaced by a unique sentinel and check that putting the contents back gives the same string
   (exact spans), else search forward turn by turn from where the rendered prefix / generation prompt
   ends;
3. tokenize the string once with offsets (fast tokenizer, ``add_special_tokens=False`` because
   templates write their own BOS), in segments cut where each turn's generation prompt ends, so the
   prompt part tokenizes exactly as :func:`render_prompt` does at inference (e.g. Llama 3's
   ``"\\n\\n"`` before ``"def"``); a token straddling a content or marker end is re-tokenized in two
   pieces (e.g. ChatML's ``"\\n"`` + content starting with spaces would merge into ``"\\n   "``);
4. mark tokens overlapping an assistant content span, plus those up to the end of the end-of-turn
   marker directly following it (only whitespace may sit between content and marker).
"""

from __future__ import annotations

import re
from typing import Any

from ..errors import SpeculatorsError

__all__ = [
    "prompt_messages",
    "render_text",
    "render_prompt",
    "render_with_mask",
    "assistant_spans",
    "end_markers",
]

# End-of-turn strings of common templates, matched textually after assistant content.
KNOWN_END_MARKERS = (
    "<|im_end|>",
    "<|eot_id|>",
    "<|end|>",
    "<end_of_turn>",
    "</s>",
    "<|endoftext|>",
    "<|end_of_text|>",
    "<|END_OF_TURN_TOKEN|>",
    "<｜end▁of▁sentence｜>",
    "<|return|>",
    "<|eom_id|>",
    "<|end_of_turn|>",
)
_SENTINEL = "\ue000speculators-assistant-{}\ue001"



class ChatError(SpeculatorsError, ValueError):
    """A conversation cannot be rendered: bad messages, no chat template, or a template that does not
    emit the assistant text verbatim (the CLI prints it as one ``error:`` line)."""


def _check_messages(messages: Any) -> list[dict]:
    if not isinstance(messages, (list, tuple)) or not messages:
        raise ChatError("messages must be a non-empty list of {'role', 'content'} dicts")
    out = []
    for i, m in enumerate(messages):
        if not isinstance(m, dict) or "role" not in m:
            raise ChatError(f"message {i} must be a dict with 'role' and 'content', got {m!r}")
        c = m.get("content")
        if c is None:
            c = ""
        if not isinstance(c, str):
            raise ChatError(f"message {i} content must be a string, got {type(c).__name__}")
        out.append({**m, "content": c})
    return out


def prompt_messages(messages: list[dict]) -> list[dict]:
    """The messages the target regenerates from: the conversation without its final assistant turn.

    ``[sys, user, assistant]`` -> ``[sys, user]``; ``[user, assistant, user, assistant]`` ->
    ``[user, assistant, user]``; a conversation that already ends with a user turn is returned whole.
    Returns a new list (the message dicts are shared).
    """
    msgs = list(messages)
    while msgs and msgs[-1].get("role") == "assistant":
        msgs.pop()
    return msgs


def _template_or_raise(tokenizer: Any, chat_template: str | None) -> str | None:
    if chat_template is None and not getattr(tokenizer, "chat_template", None):
        raise ChatError(
            "the target's tokenizer has no chat template; the recipe must supply `data.chat_template` "
            "(a Jinja chat template string)"
        )
    return chat_template


def render_text(tokenizer: Any, messages: list[dict], chat_template: str | None = None, *,
                add_generation_prompt: bool = False) -> str:
    """Render messages to a string with the tokenizer's (or the given) chat template.

    Raises:
        ValueError: no chat template (the tokenizer has none and ``chat_template`` is None).
    """
    tpl = _template_or_raise(tokenizer, chat_template)
    kwargs = {"chat_template": tpl} if tpl is not None else {}
    text = tokenizer.apply_chat_template(
        list(messages), tokenize=False, add_generation_prompt=add_generation_prompt, **kwargs
    )
    if not isinstance(text, str):  # some versions return a list for batched input
        text = text[0]
    return text


def _encode(tokenizer: Any, text: str) -> list[int]:
    return list(tokenizer(text, add_special_tokens=False)["input_ids"])


def render_prompt(tokenizer: Any, messages: list[dict], chat_template: str | None = None) -> list[int]:
    """Token ids of the prompt, with the template's generation prompt appended.

    ``messages`` may be a whole conversation: its final assistant turn is dropped first
    (:func:`prompt_messages`). The ids equal the first ids of :func:`render_with_mask` for a
    single-turn conversation.

    Returns:
        list[int] of token ids (no extra special tokens beyond what the template writes).

    Raises:
        ValueError: no chat template, or the prompt is empty.
    """
    msgs = prompt_messages(_check_messages(messages))
    if not msgs:
        raise ChatError("the prompt is empty: the conversation has no message before its assistant turn")
    return _encode(tokenizer, render_text(tokenizer, msgs, chat_template, add_generation_prompt=True))


def end_markers(tokenizer: Any) -> list[str]:
    """End-of-turn strings to include in the loss mask after assistant content, longest first.

    The tokenizer's eos token, its special tokens whose name says "end"/"eot"/"eos" (not
    "start"/"begin"/"header"), and :data:`KNOWN_END_MARKERS`.
    """
    cands = set(KNOWN_END_MARKERS)
    eos = getattr(tokenizer, "eos_token", None)
    if isinstance(eos, str) and eos:
        cands.add(eos)
    specials = list(getattr(tokenizer, "all_special_tokens", []) or [])
    try:
        specials += [str(t) for t in tokenizer.added_tokens_decoder.values() if getattr(t, "special", False)]
    except Exception:
        pass
    for t in specials:
        if re.search(r"end|eot|eos|</s>", t, re.I) and not re.search(r"start|begin|header|bos", t, re.I):
            cands.add(t)
    return sorted(cands, key=lambda s: (-len(s), s))


def _prefix_len(text: str, prefix: str | None) -> int | None:
    return len(prefix) if prefix is not None and text.startswith(prefix) else None


def assistant_spans(tokenizer: Any, messages: list[dict], chat_template: str | None = None
                    ) -> tuple[str, list[tuple[int, int, int, int]]]:
    """Render a conversation and locate its assistant turns in the string.

    Returns:
        ``(text, spans)``; one span per assistant message, ``(gen, start, end, stop)`` in characters:
        ``gen`` where the generation prompt for this turn ends (= ``start`` when unknown), ``[start,
        end)`` the content, ``[end, stop)`` whitespace + end-of-turn marker (empty when the template
        writes no marker).

    Raises:
        ValueError: no chat template, or an assistant content that the template does not emit
            verbatim (or trimmed).
    """
    msgs = _check_messages(messages)
    text = render_text(tokenizer, msgs, chat_template)
    idx = [i for i, m in enumerate(msgs) if m["role"] == "assistant"]
    if not idx:
        return text, []

    def safe_render(ms: list[dict], gen: bool) -> str | None:
        if not ms:
            return None
        try:
            return render_text(tokenizer, ms, chat_template, add_generation_prompt=gen)
        except Exception:  # templates may reject some prefixes (e.g. must end with a user turn)
            return None

    gens = [_prefix_len(text, safe_render(msgs[:i], True)) for i in idx]

    # 1) sentinel rendering: exact spans when the template emits contents verbatim (or trimmed)
    contents = None
    sent = [dict(m) for m in msgs]
    for k, i in enumerate(idx):
        sent[i]["content"] = _SENTINEL.format(k)
    stext = safe_render(sent, False)
    if stext is not None:
        pieces, rest, ok = [], stext, True
        for k in range(len(idx)):
            a, b, rest2 = rest.partition(_SENTINEL.format(k))
            if not b:
                ok = False
                break
            pieces.append(a)
            rest = rest2
        pieces.append(rest)
        if ok:
            for variant in ("raw", "strip"):
                cs = [msgs[i]["content"] if variant == "raw" else msgs[i]["content"].strip() for i in idx]
                if "".join(p + c for p, c in zip(pieces, cs + [""])) == text:
                    contents = []
                    pos = 0
                    for p, c in zip(pieces, cs):
                        pos += len(p)
                        contents.append((pos, pos + len(c)))
                        pos += len(c)
                    break

    # 2) forward search from the end of the rendered prefix / generation prompt
    if contents is None:
        contents, cursor = [], 0
        for k, i in enumerate(idx):
            start = gens[k]
            if start is None:
                start = _prefix_len(text, safe_render(msgs[:i], False))
            start = cursor if start is None else max(start, cursor)
            c = msgs[i]["content"]
            pos, clen = text.find(c, start), len(c)
            if pos < 0 and c.strip() != c:
                pos, clen = text.find(c.strip(), start), len(c.strip())
            if pos < 0:
                raise ChatError(
                    f"cannot locate assistant message {i} in the text rendered by the chat template: "
                    "the template must emit assistant contents verbatim (or trimmed) for the loss mask"
                )
            contents.append((pos, pos + clen))
            cursor = pos + clen

    markers = end_markers(tokenizer)
    spans = []
    for k, (s, e) in enumerate(contents):
        g = gens[k] if gens[k] is not None and gens[k] <= s else s
        if k > 0 and g < spans[-1][3]:
            g = s
        stop = e
        j = e
        while j < len(text) and text[j].isspace():
            j += 1
        for mk in markers:
            if text.startswith(mk, j):
                stop = j + len(mk)
                break
        spans.append((g, s, e, stop))
    return text, spans


def _adds_prefix_space(tokenizer: Any) -> bool:
    """True when tokenizing a string on its own adds a leading space (SentencePiece dummy prefix,
    GPT-2 ``add_prefix_space``): then tokenizing segments separately would add spurious tokens."""
    try:
        toks = tokenizer.convert_ids_to_tokens(_encode(tokenizer, "a"))
    except Exception:
        return True
    return toks != ["a"]


def _split_straddlers(tokenizer: Any, text: str, ids: list[int], offs: list[tuple[int, int]],
                      base: int, cuts: list[int]) -> tuple[list[int], list[tuple[int, int]]]:
    """Re-tokenize, in pieces, every token whose character span contains a cut strictly inside."""
    out_ids, out_offs = [], []
    for t, (a, b) in zip(ids, offs):
        inner = [c for c in cuts if a < c < b]
        if not inner:
            out_ids.append(t)
            out_offs.append((a, b))
            continue
        bounds = [a] + inner + [b]
        for lo, hi in zip(bounds[:-1], bounds[1:]):
            sub = tokenizer(text[lo - base:hi - base], add_special_tokens=False, return_offsets_mapping=True)
            out_ids += list(sub["input_ids"])
            out_offs += [(lo + x, lo + y) for x, y in sub["offset_mapping"]]
    return out_ids, out_offs


def _offsets_tokenize(tokenizer: Any, text: str, hard: list[int], soft: list[int]
                      ) -> tuple[list[int], list[tuple[int, int]]]:
    """Tokenize ``text`` with character offsets per token.

    ``hard`` cuts (where the generation prompt ends) split the text into segments tokenized
    separately, so each prompt tokenizes exactly as :func:`render_prompt` does (unless the tokenizer
    adds a prefix space to every segment: then they are treated like soft cuts). A token straddling a
    ``soft`` cut (content end, marker end) is re-tokenized in two pieces. A slow tokenizer (no
    offsets) is tokenized segment by segment at all cuts, each token getting its segment's span.
    """
    n = len(text)
    if not getattr(tokenizer, "is_fast", False):
        ids, offs, prev = [], [], 0
        for c in sorted(set(c for c in hard + soft if 0 < c < n)) + [n]:
            if c <= prev:
                continue
            seg = _encode(tokenizer, text[prev:c])
            ids += seg
            offs += [(prev, c)] * len(seg)
            prev = c
        return ids, offs
    hard = sorted(set(c for c in hard if 0 < c < n))
    if hard and _adds_prefix_space(tokenizer):
        soft, hard = soft + hard, []
    soft = sorted(set(c for c in soft if 0 < c < n))
    ids: list[int] = []
    offs: list[tuple[int, int]] = []
    for lo, hi in zip([0] + hard, hard + [n]):
        seg = text[lo:hi]
        enc = tokenizer(seg, add_special_tokens=False, return_offsets_mapping=True)
        s_ids = list(enc["input_ids"])
        s_offs = [(lo + a, lo + b) for a, b in enc["offset_mapping"]]
        s_ids, s_offs = _split_straddlers(tokenizer, seg, s_ids, s_offs, lo, [c for c in soft if lo < c < hi])
        ids += s_ids
        offs += s_offs
    return ids, offs


def render_with_mask(tokenizer: Any, messages: list[dict], chat_template: str | None = None,
                     max_length: int | None = None) -> tuple[list[int], list[int]]:
    """Token ids and assistant loss mask of a whole conversation rendered with the chat template.

    Args:
        tokenizer: a transformers tokenizer (fast, for offsets; a slow one is tokenized per segment).
        messages: ``[{"role": "system"|"user"|"assistant", "content": str}, ...]``.
        chat_template: Jinja template overriding the tokenizer's (the recipe's ``data.chat_template``).
        max_length: keep only the first ``max_length`` tokens.

    Returns:
        ``(input_ids, loss_mask)``: two lists of ints of equal length ``T``; ``loss_mask[t] == 1``
        exactly for tokens of assistant contents and the end-of-turn marker right after each.

    Raises:
        ValueError: the tokenizer has no chat template and ``chat_template`` is None (the recipe must
            supply ``data.chat_template``); bad messages; a template that does not emit assistant
            contents verbatim.
    """
    text, spans = assistant_spans(tokenizer, messages, chat_template)
    hard = [g for g, _, _, _ in spans]
    soft = [c for _, _, e, stop in spans for c in (e, stop)]
    ids, offs = _offsets_tokenize(tokenizer, text, hard, soft)
    mask = [0] * len(ids)
    regions = [(s, stop) for _, s, _, stop in spans if stop > s]
    for t, (a, b) in enumerate(offs):
        for s, stop in regions:
            if (a < stop and b > s) if b > a else (s <= a < stop):
                mask[t] = 1
                break
    if max_length is not None:
        if max_length < 1:
            raise ChatError(f"max_length must be >= 1, got {max_length}")
        ids, mask = ids[:max_length], mask[:max_length]
    return ids, mask
