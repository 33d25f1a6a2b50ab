"""Greedy losslessness in low precision: is a mismatch a verifier failure or a rounding near-tie?

At temperature 0 a lossless verifier makes speculative output equal plain greedy decoding token for token
(Leviathan et al. 2023; vLLM's greedy rejection sampler). That holds exactly only when the target's logits
at a position do not depend on the SHAPE of the forward that computes them. In float32 on a CPU they do
not, to the last bit that matters (so every mismatch is a failure). In bfloat16 / float16 a verify forward
over K+1 tokens and a 1-token decode forward take different matmul blockings and round differently; where
the two best logits are within that rounding of each other the argmax can flip, and the outputs diverge
from there on without any fault of the verifier (engines see the same: vLLM documents that batched and
speculative bf16 outputs need not match plain decoding bit for bit).

:func:`classify_mismatch` looks at the FIRST diverging position ``j`` of a mismatch: it recomputes the
target's logits for the shared prefix (prompt + the ``j`` tokens both outputs agree on) twice in the eval
dtype, with the shapes of the two decodes being compared:

* ``sequential``: the prompt in one prefill forward, then one token per forward (plain decoding's shape);
* ``verify``: the prompt in one prefill forward, then forwards of ``K + 1`` tokens (each verify step of
  the speculative loop when every draft is accepted), the last one ending at position ``j - 1``
  (the first chunk takes the remainder).

Let ``a`` be plain greedy's token at ``j`` and ``b`` the speculative output's. Recorded, per shape:
``logit_gap = |l[a] - l[b]|`` and ``top2_gap`` (best minus second-best logit). The rounding bound is

    ``rounding_bound = 2 * max(eps(dtype) * max(|l_s[a]|, |l_s[b]|) over both shapes, shape_drift)``

where ``eps`` is ``torch.finfo(dtype).eps`` (bf16: 2**-7, fp16: 2**-10; one step of the dtype's mantissa
at the logits' magnitude, the rounding of the logits alone) and ``shape_drift = max_v |l_seq[v] -
l_ver[v]|`` (what the forward's shape changes in these logits, measured here). The factor 2 covers the
rounding of both tokens' logits and shapes the recompute does not replay exactly (the real run's step
boundaries and batch rows). A mismatch is ``near_tie: true`` when the dtype is not float32, both tokens
exist, and ``min(logit_gap over the shapes) <= rounding_bound``. Any other mismatch (a gap beyond
rounding, a length difference with no diverging token, or any mismatch in float32) is a verifier
failure. Nothing is hidden: every mismatch stays in ``greedy_mismatches`` with its classification.
"""

from __future__ import annotations

import torch

#: the factor on the rounding scale a near-tie gap may reach (see the module docstring)
NEAR_TIE_FACTOR = 2.0


@torch.no_grad()
def next_token_logits(target, prompt_ids: list[int], prefix: list[int], chunk: int) -> torch.Tensor:
    """The target's logits for the token after ``prompt_ids + prefix``, computed over a fresh batch-1 KV
    cache (:meth:`speculators.target.Target.session`) in the target's dtype: the prompt in one forward,
    then ``prefix`` in forwards of ``chunk`` tokens (``1``: plain decoding's shape; ``K + 1``: verify
    steps'), the first forward taking the remainder so that the last one ends at the prefix's end.

    Args:
        target: a :class:`speculators.target.Target`. prompt_ids: the prompt (>= 1 token). prefix: the
            generated tokens before the position asked for. chunk: tokens per forward after the prompt (>= 1).
    Returns:
        ``[V]`` float32 (the logits as the target's dtype computed them, upcast), on the target's device.
    """
    sess = target.session()
    logits, _ = sess.forward(torch.tensor(prompt_ids, dtype=torch.long))
    rest = len(prefix) % chunk
    pieces = ([prefix[:rest]] if rest else []) + [prefix[i:i + chunk] for i in range(rest, len(prefix), chunk)]
    for piece in pieces:
        logits, _ = sess.forward(torch.tensor(piece, dtype=torch.long))
    return logits[-1].float()


def first_diff(a: list[int], b: list[int]) -> int:
    """The first position where ``a`` and ``b`` differ (the shorter length when one is a prefix of the other)."""
    return next((j for j, (x, y) in enumerate(zip(a, b)) if x != y), min(len(a), len(b)))


def _gaps(logits: torch.Tensor, a: int, b: int) -> dict:
    top = torch.topk(logits, 2).values
    return {"logit_gap": float((logits[a] - logits[b]).abs()), "top2_gap": float(top[0] - top[1]),
            "argmax": int(logits.argmax())}


