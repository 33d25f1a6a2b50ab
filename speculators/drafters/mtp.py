"""MTP: DeepSeek-V3's multi-token prediction modules (arXiv 2412.19437, section 2.2).

Two modes: frozen target (``joint: false``, the modules alone are trained on cached features) and
joint (``joint: true``: the target is fine-tuned through LoRA adapters in the same loss,
``L_LM + lambda * L_MTP`` with lambda 0.3, see :mod:`speculators.drafters.joint`).

Architecture (ALGORITHMS.md "MTP"; module layout as vLLM's ``deepseek_mtp.py`` loads DeepSeek-V3):

* D sequential modules. Module k (1..D) at index t::

      h'_k[t] = eh_proj(concat(enorm(embed(x_{t+k})), hnorm(h_{k-1}[t])))     # embedding FIRST
      h_k[t]  = Block_k(h'_k[0..t])                                            # one Llama decoder layer
      logits_k[t] = target_lm_head(target_final_norm(h_k[t]))                  # shared output head

  The concat order (embedding first, then the previous hidden state) follows vLLM's
  ``DeepSeekMultiTokenPredictorLayer.forward`` (``torch.cat([inputs_embeds, previous_hidden_states])``);
  ALGORITHMS.md writes the pair the other way round, the public code is what we follow.
  ``eh_proj: Linear(2H -> H, bias=False)``; the block is a plain Llama decoder layer (RMSNorm, GQA
  attention with RoPE, SwiGLU MLP; sizes and RoPE from the target's config) with causal attention;
  ``h_k`` is the block's pre-norm output (what the next module's ``hnorm`` receives, as in vLLM).
* ``h_0`` is the target's top hidden state :attr:`Batch.top` / ``TargetFeatures.top``, i.e. AFTER the
  target's final norm. DeepSeek feeds the main model's pre-norm last hidden state; our feature pipeline
  stores the post-norm one (``hnorm`` re-normalises it either way).
* Output head. DeepSeek's per-module ``shared_head`` has its OWN RMSNorm (``shared_head.norm``) in
  front of the shared ``shared_head.head`` (= the main model's lm_head). In both modes we share the
  target's final norm AND lm_head (:meth:`.layers.FrozenTarget.final_norm`, :meth:`.layers.FrozenTarget.lm_head`):
  both frozen, never saved. Drafts are always over the full target vocabulary (no d2t/t2d).
* Token embedding: copied from the target, frozen (``embed_tokens``).

Indexing and labels. Module k at index t takes token ``x_{t+k}`` and position id ``t + k`` and predicts
``x_{t+k+1}``. Hard CE (default) is taken against the data token ``x_{t+k+1}``; ``distill: true`` uses
soft CE to the target's distribution at position ``t + k`` (``softmax(lm_head(top[t+k]))``, the
target's prediction of ``x_{t+k+1}``). A (t, k) pair is supervised iff ``t + k + 1 < T`` and token
``t + k + 1`` is a real assistant token (``loss_mask & attention_mask``).
vLLM starts the first MTP step at the position of the hidden state (t) rather than t + 1: a constant
offset of every query and key of one module's attention, which RoPE does not see.

Inference (see :meth:`MTPDrafter.propose`). After ``start``/``advance`` the drafter has seen tokens
``x_0..x_n`` and target features of positions ``0..n-1``. Module k's KV cache holds its committed
entries: indices ``0..n-k`` (those whose token ``x_{t+k}`` is verified), computed from real target
features (module 1) or the committed outputs of module k-1, and real tokens. Drafting chains through
the modules at index ``n-1``: module 1 uses ``h_top[n-1]`` and ``x_n`` (committed) to draft
``x_{n+1}``; module j>1 first fills its missing indices ``n-j+1..n-1`` with the drafted tokens and
module j-1's outputs, then drafts ``x_{n+j}`` from index ``n-1``. Beyond D drafts the last module is
reused autoregressively (its own output hidden state and its last draft, next index and position);
vLLM's DeepSeekMTP instead cycles ``spec_step_idx % num_nextn_predict_layers`` (the same when D = 1).
Speculative cache entries are rolled back after every proposal.
Draft trees (:meth:`MTPDrafter.propose_tree`, EAGLE-2 dynamic or vLLM static through
:func:`.tree_drafting.expand_tree`): a node at depth d gets what the chain computes for draft d + 1 after its
path: module d + 1's block over its missing indices (below D, on the path's tokens and the parent's block
of module d), or the last module one index further on the parent's output under a tree mask (beyond D);
batched over a request's frontier, request by request.

Export (``speculators_model_type: mtp``): ``transformer_layer_config`` = the target's config,
``num_nextn_predict_layers`` = D; weights ``embed_tokens.weight`` and, per module i = 0..D-1 (module
k = i + 1), ``layers.{i}.{enorm,hnorm}.weight``, ``layers.{i}.eh_proj.weight`` [H, 2H] and the block's
weights flat under ``layers.{i}.`` (``self_attn.{q,k,v,o}_proj``, ``input_layernorm``,
``post_attention_layernorm``, ``mlp.{gate,up,down}_proj``), which is the DeepSeek-V3 checkpoint layout
(vLLM inserts ``.mtp_block`` itself). Differences from a DeepSeek checkpoint, by choice: module i is
``layers.{i}`` rather than ``model.layers.{num_hidden_layers + i}``, and ``shared_head.norm`` /
``shared_head.head`` are not written (they are the verifier's ``model.norm`` and ``lm_head``; a
converter copies them). vLLM's speculators-format loader does not register ``mtp`` yet, and its
DeepSeekMTP expects a DeepSeek (MLA/MoE) block: serving this Llama-block drafter needs a converter.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, ClassVar, Literal

import torch
import torch.nn.functional as F
from pydantic import Field, ValidationInfo, field_validator, model_validator
from torch import nn

from .. import export
from ..data.vocab import DraftVocab
from ..losses import chained_acceptance, combine_terms, hard_cross_entropy, sample_draft
from ..decode.proposal import check_batch
from ..verify import SamplingParams
from .base import Drafter, DrafterConfig, full_vocab_drafter
from ..decode.proposal import Proposal
from .checkpoint import TargetMeta
from .registry import register
from .serving_format import ServingFormat
from .joint import JointConfig
from .layers import (
    DecoderLayer,
    KVCache,
    RMSNorm,
    Rotary,
    cached_attend,
    causal_mask_with_cache,
    layer_config,
    shift_left,
)


class MTPConfig(JointConfig, DrafterConfig):
    """``drafter:`` section of an MTP recipe.

    Keys:
        num_modules: D, the number of sequential MTP modules (DeepSeek-V3 uses 1).
        loss_lambda: lambda in ``loss = lambda * (1/D) * sum_k w_k * CE_k``. Default 1.0 in frozen mode
            (the MTP loss is the only loss) and DeepSeek-V3's 0.3 with ``joint: true``, where the
            total is ``joint_target.lm_weight * L_LM + loss``.
        module_weights: w_k per module (length D); default all 1.
        distill: soft CE to the target's distribution at ``t + k`` instead of hard CE to ``x_{t+k+1}``.
        joint: train the target together with the modules (DeepSeek's setting), through LoRA adapters
            (``joint_target``, see :mod:`speculators.drafters.joint`); the modules then read the
            adapted target's hidden states and eval verifies against the adapted target.
        num_speculative_tokens: K written to the vLLM config (default D). At inference any K works:
            drafts beyond D reuse the last module autoregressively (see the module docstring).
        draft_vocab_size: must stay unset: MTP drafts through the target's full-vocabulary head.
    """

    algorithm: Literal["mtp"] = "mtp"
    num_modules: int = Field(default=3, ge=1, le=8, description="D: sequential MTP modules (DeepSeek-V3 uses 1)")
    loss_lambda: float | None = Field(default=None, gt=0.0,
                                      description="weight of the MTP loss, `lambda * (1/D) * sum_k w_k * CE_k`; null "
                                                  "= 1.0 frozen, 0.3 (DeepSeek-V3's) with `joint: true`")
    module_weights: list[float] | None = Field(
        default=None, description="per-module loss weights w_k (length `num_modules`, >= 0, one > 0); null = all 1")
    distill: bool = Field(default=False, description="soft CE to the target distribution instead of hard CE")
    num_speculative_tokens: int | None = Field(
        default=None, ge=1, le=64, description="K written to the vLLM config; null = `num_modules` (any K works "
                                               "at inference: drafts beyond D reuse the last module)")

    full_vocab_only: ClassVar[str] = "MTP drafts through the target's shared lm_head over the full vocabulary"

    @model_validator(mode="after")
    def _default_lambda(self) -> "MTPConfig":
        if self.loss_lambda is None:
            self.loss_lambda = 0.3 if self.joint else 1.0
        return self

    @field_validator("module_weights")
    @classmethod
    def _weights(cls, v, info: ValidationInfo):
        if v is None:
            return v
        d = info.data.get("num_modules")
        if d is not None and len(v) != d:
            raise ValueError(f"drafter.module_weights has {len(v)} entries; drafter.num_modules is {d}")
        if any(w < 0 for w in v) or not any(w > 0 for w in v):
            raise ValueError("drafter.module_weights must be >= 0 with at least one > 0")
        return v


class _MTPModule(DecoderLayer):
    """One MTP module: ``enorm``, ``hnorm``, ``eh_proj`` and a Llama decoder block (flat names)."""

    def __init__(self, cfg):
        super().__init__(cfg)
        H, eps = cfg.hidden_size, cfg.rms_norm_eps
        self.enorm = RMSNorm(H, eps=eps)
        self.hnorm = RMSNorm(H, eps=eps)
        self.eh_proj = nn.Linear(2 * H, H, bias=False)

    def forward(self, emb: torch.Tensor, hidden: torch.Tensor, cos, sin, attend) -> torch.Tensor:
        """``emb, hidden [B, m, H]`` -> ``[B, m, H]`` pre-norm output; ``attend(q, k, v) -> o``."""
        x = self.eh_proj(torch.cat([self.enorm(emb), self.hnorm(hidden)], dim=-1))
        q, k, v = self.self_attn.qkv(self.input_layernorm(x), cos, sin)
        x = x + self.self_attn.out(attend(q, k, v))
        return x + self.mlp(self.post_attention_layernorm(x))


def _causal(q, k, v):
    return F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=k.shape[1] != q.shape[1])


@dataclass
class MTPState:
    """Per-request inference state.

    Attributes:
        ids: ``[n+1]`` int64 tokens ``x_0..x_n`` seen so far.
        caches: per module, its KV cache; module k (1-based) holds ``committed(n, k)`` entries.
        outs: per module, ``[1, committed(n, k), H]`` its output hidden states at the committed indices.
    """

    ids: torch.Tensor
    caches: list[KVCache] = field(default_factory=list)
    outs: list[torch.Tensor | None] = field(default_factory=list)

    @property
    def n(self) -> int:
        return self.ids.numel() - 1


def committed(n: int, k: int) -> int:
    """Number of committed entries of module k (1-based) once ``x_0..x_n`` are known: indices
    ``0..n-k`` (module k at index t needs the verified token ``x_{t+k}``)."""
    return max(0, n - k + 1)


class MTPFormat(ServingFormat):
    """MTP's serving format: a vllm-project/speculators-style ``mtp`` config over our Llama-block MTP modules;
    vLLM has no loader for it as written (:attr:`vllm_note`)."""

    algorithm = "mtp"
    vllm_note = ("vLLM's speculators loader does not register `mtp`, and its DeepSeekMTP expects a "
                 "DeepSeek (MLA/MoE) block: serving this Llama-block drafter needs a converter")
    llamacpp_note = ("llama.cpp's draft-mtp runs the NextN layers shipped inside the target's own GGUF "
                     "(DeepSeek, GLM, Qwen 3.5 conversions); its converter registers no separate MTP module")
    # the target's embedding, like shared_head (= its norm and lm_head): a converter copies it (not in final/)
    frozen_target_weights = {"embed_tokens.weight": "embed_tokens"}

    def config(self, drafter: MTPDrafter) -> dict[str, Any]:
        """vllm-project/speculators-style ``mtp`` config (FORMATS.md)."""
        m, cfg = drafter.meta, drafter.cfg
        # the target's config with the RoPE the block was trained with (layer_config drops partial rotary)
        tcfg = m.target_config
        layer = layer_config(tcfg, num_hidden_layers=int(tcfg.get("num_hidden_layers", 1)))
        return {
            "architectures": ["MTPDraftModel"],
            "speculators_model_type": "mtp",
            "speculators_config": export.speculators_config(drafter.algorithm,
                                                            cfg.num_speculative_tokens or cfg.num_modules,
                                                            m.name_or_path, m.architectures),
            "transformer_layer_config": export.transformer_layer_config(layer),
            "num_nextn_predict_layers": cfg.num_modules,
            "draft_vocab_size": m.vocab_size,
            "tie_word_embeddings": False,
            "torch_dtype": "float32",
        }


@register
class MTPDrafter(Drafter):
    """MTP drafter (see module docstring). Shapes: ``B`` batch, ``T`` sequence, ``H`` hidden, ``V`` vocab."""

    algorithm = "mtp"
    config_class = MTPConfig

    @property
    def distills(self) -> bool:
        """``distill: true``: the stages' loss is a divergence to the target's distribution (``train.loss``)."""
        return bool(self.cfg.distill)

    serving = MTPFormat()

    def __init__(self, cfg: MTPConfig, meta: TargetMeta):
        super().__init__(cfg, meta)
        self.layer_cfg = layer_config(self.meta.target_config, num_hidden_layers=1)
        H, V = self.layer_cfg.hidden_size, self.meta.vocab_size
        self.embed_tokens = nn.Embedding(V, H)
        self.embed_tokens.weight.requires_grad_(False)
        self.layers = nn.ModuleList([_MTPModule(self.layer_cfg) for _ in range(cfg.num_modules)])
        self.rotary = Rotary(self.layer_cfg)

    # ------------------------------------------------------------------ construction
    def output_heads(self) -> list[nn.Module]:
        """None: the modules share the target's ``lm_head`` (:meth:`Drafter.output_heads`)."""
        return []

    @classmethod
    def from_target(cls, cfg: MTPConfig, target, vocab: DraftVocab) -> MTPDrafter:
        """Fresh modules; embedding copied from the target (frozen); target head and norm attached.

        Raises:
            SpeculatorsError: ``vocab`` is not the full target vocabulary.
        """
        return full_vocab_drafter(cls, cfg, target, vocab)

    @classmethod
    def _build(cls, cfg: MTPConfig, meta: TargetMeta, weights: dict[str, torch.Tensor]) -> MTPDrafter:
        """Empty module: every size comes from ``cfg`` and ``meta`` (full target vocabulary)."""
        return cls(cfg, meta)

    @property
    def num_modules(self) -> int:
        return len(self.layers)

    @property
    def module_weights(self) -> list[float]:
        return list(self.cfg.module_weights or [1.0] * self.num_modules)

    def head(self, h: torch.Tensor) -> torch.Tensor:
        """Shared output head: ``[..., H]`` module output -> ``[..., V]`` logits (target final norm + lm_head)."""
        return self.frozen_target.lm_head(self.frozen_target.final_norm(h))

    # ------------------------------------------------------------------ training
    def module_hiddens(self, input_ids: torch.Tensor, top: torch.Tensor) -> list[torch.Tensor]:
        """Teacher-forced forward of every module over whole sequences.

        Args:
            input_ids: ``[B, T]`` int64 tokens (right-padded).
            top: ``[B, T, H]`` target top (post-norm) hidden states, ``h_0``.
        Returns:
            D tensors ``[B, T, H]``: ``h_k[t]`` for k = 1..D, computed from ``x_{t+k}`` (zero id past
            the end), ``h_{k-1}[t]`` and position id ``t + k``; causal attention. Padding needs no
            key mask: right padding is never attended by a real query under the causal mask.
        """
        B, T = input_ids.shape
        hidden = top
        outs = []
        for i, module in enumerate(self.layers):
            k = i + 1
            emb = self.embed_tokens(shift_left(input_ids, k))
            pos = (torch.arange(T, device=input_ids.device) + k).unsqueeze(0).expand(B, T)
            cos, sin = self.rotary(hidden, pos)
            hidden = module(emb, hidden, cos, sin, _causal)
            outs.append(hidden)
        return outs

    def _valid_masks(self, batch) -> list[torch.Tensor]:
        """``[B, T]`` bool per module k = 1..D: ``x_{t+k+1}`` is in the sequence and an assistant token
        (used by :meth:`loss` and :meth:`loss_counts`)."""
        real = batch.loss_mask & batch.attention_mask
        return [shift_left(real, k + 1) for k in range(1, self.num_modules + 1)]

    def loss_counts(self, batch) -> torch.Tensor:
        """``[num_modules]`` int64: valid indices of each module's term (see :meth:`Drafter.loss_counts`)."""
        return torch.stack([v.sum() for v in self._valid_masks(batch)])

    def loss(self, batch, norm: torch.Tensor | None = None) -> tuple[torch.Tensor, dict[str, float]]:
        """``lambda * (1/D) * sum_k w_k * CE_k`` (DeepSeek-V3 eq. 24-25 with per-module weights).

        CE_k sums over the valid indices t of module k (token ``t + k + 1`` in the sequence and an
        assistant token) and divides by ``norm[k-1]`` (default: their count, i.e. the mean; see
        :meth:`Drafter.loss`) the cross entropy of ``logits_k[t]`` against ``x_{t+k+1}`` (or, with
        ``distill``, against ``softmax(target_lm_head(top[t+k]))``). Logits are computed only at the
        valid indices (the full-vocabulary head is the dominant cost).

        Returns:
            loss (scalar) and metrics, for module k = j + 1: ``loss_j`` (this batch's mean);
            ``full_acc_j``, ``cond_acc_j``, ``sim_tau`` from :func:`speculators.losses.chained_acceptance`:
            module k's draft at t is correct when its top-1 ``== Batch.argmax[t + k]`` (the target's
            greedy token after ``x_{<=t+k}``; the chain is teacher-forced on the data tokens) and
            labelled when ``x_{t+k+1}`` is an assistant token inside the sequence.
        """
        cfg: MTPConfig = self.cfg
        D = self.num_modules
        ids = batch.input_ids
        hs = self.module_hiddens(ids, batch.top)
        valid = self._valid_masks(batch)  # valid[k-1][t] = real[t+k+1]: the loss's and the metrics' labels
        counts = torch.stack([v.sum() for v in valid])
        sums: list[torch.Tensor] = []
        metrics: dict[str, float] = {}
        corrects: list[torch.Tensor] = []
        for i in range(D):
            k = i + 1
            # the chained metric counts module k at t only where modules 1..k are all labelled, so the
            # logits at module k's own valid indices serve both the loss and every metric
            sel = valid[i]
            logits = self.head(hs[i][sel]).float()  # [n_sel, V]
            if cfg.distill:
                with torch.no_grad():
                    teacher = torch.softmax(self.frozen_target.teacher_logits(shift_left(batch.top, k)[sel]).float(), dim=-1)
                sums.append(self.distill_loss.sum(logits, teacher))
            else:
                sums.append(hard_cross_entropy(logits, shift_left(ids, k + 1)[sel]))
            with torch.no_grad():
                correct = torch.zeros_like(sel)
                correct[sel] = logits.argmax(-1) == shift_left(batch.argmax, k)[sel]
                corrects.append(correct)
                metrics[f"loss_{i}"] = float(sums[-1].detach() / counts[i].clamp(min=1))
        metrics.update(chained_acceptance(corrects, valid))
        total, self.last_own_loss = combine_terms(sums, list(self.module_weights),
                                                  counts, norm, scale=cfg.loss_lambda / D, where=self.algorithm)
        return total, metrics

    # ------------------------------------------------------------------ inference
    def _run(self, i: int, cache: KVCache, tokens: torch.Tensor, hidden: torch.Tensor, start: int) -> torch.Tensor:
        """Module ``i`` (0-based) on indices ``start..start+m-1`` appended to its cache.

        ``tokens [m]`` are ``x_{t+k}``, ``hidden [1, m, H]`` are ``h_{k-1}[t]``; returns ``[1, m, H]``.
        """
        if cache.length != start:
            raise RuntimeError(f"MTP module {i + 1}: cache holds {cache.length} entries, expected {start}")
        m = tokens.numel()
        emb = self.embed_tokens(tokens.reshape(1, m).to(self.embed_tokens.weight.device))
        pos = torch.arange(start + i + 1, start + i + 1 + m, device=emb.device).unsqueeze(0)
        cos, sin = self.rotary(hidden, pos)
        mask = causal_mask_with_cache(m, cache.length, device=emb.device)
        return self.layers[i](emb, hidden, cos, sin, lambda q, k, v: cached_attend(cache, 0, q, k, v, mask))

    def _rollback(self, state: MTPState) -> None:
        for i, cache in enumerate(state.caches):
            cache.crop(committed(state.n, i + 1))

    @torch.no_grad()
    def start(self, input_ids: torch.Tensor, features) -> MTPState:
        """``input_ids [n+1]`` (prompt + first target token), features of positions ``0..n-1``."""
        ids = input_ids.reshape(-1).to(torch.int64).cpu()
        state = MTPState(ids[:1], [KVCache() for _ in self.layers], [None] * self.num_modules)
        self._advance_one(state, ids[1:], features)
        return state

    @torch.no_grad()
    def _advance_one(self, state: MTPState, new_ids: torch.Tensor, features) -> None:
        """Append verified tokens ``x_{n+1}..x_{n+m}`` and target features of positions ``n..n+m-1``;
        every module computes its newly committed indices (module k: ``n-k+1 .. n+m-k``)."""
        self._rollback(state)
        dt = self.embed_tokens.weight.dtype
        top = features.top.reshape(1, -1, features.top.shape[-1]).to(device=self.embed_tokens.weight.device,
                                                                      dtype=dt)
        n_old = state.n
        state.ids = torch.cat([state.ids, new_ids.reshape(-1).to(torch.int64).cpu()])
        n_new = state.n
        if top.shape[1] != n_new - n_old:
            raise ValueError(f"advance: {n_new - n_old} new tokens but features of {top.shape[1]} positions")
        for i in range(self.num_modules):
            k = i + 1
            lo, hi = committed(n_old, k), committed(n_new, k)
            if hi <= lo:
                continue
            hidden = top if i == 0 else state.outs[i - 1][:, lo:hi]
            out = self._run(i, state.caches[i], state.ids[lo + k:hi + k], hidden, lo)
            state.outs[i] = out if state.outs[i] is None else torch.cat([state.outs[i], out], dim=1)

    @torch.no_grad()
    def _propose_one(self, state: MTPState, k: int, sampling: SamplingParams | None = None,
                     generator: torch.Generator | None = None) -> Proposal:
        """Chain of ``k`` drafts through the modules at index ``n - 1`` (see module docstring).

        Draft j comes from :func:`speculators.losses.sample_draft` on module j's logits under
        ``sampling`` (the request's :class:`speculators.verify.SamplingParams`, batch of one; ``None``
        = greedy): greedy gives the argmax and ``probs=None``; otherwise it is drawn under the same
        temperature/top-k/top-p as the target, with ``generator`` (default: the request's own), and
        the ``[k, V]`` float32 distributions are returned for the verifier. The committed cache
        content is unchanged on return (speculative entries are cropped).

        Raises:
            SpeculatorsError: ``sampling`` is not one request's valid ``SamplingParams``.
        """
        n, D = state.n, self.num_modules
        drafts: list[int] = []
        probs = []
        last = state.outs[0][:, n - 1:n]  # h_1[n-1]: module 1 on (h_top[n-1], x_n), committed
        prev_full = state.outs[0]  # module j-1's outputs at indices 0..n-1 (committed + speculative)
        try:
            for j in range(1, k + 1):
                if 2 <= j <= D:
                    i = j - 1
                    lo = committed(n, j)
                    seq = torch.cat([state.ids, torch.tensor(drafts, dtype=torch.int64)])
                    out = self._run(i, state.caches[i], seq[lo + j:n + j], prev_full[:, lo:n], lo)
                    prev_full = out if state.outs[i] is None else torch.cat([state.outs[i], out], dim=1)
                    last = out[:, -1:]
                elif j > D:  # reuse the last module autoregressively: next index, its own output hidden
                    last = self._run(D - 1, state.caches[D - 1], torch.tensor([drafts[-1]]), last,
                                     n - 1 + j - D)
                ids, q = sample_draft(self.head(last).float()[0], sampling, generator)  # [1, V] logits
                if q is not None:
                    probs.append(q[0])
                drafts.append(int(ids[0]))
        finally:
            self._rollback(state)
        return Proposal(torch.tensor(drafts, dtype=torch.int64), torch.stack(probs) if probs else None)

    # ------------------------------------------------------------------ draft trees
    drafts_trees = True  # declared capability: propose_tree (EAGLE-2 dynamic trees, vLLM static trees)

    @torch.no_grad()
    def propose_tree(self, states: list[MTPState], spec, depth_caps: list[int], sampling=None,
                     generators=None) -> list:
        """Draft trees for B requests (:func:`speculators.drafters.tree_drafting.expand_tree`: EAGLE-2's
        dynamic expansion, Li et al. arXiv 2406.16858, or a static vLLM ``speculative_token_tree``); the
        requests' states are left unchanged.

        A node at depth d with path ``a_1..a_d`` gets exactly the logits :meth:`_propose_one` computes for
        draft ``d + 1`` after drafting that path (DeepSeek-V3's chained modules, arXiv 2412.19437): for
        ``d + 1 <= D`` module ``d + 1`` runs its missing indices ``committed(n, d+1)..n-1`` on the path's
        tokens and module d's outputs there (the committed ones, then the parent's block), causal over
        its own committed cache; beyond D the last module runs one index per level on the node's token
        and its parent's output hidden state, attending to its committed cache and the keys of the node's
        ancestors only (the tree mask, from ``expand_tree``'s visibility matrix). Children are the top-k
        of the shared head's logits (full vocabulary, point masses for the verifier), so ``sampling`` /
        ``generators`` are not drawn from. The levels are batched over a request's frontier nodes and run
        request by request (MTP's chain, :meth:`propose`, is per request too; each request's modules hold
        caches of different committed lengths).

        Args:
            states: B states from :meth:`start` / :meth:`advance`.
            spec: a :class:`speculators.decode.tree_spec.TreeSpec`.
            depth_caps: B ints >= 0, per request the deepest level kept (0 = an empty tree).
            sampling, generators: checked for B requests, otherwise unused (top-k children).
        Returns:
            B :class:`speculators.verify.tree.DraftTree` (int64 target ids and parents, CPU, ``probs`` None).
        Raises:
            SpeculatorsError: ``depth_caps`` / ``generators`` not one entry per state, a negative cap, or
                ``sampling`` not valid for B requests.
        """
        from .tree_drafting import expand_tree

        check_batch(states, depth_caps, sampling, generators, who="propose_tree", ks_name="depth_caps")
        if not states:
            return []
        runs = [_TreeRun(self, s) for s in states]
        root_logits = torch.cat([self.head(s.outs[0][:, s.n - 1]).float() for s in states])  # [R, V]

        def forward(tokens, parents, visible, depth):
            return torch.stack([run.level(tokens[r], parents[r], visible[r], depth) for r, run in enumerate(runs)])

        return expand_tree(root_logits, forward, spec, None, [int(c) for c in depth_caps])


class _TreeRun:
    """One request's tree nodes run through the MTP modules without touching its state.

    Per run node (in ``expand_tree``'s run order): ``paths`` its tokens from the root, ``outs`` its
    module's output hidden states ``[1, m, H]`` (the block of indices ``committed(n, d+1)..n-1`` below
    depth D, one index beyond). The last module's keys of every node that ran it are kept in ``k, v``
    (``[1, n_kv, A, hd]``, slot owners in ``owner``) for the nodes below it."""

    def __init__(self, drafter: MTPDrafter, state: MTPState):
        self.d, self.s = drafter, state
        self.paths: list[list[int]] = []
        self.outs: list[torch.Tensor] = []
        self.k: torch.Tensor | None = None
        self.v: torch.Tensor | None = None
        self.owner: list[int] = []

    def level(self, tokens: torch.Tensor, parents: torch.Tensor, visible: torch.Tensor, depth: int) -> torch.Tensor:
        """``tokens [F]`` int64 nodes of depth ``depth`` with ``parents [F]`` (run indices, -1 = root) and
        ``visible [F, n_run + F]`` bool -> logits ``[F, V]`` float32 of their children."""
        n_run = len(self.paths)
        par = parents.tolist()
        self.paths += [(self.paths[p] if p >= 0 else []) + [int(t)] for p, t in zip(par, tokens.tolist())]
        D = self.d.num_modules
        if depth + 1 <= D:
            out, k, v = self._block(par, n_run, depth)
        else:
            out, k, v = self._step(par, n_run, visible, depth)
        self.outs += [out[f:f + 1] for f in range(out.shape[0])]
        if depth + 1 >= D:  # the last module ran: its keys serve the nodes below
            self.owner += [n_run + f for f in range(k.shape[0]) for _ in range(k.shape[2])]
            k = k.transpose(0, 1).reshape(1, k.shape[1], -1, k.shape[3])  # [1, n_kv, F*m, hd], node-major
            v = v.transpose(0, 1).reshape(1, v.shape[1], -1, v.shape[3])
            self.k = k if self.k is None else torch.cat([self.k, k], 2)
            self.v = v if self.v is None else torch.cat([self.v, v], 2)
        return self.d.head(out[:, -1]).float()

    def _module(self, i: int, tokens: torch.Tensor, hidden: torch.Tensor, pos0: int, attend):
        """Module ``i`` (0-based) on ``tokens [F, m]`` and ``hidden [F, m, H]`` at position ids
        ``pos0..pos0+m-1``; returns ``(out [F, m, H], k, v [F, n_kv, m, hd])``."""
        d = self.d
        F_, m = tokens.shape
        emb = d.embed_tokens(tokens.to(d.embed_tokens.weight.device))
        pos = torch.arange(pos0, pos0 + m, device=emb.device).unsqueeze(0).expand(F_, m)
        cos, sin = d.rotary(hidden, pos)
        kv = []

        def spy(q, k, v):
            kv.append((k, v))
            return attend(q, k, v)

        return d.layers[i](emb, hidden, cos, sin, spy), kv[0][0], kv[0][1]

    def _cached(self, i: int) -> tuple[torch.Tensor | None, torch.Tensor | None]:
        cache = self.s.caches[i]
        if cache.length == 0:
            return None, None
        return cache.k[0], cache.v[0]

    def _block(self, par: list[int], n_run: int, depth: int):
        """Module ``depth + 1`` over its missing indices ``lo..n-1`` for every node, as :meth:`MTPDrafter.
        _propose_one` runs it for draft ``depth + 1``: causal over its committed cache and the block."""
        s, i = self.s, depth
        n = s.n
        lo = committed(n, depth + 1)
        toks, hid = [], []
        for f, p in enumerate(par):
            seq = torch.cat([s.ids, torch.tensor(self.paths[n_run + f], dtype=torch.int64)])
            toks.append(seq[lo + depth + 1:n + depth + 1])
            prev = ([] if s.outs[depth - 1] is None else [s.outs[depth - 1]]) + ([self.outs[p]] if p >= 0 else [])
            hid.append(torch.cat(prev, 1)[:, lo:n])
        ck, cv = self._cached(i)
        m = n - lo
        mask = causal_mask_with_cache(m, lo, device=hid[0].device)

        def attend(q, k, v):
            if ck is not None:
                k = torch.cat([ck.expand(k.shape[0], -1, -1, -1), k], 2)
                v = torch.cat([cv.expand(v.shape[0], -1, -1, -1), v], 2)
            return F.scaled_dot_product_attention(q, k, v, attn_mask=mask, enable_gqa=k.shape[1] != q.shape[1])

        return self._module(i, torch.stack(toks), torch.cat(hid), lo + i + 1, attend)

    def _step(self, par: list[int], n_run: int, visible: torch.Tensor, depth: int):
        """The last module one index further for every node (beyond D): its token, its parent's output
        hidden state, keys = the committed cache + the ancestors' (``visible``) + its own."""
        s, D = self.s, self.d.num_modules
        n = s.n
        toks = torch.tensor([[self.paths[n_run + f][-1]] for f in range(len(par))], dtype=torch.int64)
        hid = torch.cat([self.outs[p][:, -1:] if p >= 0 else s.outs[0][:, n - 1:n] for p in par])  # [F, 1, H]
        ck, cv = self._cached(D - 1)
        Fn = len(par)
        vis = visible.to(hid.device)
        parts = [torch.ones(Fn, 0 if ck is None else ck.shape[2], dtype=torch.bool, device=hid.device)]
        if self.owner:
            parts.append(vis[:, self.owner])
        mask = torch.cat(parts + [vis[:, n_run:]], 1)[:, None, None, :]  # [F, 1, 1, S]

        def attend(q, k, v):
            new_k = k.transpose(0, 1).reshape(1, k.shape[1], -1, k.shape[3])  # [1, n_kv, F, hd]
            new_v = v.transpose(0, 1).reshape(1, v.shape[1], -1, v.shape[3])
            kk = torch.cat([t for t in (ck, self.k, new_k) if t is not None], 2).expand(Fn, -1, -1, -1)
            vv = torch.cat([t for t in (cv, self.v, new_v) if t is not None], 2).expand(Fn, -1, -1, -1)
            return F.scaled_dot_product_attention(q, kk, vv, attn_mask=mask, enable_gqa=kk.shape[1] != q.shape[1])

        return self._module(D - 1, toks, hid, n + depth, attend)
