"""Where the hours of a data-scaled training run go: each stage's cost per assistant token, measured on a sample.

Runs ``speculators train RECIPE`` on a sample of the recipe's data from COLD caches (a fresh ``SPECULATORS_CACHE``;
only the converted target is reused, it is not a stage) and times every stage of the real pipeline, in process:

* ``self-synthesis``: the target writing user messages (``source: self``,
  :func:`speculators.data.selfsynth.synthesize_prompts`); tokens = sampled message tokens;
* ``regeneration``: the target answering every prompt (:func:`speculators.data.regenerate.regenerate`, our loop or
  the recipe's ``data.regeneration.server``); tokens = generated answer tokens, stop tokens included;
* ``features``: aux hidden states, top hidden state and argmax over every token
  (:func:`speculators.data.features.extract_features`); tokens = all tokens of the examples;
* ``training``: ``--train-steps`` optimizer steps (:class:`speculators.train.trainer.Trainer`); tokens = the
  tokens of those steps' batches (an epoch's tokens / its batches, per step).

Per stage: tokens, wall seconds, CPU seconds (``time.process_time``: every thread of this process; a
regeneration server's own process is NOT counted, so use the recipe's own loop here or
``scripts/bench_regenerate_server.py`` for servers), tokens per CPU-second, and the CPU-hours the stage would
take for ``--assistant-tokens`` (default one million) assistant tokens of training data with the sample's mix of
sources: a stage's CPU seconds per training assistant token of the sample times that number (training: per
epoch, times the recipe's epochs). The sample is ``--prompts`` prompts per source (``max_examples`` / a
``source: self`` entry's ``synth.num_prompts``, never more than the recipe's); regeneration batches grow with the
number of prompts (memory-chosen, up to 256 rows), so a small sample understates the regeneration of a full run.

    python scripts/stage_costs.py recipes/smollm2-eagle3-scale.yaml                 # 256 prompts per source
    python scripts/stage_costs.py recipes/smollm2-eagle3.yaml --prompts 64 --train-steps 10
"""

from __future__ import annotations

import argparse
import contextlib
import os
import shutil
import tempfile
import time
from pathlib import Path

STAGES = ("self-synthesis", "regeneration", "features", "training")


class StageClock:
    """Wall and process-CPU seconds and tokens per stage, summed over every call of the stage."""

    def __init__(self):
        self.wall = dict.fromkeys(STAGES, 0.0)
        self.cpu = dict.fromkeys(STAGES, 0.0)
        self.tokens = dict.fromkeys(STAGES, 0)

    @contextlib.contextmanager
    def timing(self, stage: str):
        w, c = time.perf_counter(), time.process_time()
        try:
            yield
        finally:
            self.wall[stage] += time.perf_counter() - w
            self.cpu[stage] += time.process_time() - c


def response_tokens(conv) -> int:
    """The answer tokens of a regenerated conversation: the trailing run of 1s of its loss mask (the response ids
    and the stop id; the prompt's last tokens, the assistant header, are never in the loss)."""
    n = 0
    for m in reversed(conv.loss_mask or []):
        if not m:
            break
        n += 1
    return n


def instrument(clock: StageClock, train_info: dict):
    """Wrap the pipeline's stage functions and the trainer with ``clock``; returns the undo callable."""
    from speculators.data import pipeline
    from speculators.train import trainer as trainer_mod

    synth, regen, feats, train = (pipeline.synthesize_prompts, pipeline.regenerate, pipeline.extract_features,
                                  trainer_mod.Trainer.train)

    def synthesize_prompts(*a, **k):
        import json

        from speculators.utils import cache_root

        def lines(path: Path) -> list[str]:
            return path.read_text().splitlines() if path.is_file() else []

        # a warm cache holds the batches of earlier runs too: count only the lines this call appends
        before = {p: len(lines(p)) for p in (cache_root() / "selfsynth").glob("*.jsonl")}
        with clock.timing("self-synthesis"):
            res = synth(*a, **k)
        path = Path(res.cache_file)
        for line in lines(path)[before.get(path, 0):]:
            clock.tokens["self-synthesis"] += sum(len(s["ids"]) + (s["stop"] is not None)
                                                  for s in json.loads(line)["samples"])
        return res

    def regenerate(*a, **k):
        with clock.timing("regeneration"):
            out = regen(*a, **k)
        clock.tokens["regeneration"] += sum(response_tokens(c) for c in out)
        return out

    def extract_features(target, examples, *a, **k):
        with clock.timing("features"):
            store = feats(target, examples, *a, **k)
        clock.tokens["features"] += sum(len(e.input_ids) for e in examples)
        return store

    def trainer_train(self, *a, **k):
        train_info.update(steps=self.total_steps, batches_per_epoch=self.batches_per_epoch,
                          epoch_tokens=self.data.train.num_tokens, assistant=self.data.train.num_loss_tokens)
        with clock.timing("training"):
            out = train(self, *a, **k)
        clock.tokens["training"] += round(self.total_steps * self.data.train.num_tokens / self.batches_per_epoch)
        return out

    pipeline.synthesize_prompts, pipeline.regenerate, pipeline.extract_features = \
        synthesize_prompts, regenerate, extract_features
    trainer_mod.Trainer.train = trainer_train

    def undo():
        pipeline.synthesize_prompts, pipeline.regenerate, pipeline.extract_features = synth, regen, feats
        trainer_mod.Trainer.train = train
    return undo


