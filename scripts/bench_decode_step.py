#!/usr/bin/env python
"""Framework overhead of one decoding step, eager against static-cache + ``torch.compile``, in one run.

Three tables (``--threads`` CPU threads; nothing else should run on the machine):

1. Target forward per step through the decode session speculative decoding uses
   (:meth:`speculators.target.Target.batch_session`: DynamicCache, aux taps by forward hooks, rejected
   drafts rolled back by ``keep``) against the same model over a transformers ``StaticCache`` with the
   decoder + lm_head compiled by ``torch.compile`` (``dynamic=False``, one graph per (batch, m) shape,
   inductor ``freezing`` unless ``--no-freezing``; aux taps read from ``output_hidden_states``; the
   cache rolled back by ``StaticCache.crop``): ms per step of ``m = 1`` (plain decoding) and
   ``m = K + 1`` (a verify) new tokens per row after a ``--context``-token prompt, at each
   ``--batch``, the compile seconds, and the largest |logit| difference and argmax agreement of the
   compiled step against the eager one on the same tokens.
2. The memory-bandwidth bound of a 1-token step: the bytes of the weights one step reads (every
   decoder layer, the final norm and the output head; a tied input embedding counted once) over the
   read bandwidth measured here (a ``sum`` streaming a buffer larger than the caches), and each batch-1
   1-token step's ratio to it; with the target's linear layers alone (``F.linear`` over one row, every
   weight once in forward order, streamed from memory as in the step): step - linears = what attention,
   norms, the cache and the framework add.
3. EAGLE-3 drafting per decoding step (``advance`` of ``--accepted`` + 1 verified tokens, then
   ``propose`` of K drafts; batch 1, greedy): the eager path against the same drafter with its
   decoder-stack step (``_forward_ragged``) and head (``_head``) compiled, ms per step, compile seconds,
   and whether the compiled drafts equal the eager ones. The drafter is ``--drafter`` (a run directory
   or checkpoint) or a freshly initialised EAGLE-3 for the target's shapes (``--draft-vocab`` rows,
   float32 as training writes it): only shapes matter for time.

Every timing is the median of ``--reps`` (min in brackets); rows of a table run in the same process, so
ratios hold on a busy machine better than absolute times. ``--no-compile`` prints the eager columns
only. Compiling needs a C++ compiler (gcc) for inductor's CPU code.

    python scripts/bench_decode_step.py                                 # SmolLM2-135M, bf16, K=4
    python scripts/bench_decode_step.py --dtype float32 --batch 1 --k 8 --threads 2
    python scripts/bench_decode_step.py --drafter outputs/smollm2-eagle3

Timing only; nothing is written.
"""

from __future__ import annotations

import argparse
import copy
import statistics
import sys
import time
from pathlib import Path
from types import SimpleNamespace

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parent))
from bench_verify_cost import read_bandwidth  # noqa: E402  (the read-bandwidth measurement, once)


def timed(fn, reps: int, warmup: int = 2, setup=None) -> tuple[float, float]:
    """``(median ms, min ms)`` of ``fn(setup())`` (``fn()`` without ``setup``) over ``reps`` calls after
    ``warmup`` calls; ``setup`` runs outside the timing."""
    ts = []
    for i in range(warmup + reps):
        arg = () if setup is None else (setup(),)
        t0 = time.perf_counter()
        fn(*arg)
        if i >= warmup:
            ts.append(time.perf_counter() - t0)
    return 1e3 * statistics.median(ts), 1e3 * min(ts)


def step_weight_bytes(target) -> int:
    """Bytes of the weights one 1-token target step reads: every parameter of the model once (shared
    tensors once), without the input embedding unless it is also the output head (tied)."""
    model = target.model
    seen, total = set(), 0
    for p in model.parameters():
        if p.data_ptr() not in seen:
            seen.add(p.data_ptr())
            total += p.numel() * p.element_size()
    emb = model.get_input_embeddings().weight
    if emb.data_ptr() != target.lm_head_weight.data_ptr():
        total -= emb.numel() * emb.element_size()
    return total


def linears_alone(target, m: int, reps: int) -> tuple[float, float]:
    """``(median ms, min ms)`` of every linear layer of the target (and the output head), in forward order,
    on an ``[m, in]`` input: the step's matrix products alone, their weights streamed from memory as in
    the step (each weight once per pass), without attention, norms or framework code."""
    ws = [mod.weight for mod in target.decoder.modules() if isinstance(mod, torch.nn.Linear)] + [target.lm_head_weight]
    xs = {w.shape[1]: torch.randn(m, w.shape[1]).to(w.dtype) for w in ws}

    def run():
        for w in ws:
            torch.nn.functional.linear(xs[w.shape[1]], w)

    return timed(run, reps)


