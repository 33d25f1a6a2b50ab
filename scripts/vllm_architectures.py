"""The tiny-architecture matrix served by vLLM itself: per architecture, a tiny random target of transformers' config
class (head_dim 32: vLLM's CPU attention takes no smaller), an EAGLE-3, a DFlash and a draft-model drafter trained
on it with the tiny recipes, and each served by vLLM (:func:`speculators.export.vllm_served.check_served_many`:
lossless against vLLM's plain output, accepted drafts per step equal to our loop's, the negative control told
apart). Prints one markdown row per architecture: what vLLM did, in its own words where it refused.

    python scripts/vllm_architectures.py                       # every architecture of speculators.target.tiny
    python scripts/vllm_architectures.py --arch qwen3 gpt_oss --families eagle3
"""

from __future__ import annotations

import argparse
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
OVERRIDES = {"eagle3": ["train.steps=20"], "dflash": ["train.steps=20"], "draft_model": ["train.steps=1"]}
#: tiny configs brought to what the real models of the architecture have and vLLM's CPU build needs: a head size of
#: 32 (its CPU attention takes no smaller), Gemma's tied head (vLLM's Gemma loaders place no lm_head), Llama 4's
#: attention chunk a multiple of vLLM's 128-token KV block
CONFIG = {"gemma2": {"head_dim": 32, "tie_word_embeddings": True}, "gemma3": {"head_dim": 32, "tie_word_embeddings": True},
          "gpt_oss": {"head_dim": 32}, "qwen3": {"head_dim": 32}, "qwen3_moe": {"head_dim": 32},
          "llama4_text": {"attention_chunk_size": 128}}


def main() -> None:
    from speculators.target.tiny import TINY_ARCHITECTURES

    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--arch", nargs="*", default=sorted(TINY_ARCHITECTURES))
    ap.add_argument("--families", nargs="*", default=list(OVERRIDES))
    ap.add_argument("--layers", type=int, default=4)
    args = ap.parse_args()

    sys.path.insert(0, str(ROOT / "tests"))
    from conftest import cli_train, load_smollm2_tokenizer  # the SmolLM2 tokenizer, cached; the CLI as a user runs it

    from speculators.export.vllm_served import check_served_many
    from speculators.target.tiny import tiny_architecture_model

    tok = load_smollm2_tokenizer()
    rows = []
    with tempfile.TemporaryDirectory(prefix="vllm-arch-") as tmp:
        for name in args.arch:
            d = Path(tmp) / name
            model = tiny_architecture_model(name, vocab_size=len(tok), hidden_size=128, num_layers=args.layers,
                                            config_overrides=CONFIG.get(name))
            model.config.eos_token_id = tok.eos_token_id
            model.save_pretrained(d / "target")
            tok.save_pretrained(d / "target")
            runs, cells = {}, {}
            for fam in args.families:
                try:
                    runs[fam] = cli_train(ROOT / f"recipes/tiny-{fam}.yaml", d / "target", d / fam,
                                          *OVERRIDES.get(fam, []))
                except AssertionError as e:  # our trainer refused or failed: say so in the row
                    cells[fam] = "not trained: " + str(e).splitlines()[-1][:120]
            if runs:
                for fam, r in zip(runs, check_served_many([p / "final" for p in runs.values()], num_prompts=2,
                                                          max_tokens=24, log=lambda m: print(m, flush=True))):
                    if r.passed:
                        a = r.acceptance
                        cells[fam] = (f"PASS ({a['steps_equal']}/{a['steps_compared']} steps equal, accepted "
                                      f"{a['vllm_per_pos']})")
                    else:
                        cells[fam] = "FAIL: " + (r.error or r.summary())[:160] if r.passed is False else \
                            "not run: " + (r.skipped or "")[:160]
            rows.append((name, cells))
            print(f"{name}: {cells}", flush=True)
    print("\n| architecture | " + " | ".join(args.families) + " |")
    print("|---|" + "---|" * len(args.families))
    for name, cells in rows:
        print(f"| {name} | " + " | ".join(cells.get(f, "") for f in args.families) + " |")


if __name__ == "__main__":
    main()
