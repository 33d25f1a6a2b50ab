"""The proposer protocol: what the decoding loop, the drafter families and the model-free proposers share.

* :class:`Proposer`: the batched protocol every proposer implements (``start`` / ``propose`` /
  ``advance``; vLLM's spec-decode proposers follow the same split), and :class:`Proposal`, the drafts
  of one request with their distributions and confidence logits;
* the default batched ``propose`` / ``advance`` loops over one request at a time
  (:func:`propose_each` / :func:`advance_each`) with their argument checks, and one request's sampling
  parameters (:func:`request_sampling`);
* the calibrated confidence of a proposal's drafts (:func:`calibrated_confidence_logits`);
* the K cap: :func:`max_speculative_tokens_of` and :func:`check_speculative_tokens` (the one error a
  user sees for a K above what a drafter was trained for), and :func:`check_int`, the integer check of
  the loop's and the proposers' arguments.

It sits below the drafters and the loop (docs/ARCHITECTURE.md): :mod:`speculators.drafters.base`
re-exports its names.
"""

from __future__ import annotations

import operator
from dataclasses import dataclass
from typing import Any, Protocol, runtime_checkable

import torch

from ..errors import SpeculatorsError
from ..verify import SamplingParams


@dataclass
class Proposal:
    """Draft tokens for one request.

    Attributes:
        token_ids: ``[k]`` int64 draft tokens in target-vocabulary ids.
        probs: ``[k, V]`` float32 draft distributions q the tokens were sampled from (target vocab),
            or None for drafters that only give ids (the verifier then treats q as a point mass).
        confidence_logits: ``[k]`` float32 raw (pre-sigmoid, uncalibrated) confidence logits of the drafts
            (DSpark's confidence head), or None; calibrated ``c_k = sigmoid(logit_k / T_k + b_k)`` with the
            drafter's :meth:`Drafter.confidence_calibration` (:mod:`speculators.calibration`).
            Contract (what keeps confidence-gated verification lossless): logit k may read the drafter's
            state and drafts ``< k``, never draft k itself nor the target (DSpark's ``c_k`` reads ``h_k``
            and ``x_{k-1}``).
    """

    token_ids: torch.Tensor
    probs: torch.Tensor | None = None
    confidence_logits: torch.Tensor | None = None


@runtime_checkable
class Proposer(Protocol):
    """What the speculative loop needs from a proposer (a drafter family or a model-free proposer).

    Batched and ragged: ``propose`` / ``advance`` take the states of ``B`` requests (``B = 1`` is just
    a batch of one). Inference protocol (features lag tokens by one): after ``start``/``advance`` the
    proposer has seen tokens ``x_0..x_n`` of a request and target features of positions ``0..n-1``;
    ``x_n`` is the newest (bonus or recovered) token, not yet run through the target.
    """

    def start(self, input_ids: torch.Tensor, features: Any) -> Any:
        """Begin ONE request: ``input_ids [n+1]`` int64 (prompt + first target token), ``features`` the
        target's :class:`speculators.target.TargetFeatures` of positions ``0..n-1`` (batch dim 1).
        Returns the proposer's per-request state."""
        ...

    def propose(self, states: list, ks: list[int], sampling: SamplingParams | None = None,
                generators: list[torch.Generator | None] | None = None) -> list[Proposal]:
        """Drafts for ``B = len(states)`` requests: request i gets a :class:`Proposal` of at most
        ``ks[i]`` drafts (target-vocabulary ids ``[k_i']`` and the ``[k_i', V]`` float32 draft
        distributions or None for point masses); ``ks[i] == 0`` gives an empty Proposal.
        ``sampling``: the B requests' :class:`speculators.verify.SamplingParams` (per-request
        temperature / top-k / top-p; ``None`` = all greedy); ``generators``: one torch generator (or
        None) per request, winning over ``sampling.generators``; request i draws ONLY from its own
        generator (else torch's global RNG). Must leave every state as it found it."""
        ...

    def advance(self, states: list, new_ids: list[torch.Tensor], features: list) -> None:
        """Append to request i the ``m_i`` verified tokens ``new_ids[i] [m_i]`` (accepted drafts + the
        recovered/bonus token) and the target features ``features[i]`` of positions
        ``n_i..n_i+m_i-1``; updates the states in place."""
        ...


