"""MLP speculator (IBM's accelerator heads; Wertheimer et al., "Accelerating Production LLMs with Combined
Token/Embedding Speculators", arXiv 2404.19124; vLLM ``MLPSpeculator``, ``method: mlp_speculator``).

Architecture (ALGORITHMS.md; weight names as vLLM's ``mlp_speculator.py`` loads them, ``speculator.`` prefix
stripped): ``n_predict`` stages, each reading the previous stage's state and the previous token:

* ``s_0 = h_top`` (the target's final post-norm hidden state), or ``ln0(h_top) / sqrt(2)`` with
  ``scale_input`` (``ln0``: RMS normalisation without weights);
* stage i (0-based): ``s_{i+1} = GELU(LN_i(proj_i(s_i) + (w_emb / w_state) * emb_i(tok_i)))`` with
  ``w_state = 0.5 ** (0.5 / n_predict)``, ``w_emb = sqrt((1 - w_state^2) * inner_dim / 2)``, ``LN_i(x) =
  weight_i * x / sqrt(mean(x^2) + 1e-6) + bias_i``, exact GELU; logits ``head_i(s_{i+1})`` over the full
  vocabulary (``head_i: Linear(inner_dim -> V)``, no bias);
* ``proj_0: Linear(H -> inner_dim)``, ``proj_i: Linear(inner_dim -> inner_dim)`` (no bias), ``emb_i:
  Embedding(V, inner_dim)``; ``inner_dim: 0`` means H. ``tie_weights`` shares ``emb``, ``proj[1:]``, ``head``
  and ``ln`` across stages (vLLM builds the ModuleLists from one module; the file still carries every index).

Label convention (Medusa's). Stage i = draft k = i + 1 at index t reads ``h_top[t]`` and the tokens
``x_{t+1} .. x_{t+k}`` (teacher-forced: the data's tokens, which regeneration makes the target's own) and
predicts ``x_{t+k+1}``. Loss (``distill: false``): CE of stage k at ``t`` against ``x_{t+k+1}`` where it is an
assistant token; ``distill: true``: soft CE to the target's distribution at ``t + k`` (which predicts the
same token). Each stage's loss is averaged over its valid positions, total ``sum_k stage_decay^(k-1) *
loss_k``. IBM trains in two stages (fms-fsdp: teacher-forced on text, then on the base model's own
generations); here the second is the recipe's regenerated data, the first ``data.regenerate: false``.

Inference. After ``start``/``advance`` the newest feature is ``h_top[n-1]`` and the newest token ``x_n``:
stage 0 reads them and drafts ``x_{n+1}``; stage i reads stage i-1's state and its draft. Drafts are sampled
from each stage's distribution under the request's sampling settings (vLLM samples them with the request's
sampler too) and fed to the next stage. Trees: a node's children come from the stage of its depth, run on
its parent's state and its own token (:func:`speculators.drafters.tree_drafting.expand_tree`).

Initialisation: with ``inner_dim == H`` every ``emb_i`` starts as the target's token embedding and every
``head_i`` as the target's output head (as our Medusa heads start from it), otherwise N(0, 1/inner_dim);
``proj_i`` ~ N(0, 1/inner_dim) as IBM's ``reset_parameters``; LN weight 1, bias 0.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any, ClassVar, Literal

import torch
import torch.nn.functional as F
from pydantic import Field, model_validator
from torch import nn

from ..data.vocab import DraftVocab
from ..decode.proposal import Proposal, check_batch
from ..errors import SpeculatorsError
from ..losses import chained_acceptance, combine_terms, hard_cross_entropy, sample_draft
from ..verify import SamplingParams
from .base import Drafter, DrafterConfig
from .checkpoint import TargetMeta
from .registry import register
from .serving_format import ServingFormat

LN_EPS = 1e-6  # vLLM's MLPSpeculatorLayerNorm default


class MLPSpeculatorConfig(DrafterConfig):
    """``drafter:`` section of an MLP speculator recipe (vLLM's ``MLPSpeculatorConfig`` fields where they exist)."""

    algorithm: Literal["mlp_speculator"] = "mlp_speculator"
    n_predict: int = Field(default=3, ge=1, le=16, description="stages = drafts per step (vLLM `n_predict`, "
                                                               "`num_lookahead_tokens`)")
    inner_dim: int = Field(default=0, ge=0, description="width of the stages' state; 0 = the target's hidden size "
                                                        "(then emb/head start from the target's)")
    tie_weights: bool = Field(default=False, description="share emb, proj[1:], head and ln across stages (vLLM "
                                                         "`tie_weights`; needs n_predict > 1)")
    scale_input: bool = Field(default=False, description="RMS-normalise the target's hidden state and divide by "
                                                         "sqrt(2) before stage 0 (vLLM `scale_input`)")
    stage_decay: float = Field(default=1.0, gt=0.0, le=1.0, description="stage k's loss weight is stage_decay^(k-1)")
    distill: bool = Field(default=False, description="soft CE to the target's distribution at t+k instead of hard "
                                                     "CE to the data token x_{t+k+1}")

    full_vocab_only: ClassVar[str] = ("the MLP speculator's heads cover the full vocabulary (vLLM's loader has no "
                                      "draft vocabulary for it)")

    @model_validator(mode="after")
    def _tie(self):
        if self.tie_weights and self.n_predict < 2:
            raise ValueError("tie_weights: needs n_predict >= 2 (one stage has nothing to share; vLLM asserts it)")
        return self


class _RMSAffine(nn.Module):
    """``weight * x / sqrt(mean(x^2) + eps) + bias`` (vLLM ``MLPSpeculatorLayerNorm``, affine)."""

    def __init__(self, dim: int):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))
        self.bias = nn.Parameter(torch.zeros(dim))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.weight * rms_normalize(x) + self.bias


