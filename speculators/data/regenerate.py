"""Response regeneration: every prompt's assistant turn is rewritten by the target itself.

A drafter should imitate the target's own outputs (on-policy data). Generation is batched (left
padding, prompts sorted by length so a batch pads little, batch sizes chosen from free memory unless the
recipe sets ``regeneration.batch_size``: :func:`speculators.data.batching.generation_batches`), greedy or
sampled per recipe, stops at the target's stop tokens
(:attr:`speculators.target.Target.stop_token_ids`: tokenizer EOS, generation-config EOS ids and the chat
template's end-of-turn token), and is cached on disk in a JSONL file keyed by (format version, target,
source, settings, stop ids, chat template); inside it every response is keyed by the CONTENT of its
prompt (messages and prompt ids), never by the conversation id, so an edited prompt is regenerated.
Each finished batch is appended and flushed, so an interrupted run resumes where it stopped.

With ``data.regeneration.server`` the answers come from an inference server instead
(:mod:`speculators.data.server_regen`: token ids in and out, ``concurrency`` requests in flight, each
response appended as it arrives); the server's identity (protocol, served model or llama.cpp build and GGUF)
joins the cache key, so answers of another producer are never mixed in.

What is trained is exactly what the target produced: the cache stores the generated token ids and the
stop id (null when the response was cut by ``max_new_tokens``), and the regenerated conversation is
pre-tokenized as ``prompt ids + response ids (+ stop id)``, the loss mask covering the response ids
and the stop id (a cut response has no supervised end-of-turn). Nothing is decoded and re-rendered.
"""

from __future__ import annotations

import json
import time
from dataclasses import replace
from pathlib import Path

import torch

from ..utils import cache_root, open_jsonl_append, read_jsonl_records, stable_hash
from .batching import generation_batches
from .chat import prompt_messages, render_prompt, render_with_mask
from .server_regen import Generated, RegenerationServer, generate_all
from .sources import Conversation

# Version of the cache records: 2 = token ids + stop id, keyed by prompt content (1 was text by id).
REGEN_FORMAT = 2


def regeneration_cache_file(target, source: str, settings: dict, chat_template: str | None) -> Path:
    """JSONL cache of one source's regenerations for this target (its fingerprint and compute dtype:
    :attr:`speculators.target.Target.cache_identity`), settings and chat template."""
    key = stable_hash({"format": REGEN_FORMAT, "target": target.cache_identity, "source": source,
                       "settings": settings, "template": chat_template})
    safe = "".join(c if c.isalnum() or c in "-_." else "_" for c in source)[-40:]
    return cache_root() / "regen" / f"{safe}-{key}.jsonl"


def prompt_key(messages: list[dict], prompt_ids: list[int]) -> str:
    """Content key of a cached response: the hash of the prompt messages and the prompt ids."""
    return stable_hash({"messages": messages, "ids": prompt_ids}, n=24)


def prompt_seed(seed: int, key: str) -> int:
    """The sampling seed of one prompt's regeneration: a 60-bit hash of the recipe's ``seed`` and the
    prompt's content key (:func:`prompt_key`), independent of batching and of the other prompts."""
    return int(stable_hash({"seed": int(seed), "key": key}, n=15), 16)


def _prompt_mask(tok, messages: list[dict], prompt_ids: list[int], chat_template: str | None) -> list[int]:
    """Loss mask of the prompt part: earlier assistant turns keep their :func:`render_with_mask` mask
    when those ids are a prefix of ``prompt_ids``; otherwise (or with no assistant turn) all zeros."""
    mask = [0] * len(prompt_ids)
    if not any(m.get("role") == "assistant" for m in messages):
        return mask
    try:
        ids, m = render_with_mask(tok, messages, chat_template)
    except ValueError:
        return mask
    if len(ids) <= len(prompt_ids) and prompt_ids[:len(ids)] == ids:
        mask[:len(m)] = m
    return mask


