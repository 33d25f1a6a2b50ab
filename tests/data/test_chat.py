"""Chat rendering and the assistant loss mask (speculators.data.chat), with SmolLM2's real tokenizer."""

from __future__ import annotations


import pytest

from speculators.data.chat import (
    assistant_spans,
    prompt_messages,
    render_prompt,
    render_with_mask,
)

@pytest.fixture(scope="module")
def tok(smol_tokenizer):
    """SmolLM2-135M-Instruct's tokenizer (converted from the GGUF once, cached; see conftest.py)."""
    return smol_tokenizer


def masked_text(tok, ids, mask):
    return tok.decode([i for i, m in zip(ids, mask) if m])


LLAMA3_TEMPLATE = (
    "{{ bos_token }}{% for message in messages %}"
    "{{ '<|start_header_id|>' + message['role'] + '<|end_header_id|>\n\n' + message['content'] | trim + '<|eot_id|>' }}"
    "{% endfor %}{% if add_generation_prompt %}{{ '<|start_header_id|>assistant<|end_header_id|>\n\n' }}{% endif %}"
)
ZEPHYR_TEMPLATE = (
    "{% for message in messages %}\n{% if message['role'] == 'user' %}\n{{ '<|user|>\n' + message['content'] + eos_token }}\n"
    "{% elif message['role'] == 'system' %}\n{{ '<|system|>\n' + message['content'] + eos_token }}\n"
    "{% elif message['role'] == 'assistant' %}\n{{ '<|assistant|>\n'  + message['content'] + eos_token }}\n"
    "{% endif %}\n{% if loop.last and add_generation_prompt %}\n{{ '<|assistant|>' }}\n{% endif %}\n{% endfor %}"
)
# a template with no special end marker: assistant turns end with a blank line
PLAIN_TEMPLATE = (
    "{% for m in messages %}{% if m['role'] == 'user' %}User: {{ m['content'] }}\n"
    "{% elif m['role'] == 'assistant' %}Assistant: {{ m['content'] }}\n\n"
    "{% else %}{{ m['content'] }}\n\n{% endif %}{% endfor %}{% if add_generation_prompt %}Assistant: {% endif %}"
)

CODE = '    def f(x):\n        """Say «héllo» 😀 日本語."""\n\n        return x  # tab\there\n'
MULTI = [
    {"role": "system", "content": "You are a terse assistant."},
    {"role": "user", "content": "Write f."},
    {"role": "assistant", "content": CODE},
    {"role": "user", "content": "Again, please"},
    {"role": "assistant", "content": "Again, please"},  # identical to a user turn
    {"role": "user", "content": "a"},
    {"role": "assistant", "content": "a"},  # substring of the role header 'assistant'
]


def test_prompt_messages():
    assert prompt_messages(MULTI) == MULTI[:-1]
    assert prompt_messages(MULTI[:2]) == MULTI[:2]
    assert prompt_messages(MULTI[:3]) == MULTI[:2]


def test_chatml_single_turn_mask(tok):
    msgs = [{"role": "user", "content": "What is 2+2?"}, {"role": "assistant", "content": "It is 4."}]
    ids, mask = render_with_mask(tok, msgs)
    assert len(ids) == len(mask)
    assert masked_text(tok, ids, mask) == "It is 4.<|im_end|>"
    # mask is one contiguous run ending at <|im_end|>, followed by the template's "\n"
    on = [i for i, m in enumerate(mask) if m]
    assert on == list(range(on[0], on[-1] + 1))
    assert tok.convert_ids_to_tokens(ids[on[-1]]) == "<|im_end|>"
    # the prompt ids are exactly render_prompt's (what the target regenerates from)
    p = render_prompt(tok, msgs)
    assert ids[: len(p)] == p and on[0] == len(p)
    assert render_prompt(tok, msgs[:1]) == p
    assert tok.decode(p).endswith("<|im_start|>assistant\n")


