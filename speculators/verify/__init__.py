"""Lossless speculative-decoding verifier: rejection sampling as a pure function of tensors.

Public API::

    SamplingParams, apply_sampling            # per-request temperature / top-k / top-p (vLLM semantics)
    rejection_sample(..., impl="auto"|"torch"|"triton")   # vectorised torch or Triton kernels
    rejection_sample_reference(...)           # per-request Python loop (tests, benchmark baseline)
    RejectionOutput, RejectionRandoms, draw_randoms

Papers: Leviathan et al. arXiv 2211.17192; Chen et al. arXiv 2302.01318. Engine followed: vLLM
``vllm/v1/sample/rejection_sampler.py``. The Triton module is imported lazily (only for impl="triton").
"""

from .rejection import (
    PLACEHOLDER_TOKEN_ID,
    RejectionOutput,
    RejectionRandoms,
    draw_randoms,
    rejection_sample,
    rejection_sample_reference,
)
from .sampling import SamplingParams, apply_sampling

__all__ = [
    "PLACEHOLDER_TOKEN_ID",
    "RejectionOutput",
    "RejectionRandoms",
    "SamplingParams",
    "apply_sampling",
    "draw_randoms",
    "rejection_sample",
    "rejection_sample_reference",
]
