"""Recording a drafter's confidence outcomes (step 1 of :mod:`speculators.calibration`).

:func:`collect_confidence_outcomes` decodes held-out prompts speculatively (the eval loop,
:func:`speculators.decode.loop.speculative_generate`, no gating) and records, through the loop's outcome
hook ``on_step``, per verification step the raw confidence logits of the drafts, how many the verifier
accepted and which prompt the step decoded, as a :class:`ConfidenceRecord`;
:meth:`ConfidenceRecord.save_many` / :meth:`ConfidenceRecord.load_many` keep
such records in ``outcomes.safetensors`` (refit or re-measure without decoding again).
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import torch

from ..errors import SpeculatorsError
from ..decode.loop import speculative_generate

OUTCOMES_FILE = "outcomes.safetensors"


@dataclass
class ConfidenceRecord:
    """Raw confidence logits and accept outcomes of ``N`` verification steps.

    Attributes:
        logits: ``[N, K]`` float32 raw confidence logits; NaN beyond a step's ``drafted``.
        drafted: ``[N]`` int64 drafts verified in the step (1..K).
        accepted: ``[N]`` int64 drafts the verifier accepted (0..drafted).
        prompt: ``[N]`` int64 index of the prompt (request) each step decoded, in the order the record's
            prompts were given; None when unknown (records written before it existed). Steps of one prompt
            are correlated; :func:`ece_prompt_bootstrap` resamples whole prompts with it.
    """

    logits: torch.Tensor
    drafted: torch.Tensor
    accepted: torch.Tensor
    prompt: torch.Tensor | None = None

    @classmethod
    def from_steps(cls, steps: list[tuple], k: int | None = None) -> "ConfidenceRecord":
        """From ``[(logits [n] float, accepted int)]`` or ``[(logits, accepted, prompt index int)]`` per
        step (all steps of one kind); ``k`` = width (default: the longest n).

        Raises:
            SpeculatorsError: an accepted count outside ``[0, n]``, a step without drafts, or prompt indices
                given for some steps only.
        """
        width = k if k is not None else max((int(st[0].numel()) for st in steps), default=0)
        logits = torch.full((len(steps), width), float("nan"))
        drafted = torch.zeros(len(steps), dtype=torch.int64)
        accepted = torch.zeros(len(steps), dtype=torch.int64)
        with_prompt = {len(st) == 3 for st in steps}
        if len(with_prompt) > 1:
            raise SpeculatorsError("confidence record: prompt indices given for some steps only")
        prompt = torch.zeros(len(steps), dtype=torch.int64) if with_prompt == {True} else None
        for i, st in enumerate(steps):
            z, a = st[0].detach().reshape(-1).float().cpu(), st[1]
            n = int(z.numel())
            if n == 0 or n > width or not 0 <= int(a) <= n:
                raise SpeculatorsError(f"confidence record step {i}: {n} drafts (1..{width} allowed) with {a} accepted")
            logits[i, :n] = z
            drafted[i], accepted[i] = n, int(a)
            if prompt is not None:
                prompt[i] = int(st[2])
        return cls(logits, drafted, accepted, prompt)

    def __len__(self) -> int:
        return int(self.drafted.numel())

    @property
    def k(self) -> int:
        """Width of :attr:`logits` (the most drafts one step recorded)."""
        return int(self.logits.shape[1])

    @staticmethod
    def save_many(records: dict[str, "ConfidenceRecord"], file: str | Path) -> Path:
        """Write records (name -> record; a name without dots) to one safetensors file: per record the
        tensors ``{name}.logits`` ``[N, K]`` float32 (NaN beyond a step's drafts), ``{name}.drafted``,
        ``{name}.accepted`` and, when known, ``{name}.prompt`` ``[N]`` int64 (:meth:`load_many` reads them
        back). Returns ``file``.

        Raises:
            SpeculatorsError: an empty record name or one containing a dot.
        """
        from safetensors.torch import save_file

        bad = [name for name in records if "." in name or not name]
        if bad:
            raise SpeculatorsError(f"confidence-outcome record names must be non-empty without dots, got {bad}")
        tensors = {f"{name}.{field}": getattr(r, field).contiguous() for name, r in records.items()
                   for field in ("logits", "drafted", "accepted", "prompt") if getattr(r, field) is not None}
        save_file(tensors, str(file), metadata={"format": "speculators-confidence-outcomes"})
        return Path(file)

    @staticmethod
    def load_many(file: str | Path) -> dict[str, "ConfidenceRecord"]:
        """Read :meth:`save_many`'s file back (name -> record).

        Raises:
            SpeculatorsError: a missing or unreadable file, or a record with a missing tensor or
                inconsistent shapes.
        """
        from safetensors.torch import load_file

        try:
            tensors = load_file(str(file))
        except Exception as e:  # OSError, or safetensors' own error for a corrupt file
            raise SpeculatorsError(f"{file}: not a confidence-outcomes file ({e})") from None
        out = {}
        for name in sorted({k.rsplit(".", 1)[0] for k in tensors}):
            try:
                z, n, a = (tensors[f"{name}.{f}"] for f in ("logits", "drafted", "accepted"))
            except KeyError as e:
                raise SpeculatorsError(f"{file}: record {name!r} lacks the tensor {e.args[0]}") from None
            p = tensors.get(f"{name}.prompt")  # absent in files written before prompt indices were kept
            if z.dim() != 2 or n.shape != (z.shape[0],) or a.shape != n.shape or (p is not None and p.shape != n.shape):
                raise SpeculatorsError(f"{file}: record {name!r} has logits {tuple(z.shape)}, drafted "
                                       f"{tuple(n.shape)}, accepted {tuple(a.shape)}"
                                       + ("" if p is None else f", prompt {tuple(p.shape)}")
                                       + "; expected [N, K], [N], [N] (and prompt [N])")
            out[name] = ConfidenceRecord(z, n, a, p)
        return out


class _ConfidenceRecorder:
    """The outcome hook (``speculative_generate(..., on_step=recorder)``) that records, per verification
    step and request, the verified proposal's raw confidence logits, how many of its drafts the verifier
    accepted and the request's prompt index. The last step of each request (the one that emitted its
    stop token or reached ``max_new_tokens``; the drafter is never advanced past it) is dropped by
    :meth:`records`."""

    def __init__(self):
        self.steps: list[tuple[torch.Tensor, int, int] | None] = []  # per hook call; None: nothing to record
        self.last_step: dict[int, int] = {}  # request -> index in steps of its latest step
        self.without_confidence = 0

    def __call__(self, request: int, proposal, num_accepted: int, emitted: list[int]) -> None:
        self.last_step[request] = len(self.steps)
        if proposal.token_ids.numel() == 0:
            self.steps.append(None)
        elif proposal.confidence_logits is None:
            self.without_confidence += 1
            self.steps.append(None)
        else:
            self.steps.append((proposal.confidence_logits.detach().reshape(-1).float().cpu(), int(num_accepted),
                               int(request)))

    def records(self) -> list[tuple[torch.Tensor, int, int]]:
        """``[(logits [n] float32, accepted, prompt index)]`` in step order, without each request's last step."""
        last = set(self.last_step.values())
        return [st for i, st in enumerate(self.steps) if st is not None and i not in last]


