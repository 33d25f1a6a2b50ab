"""Batches for generating from the target: prompts bucketed by length, batch sizes chosen from memory.

Used by regeneration (:func:`speculators.data.regenerate.regenerate`) and self-synthesis
(:func:`speculators.data.selfsynth.synthesize_prompts`) before calling ``target.generate_batch``
(:func:`speculators.target.generation.generate_batch`, left padding, finished rows leave the batch). The
target is read duck-typed (``config``, ``model``, ``device``): this module imports nothing of ``target/``.

The rule: a batch may take ``MEMORY_FRACTION`` of the free memory (:func:`available_memory_bytes`), and one
row costs :func:`row_bytes` (its KV cache at full length, counted twice, plus the prefill's attention scores
and two vocabulary rows), so ``rows = budget // row_bytes(longest prompt of the batch)``, capped at
``MAX_AUTO_BATCH`` and cut where padding would exceed ``PAD_SLACK`` of the prompt tokens.
``regeneration.batch_size`` in a recipe overrides it with a fixed size.
"""

from __future__ import annotations

from typing import Sequence

import torch

from ..errors import SpeculatorsError

# Auto batch sizing (:func:`generation_batches`): the share of the free memory the batch's KV cache and prefill
# may take, and the cap on rows (past it a CPU step is compute-bound and a large batch drains into a long
# tail of few rows).
MEMORY_FRACTION = 0.25
MAX_AUTO_BATCH = 256
# A batch's padded prefill (rows x longest prompt) stays within (1 + PAD_SLACK) x its real prompt tokens: a
# short chat prompt is not padded to a long code prompt (each pad position costs a prefill token).
PAD_SLACK = 0.25
# A batch of fewer rows than this, cut off by padding, joins the batch before it when memory allows: a step
# over 3 rows costs nearly what a step over 30 does on a CPU, more than the padding it saves.
MIN_AUTO_BATCH = 8


def kv_bytes_per_token(target) -> int:
    """Bytes of KV cache one token of one row costs in this target: ``2 (K and V) x layers x kv_heads x
    head_dim x itemsize`` of the model's dtype (SmolLM2-135M: 2 x 30 x 3 x 64 x 2 = 23,040 bytes in bf16)."""
    cfg = target.config
    heads = int(cfg.num_attention_heads)
    kv_heads = int(getattr(cfg, "num_key_value_heads", None) or heads)
    head_dim = int(getattr(cfg, "head_dim", None) or cfg.hidden_size // heads)
    itemsize = torch.empty((), dtype=target.dtype).element_size()
    return 2 * int(cfg.num_hidden_layers) * kv_heads * head_dim * itemsize


def available_memory_bytes(device: torch.device) -> int:
    """Free memory for a batch on ``device``: ``torch.cuda.mem_get_info`` on CUDA, else ``MemAvailable`` of
    ``/proc/meminfo`` (4 GiB when it cannot be read)."""
    if device.type == "cuda":
        return int(torch.cuda.mem_get_info(device)[0])
    try:
        for line in open("/proc/meminfo"):
            if line.startswith("MemAvailable:"):
                return int(line.split()[1]) * 1024
    except OSError:
        pass
    return 4 << 30


def row_bytes(target, prompt_len: int, max_new_tokens: int) -> int:
    """Peak bytes one row of :func:`generate_batch` may hold, the unit of :func:`generation_batches`: its KV cache
    at full length, twice (``DynamicCache`` concatenates into a new tensor each step, so old and new copies
    coexist), plus the prefill's attention scores (``heads x prompt_len^2`` float32, the unfused path) and
    two float32 vocabulary rows (last logits and the sampling probabilities)."""
    cfg = target.config
    kv = kv_bytes_per_token(target) * (prompt_len + max_new_tokens) * 2
    return kv + int(cfg.num_attention_heads) * prompt_len * prompt_len * 4 + 2 * 4 * int(cfg.vocab_size)


def generation_batches(target, prompt_lens: Sequence[int], max_new_tokens: int, batch_size: int | None = None,
                 memory_bytes: int | None = None) -> list[list[int]]:
    """Length-bucketed batches for :func:`generate_batch`: prompt indices sorted by length (ties keep their
    order), cut into consecutive chunks, so the rows of a batch have similar lengths and pad little.

    The size of a chunk is ``batch_size`` when given (the recipe's ``regeneration.batch_size``); otherwise
    it is chosen from memory: rows are added while ``rows x row_bytes(longest prompt of the chunk)``
    (:func:`row_bytes`) stays within ``MEMORY_FRACTION`` of ``memory_bytes`` (None:
    :func:`available_memory_bytes` of the target's device), at most ``MAX_AUTO_BATCH`` rows, at least one,
    and while the padded prefill ``rows x longest`` stays within ``1 + PAD_SLACK`` times the chunk's real
    prompt tokens. Short prompts therefore share larger batches than long ones, and never pad to them. A
    chunk of fewer than ``MIN_AUTO_BATCH`` rows then joins the chunk before it when the two fit the memory
    budget and ``MAX_AUTO_BATCH`` together.

    Args:
        prompt_lens: tokens per prompt. max_new_tokens: the response cap (counted in every row's KV cache).
    Returns:
        The batches as lists of indices into ``prompt_lens``; every index appears once.
    Raises:
        SpeculatorsError: ``batch_size`` or ``memory_bytes`` below 1.
    """
    if batch_size is not None and batch_size < 1:
        raise SpeculatorsError(f"regeneration.batch_size must be >= 1 (or unset: chosen from memory), got {batch_size}")
    if memory_bytes is not None and memory_bytes < 1:
        raise SpeculatorsError(f"generation_batches: memory_bytes must be >= 1, got {memory_bytes}")
    order = sorted(range(len(prompt_lens)), key=lambda i: prompt_lens[i])
    if batch_size is not None:
        return [order[i:i + batch_size] for i in range(0, len(order), batch_size)]
    budget = MEMORY_FRACTION * (memory_bytes if memory_bytes is not None else available_memory_bytes(target.device))
    batches: list[list[int]] = []
    real = 0  # prompt tokens of the last chunk
    for i in order:  # ascending lengths: the newest row is the chunk's longest
        n, L = (len(batches[-1]) + 1, prompt_lens[i]) if batches else (1, prompt_lens[i])
        if batches and n <= MAX_AUTO_BATCH and n * row_bytes(target, L, max_new_tokens) <= budget \
                and n * L <= (1 + PAD_SLACK) * (real + L):
            batches[-1].append(i)
            real += L
        else:
            batches.append([i])
            real = L
    merged: list[list[int]] = []
    for b in batches:
        if merged and len(b) < MIN_AUTO_BATCH and len(merged[-1]) + len(b) <= MAX_AUTO_BATCH and \
                (len(merged[-1]) + len(b)) * row_bytes(target, prompt_lens[b[-1]], max_new_tokens) <= budget:
            merged[-1].extend(b)
        else:
            merged.append(b)
    return merged
