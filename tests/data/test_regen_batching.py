"""Generation batches for regeneration: length buckets, memory-chosen sizes, and greedy responses that do not
depend on the batching (the same tokens as one prompt at a time, in the target's dtype)."""

from __future__ import annotations

import pytest
import torch

from speculators.data import batching
from speculators.data.batching import generation_batches, kv_bytes_per_token, row_bytes
from speculators.data.regenerate import regenerate
from speculators.data.sources import Conversation
from speculators.errors import SpeculatorsError
from speculators.target import Target, build_tiny_target


@pytest.fixture(scope="module")
def tiny():
    return build_tiny_target(vocab_size=128, hidden_size=64, num_layers=6, seed=2)


def _prompts(n: int, seed: int = 0) -> list[list[int]]:
    g = torch.Generator().manual_seed(seed)
    lens = torch.randint(2, 48, (n,), generator=g).tolist()
    return [torch.randint(0, 128, (k,), generator=g).tolist() for k in lens]


def test_kv_bytes_per_token_follows_the_config(tiny):
    # 2 (K, V) x 6 layers x 2 kv heads x head_dim 16 x 4 bytes (float32)
    assert kv_bytes_per_token(tiny) == 2 * 6 * 2 * 16 * 4
    half = Target(build_tiny_target(vocab_size=128, hidden_size=64, num_layers=6, seed=2).model.to(torch.bfloat16))
    assert kv_bytes_per_token(half) == kv_bytes_per_token(tiny) // 2


def test_batches_are_length_buckets_within_the_memory_budget(tiny, monkeypatch):
    monkeypatch.setattr(batching, "MIN_AUTO_BATCH", 1)  # no tail merging here (checked at the end)
    lens = [100 + len(p) for p in _prompts(60)]  # 102..147 tokens: padding alone rarely cuts a batch
    budget_rows = 5  # the budget fits 5 rows of the longest prompt, more rows of shorter ones
    mem = int(budget_rows * row_bytes(tiny, max(lens), 16) / batching.MEMORY_FRACTION)
    batches = generation_batches(tiny, lens, 16, memory_bytes=mem)
    flat = [i for b in batches for i in b]
    assert sorted(flat) == list(range(len(lens)))  # every prompt once
    assert [lens[i] for i in flat] == sorted(lens)  # ascending lengths: a batch pads little
    for b in batches:
        longest, real = max(lens[i] for i in b), sum(lens[i] for i in b)
        assert len(b) * row_bytes(tiny, longest, 16) <= batching.MEMORY_FRACTION * mem
        assert len(b) * longest <= (1 + batching.PAD_SLACK) * real  # little padding
    for b, nxt in zip(batches, batches[1:]):  # a batch ends only when the next prompt would not fit
        L = lens[nxt[0]]
        assert (len(b) + 1) * row_bytes(tiny, L, 16) > batching.MEMORY_FRACTION * mem or \
            (len(b) + 1) * L > (1 + batching.PAD_SLACK) * (sum(lens[i] for i in b) + L)
    # a short chat prompt is not padded to a long code prompt; a tail of 3 long prompts joins the batch before
    monkeypatch.undo()
    mixed = generation_batches(tiny, [30] * 8 + [400] * 8, 16, memory_bytes=1 << 40)
    assert mixed == [list(range(8)), list(range(8, 16))]
    assert generation_batches(tiny, [100] * 20 + [300] * 3, 16, memory_bytes=1 << 40) == [list(range(23))]
    assert len(batches[0]) > budget_rows >= len(batches[-1])  # short prompts share larger batches
    # a fixed batch_size (regeneration.batch_size) overrides the memory rule
    fixed = generation_batches(tiny, lens, 16, batch_size=7, memory_bytes=mem)
    assert [len(b) for b in fixed] == [7] * 8 + [4] and [i for b in fixed for i in b] == flat
    # plenty of memory: capped at MAX_AUTO_BATCH rows; none at all: one row per batch
    assert [len(b) for b in generation_batches(tiny, [50] * 300, 16, memory_bytes=1 << 40)] \
        == [batching.MAX_AUTO_BATCH, 300 - batching.MAX_AUTO_BATCH]
    assert {len(b) for b in generation_batches(tiny, lens, 16, memory_bytes=1)} == {1}


def test_bad_batch_settings_are_refused(tiny):
    with pytest.raises(SpeculatorsError, match="regeneration.batch_size"):
        generation_batches(tiny, [3, 4], 8, batch_size=0)
    with pytest.raises(SpeculatorsError, match="memory_bytes"):
        generation_batches(tiny, [3, 4], 8, memory_bytes=0)


