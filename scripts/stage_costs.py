"""Where the hours of a data-scaled training run go: each stage's cost per assistant token, measured on a sample.

Runs ``speculators train RECIPE`` on a sample of the recipe's data from COLD caches (a fresh ``SPECULATORS_CACHE``;
only the converted target is reused, it is not a stage) and times every stage of the real pipeline, in process:

* ``self-synthesis``: the target writing user messages (``source: self``,
  :func:`speculators.data.selfsynth.synthesize_prompts`); tokens = sampled message tokens;
* ``regeneration``: the target answering every prompt (:func:`speculators.data.regenerate.regenerate`, our loop or
  the recipe's ``data.regeneration.server``); tokens = generated answer tokens, stop tokens included;
* ``features``: aux hidden states, top hidden state and argmax over every token
  (:func:`speculators.data.features.extract_features`); tokens = all tokens of the examples;
* ``training``: ``--train-steps`` optimizer steps (:class:`speculators.train.trainer.Trainer`), the forward,
  backward and optimizer step of each timed, the first (warm-up) and the final held-out evaluation and checkpoint
  not; tokens = the real tokens of the timed steps' batches.

Per stage: tokens, wall seconds, CPU seconds (``time.process_time``: every thread of this process; a
regeneration server's own process is NOT counted, so use the recipe's own loop here or
``scripts/bench_regenerate_server.py`` for servers), tokens per CPU-second, and the CPU-hours the stage would
take for ``--assistant-tokens`` (default one million) assistant tokens of training data with the sample's mix of
sources: a stage's CPU seconds per training assistant token of the sample times that number (training: per token
times an epoch's tokens times the recipe's epochs; n/a for a recipe that sets ``train.steps``). The sample is ``--prompts`` prompts per source (``max_examples`` / a
``source: self`` entry's ``synth.num_prompts``, never more than the recipe's); regeneration batches grow with the
number of prompts (memory-chosen, up to 256 rows), so a small sample understates the regeneration of a full run.

``--also-every-row`` then trains again in the same process on the same (now cached) data with the family's
``labelled_rows_only`` switch off (EAGLE-3: every TTT step and output head on every row, what its training computed
before the row selection) and prints that row and the ratio of the two: a ratio from one run.

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

    synth, regen, feats = pipeline.synthesize_prompts, pipeline.regenerate, pipeline.extract_features
    T = trainer_mod.Trainer
    train, backward, step = T.train, T._backward_window, T._optimizer_step

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
        train_info.update(epoch_tokens=self.data.train.num_tokens, assistant=self.data.train.num_loss_tokens)
        return train(self, *a, **k)

    steps = {"seen": 0}  # optimizer steps begun; the first one (warm-up: allocations, kernel choice) is not timed

    def backward_window(self, window, *a, **k):
        steps["seen"] += 1
        if steps["seen"] == 1:
            return backward(self, window, *a, **k)
        with clock.timing("training"):
            out = backward(self, window, *a, **k)
        clock.tokens["training"] += sum(int(b.attention_mask.sum()) for b in window)
        return out

    def optimizer_step(self, *a, **k):
        if steps["seen"] <= 1:
            return step(self, *a, **k)
        with clock.timing("training"):
            return step(self, *a, **k)

    pipeline.synthesize_prompts, pipeline.regenerate, pipeline.extract_features = \
        synthesize_prompts, regenerate, extract_features
    T.train, T._backward_window, T._optimizer_step = trainer_train, backward_window, optimizer_step

    def undo():
        pipeline.synthesize_prompts, pipeline.regenerate, pipeline.extract_features = synth, regen, feats
        T.train, T._backward_window, T._optimizer_step = train, backward, step
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


def cost_rows(clock: StageClock, train_info: dict, epochs: float | None, per: float) -> list[list[str]]:
    """Table rows per stage: tokens, wall s, CPU s, tokens per CPU-s, CPU-hours for ``per`` assistant tokens: a data
    stage's CPU seconds per training assistant token (``train_info["assistant"]``) times ``per``; training's CPU
    seconds per timed token times an epoch's tokens (``train_info["epoch_tokens"]``) times ``epochs``, per assistant
    token. ``n/a`` where a denominator is zero or the recipe has no epochs (it sets ``train.steps``)."""
    rows = []
    a = train_info.get("assistant") or 0
    for st in STAGES:
        tok, cpu, wall = clock.tokens[st], clock.cpu[st], clock.wall[st]
        if tok == 0 and cpu == 0:
            continue
        rate = f"{tok / cpu:.1f}" if cpu > 0 else "n/a"
        if st == "training":
            ok = a and tok and epochs
            scale = cpu / tok * train_info.get("epoch_tokens", 0) * epochs * per / a if ok else None
        else:
            scale = cpu * per / a if a else None
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


def rows_switch(algorithm: str):
    """The drafter class of ``algorithm`` when its training loss has the ``labelled_rows_only`` switch.

    Raises:
        SystemExit: it has none (its loss computes every row anyway), naming the family.
    """
    from speculators.drafters import registry

    cls = registry.get(algorithm)
    if not isinstance(getattr(cls, "labelled_rows_only", None), bool):
        raise SystemExit(f"--also-every-row: the {algorithm} drafter's loss has no labelled_rows_only switch")
    return cls


def every_row_training(sample, out: Path, train_info: dict) -> StageClock:
    """Train ``sample`` again (its data now cached) with the family's ``labelled_rows_only`` off, timed by a clock
    of its own (the same steps; the first, warm-up, not timed)."""
    from speculators import workflows

    cls = rows_switch(sample.drafter.algorithm)
    clock = StageClock()
    undo = instrument(clock, dict(train_info))
    before, cls.labelled_rows_only = cls.labelled_rows_only, False
    try:
        workflows.train_run(sample, out, overwrite=True, log=lambda m: print(m, flush=True))
    finally:
        cls.labelled_rows_only = before
        undo()
    return clock


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("recipe")
    ap.add_argument("--prompts", type=int, default=256, help="prompts per source (default 256)")
    ap.add_argument("--train-steps", type=int, default=20,
                    help="optimizer steps run (default 20; the first, warm-up, is not timed)")
    ap.add_argument("--assistant-tokens", type=float, default=1e6, help="extrapolate to this many (default 1e6)")
    ap.add_argument("--set", dest="overrides", action="append", default=[], metavar="KEY=VALUE",
                    help="recipe override (repeatable), applied before the sample caps")
    ap.add_argument("--keep-cache", metavar="DIR", help="use (and keep) this cache directory instead of a fresh one")
    ap.add_argument("--also-every-row", action="store_true",
                    help="then train again, in this process on the same data, with the family's training loss on "
                         "every row (labelled_rows_only = False: what training computed before the row selection) "
                         "and print that row and the ratio")
    args = ap.parse_args()

    from speculators.recipe import load_recipe
    from speculators.utils import cache_root

    recipe = load_recipe(args.recipe, args.overrides)
    epochs = recipe.train.epochs if recipe.train.steps is None else None
    overrides = [*args.overrides, *sample_overrides(recipe, args.prompts), f"train.steps={args.train_steps}",
                 "train.parity_check=false", "train.eval_every=1000000", "train.checkpoint_every=1000000"]
    sample = load_recipe(args.recipe, overrides)
    if args.also_every_row:
        rows_switch(sample.drafter.algorithm)  # refuse before any work
    if args.train_steps < 2:
        raise SystemExit("--train-steps: at least 2 (the first step is a warm-up and is not timed)")
    warm = bool(args.keep_cache) and Path(args.keep_cache).is_dir() and any(Path(args.keep_cache).iterdir())
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
        undo()
        every_row = every_row_training(sample, out, train_info) if args.also_every_row else None
    finally:
        undo()
        if not args.keep_cache:
            shutil.rmtree(root, ignore_errors=True)
    per = args.assistant_tokens
    print(f"\n{args.recipe}: {args.prompts} prompts per source, {args.train_steps} training steps; "
          f"{train_info.get('assistant', 0)} training assistant tokens of {train_info.get('epoch_tokens', 0)}; "
          f"epochs {epochs if epochs is not None else 'n/a (the recipe sets train.steps)'}; "
          f"{machine()}")
    if warm:
        print(f"cache {root} was not empty: a data stage that hit it shows the cached tokens with the CPU time of "
              "reading them (only a cold run measures the data stages)")
    print(f"\n| stage | tokens | wall s | CPU s | tokens/CPU-s | CPU-h per {per:,.0f} assistant tokens |")
    print("|---|---|---|---|---|---|")
    rows = cost_rows(clock, train_info, epochs, per)
    if every_row is not None:
        rows += [["training, every row", *r[1:]] for r in cost_rows(every_row, train_info, epochs, per)
                 if r[0] == "training"]
    for row in rows:
        print("| " + " | ".join(row) + " |")
    if every_row is not None and clock.cpu["training"] > 0:
        print(f"\ntraining CPU seconds, every row / labelled rows only: "
              f"{every_row.cpu['training'] / clock.cpu['training']:.2f}x (wall "
              f"{every_row.wall['training'] / max(clock.wall['training'], 1e-9):.2f}x)")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
