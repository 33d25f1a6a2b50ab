"""Anchors of block drafters (DFlash, DSpark; ALGORITHMS.md "DFlash", "Training"): which positions may
anchor a block, a seeded uniform draw of up to ``num_anchors`` of them per sequence, and the seeds that
make ``loss_counts`` and the following ``loss`` of the same batch draw the same anchors."""

from __future__ import annotations

import hashlib

import torch

from .layers import shift_left


def valid_anchor_positions(batch) -> torch.Tensor:
    """``[B, T]`` bool: positions p that may anchor a block (``loss_mask[p] & loss_mask[p+1]``, both real
    tokens)."""
    lm = batch.loss_mask & batch.attention_mask
    return lm & shift_left(lm, 1)


def sample_anchors(ok: torch.Tensor, num_anchors: int, seed: int, device) -> tuple[torch.Tensor, torch.Tensor]:
    """Up to ``num_anchors`` anchors per row of ``ok [B, T]`` (bool, valid positions), uniform without
    replacement, drawn with a CPU generator seeded by ``seed``.

    Returns:
        ``(anchors [B, A] int64, valid [B, A] bool)`` on ``device``, anchors ascending within a row's valid
        ones; ``A = max(1, min(num_anchors, max valid count))`` (rows with fewer valid positions are padded
        with invalid entries).
    """
    ok = ok.cpu()
    B, T = ok.shape
    A = max(1, min(num_anchors, int(ok.sum(1).max()) if ok.numel() else 0))
    g = torch.Generator().manual_seed(int(seed))
    keys = torch.rand(B, T, generator=g)
    keys = torch.where(ok, keys, torch.full_like(keys, 2.0))  # invalid positions sort last
    idx = keys.topk(min(A, T), dim=1, largest=False).indices
    valid = ok.gather(1, idx)
    # ascending positions, valid first (invalid ones get T + position)
    order = torch.where(valid, idx, idx + T).sort(dim=1).indices
    idx, valid = idx.gather(1, order), valid.gather(1, order)
    return idx.to(device), valid.to(device)


def content_key(batch) -> bytes:
    """A digest of the batch's token ids and masks (same content, same key)."""
    h = hashlib.blake2b(digest_size=16)
    for t in (batch.input_ids, batch.loss_mask, batch.attention_mask):
        h.update(str(tuple(t.shape)).encode())
        h.update(t.detach().cpu().contiguous().numpy().tobytes())
    return h.digest()


class AnchorSeeds:
    """The seeds of training steps: a seed drawn from torch's RNG for ``loss_counts`` is kept under the batch's
    content key and handed to the next ``loss`` of the same content (so both draw the same anchors); eval
    mode seeds by the content itself (deterministic, no RNG consumed)."""

    def __init__(self):
        self.pending: dict[bytes, list[int]] = {}

    def seed(self, batch, training: bool, for_counts: bool) -> int:
        key = content_key(batch)
        if not training:
            return int.from_bytes(key[:7], "little")
        pending = self.pending.get(key)
        if not for_counts and pending:
            seed = pending.pop(0)
            if not pending:
                del self.pending[key]
            return seed
        seed = int(torch.randint(0, 2 ** 62, (1,)))
        if for_counts:
            if len(self.pending) > 256:  # counts never followed by a loss: do not grow forever
                self.pending.clear()
            self.pending.setdefault(key, []).append(seed)
        return seed
