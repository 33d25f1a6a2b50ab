"""P-EAGLE (Hui et al., arXiv 2602.01469): parallel EAGLE drafting with K-dimension (COD) sparsification.

Architecture (ALGORITHMS.md "P-EAGLE", FORMATS.md; weight names as EAGLE-3's, see ``eagle3.py``):

* EAGLE-3 inputs: ``fc: Linear(n_aux*H -> H, bias=False)`` fuses the aux hidden states; layer 0 attends
  over ``concat(input_layernorm(embed(x)), hidden_norm(g))`` (``layers.FusedInputLayer``, as EAGLE-3); ``num_layers``
  (default 2) causal decoder layers; final ``norm``; own ``lm_head: Linear(H -> N_draft)`` over the
  draft vocabulary; ``embed_tokens`` copied from the target and frozen.
* Slots after the first carry no token and no feature: a learned mask-token embedding and a learned
  shared ``mask_hidden [1, 1, n_aux*H]`` substituted for the aux features BEFORE ``fc``.

The mask-token embedding. vLLM embeds a mask slot with ``embed_tokens.weight[mask_token_id]`` and the
format says that row is trainable (``embed_requires_grad: true``). Training the whole table would let
the optimizer's weight decay drift every frozen row, so the trainable row is a separate parameter
``mask_embedding [H]`` (initialised from the target's row ``mask_token_id``). It is EXPORTED as that
row of ``embed_tokens.weight`` (and read back from it), and the drafter's own embedding lookup
(:meth:`PEagleDrafter.embed`) uses it for EVERY occurrence of ``mask_token_id``, real tokens included,
exactly as vLLM's table does: what we train and evaluate is what vLLM serves. ``mask_token_id``
defaults to the tokenizer's mask token, else the first embedding row beyond the tokenizer (an unused
slot), else the last id ``V - 1``; set ``drafter.mask_token_id`` to choose one that never occurs.

Indexing (EAGLE-3's). Element ``(a, d)`` = depth ``d`` of the chain anchored at index ``a``. Depth 0
is the real input ``(g[a], x_{a+1})``; depth ``d > 0`` is a mask slot. Every element has position
id ``a + 1 + d`` and is trained against the target's distribution at position ``a + 1 + d`` (over
``x_{a+2+d}``), restricted to the draft vocabulary and renormalised (as EAGLE-3's TTT step d at t = a).
Attention: element ``(a, d)`` sees the real inputs at indices ``<= a`` (depth-0 elements) and its own
chain's elements of depth ``<= d``, nothing else: exactly what one inference forward over
``[real context (cached), K-1 mask slots]`` sees.

Training with COD sampling (:meth:`PEagleDrafter.cod_plan`): anchors = indices ``a`` whose first
draft is labelled (``x_{a+2}`` a real assistant token), ``n`` of them per sequence. Depth 0 keeps every
anchor (and the forward also holds every real position as context); depth ``d`` keeps
``round(n * max(r^d, r_min))`` anchors, drawn only among those kept at depth ``d-1`` (uniformly, chains
whose depth-d label is loss-valid first). All kept elements of a batch go through ONE forward with
one boolean attention mask (``torch.nn.functional.scaled_dot_product_attention``); the loss is one soft
cross-entropy term per depth, no per-depth decay.

Reproducible sampling. The trainer calls :meth:`loss_counts` (masks only) for every micro-batch of a
window before the losses, so the COD sample must be the same in both: it is drawn with a generator
seeded from the batch's ids and masks, ``torch.initial_seed()`` and the number of times :meth:`loss`
has trained on that same batch (so every epoch draws a new sample; in eval mode the sample is fixed).

Inference (:meth:`PEagleDrafter._propose_one`): the drafter's KV cache holds the real inputs only;
ONE forward per step: ``advance`` runs the newly verified inputs followed by ``K-1`` mask slots (vLLM's
parallel drafting); the newest real input gives draft 1 and the mask slots, at position ids
``n+1..n+K-1``, drafts 2..K; only the real inputs are cached.
"""

from __future__ import annotations

import hashlib
from dataclasses import dataclass
from typing import Any, Literal

import torch
import torch.nn.functional as F
from pydantic import Field
from torch import nn

from .. import export
from ..data.vocab import DraftVocab
from ..errors import SpeculatorsError
from ..losses import chained_acceptance, combine_terms, sample_draft
from ..decode.proposal import check_batch, check_int, check_speculative_tokens
from ..verify import SamplingParams
from .base import Drafter, DrafterConfig
from ..decode.proposal import Proposal
from .checkpoint import TargetMeta
from .registry import register
from .serving_format import ServingFormat
from .layers import (
    DecoderLayer,
    DraftVocabBuffers,
    FusedInputLayer,
    KVCache,
    RMSNorm,
    Rotary,
    cached_attend,
    causal_mask_with_cache,
    layer_config,
    shift_left,
)


