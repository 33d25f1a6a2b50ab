"""DFlash (arXiv 2602.06036): a block-diffusion drafter with target-context KV injection.

Architecture (ALGORITHMS.md "DFlash"; weight names as vLLM's ``DFlashQwen3ForCausalLM`` loads them):

* context: the target's aux hidden states (``meta.aux_layer_ids``, n taps) -> ``fc: Linear(nH -> H,
  bias=False)`` -> ``hidden_norm`` (RMSNorm): one context vector ``c[t]`` per verified position t;
* ``num_layers`` Qwen3-style decoder layers (``input_layernorm``, ``self_attn.{q,k,v,o}_proj`` with
  per-head ``self_attn.{q,k}_norm``, ``post_attention_layernorm``, SwiGLU ``mlp``; sizes and RoPE from
  the target's config). Every layer injects the context as extra keys/values through ITS OWN
  projections: ``K = [k_norm(k_proj(c)); k_norm(k_proj(x))]``, ``V = [v_proj(c); v_proj(x)]`` where
  ``x = input_layernorm(h)`` are the block's hidden states (the context does not pass through
  ``input_layernorm``, as in the reference implementation and vLLM); queries come only from the
  block. Context keys are rotated at their own positions, block keys/queries at theirs;
* a block ``[x_a, MASK x (B-1)]`` (``block_size`` B) at positions ``a..a+B-1``, embedded with the
  target's FROZEN token embedding (``mask_token_id`` is an existing row), attends bidirectionally
  inside itself and to the context of positions ``< a`` (strictly before its anchor ``a``);
* final ``norm`` (trained) and the target's FROZEN output head: the full vocabulary by default
  (the attached target's ``lm_head``, never saved), or with ``draft_vocab_size`` a frozen ``lm_head``
  holding the target's rows of the draft vocabulary (saved with ``d2t``/``t2d``, as EAGLE-3's).

Labels: slot k (1..B-1) of the block anchored at a predicts token ``x_{a+k}``; slot 0 is not trained.
``labels: token`` (default, the paper's CE) uses the data token ``x_{a+k}``; ``labels: argmax`` the
target's greedy token at ``a+k-1`` (``Batch.argmax``). DSpark (``dspark.py``) subclasses this drafter
with :attr:`DFlashDrafter.sample_from_anchor` (slot k predicts ``x_{a+k+1}``, slot 0 included).

Training (:meth:`DFlashDrafter.loss`): per sequence up to ``num_anchors`` anchors drawn uniformly
without replacement among positions p with ``loss_mask[p] & loss_mask[p+1]`` (both real tokens),
resampled every step from a seed drawn from torch's global RNG (checkpointed by the trainer, so a
resumed run draws the same anchors); :meth:`loss_counts` and the following :meth:`loss` of the same
batch content share the draw. In eval mode the anchors are a pure function of the batch content
(held-out metrics are deterministic and consume no RNG). All blocks of a batch go through ONE forward:
queries ``[A*B]``, keys ``[T context; A*B block]`` and one boolean SDPA mask in which block a sees the
context keys ``< anchor_a`` (real tokens) and its own block only. Loss: sum over slots k of CE_k, the CE of
the supervised (anchor, slot k) pairs (slot inside the sequence, loss-masked, label in the draft vocabulary)
each weighted by D-PACE's weight of its block (``position_weights: dpace``, the default), or of
``exp(-(k-1)/gamma) * CE_k`` (``exp_decay``, the DFlash paper's), each slot's sum divided by ``norm[k-1]``
(per-slot terms for the count normalisation, :meth:`Drafter.loss`). Memory: the mask and SDPA scores are
``O(A*B * (T + A*B))`` per sequence and head.

Inference: the state holds, per draft layer, the context K/V cache of the verified positions
``0..n-1`` (rotated, from their target features) and the newest token ``x_n``. ``propose`` runs ONE
forward over ``[x_n, MASK x k]`` at positions ``n..n+k`` against the cache (the block vLLM serves with
``num_speculative_tokens = k <= B-1``: shorter than the trained block when k < B-1) and returns the
drafts of slots ``1..k``, without writing anything (rejected drafts leave no trace);
``advance`` appends the K/V of the newly verified positions' features.

Export (``speculators_model_type: dflash``; vLLM and llama.cpp): :class:`DFlashFormat` and FORMATS.md; never a
``mask_hidden`` weight, and the token embedding is the target's (the engines share it).
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import ClassVar, Literal

import torch
import torch.nn.functional as F
from pydantic import Field, field_validator, model_validator
from torch import nn
from transformers.models.llama.modeling_llama import rotate_half

from ..data.vocab import DraftVocab
from ..divergences import dpace_weights
from ..errors import SpeculatorsError
from ..losses import chained_acceptance, combine_terms, draft_to_target, hard_cross_entropy, sample_draft, target_to_draft
from ..verify import SamplingParams
from .base import Drafter, DrafterConfig
from ..decode.proposal import Proposal
from .checkpoint import TargetMeta
from .registry import register
from .dflash_format import DFlashFormat
from .anchors import AnchorSeeds, sample_anchors, valid_anchor_positions
from .layers import (DecoderLayer, DraftVocabBuffers, KVCache, RMSNorm, Rotary, effective_rms_scale, head_dim,
                     layer_config)


def default_gamma(block_size: int) -> float:
    """DFlash's loss-decay gamma for block size ``B``: 4 for ``B <= 8``, 7 for ``B >= 16`` (the paper's
    two settings), linear in between."""
    if block_size <= 8:
        return 4.0
    if block_size >= 16:
        return 7.0
    return 4.0 + 3.0 * (block_size - 8) / 8.0


class DFlashBlockConfig(DrafterConfig):
    """The keys of a DFlash-backbone family (DFlash, DSpark): the block, the anchors, the labels and the
    layers. A family subclasses it with its ``algorithm`` and loss keys (:class:`DFlashConfig`,
    :class:`speculators.drafters.dspark.DSparkConfig`).

    Keys:
        num_layers: draft decoder layers (DFlash's default taps: one target layer per draft layer).
        block_size: B, the block ``[anchor, MASK x (B-1)]``, 2 <= B <= 64.
        num_anchors: anchors sampled per sequence and step (>= 1; fewer when a sequence has fewer
            valid positions).
        mask_token_id: the token whose (frozen) embedding fills the mask slots; must be a row of the
            target's embedding; default: the last id ``V - 1`` (resolved when the drafter is built).
        labels: ``token`` (CE to the data token a slot predicts) or ``argmax`` (CE to the target's greedy
            token at the position before it).
        intermediate_size: MLP width; default the target's.
        draft_vocab_size: optional reduced draft vocabulary (the target's frozen head rows); unset =
            the full vocabulary through the target's own head.
    """

    num_layers: int = Field(default=1, ge=1, le=16, description="draft decoder layers (DFlash's default taps: one "
                                                                "target layer per draft layer)")
    block_size: int = Field(default=8, description="B: the block `[anchor, MASK x (B-1)]`; 2 <= B <= 64; one forward "
                                                   "drafts B-1 tokens (`dflash`) or B (`dspark`: slot 0 drafts from "
                                                   "the anchor)")
    num_anchors: int = Field(default=512, description="anchors sampled per sequence and step (>= 1; fewer when a "
                                                      "sequence has fewer valid positions)")
    mask_token_id: int | None = Field(default=None, ge=0, description="token whose frozen embedding fills the mask "
                                      "slots (a row of the target's embedding); null = the last id V-1")
    labels: Literal["token", "argmax"] = Field(default="token", description="CE label of a slot: `token` (the data "
                                               "token) or `argmax` (the target's greedy token)")
    intermediate_size: int | None = Field(default=None, gt=0, description="MLP width; default: the target's")

    @field_validator("block_size")
    @classmethod
    def _block_size(cls, v: int) -> int:
        if v < 2 or v > 64:
            raise ValueError(f"block_size {v}: a DFlash block is [anchor, MASK x (B-1)] and needs 2 <= B <= 64")
        return v

    @field_validator("num_anchors")
    @classmethod
    def _num_anchors(cls, v: int) -> int:
        if v < 1:
            raise ValueError(f"num_anchors {v}: at least one anchor per sequence is needed (>= 1)")
        return v


class DFlashConfig(DFlashBlockConfig):
    """``drafter:`` section of a DFlash recipe: the :class:`DFlashBlockConfig` keys (one forward drafts
    ``block_size - 1`` tokens; ``labels: token`` is the data token ``x_{a+k}``, ``argmax`` the target's
    greedy token at ``a+k-1``) plus

        position_weights: ``dpace`` (default; D-PACE, :func:`speculators.divergences.dpace_weights`) or
            ``exp_decay`` (the DFlash paper's fixed slot weights).
        gamma: with ``exp_decay``, loss weight ``exp(-(k-1)/gamma)`` of slot k; default :func:`default_gamma` (4
            for B=8, 7 for B=16).
        dpace_alpha: with ``dpace``, D-PACE's smoothing.
    """

    algorithm: Literal["dflash"] = "dflash"
    gamma: float | None = Field(default=None, gt=0.0, description="with position_weights: exp_decay only: slot-k "
                                "loss weight `exp(-(k-1)/gamma)`; null = 4 for B <= 8, 7 for B >= 16, linear in "
                                "between")
    position_weights: Literal["exp_decay", "dpace"] = Field(
        default="dpace", description="dpace: D-PACE's per-position weights from the draft's own confidence along the "
        "block (vllm-project/speculators' DFlash default; measured better than exp_decay, docs/RESULTS.md); "
        "exp_decay: slot k weighs exp(-(k-1)/gamma) (the DFlash paper's)")
    dpace_alpha: float = Field(default=0.5, gt=0.0, le=1.0, description="D-PACE's smoothing s = (1-a) c + a")

    @model_validator(mode="after")
    def _default_gamma(self) -> "DFlashConfig":
        if self.gamma is None:
            self.gamma = default_gamma(self.block_size)
        return self


class _DFlashLayer(DecoderLayer):
    """A Qwen3-style decoder layer: Llama layer + per-head RMSNorms ``self_attn.q_norm`` / ``k_norm``."""

    def __init__(self, cfg):
        super().__init__(cfg)
        hd = head_dim(cfg)
        self.self_attn.q_norm = RMSNorm(hd, eps=cfg.rms_norm_eps)
        self.self_attn.k_norm = RMSNorm(hd, eps=cfg.rms_norm_eps)


def _rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotate ``x [B, heads, T, hd]`` with ``cos, sin [B, T, hd]``."""
    return x * cos.unsqueeze(1) + rotate_half(x) * sin.unsqueeze(1)


@dataclass
class DFlashState:
    """Per-request inference state.

    Attributes:
        cache: per draft layer, the context K/V of verified positions ``0..n-1``: ``[1, n_kv, n, hd]``
            (keys normed and rotated at their positions).
        num_positions: n, the number of verified positions whose features are in the cache.
        last_id: ``x_n``, the newest token (the next block's anchor, at position n).
    """

    cache: KVCache
    num_positions: int
    last_id: int


@register
class DFlashDrafter(DraftVocabBuffers, Drafter):
    """DFlash drafter (see the module docstring). Shapes: ``B`` batch, ``T`` sequence, ``A`` anchors per
    sequence, ``Bs`` block size, ``H`` hidden, ``V`` target vocab, ``N`` draft vocab."""

    algorithm = "dflash"
    config_class = DFlashConfig
    serving = DFlashFormat()

    def __init__(self, cfg: DFlashConfig, meta: TargetMeta | dict, draft_vocab_size: int | None = None):
        """Raises:
            SpeculatorsError: ``mask_token_id`` outside the target vocabulary, or a draft vocabulary
                larger than the target's.
        """
        super().__init__(cfg, meta)
        over = {"intermediate_size": cfg.intermediate_size} if cfg.intermediate_size else {}
        self.layer_cfg = layer_config(self.meta.target_config, num_hidden_layers=cfg.num_layers, **over)
        H, V, n_aux = self.layer_cfg.hidden_size, self.meta.vocab_size, len(self.meta.aux_layer_ids)
        mask_id = V - 1 if cfg.mask_token_id is None else cfg.mask_token_id
        if not 0 <= mask_id < V:
            raise SpeculatorsError(f"drafter.mask_token_id: {mask_id} is not a row of the target's embedding "
                                   f"(allowed: 0..{V - 1})")
        if cfg.mask_token_id is None:
            self.cfg = cfg = cfg.model_copy(update={"mask_token_id": mask_id})
        N = V if draft_vocab_size is None else int(draft_vocab_size)
        if not 0 < N <= V:
            raise SpeculatorsError(f"drafter.draft_vocab_size: {N} must lie in 1..{V} (the target vocabulary)")
        self.fc = nn.Linear(n_aux * H, H, bias=False)
        self.hidden_norm = RMSNorm(H, eps=self.layer_cfg.rms_norm_eps)
        self.layers = nn.ModuleList([_DFlashLayer(self.layer_cfg) for _ in range(cfg.num_layers)])
        self.norm = RMSNorm(H, eps=self.layer_cfg.rms_norm_eps)
        self.rotary = Rotary(self.layer_cfg)
        self.reduced_vocab = N != V
        if self.reduced_vocab:  # frozen rows of the target's head + vLLM's d2t/t2d
            self.lm_head = nn.Linear(H, N, bias=False)
            self.lm_head.weight.requires_grad_(False)
            self.register_draft_vocab(N, V)
        self._anchor_seeds = AnchorSeeds()

    # ------------------------------------------------------------------ construction
    def output_heads(self) -> list[nn.Module]:
        """The frozen draft-vocabulary ``lm_head``; none at the full vocabulary, where the target's is borrowed
        (:meth:`Drafter.output_heads`)."""
        return [self.lm_head] if self.reduced_vocab else []

    @classmethod
    def from_target(cls, cfg: DFlashConfig, target, vocab: DraftVocab) -> "DFlashDrafter":
        """A fresh drafter for ``target``: the target's embedding and head are attached (frozen, not
        copied); with a reduced ``vocab`` the frozen ``lm_head`` holds the target's rows of it. The
        final ``norm`` (trained) starts from the target's final norm weight.

        Raises:
            SpeculatorsError: ``vocab`` is reduced while ``cfg.draft_vocab_size`` is unset (the config
                asks for the full vocabulary) or has another size than ``cfg.draft_vocab_size``.
        """
        want = cfg.draft_vocab_size or target.vocab_size
        if vocab.size != want:
            what = ("drafts over the full target vocabulary" if cfg.draft_vocab_size is None
                    else f"asks for a draft vocabulary of {cfg.draft_vocab_size}")
            raise SpeculatorsError(f"drafter.draft_vocab_size: this {cls.algorithm} config {what} ({want} tokens), "
                                   f"but a draft vocabulary of {vocab.size} was given")
        d = cls(cfg, TargetMeta.from_target(target), None if vocab.size == target.vocab_size else vocab.size)
        scale = effective_rms_scale(target.final_norm, d.norm.weight.shape[0])
        if scale is not None:  # start where the frozen head expects its input
            with torch.no_grad():
                d.norm.weight.copy_(scale)
        if d.reduced_vocab:
            d.init_draft_vocab(target, vocab, [d.lm_head])
        d.attach_target(target)
        return d

    @classmethod
    def _build(cls, cfg: DFlashConfig, meta: TargetMeta, weights: dict[str, torch.Tensor]) -> "DFlashDrafter":
        """Empty module; a checkpoint with ``lm_head.weight`` has a draft vocabulary of its row count."""
        head = weights.get("lm_head.weight")
        return cls(cfg, meta, None if head is None else head.shape[0])

    # ------------------------------------------------------------------ pieces
    @property
    def block_size(self) -> int:
        return self.cfg.block_size

    max_speculative_tokens_source = "drafter.block_size - 1"

    @property
    def max_speculative_tokens(self) -> int:
        """The most drafts one step can give: ``block_size - 1`` (the block's mask slots); a larger K is
        refused (:meth:`_propose_one`, and before decoding by the eval and the generation loop)."""
        return self.cfg.block_size - 1

    def embed(self, ids: torch.Tensor) -> torch.Tensor:
        """The target's frozen embedding: ``ids [...]`` int64 -> ``[..., H]`` in the drafter's dtype.

        Raises:
            RuntimeError: ``attach_target`` was not called.
        """
        return self.frozen_target.embed(ids, self.fc.weight)

    def head(self, h: torch.Tensor) -> torch.Tensor:
        """Frozen output head: ``[..., H]`` normed hidden -> ``[..., N]`` logits (draft vocabulary)."""
        return self.lm_head(h) if self.reduced_vocab else self.frozen_target.lm_head(h)

    def to_target_ids(self, idx: torch.Tensor) -> torch.Tensor:
        """Draft-vocabulary indices -> target ids (identity for the full vocabulary)."""
        return draft_to_target(idx, self.d2t) if self.reduced_vocab else idx

    def context(self, aux: torch.Tensor) -> torch.Tensor:
        """``[..., n_aux*H]`` aux hidden states -> ``[..., H]`` context ``hidden_norm(fc(aux))``."""
        return self.hidden_norm(self.fc(aux.to(self.fc.weight.dtype)))

    def _q(self, attn, x, cos, sin) -> torch.Tensor:
        B, T, _ = x.shape
        q = attn.q_norm(attn.q_proj(x).view(B, T, attn.num_heads, attn.head_dim)).transpose(1, 2)
        return _rope(q, cos, sin)

    def _kv(self, attn, x, cos, sin) -> tuple[torch.Tensor, torch.Tensor]:
        B, T, _ = x.shape
        k = attn.k_norm(attn.k_proj(x).view(B, T, attn.num_kv, attn.head_dim)).transpose(1, 2)
        v = attn.v_proj(x).view(B, T, attn.num_kv, attn.head_dim).transpose(1, 2)
        return _rope(k, cos, sin), v

    def context_kv(self, ctx: torch.Tensor, pos: torch.Tensor) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
        """Per draft layer the context keys/values: ``ctx [B, S, H]`` at positions ``pos [B, S]`` ->
        lists of ``[B, n_kv, S, hd]`` (keys normed and rotated)."""
        cos, sin = self.rotary(ctx, pos)
        ks, vs = [], []
        for layer in self.layers:
            k, v = self._kv(layer.self_attn, ctx, cos, sin)
            ks.append(k)
            vs.append(v)
        return ks, vs

    def block_forward(self, emb: torch.Tensor, pos: torch.Tensor, ctx_k: list[torch.Tensor],
                      ctx_v: list[torch.Tensor], mask: torch.Tensor | None) -> torch.Tensor:
        """The decoder stack over block tokens with injected context K/V.

        Args:
            emb: ``[B, Q, H]`` block embeddings; pos: ``[B, Q]`` their position ids.
            ctx_k, ctx_v: per layer ``[B, n_kv, S, hd]`` context keys/values (:meth:`context_kv`).
            mask: boolean ``[B, 1, Q, S + Q]`` (True = attend; keys ordered context then block), or
                None = every query sees every key (one block at inference).
        Returns:
            ``[B, Q, H]`` after the final ``norm``.
        """
        cos, sin = self.rotary(emb, pos)
        h = emb
        for i, layer in enumerate(self.layers):
            attn = layer.self_attn
            x = layer.input_layernorm(h)
            q = self._q(attn, x, cos, sin)
            kb, vb = self._kv(attn, x, cos, sin)
            k = torch.cat([ctx_k[i].to(kb.dtype), kb], dim=2)
            v = torch.cat([ctx_v[i].to(vb.dtype), vb], dim=2)
            o = F.scaled_dot_product_attention(q, k, v, attn_mask=mask, enable_gqa=k.shape[1] != q.shape[1])
            h = h + attn.out(o)
            h = h + layer.mlp(layer.post_attention_layernorm(h))
        return self.norm(h)

    # ------------------------------------------------------------------ anchors (drafters/anchors.py)
    @staticmethod
    def valid_anchor_positions(batch) -> torch.Tensor:
        """``[B, T]`` bool: positions that may anchor a block (:func:`.anchors.valid_anchor_positions`)."""
        return valid_anchor_positions(batch)

    def sample_anchors(self, batch, seed: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Up to ``num_anchors`` anchors per sequence (:func:`.anchors.sample_anchors`):
        ``(anchors [B, A] int64, valid [B, A] bool)`` on the batch's device."""
        return sample_anchors(self.valid_anchor_positions(batch), self.cfg.num_anchors, seed, batch.input_ids.device)

    def _anchors(self, batch, for_counts: bool) -> tuple[torch.Tensor, torch.Tensor]:
        """The anchors of this step for ``batch`` (see the module docstring): eval mode -> seeded by the
        content; training -> a seed from torch's RNG, shared by ``loss_counts`` and the next ``loss``
        of the same batch content (:class:`.anchors.AnchorSeeds`)."""
        return self.sample_anchors(batch, self._anchor_seeds.seed(batch, self.training, for_counts))

    # ------------------------------------------------------------------ training
    @property
    def counts_use_argmax(self) -> bool:
        return self.reduced_vocab and self.cfg.labels == "argmax"

    #: DSpark's "sample_from_anchor": slot k (0..Bs-1) predicts ``x_{a+k+1}``; DFlash (False): slot k
    #: (1..Bs-1) predicts ``x_{a+k}`` and slot 0 is not trained.
    sample_from_anchor: ClassVar[bool] = False

    def _slot_labels(self, batch, anchors: torch.Tensor, anchor_valid: torch.Tensor):
        """Per trained slot of every anchor: ``(labels [B, A, S] target ids, labelled, valid)``; DFlash:
        slots k = 1..Bs-1 (S = Bs-1) predict position ``p = a + k``; with :attr:`sample_from_anchor`
        slots k = 0..Bs-1 (S = Bs) predict ``p = a + k + 1``.

        The label is ``x_p`` (``labels: token``) or the target's argmax at ``p - 1``. ``labelled``: the
        anchor is valid, ``p < T`` and token ``p`` is a real assistant token (the metrics' chains).
        ``valid``: labelled and the label lies in the draft vocabulary (the loss's supervised pairs)."""
        T = batch.input_ids.shape[1]
        shift = int(self.sample_from_anchor)
        k = torch.arange(1 - shift, self.block_size, device=anchors.device)
        pos = anchors.unsqueeze(-1) + k + shift  # [B, A, S]
        inside = pos < T
        pc = pos.clamp(max=T - 1)
        B = anchors.shape[0]
        flat = pc.reshape(B, -1)
        lm = (batch.loss_mask & batch.attention_mask).gather(1, flat).view_as(pos)
        labelled = anchor_valid.unsqueeze(-1) & inside & lm
        if self.cfg.labels == "token":
            labels = batch.input_ids.gather(1, flat).view_as(pos)
        else:
            labels = batch.argmax.gather(1, (flat - 1).clamp(min=0)).view_as(pos)
        valid = labelled
        if self.reduced_vocab:
            valid = valid & target_to_draft(labels, self.t2d)[1]
        return labels, labelled, valid

    def loss_counts(self, batch) -> torch.Tensor:
        """``[S]`` int64: supervised (anchor, slot k) pairs per slot term (``S = block_size - 1``; ``block_size``
        with :attr:`sample_from_anchor`), for this step's anchors (see :meth:`Drafter.loss_counts`; shares
        the draw with the next :meth:`loss`)."""
        anchors, ok = self._anchors(batch, for_counts=True)
        return self._slot_labels(batch, anchors, ok)[2].sum(dim=(0, 1))

    def slot_logits(self, batch, anchors: torch.Tensor) -> torch.Tensor:
        """The one-forward training path: every anchor's block in ONE forward with the block-sparse mask.

        Args:
            batch: a :class:`speculators.data.dataset.Batch` (``aux``, ``input_ids``, ``attention_mask``).
            anchors: ``[B, A]`` int64 anchor positions (any in ``0..T-1``).
        Returns:
            ``[B, A, Bs, H]`` final-normed hidden states of every (anchor, slot) (apply :meth:`head`
            for logits). Block a sees the context positions ``< anchors[a]`` that are real tokens and its
            own ``Bs`` slots.
        """
        B, T = batch.input_ids.shape
        A, Bs = anchors.shape[1], self.block_size
        dev = batch.input_ids.device
        ctx = self.context(batch.aux)
        ctx_k, ctx_v = self.context_kv(ctx, torch.arange(T, device=dev).unsqueeze(0).expand(B, T))
        ids = torch.full((B, A, Bs), self.cfg.mask_token_id, dtype=torch.int64, device=dev)
        ids[:, :, 0] = batch.input_ids.gather(1, anchors)
        pos = (anchors.unsqueeze(-1) + torch.arange(Bs, device=dev)).reshape(B, A * Bs)
        mask = self.block_sparse_mask(anchors, batch.attention_mask)
        h = self.block_forward(self.embed(ids.reshape(B, A * Bs)), pos, ctx_k, ctx_v, mask)
        return h.view(B, A, Bs, -1)

    def block_sparse_mask(self, anchors: torch.Tensor, attention_mask: torch.Tensor) -> torch.Tensor:
        """The training path's attention mask (built with tensor ops, no loop over anchors).

        Args:
            anchors: ``[B, A]`` int64 anchor positions.
            attention_mask: ``[B, T]`` bool, True on real tokens.
        Returns:
            boolean ``[B, 1, A*Bs, T + A*Bs]`` (True = attend): query (a, j) at row ``a*Bs + j`` sees the
            context keys ``t < anchors[a]`` with ``attention_mask[t]`` (columns ``0..T-1``) and the ``Bs``
            keys of its own block (columns ``T + a*Bs .. T + a*Bs + Bs - 1``), bidirectionally.
        """
        B, A = anchors.shape
        T, Bs, dev = attention_mask.shape[1], self.block_size, anchors.device
        t = torch.arange(T, device=dev)
        ctx_ok = (t < anchors.unsqueeze(-1)) & attention_mask.unsqueeze(1)  # [B, A, T]
        ctx_ok = ctx_ok.repeat_interleave(Bs, dim=1)  # [B, A*Bs, T]
        blk = torch.arange(A, device=dev).repeat_interleave(Bs)
        own = (blk.unsqueeze(1) == blk.unsqueeze(0)).unsqueeze(0).expand(B, -1, -1)  # [B, A*Bs, A*Bs]
        return torch.cat([ctx_ok, own], dim=-1).unsqueeze(1)

    def slot_weights(self) -> list[float]:
        """``exp(-(k-1)/gamma)`` for slots k = 1..Bs-1."""
        return [math.exp(-(k - 1) / self.cfg.gamma) for k in range(1, self.block_size)]

    def loss(self, batch, norm: torch.Tensor | None = None) -> tuple[torch.Tensor, dict[str, float]]:
        """``sum_k CE_k / norm[k-1]`` over slots k = 1..Bs-1 (see the module docstring; ``norm`` default: this
        batch's counts, i.e. each term is a mean), each (anchor, slot) CE weighted by
        :func:`speculators.divergences.dpace_weights` of its block (``position_weights: dpace``, the default),
        or each slot term by ``exp(-(k-1)/gamma)`` (``exp_decay``).

        CE_k: cross entropy of slot k's logits (draft vocabulary) against its label (the data token
        ``x_{a+k}``, or the target's argmax at ``a+k-1`` with ``labels: argmax``), summed over the
        supervised pairs. Logits are computed only where a slot is labelled.

        Returns:
            loss (scalar) and metrics ``loss_j`` (slot j+1's mean CE), ``num_anchors`` (valid anchors per
            sequence, mean) and ``full_acc_j, cond_acc_j, sim_tau`` from
            :func:`speculators.losses.chained_acceptance`: slot j+1's top-1 draft (target id) equals the
            target's greedy token at ``a + j`` (``Batch.argmax``), labelled when token ``a + j + 1`` is a
            real assistant token inside the sequence.
        Raises:
            RuntimeError: ``attach_target`` was not called.
        """
        anchors, ok = self._anchors(batch, for_counts=False)
        labels, labelled, valid = self._slot_labels(batch, anchors, ok)
        counts = valid.sum(dim=(0, 1))
        h = self.slot_logits(batch, anchors)[:, :, 1:]  # [B, A, Bs-1, H]
        sel = labelled
        logits = self.head(h[sel]).float()  # [n_sel, N]
        lbl = labels[sel]
        if self.reduced_vocab:
            lbl = target_to_draft(lbl, self.t2d)[0]
        slot = torch.arange(1, self.block_size, device=h.device).expand_as(sel)[sel]  # [n_sel] slot k
        ce_valid = valid[sel]
        weights = self.slot_weights()
        if self.cfg.position_weights == "dpace":  # CE_k of each (anchor, slot) weighted by D-PACE, slots weigh 1
            nll = -torch.log_softmax(logits, -1).gather(-1, torch.where(ce_valid, lbl, 0)[:, None]).squeeze(-1)
            grid = torch.zeros(sel.shape, device=nll.device)
            grid[sel] = nll.detach()
            w = dpace_weights(grid, valid & sel, self.cfg.dpace_alpha)[sel]
            sums = [torch.where(ce_valid & (slot == k), w * nll, 0.0).sum() for k in range(1, self.block_size)]
            weights = [1.0] * (self.block_size - 1)
        else:
            sums = [hard_cross_entropy(logits, lbl, ce_valid & (slot == k)) for k in range(1, self.block_size)]
        metrics: dict[str, float] = {}
        with torch.no_grad():
            pred = torch.zeros_like(labels)
            pred[sel] = self.to_target_ids(logits.argmax(-1))
            T = batch.input_ids.shape[1]
            goal_pos = (anchors.unsqueeze(-1) + torch.arange(self.block_size - 1, device=h.device)).clamp(max=T - 1)
            goal = batch.argmax.gather(1, goal_pos.reshape(goal_pos.shape[0], -1)).view_as(goal_pos)
            correct = (pred == goal) & sel
            for j in range(self.block_size - 1):
                metrics[f"loss_{j}"] = float(sums[j].detach() / counts[j].clamp(min=1))
            metrics.update(chained_acceptance([correct[..., j] for j in range(self.block_size - 1)],
                                              [labelled[..., j] for j in range(self.block_size - 1)]))
            metrics["num_anchors"] = float(ok.sum()) / max(1, ok.shape[0])
        total, self.last_own_loss = combine_terms(sums, weights, counts, norm, where=self.algorithm)
        return total, metrics

    # ------------------------------------------------------------------ inference
    @torch.no_grad()
    def start(self, input_ids: torch.Tensor, features) -> DFlashState:
        """``input_ids [n+1]`` (prompt + first target token), ``features`` of positions ``0..n-1``."""
        ids = input_ids.reshape(-1)
        state = DFlashState(KVCache(), 0, int(ids[0]))
        self._advance_one(state, ids[1:], features)
        return state

    @torch.no_grad()
    def _advance_one(self, state: DFlashState, new_ids: torch.Tensor, features) -> None:
        """Append ``m`` verified tokens ``x_{n+1}..x_{n+m}`` and the target features of positions
        ``n..n+m-1``: their context K/V join every layer's cache; ``x_{n+m}`` becomes the anchor.

        Raises:
            SpeculatorsError: the number of feature positions differs from ``m``.
        """
        new_ids = new_ids.reshape(-1)
        m = new_ids.numel()
        aux = features.aux.reshape(-1, features.aux.shape[-1])
        if aux.shape[0] != m:
            raise SpeculatorsError(f"{self.algorithm} advance: {m} new tokens but target features of {aux.shape[0]} "
                                   "positions (one per new token: features lag tokens by one)")
        if m == 0:
            return
        dev = self.fc.weight.device
        n = state.num_positions
        ctx = self.context(aux.to(dev).unsqueeze(0))
        ks, vs = self.context_kv(ctx, torch.arange(n, n + m, device=dev).unsqueeze(0))
        c = state.cache
        if not c.k:
            c.k, c.v = ks, vs
        else:
            c.k = [torch.cat([a, b], dim=2) for a, b in zip(c.k, ks)]
            c.v = [torch.cat([a, b], dim=2) for a, b in zip(c.v, vs)]
        state.num_positions = n + m
        state.last_id = int(new_ids[-1])

    def _context_of(self, state: DFlashState):
        if state.cache.k:
            return state.cache.k, state.cache.v
        cfg, dev, dt = self.layer_cfg, self.fc.weight.device, self.fc.weight.dtype
        empty = torch.zeros(1, cfg.num_key_value_heads, 0, head_dim(cfg), device=dev, dtype=dt)
        return [empty] * len(self.layers), [empty] * len(self.layers)

    @torch.no_grad()
    def block_hidden(self, state: DFlashState, size: int | None = None) -> torch.Tensor:
        """The inference path: ONE forward of ``[x_n, MASK x (S-1)]`` at positions ``n..n+S-1`` over the
        cached context (nothing is written).

        Args:
            state: the request's state (left as found).
            size: S, the block length (default: the trained ``block_size``). vLLM serves a block of
                ``num_speculative_tokens + 1`` slots (DFlash) / ``num_speculative_tokens`` slots (DSpark,
                ``sample_from_anchor``), whatever block the drafter was trained with; the block attends
                bidirectionally, so a shorter block changes every slot (:meth:`_propose_one`).
        Returns:
            ``[S, H]`` final-normed hidden states.
        Raises:
            SpeculatorsError: ``size`` outside ``1..block_size``.
        """
        n, dev = state.num_positions, self.fc.weight.device
        Bs = self.block_size if size is None else int(size)
        if not 1 <= Bs <= self.block_size:
            raise SpeculatorsError(f"{self.algorithm} block of {Bs} slots: allowed 1..{self.block_size} "
                                   "(drafter.block_size, the trained block)")
        ids = torch.full((1, Bs), self.cfg.mask_token_id, dtype=torch.int64, device=dev)
        ids[0, 0] = state.last_id
        ks, vs = self._context_of(state)
        pos = torch.arange(n, n + Bs, device=dev).unsqueeze(0)
        return self.block_forward(self.embed(ids), pos, ks, vs, None)[0]

    @torch.no_grad()
    def _propose_one(self, state: DFlashState, k: int, sampling: SamplingParams | None = None,
                     generator: torch.Generator | None = None) -> Proposal:
        """``k`` drafts from ONE forward of the block ``[x_n, MASK x k]`` (``k + 1`` slots): its slots ``1..k``.

        The block shrinks with ``k`` exactly as vLLM's DFlash proposer builds it (``1 +
        num_speculative_tokens`` query slots per request, ``vllm/v1/spec_decode/dflash.py``): served with
        fewer speculative tokens than ``block_size - 1``, vLLM runs the shorter block, and since the block
        attends bidirectionally every slot differs from the full trained block's; this method computes
        what the engine serves, not the first k slots of the full block.

        Each draft comes from :func:`speculators.losses.sample_draft` on its slot's logits under
        ``sampling`` (the request's :class:`speculators.verify.SamplingParams`, batch of one; ``None`` =
        greedy): greedy gives the argmaxes and ``probs=None``; otherwise every slot is drawn from the
        verifier's temperature/top-k/top-p transform of its own logits with ``generator`` (default: the
        request's own) and the ``[k, V]`` float32 distributions are returned. The state is not changed.

        Raises:
            SpeculatorsError: ``k`` larger than ``block_size - 1`` (the drafts one block gives), or
                ``sampling`` is not one request's valid ``SamplingParams``.
        """
        if k > self.block_size - 1:
            raise SpeculatorsError(f"K={k}: a dflash drafter with block_size {self.block_size} drafts at most "
                                   f"{self.block_size - 1} tokens per step; use K <= {self.block_size - 1} or "
                                   "train with a larger drafter.block_size")
        if k <= 0:
            return Proposal(torch.zeros(0, dtype=torch.int64), None)
        logits = self.head(self.block_hidden(state, k + 1)[1:]).float()  # [k, N]: vLLM's shrunken block
        ids, q = sample_draft(logits, sampling, generator, d2t=self.d2t if self.reduced_vocab else None,
                              vocab_size=self.meta.vocab_size)
        return Proposal(ids.to(torch.int64), q)

    drafts_trees = True  # declared capability: propose_tree (block-slot trees, EAGLE-2 dynamic or static)

    def propose_tree(self, states: list[DFlashState], spec, depth_caps: list[int], sampling=None,
                     generators=None) -> list:
        """Draft trees from the block's slots, one block forward per request as the chain's
        (:func:`speculators.drafters.dflash_tree.dflash_block_tree`: shapes, errors); states left as found."""
        from .dflash_tree import dflash_block_tree

        return dflash_block_tree(self, states, spec, depth_caps, sampling, generators)
