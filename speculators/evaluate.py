"""Acceptance statistics and reports from real speculative generation.

For each held-out prompt the target decodes plainly, then speculatively with the drafter, then with
the n-gram (prompt lookup) proposer. Reported (ALGORITHMS.md, "Acceptance metrics"): tau (mean
acceptance length, bonus included), acceptance rate (accepted / drafted), per-position acceptance
``acc_k = P(draft k accepted)``, conditional per-position acceptance, tokens/s of each method and the
speedup over plain decoding, and at temperature 0 the number of prompts whose speculative output
differs from plain greedy decoding (must be zero: lossless).
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path

from .utils import atomic_dir


@dataclass
class AcceptanceStats:
    """Accumulates verification steps of one proposer over many prompts.

    Attributes:
        k: max drafts per step (num_speculative_tokens).
        steps: number of verification steps (target forwards after prefill).
        emitted: tokens emitted by those steps (accepted + 1 each).
        drafted, accepted: totals over steps.
        pos_drafted[i], pos_accepted[i]: steps that drafted / accepted at least i+1 tokens.
    """

    k: int
    steps: int = 0
    emitted: int = 0
    drafted: int = 0
    accepted: int = 0
    tokens: int = 0
    seconds: float = 0.0
    pos_drafted: list[int] = field(default_factory=list)
    pos_accepted: list[int] = field(default_factory=list)
    pos_reached: list[int] = field(default_factory=list)

    def __post_init__(self):
        self.pos_drafted = self.pos_drafted or [0] * self.k
        self.pos_accepted = self.pos_accepted or [0] * self.k
        self.pos_reached = self.pos_reached or [0] * self.k

    def add(self, result) -> None:
        """Add a :class:`speculators.generate.GenerationResult`."""
        self.tokens += len(result.tokens)
        self.seconds += result.seconds
        for a, n in zip(result.accepted, result.drafted):
            self.steps += 1
            self.emitted += a + 1
            self.drafted += n
            self.accepted += a
            for i in range(n):
                self.pos_drafted[i] += 1
                if a >= i:  # drafts 1..i all accepted and draft i+1 proposed: it was verified
                    self.pos_reached[i] += 1
            for i in range(a):
                self.pos_accepted[i] += 1

    @property
    def tau(self) -> float:
        return self.emitted / self.steps if self.steps else 1.0

    @property
    def acceptance_rate(self) -> float:
        return self.accepted / self.drafted if self.drafted else 0.0

    @property
    def per_position(self) -> list[float]:
        """``acc_k``: fraction of steps that drafted >= k tokens in which draft k was accepted."""
        return [a / d if d else 0.0 for a, d in zip(self.pos_accepted, self.pos_drafted)]

    @property
    def conditional(self) -> list[float]:
        """P(draft k accepted | draft k proposed and drafts 1..k-1 accepted)."""
        return [a / r if r else 0.0 for a, r in zip(self.pos_accepted, self.pos_reached)]

    @property
    def tokens_per_s(self) -> float:
        return self.tokens / self.seconds if self.seconds else 0.0

    def as_dict(self) -> dict:
        return {"tau": self.tau, "acceptance_rate": self.acceptance_rate, "per_position": self.per_position,
                "conditional": self.conditional, "steps": self.steps, "drafted": self.drafted,
                "accepted": self.accepted, "tokens": self.tokens, "seconds": self.seconds,
                "tokens_per_s": self.tokens_per_s}


def run_eval(target, drafter, prompts: list[dict], k: int, max_new_tokens: int, sampling, ngram_max: int = 3,
             seed: int = 0, log=print, progress=None) -> dict:
    """Decode every prompt plainly, with ``drafter`` and with the n-gram proposer; return the report dict.

    Args:
        prompts: ``[{"id", "input_ids"}]`` rendered prompts.
        sampling: :class:`speculators.generate.Sampling`.
    Returns:
        A JSON-serialisable report (see :func:`write_report`).
    """
    from .generate import NGramProposer, plain_decode, speculative_decode

    plain = AcceptanceStats(k)
    spec = AcceptanceStats(k)
    ngram = AcceptanceStats(k)
    mismatches = []
    greedy = sampling.temperature == 0.0
    ng = NGramProposer(max_n=ngram_max)
    for i, p in enumerate(prompts):
        ids = p["input_ids"]
        r_plain = plain_decode(target, ids, max_new_tokens, sampling, seed=seed + i)
        r_spec = speculative_decode(target, drafter, ids, k, max_new_tokens, sampling, seed=seed + i)
        r_ng = speculative_decode(target, ng, ids, k, max_new_tokens, sampling, seed=seed + i)
        plain.add(r_plain)
        spec.add(r_spec)
        ngram.add(r_ng)
        if greedy:
            for name, r in (("drafter", r_spec), ("ngram", r_ng)):
                if r.tokens != r_plain.tokens:
                    first = next((j for j, (a, b) in enumerate(zip(r.tokens, r_plain.tokens)) if a != b),
                                 min(len(r.tokens), len(r_plain.tokens)))
                    mismatches.append({"prompt": p["id"], "proposer": name, "first_diff": first})
        if progress:
            progress(i + 1, len(prompts))
    return {
        "num_prompts": len(prompts), "k": k, "max_new_tokens": max_new_tokens,
        "temperature": sampling.temperature, "top_p": sampling.top_p, "top_k": sampling.top_k,
        "drafter": spec.as_dict(), "ngram": ngram.as_dict(),
        "plain": {"tokens": plain.tokens, "seconds": plain.seconds, "tokens_per_s": plain.tokens_per_s},
        "speedup": spec.tokens_per_s / plain.tokens_per_s if plain.tokens_per_s else 0.0,
        "ngram_speedup": ngram.tokens_per_s / plain.tokens_per_s if plain.tokens_per_s else 0.0,
        "greedy_mismatches": mismatches if greedy else None,
    }


def report_markdown(report: dict, title: str = "speculators eval") -> str:
    """The report as Markdown (also printed as a table by the CLI)."""
    d, n = report["drafter"], report["ngram"]
    lines = [f"# {title}", "",
             f"{report['num_prompts']} prompts, K={report['k']}, temperature {report['temperature']}, "
             f"top_p {report['top_p']}, top_k {report['top_k']}, max_new_tokens {report['max_new_tokens']}", "",
             "| method | tau | acceptance rate | tokens/s | speedup |", "|---|---|---|---|---|",
             f"| drafter | {d['tau']:.3f} | {d['acceptance_rate']:.3f} | {d['tokens_per_s']:.1f} | "
             f"{report['speedup']:.2f}x |",
             f"| n-gram (prompt lookup) | {n['tau']:.3f} | {n['acceptance_rate']:.3f} | {n['tokens_per_s']:.1f} | "
             f"{report['ngram_speedup']:.2f}x |",
             f"| plain target | 1.000 | - | {report['plain']['tokens_per_s']:.1f} | 1.00x |", "",
             "| position | " + " | ".join(str(i + 1) for i in range(report["k"])) + " |",
             "|---|" + "---|" * report["k"],
             "| drafter acc_k | " + " | ".join(f"{x:.3f}" for x in d["per_position"]) + " |",
             "| drafter cond acc_k | " + " | ".join(f"{x:.3f}" for x in d["conditional"]) + " |",
             "| n-gram acc_k | " + " | ".join(f"{x:.3f}" for x in n["per_position"]) + " |", ""]
    mm = report.get("greedy_mismatches")
    if mm is not None:
        lines.append("Greedy losslessness: " + ("speculative output == plain greedy output on every prompt."
                                                if not mm else f"ERROR: {len(mm)} mismatches: {mm}"))
    return "\n".join(lines) + "\n"


def write_report(report: dict, output: str | Path, title: str = "speculators eval") -> Path:
    """Write ``report.json`` and ``report.md`` into ``output`` (atomically replaced)."""
    with atomic_dir(output, overwrite=True) as tmp:
        (tmp / "report.json").write_text(json.dumps(report, indent=2))
        (tmp / "report.md").write_text(report_markdown(report, title))
    return Path(output)