class PEagleConfig(DrafterConfig):
    """``drafter:`` section of a P-EAGLE recipe."""

    algorithm: Literal["peagle"] = "peagle"
    num_layers: int = Field(default=2, ge=1, le=8, description="causal decoder layers (2-4 in the paper)")
    num_depths: int = Field(default=4, ge=1, le=16,
                            description="K: trained depths = drafts per forward (speculative_tokens)")
    r: float = Field(default=0.7, gt=0.0, le=1.0, description="COD ratio: depth d keeps n*max(r^d, r_min)")
    r_min: float = Field(default=0.2, gt=0.0, le=1.0, description="COD floor of the kept fraction")
    mask_token_id: int | None = Field(
        default=None, ge=0, description="embedding row of the mask slots; null = resolved from the tokenizer")
    norm_before_fc: bool = Field(default=False, description="RMSNorm over the concatenated aux hidden states before "
                                                            "`fc` (as EAGLE-3's)")
    intermediate_size: int | None = Field(default=None, gt=0, description="MLP width; default: the target's")


@dataclass
class PEagleState:
    """Per-request inference state: KV cache of the real inputs and the next proposal's logits."""

    cache: KVCache
    num_positions: int          # real inputs in the cache (position ids 1..n)
    draft_logits: torch.Tensor  # [num_depths, N_draft] float32: depths 0..K-1 of the chain anchored at n-1


@dataclass
class CodPlan:
    """One COD sample of a batch (see :meth:`PEagleDrafter.cod_plan`); all ``[B, T]`` bool, one per depth.

    Attributes:
        kept: element ``(a, d)`` is in the forward (depth 0: the anchors).
        labelled: token ``a + 2 + d`` (the one depth d drafts) is a real assistant token.
        valid: ``labelled`` and the target's argmax at ``a + 1 + d`` is in the draft vocabulary (loss).
    """

    kept: list[torch.Tensor]
    labelled: list[torch.Tensor]
    valid: list[torch.Tensor]


def _resolve_mask_token_id(cfg: PEagleConfig, target) -> int:
    """``cfg.mask_token_id``, else the tokenizer's mask token, else the first row past the tokenizer,
    else ``V - 1`` (see the module docstring).

    Raises:
        SpeculatorsError: the id is not a row of the target's embedding.
    """
    V = int(target.vocab_size)
    mid = cfg.mask_token_id
    tok = getattr(target, "tokenizer", None)
    if mid is None and tok is not None and getattr(tok, "mask_token_id", None) is not None:
        mid = int(tok.mask_token_id)
    if mid is None and tok is not None and len(tok) < V:
        mid = len(tok)
    if mid is None:
        mid = V - 1
    if not 0 <= mid < V:
        raise SpeculatorsError(f"drafter.mask_token_id: {mid} is not a token of the target's vocabulary "
                               f"(allowed: 0..{V - 1})")
    return int(mid)


