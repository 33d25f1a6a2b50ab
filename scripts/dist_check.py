"""Distributed-training check for a CUDA machine, run by ``scripts/gpu_check.sh``.

For each accelerate config named (``recipes/accelerate/<name>.yaml``: ddp, fsdp, deepspeed_zero2,
deepspeed_zero3), train a tiny EAGLE-3 drafter through ``accelerate launch`` with a global batch of 2
micro-batches (``P`` processes x ``grad_accum = 2 / P``) and compare every step's ``train/loss`` with a
1-process run of the same global batch (fp32, 1e-4 relative); then kill a copy after its step-2
checkpoint (``SPECULATORS_TEST_CRASH_AT_STEP``), ``--resume`` it and compare again. ``P`` is 2 where
there are two GPUs or none (CPU processes over gloo: DDP, FSDP2 through ``speculators.train.fsdp``, DeepSpeed
on its CPU accelerator), else 1 (FSDP and DeepSpeed still wrap the unit with world size 1; DDP needs 2
GPUs and is skipped with one). The test suite runs the CPU cases in tests/train/test_distributed.py,
tests/train/test_fsdp.py and tests/train/test_deepspeed.py. Self-contained, no download: a tiny random Llama target with a small
byte-level BPE tokenizer trained here and synthetic chat data.

Prints one table row per config: processes, status, largest relative loss difference (full run and
resumed run). Exit status 1 if any run failed or differed.

    python scripts/dist_check.py --configs ddp fsdp deepspeed_zero2 deepspeed_zero3
    python scripts/dist_check.py --dry-run   # CPU: each config loads with accelerate; target, data and the
                                             # 1-process reference run are built (no engine run)
"""

from __future__ import annotations

import argparse
import importlib
import json
import os
import random
import shutil
import socket
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
TINY = ROOT / "recipes" / "tiny-eagle3.yaml"
STEPS, CRASH_AT, RTOL = 4, 2, 1e-4
CHATML = ("{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endfor %}"
          "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")