def eager_target(target, batch: int, m: int, context: int, reps: int, gen: torch.Generator):
    """Eager session step: ``(median ms, min ms, logits [batch*m, V] of the last step)``."""
    V = target.vocab_size
    ctx = torch.randint(0, V, (batch, context), generator=gen)
    new = torch.randint(0, V, (batch, m), generator=gen)
    sess = target.batch_session(batch)
    sess.add_many(list(range(batch)), [ctx[b].tolist() for b in range(batch)])
    out = {}

    def step():
        logits, _ = sess.forward(list(range(batch)), [new[b] for b in range(batch)])
        for b in range(batch):
            sess.keep(b, context)
        out["logits"] = torch.cat(logits)

    med, best = timed(step, reps)
    return med, best, out["logits"], ctx, new


def compiled_target(target, ctx: torch.Tensor, new: torch.Tensor, reps: int):
    """The same step over a ``StaticCache`` with the decoder + head compiled:
    ``(median ms, min ms, compile s, logits [batch*m, V])``."""
    from transformers import StaticCache

    model, ids_aux = target.model, list(target.aux_layer_ids)
    batch, context = ctx.shape
    m = new.shape[1]
    cache = StaticCache(config=model.config, max_cache_len=context + m)
    with torch.no_grad():
        target.decoder(input_ids=ctx, position_ids=torch.arange(context).expand(batch, context), cache=cache,
                       use_cache=True)

    def step(ids, pos):
        out = target.decoder(input_ids=ids, position_ids=pos, cache=cache, use_cache=True, output_hidden_states=True)
        aux = torch.cat([out.hidden_states[i + 1] for i in ids_aux], dim=-1)
        return target.lm_head(out.last_hidden_state).float(), aux

    fn = torch.compile(step, dynamic=False)
    pos = (context + torch.arange(m)).expand(batch, m)
    res = {}

    def run():
        res["logits"], _ = fn(new, pos)
        cache.crop(-m)  # roll the m new tokens back (StaticCache: the next update overwrites them)

    t0 = time.perf_counter()
    run()
    compile_s = time.perf_counter() - t0
    med, best = timed(run, reps)
    return med, best, compile_s, res["logits"].reshape(batch * m, -1)


def repay_steps(eager_ms: float, compiled_ms: float, compile_s: float) -> str:
    """Steps after which the compile time is repaid by the faster step, or "n/a" (not faster)."""
    saved = eager_ms - compiled_ms
    return f"{1e3 * compile_s / saved:.0f}" if saved > 0 else "n/a"


def build_drafter(args, target):
    """``--drafter`` loaded, or a fresh EAGLE-3 for the target's shapes (random draft vocabulary)."""
    from speculators.drafters import Drafter
    from speculators.drafters.eagle3 import Eagle3Config, Eagle3Drafter

    if args.drafter:
        from speculators.workflows import resolve_checkpoint

        return Drafter.from_pretrained(resolve_checkpoint(args.drafter, log=lambda m: None)).eval()
    from speculators.data.vocab import DraftVocab

    counts = torch.randint(0, 1000, (target.vocab_size,), generator=torch.Generator().manual_seed(0))
    n = min(args.draft_vocab, target.vocab_size)
    cfg = Eagle3Config(algorithm="eagle3", draft_vocab_size=n)
    return Eagle3Drafter.from_target(cfg, target, DraftVocab.from_counts(counts, n)).float().eval()