@torch.no_grad()
def regenerate(target, convs: list[Conversation], source: str, max_new_tokens: int = 256,
               temperature: float = 0.0, top_p: float = 1.0, batch_size: int | None = None, seed: int = 0,
               chat_template: str | None = None, log=print, progress=None,
               max_length: int | None = None, server: RegenerationServer | None = None) -> list[Conversation]:
    """Replace the final assistant turn of each conversation by the target's own response.

    A prompt of ``max_length`` tokens or more (the recipe's ``data.max_length``, the training window) is
    not generated: no token of its answer could be trained, and one long multi-turn prompt padded into
    a batch makes the batched prefill's attention scores ``[batch, heads, L, L]`` (a 5,400-token chat
    history in a batch of 26 asked for 27.6 GB). Its conversation comes back with the prompt ids and
    mask only (no response, nothing trained as an answer); :func:`speculators.data.pipeline.tokenize`
    keeps what of its earlier assistant turns fits the window, or drops it as an answer beyond
    ``data.max_length``. The skipped prompts are counted in the log.

    Args:
        target: :class:`speculators.target.Target` (needs a tokenizer).
        convs: conversations of one source; everything before the last assistant turn is the prompt.
        source: source label for the cache key.
        max_new_tokens, temperature, top_p: generation settings (temperature 0 = greedy).
        batch_size: prompts per ``generate_batch`` call; None = chosen from free memory per length bucket
            (:func:`speculators.data.batching.generation_batches`). Greedy responses do not depend on it (nor on
            the order): each row's logits are its own, up to the last-bit rounding of a batched matmul, which
            can flip a near-tie of the two best logits (float32 on CPU: none seen; bfloat16: seen at gaps of
            1-2 ulps, see :func:`speculators.target.generation.generate_batch`).
        seed: sampling seed (each prompt samples from its own generator, :func:`prompt_seed`).
        chat_template: the recipe's ``data.chat_template`` (None = the tokenizer's); also selects the
            end-of-turn stop token (:meth:`speculators.target.Target.stop_ids_for`).
        progress: optional ``(done, total)`` callable.
        max_length: prompts with at least this many tokens are not generated (None: every prompt is).
        server: regenerate through this inference server (:mod:`speculators.data.server_regen`; its
            identity joins the cache key; ``batch_size`` unused) instead of ``target.generate_batch``.
    Returns:
        Conversations in input order, each with ``messages = prompt + [{"role": "assistant",
        "content": decoded response}]`` (for display) and the training ids: ``input_ids = prompt ids
        (render_prompt) + response ids + [stop id if the target stopped]``, ``loss_mask`` = 1 on the
        response ids and the stop id (and on earlier assistant turns of the prompt, see
        :func:`_prompt_mask`).
    Raises:
        ServerError: (with ``server``) a request failed after its retries or its answer cannot be trained on
            (:mod:`speculators.data.server_regen`); the answers that arrived before are kept in the cache.
    """
    tok = target.tokenizer
    stops = target.stop_ids_for(chat_template)
    settings = {"max_new_tokens": max_new_tokens, "temperature": temperature, "top_p": top_p, "seed": seed,
                "stop_ids": stops}
    if temperature > 0:  # sampled responses: one generator per prompt (earlier caches seeded per batch)
        settings["rng"] = "per-prompt"
    if server is not None:  # another producer's answers are another cache (our loop's key is unchanged)
        settings["server"] = server.identity(target, log)
    path = regeneration_cache_file(target, source, settings, chat_template)
    done = {rec["key"]: rec for rec in read_jsonl_records(path)
            if isinstance(rec.get("key"), str) and isinstance(rec.get("ids"), list)}
    pms = [prompt_messages(c.messages) for c in convs]
    prompts = [render_prompt(tok, pm, chat_template) for pm in pms]
    keys = [prompt_key(pm, p) for pm, p in zip(pms, prompts)]
    too_long = {k for k, p in zip(keys, prompts) if max_length is not None and len(p) >= max_length}
    todo: dict[str, list[int]] = {}
    for k, p in zip(keys, prompts):
        if k not in done and k not in too_long:
            todo.setdefault(k, p)  # one generation per distinct prompt
    n_distinct = len(set(keys))
    if too_long:
        log(f"regeneration: {len(too_long)} of {n_distinct} prompts of {source!r} not generated: "
            f"{max_length} tokens or longer (data.max_length), no answer token would be trained")
    n_distinct -= len(too_long)
    if not todo:
        log(f"regeneration: cache hit {path} ({n_distinct} responses)")
    else:
        log(f"regeneration: {len(todo)} of {n_distinct} prompts of {source!r} "
            f"({n_distinct - len(todo)} cached) -> {path}")
        if server is None:
            _regenerate_locally(target, todo, done, path, max_new_tokens, stops, temperature, top_p, batch_size,
                                seed, log, progress)
        else:
            _regenerate_via_server(server, target, todo, done, path, max_new_tokens, stops, temperature, top_p,
                                   seed, log, progress)
    out = []
    for c, pm, p, k in zip(convs, pms, prompts, keys):
        if k in too_long:  # the prompt alone fills the training window: no response (see above)
            out.append(replace(c, messages=pm, input_ids=list(p), loss_mask=_prompt_mask(tok, pm, p, chat_template)))
            continue
        rec = done[k]
        resp = list(rec["ids"]) + ([int(rec["stop"])] if rec.get("stop") is not None else [])
        mask = _prompt_mask(tok, pm, p, chat_template) + [1] * len(resp)
        out.append(replace(c, messages=pm + [{"role": "assistant", "content": rec.get("response", "")}],
                           input_ids=list(p) + resp, loss_mask=mask))
    return out