def build_inputs(work: Path) -> tuple[Path, Path]:
    """A tiny target directory (random 4-layer Llama, hidden 64, a 400-token byte-level BPE tokenizer
    with a ChatML template) and a JSONL of 24 synthetic conversations: ``(target_dir, data_file)``."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    from speculators.target import build_tiny_target

    rng = random.Random(0)
    words = "the a drafter target token speculative decoding verifier accepts rejects model fast slow".split()
    convs = [{"messages": [{"role": "user", "content": " ".join(rng.choices(words, k=8)) + "?"},
                           {"role": "assistant", "content": " ".join(rng.choices(words, k=30)) + "."}]}
             for _ in range(24)]
    data = work / "data.jsonl"
    data.write_text("".join(json.dumps(c) + "\n" for c in convs))
    bpe = Tokenizer(models.BPE())
    bpe.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    bpe.decoder = decoders.ByteLevel()
    bpe.train_from_iterator([m["content"] for c in convs for m in c["messages"]] + ["user assistant system"],
                            trainers.BpeTrainer(vocab_size=400, special_tokens=["<|im_start|>", "<|im_end|>", "<pad>"],
                                                initial_alphabet=pre_tokenizers.ByteLevel.alphabet()))
    tok = PreTrainedTokenizerFast(tokenizer_object=bpe, eos_token="<|im_end|>", pad_token="<pad>")
    tok.chat_template = CHATML
    target = work / "target"
    t = build_tiny_target(vocab_size=len(tok), hidden_size=64, num_layers=4, seed=0)  # EAGLE-3 taps 3 layers
    t.model.config.eos_token_id, t.model.config.pad_token_id = tok.eos_token_id, tok.pad_token_id
    t.model.save_pretrained(target)
    tok.save_pretrained(target)
    return target, data


def _no_gate() -> tuple[str, ...]:
    """Skip the end-of-training export gate (a check of its own, not of the engines) where the recipe has it."""
    from speculators.recipe import TrainSpec

    return ("train.parity_check=false",) if "parity_check" in TrainSpec.model_fields else ()


def _port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def train(out: Path, target: Path, data: Path, config: str | None, processes: int, *extra: str,
          crash_at: int | None = None, timeout: int = 300) -> tuple[int, str]:
    """One ``speculators train`` run (``config`` None: a plain 1-process run); ``(exit status, output)``."""
    args = ["-m", "speculators.cli", "train", str(TINY), f"target.model={target}", f"data.sources=[{data}]",
            "data.regenerate=false", "drafter.draft_vocab_size=null", "data.held_out.fraction=0.1",
            f"train.steps={STEPS}", "train.checkpoint_every=2", "train.eval_every=100",
            f"train.grad_accum={2 // processes}", "train.report_to=[]", *_no_gate(), "-o", str(out), *extra]
    cmd = [sys.executable, *args] if config is None else [
        sys.executable, "-m", "accelerate.commands.launch", "--config_file",
        str(ROOT / "recipes" / "accelerate" / f"{config}.yaml"), "--num_processes", str(processes),
        "--main_process_port", str(_port()), *args]
    env = {**os.environ, "SPECULATORS_NO_PROGRESS": "1", "HF_HUB_OFFLINE": "1", "OMP_NUM_THREADS": "1",
           "SPECULATORS_CACHE": str(out.parent / "cache"), "TOKENIZERS_PARALLELISM": "false"}
    env.pop("SPECULATORS_TEST_CRASH_AT_STEP", None)
    if crash_at is not None:
        env["SPECULATORS_TEST_CRASH_AT_STEP"] = str(crash_at)
    try:
        p = subprocess.run(cmd, env=env, cwd=out.parent, capture_output=True, text=True, timeout=timeout)
    except subprocess.TimeoutExpired as e:
        return 124, f"timed out after {timeout}s\n{e.stdout or ''}"
    return p.returncode, p.stdout + p.stderr


def losses(run: Path) -> dict[int, float]:
    rows = [json.loads(x) for x in (run / "train_log.jsonl").read_text().splitlines()]
    return {r["step"]: r["train/loss"] for r in rows if "train/loss" in r}


def max_rel(a: dict[int, float], b: dict[int, float]) -> float:
    if sorted(a) != sorted(b):
        return float("inf")
    return max(abs(a[s] - b[s]) / max(abs(b[s]), 1e-12) for s in a)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--configs", nargs="+", default=["ddp", "fsdp", "deepspeed_zero2", "deepspeed_zero3"])
    ap.add_argument("--processes", type=int, default=None, help="default: 2 with two GPUs or none (CPU), else 1")
    ap.add_argument("--work", default="outputs/dist-check")
    ap.add_argument("--dry-run", action="store_true")
    a = ap.parse_args()
    import torch
    from accelerate.commands.config.config_args import load_config_from_file

    work = Path(a.work).resolve()
    shutil.rmtree(work, ignore_errors=True)
    work.mkdir(parents=True)
    for name in a.configs:  # every config loads with this accelerate (and names what docs/DISTRIBUTED.md says)
        cfg = load_config_from_file(str(ROOT / "recipes" / "accelerate" / f"{name}.yaml"))
        print(f"config {name}: distributed_type {cfg.distributed_type}, num_processes {cfg.num_processes}")
    target, data = build_inputs(work)
    rc, out = train(work / "reference", target, data, None, 1)
    if rc != 0:
        print(out[-4000:])
        print("| reference (1 process) | FAILED |")
        return 1
    ref = losses(work / "reference")
    print(f"reference (1 process, grad_accum 2): losses {ref}")
    if a.dry_run:
        print("| config | processes | status |\n|---|---|---|")
        for name in a.configs:
            print(f"| {name} | - | dry run: config loads (not launched on CPU) |")
        return 0
    n_gpu = torch.cuda.device_count()
    procs = a.processes or (2 if n_gpu >= 2 or n_gpu == 0 else 1)
    status = 0
    rows = []
    for name in a.configs:
        if name == "ddp" and procs < 2 and n_gpu:
            rows.append((name, procs, "skipped: DDP needs 2 GPUs", "-", "-"))
            continue
        if name.startswith("deepspeed"):
            try:
                importlib.import_module("deepspeed")
            except ImportError:
                rows.append((name, procs, "skipped: deepspeed not installed (pip install 'speculators[deepspeed]')",
                             "-", "-"))
                continue
        full, crashed = work / f"{name}-full", work / f"{name}-crashed"
        rc, out = train(full, target, data, name, procs)
        if rc != 0:
            print(f"== {name} full run failed:\n{out[-4000:]}")
            rows.append((name, procs, f"FAILED (exit {rc})", "-", "-"))
            status = 1
            continue
        d_full = max_rel(losses(full), ref)
        rc, out = train(crashed, target, data, name, procs, crash_at=CRASH_AT)
        rc2, out2 = train(crashed, target, data, name, procs, "--resume") if rc != 0 else (rc, "not killed")
        d_res = max_rel(losses(crashed), ref) if rc2 == 0 else float("inf")
        if rc2 != 0:
            print(f"== {name} resume failed:\n{out[-2000:]}\n{out2[-4000:]}")
        ok = d_full <= RTOL and d_res <= RTOL
        status |= 0 if ok else 1
        rows.append((name, procs, "ok" if ok else "DIFFERS", f"{d_full:.2e}", f"{d_res:.2e}"))
    print("| config | processes | status | max rel loss diff | after kill + resume |\n|---|---|---|---|---|")
    for r in rows:
        print("| " + " | ".join(str(x) for x in r) + " |")
    return status


if __name__ == "__main__":
    sys.exit(main())
