"""Training batches from a FeatureStore: token-budget batching, deterministic shuffling, resumable."""

from __future__ import annotations

import random
from dataclasses import dataclass, fields

import torch

from .features import FeatureStore


@dataclass
class Batch:
    """A right-padded batch of training sequences with target features.

    Attributes:
        input_ids: ``[B, T]`` int64 token ids (padding: 0).
        loss_mask: ``[B, T]`` bool, True where the token is an assistant token (to be predicted).
        attention_mask: ``[B, T]`` bool, True on real tokens.
        argmax: ``[B, T]`` int64 target's greedy next token at t (prediction for t + 1).
        aux: ``[B, T, n_aux * H]`` aux hidden states (float32 or bf16 after ``to``).
        top: ``[B, T, H]`` target final post-norm hidden state.
    """

    input_ids: torch.Tensor
    loss_mask: torch.Tensor
    attention_mask: torch.Tensor
    argmax: torch.Tensor
    aux: torch.Tensor
    top: torch.Tensor

    def to(self, device, dtype: torch.dtype = torch.float32) -> "Batch":
        out = {}
        for f in fields(self):
            t = getattr(self, f.name)
            out[f.name] = t.to(device=device, dtype=dtype) if t.is_floating_point() else t.to(device)
        return Batch(**out)

    @property
    def num_tokens(self) -> int:
        return int(self.attention_mask.sum())


def collate(rows: list[dict[str, torch.Tensor]]) -> Batch:
    """Right-pad per-example tensors (see ``FeatureStore.example``) into a :class:`Batch`."""
    B = len(rows)
    T = max(r["input_ids"].numel() for r in rows)
    nH, H = rows[0]["aux"].shape[-1], rows[0]["top"].shape[-1]
    b = Batch(torch.zeros(B, T, dtype=torch.int64), torch.zeros(B, T, dtype=torch.bool),
              torch.zeros(B, T, dtype=torch.bool), torch.zeros(B, T, dtype=torch.int64),
              torch.zeros(B, T, nH, dtype=rows[0]["aux"].dtype), torch.zeros(B, T, H, dtype=rows[0]["top"].dtype))
    for i, r in enumerate(rows):
        n = r["input_ids"].numel()
        b.input_ids[i, :n] = r["input_ids"]
        b.loss_mask[i, :n] = r["loss_mask"]
        b.attention_mask[i, :n] = True
        b.argmax[i, :n] = r["argmax"]
        b.aux[i, :n] = r["aux"]
        b.top[i, :n] = r["top"]
    return b


def plan_batches(store: FeatureStore, batch_tokens: int, seed: int, epoch: int) -> list[list[int]]:
    """Group examples into batches of at most ``batch_tokens`` padded tokens, shuffled per epoch.

    Examples are bucketed by length (little padding), then the batch order is shuffled with
    ``seed + epoch`` so that the plan is a pure function of (store, batch_tokens, seed, epoch):
    resuming at batch index i of an epoch reproduces the same data position.
    An example longer than ``batch_tokens`` forms a batch of its own.
    """
    lens = store.lengths().tolist()
    rng = random.Random(seed * 1000003 + epoch)
    order = sorted(range(len(lens)), key=lambda i: (lens[i], rng.random()))
    batches, cur, cur_max = [], [], 0
    for i in order:
        m = max(cur_max, lens[i])
        if cur and m * (len(cur) + 1) > batch_tokens:
            batches.append(cur)
            cur, m = [], lens[i]
        cur.append(i)
        cur_max = m
    if cur:
        batches.append(cur)
    rng.shuffle(batches)
    return batches


def make_batch(store: FeatureStore, indices: list[int]) -> Batch:
    return collate([store.example(i) for i in indices])
