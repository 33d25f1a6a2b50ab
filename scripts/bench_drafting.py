#!/usr/bin/env python
"""Benchmark EAGLE-3 drafting: the truly batched ``propose`` / ``advance`` vs the per-request loop.

For each model size and batch size B it builds B requests with different context lengths (the drafter's
KV caches hold ``--context`` +- 25% real-feature positions), then times one decoding step's drafter work:

  * propose - a chain of ``--k`` drafts for every request: ``Eagle3Drafter.propose(states, ks, ...)`` (ONE
              drafter forward per chain step for all requests) vs ``[_propose_one(state_i, k, ...)]``;
  * advance - appending ``--accepted`` + 1 verified positions per request: ``advance(states, ...)`` (ONE
              forward) vs ``[_advance_one(state_i, ...)]`` (on copies of the states, so every repeat
              starts from the same caches).

Times are milliseconds per decoding step (all B requests together), best of ``--repeats`` (filters out
preemption on a shared machine). The speedup column is loop / batched. Both paths give the same drafts
(checked once per row; tests/drafters/test_eagle3.py checks it precisely).

Models (random weights; only the shapes matter for the timings):
  * tiny    - ``build_tiny_target(vocab_size=96, hidden_size=64, num_layers=4)``, full draft vocabulary;
  * smollm2 - SmolLM2-135M shapes: hidden 576, 9 heads / 3 kv heads, MLP 1536, vocab 49152, draft
              vocabulary 4096 (4 target layers: the drafter only needs the aux features' shapes).

    python scripts/bench_drafting.py                       # tiny + smollm2 at B = 1, 4, 16
    python scripts/bench_drafting.py --models smollm2 --batch 1,16 --k 6 --temperature 0.7
    python scripts/bench_drafting.py --device cuda --threads 8
"""

from __future__ import annotations

import argparse
import copy
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from speculators.data.vocab import DraftVocab
from speculators.drafters import registry
from speculators.target import Target, TargetFeatures, build_tiny_target  # noqa: E402
from speculators.verify import SamplingParams  # noqa: E402


def smollm2_sized_target(num_layers: int = 4, seed: int = 0) -> Target:
    """A random Llama with SmolLM2-135M's widths (``num_layers`` decoder layers)."""
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(seed)
    cfg = LlamaConfig(vocab_size=49152, hidden_size=576, intermediate_size=1536, num_hidden_layers=num_layers,
                      num_attention_heads=9, num_key_value_heads=3, head_dim=64, max_position_embeddings=8192,
                      rms_norm_eps=1e-5, tie_word_embeddings=True, rope_theta=100000.0,
                      bos_token_id=None, eos_token_id=None, pad_token_id=None)
    return Target(LlamaForCausalLM(cfg).eval(), None, name_or_path=f"random-smollm2-shape-{seed}")


def make_setup(name: str, device: str):
    if name == "tiny":
        target, draft_vocab = build_tiny_target(vocab_size=96, hidden_size=64, num_layers=4, seed=1), None
    elif name == "smollm2":
        target, draft_vocab = smollm2_sized_target(), 4096
    else:
        raise SystemExit(f"--models: unknown model {name!r}; allowed: tiny, smollm2")
    cls = registry.get("eagle3")
    cfg = cls.config_class(algorithm="eagle3", draft_vocab_size=draft_vocab)
    counts = torch.arange(target.vocab_size, 0, -1)
    torch.manual_seed(0)
    d = cls.from_target(cfg, target, DraftVocab.from_counts(counts, draft_vocab))
    with torch.no_grad():
        for n, p in d.named_parameters():
            if p.requires_grad and "norm" not in n:
                p.normal_(0, 0.05)
    return target, d.to(device).eval()


def random_features(n: int, d, gen: torch.Generator) -> TargetFeatures:
    """Random target features for ``n`` positions (the timings do not depend on their values)."""
    dev = d.fc.weight.device
    aux = torch.randn(1, n, d.fc.in_features, generator=gen).to(dev)
    return TargetFeatures(aux, torch.zeros(1, n, 1, device=dev))


