#!/usr/bin/env python
"""Greedy losslessness per target dtype: how many speculative outputs leave plain greedy decoding, and
whether each one sits on a near-tie of the target's logits (:mod:`speculators.evaluation.greedy_check`) or is a
verifier failure.

For every dtype of ``--dtype`` the target is loaded, ``--num-prompts`` prompts (HumanEval, then
chatterbot; rendered with the target's chat template) are decoded plainly and with the model-free
proposers (``--methods``: n-gram, suffix) for every K of ``--k`` through :func:`speculators.evaluation.runner.run_eval`,
at batch 1 and ``--batch-size``; with ``--checkpoint`` the checkpoint's drafter is decoded too (its recipe's
target is the one loaded, unless ``--target`` says otherwise). Two tables are printed:

1. per dtype, method, K and batch size: outputs compared, mismatches, near-ties, verifier failures;
2. every mismatch: prompt, method, K, batch, first diverging token, plain greedy's token and the other
   output's, the logit gap, the top-2 gaps (sequential / verify-shaped forward), the shapes' drift and the
   rounding bound, and the verdict.

In float32 every mismatch counts as a failure (a correct verifier gives none); in bfloat16 near-ties are
expected where a verify forward rounds differently from a 1-token forward, failures are not.

    python scripts/check_greedy_precision.py                              # SmolLM2-135M, fp32 and bf16
    python scripts/check_greedy_precision.py --num-prompts 48 --k 2,4 --max-new-tokens 128
    python scripts/check_greedy_precision.py --checkpoint outputs/smollm2-eagle3 --dtype bfloat16
    python scripts/check_greedy_precision.py --checkpoint outputs/smollm2-eagle3 --dtype float32 --methods "" \
        --tree depth=4,topk=4,total_tokens=16 --tree depth=4,topk=8,total_tokens=32   # draft trees too

Nothing is written; the counts do not depend on the machine's load (the tokens/s in the log do).
"""

from __future__ import annotations

import argparse


def _prompts(target, n: int) -> list[dict]:
    from speculators.data.pipeline import unique_prompts
    from speculators.data.sources import load_source

    out: list[dict] = []
    for src in ("humaneval", "chatterbot"):
        if len(out) >= n:
            break
        out += unique_prompts(load_source(src), target.tokenizer, None, limit=n - len(out))
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--target", default=None, help="target model (default: smollm2-135m-instruct, or the checkpoint's)")
    ap.add_argument("--checkpoint", default=None, help="also decode with this checkpoint's drafter")
    ap.add_argument("--dtype", default="float32,bfloat16", help="comma-separated target dtypes (auto allowed)")
    ap.add_argument("--k", default="4", help="comma-separated K values")
    ap.add_argument("--methods", default="ngram,suffix", help="comma-separated model-free methods")
    ap.add_argument("--num-prompts", type=int, default=12)
    ap.add_argument("--max-new-tokens", type=int, default=64)
    ap.add_argument("--batch-size", type=int, default=1)
    ap.add_argument("--threads", type=int, default=None)
    ap.add_argument("--tree", action="append", default=[], help="with --checkpoint: also decode with the drafter "
                    "drafting this tree per step (repeatable; depth=D,topk=K,total_tokens=N or a vLLM "
                    "speculative_token_tree literal)")
    args = ap.parse_args()

    import torch

    from speculators.evaluation.runner import run_eval
    from speculators.evaluation.settings import EvalSettings
    from speculators.hardware import resolve_target_dtype
    from speculators.target import Target
    from speculators.decode.tree_spec import TreeSpec

    if args.threads:
        torch.set_num_threads(args.threads)
    ks = [int(x) for x in args.k.split(",")]
    methods = tuple(m for m in args.methods.split(",") if m)
    trees = [TreeSpec.parse(t) for t in args.tree]
    summary, details = [], []
    for name in args.dtype.split(","):
        dtype = resolve_target_dtype(name)
        drafter, ref = None, args.target or "smollm2-135m-instruct"
        if args.checkpoint:
            from speculators.recipe import load_recipe
            from speculators.evaluation.loading import load_for_eval
            from speculators.workflows import resolve_checkpoint

            ckpt = resolve_checkpoint(args.checkpoint)
            rec = load_recipe(ckpt / "recipe.yaml") if (ckpt / "recipe.yaml").is_file() else None
            drafter, target, _ = load_for_eval(ckpt, rec, args.target, "cpu", print, dtype)
        else:
            target = Target.load(ref, dtype)
        prompts = _prompts(target, args.num_prompts)
        rep = run_eval(target, drafter, prompts, EvalSettings(ks, args.max_new_tokens, eos_ids=None, batch_size=args.batch_size, methods=(("drafter",) if drafter is not None else ()) + methods, trees=trees if drafter is not None else ()), log=print)
        mm = rep["greedy_mismatches"]
        for b in rep["batch_sizes"]:
            for m in ["plain"] + list(rep["methods"]):
                for k in ([0] if m == "plain" else ks):
                    if m == "plain" and b == 1:
                        continue  # the reference itself
                    rows = [x for x in mm if x["proposer"] == m and x["k"] == k and x["batch_size"] == b]
                    nt = sum(bool(x["near_tie"]) for x in rows)
                    summary.append((dtype, m, k, b, len(prompts), len(rows), nt, len(rows) - nt))
            for t in trees if drafter is not None else ():
                rows = [x for x in mm if x["proposer"] == f"drafter tree {t.label}" and x["batch_size"] == b]
                nt = sum(bool(x["near_tie"]) for x in rows)
                summary.append((dtype, f"tree {t.label}", t.depth, b, len(prompts), len(rows), nt, len(rows) - nt))
        details += [(dtype, x) for x in mm]
        del target, drafter

    print("\nGreedy check per dtype, method, K and batch size (outputs compared with plain greedy at batch 1)")
    print(f"{'dtype':<9} {'method':<26} {'K':>2} {'batch':>5} {'outputs':>7} {'mismatch':>8} {'near-tie':>8} {'failures':>8}")
    for row in summary:
        print(f"{row[0]:<9} {row[1]:<26} {row[2]:>2} {row[3]:>5} {row[4]:>7} {row[5]:>8} {row[6]:>8} {row[7]:>8}")
    if details:
        print("\nMismatches (logits at the first diverging token; gaps in logit units)")
        print(f"{'dtype':<9} {'prompt':<14} {'method':<8} {'K':>2} {'b':>2} {'pos':>4} {'plain':>6} {'other':>6} "
              f"{'gap':>8} {'top2 seq':>8} {'top2 ver':>8} {'drift':>8} {'bound':>8}  verdict")
        for dtype, x in details:
            sh = x.get("shapes") or {}

            def f(v):
                return "-" if v is None else f"{v:8.4f}"

            print(f"{dtype:<9} {str(x['prompt'])[:14]:<14} {x['proposer']:<8} {x['k']:>2} {x['batch_size']:>2} "
                  f"{x['first_diff']:>4} {str(x['reference_token']):>6} {str(x['output_token']):>6} "
                  f"{f(x.get('logit_gap')):>8} {f(sh.get('sequential', {}).get('top2_gap')):>8} "
                  f"{f(sh.get('verify', {}).get('top2_gap')):>8} {f(x.get('shape_drift')):>8} "
                  f"{f(x.get('rounding_bound')):>8}  {'near-tie' if x['near_tie'] else 'FAILURE'}")


if __name__ == "__main__":
    main()