def sample_overrides(recipe, n: int) -> list[str]:
    """``--set`` overrides that cap every source of ``recipe`` at ``n`` prompts (never above its own cap)."""
    out = []
    for i, s in enumerate(recipe.data.sources):
        if getattr(s, "synth", None) is not None:
            out.append(f"data.sources.{i}.synth.num_prompts={min(n, s.synth.num_prompts)}")
        else:
            cap = s.max_examples if s.max_examples is not None else n
            out.append(f"data.sources.{i}.max_examples={min(n, cap)}")
    return out


def cost_rows(clock: StageClock, train_info: dict, epochs: float, per: float) -> list[list[str]]:
    """Table rows per stage: tokens, wall s, CPU s, tokens per CPU-s, CPU-hours for ``per`` assistant tokens."""
    rows = []
    a = train_info.get("assistant") or 0
    for st in STAGES:
        tok, cpu, wall = clock.tokens[st], clock.cpu[st], clock.wall[st]
        if tok == 0 and cpu == 0:
            continue
        rate = f"{tok / cpu:.1f}" if cpu > 0 else "n/a"
        scale = cpu * per / a if a else None
        if st == "training" and scale is not None:
            steps = train_info["steps"]
            scale = scale / steps * train_info["batches_per_epoch"] * epochs if steps else None
        rows.append([st, str(tok), f"{wall:.1f}", f"{cpu:.1f}", rate,
                     f"{scale / 3600:.4g}" if scale is not None else "n/a"])
    return rows


def machine() -> str:
    """CPU model, its bf16 instruction sets, cores and torch threads (for the table's heading)."""
    import platform

    import torch

    info = Path("/proc/cpuinfo").read_text() if Path("/proc/cpuinfo").is_file() else ""
    model = next((ln.split(":", 1)[1].strip() for ln in info.splitlines() if ln.startswith("model name")),
                 platform.processor() or "unknown CPU")
    isa = [f for f in ("avx512_bf16", "amx_bf16") if f in info] or ["no bf16 instructions"]
    return f"{model} ({', '.join(isa)}), {os.cpu_count()} cores, torch threads {torch.get_num_threads()}"


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("recipe")
    ap.add_argument("--prompts", type=int, default=256, help="prompts per source (default 256)")
    ap.add_argument("--train-steps", type=int, default=20, help="optimizer steps timed (default 20)")
    ap.add_argument("--assistant-tokens", type=float, default=1e6, help="extrapolate to this many (default 1e6)")
    ap.add_argument("--set", dest="overrides", action="append", default=[], metavar="KEY=VALUE",
                    help="recipe override (repeatable), applied before the sample caps")
    ap.add_argument("--keep-cache", metavar="DIR", help="use (and keep) this cache directory instead of a fresh one")
    args = ap.parse_args()

    from speculators.recipe import load_recipe
    from speculators.utils import cache_root

    recipe = load_recipe(args.recipe, args.overrides)
    epochs = recipe.train.epochs if recipe.train.steps is None else None
    overrides = [*args.overrides, *sample_overrides(recipe, args.prompts), f"train.steps={args.train_steps}",
                 "train.parity_check=false", "train.eval_every=1000000", "train.checkpoint_every=1000000"]
    sample = load_recipe(args.recipe, overrides)
    old_root = cache_root()
    root = Path(args.keep_cache) if args.keep_cache else Path(tempfile.mkdtemp(prefix="stage-costs-"))
    root.mkdir(parents=True, exist_ok=True)
    for sub in ("targets", "llama.cpp"):  # the converted target is not a stage: reuse it
        if (old_root / sub).is_dir() and not (root / sub).exists():
            (root / sub).symlink_to(old_root / sub)
    os.environ["SPECULATORS_CACHE"] = str(root)
    clock, train_info = StageClock(), {}
    undo = instrument(clock, train_info)
    out = root / "run"
    try:
        from speculators import workflows

        workflows.train_run(sample, out, overwrite=True, log=lambda m: print(m, flush=True))
    finally:
        undo()
        if not args.keep_cache:
            shutil.rmtree(root, ignore_errors=True)
    per = args.assistant_tokens
    print(f"\n{args.recipe}: {args.prompts} prompts per source, {args.train_steps} training steps; "
          f"{train_info.get('assistant', 0)} training assistant tokens of {train_info.get('epoch_tokens', 0)}; "
          f"epochs {epochs if epochs is not None else 'n/a (the recipe sets train.steps)'}; "
          f"{machine()}")
    print(f"\n| stage | tokens | wall s | CPU s | tokens/CPU-s | CPU-h per {per:,.0f} assistant tokens |")
    print("|---|---|---|---|---|---|")
    for row in cost_rows(clock, train_info, epochs or 0.0, per):
        print("| " + " | ".join(row) + " |")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