def test_chatml_multi_turn_with_system_and_tricky_content(tok):
    ids, mask = render_with_mask(tok, MULTI)
    want = "".join(m["content"] + "<|im_end|>" for m in MULTI if m["role"] == "assistant")
    assert masked_text(tok, ids, mask) == want
    # nothing from system/user turns or role headers
    unmasked = tok.decode([i for i, m in zip(ids, mask) if not m])
    assert "You are a terse assistant." in unmasked and unmasked.count("<|im_start|>assistant\n") == 3
    assert "def f" not in unmasked
    # ids decode back to the rendered text (splitting a straddling token changes no text)
    text, spans = assistant_spans(tok, MULTI)
    assert tok.decode(ids) == text
    assert len(spans) == 3


def test_leading_spaces_prompt_prefix(tok):
    # ChatML's "\n" + "    def" would tokenize as "\n   " + " def": the mask must still be exact
    msgs = [{"role": "user", "content": "code"}, {"role": "assistant", "content": CODE}]
    ids, mask = render_with_mask(tok, msgs)
    p = render_prompt(tok, msgs)
    assert ids[: len(p)] == p
    assert masked_text(tok, ids, mask) == CODE + "<|im_end|>"
    assert mask[: len(p)] == [0] * len(p) and all(mask[len(p):-1])


@pytest.mark.parametrize(
    "template,marker,strip",
    [(LLAMA3_TEMPLATE, "<|eot_id|>", True), (ZEPHYR_TEMPLATE, "<|im_end|>", False)],  # eos of SmolLM2 is <|im_end|>
    ids=["llama3", "zephyr"],
)
def test_other_templates(tok, template, marker, strip):
    ids, mask = render_with_mask(tok, MULTI, chat_template=template)
    want = "".join((m["content"].strip() if strip else m["content"]) + marker for m in MULTI if m["role"] == "assistant")
    assert masked_text(tok, ids, mask) == want
    # the first turn's prompt ids are a prefix of the conversation's ids
    p = render_prompt(tok, MULTI[:3], chat_template=template)
    assert ids[: len(p)] == p and not any(mask[: len(p)])


def test_template_set_on_tokenizer(tok):
    import copy

    t2 = copy.deepcopy(tok)
    t2.chat_template = ZEPHYR_TEMPLATE
    a = render_with_mask(t2, MULTI)
    b = render_with_mask(tok, MULTI, chat_template=ZEPHYR_TEMPLATE)
    assert a == b


def test_template_without_end_marker(tok):
    ids, mask = render_with_mask(tok, MULTI, chat_template=PLAIN_TEMPLATE)
    assert masked_text(tok, ids, mask) == "".join(m["content"] for m in MULTI if m["role"] == "assistant")


def test_prompt_only_conversation_has_empty_mask(tok):
    ids, mask = render_with_mask(tok, [{"role": "user", "content": "hi"}])
    assert len(ids) > 0 and sum(mask) == 0


def test_missing_template_error(tok):
    import copy

    t2 = copy.deepcopy(tok)
    t2.chat_template = None
    msgs = MULTI[:3]
    for fn in (render_with_mask, render_prompt):
        with pytest.raises(ValueError, match=r"no chat template.*data\.chat_template"):
            fn(t2, msgs)
    # a recipe-supplied template fixes it
    ids, mask = render_with_mask(t2, msgs, chat_template=LLAMA3_TEMPLATE)
    assert masked_text(t2, ids, mask) == CODE.strip() + "<|eot_id|>"


def test_truncation_keeps_beginning(tok):
    full_ids, full_mask = render_with_mask(tok, MULTI)
    for n in (1, 10, 37, len(full_ids), len(full_ids) + 5):
        ids, mask = render_with_mask(tok, MULTI, max_length=n)
        assert ids == full_ids[:n] and mask == full_mask[:n]
    with pytest.raises(ValueError):
        render_with_mask(tok, MULTI, max_length=0)


def test_bad_messages(tok):
    with pytest.raises(ValueError):
        render_with_mask(tok, [])
    with pytest.raises(ValueError):
        render_with_mask(tok, [{"role": "user", "content": ["not", "text"]}])
    with pytest.raises(ValueError, match="prompt is empty"):
        render_prompt(tok, [{"role": "assistant", "content": "x"}])
