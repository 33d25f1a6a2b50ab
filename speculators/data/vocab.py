"""The draft vocabulary: the N most frequent target tokens a reduced-vocabulary drafter predicts.

Built by the data pipeline from assistant-token frequencies (:func:`speculators.data.pipeline.prepare_data`)
and used by the drafters (their ``d2t`` / ``t2d`` buffers). It lives in the data layer so that the data
pipeline never imports ``speculators.drafters``; ``speculators.data.vocab.DraftVocab`` re-exports it.
"""

from __future__ import annotations

import torch

from ..errors import SpeculatorsError


class DraftVocab:
    """Draft vocabulary mapping (ALGORITHMS.md, "Draft vocabulary"; vLLM / EAGLE-3's ``d2t`` / ``t2d``).

    Attributes:
        d2t: ``[N]`` int64 offsets: ``target_id = i + d2t[i]`` (vLLM's convention).
        t2d: ``[V]`` bool, True for the N target ids in the draft vocabulary.

    Raises:
        SpeculatorsError: ``t2d`` marks a different number of ids than ``d2t`` has entries.
    """

    def __init__(self, d2t: torch.Tensor, t2d: torch.Tensor):
        self.d2t = d2t.to(torch.int64)
        self.t2d = t2d.to(torch.bool)
        n = int(self.t2d.sum())
        if n != self.d2t.numel():
            raise SpeculatorsError(f"draft vocab: t2d has {n} True entries but d2t has {self.d2t.numel()}")

    @property
    def size(self) -> int:
        """N, the number of draft ids."""
        return self.d2t.numel()

    @property
    def target_ids(self) -> torch.Tensor:
        """``[N]`` int64 sorted target ids of the draft vocabulary."""
        return torch.arange(self.size, dtype=torch.int64) + self.d2t

    def head_rows(self, lm_head_weight: torch.Tensor) -> torch.Tensor:
        """The target output head restricted to the draft vocabulary: ``lm_head_weight [V, H]`` ->
        ``[N, H]`` float32 (detached), what a reduced-vocabulary drafter head starts from (EAGLE-3's recipe)."""
        return lm_head_weight.detach().float()[self.target_ids]

    @classmethod
    def full(cls, vocab_size: int) -> "DraftVocab":
        """The identity mapping over all ``vocab_size`` target ids (no reduction)."""
        return cls(torch.zeros(vocab_size, dtype=torch.int64), torch.ones(vocab_size, dtype=torch.bool))

    @classmethod
    def from_counts(cls, counts: torch.Tensor, size: int | None) -> "DraftVocab":
        """Keep the ``size`` most frequent ids (ties: lower id), sorted; ``size=None`` = full vocab.

        Args:
            counts: ``[V]`` int64 token frequencies on loss-masked (assistant) tokens.
            size: N, the recipe's ``drafter.draft_vocab_size`` (None = V).
        Raises:
            SpeculatorsError: ``size`` larger than the target vocabulary.
        """
        V = counts.numel()
        if size is None or size == V:
            return cls.full(V)
        if size > V:
            raise SpeculatorsError(f"drafter.draft_vocab_size {size} exceeds the target vocab {V}")
        # stable descending sort by count keeps the lower id first among ties
        order = torch.sort(-counts.to(torch.int64), stable=True).indices[:size]
        ids = torch.sort(order).values
        t2d = torch.zeros(V, dtype=torch.bool)
        t2d[ids] = True
        return cls(ids - torch.arange(size), t2d)