def check_int(name: str, value, minimum: int) -> int:
    """``value`` as an int >= ``minimum`` (any integer type; bools refused).

    Raises:
        SpeculatorsError: naming ``name``: not an integer, or below ``minimum``.
    """
    try:
        if isinstance(value, bool):
            raise TypeError
        n = operator.index(value)
    except TypeError:
        n = None
    if n is None or n < minimum:
        raise SpeculatorsError(f"{name} must be an integer >= {minimum}, got {value!r}")
    return n


def calibrated_confidence_logits(z: torch.Tensor, temperature: torch.Tensor | None = None,
                                 bias: torch.Tensor | None = None) -> torch.Tensor:
    """``z / T + b`` per draft: the calibrated confidence logits of ``Proposal.confidence_logits``
    (:mod:`speculators.calibration`; the one place that applies and checks a calibration).

    Args:
        z: ``[n]`` raw confidence logits. temperature: ``[>= n]`` temperatures (> 0), None = all 1.
        bias: ``[>= n]`` shifts (finite), None = all 0. Only the first n entries are read.
    Returns:
        ``[n]`` float32 on ``z``'s device.
    Raises:
        SpeculatorsError: fewer temperatures or shifts than drafts, a temperature <= 0 or a shift that
            is not finite.
    """
    z = z.float()
    n = z.numel()
    if temperature is not None:
        t = temperature.detach().reshape(-1)[:n].to(device=z.device, dtype=torch.float32)
        if t.numel() < n or not bool((t > 0).all()):
            raise SpeculatorsError(f"confidence_temperature: expected {n} or more positive temperatures (> 0, one "
                                   f"per draft position), got {temperature.reshape(-1).tolist()}")
        z = z / t
    if bias is not None:
        b = bias.detach().reshape(-1)[:n].to(device=z.device, dtype=torch.float32)
        if b.numel() < n or not bool(torch.isfinite(b).all()):
            raise SpeculatorsError(f"confidence_bias: expected {n} or more finite shifts (one per draft "
                                   f"position), got {bias.reshape(-1).tolist()}")
        z = z + b
    return z


def _empty_proposal() -> Proposal:
    return Proposal(torch.empty(0, dtype=torch.int64))


def request_sampling(sampling: SamplingParams | None, i: int,
                     generator: torch.Generator | None = None) -> SamplingParams | None:
    """Request ``i``'s :class:`speculators.verify.SamplingParams` (a batch of one, views of the batch's
    tensors) with ``generator`` as its generator (``None``: its own ``sampling.generators[i]``, if any).
    ``sampling=None`` (all greedy) gives ``None``."""
    if sampling is None:
        return None
    if generator is None and sampling.generators is not None:
        generator = sampling.generators[i]

    def row(x):
        return None if x is None else x[i:i + 1]

    return SamplingParams(temperature=sampling.temperature[i:i + 1], top_k=row(sampling.top_k),
                          top_p=row(sampling.top_p), generators=None if generator is None else [generator])


def check_batch(states, ks, sampling=None, generators=None, who: str = "propose", ks_name: str = "ks") -> list[int]:
    """Check the arguments of a batched ``propose`` call (the protocol of :class:`Proposer`): one state list,
    one draft count per state (integers >= 0), the batch's ``SamplingParams`` or None, one generator (or
    None) per request. Returns ``ks`` as ints (``B = len``); ``ks_name`` is how errors name it
    (``depth_caps`` for ``propose_tree``).

    Raises:
        SpeculatorsError: naming ``who`` and the argument that is wrong.
    """
    if not isinstance(states, (list, tuple)):
        raise SpeculatorsError(f"{who}: states must be a list of per-request states (batched protocol), got "
                               f"{type(states).__name__}; for one request call propose([state], [k], ...)")
    B = len(states)
    if not isinstance(ks, (list, tuple)) or len(ks) != B:
        raise SpeculatorsError(f"{who}: {ks_name} must be a list of {B} counts (one per state), got {ks!r}")
    out = [check_int(f"{who}: {ks_name}[{i}]", k, 0) for i, k in enumerate(ks)]
    if sampling is not None:
        if not isinstance(sampling, SamplingParams):
            raise SpeculatorsError(f"{who}: sampling must be speculators.verify.SamplingParams for the {B} "
                                   f"requests or None, got {type(sampling).__name__}")
        sampling.validate(B, values=False)  # VerifyInputError (a SpeculatorsError) naming the field
    if generators is not None and len(generators) != B:
        raise SpeculatorsError(f"{who}: generators must have one entry (Generator or None) per request ({B}), "
                               f"got {len(generators)}")
    return out


