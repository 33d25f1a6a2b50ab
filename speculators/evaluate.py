"""Acceptance statistics and reports from real speculative generation.

For each held-out prompt the target decodes plainly, then speculatively with the drafter, then with
the n-gram (prompt lookup) proposer. Reported (ALGORITHMS.md, "Acceptance metrics"): tau (mean
acceptance length, bonus included), acceptance rate (accepted / drafted), per-position acceptance
``acc_k = P(draft k accepted)``, conditional per-position acceptance, tokens/s of each method and the
speedup over plain decoding, and at temperature 0 the number of prompts whose speculative output
differs from plain greedy decoding (must be zero: lossless).

Every decode stops at the first stop token (the target's stop ids: tokenizer EOS, ``generation_config``
EOS ids, chat-template end-of-turn) and at ``max_new_tokens``; tau, tokens and tokens/s count only the
tokens that were emitted, never tokens a step verified after the stop (see :class:`AcceptanceStats`
for every definition).
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path

from .errors import SpeculatorsError
from .utils import atomic_dir


@dataclass
class AcceptanceStats:
    """Accumulates the verification steps of one proposer over many prompts.

    Definitions (per step, from :class:`speculators.generate.GenerationResult`): ``drafted`` = drafts
    the target verified; ``verifier_accepted`` = drafts the rejection sampler accepted; ``emitted`` =
    tokens the step appended to the output, cut at the first stop token and at ``max_new_tokens``
    (accepted drafts and the recovered/bonus token up to the cut); ``accepted`` = accepted drafts
    that were emitted = ``min(verifier_accepted, emitted)``.

    Two views, chosen per metric:

    * what was EMITTED (what a user gets): ``tau = emitted / steps`` (mean acceptance length, bonus
      included), ``accepted`` (accepted-and-emitted drafts), ``tokens`` and ``tokens_per_s``. Tokens
      after a stop token accepted inside a draft block are never counted here.
    * what the VERIFIER SAW (the drafter's agreement with the target): ``acceptance_rate =
      verifier_accepted / drafted``, per-position ``acc_k`` and conditional ``acc_k``. Drafts verified
      after a stop token ended the request are counted as drafted, and as accepted when the verifier
      accepted them: they were verified, so counting them in the denominator only (as misses) would
      make the rate depend on where requests happen to end. In this view
      ``acceptance_rate == sum(pos_accepted) / sum(pos_drafted)``.

    ``steps`` are target forwards after the prefill; the prefill's first token is in ``tokens`` but in
    no step (``tokens == steps' emitted + 1`` per request that generated anything).

    Attributes:
        k: max drafts per step (num_speculative_tokens); no step may draft more.
        steps: number of verification steps.
        emitted: tokens emitted by those steps.
        drafted: drafts verified.
        accepted: accepted drafts that were emitted.
        verifier_accepted: drafts the verifier accepted (emitted or not).
        tokens: generated tokens (prefill token and stop tokens included), seconds: wall time.
        pos_drafted[i]: steps that drafted >= i+1 tokens.
        pos_accepted[i]: steps whose verifier accepted >= i+1 drafts.
        pos_reached[i]: steps that drafted >= i+1 tokens and accepted drafts 1..i (draft i+1 was judged).
    """

    k: int
    steps: int = 0
    emitted: int = 0
    drafted: int = 0
    accepted: int = 0
    verifier_accepted: int = 0
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
        """Add the steps and tokens of one :class:`speculators.generate.GenerationResult`.

        Raises:
            SpeculatorsError: the result's per-step lists differ in length, or a step is inconsistent
                (``0 <= verifier_accepted <= drafted <= k``, ``1 <= emitted <= verifier_accepted + 1``,
                ``accepted == min(verifier_accepted, emitted)``).
        """
        lists = {"accepted": result.accepted, "drafted": result.drafted, "emitted": result.emitted,
                 "verifier_accepted": result.verifier_accepted}
        if len({len(v) for v in lists.values()}) != 1:
            raise SpeculatorsError("GenerationResult: the per-step lists must have one entry per step, got "
                                   + ", ".join(f"{n}: {len(v)}" for n, v in lists.items()))
        steps = list(zip(result.accepted, result.drafted, result.emitted, result.verifier_accepted))
        for i, (a, n, e, va) in enumerate(steps):
            if not (0 <= va <= n <= self.k and 1 <= e <= va + 1 and a == min(va, e)):
                raise SpeculatorsError(
                    f"GenerationResult step {i}: accepted={a}, drafted={n}, emitted={e}, verifier_accepted={va} "
                    f"is not a verification step with k={self.k} (allowed: 0 <= verifier_accepted <= drafted "
                    f"<= k, 1 <= emitted <= verifier_accepted + 1, accepted == min(verifier_accepted, emitted))")
        self.tokens += len(result.tokens)
        self.seconds += result.seconds
        for a, n, e, va in steps:
            self.steps += 1
            self.emitted += e
            self.drafted += n
            self.accepted += a
            self.verifier_accepted += va
            for i in range(n):
                self.pos_drafted[i] += 1
                if va >= i:  # drafts 1..i all accepted and draft i+1 proposed: it was judged
                    self.pos_reached[i] += 1
            for i in range(va):
                self.pos_accepted[i] += 1

    @property
    def tau(self) -> float:
        """Mean tokens emitted per verification step (bonus included; 1.0 when there is no step)."""
        return self.emitted / self.steps if self.steps else 1.0

    @property
    def acceptance_rate(self) -> float:
        """``verifier_accepted / drafted`` (the verifier's view; 0.0 when nothing was drafted)."""
        return self.verifier_accepted / self.drafted if self.drafted else 0.0

    @property
    def per_position(self) -> list[float]:
        """``acc_k``: fraction of steps that drafted >= k tokens in which the verifier accepted draft k."""
        return [a / d if d else 0.0 for a, d in zip(self.pos_accepted, self.pos_drafted)]

    @property
    def conditional(self) -> list[float]:
        """P(draft k accepted | draft k proposed and drafts 1..k-1 accepted), the verifier's view."""
        return [a / r if r else 0.0 for a, r in zip(self.pos_accepted, self.pos_reached)]

    @property
    def tokens_per_s(self) -> float:
        """Generated (emitted) tokens per second of wall time, prefill included (0.0 without time)."""
        return self.tokens / self.seconds if self.seconds else 0.0

    def as_dict(self) -> dict:
        return {"tau": self.tau, "acceptance_rate": self.acceptance_rate, "per_position": self.per_position,
                "conditional": self.conditional, "steps": self.steps, "emitted": self.emitted,
                "drafted": self.drafted, "accepted": self.accepted, "verifier_accepted": self.verifier_accepted,
                "tokens": self.tokens, "seconds": self.seconds, "tokens_per_s": self.tokens_per_s}


def run_eval(target, drafter, prompts: list[dict], k: int, max_new_tokens: int, sampling=None, ngram_max: int = 3,
             seed: int = 0, log=print, progress=None, eos_ids: set[int] | None = None) -> dict:
    """Decode every prompt plainly, with ``drafter`` and with the n-gram proposer; return the report dict.

    All three decodes of a prompt stop on the same stop ids (``eos_ids``, default the target's
    :func:`speculators.generate.resolve_stop_ids`) and at ``max_new_tokens``; every count in the
    report is of emitted tokens (see :class:`AcceptanceStats`).

    Args:
        prompts: ``[{"id", "input_ids"}]`` rendered prompts.
        k: max drafts per step. max_new_tokens: cap on generated tokens per prompt.
        sampling: :class:`speculators.verify.SamplingParams` of one request (``SamplingParams.uniform(1,
            temperature, top_k, top_p)``; ``None`` = greedy). Its generators are not used: prompt ``i``
            is decoded three times, each from a fresh generator seeded with ``seed + i``.
        eos_ids: explicit stop ids (wins over the target's).
    Returns:
        A JSON-serialisable report (see :func:`write_report`), with ``stop_token_ids`` (sorted) and the
        effective ``temperature``, ``top_k``, ``top_p`` (numbers).
    Raises:
        SpeculatorsError: ``sampling`` is not one request's valid ``SamplingParams``.
    """
    from .generate import NGramProposer, plain_decode, resolve_stop_ids, speculative_decode
    from .losses import sampling_values

    temperature, top_k, top_p = sampling_values(sampling)
    stop = resolve_stop_ids(target, eos_ids)
    plain = AcceptanceStats(k)
    spec = AcceptanceStats(k)
    ngram = AcceptanceStats(k)
    mismatches = []
    greedy = temperature == 0.0
    ng = NGramProposer(max_n=ngram_max)
    for i, p in enumerate(prompts):
        ids = p["input_ids"]
        r_plain = plain_decode(target, ids, max_new_tokens, sampling, eos_ids=stop, seed=seed + i)
        r_spec = speculative_decode(target, drafter, ids, k, max_new_tokens, sampling, eos_ids=stop, seed=seed + i)
        r_ng = speculative_decode(target, ng, ids, k, max_new_tokens, sampling, eos_ids=stop, seed=seed + i)
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
        "temperature": temperature, "top_p": top_p, "top_k": top_k,
        "stop_token_ids": sorted(stop),
        "drafter": spec.as_dict(), "ngram": ngram.as_dict(),
        "plain": {"tau": plain.tau, "steps": plain.steps, "tokens": plain.tokens, "seconds": plain.seconds,
                  "tokens_per_s": plain.tokens_per_s},
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
             f"| plain target | {report['plain'].get('tau', 1.0):.3f} | - | "
             f"{report['plain']['tokens_per_s']:.1f} | 1.00x |", "",
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
