"""The checked inputs of the decoding loop (:func:`speculators.decode.loop.speculative_generate`): the
prompts, the per-request counts (``k``, ``max_new_tokens``), and each request's sampling parameters and
random generator (the run's rows on the target's device, a request's generator from its seed), with one
clear :class:`speculators.errors.SpeculatorsError` naming the argument for bad input.
"""

from __future__ import annotations

import dataclasses
import operator

import torch

from ..errors import SpeculatorsError
from .proposal import check_int
from ..verify import SamplingParams


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


def _as_token_ids(ids, what: str) -> set[int]:
    if isinstance(ids, (str, bytes)) or not hasattr(ids, "__iter__"):
        ids = [ids]
    out = set()
    for t in ids:
        try:
            if isinstance(t, bool):
                raise TypeError
            v = operator.index(t.item() if isinstance(t, torch.Tensor) else t)
        except (TypeError, ValueError, RuntimeError):
            v = None
        if v is None or v < 0:
            raise SpeculatorsError(f"{what} must be non-negative integer token ids, got {t!r} in {ids!r}")
        out.add(v)
    return out


def resolve_stop_ids(target, eos_ids=None) -> set[int]:
    """The stop token ids of a decode: ``eos_ids`` when given, else the target's stop ids.

    The target's stop ids are ``target.stop_token_ids`` (tokenizer EOS ∪ ``generation_config`` EOS ids
    ∪ the chat template's end-of-turn marker; a list property, or a method called without
    arguments); for an object without it, the tokenizer's ``eos_token_id`` (none without a
    tokenizer). Plain decoding, speculative decoding and eval all stop on this set.

    Args:
        target: :class:`speculators.target.Target` (or any object with ``stop_token_ids`` or
            ``tokenizer``).
        eos_ids: explicit stop ids (an int or an iterable of ints; an empty set = never stop early);
            it wins over the target's.
    Returns:
        set of int token ids.
    Raises:
        SpeculatorsError: ``eos_ids`` (or the target's stop ids) are not non-negative integers.
    """
    if eos_ids is not None:
        return _as_token_ids(eos_ids, "eos_ids")
    stop = getattr(target, "stop_token_ids", None)
    if callable(stop):
        stop = stop()
    if stop is not None:
        return _as_token_ids(stop, "target.stop_token_ids")
    tok = getattr(target, "tokenizer", None)
    eos = getattr(tok, "eos_token_id", None) if tok is not None else None
    return set() if eos is None else _as_token_ids(eos, "tokenizer.eos_token_id")