def propose_each(one, states: list, ks: list[int], sampling: SamplingParams | None = None,
                 generators: list[torch.Generator | None] | None = None) -> list[Proposal]:
    """The default batched ``propose``: ``one(state_i, k_i, sampling_i, generator_i)`` per request.

    ``sampling_i`` is :func:`request_sampling` (batch of one) and ``generator_i`` is ``generators[i]``
    when ``generators`` is given, else ``sampling.generators[i]`` (else None: torch's global RNG), so a
    request draws only from its own generator. A request with ``k_i == 0`` gets an empty
    :class:`Proposal` without a call.

    Raises:
        SpeculatorsError: see :meth:`Drafter.propose`.
    """
    check_batch(states, ks, sampling, generators)
    out = []
    for i, (state, k) in enumerate(zip(states, ks)):
        k = int(k)
        if k == 0:
            out.append(_empty_proposal())
            continue
        g = generators[i] if generators is not None else None
        if g is None and sampling is not None and sampling.generators is not None:
            g = sampling.generators[i]
        out.append(one(state, k, request_sampling(sampling, i, g), g))
    return out


def advance_each(one, states: list, new_ids: list, features: list | None) -> None:
    """The default batched ``advance``: ``one(state_i, new_ids_i, features_i)`` per request
    (``features=None``: None for every request, for model-free proposers).

    Raises:
        SpeculatorsError: the lists differ in length, or ``states`` is not a list.
    """
    if not isinstance(states, (list, tuple)):
        raise SpeculatorsError(f"advance: states must be a list of per-request states (batched protocol), got "
                               f"{type(states).__name__}; for one request call advance([state], [ids], [features])")
    if features is None:
        features = [None] * len(states)
    if not (len(states) == len(new_ids) == len(features)):
        raise SpeculatorsError(f"advance: states, new_ids and features must have one entry per request, got "
                               f"{len(states)}, {len(new_ids)} and {len(features)}")
    for state, ids, f in zip(states, new_ids, features):
        one(state, ids, f)


def max_speculative_tokens_of(proposer) -> int | None:
    """The K bound of any proposer: the ``max_speculative_tokens`` it declares (a :class:`Drafter`'s, what it
    was trained for; a wrapper such as :class:`speculators.decode.proposers.HybridProposer` declares its own), or
    None when it declares none or None (unbounded: n-gram, suffix, plain, autoregressive families)."""
    cap = getattr(proposer, "max_speculative_tokens", None)
    return None if cap is None else int(cap)


def check_speculative_tokens(proposer, ks, name: str = "k") -> None:
    """Refuse a K (one int or several, e.g. an eval's K sweep) larger than ``proposer`` can draft in one
    step (:func:`max_speculative_tokens_of`): the ONE error a user sees, before any decoding.

    Args:
        proposer: a drafter, a proposer wrapping one, any other proposer (never refused) or None.
        ks: an int or an iterable of ints.
        name: how the error names the setting (``"k"``, ``"-k"``, ``"eval.k"``, ``"eval.k_sweep"``).
    Raises:
        SpeculatorsError: naming ``name``, the offending value, the allowed maximum and what sets it.
    """
    cap = max_speculative_tokens_of(proposer)
    if cap is None or proposer is None:
        return
    values = [ks] if isinstance(ks, int) else list(ks)
    bad = [k for k in values if isinstance(k, int) and k > cap]
    if bad:
        src = getattr(proposer, "max_speculative_tokens_source", "") or "its training"
        owner = getattr(proposer, "algorithm", "") or type(proposer).__name__  # wrappers name their drafter
        given = f"{name}{' ' if name.startswith('-') else '='}{','.join(map(str, bad))}"
        raise SpeculatorsError(f"{given}: this {owner} "
                               f"drafter drafts at most {cap} tokens per step ({src} = {cap}, what it was trained "
                               f"for); use {name} <= {cap}, or train a drafter for more")
