"""Lossless speculative-decoding verifier: rejection sampling as a pure function of tensors.

Public API::

    SamplingParams, apply_sampling            # per-request temperature / top-k / top-p (vLLM semantics)
    effective_temperature, MIN_TEMPERATURE    # vLLM's clamp of tiny temperatures (0 < t < 1e-2 -> 1e-2)
    rejection_sample(..., impl="auto"|"torch"|"triton", order="auto"|"lazy"|"eager")
    rejection_sample_reference(...)           # per-request Python loop (tests, benchmark baseline)
    RejectionOutput, RejectionRandoms, draw_randoms
    VerifyInputError                          # bad input: a SpeculatorsError and a ValueError
    DraftTree, TreeVerifyOutput, tree_rejection_sample   # draft trees (SpecInfer / EAGLE-2), .tree
    parse_token_tree, tree_from_paths, tree_depths, ancestor_mask   # vLLM's speculative_token_tree

Papers: Leviathan et al. arXiv 2211.17192; Chen et al. arXiv 2302.01318. Engine followed: vLLM
``vllm/v1/sample/rejection_sampler.py``. The Triton module is imported lazily (only for impl="triton").
Compute dtype: float32 on every path; inputs are detached (not differentiable). Import graph: a DAG
rooted at the leaf module :mod:`speculators.verify.layout` (see its docstring).
"""

from .layout import PLACEHOLDER_TOKEN_ID, RejectionOutput, VerifyInputError
from .rejection import (
    RejectionRandoms,
    draw_randoms,
    rejection_sample,
    rejection_sample_reference,
)
from .sampling import MIN_TEMPERATURE, SamplingParams, apply_sampling, effective_temperature
from .tree import (
    DraftTree,
    TreeVerifyOutput,
    ancestor_mask,
    parse_token_tree,
    tree_depths,
    tree_from_paths,
    tree_rejection_sample,
)

__all__ = [
    "DraftTree",
    "MIN_TEMPERATURE",
    "PLACEHOLDER_TOKEN_ID",
    "RejectionOutput",
    "RejectionRandoms",
    "SamplingParams",
    "TreeVerifyOutput",
    "VerifyInputError",
    "ancestor_mask",
    "apply_sampling",
    "draw_randoms",
    "effective_temperature",
    "parse_token_tree",
    "rejection_sample",
    "rejection_sample_reference",
    "tree_depths",
    "tree_from_paths",
    "tree_rejection_sample",
]
