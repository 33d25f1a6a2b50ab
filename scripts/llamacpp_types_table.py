"""One table over several ``speculators eval --engine llama.cpp`` reports: the same drafter with the target served
in different weight types (``--target-type``), side by side.

Per report (a ``report.json`` or its directory), one row: the target GGUF, plain decoding's tokens/s, the
target's verify-cost curve T(n)/T(1) at n = 2, 3, 5 (llama-bench), the fastest drafter setting with its speedup and
tau, the best model-free type with its speedup, the fastest setting overall and whether the greedy check passed.
Then, per report and per K of its sweep, where a speculative step's time goes (the report's ``step_costs``,
recomputed from its rows when the report predates them).

    python scripts/llamacpp_types_table.py RUN/eval-llamacpp-q4_1 RUN/eval-llamacpp-q4_0 RUN/eval-llamacpp-q8_0
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))  # the speculators package of this checkout, not an installed one


def _load(path: str) -> dict:
    p = Path(path)
    p = p / "report.json" if p.is_dir() else p
    try:
        return json.loads(p.read_text())
    except (OSError, json.JSONDecodeError) as e:
        raise SystemExit(f"{p}: not a readable engine report ({e})") from None


def _f(x, spec=".2f") -> str:
    return "n/a" if x is None else format(x, spec)


def main(argv: list[str] | None = None) -> int:
    from speculators.engines.llamacpp_bench import step_costs

    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("reports", nargs="+", help="engine eval report directories or report.json files")
    args = ap.parse_args(argv)
    reports = [(r, _load(r)) for r in args.reports]
    print("| target | plain tok/s | T(2)/T(1) | T(3)/T(1) | T(5)/T(1) | fastest drafter setting | x plain | tau | "
          "best model-free | x plain | fastest overall | greedy check |")
    print("|---|---|---|---|---|---|---|---|---|---|---|---|")
    for name, rep in reports:
        rows = {r["label"]: r for r in rep["rows"]}
        ratio = dict(zip(*(rep["verify_cost"][f] for f in ("tokens", "ratio")))) if rep.get("verify_cost") else {}
        best, plain = rep["best"], rep["plain"]
        drafter = rows.get(best["row"]) or {}
        ngram = rows.get(best["ngram_best"]) or {}
        fastest = rep.get("fastest") or {}
        print(f"| {Path(rep.get('target_gguf') or name).name} | {_f(plain['tokens_per_s'], '.1f')} | {_f(ratio.get(2))} | "
              f"{_f(ratio.get(3))} | {_f(ratio.get(5))} | `{best['row']}` | {_f(drafter.get('speedup'))} | "
              f"{_f(drafter.get('tau'), '.3f')} | `{best['ngram_best']}` | {_f(ngram.get('speedup'))} | "
              f"`{fastest.get('row', 'n/a')}` | {'PASS' if rep['greedy_check']['passed'] else 'FAIL'} |")
    print()
    print("| target | K | tau | plain ms / token | ms per step | target forward | the rest | break-even tau | "
          "with free drafts |")
    print("|---|---|---|---|---|---|---|---|---|")
    for name, rep in reports:
        main_type = (rep.get("settings") or {}).get("draft_outtypes", [None])[0]
        costs = rep.get("step_costs") or step_costs(rep["rows"], rep.get("verify_cost"), main_type)
        for c in costs:
            print(f"| {Path(rep.get('target_gguf') or name).name} | {c['k']} | {_f(c['tau'], '.3f')} | "
                  f"{_f(c['plain_ms'])} | {_f(c['step_ms'])} | {_f(c['target_ms'])} | {_f(c['rest_ms'])} | "
                  f"{_f(c['break_even_tau'])} | {_f(c['free_draft_tau'])} |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