def rms_normalize(x: torch.Tensor) -> torch.Tensor:
    """``x / sqrt(mean(x^2, -1) + 1e-6)`` in ``x``'s dtype (vLLM's ``ln0`` without weights)."""
    return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + LN_EPS)


@dataclass
class MLPState:
    """Per-request state: the newest target feature ``h [H]`` and token ``x_n``; ``s1 [inner]`` and ``logits [V]``
    are stage 0's output on them (drafts ``x_{n+1}``), computed once per ``advance``."""

    h: torch.Tensor
    token: int
    s1: torch.Tensor
    logits: torch.Tensor


class MLPSpeculatorFormat(ServingFormat):
    """vLLM's own MLP speculator layout (``MLPSpeculatorPreTrainedModel``, ``model_type: mlp_speculator``)."""

    algorithm = "mlp_speculator"
    vllm_note = ("vLLM's config still accepts method mlp_speculator and its MLPSpeculator loader reads this layout, "
                 "but its V1 GPU model runner builds no MLP speculator proposer (\"Unknown speculative decoding "
                 "method\"): serve it with vLLM's V0 engine (<= 0.10) or Snowflake's ArcticInference plugin on V1")
    llamacpp_note = "llama.cpp has no speculative type for MLP speculator stages (heads on the target's last state)"

    def speculative_tokens(self, config: dict[str, Any]) -> int | None:
        """K is vLLM's ``num_lookahead_tokens`` (= ``n_predict``)."""
        return config.get("num_lookahead_tokens") or config.get("n_predict")

    def config(self, drafter: MLPSpeculatorDrafter) -> dict[str, Any]:
        """``config.json`` as vLLM's ``MLPSpeculatorConfig`` reads it (FORMATS.md)."""
        m, cfg = drafter.meta, drafter.cfg
        return {"architectures": ["MLPSpeculatorPreTrainedModel"], "model_type": "mlp_speculator",
                "vocab_size": m.vocab_size, "emb_dim": m.hidden_size, "inner_dim": drafter.inner_dim,
                "n_predict": cfg.n_predict, "num_lookahead_tokens": cfg.n_predict, "top_k_tokens_per_head":
                [1] * cfg.n_predict, "n_candidates": 1, "tie_weights": cfg.tie_weights,
                "scale_input": cfg.scale_input, "torch_dtype": "float32"}

    def state_dict(self, drafter: MLPSpeculatorDrafter) -> dict[str, torch.Tensor]:
        """``emb.{i}.weight [V, inner]``, ``proj.{i}.weight``, ``head.{i}.weight [V, inner]``, ``ln.{i}.weight|bias``
        for every stage i (tied stages repeat the shared tensor, as a vLLM checkpoint of tied weights does)."""
        sd = {}
        for i in range(drafter.n_predict):
            sd[f"emb.{i}.weight"] = drafter.emb[i].weight
            sd[f"proj.{i}.weight"] = drafter.proj[i].weight
            sd[f"head.{i}.weight"] = drafter.head[i].weight
            sd[f"ln.{i}.weight"] = drafter.ln[i].weight
            sd[f"ln.{i}.bias"] = drafter.ln[i].bias
        return {k: v.detach().clone().contiguous() for k, v in sd.items()}

    def load_state_dict(self, drafter: MLPSpeculatorDrafter, sd: dict[str, torch.Tensor]) -> None:
        """Load :meth:`state_dict`'s names (a ``speculator.`` prefix, as IBM's checkpoints carry, is dropped).

        Raises:
            SpeculatorsError: a missing or unexpected name, or a shape this config does not have.
        """
        sd = {k.removeprefix("speculator."): v for k, v in sd.items()}
        want = self.state_dict(drafter)
        missing, unexpected = sorted(set(want) - set(sd)), sorted(set(sd) - set(want))
        if missing or unexpected:
            raise SpeculatorsError(f"checkpoint weights do not match {self.algorithm}: missing {missing[:5]}, "
                                   f"unexpected {unexpected[:5]}")
        for name, t in sd.items():
            if tuple(t.shape) != tuple(want[name].shape):
                raise SpeculatorsError(f"checkpoint weights do not match this {self.algorithm} config: {name} is "
                                       f"{list(t.shape)}, expected {list(want[name].shape)}")
        with torch.no_grad():
            for i in range(drafter.n_predict):  # tied stages: every index writes the same (equal) tensor
                drafter.emb[i].weight.copy_(sd[f"emb.{i}.weight"])
                drafter.proj[i].weight.copy_(sd[f"proj.{i}.weight"])
                drafter.head[i].weight.copy_(sd[f"head.{i}.weight"])
                drafter.ln[i].weight.copy_(sd[f"ln.{i}.weight"])
                drafter.ln[i].bias.copy_(sd[f"ln.{i}.bias"])