def drafting(args, target, gen: torch.Generator) -> list[str]:
    """Table 3 rows: eager and compiled drafting step (advance + propose K) of one drafter."""
    d = build_drafter(args, target)
    width = d.meta.hidden_size * len(d.meta.aux_layer_ids)
    V = d.meta.vocab_size
    ctx = torch.randint(0, V, (args.context + 1,), generator=gen)
    new = torch.randint(0, V, (args.accepted + 1,), generator=gen)
    feats = SimpleNamespace(aux=torch.randn(1, args.accepted + 1, width, generator=gen))
    state = d.start(ctx, SimpleNamespace(aux=torch.randn(1, args.context, width, generator=gen)))
    res = {}

    def step(s=None):
        s = copy.deepcopy(state) if s is None else s
        d.advance([s], [new], [feats])
        res["drafts"] = d.propose([s], [args.k])[0].token_ids

    fresh = lambda: copy.deepcopy(state)  # noqa: E731
    med, best = timed(step, args.reps, setup=fresh)
    eager_drafts = res["drafts"]
    rows = [f"| eager | {med:.2f} ({best:.2f}) | - | - | - | 1.00 |"]
    if args.compile:
        d._forward_ragged = torch.compile(d._forward_ragged)
        d._head = torch.compile(d._head)
        t0 = time.perf_counter()
        for _ in range(3):  # context lengths differ per call: automatic dynamic shapes after the second
            step()
        compile_s = time.perf_counter() - t0
        cmed, cbest = timed(step, args.reps, setup=fresh)
        same = "yes" if torch.equal(res["drafts"], eager_drafts) else "NO"
        rows.append(f"| compiled | {cmed:.2f} ({cbest:.2f}) | {compile_s:.0f} | {repay_steps(med, cmed, compile_s)} | "
                    f"{same} | {cmed / med:.2f} |")
    return rows


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default="smollm2-135m-instruct", help="target: alias, hub id, dir or .gguf")
    ap.add_argument("--dtype", default="bfloat16", help="target dtype: float32 | bfloat16 | float16 | auto")
    ap.add_argument("-k", "--k", type=int, default=4, help="drafts per step (K); a verify step is K + 1 tokens")
    ap.add_argument("--batch", type=int, nargs="+", default=[1, 4], help="batch sizes of the target table")
    ap.add_argument("--context", type=int, default=128, help="prompt tokens before the timed step")
    ap.add_argument("--accepted", type=int, default=1, help="accepted drafts per step (advance appends this + 1)")
    ap.add_argument("--drafter", default=None, help="run dir / checkpoint (default: a fresh EAGLE-3)")
    ap.add_argument("--draft-vocab", type=int, default=4096, help="draft vocabulary of the fresh EAGLE-3")
    ap.add_argument("--reps", type=int, default=20)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--bandwidth-mb", type=int, default=1024, help="size of the tensor the read bandwidth sums "
                    "(larger than the caches)")
    ap.add_argument("--no-compile", dest="compile", action="store_false", help="eager columns only")
    ap.add_argument("--no-freezing", dest="freezing", action="store_false",
                    help="compile without inductor freezing (weights as graph inputs)")
    ap.add_argument("--no-target", dest="target", action="store_false", help="skip tables 1 and 2")
    ap.add_argument("--no-drafting", dest="drafting", action="store_false", help="skip table 3")
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    torch._inductor.config.freezing = args.freezing
    torch.set_grad_enabled(False)
    from speculators.target import Target

    target = Target.load(args.model, dtype=args.dtype, log=lambda m: None)
    gen = torch.Generator().manual_seed(0)
    dtype = str(target.dtype).removeprefix("torch.")  # ``auto`` resolved by Target.load
    print(f"{args.model} {dtype}, {target.num_layers} layers, hidden {target.hidden_size}; context "
          f"{args.context}, K={args.k}; {args.threads} CPU thread(s); median of {args.reps} ms (min)\n")
    if args.target:
        target_table(args, target, gen)
    if args.drafting:
        print(f"\nEAGLE-3 drafting per step: advance {args.accepted + 1} tokens + propose K={args.k}, batch 1, greedy")
        print("| path | ms/step | compile s | steps to repay | same drafts | / eager |\n|---|---|---|---|---|---|")
        for row in drafting(args, target, gen):
            print(row)


def target_table(args, target, gen: torch.Generator) -> None:
    """Tables 1 and 2: target step times, eager and compiled, and the bandwidth bound."""
    print("| batch | tokens/row | eager ms | compiled ms | compiled/eager | compile s | steps to repay | "
          "max abs logit diff | argmax agree |")
    print("|---|---|---|---|---|---|---|---|---|")
    plain = {}
    for B in args.batch:
        for m in (1, args.k + 1):
            med, best, logits, ctx, new = eager_target(target, B, m, args.context, args.reps, gen)
            cells = ["-"] * 6
            if args.compile:
                cmed, cbest, cs, clog = compiled_target(target, ctx, new, args.reps)
                diff = float((clog - logits).abs().max())
                agree = float((clog.argmax(-1) == logits.argmax(-1)).float().mean())
                cells = [f"{cmed:.2f} ({cbest:.2f})", f"{cmed / med:.2f}", f"{cs:.0f}", repay_steps(med, cmed, cs),
                         f"{diff:.3g}", f"{agree:.2f}"]
            if B == 1 and m == 1:
                plain["eager"] = med
                if args.compile:
                    plain["compiled"] = cmed
            print(f"| {B} | {m} | {med:.2f} ({best:.2f}) | " + " | ".join(cells) + " |")
    lin, lin_best = linears_alone(target, 1, args.reps)
    nbytes = step_weight_bytes(target)
    bw = read_bandwidth(args.bandwidth_mb, 5, torch.float32)  # the one rule of scripts/bench_verify_cost.py (median)
    bound = 1e3 * nbytes / bw
    print(f"\nweights read per 1-token step: {nbytes / 2 ** 20:.0f} MiB; read bandwidth {bw / 1e9:.1f} GB/s; "
          f"bound {bound:.2f} ms/token")
    print("| plain decoding, batch 1 | ms/token | / bound |\n|---|---|---|")
    for name, ms in plain.items():
        print(f"| {name} step | {ms:.2f} | {ms / bound:.2f} |")
    print(f"| its linear layers alone (1 row, min {lin_best:.2f}) | {lin:.2f} | {lin / bound:.2f} |")


if __name__ == "__main__":
    main()