class PEagleFormat(ServingFormat):
    """P-EAGLE's serving format: vllm-project/speculators' ``peagle`` config (EAGLE-3's keys and weight names
    plus the mask token), which vLLM serves as ``method: eagle3`` with ``parallel_drafting``."""

    algorithm = "peagle"
    vllm_method = "eagle3"  # vLLM serves `peagle` checkpoints as eagle3 with parallel_drafting
    #: vLLM infers parallel drafting from a `peagle` config only when no method is given; with `method: eagle3` it
    #: must be asked for, else vLLM skips mask_hidden and drafts the depths one after another (a chain P-EAGLE's
    #: mask slots were not trained for)
    vllm_extra = {"parallel_drafting": True}
    llamacpp_note = ("llama.cpp has no parallel-drafting type and its converter registers no PEagleSpeculator; "
                     "served as draft-eagle3 it would draft autoregressively, which P-EAGLE's later depths "
                     "were not trained for")
    serving_aux_ids_key = "eagle_aux_hidden_state_layer_ids"
    legacy_weight_names = {"fc_norm.weight": "input_norm.weight"}  # norm_before_fc, before vLLM's name
    aux_layer_count = (3, 3)
    aux_layer_count_reason = "vLLM serves it as eagle3 and sizes fc as 3 x hidden"

    def config(self, drafter: PEagleDrafter) -> dict[str, Any]:
        """vllm-project/speculators ``peagle`` config (FORMATS.md): EAGLE-3's keys plus ``mask_token_id``
        and ``embed_requires_grad: true``; ``speculative_tokens`` = ``num_depths``. vLLM maps it to
        ``method: eagle3`` with ``parallel_drafting``."""
        m, cfg = drafter.meta, drafter.cfg
        return {
            "architectures": ["PEagleSpeculator"],
            "speculators_model_type": "peagle",
            "speculators_config": export.speculators_config(drafter.algorithm, cfg.num_depths,
                                                            m.name_or_path, m.architectures),
            "transformer_layer_config": export.transformer_layer_config(drafter.layer_cfg),
            "draft_vocab_size": int(drafter.d2t.numel()),
            "eagle_aux_hidden_state_layer_ids": m.vllm_aux_layer_ids,
            "target_hidden_size": None,
            "norm_before_residual": False,
            "norm_before_fc": cfg.norm_before_fc,
            "embed_requires_grad": True,
            "mask_token_id": int(cfg.mask_token_id),
            "tie_word_embeddings": False,
            "torch_dtype": "float32",
        }

    def state_dict(self, drafter: PEagleDrafter) -> dict[str, torch.Tensor]:
        """EAGLE-3's weight names plus ``mask_hidden [1, 1, n_aux*H]``; the learned mask embedding is the
        row ``mask_token_id`` of ``embed_tokens.weight`` (no ``mask_embedding`` key), so a saved-and-loaded
        drafter exports the same tensors."""
        sd = super().state_dict(drafter)
        emb = sd["embed_tokens.weight"].clone()
        emb[drafter.cfg.mask_token_id] = sd.pop("mask_embedding").to(emb.dtype)
        sd["embed_tokens.weight"] = emb
        return sd

    def load_state_dict(self, drafter: PEagleDrafter, sd: dict[str, torch.Tensor]) -> None:
        """Load :meth:`state_dict` weights; ``mask_embedding`` is read from the row
        ``mask_token_id`` of ``embed_tokens.weight``.

        Raises:
            SpeculatorsError: missing/unexpected names or shapes that do not match this config.
        """
        sd = dict(sd)
        emb = sd.get("embed_tokens.weight")
        if emb is not None and "mask_embedding" not in sd:
            if emb.dim() != 2 or emb.shape[0] <= drafter.cfg.mask_token_id:
                raise SpeculatorsError(f"checkpoint weights do not match peagle: embed_tokens.weight has shape "
                                       f"{tuple(emb.shape)}, no row mask_token_id={drafter.cfg.mask_token_id}")
            sd["mask_embedding"] = emb[drafter.cfg.mask_token_id].clone()
        super().load_state_dict(drafter, sd)

    def speculative_tokens(self, config: dict[str, Any]) -> int | None:
        """K of a ``peagle`` config: ``speculative_tokens`` (= the number of trained depths)."""
        return export.speculative_tokens(config)

    def reference_parity_step(self, drafter: PEagleDrafter, config: dict[str, Any], ids: list[int], feats_ours,
                              feats_ref):
        """Every depth of one parallel step after the prefix ``ids`` (``n = T - 1`` real inputs; the export
        gate, :meth:`ServingFormat.reference_parity_step`). Ours: ``start`` (whose forward drafts all depths,
        :meth:`PEagleDrafter._advance_one`), ``[D, N]``. The reference: every real input at depth 0 plus depths
        ``1..D-1`` at the last one, as vLLM's parallel drafting runs them; its logits rows
        ``n-1 .. n+D-2`` are compared."""
        from .parity_inputs import ParityStep, reference_batch

        t = torch.tensor(ids, dtype=torch.long)
        n = len(ids) - 1
        logits = drafter.start(t, feats_ours.slice(0, n)).draft_logits.float()
        D = logits.shape[0]
        T = n + D - 1
        aux = torch.zeros(1, T, feats_ref.aux.shape[-1])
        aux[:, :n] = feats_ref.aux[:, :n]
        inp = torch.zeros(1, T, dtype=torch.long)
        inp[0, :n] = t[1:]
        ref = reference_batch(aux, inp, feats_ref.top.shape[-1], loss_mask=torch.ones(1, T))
        # the reference's COD sampling returns (anchor positions, depths): pinned to one parallel step
        choice = [{"values": list(range(n)) + [n - 1] * (D - 1), "dtype": "int64"},
                  {"values": [0] * n + list(range(1, D)), "dtype": "int64"}]
        pin = {"metrics_module": "speculators.models.peagle.core", "logits_rows": [n - 1, n - 1 + D],
               "patches": [{"module": "speculators.models.peagle.core", "attr": "generate_cod_sample_indices",
                            "returns": choice}]}
        return ParityStep(ref, {"num_depths": D}, pin, {"logits": logits})