@register
class MLPSpeculatorDrafter(Drafter):
    """MLP speculator (module docstring). Shapes: ``B`` batch, ``T`` sequence, ``H`` target hidden, ``D`` inner
    dim, ``V`` vocabulary, ``K`` stages (``n_predict``)."""

    algorithm = "mlp_speculator"
    config_class = MLPSpeculatorConfig

    @property
    def distills(self) -> bool:
        """``distill: true``: the stages' loss is a divergence to the target's distribution (``train.loss``)."""
        return bool(self.cfg.distill)

    serving = MLPSpeculatorFormat()
    max_speculative_tokens_source = "drafter.n_predict"

    def __init__(self, cfg: MLPSpeculatorConfig, meta: TargetMeta):
        super().__init__(cfg, meta)
        H, V, K = self.meta.hidden_size, self.meta.vocab_size, cfg.n_predict
        D = self.inner_dim = cfg.inner_dim or H
        if cfg.tie_weights:
            emb, head, ln, proj = nn.Embedding(V, D), nn.Linear(D, V, bias=False), _RMSAffine(D), nn.Linear(D, D, bias=False)
            self.emb, self.head, self.ln = (nn.ModuleList([m] * K) for m in (emb, head, ln))
            self.proj = nn.ModuleList([nn.Linear(H, D, bias=False)] + [proj] * (K - 1))
        else:
            self.emb = nn.ModuleList([nn.Embedding(V, D) for _ in range(K)])
            self.proj = nn.ModuleList([nn.Linear(H if i == 0 else D, D, bias=False) for i in range(K)])
            self.head = nn.ModuleList([nn.Linear(D, V, bias=False) for _ in range(K)])
            self.ln = nn.ModuleList([_RMSAffine(D) for _ in range(K)])
        self.state_weight = 0.5 ** (0.5 / K)
        self.emb_weight = math.sqrt((1 - self.state_weight ** 2) * (D / 2))

    @property
    def n_predict(self) -> int:
        return self.cfg.n_predict

    @property
    def max_speculative_tokens(self) -> int:
        """One draft per stage; a larger K is refused (:func:`speculators.decode.proposal.check_speculative_tokens`)."""
        return self.n_predict

    # ------------------------------------------------------------------ construction
    def output_heads(self) -> list[nn.Module]:
        """Each stage's ``head`` (one module when ``tie_weights``) (:meth:`Drafter.output_heads`)."""
        return list(dict.fromkeys(self.head))

    @classmethod
    def from_target(cls, cfg: MLPSpeculatorConfig, target, vocab: DraftVocab) -> MLPSpeculatorDrafter:
        """A fresh speculator for ``target`` (initialisation: module docstring).

        Raises:
            SpeculatorsError: ``vocab`` is a reduced draft vocabulary (the heads cover the full vocabulary).
        """
        if vocab.size != target.vocab_size:
            raise SpeculatorsError(f"mlp_speculator drafts over the full vocabulary ({target.vocab_size}); got a draft "
                                   f"vocabulary of {vocab.size}: leave drafter.draft_vocab_size unset")
        d = cls(cfg, TargetMeta.from_target(target))
        with torch.no_grad():
            for p in d.proj:
                nn.init.normal_(p.weight, 0.0, 1 / math.sqrt(d.inner_dim))
            emb = target.embed_tokens.weight
            for e, h in zip(d.emb, d.head):
                if d.inner_dim == d.meta.hidden_size:  # start as the target's embedding and head
                    e.weight.copy_(emb.detach().float()[: d.meta.vocab_size])
                    h.weight.copy_(target.lm_head_weight.detach().float()[: d.meta.vocab_size])
                else:  # IBM's reset_parameters
                    nn.init.normal_(e.weight, 0.0, 1 / math.sqrt(d.inner_dim))
                    nn.init.normal_(h.weight, 0.0, 1 / math.sqrt(d.inner_dim))
        d.attach_target(target)
        return d

    @classmethod
    def _build(cls, cfg: MLPSpeculatorConfig, meta: TargetMeta, weights: dict[str, torch.Tensor]) -> MLPSpeculatorDrafter:
        return cls(cfg, meta)

    # ------------------------------------------------------------------ the stages
    def initial_state(self, h: torch.Tensor) -> torch.Tensor:
        """``s_0`` from target hidden states ``h [..., H]`` (``scale_input``: ``ln0(h) / sqrt(2)``)."""
        w = self.proj[0].weight
        h = h.to(device=w.device, dtype=w.dtype)
        return rms_normalize(h) / math.sqrt(2.0) if self.cfg.scale_input else h

    def stage(self, i: int, s: torch.Tensor, tokens: torch.Tensor) -> torch.Tensor:
        """Stage ``i``: state ``s [..., H or D]`` and previous tokens ``[...]`` int64 -> new state ``[..., D]``."""
        z = self.emb[i](tokens.to(self.emb[i].weight.device))
        x = self.proj[i](s) + z * (self.emb_weight / self.state_weight)
        return F.gelu(self.ln[i](x))

    def stage_logits(self, i: int, s: torch.Tensor) -> torch.Tensor:
        """``head_i`` on a stage-i output state: ``[..., V]``."""
        return self.head[i](s)

    # ------------------------------------------------------------------ training
    def _valid_masks(self, batch) -> list[torch.Tensor]:
        """Per stage k = 1..K: ``[B, max(T - k - 1, 0)]`` bool, t valid when ``x_{t+k+1}`` is an assistant token."""
        assistant = batch.loss_mask & batch.attention_mask
        return [assistant[:, k + 1:] for k in range(1, self.n_predict + 1)]

    def loss_counts(self, batch) -> torch.Tensor:
        """``[n_predict]`` int64 valid positions per stage (see :meth:`Drafter.loss_counts`)."""
        return torch.stack([v.sum() for v in self._valid_masks(batch)])

    def loss(self, batch, norm: torch.Tensor | None = None) -> tuple[torch.Tensor, dict[str, float]]:
        """Teacher-forced stage losses ``sum_k stage_decay^(k-1) * loss_k`` (module docstring), ``loss_k`` the sum
        over stage k's valid positions divided by ``norm[k-1]`` (default: their count).

        Args:
            batch: :class:`speculators.data.dataset.Batch` (``top``, ``input_ids``, ``loss_mask``,
                ``attention_mask``, ``argmax``).
            norm: ``[n_predict]`` divisors (:meth:`loss_counts` of the accumulation window).
        Returns:
            loss and metrics ``loss_j``, ``full_acc_j``, ``cond_acc_j``, ``sim_tau``
            (:func:`speculators.losses.chained_acceptance`: stage j's top-1 at t equals the target's greedy
            token ``argmax[t+j+1]``, the teacher-forced chain of the data's tokens).
        Raises:
            RuntimeError: ``distill`` without ``attach_target``.
        """
        cfg: MLPSpeculatorConfig = self.cfg
        ids, T = batch.input_ids, batch.input_ids.shape[1]
        assistant = batch.loss_mask & batch.attention_mask
        valids = self._valid_masks(batch)
        counts = torch.stack([v.sum() for v in valids])
        if cfg.distill:
            if self.frozen_target.head_weight is None:
                raise RuntimeError("attach_target(target) first: the target's output head is missing")
            with torch.no_grad():
                teacher_p = torch.softmax(self.frozen_target.teacher_logits(batch.top).float(), dim=-1)  # [B, T, V]
        s = self.initial_state(batch.top)  # [B, T, H]
        sums, corrects, labels, metrics = [], [], [], {}
        for k in range(1, self.n_predict + 1):
            L = max(T - k - 1, 0)
            s = self.stage(k - 1, s[:, :L], ids[:, k:k + L])  # reads x_{t+k}: [B, L, D]
            logits = self.stage_logits(k - 1, s).float()  # predicts x_{t+k+1}
            if cfg.distill:
                sums.append(self.distill_loss.sum(logits, teacher_p[:, k:k + L], valids[k - 1]))
            else:
                sums.append(hard_cross_entropy(logits, ids[:, k + 1:k + 1 + L], valids[k - 1]))
            with torch.no_grad():
                corrects.append(logits.argmax(-1) == batch.argmax[:, k:k + L])
                labels.append(assistant[:, k + 1:k + 1 + L])
                metrics[f"loss_{k - 1}"] = float(sums[-1].detach() / counts[k - 1].clamp(min=1))
        metrics.update(chained_acceptance(corrects, labels))
        total, self.last_own_loss = combine_terms(sums, [cfg.stage_decay ** j for j in range(self.n_predict)],
                                                  counts, norm, where=self.algorithm)
        return total, metrics

    # ------------------------------------------------------------------ inference
    def _new_state(self, features, token: int) -> MLPState:
        top = features.top.reshape(-1, features.top.shape[-1])
        if top.shape[0] == 0:
            raise SpeculatorsError("mlp_speculator: no target features given (need the features of position n-1)")
        h = self.initial_state(top[-1])
        s1 = self.stage(0, h, torch.tensor(token))
        return MLPState(h, token, s1, self.stage_logits(0, s1).float())

    @torch.no_grad()
    def start(self, input_ids: torch.Tensor, features) -> MLPState:
        """``input_ids [n+1]`` (prompt + first target token), features of positions ``0..n-1`` (the newest used)."""
        return self._new_state(features, int(input_ids[-1]))

    @torch.no_grad()
    def _advance_one(self, state: MLPState, new_ids: torch.Tensor, features) -> None:
        """Append ``m`` verified tokens; features of positions ``n..n+m-1`` (only the last is used)."""
        new = self._new_state(features, int(new_ids[-1]))
        state.h, state.token, state.s1, state.logits = new.h, new.token, new.s1, new.logits

    @torch.no_grad()
    def _propose_one(self, state: MLPState, k: int, sampling: SamplingParams | None = None,
                     generator: torch.Generator | None = None) -> Proposal:
        """Drafts ``x_{n+1}..x_{n+k}`` stage by stage, each drawn (:func:`speculators.losses.sample_draft`, greedy
        when ``sampling`` is None) from its stage's distribution and fed to the next stage; ``probs [k, V]``
        float32 when sampled. The state is not modified. ``k`` above ``n_predict`` is refused by the loop first."""
        kk = max(0, min(int(k), self.n_predict))
        if kk == 0:
            return Proposal(torch.empty(0, dtype=torch.int64))
        ids, probs, s, logits = [], [], state.s1, state.logits
        for i in range(kk):
            tok, p = sample_draft(logits[None], sampling, generator)
            ids.append(tok.reshape(1).cpu())
            if p is not None:
                probs.append(p.reshape(1, -1))
            if i + 1 < kk:
                s = self.stage(i + 1, s, tok.reshape(()).to(s.device))
                logits = self.stage_logits(i + 1, s).float()
        return Proposal(torch.cat(ids).to(torch.int64), torch.cat(probs) if probs else None)

    drafts_trees = True  # declared capability: propose_tree (EAGLE-2 dynamic or vLLM static trees over the stages)

    @torch.no_grad()
    def propose_tree(self, states: list[MLPState], spec, depth_caps: list[int], sampling=None,
                     generators=None) -> list:
        """Draft trees for B requests (:func:`speculators.drafters.tree_drafting.expand_tree`: EAGLE-2's dynamic
        expansion or a static ``speculative_token_tree``): a node at depth d (token ``a_d``) runs stage d on its
        parent's state and its token, exactly what :meth:`_propose_one` computes after drafting that path; the
        root's children come from stage 0 (``state.logits``). Depth is capped at ``n_predict``. Children are
        top-k tokens (point masses for the verifier), so ``sampling`` / ``generators`` are not drawn from.

        Returns:
            B :class:`speculators.verify.tree.DraftTree` (int64 target ids, CPU, ``probs`` None).
        Raises:
            SpeculatorsError: ``depth_caps`` not one non-negative integer per state.
        """
        from .tree_drafting import expand_tree

        caps = check_batch(states, depth_caps, sampling, generators, who="propose_tree", ks_name="depth_caps")
        if not states:
            return []
        runs: list[list[torch.Tensor]] = [[] for _ in states]  # per request: the states of the nodes run so far

        def forward(tokens, parents, visible, depth):
            out = []
            for r, st in enumerate(states):
                prev = torch.stack([st.s1 if int(p) < 0 else runs[r][int(p)] for p in parents[r]])  # [F, D]
                s = self.stage(depth, prev, tokens[r].to(prev.device))
                runs[r].extend(s.unbind(0))
                out.append(self.stage_logits(depth, s).float())
            return torch.stack(out)

        root = torch.stack([st.logits for st in states])
        return expand_tree(root, forward, spec, None, [min(int(c), self.n_predict) for c in caps])


__all__ = ["MLPSpeculatorConfig", "MLPSpeculatorDrafter", "MLPSpeculatorFormat", "rms_normalize"]
