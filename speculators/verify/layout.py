"""Leaf module of :mod:`speculators.verify`: the shared layout type, constants and error type.

Every other module of the package may import this one; this one imports nothing from the package
(only torch and :mod:`speculators.errors`), so the package's import graph is a DAG (checked by
``tests/verify/test_verify.py::test_verify_import_graph_is_a_dag``)::

    sampling    -> layout
    target_side -> layout, sampling
    torch_impl  -> layout, target_side
    triton_impl -> layout
    testing     -> layout, sampling
    rejection   -> layout, sampling, target_side, torch_impl / triton_impl (imported lazily, by ``impl``)
    __init__    -> layout, rejection, sampling

Contents: :class:`VerifyInputError` (bad input), :data:`PLACEHOLDER_TOKEN_ID` (output padding),
:data:`COMPUTE_DTYPE` (the one dtype the target side computes in), the sampling-rule constants
:data:`SAMPLE_SCALE` / :data:`SAMPLE_BLOCK` / :func:`sample_block` (two-level inverse CDF, see
:mod:`speculators.verify.rejection`), :data:`CHUNK_BYTES` (CPU chunk size) and :class:`_Layout`
(the ragged batch layout every backend reads), :class:`RejectionOutput` (what every backend returns).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import Tensor

from ..errors import SpeculatorsError

__all__ = [
    "CHUNK_BYTES",
    "COMPUTE_DTYPE",
    "PLACEHOLDER_TOKEN_ID",
    "RejectionOutput",
    "SAMPLE_BLOCK",
    "SAMPLE_SCALE",
    "VerifyInputError",
    "sample_block",
]


class VerifyInputError(SpeculatorsError, ValueError):
    """Bad input to the verifier or :func:`~speculators.verify.apply_sampling`.

    The message names the argument (``target_logits``, ``sampling.temperature``, ``order``, ...) and
    what is allowed. A :class:`~speculators.errors.SpeculatorsError` (the CLI prints it as one line) and
    a ``ValueError`` (what callers of the verifier caught before it existed).
    """


PLACEHOLDER_TOKEN_ID = -1  # padding of RejectionOutput.output_token_ids after each request's last token

# The target side (logits -> probabilities / argmax) computes in float32 on every path (greedy and
# sampled, lazy and eager, torch / Triton / reference), as vLLM's sampler does: float64 logits are
# rounded to float32 once, at the entry of rejection_sample / apply_sampling; float16 / bfloat16 logits
# convert to float32 exactly (wherever the conversion happens, the values are the same).
COMPUTE_DTYPE = torch.float32

SAMPLE_SCALE = 2.0**52  # weights floor(r * 2**52): integers, so float64 sums of them are exact
SAMPLE_BLOCK = 1024  # tokens per block of the two-level inverse CDF (a power of two)

CHUNK_BYTES = 4 << 20  # CPU: rows of about this many float32 bytes are processed at a time


def sample_block(vocab: int) -> int:
    """Block width of the two-level inverse CDF for a vocabulary of ``vocab`` tokens.

    ``min(SAMPLE_BLOCK, next power of two >= vocab)``; part of the sampling rule (every implementation
    sums the same blocks).
    """
    return min(SAMPLE_BLOCK, 1 << max(vocab - 1, 0).bit_length())


@dataclass
class _Layout:
    """Ragged batch layout of one verification call (built by ``rejection._prepare``).

    Request ``i`` owns draft positions ``draft_start[i] .. draft_start[i] + n[i] - 1`` of the flat
    ``[T]`` draft arrays and target rows ``row_start[i] .. row_start[i] + n[i]`` of the ``[T + B, V]``
    logits (its ``n[i]`` draft positions, then its bonus position).
    """

    batch: int  # B
    vocab: int  # V
    num_drafts: list[int]  # host copy of n
    max_drafts: int  # K = max(n)
    total_drafts: int  # T = sum(n)
    n: Tensor  # [B] int64 (device)
    draft_start: Tensor  # [B] int64, index of request i's first draft in the flat draft arrays
    row_start: Tensor  # [B] int64, index of request i's first target_logits row (= draft_start + i)
    is_greedy: Tensor  # [B] bool (temperature == 0)
    all_greedy: bool
    any_greedy: bool


@dataclass
class RejectionOutput:
    """Result of :func:`rejection_sample`.

    Attributes:
        output_token_ids: ``[B, max_num_drafts + 1]`` int64. Row ``i`` holds the accepted drafts of
            request ``i`` followed by one recovered or bonus token, then ``-1`` padding.
        num_accepted: ``[B]`` int64, accepted drafts per request (tokens emitted = ``num_accepted + 1``).
    """

    output_token_ids: Tensor
    num_accepted: Tensor

    @property
    def num_emitted(self) -> Tensor:
        """``[B]`` int64, tokens emitted per request (accepted + recovered/bonus)."""
        return self.num_accepted + 1

    def tolist(self) -> list[list[int]]:
        """Emitted token ids per request, padding removed."""
        return [
            row[: int(n) + 1]
            for row, n in zip(self.output_token_ids.tolist(), self.num_accepted.tolist())
        ]