def classify_mismatch(target, prompt_ids: list[int], reference: list[int], output: list[int], k: int,
                      cache: dict | None = None) -> dict:
    """Whether one greedy mismatch sits on a near-tie of the target's logits (the rule is in the module
    docstring).

    Args:
        target: the eval's :class:`speculators.target.Target` (its dtype is the eval dtype).
        prompt_ids: the prompt's token ids. reference: plain greedy's generated ids (batch 1).
        output: the compared decode's generated ids (differs from ``reference``).
        k: the decode's drafts per step (0 for plain decoding at another batch size: the verify shape is
            then 1 token, as its forwards are).
        cache: a dict reused across calls of one eval: logits per (prompt, position, chunk) are computed once.
    Returns:
        ``{"position", "reference_token", "output_token", "dtype", "near_tie", "rounding_bound",
        "rounding_scale", "shape_drift", "logit_gap", "shapes": {"sequential": {logit_gap, top2_gap, argmax},
        "verify": {...}}}``: floats in logit units; ``reference_token`` / ``output_token`` None where that
        output ended at ``position`` (then ``near_tie`` is False and no logits are computed).
    """
    j = first_diff(reference, output)
    a = reference[j] if j < len(reference) else None
    b = output[j] if j < len(output) else None
    dtype = str(target.dtype).removeprefix("torch.")
    out = {"position": j, "reference_token": a, "output_token": b, "dtype": dtype, "near_tie": False}
    if a is None or b is None:
        return out
    cache = {} if cache is None else cache
    logits = {}
    for shape, chunk in (("sequential", 1), ("verify", max(1, k + 1))):
        key = (tuple(prompt_ids), tuple(reference[:j]), chunk)
        if key not in cache:
            cache[key] = next_token_logits(target, list(prompt_ids), list(reference[:j]), chunk)
        logits[shape] = cache[key]
    seq, ver = logits["sequential"], logits["verify"]
    mag = max(float(x[t].abs()) for x in (seq, ver) for t in (a, b))
    scale = torch.finfo(target.dtype).eps * mag
    drift = float((seq - ver).abs().max())
    bound = NEAR_TIE_FACTOR * max(scale, drift)
    shapes = {name: _gaps(x, a, b) for name, x in logits.items()}
    gap = min(s["logit_gap"] for s in shapes.values())
    out.update(near_tie=dtype != "float32" and gap <= bound, rounding_bound=bound, rounding_scale=scale,
               shape_drift=drift, logit_gap=gap, shapes=shapes)
    return out


def classify_mismatches(target, prompts: list[list[int]], reference: list[list[int]], mismatches: list[dict],
                        diverged: list[tuple[int, list[int], int]]) -> list[dict]:
    """Add :func:`classify_mismatch`'s fields (all but ``position``, which is the mismatch's ``first_diff``)
    to every mismatch of an eval, in place; logits shared by mismatches at the same prompt, position and
    shape are computed once.

    Args:
        target: the eval's target. prompts: every prompt's ids. reference: plain greedy's output per prompt.
        mismatches: the eval's mismatch records (``prompt``, ``proposer``, ``k``, ``batch_size``, ``first_diff``).
        diverged: per mismatch, ``(prompt index, the mismatching output's ids, K)``.
    Returns:
        ``mismatches`` (the same list).
    """
    cache: dict = {}
    for m, (i, tokens, k) in zip(mismatches, diverged):
        info = classify_mismatch(target, prompts[i], reference[i], tokens, k, cache)
        info.pop("position")
        m.update(info)
    return mismatches


def greedy_summary(mismatches: list[dict] | None, dtype: str) -> dict | None:
    """The greedy check of an eval report (``report["greedy_check"]``) from its classified mismatches.

    Args:
        mismatches: ``report["greedy_mismatches"]`` (None when sampling: then None is returned).
        dtype: the eval dtype of the target (``"float32"``, ``"bfloat16"``, ``"float16"``).
    Returns:
        ``{"dtype", "mismatches", "near_tie", "failures", "passed", "by_proposer": {label: {"mismatches",
        "near_tie", "failures"}}}`` where a label is the mismatch's ``proposer`` (``"drafter"``, ``"plain"``,
        ``"drafter (gated)"`` ...), followed by ``" @ <checkpoint>"`` for a compared checkpoint's; ``passed``
        is True when no mismatch is a failure (a non-near-tie one).
    """
    if mismatches is None:
        return None
    by: dict[str, dict] = {}
    for m in mismatches:
        label = m["proposer"] + (f" @ {m['checkpoint']}" if m.get("checkpoint") else "")
        row = by.setdefault(label, {"mismatches": 0, "near_tie": 0, "failures": 0})
        row["mismatches"] += 1
        row["near_tie" if m.get("near_tie") else "failures"] += 1
    n_tie = sum(r["near_tie"] for r in by.values())
    return {"dtype": dtype, "mismatches": len(mismatches), "near_tie": n_tie, "failures": len(mismatches) - n_tie,
            "passed": len(mismatches) == n_tie, "by_proposer": by}
