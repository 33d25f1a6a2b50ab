"""What a speculative step costs inside llama.cpp, against a plain token, for any target: the break-even tau.

A drafter pays in an engine only when its tau exceeds (cost of one speculative step) / (cost of one plain
token). This script measures both in ``llama-server`` for a target without training anything: it builds an
UNTRAINED drafter of a family llama.cpp serves (default EAGLE-3, the family's default aux taps, a draft
vocabulary of ``--draft-vocab`` tokens) for the target, converts it with llama.cpp's converter, and serves
plain decoding and the drafter at each K (``--spec-draft-n-max``, ``p_min`` 0, so every step drafts K tokens;
an untrained draft is rejected, so each step is one verify forward over K + 1 tokens plus K draft forwards).
Printed per K: ms per plain token, ms per speculative step (the server's generation time over its target
forwards), and the break-even tau. A trained drafter's tau (our loop's eval) above that number is a speedup
in this engine; below it, a slowdown.

    python scripts/bench_llamacpp_step_cost.py --target smollm2-135m-instruct --ks 1,2,4
    python scripts/bench_llamacpp_step_cost.py --target gemma3-270m --draft-vocab 8192 --ks 1,2,4

Needs ``make llama-cpp``. A target whose llama.cpp graph exposes no layer inputs (Gemma 3 in llama.cpp of
llama-cpp-python 0.3.36) aborts the server at the first drafted request; the script then prints the server's
assertion. Run it alone on the machine: llama.cpp's threads spin-wait, and another busy
process slows them far more than its share of the cores.
"""

from __future__ import annotations

import argparse
import sys
import tempfile
from pathlib import Path

import torch


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--target", default="smollm2-135m-instruct", help="target: alias, .gguf file or HF directory")
    ap.add_argument("--algorithm", default="eagle3", help="drafter family llama.cpp serves (eagle3, dflash, dspark)")
    ap.add_argument("--draft-vocab", type=int, default=4096, help="draft vocabulary size (0: the full vocabulary)")
    ap.add_argument("--ks", default="1,2,4", help="K values, comma-separated")
    ap.add_argument("--prompts", type=int, default=4, help="prompts (chatterbot questions)")
    ap.add_argument("--max-new-tokens", type=int, default=64)
    ap.add_argument("--outtype", default="f16", help="draft GGUF type")
    ap.add_argument("--threads", type=int, default=None, help="llama-server --threads (default: all cores)")
    args = ap.parse_args(argv)

    from speculators.data.vocab import DraftVocab
    from speculators.drafters import registry
    from speculators.engines.gguf_export import export_gguf, spec_type_of, target_files
    from speculators.engines.llamacpp_build import require_llama_cpp
    from speculators.engines.llamacpp_server import LlamaServer
    from speculators.errors import SpeculatorsError
    from speculators.target import Target

    ks = [int(k) for k in args.ks.split(",") if k.strip()]
    lc = require_llama_cpp()
    cls = registry.get(args.algorithm)
    if cls.serving.llamacpp_spec_type is None:
        raise SystemExit(f"--algorithm {args.algorithm}: {cls.serving.llamacpp_note}")
    with tempfile.TemporaryDirectory(prefix="bench-llamacpp-") as tmp:
        tmp = Path(tmp)
        gguf, hf = target_files(args.target, lc, tmp, log=lambda m: None)
        target = Target.load(args.target, dtype="float32", log=lambda m: None)
        size = args.draft_vocab or None
        over = {"draft_vocab_size": size} if size and "draft_vocab_size" in cls.config_class.model_fields else {}
        cfg = cls.config_class(algorithm=cls.algorithm, **over)
        target.aux_layer_ids = cls.serving.default_aux_layer_ids(target.num_layers, cfg)
        torch.manual_seed(0)
        vocab = DraftVocab.from_counts(torch.arange(target.vocab_size, 0, -1), size)
        ckpt = cls.from_target(cfg, target, vocab).save_pretrained(tmp / "drafter")
        spec = spec_type_of(ckpt)
        draft = export_gguf(ckpt, tmp / f"draft-{args.outtype}.gguf", hf, lc, args.outtype, log=lambda m: None)
        tok = target.tokenizer
        questions = ["What is your favourite book?", "How do I sort a list in Python?", "Tell me about the moon.",
                     "Why is the sky blue?", "Write a haiku about rain.", "What is a prime number?"]
        prompts = [tok.apply_chat_template([{"role": "user", "content": q}], add_generation_prompt=True)
                   if tok.chat_template else tok(q)["input_ids"] for q in questions[:args.prompts]]
        prompts = [list(p["input_ids"] if hasattr(p, "keys") else p) for p in prompts]
        del target

        def run(**kw):
            with LlamaServer(lc, gguf, threads=args.threads, **kw) as srv:
                srv.complete(prompts[0], 8)
                outs = [srv.complete(p, args.max_new_tokens) for p in prompts]
            tokens = sum(len(o.tokens) for o in outs)
            secs = sum(o.seconds for o in outs)
            fwd = sum(o.steps for o in outs)
            return tokens, secs, fwd, sum(o.draft_n for o in outs), sum(o.draft_accepted for o in outs)

        t, s, st, _, _ = run()
        if not st or not s:
            print(f"plain decoding emitted {t} token(s): no decode step to time (raise --max-new-tokens)")
            return 1
        token_ms = 1000 * s / st
        print(f"target {args.target} ({gguf.name}), draft {cls.algorithm} {args.outtype}, draft vocabulary "
              f"{vocab.size}, {len(prompts)} prompts x {args.max_new_tokens} tokens, llama.cpp {lc.version}")
        print(f"plain: {st / s:.1f} tok/s (decode steps), {token_ms:.2f} ms per token")
        print("| K | ms per speculative step | drafted / step | accepted | break-even tau (step / token) |")
        print("|---|---|---|---|---|")
        for k in ks:
            try:
                t, s, fwd, drafted, acc = run(draft=draft, spec_type=spec, draft_n_max=k, p_min=0.0)
            except SpeculatorsError as e:
                print(f"llama-server failed with the draft at K={k}: {e}")
                return 1
            if not fwd:
                print(f"| {k} | n/a | n/a | {acc} / {drafted} | n/a |")
                continue
            step_ms = 1000 * s / fwd
            print(f"| {k} | {step_ms:.2f} | {drafted / fwd:.2f} | {acc} / {drafted} | {step_ms / token_ms:.2f} |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