@register
class PEagleDrafter(DraftVocabBuffers, Drafter):
    """P-EAGLE drafter (see the module docstring). Shapes: ``B`` batch, ``T`` sequence, ``L`` elements of
    the training forward, ``H`` hidden, ``N`` draft vocabulary, ``V`` target vocabulary."""

    algorithm = "peagle"
    config_class = PEagleConfig
    distills = True  # every depth is trained on the target's distribution (train.loss)
    serving = PEagleFormat()

    def __init__(self, cfg: PEagleConfig, meta: TargetMeta, draft_vocab_size: int):
        """Raises:
            SpeculatorsError: ``cfg.mask_token_id`` unset or outside the target vocabulary."""
        super().__init__(cfg, meta)
        V = self.meta.vocab_size
        if cfg.mask_token_id is None or not 0 <= cfg.mask_token_id < V:
            raise SpeculatorsError(f"drafter.mask_token_id: {cfg.mask_token_id!r} is not a token of the "
                                   f"target's vocabulary (allowed: 0..{V - 1})")
        over = {"intermediate_size": cfg.intermediate_size} if cfg.intermediate_size else {}
        self.layer_cfg = layer_config(self.meta.target_config, num_hidden_layers=cfg.num_layers, **over)
        H, n_aux = self.layer_cfg.hidden_size, len(self.meta.aux_layer_ids)
        self.embed_tokens = nn.Embedding(V, H)
        self.embed_tokens.weight.requires_grad_(False)
        self.mask_embedding = nn.Parameter(torch.zeros(H))  # exported as embed_tokens.weight[mask_token_id]
        self.mask_hidden = nn.Parameter(torch.randn(1, 1, n_aux * H))
        # norm_before_fc: RMSNorm over the concatenated aux states, exported as ``input_norm.weight`` (vLLM's and
        # vllm-project/speculators' name; vLLM's ``fc_norm`` is another module, one norm per tap)
        self.input_norm = RMSNorm(n_aux * H, eps=self.layer_cfg.rms_norm_eps) if cfg.norm_before_fc else None
        self.fc = nn.Linear(n_aux * H, H, bias=False)
        self.layers = nn.ModuleList([FusedInputLayer(self.layer_cfg)] +
                                    [DecoderLayer(self.layer_cfg) for _ in range(cfg.num_layers - 1)])
        self.norm = RMSNorm(H, eps=self.layer_cfg.rms_norm_eps)
        self.lm_head = nn.Linear(H, draft_vocab_size, bias=False)
        self.register_draft_vocab(draft_vocab_size, V)
        self.rotary = Rotary(self.layer_cfg)
        self._cod_uses: dict[bytes, int] = {}

    # ------------------------------------------------------------------ construction
    def output_heads(self) -> list[nn.Module]:
        """The draft-vocabulary ``lm_head`` (:meth:`Drafter.output_heads`)."""
        return [self.lm_head]

    @classmethod
    def from_target(cls, cfg: PEagleConfig, target, vocab: DraftVocab) -> "PEagleDrafter":
        """Fresh drafter: embedding copied (frozen), ``mask_embedding`` = the target's row
        ``mask_token_id`` (resolved and written into the config, see the module docstring), lm_head from
        the target's rows of the draft vocabulary.

        Raises:
            SpeculatorsError: ``mask_token_id`` outside the target vocabulary.
        """
        cfg = cfg.model_copy(update={"mask_token_id": _resolve_mask_token_id(cfg, target)})
        d = cls(cfg, TargetMeta.from_target(target), vocab.size)
        with torch.no_grad():
            d.embed_tokens.weight.copy_(target.embed_tokens.weight.float())
            d.mask_embedding.copy_(d.embed_tokens.weight[cfg.mask_token_id])
        d.init_draft_vocab(target, vocab, [d.lm_head])
        d.attach_target(target)
        return d

    @classmethod
    def _build(cls, cfg: PEagleConfig, meta: TargetMeta, weights: dict[str, torch.Tensor]) -> "PEagleDrafter":
        """Empty module; the draft vocabulary size is ``lm_head.weight``'s row count.

        Raises:
            SpeculatorsError: the checkpoint has no ``lm_head.weight``.
        """
        return cls(cfg, meta, cls.serving.draft_vocab_size_of(weights))


    max_speculative_tokens_source = "drafter.num_depths"

    @property
    def max_speculative_tokens(self) -> int:
        """The most drafts one step can give: the trained depth ``num_depths`` (mask slots deeper than
        it were never trained); a larger K is refused
        (:func:`speculators.decode.proposal.check_speculative_tokens`), never silently capped."""
        return int(self.cfg.num_depths)

    def embed(self, ids: torch.Tensor) -> torch.Tensor:
        """Token embedding as exported: ``ids [...]`` int64 -> ``[..., H]``, the row ``mask_token_id``
        replaced by the trainable ``mask_embedding`` (module docstring)."""
        e = self.embed_tokens(ids)
        is_mask = (ids == self.cfg.mask_token_id).unsqueeze(-1)
        return torch.where(is_mask, self.mask_embedding.to(e.dtype), e)

    def fuse(self, aux: torch.Tensor) -> torch.Tensor:
        """``[..., n_aux*H]`` aux hidden states -> ``[..., H]`` fused features g (optional norm, ``fc``)."""
        if self.input_norm is not None:
            aux = self.input_norm(aux)
        return self.fc(aux)

    def _mask_inputs(self, rows: int, m: int, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
        """``(emb, hidden)`` ``[rows, m, H]`` of ``m`` mask slots: the mask-token embedding and
        ``fc(mask_hidden)`` (mask_hidden substituted for the aux features before fc)."""
        hid = self.fuse(self.mask_hidden).reshape(1, 1, -1)
        emb = self.mask_embedding.reshape(1, 1, -1)
        return emb.to(dtype).expand(rows, m, -1), hid.to(dtype).expand(rows, m, -1)

    def _run_layers(self, emb, hidden, cos, sin, attend) -> torch.Tensor:
        """Decoder stack; ``attend(layer_idx, q, k, v) -> o [B, nh, S, hd]``. Returns pre-norm ``[B, S, H]``."""
        h = hidden
        for i, layer in enumerate(self.layers):
            residual = h
            x = layer.attn_input(emb, h) if i == 0 else layer.input_layernorm(h)
            q, k, v = layer.self_attn.qkv(x, cos, sin)
            h = residual + layer.self_attn.out(attend(i, q, k, v))
            h = h + layer.mlp(layer.post_attention_layernorm(h))
        return h

    # ------------------------------------------------------------------ training
    counts_use_argmax = True  # an element counts only if the target's argmax is in the draft vocabulary

    def _cod_generator(self, batch) -> tuple[torch.Generator, bytes]:
        """CPU generator of this batch's COD sample and the batch's key (module docstring)."""
        h = hashlib.blake2b(digest_size=16)
        for t in (batch.input_ids, batch.loss_mask, batch.attention_mask):
            h.update(str(tuple(t.shape)).encode())
            h.update(t.detach().to("cpu").contiguous().numpy().tobytes())
        key = h.digest()
        uses = self._cod_uses.get(key, 0) if self.training else 0
        seed = hashlib.blake2b(key + f"{uses}:{torch.initial_seed()}".encode(), digest_size=8).digest()
        return torch.Generator().manual_seed(int.from_bytes(seed, "little") & (2 ** 63 - 1)), key

    def cod_plan(self, batch) -> CodPlan:
        """The COD sample of ``batch`` (masks only, no forward; the same sample for :meth:`loss_counts`
        and the next :meth:`loss` of the same batch).

        Anchors (depth 0): indices ``a`` with ``x_{a+2}`` a real assistant token, ``n_b`` per row. Depth
        ``d >= 1`` keeps ``round(n_b * max(r^d, r_min))`` of the anchors kept at depth ``d-1``: a uniform
        draw, elements whose depth-d label is loss-valid (and whose chain is labelled up to d) first.
        One vectorised draw per depth over the whole batch (random keys, per-row rank).

        Returns:
            :class:`CodPlan` with ``num_depths`` ``[B, T]`` bool masks per field.
        """
        cfg: PEagleConfig = self.cfg
        B, T = batch.input_ids.shape
        dev = batch.input_ids.device
        lm = batch.loss_mask & batch.attention_mask
        in_vocab = self.t2d[batch.argmax.to(self.t2d.device)].to(dev)  # [B, T]
        labelled = [shift_left(lm, 2 + d) for d in range(cfg.num_depths)]
        valid = [lab & shift_left(in_vocab, 1 + d) for d, lab in enumerate(labelled)]
        kept = [labelled[0]]
        n = labelled[0].sum(1).to(torch.float64)  # [B]
        gen, _ = self._cod_generator(batch)
        live = labelled[0]
        ranks = torch.arange(T, device=dev).expand(B, T)
        for d in range(1, cfg.num_depths):
            live = live & labelled[d]
            m = torch.round(n * max(cfg.r ** d, cfg.r_min)).to(torch.int64)  # [B]
            pool = kept[-1]
            keys = torch.rand(B, T, generator=gen, dtype=torch.float64).to(dev)
            keys = keys + 2.0 * (~(valid[d] & live)) + 4.0 * (~pool)
            order = keys.argsort(dim=1)
            rank = torch.empty_like(order).scatter_(1, order, ranks)
            kept.append(pool & (rank < m[:, None]))
        return CodPlan(kept, labelled, valid)

    def loss_counts(self, batch) -> torch.Tensor:
        """``[num_depths]`` int64: loss-valid kept elements of each depth (see :meth:`Drafter.loss_counts`)."""
        plan = self.cod_plan(batch)
        return torch.stack([(k & v).sum() for k, v in zip(plan.kept, plan.valid)])

    def cod_forward(self, batch, plan: CodPlan, mask_hook=None) -> dict[str, Any]:
        """ONE drafter forward over every kept element of ``batch`` (no loop over anchors or depths).

        Element layout per row: the ``T`` depth-0 elements (every real position, index order), then for
        each depth ``d >= 1`` its kept anchors in index order, right-padded to the batch's maximum
        ``M_d`` (padding: anchor ``T``, ``exists`` False). Attention (one boolean ``[B, 1, L, L]``
        mask, :func:`torch.nn.functional.scaled_dot_product_attention`): query ``(a, d)`` sees key
        ``(a', d')`` iff the key exists and (``d' == 0`` and ``a' <= a``) or (``a' == a`` and
        ``d' <= d``); a padding query sees only itself.

        Args:
            batch: a :class:`speculators.data.dataset.Batch`.
            plan: its :meth:`cod_plan`.
            mask_hook: optional ``f(mask [B, 1, L, L] bool, elements) -> mask``, applied before the
                forward (tests use it to show that one extra visible key changes the logits).
        Returns:
            ``{"logits": [B, L, N] float32, "anchor", "depth": [B, L] int64, "exists": [B, L] bool,
            "offsets": list of (start, end) of each depth's slice of L, "index": per depth d >= 1 the
            ``[B, M_d]`` anchors (T = padding)}``.
        """
        B, T = batch.input_ids.shape
        dev = batch.input_ids.device
        key_valid = shift_left(batch.attention_mask, 1)  # index t is an input iff x_{t+1} exists
        anchors = [torch.arange(T, device=dev).expand(B, T)]
        exists = [key_valid]
        depths = [torch.zeros(B, T, dtype=torch.int64, device=dev)]
        index = []
        for d in range(1, len(plan.kept)):
            kept = plan.kept[d]
            cnt = kept.sum(1)
            M = int(cnt.max()) if B else 0
            order = torch.argsort((~kept).to(torch.int8), dim=1, stable=True)[:, :M]  # kept anchors first
            ex = torch.arange(M, device=dev)[None] < cnt[:, None]
            idx = torch.where(ex, order, torch.full_like(order, T))
            index.append(idx)
            anchors.append(idx)
            exists.append(ex)
            depths.append(torch.full_like(idx, d))
        anchor, depth, exist = torch.cat(anchors, 1), torch.cat(depths, 1), torch.cat(exists, 1)
        L = anchor.shape[1]
        aq, ak = anchor[:, :, None], anchor[:, None, :]
        dq, dk = depth[:, :, None], depth[:, None, :]
        mask = exist[:, None, :] & (((dk == 0) & (ak <= aq)) | ((ak == aq) & (dk <= dq)))
        mask = (mask | torch.eye(L, dtype=torch.bool, device=dev)[None]).unsqueeze(1)  # [B, 1, L, L]
        elements = {"anchor": anchor, "depth": depth, "exists": exist}
        if mask_hook is not None:
            mask = mask_hook(mask, elements)

        g = self.fuse(batch.aux)  # [B, T, H]
        emb0 = self.embed(shift_left(batch.input_ids, 1))
        emb_m, hid_m = self._mask_inputs(B, L - T, g.dtype)
        emb = torch.cat([emb0.to(g.dtype), emb_m], 1)
        hidden = torch.cat([g, hid_m], 1)
        cos, sin = self.rotary(hidden, anchor + 1 + depth)

        def attend(i, q, k, v):
            return F.scaled_dot_product_attention(q, k, v, attn_mask=mask, enable_gqa=k.shape[1] != q.shape[1])

        h = self._run_layers(emb, hidden, cos, sin, attend)
        logits = self.lm_head(self.norm(h)).float()  # [B, L, N]
        sizes = [T] + [t.shape[1] for t in index]
        starts = [sum(sizes[:i]) for i in range(len(sizes))]
        return {**elements, "logits": logits, "offsets": [(s, s + n) for s, n in zip(starts, sizes)],
                "index": index}

    def loss(self, batch, norm: torch.Tensor | None = None) -> tuple[torch.Tensor, dict[str, float]]:
        """P-EAGLE loss: ``sum_d Loss_d`` (no per-depth decay), Loss_d = soft CE of the kept depth-d
        elements' logits vs the target distribution at ``a + 1 + d`` restricted to the draft vocab, summed
        over the loss-valid kept elements and divided by ``norm[d]`` (default: their count; see
        :meth:`Drafter.loss`). Valid: token ``a + 2 + d`` is a real assistant token and the target's argmax
        at ``a + 1 + d`` lies in the draft vocabulary.

        Returns:
            loss (scalar) and metrics ``loss_d`` (this batch's mean), ``kept_d`` (elements of depth d in
            the forward) and ``full_acc_d, cond_acc_d, sim_tau`` from
            :func:`speculators.losses.chained_acceptance` over the kept chains: element ``(a, d)`` is
            correct when its top-1 draft equals the target's greedy token at ``a + 1 + d`` (target ids),
            labelled when it is kept and ``x_{a+2+d}`` is a real assistant token; ``full_acc_d`` thus
            also needs the chain's earlier depths correct.
        Raises:
            RuntimeError: ``attach_target`` was not called (no teacher head).
        """
        cfg: PEagleConfig = self.cfg
        B, T = batch.input_ids.shape
        dev = batch.input_ids.device
        plan = self.cod_plan(batch)
        if self.training:  # the next loss on this same batch (next epoch) draws a new sample
            _, key = self._cod_generator(batch)
            self._cod_uses[key] = self._cod_uses.get(key, 0) + 1
        draft_ids = self.draft_ids
        with torch.no_grad():
            if self.frozen_target.head_weight is None:
                raise RuntimeError("attach_target(target) before training: the teacher head is missing")
            teacher_logits = self.frozen_target.teacher_logits(batch.top, draft_ids)  # [B, T, N]
            teacher_p = torch.softmax(teacher_logits.float(), dim=-1)
            teacher_p = torch.cat([teacher_p, teacher_p.new_zeros(B, 1, teacher_p.shape[-1])], 1)  # T: padding
            goal_all = torch.cat([batch.argmax, batch.argmax.new_full((B, 1), -1)], 1)  # [B, T+1]
        out = self.cod_forward(batch, plan)
        logits = out["logits"]
        counts = torch.stack([(k & v).sum() for k, v in zip(plan.kept, plan.valid)])
        sums, corrects, labels, metrics = [], [], [], {}
        pad = torch.zeros(B, 1, dtype=torch.bool, device=dev)
        for d, (s, e) in enumerate(out["offsets"]):  # index bookkeeping per depth; the forward is done
            anchor = out["anchor"][:, s:e]
            tgt = (anchor + 1 + d).clamp(max=T)  # target position; T = padding row
            valid_d = torch.cat([plan.valid[d], pad], 1).gather(1, anchor.clamp(max=T)) & out["exists"][:, s:e]
            if d > 0:
                valid_d = valid_d & torch.cat([plan.kept[d], pad], 1).gather(1, anchor.clamp(max=T))
            teach = teacher_p.gather(1, tgt[..., None].expand(-1, -1, teacher_p.shape[-1]))
            sums.append(self.distill_loss.sum(logits[:, s:e], teach, valid_d))
            with torch.no_grad():
                pred = draft_ids[logits[:, s:e].argmax(-1)]
                ok = (pred == goal_all.gather(1, tgt)) & out["exists"][:, s:e]
                if d == 0:
                    corrects.append(ok)
                else:  # scatter the kept elements back to their anchors ([B, T] maps)
                    full = torch.zeros(B, T + 1, dtype=torch.bool, device=dev)
                    corrects.append(full.scatter(1, anchor, ok)[:, :T])
                labels.append(plan.labelled[d] & plan.kept[d])
                metrics[f"loss_{d}"] = float(sums[-1].detach() / counts[d].clamp(min=1))
                metrics[f"kept_{d}"] = float(plan.kept[d].sum())
        metrics.update(chained_acceptance(corrects, labels))
        total, self.last_own_loss = combine_terms(sums, [1.0] * cfg.num_depths, counts, norm, where=self.algorithm)
        return total, metrics

    # ------------------------------------------------------------------ inference
    @staticmethod
    def _check_advance_inputs(new_ids: torch.Tensor, features) -> tuple[torch.Tensor, torch.Tensor]:
        """``(ids [m], aux [m, n_aux*H])`` of one request.

        Raises:
            SpeculatorsError: ``new_ids`` empty or not 1-D, or ``features.aux`` without ``m`` rows.
        """
        ids = new_ids.reshape(-1) if new_ids.dim() == 2 and new_ids.shape[0] == 1 else new_ids
        if ids.dim() != 1 or ids.numel() == 0:
            raise SpeculatorsError(f"advance: new_ids: expected a non-empty 1-D tensor [m] of verified token "
                                   f"ids, got shape {tuple(new_ids.shape)}")
        aux = features.aux.reshape(-1, features.aux.shape[-1])
        if aux.shape[0] != ids.shape[0]:
            raise SpeculatorsError(f"advance: features.aux: expected the target features of the {ids.shape[0]} "
                                   f"positions the new tokens follow, got {aux.shape[0]} rows")
        return ids, aux

    @torch.no_grad()
    def start(self, input_ids: torch.Tensor, features) -> PEagleState:
        """``input_ids [n+1]`` (prompt + first target token), features of positions ``0..n-1``."""
        state = PEagleState(KVCache(), 0, torch.empty(0))
        self._advance_one(state, input_ids.reshape(-1)[1:], features)
        return state

    @torch.no_grad()
    def _advance_one(self, state: PEagleState, new_ids: torch.Tensor, features) -> None:
        """Append the real inputs ``(g[t], x_{t+1})`` of the ``m`` newly verified positions of one request
        (``new_ids [m]`` int64, ``features.aux [1, m, n_aux*H]``) to its KV cache, and draft the next
        proposal in the SAME forward (vLLM's parallel drafting: one drafter forward per step).

        The forward runs ``[m real inputs, num_depths-1 mask slots]`` at position ids
        ``n+1..n+m+num_depths-1``; the real inputs attend causally to the cache and to each other, the
        mask slots to everything before them and causally to each other (mask slots come last, so the
        real inputs never see them). The newest real input's logits are depth 0 (draft 1), the mask
        slots' are depths 1..num_depths-1; they are kept in ``state.draft_logits``. Only the ``m`` real
        inputs' keys/values stay in the cache (mask slots are never cached), so the result equals a
        separate advance followed by a forward over the mask slots alone.

        Raises:
            SpeculatorsError: ``new_ids`` empty / not 1-D, or ``features.aux`` without ``m`` rows.
        """
        ids, aux = self._check_advance_inputs(new_ids, features)
        dev, dt = self.fc.weight.device, self.fc.weight.dtype
        ids = ids.to(dev).unsqueeze(0)
        m, slots = ids.shape[1], self.max_speculative_tokens - 1
        aux = aux.to(device=dev, dtype=dt).unsqueeze(0)
        emb = self.embed(ids)
        if slots > 0:  # mask_hidden replaces the aux features before fc: ONE fc over real + mask rows
            aux = torch.cat([aux, self.mask_hidden.to(dt).expand(1, slots, -1)], 1)
            emb = torch.cat([emb, self.mask_embedding.to(emb.dtype).expand(1, slots, -1)], 1)
        hidden = self.fuse(aux)
        n, cached = state.num_positions, state.cache.length
        pos = torch.arange(n + 1, n + 1 + m + slots, device=dev).unsqueeze(0)
        cos, sin = self.rotary(hidden, pos)
        mask = causal_mask_with_cache(m + slots, cached, device=dev)
        h = self._run_layers(emb, hidden, cos, sin,
                             lambda i, q, k, v: cached_attend(state.cache, i, q, k, v, mask))
        state.cache.crop(cached + m)  # the mask slots' keys/values are not part of the context
        state.num_positions += m
        state.draft_logits = self.lm_head(self.norm(h[0, m - 1:])).float()  # [num_depths, N]

    @torch.no_grad()
    def draft_logits(self, state: PEagleState, k: int) -> torch.Tensor:
        """``[k, N]`` float32 draft-vocabulary logits of drafts 1..k, computed by the last ``advance``
        (one forward; see :meth:`_advance_one`). The state is not modified.

        Raises:
            SpeculatorsError: ``k`` outside ``0..num_depths`` (:func:`speculators.decode.proposal.check_speculative_tokens`).
        """
        k = check_int("k", k, 0)
        check_speculative_tokens(self, k)
        return state.draft_logits[:k]

    @torch.no_grad()
    def _propose_one(self, state: PEagleState, k: int, sampling: SamplingParams | None = None,
                     generator: torch.Generator | None = None) -> Proposal:
        """``k`` drafts for ONE request in parallel: ``k`` draft distributions
        from :meth:`draft_logits` (one forward), each drawn with :func:`speculators.losses.sample_draft`
        under ``sampling`` (the request's :class:`speculators.verify.SamplingParams`, batch of one;
        ``None`` = greedy): greedy gives each row's argmax and ``probs=None``; otherwise one multinomial
        call over the ``k`` rows with ``generator`` (default: the request's own) and ``[k, V]`` float32
        full-vocabulary distributions (zero outside the draft vocabulary). Mask slots carry no token, so
        the drafts are independent given the context. The state is not modified.

        A ``k`` deeper than ``num_depths`` is refused (:func:`speculators.decode.proposal.check_speculative_tokens`), not capped: mask slots deeper
        than the trained depth were never trained, and a silent cap would make an eval's "K" a lie.

        Raises:
            SpeculatorsError: ``k`` outside ``0..num_depths``, or ``sampling`` is not one request's valid
                ``SamplingParams``.
        """
        kk = check_int("k", k, 0)
        check_speculative_tokens(self, kk)
        if kk == 0:
            return Proposal(torch.empty(0, dtype=torch.int64))
        ids, probs = sample_draft(self.draft_logits(state, kk), sampling, generator, d2t=self.d2t,
                                  vocab_size=self.t2d.numel())
        return Proposal(ids, probs)

    drafts_trees = True  # declared capability: propose_tree (parallel-slot trees, EAGLE-2 dynamic or static)

    @torch.no_grad()
    def propose_tree(self, states: list[PEagleState], spec, depth_caps: list[int], sampling=None,
                     generators=None) -> list:
        """Draft trees for B requests from the parallel depths (Medusa-style trees, Cai et al. arXiv
        2401.10774, over P-EAGLE's slots), by :func:`speculators.drafters.tree_drafting.slot_tree`.

        The mask slots carry no token, so depth d's distribution (``state.draft_logits[d-1]``, computed by
        the last ``advance`` in the chain's one forward) is the same under every parent: a node at depth d
        takes one of its top-k tokens, scored by the summed log-softmax along its path. No forward runs;
        depth is at most ``num_depths``. Children are top-k tokens (point masses for the verifier), so
        ``sampling`` / ``generators`` are not drawn from; the states are not modified.

        Args:
            states: B states from :meth:`start` / :meth:`advance`.
            spec: a :class:`speculators.decode.tree_spec.TreeSpec`.
            depth_caps: per request the deepest level kept (>= 0).
        Returns:
            B :class:`speculators.verify.tree.DraftTree` (int64 target ids, CPU, ``probs`` None).
        Raises:
            SpeculatorsError: ``depth_caps`` not one non-negative integer per state.
        """
        from .tree_drafting import slot_tree

        caps = check_batch(states, depth_caps, sampling, generators, who="propose_tree", ks_name="depth_caps")
        if not states:
            return []
        logits = torch.stack([s.draft_logits for s in states]).float().cpu()  # [B, num_depths, N]
        return slot_tree(logits, spec, self.d2t, caps)