@torch.no_grad()
def collect_confidence_outcomes(target, drafter, prompts: list[list[int]], k: int, max_new_tokens: int,
                                sampling=None, batch_size: int = 8, eos_ids: set[int] | None = None,
                                seed: int = 0) -> ConfidenceRecord:
    """Decode ``prompts`` speculatively (no gating) and record every step's raw confidence logits and
    accepted count (see the module docstring, step 1).

    Args:
        target: :class:`speculators.target.Target`. drafter: a batched proposer whose proposals carry
            ``confidence_logits``.
        prompts: token-id lists. k: drafts per step (>= 1). max_new_tokens: per prompt.
        sampling: one request's :class:`speculators.verify.SamplingParams` applied to every prompt (None =
            greedy); prompt i draws from a generator seeded with ``seed + i``.
        batch_size, eos_ids: as :func:`speculators.decode.loop.speculative_generate`.
    Returns:
        :class:`ConfidenceRecord` of width ``k``, with each step's prompt index (into ``prompts``).
    Raises:
        SpeculatorsError: the drafter's proposals carry no confidence logits (no confidence head), no step
            was recorded, or a decoding argument is invalid.
    """
    from ..losses import sampling_values
    from ..verify import SamplingParams

    temperature, top_k, top_p = sampling_values(sampling)
    sp = SamplingParams.uniform(len(prompts), temperature, top_k, top_p)
    rec = _ConfidenceRecorder()
    speculative_generate(target, drafter, prompts, k, max_new_tokens, sp, batch_size, eos_ids=eos_ids,
                         seeds=[seed + i for i in range(len(prompts))], on_step=rec)
    steps = rec.records()
    if not steps:
        if rec.without_confidence:
            raise SpeculatorsError(f"calibrate: the {getattr(drafter, 'algorithm', type(drafter).__name__)} drafter "
                                   "reports no confidence logits (no confidence head): nothing to calibrate")
        raise SpeculatorsError("calibrate: no verification step was recorded (prompts too few or max_new_tokens "
                               "too small); use more prompts or a larger max_new_tokens")
    return ConfidenceRecord.from_steps(steps, k)