def _record(tok, key: str, new: list[int], stop: int | None) -> dict:
    """One cache line: the generated ids, the stop id (None: cut by ``max_new_tokens``), the decoded text."""
    return {"key": key, "ids": [int(t) for t in new], "stop": stop,
            "response": tok.decode(new, skip_special_tokens=True)}


def _regenerate_locally(target, todo: dict[str, list[int]], done: dict, path: Path, max_new_tokens: int,
                        stops: list[int], temperature: float, top_p: float, batch_size: int | None, seed: int,
                        log, progress) -> None:
    """Our batched PyTorch loop over ``todo`` (key -> prompt ids); each batch appended to ``path`` and ``done``."""
    tok = target.tokenizer
    order = list(todo)
    batches = [[order[i] for i in b] for b in
               generation_batches(target, [len(todo[k]) for k in order], max_new_tokens, batch_size)]
    pad = tok.pad_token_id if tok.pad_token_id is not None else (stops[0] if stops else 0)
    t0, n_new, n_cut = time.time(), 0, 0
    with open_jsonl_append(path) as f:
        for bi, chunk in enumerate(batches):
            # one generator per prompt, seeded from (seed, prompt key): a prompt samples the same
            # response whichever prompts share its batch, so a resumed or extended run reproduces an
            # uninterrupted one and no two prompts replay one random stream. On the target's device:
            # generate_batch samples there (a CPU generator fails on CUDA).
            gens = [torch.Generator(device=target.device).manual_seed(prompt_seed(seed, k)) for k in chunk]
            outs = target.generate_batch([todo[k] for k in chunk], max_new_tokens, stops,
                                         temperature, top_p, generator=gens, pad_token_id=pad)
            for k, (new, stop) in zip(chunk, outs):
                n_new += len(new)
                n_cut += stop is None
                rec = _record(tok, k, new, stop)
                done[k] = rec
                f.write(json.dumps(rec) + "\n")
            f.flush()
            if progress:
                progress(sum(len(b) for b in batches[:bi + 1]), len(order))
    dt = time.time() - t0
    sizes = sorted(len(b) for b in batches)
    log(f"regeneration: {n_new} tokens in {dt:.1f}s ({n_new / max(dt, 1e-9):.1f} tokens/s, "
        f"{target.dtype}, {len(batches)} batches of {sizes[0]}-{sizes[-1]} prompts); "
        f"{n_cut} of {len(order)} responses cut by max_new_tokens={max_new_tokens} (no end-of-turn trained)")


def _regenerate_via_server(server: RegenerationServer, target, todo: dict[str, list[int]], done: dict, path: Path,
                           max_new_tokens: int, stops: list[int], temperature: float, top_p: float, seed: int,
                           log, progress) -> None:
    """``todo`` (key -> prompt ids) through ``server``, ``server.concurrency`` in flight; each response appended
    to ``path`` (flushed) and ``done`` as it arrives, so a killed run resumes with only the missing prompts."""
    tok = target.tokenizer
    ctx = max(len(p) for p in todo.values()) + max_new_tokens + 8
    reqs = {k: {"prompt": p, "max_new_tokens": max_new_tokens, "stops": stops, "temperature": temperature,
                "top_p": top_p, "seed": prompt_seed(seed, k), "vocab_size": target.vocab_size} for k, p in todo.items()}
    t0, stats = time.time(), {"new": 0, "cut": 0, "done": 0}
    with server.open(target, ctx, log) as client, open_jsonl_append(path) as f:
        def on_result(key: str, gen: Generated) -> None:
            rec = _record(tok, key, gen.ids, gen.stop)
            done[key] = rec
            f.write(json.dumps(rec) + "\n")
            f.flush()
            stats["new"] += len(gen.ids)
            stats["cut"] += gen.stop is None
            stats["done"] += 1
            if progress:
                progress(stats["done"], len(reqs))

        generate_all(client, reqs, server.concurrency, on_result)
    dt = time.time() - t0
    who = server.identity(target, log)
    log(f"regeneration: {stats['new']} tokens in {dt:.1f}s ({stats['new'] / max(dt, 1e-9):.1f} tokens/s, "
        f"{who['producer']}, {server.concurrency} in flight); {stats['cut']} of {len(reqs)} responses cut by "
        f"max_new_tokens={max_new_tokens} (no end-of-turn trained)")