def _varied_target(dtype: torch.dtype) -> Target:
    """The tiny target with an untied random output head (varied greedy chains, not one repeated token)."""
    t = build_tiny_target(vocab_size=128, hidden_size=64, num_layers=6, seed=2)
    head = torch.randn(128, 64, generator=torch.Generator().manual_seed(1)) * 0.5
    t.model.lm_head.weight = torch.nn.Parameter(head, requires_grad=False)
    t.model.config.tie_word_embeddings = False
    return Target(t.model.to(dtype))


def _bucketed(target, prompts, max_new, stops, mem):
    out = [None] * len(prompts)
    for b in generation_batches(target, [len(p) for p in prompts], max_new, memory_bytes=mem):
        for i, g in zip(b, target.generate_batch([prompts[i] for i in b], max_new, stops)):
            out[i] = g
    return out


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_bucketed_greedy_equals_one_prompt_at_a_time(dtype):
    """Greedy regeneration in length buckets of memory-chosen sizes gives, in the original order, the tokens
    each prompt gets alone in the same dtype (rows finish at different steps: the batches compact)."""
    target = _varied_target(dtype)
    prompts = _prompts(24, seed=1)
    stops = {3, 50, 97}
    mem = int(6 * row_bytes(target, 48, 20) / batching.MEMORY_FRACTION)
    assert len(generation_batches(target, [len(p) for p in prompts], 20, memory_bytes=mem)) > 2
    batched = _bucketed(target, prompts, 20, stops, mem)
    alone = [target.generate_batch([p], 20, stops)[0] for p in prompts]
    assert batched == alone
    assert len({len(g.ids) for g in alone}) > 3 and any(g.stop is not None for g in alone)


def test_reserved_cache_gives_the_tokens_of_a_growing_cache(monkeypatch):
    """The reserved KV buffers (written in place, compacted when rows finish) give the tokens that the plain
    ``DynamicCache`` (a new tensor per step) gives, and are really in use."""
    from speculators.target import generation

    target = _varied_target(torch.float32)
    prompts = _prompts(24, seed=1)
    stops = {3, 50, 97}
    used = []
    real = generation._reserved_cache
    monkeypatch.setattr(generation, "_reserved_cache", lambda c, cap: used.append(cap) or real(c, cap))
    reserved = target.generate_batch(prompts, 20, stops)
    assert used == [max(map(len, prompts)) + 20]
    monkeypatch.setattr(generation, "_reserved_cache", lambda c, cap: c)
    assert target.generate_batch(prompts, 20, stops) == reserved
    assert len({len(g.ids) for g in reserved}) > 2  # rows left the batch at different steps


def test_regenerate_returns_the_input_order_whatever_the_batch_size(smol_tokenizer, isolated_cache):
    """``regenerate`` with memory-chosen batches (``batch_size=None``) and with one prompt per batch: the same
    conversations, in the input order (prompts of different lengths are bucketed out of order)."""
    target = build_tiny_target(vocab_size=len(smol_tokenizer), hidden_size=64, num_layers=2, seed=0,
                               tokenizer=smol_tokenizer)
    questions = ["Hi", "What is the capital of France, and why is it there?", "Name a colour.",
                 "Explain, in a few words, why the sky looks blue at noon but red at dusk.", "Yes?"]
    convs = [Conversation(f"s/{i}", "s", [{"role": "user", "content": q}]) for i, q in enumerate(questions)]
    auto = regenerate(target, convs, "a", max_new_tokens=6, batch_size=None, log=lambda m: None)
    one = regenerate(target, convs, "b", max_new_tokens=6, batch_size=1, log=lambda m: None)
    assert [c.id for c in auto] == [c.id for c in convs]
    assert [c.input_ids for c in auto] == [c.input_ids for c in one]
    assert len({len(c.input_ids) for c in auto}) == len(convs)


def test_rows_finished_but_not_yet_dropped_change_nothing():
    """In a batch of 24, finished rows stay (computed, ignored) until an eighth of the batch has finished:
    greedy and per-prompt-generator samples are still each prompt's own, as alone."""
    from speculators.target.generation import COMPACT_DIVISOR

    target = _varied_target(torch.float32)
    prompts = _prompts(24, seed=1)
    stops = {3, 50, 97}
    assert len(prompts) // COMPACT_DIVISOR > 1  # one finished row alone does not compact
    greedy = target.generate_batch(prompts, 20, stops)
    assert greedy == [target.generate_batch([p], 20, stops)[0] for p in prompts]

    def gens(seeds):
        return [torch.Generator().manual_seed(s) for s in seeds]

    sampled = target.generate_batch(prompts, 12, stops, temperature=30.0, generator=gens(range(24)))
    alone = [target.generate_batch([p], 12, stops, temperature=30.0, generator=gens([s]))[0]
             for s, p in enumerate(prompts)]
    assert sampled == alone
    assert len({len(g.ids) for g in sampled}) > 2 and sum(g.stop is not None for g in sampled) > 3
