"""The checked inputs of the decoding loop (:func:`speculators.generate.speculative_generate`): the
prompts, the per-request counts (``k``, ``max_new_tokens``), and each request's sampling parameters and
random generator (the run's rows on the target's device, a request's generator from its seed), with one
clear :class:`speculators.errors.SpeculatorsError` naming the argument for bad input.
"""

from __future__ import annotations

import dataclasses
import operator

import torch

from .errors import SpeculatorsError
from .proposal import check_int
from .verify import SamplingParams


def request_params(sampling: SamplingParams | None, seed: int | None) -> SamplingParams:
    """The one request's sampling parameters a decode uses: ``sampling`` (greedy when None), with a
    fresh generator seeded with ``seed`` when one is given (so every decode of a prompt starts from
    the same random stream).

    Raises:
        SpeculatorsError: ``sampling`` is not a batch-of-one ``SamplingParams`` or holds invalid values.
    """
    if sampling is None:
        sampling = SamplingParams.uniform(1)
    elif not isinstance(sampling, SamplingParams):
        raise SpeculatorsError(f"sampling: expected speculators.verify.SamplingParams (one request) or None, "
                               f"got {type(sampling).__name__}")
    sampling.validate(1)  # VerifyInputError (a SpeculatorsError) naming the field
    if seed is not None:
        seed = check_int("seed", seed, -(2 ** 63))  # any integer torch.Generator.manual_seed takes
        dev = sampling.temperature.device
        sampling = dataclasses.replace(sampling, generators=[torch.Generator(device=dev).manual_seed(seed)])
    return sampling


def per_request(name: str, value, batch: int, minimum: int) -> list[int]:
    """``value`` (one int for every request, or a list of ``batch`` ints) as a list of ``batch`` ints.

    Raises:
        SpeculatorsError: a list of another length, or a value that is not an integer >= ``minimum``.
    """
    if isinstance(value, (list, tuple)):
        if len(value) != batch:
            raise SpeculatorsError(f"{name}: expected one integer or a list of {batch} (one per prompt), "
                                   f"got a list of {len(value)}")
        return [check_int(f"{name}[{i}]", v, minimum) for i, v in enumerate(value)]
    return [check_int(name, value, minimum)] * batch


def check_prompts(prompts, vocab_size: int | None) -> list[list[int]]:
    """``prompts`` as lists of int token ids, each non-empty and in ``[0, vocab_size)``.

    Raises:
        SpeculatorsError: not a list of token-id lists, an empty prompt, or an id out of range (naming
            the prompt's index).
    """
    if isinstance(prompts, (str, bytes)) or not isinstance(prompts, (list, tuple)):
        raise SpeculatorsError(f"prompts: expected a list of token-id lists, got {type(prompts).__name__}")
    out = []
    for i, p in enumerate(prompts):
        try:
            ids = [operator.index(t) for t in (p.tolist() if isinstance(p, torch.Tensor) else p)]
            if any(isinstance(t, bool) for t in p):
                raise TypeError
        except TypeError:
            raise SpeculatorsError(f"prompts[{i}]: expected a list of integer token ids, got {p!r:.80}") from None
        if not ids:
            raise SpeculatorsError(f"prompts[{i}]: empty prompt (every prompt needs at least one token)")
        if min(ids) < 0 or (vocab_size is not None and max(ids) >= vocab_size):
            raise SpeculatorsError(f"prompts[{i}]: token ids must lie in [0, {vocab_size}), got "
                                   f"min {min(ids)} max {max(ids)}")
        out.append(ids)
    return out


def batch_params(sampling: SamplingParams | None, seeds, batch: int,
                  device: torch.device) -> tuple[SamplingParams, list[torch.Generator | None]]:
    """The run's per-request sampling parameters on ``device`` and each request's generator
    (``seeds[i]`` -> a fresh generator on ``device``; else ``sampling.generators[i]``; else None).

    Raises:
        SpeculatorsError: ``sampling`` not ``batch`` requests' valid ``SamplingParams``, or ``seeds`` not
            one integer (or None) per prompt.
    """
    if sampling is None:
        sampling = SamplingParams.uniform(batch, device=device)
    elif not isinstance(sampling, SamplingParams):
        raise SpeculatorsError(f"sampling: expected speculators.verify.SamplingParams for the {batch} prompts "
                               f"or None (greedy), got {type(sampling).__name__}")
    sampling.validate(batch)  # VerifyInputError (a SpeculatorsError) naming the field
    if seeds is not None:
        if not isinstance(seeds, (list, tuple)) or len(seeds) != batch:
            raise SpeculatorsError(f"seeds: expected a list of {batch} seeds (int or None, one per prompt) or "
                                   f"None, got {seeds!r:.80}")
        seeds = [None if s is None else check_int(f"seeds[{i}]", s, -(2 ** 63)) for i, s in enumerate(seeds)]
    gens: list[torch.Generator | None] = []
    for i in range(batch):
        if seeds is not None and seeds[i] is not None:
            gens.append(torch.Generator(device=device).manual_seed(seeds[i]))
        else:
            gens.append(sampling.generators[i] if sampling.generators is not None else None)

    def to(x):
        return None if x is None else x.to(device)

    params = SamplingParams(temperature=sampling.temperature.to(device), top_k=to(sampling.top_k),
                            top_p=to(sampling.top_p))
    return params, gens


def select_rows(params: SamplingParams, gens: list, idx: list[int]) -> SamplingParams:
    """Rows ``idx`` of the run's parameters, with those requests' generators."""
    rows = torch.tensor(idx, device=params.temperature.device)

    def pick(x):
        return None if x is None else x.index_select(0, rows)

    g = [gens[i] for i in idx]
    return SamplingParams(temperature=pick(params.temperature), top_k=pick(params.top_k), top_p=pick(params.top_p),
                          generators=g if any(x is not None for x in g) else None)
