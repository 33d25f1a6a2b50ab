"""Response regeneration: every prompt's assistant turn is rewritten by the target itself.

A drafter should imitate the target's own outputs (on-policy data). Generation is batched (left
padding, prompts sorted by length), greedy or sampled per recipe, and cached on disk in a JSONL file
keyed by (target, source, settings, chat template); each finished batch is appended and flushed, so
an interrupted run resumes where it stopped.
"""

from __future__ import annotations

import json
import time
from dataclasses import replace
from pathlib import Path

import torch

from ..utils import cache_root, stable_hash
from .chat import prompt_messages, render_prompt
from .sources import Conversation


def regeneration_cache_file(target, source: str, settings: dict, chat_template: str | None) -> Path:
    key = stable_hash({"target": target.fingerprint, "source": source, "settings": settings,
                       "template": chat_template})
    safe = "".join(c if c.isalnum() or c in "-_." else "_" for c in source)[-40:]
    return cache_root() / "regen" / f"{safe}-{key}.jsonl"


@torch.no_grad()
def regenerate(target, convs: list[Conversation], source: str, max_new_tokens: int = 256,
               temperature: float = 0.0, top_p: float = 1.0, batch_size: int = 16, seed: int = 0,
               chat_template: str | None = None, log=print, progress=None) -> list[Conversation]:
    """Replace the final assistant turn of each conversation by the target's own response.

    Args:
        target: :class:`speculators.target.Target` (needs a tokenizer).
        convs: conversations of one source; everything before the last assistant turn is the prompt.
        source: source label for the cache key.
        max_new_tokens, temperature, top_p: generation settings (temperature 0 = greedy).
        batch_size: prompts per ``generate`` call.
        progress: optional ``(done, total)`` callable.
    Returns:
        Conversations ``prompt + [{"role": "assistant", "content": response}]`` in input order.
    """
    settings = {"max_new_tokens": max_new_tokens, "temperature": temperature, "top_p": top_p, "seed": seed}
    path = regeneration_cache_file(target, source, settings, chat_template)
    done: dict[str, str] = {}
    if path.exists():
        for line in path.read_text().splitlines():
            try:
                rec = json.loads(line)
            except json.JSONDecodeError:
                continue  # a torn last line from an interrupted run
            done[rec["id"]] = rec["response"]
    todo = [c for c in convs if c.id not in done]
    if not todo:
        log(f"regeneration: cache hit {path} ({len(convs)} responses)")
    else:
        log(f"regeneration: {len(todo)} of {len(convs)} prompts of {source!r} "
            f"({len(done)} cached) -> {path}")
        tok = target.tokenizer
        prompts = {c.id: render_prompt(tok, prompt_messages(c.messages), chat_template) for c in todo}
        order = sorted(todo, key=lambda c: len(prompts[c.id]))
        pad = tok.pad_token_id if tok.pad_token_id is not None else tok.eos_token_id
        path.parent.mkdir(parents=True, exist_ok=True)
        t0, n_new = time.time(), 0
        with path.open("a") as f:
            for bi in range(0, len(order), batch_size):
                chunk = order[bi:bi + batch_size]
                gen = torch.Generator().manual_seed(seed + bi)
                outs = target.generate_batch([prompts[c.id] for c in chunk], max_new_tokens, tok.eos_token_id,
                                             temperature, top_p, generator=gen, pad_token_id=pad)
                for c, new in zip(chunk, outs):
                    n_new += len(new)
                    text = tok.decode(new, skip_special_tokens=True)
                    done[c.id] = text
                    f.write(json.dumps({"id": c.id, "response": text, "tokens": len(new)}) + "\n")
                f.flush()
                if progress:
                    progress(min(bi + batch_size, len(order)), len(order))
        dt = time.time() - t0
        log(f"regeneration: {n_new} tokens in {dt:.1f}s ({n_new / max(dt, 1e-9):.1f} tokens/s)")
    return [replace(c, messages=prompt_messages(c.messages) + [{"role": "assistant", "content": done[c.id]}])
            for c in convs]
