"""Write a run's held-out prompts to one JSONL file per recipe source, for a per-source eval.

``speculators eval RUN --num-prompts N`` scores the FIRST N held-out prompts, in the order of the
recipe's sources, so on a multi-source recipe a small N measures only the first source. With one file
per source, ``speculators eval RUN --prompts DIR/a.jsonl --prompts DIR/b.jsonl --num-prompts N``
scores at most N prompts of EACH source and breaks tau down by source (report ``by_source``).

    python scripts/export_held_out.py outputs/smollm2-eagle3-large --output outputs/held-out-large

Each line is ``{"id": ..., "messages": [...]}`` (OpenAI messages: the prompt, without the answer).
A ``source: self`` entry needs the target: its synthesized prompts are read from the cache the training
run wrote (on a cache miss, e.g. another target or chat template, they are synthesized again, which takes
minutes on a CPU; the log says so). Prints one row per source: prompts written. Files are written
atomically (a temporary name, then a rename).
"""

from __future__ import annotations

import argparse
import json
import re
import sys
from collections import Counter
from pathlib import Path


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("run_dir", type=Path, help="a run directory (its recipe.yaml defines the split)")
    ap.add_argument("--output", type=Path, required=True, help="directory for SOURCE.jsonl files")
    args = ap.parse_args(argv)

    from speculators.data.pipeline import held_out_prompts, load_data
    from speculators.hardware import resolve_target_dtype
    from speculators.recipe import load_recipe
    from speculators.target import Target
    from speculators.utils import atomic_write_text

    recipe_path = args.run_dir / "recipe.yaml"
    if not recipe_path.is_file():
        sys.exit(f"{args.run_dir}: no recipe.yaml (not a run directory written by `speculators train`)")
    rec = load_recipe(recipe_path)
    # the recipe's target.dtype (``auto`` by default) resolved by the one rule training used, so a ``source: self``
    # entry reads the prompts the run cached for this target and dtype
    dtype = resolve_target_dtype(rec.target.dtype, log=print)
    target = Target.load(rec.target.model, dtype, rec.target.aux_layer_ids, log=print, device_map=rec.target.device_map)
    loaded = load_data(rec.data, log=print, target=target)
    prompts = held_out_prompts(rec.data, target.tokenizer, loaded[0], dropped_groups=loaded.dropped_groups)
    if not prompts:
        sys.exit(f"{recipe_path}: no held-out prompts (data.held_out.fraction = 0)")
    by_source: dict[str, list[dict]] = {}
    for p in prompts:
        by_source.setdefault(p["source"], []).append({"id": p["id"], "messages": p["messages"]})
    args.output.mkdir(parents=True, exist_ok=True)
    names = Counter()
    print("| source | held-out prompts | file |\n|---|---|---|")
    for source, rows in by_source.items():
        stem = re.sub(r"[^A-Za-z0-9_.-]+", "-", source).strip("-") or "source"
        names[stem] += 1
        if names[stem] > 1:
            stem = f"{stem}-{names[stem]}"
        path = args.output / f"{stem}.jsonl"
        atomic_write_text(path, "".join(json.dumps(r, ensure_ascii=False) + "\n" for r in rows))
        print(f"| {source} | {len(rows)} | {path} |")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