def best_ms(fn, repeats: int, sync) -> float:
    best = float("inf")
    for _ in range(repeats):
        sync()
        t0 = time.perf_counter()
        fn()
        sync()
        best = min(best, time.perf_counter() - t0)
    return best * 1e3


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--models", default="tiny,smollm2", help="comma list of: tiny, smollm2")
    ap.add_argument("--batch", default="1,4,16", help="comma list of batch sizes")
    ap.add_argument("--k", type=int, default=4, help="drafts per request and step")
    ap.add_argument("--accepted", type=int, default=2, help="accepted drafts per step (advance appends this + 1)")
    ap.add_argument("--context", type=int, default=256, help="mean context length of a request")
    ap.add_argument("--temperature", type=float, default=0.0, help="0 = greedy; > 0: seeded per-request sampling")
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--threads", type=int, default=1, help="torch CPU threads")
    ap.add_argument("--device", default="cpu")
    args = ap.parse_args(argv)
    torch.set_num_threads(args.threads)
    sync = torch.cuda.synchronize if args.device.startswith("cuda") else (lambda: None)
    batches = [int(b) for b in args.batch.split(",")]
    K, m = args.k, args.accepted + 1
    print(f"EAGLE-3 drafting, ms per decoding step (all B requests), best of {args.repeats}; K={K}, "
          f"advance m={m}, context ~{args.context}, temperature={args.temperature}, device={args.device}, "
          f"threads={args.threads}")
    header = (f"{'model':8} {'B':>3} | {'propose batched':>15} {'loop':>9} {'x':>6} | "
              f"{'advance batched':>15} {'loop':>9} {'x':>6} | {'step batched':>12} {'loop':>9} {'x':>6}")
    print(header)
    print("-" * len(header))
    for name in args.models.split(","):
        _, d = make_setup(name.strip(), args.device)
        V = d.t2d.numel()
        for B in batches:
            gen = torch.Generator().manual_seed(B)
            states = []
            for i in range(B):
                n = max(2, int(args.context * (0.75 + 0.5 * i / max(B - 1, 1))))
                ids = torch.randint(0, V, (n + 1,), generator=gen)
                states.append(d.start(ids, random_features(n, d, gen)))
            new_ids = [torch.randint(0, V, (m,), generator=gen) for _ in range(B)]
            feats = [random_features(m, d, gen) for _ in range(B)]
            ks = [K] * B
            sampling = None
            if args.temperature > 0:
                sampling = SamplingParams.uniform(B, args.temperature)

            def gens():
                return None if sampling is None else [torch.Generator().manual_seed(i) for i in range(B)]

            def one(i, g):
                s1 = None if sampling is None else SamplingParams.uniform(1, args.temperature)
                return d._propose_one(states[i], K, s1, None if g is None else g[i])

            with torch.no_grad():
                g1, g2 = gens(), gens()
                a = [p.token_ids.tolist() for p in d.propose(states, ks, sampling, g1)]
                b = [one(i, g2).token_ids.tolist() for i in range(B)]
                same = "" if a == b else "  (drafts differ!)"
                pb = best_ms(lambda: d.propose(states, ks, sampling, gens()), args.repeats, sync)
                pl = best_ms(lambda: [one(i, g) for g in [gens()] for i in range(B)], args.repeats, sync)
                copies = [copy.deepcopy(states) for _ in range(2 * args.repeats)]
                it = iter(copies)
                ab = best_ms(lambda: d.advance(next(it), new_ids, feats), args.repeats, sync)
                al = best_ms(lambda: [d._advance_one(s, x, f) for s, x, f in zip(next(it), new_ids, feats)],
                             args.repeats, sync)
            print(f"{name:8} {B:>3} | {pb:>15.2f} {pl:>9.2f} {pl / pb:>6.2f} | {ab:>15.2f} {al:>9.2f} "
                  f"{al / ab:>6.2f} | {pb + ab:>12.2f} {pl + al:>9.2f} {(pl + al) / (pb + ab):>6.2f}{same}")


if __name__ == "__main__":
    main()
