"""Speculative decoding: the batched loop and what it drafts with.

``loop`` (:func:`speculators.decode.loop.speculative_generate`: join, step, retire), ``state`` (the run's state and
results), ``recorder`` (its clock and counters), ``chain`` and ``tree`` (one verification step over draft chains or
draft trees), ``inputs`` (checked prompts, per-request settings, stop ids), ``gating`` (DSpark's confidence gate),
``proposal`` (the proposer protocol and the K cap, shared with the drafters), ``proposers`` (model-free proposers:
n-gram, suffix, hybrid, argmax drafts) and ``tree_spec`` (the draft-tree request).
"""
