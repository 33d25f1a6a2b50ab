"""Every given run's ``final/`` served by vLLM itself (:func:`speculators.export.vllm_served.check_served_many`):
lossless against vLLM's plain output, vLLM's accepted drafts per position beside our loop's on the same prompt ids,
and the head-perturbed negative control; one markdown row per run. Runs of one target and the same held-out prompts share one vLLM worker.

    python scripts/vllm_served_table.py outputs/smollm2-eagle3 outputs/smollm2-dflash --prompts 6 --max-tokens 64
"""

from __future__ import annotations

import argparse
from pathlib import Path


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("runs", nargs="+", help="run directories (their final/ is served) or checkpoint directories")
    ap.add_argument("--prompts", type=int, default=6, help="held-out prompts of each run's recipe")
    ap.add_argument("--max-tokens", type=int, default=64)
    ap.add_argument("--json", default=None, help="also write every result (ServedResult.to_json) to this file")
    args = ap.parse_args()

    from speculators.export.vllm_served import check_served_many
    from speculators.workflows import held_out_prompt_ids

    ckpts = [Path(r) / "final" if (Path(r) / "final" / "config.json").is_file() else Path(r) for r in args.runs]
    prompts = [held_out_prompt_ids(c, None, args.prompts, log=lambda m: None) for c in ckpts]
    groups: dict[str, list[int]] = {}  # runs whose recipes hold the same held-out prompts share a worker
    for i, p in enumerate(prompts):
        groups.setdefault(repr(p), []).append(i)
    res = [None] * len(ckpts)
    for idx in groups.values():
        for i, r in zip(idx, check_served_many([ckpts[i] for i in idx], prompts=prompts[idx[0]],
                                               num_prompts=args.prompts, max_tokens=args.max_tokens,
                                               log=lambda m: print(m, flush=True))):
            res[i] = r
    if args.json:
        import json

        Path(args.json).write_text(json.dumps([r.to_json() for r in res], indent=1, default=str))
    print("\n| run | method | K | lossless (equal to vLLM plain) | vLLM accepted per position | our loop's | "
          "steps equal | drafts equal | negative control | verdict |")
    print("|---|---|---|---|---|---|---|---|---|---|")
    for c, r in zip(ckpts, res):
        name = c.parent.name if c.name == "final" else c.name
        if r.skipped or r.error:
            print(f"| {name} | {r.method} | {r.k} | {r.skipped or r.error} | | | | | | "
                  f"{'FAIL' if r.error else 'not run'} |")
            continue
        a, g, ctl = r.acceptance, r.lossless, r.control
        d = a.get("drafts")
        drafts = "not recorded" if d is None else f"{d['equal']} of {d['compared']}"
        nc = (f"{ctl.get('vllm_per_pos')}: told apart" if ctl.get("breaks") else
              "NOT told apart" if ctl.get("informative") else "not informative")
        print(f"| {name} | `{r.method}` | {r.k} | {g['equal']} of {r.num_prompts} ({g['near_tie']} near-tie) | "
              f"{a['vllm_per_pos']} / {a['vllm_steps']} steps | {a['loop_per_pos']} / {a['loop_steps']} steps | "
              f"{a['steps_equal']} of {a['steps_compared']} | {drafts} | {nc} | {'PASS' if r.passed else 'FAIL'} |")


if __name__ == "__main__":
    main()
