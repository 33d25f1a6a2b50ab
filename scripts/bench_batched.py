"""Batched decoding throughput: the same prompts decoded at several batch sizes.

Runs :func:`speculators.decode.loop.speculative_generate` (continuous batching) over ``--prompts`` prompts
at each ``--batch`` size, plain decoding (``--proposer none``) and/or prompt-lookup speculative decoding
(``--proposer ngram``), greedy, and prints wall time, tokens/s, batched target forwards and the speedup
over the first batch size. Greedy outputs must be identical at every batch size and for every proposer
(exit status 1 when not).

    python scripts/bench_batched.py --target tiny --device cpu --batch 1 16
    python scripts/bench_batched.py --target smollm2-135m-instruct --batch 1 16 --max-new 48
    python scripts/bench_batched.py --target smollm2-sized --device cuda --dtype bfloat16 --batch 1 16 64

``--target``: ``tiny`` (a 4-layer random Llama, seconds), ``smollm2-sized`` (a random Llama with
SmolLM2-135M's shapes: 30 layers, hidden 576, vocab 49152; no download), or anything
:meth:`speculators.target.Target.load` takes.
"""

from __future__ import annotations

import argparse
import sys
import time

import torch

QUESTIONS = [
    "What is the capital of France?", "Explain photosynthesis in two sentences.", "Write a haiku about rain.",
    "How do I reverse a list in Python?", "Name three prime numbers.", "What does a CPU do?",
    "Give me a tip for learning a language.", "Why is the sky blue?", "Summarise the plot of Hamlet briefly.",
    "What is 17 times 3?", "Describe a cat to someone who has never seen one.", "What is an API?",
    "List the days of the week.", "How does a bicycle stay upright?", "What is machine learning?",
    "Suggest a name for a bakery.",
]


def build_target(name: str, device: str, dtype: str):
    from speculators.hardware import resolve_target_dtype
    from speculators.target import Target, build_tiny_target, torch_dtype

    dtype = resolve_target_dtype(dtype, device, log=lambda s: print(s, flush=True))  # ``auto``: the one rule
    if name in ("tiny", "smollm2-sized"):
        kw = dict(vocab_size=512, hidden_size=64, num_layers=4) if name == "tiny" else \
            dict(vocab_size=49152, hidden_size=576, num_layers=30)
        t = build_tiny_target(seed=0, **kw)
        head = torch.randn(t.vocab_size, t.hidden_size, generator=torch.Generator().manual_seed(1)) * 0.5
        t.model.lm_head.weight = torch.nn.Parameter(head, requires_grad=False)  # untied: varied greedy chains
        t.model.config.tie_word_embeddings = False
        t.model.to(device=device, dtype=torch_dtype(dtype))
        return t
    return Target.load(name, dtype=dtype, device=device, log=lambda s: print(s, flush=True))


def make_prompts(target, n: int) -> list[list[int]]:
    tok = target.tokenizer
    if tok is not None and getattr(tok, "chat_template", None):
        out = []
        for i in range(n):
            msgs = [{"role": "user", "content": QUESTIONS[i % len(QUESTIONS)]}]
            ids = tok.apply_chat_template(msgs, add_generation_prompt=True, tokenize=True)
            out.append(list(ids["input_ids"] if isinstance(ids, dict) or hasattr(ids, "keys") else ids))
        return out
    g = torch.Generator().manual_seed(0)
    return [torch.randint(0, target.vocab_size, (8 + (7 * i) % 33,), generator=g).tolist() for i in range(n)]


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--target", default="tiny")
    ap.add_argument("--device", default=None, help="default: cuda when available, else cpu")
    ap.add_argument("--dtype", default="float32", help="float32 | bfloat16 | float16 | auto (bf16 where fast here)")
    ap.add_argument("--prompts", type=int, default=16)
    ap.add_argument("--batch", type=int, nargs="+", default=[1, 16])
    ap.add_argument("--max-new", type=int, default=32)
    ap.add_argument("--k", type=int, default=3)
    ap.add_argument("--proposer", nargs="+", default=["none", "ngram"], choices=["none", "ngram"])
    ap.add_argument("--threads", type=int, default=0, help="torch CPU threads (0: torch's default)")
    ap.add_argument("--warmup", type=int, default=1, help="untimed runs at the largest batch first")
    a = ap.parse_args(argv)
    if a.threads:
        torch.set_num_threads(a.threads)

    from speculators.decode.loop import speculative_generate
    from speculators.decode.proposers import NGramProposer
    from speculators.target import resolve_device

    device = str(resolve_device(a.device))
    target = build_target(a.target, device, a.dtype)
    prompts = make_prompts(target, a.prompts)
    print(f"target {a.target} on {target.device} ({target.dtype}), {len(prompts)} prompts of "
          f"{min(map(len, prompts))}-{max(map(len, prompts))} tokens, max_new_tokens {a.max_new}, "
          f"torch threads {torch.get_num_threads()}", flush=True)

    def sync():
        if target.device.type == "cuda":
            torch.cuda.synchronize()

    status = 0
    ref = None  # greedy tokens of the first run: every run (any batch size, any proposer) must equal it
    for name in a.proposer:
        for _ in range(a.warmup):
            speculative_generate(target, None if name == "none" else NGramProposer(), prompts[:max(a.batch)], a.k,
                                 min(a.max_new, 8), None, max(a.batch), eos_ids=set())
        rows = []
        for bs in a.batch:
            prop = None if name == "none" else NGramProposer()
            sync()
            t0 = time.perf_counter()
            out = speculative_generate(target, prop, prompts, a.k, a.max_new, None, bs, eos_ids=set())
            sync()
            dt = time.perf_counter() - t0
            toks = [r.tokens for r in out.results]
            same = ref is None or toks == ref
            ref = ref or toks
            if not same:
                status = 1
            rows.append((bs, dt, out.tokens / dt, out.target_forwards, same))
        base = rows[0][1]
        print(f"\n{name}: | batch | seconds | tokens/s | batched forwards | speedup vs batch {a.batch[0]} | "
              f"greedy == first run ({a.proposer[0]}, batch {a.batch[0]}) |")
        for bs, dt, tps, fw, same in rows:
            print(f"{name}: | {bs} | {dt:.2f} | {tps:.1f} | {fw} | {base / dt:.2f}x | {'yes' if same else 'NO'} |",
                  flush=True)
    return status


if __name__ == "__main__":
    sys.exit(main())
