"""Medusa (Cai et al., arXiv 2401.10774): K parallel decoding heads on the target's top hidden state.

Architecture (ALGORITHMS.md; weight names as vLLM's ``Medusa`` model loads them):

* head k (k = 1..K) is ``num_layers`` residual blocks ``x <- x + SiLU(W x + b)`` (``blocks.{k-1}.layers.{j}``,
  one ``nn.Linear(H, H)`` per block, never shared) followed by its own ``lm_heads.{k-1}: Linear(H -> N_draft)``;
* W and b start at zero (every block starts as the identity; the reference code zeroes W, the
  vllm-project/speculators trainer zeroes both) and each ``lm_heads`` row starts as the target's
  lm_head row of that draft-vocabulary token, so at initialisation every head reproduces the target's
  own next-token distribution;
* optional draft vocabulary (``d2t`` / ``t2d``, :class:`~speculators.data.vocab.DraftVocab`).

Label convention. All heads read ``h_top[t]`` (the target's final post-norm hidden state, ``Batch.top``).
The target's own head predicts ``x_{t+1}`` from it; Medusa head k predicts ``x_{t+k+1}`` (head 1 ->
``x_{t+2}``). Hard-label loss (``distill: false``): CE of head k at ``t`` against the data token
``input_ids[t+k+1]``, valid where ``t+k+1`` is inside the sequence, ``loss_mask[t+k+1]`` (assistant token)
and that token is in the draft vocabulary. Self-distillation (``distill: true``): soft CE to the target's
distribution at position ``t+k`` (``softmax(lm_head(top[t+k]))`` restricted to the draft vocab and
renormalised; it predicts ``x_{t+k+1}``), valid where ``loss_mask[t+k+1]`` and the target's argmax at
``t+k`` lies in the draft vocabulary. Each head's loss is averaged over its own valid positions;
total = ``sum_k head_decay^(k-1) * loss_k`` (Medusa-1, lambda = 0.8).

Inference. After ``start``/``advance`` the newest feature is ``h_top[n-1]`` and the newest token ``x_n``;
head k drafts ``x_{n+k}`` (= ``x_{(n-1)+k+1}``). One pass of the K heads gives K drafts (top-1 chain);
``propose(k)`` uses the first ``min(k, K)`` heads.

Medusa-2 (``joint: true``): the target is fine-tuned with LoRA together with the heads (``joint.py``);
loss ``L_LM + joint_head_weight * sum_k head_decay^(k-1) * loss_k`` (the paper's 0.2 and 0.8; its code
writes the decay as ``0.8^k`` with k from 0, the same weights), the heads at ``train.lr`` and the
adapters at ``joint_target.lr``. The heads then read the adapted target's hidden states, and eval
verifies against the adapted target.

Formats. ``export: speculators`` (default) writes the vllm-project/speculators ``medusa`` config (which
vLLM maps to its ``MedusaModel``) with ``lm_heads`` over the draft vocabulary, ``d2t``/``t2d`` and, for a
truncated vocabulary, vLLM's ``token_map`` + ``truncated_vocab_size``. ``export: vllm-medusa`` writes
vLLM's native Medusa config and full-vocabulary ``lm_heads`` (see :meth:`MedusaFormat.state_dict`), for the full
vocabulary only: vLLM 0.32's Medusa builds every head at ``vocab_size`` rows and cuts a loaded head to its
``token_map`` rows, which fails its shape check, so a reduced draft vocabulary is refused when training starts
(vLLM itself raised on such a file). An older checkpoint written that way still loads here.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Literal

import torch
import torch.nn.functional as F
from pydantic import Field
from torch import nn

from .. import export
from ..data.vocab import DraftVocab
from ..errors import SpeculatorsError
from ..losses import (
    chained_acceptance,
    combine_terms,
    hard_cross_entropy,
    sample_draft,
    target_to_draft,
)
from ..decode.proposal import check_batch
from ..verify import SamplingParams
from .base import Drafter, DrafterConfig
from ..decode.proposal import Proposal
from .checkpoint import TargetMeta
from .registry import register
from .serving_format import ServingFormat
from .joint import JointConfig
from .layers import DraftVocabBuffers, layer_config


class MedusaConfig(JointConfig, DrafterConfig):
    """``drafter:`` section of a Medusa recipe (``joint`` / ``joint_target``: see :class:`JointConfig`)."""

    algorithm: Literal["medusa"] = "medusa"
    num_heads: int = Field(default=4, ge=1, le=64, description="K: number of Medusa heads = drafts per step")
    num_layers: int = Field(default=1, ge=1, le=8, description="residual blocks per head")
    head_decay: float = Field(default=0.8, gt=0.0, le=1.0,
                              description="lambda: head k's loss weight is lambda^(k-1)")
    distill: bool = Field(default=False, description="soft CE to the target distribution at t+k "
                                                     "instead of hard CE to the data token x_{t+k+1}")
    joint_head_weight: float = Field(default=0.2, gt=0.0, description="Medusa-2: weight of the heads' loss "
                                                                     "next to the target's LM loss")
    export: Literal["speculators", "vllm-medusa"] = Field(
        default="speculators", description="checkpoint layout: vllm-project/speculators config, or vLLM's "
                                           "native Medusa config with full-vocabulary lm_heads")


class _ResBlocks(nn.Module):
    """One head's residual stack: ``x <- x + SiLU(layers[j](x))`` for j = 0..n-1 (vLLM ``ResidualBlock``)."""

    def __init__(self, hidden_size: int, num_layers: int):
        super().__init__()
        self.layers = nn.ModuleList([nn.Linear(hidden_size, hidden_size, bias=True) for _ in range(num_layers)])

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for layer in self.layers:
            x = x + F.silu(layer(x))
        return x


@dataclass
class MedusaState:
    """Per-request inference state: the K heads' logits on the newest target feature ``h_top[n-1]``."""

    logits: torch.Tensor  # [K, N_draft] float32; row k-1 predicts x_{n+k}


class MedusaFormat(ServingFormat):
    """Medusa's serving formats (``drafter.export``): vllm-project/speculators' ``medusa`` config (default)
    or vLLM's native Medusa config and weights (``vllm-medusa``, the one vLLM loads, ``method: medusa``)."""

    algorithm = "medusa"
    llamacpp_note = "llama.cpp has no Medusa speculative type (heads on the target's last hidden state)"

    def vllm_serving(self, config: dict[str, Any]) -> tuple[str | None, str]:
        """vLLM loads Medusa in its own layout (``export: vllm-medusa``, ``method: medusa``) only."""
        method = "medusa" if config.get("model_type") == "medusa" else None
        return export.vllm_serving(self.algorithm, method, "vLLM loads Medusa heads in its own layout: train with "
                                                           "`drafter.export: vllm-medusa`")

    def speculative_tokens(self, config: dict[str, Any]) -> int | None:
        """vLLM's native Medusa config has no speculators block: K is its ``num_heads``."""
        return super().speculative_tokens(config) or config.get("num_heads")

    def config(self, drafter: MedusaDrafter) -> dict[str, Any]:
        """``config.json``: vllm-project/speculators ``medusa`` (default) or vLLM's native Medusa config.

        Both carry what vLLM's ``MedusaConfig``/``Medusa`` read: ``num_heads``, ``num_hidden_layers``
        (residual blocks per head), hidden/vocab sizes, ``medusa_fc_bias: true`` (our blocks have a bias;
        vLLM's default is no bias) and, for a draft vocabulary of N < V tokens, ``truncated_vocab_size: N``
        (the speculators layout; the vllm-medusa layout has N = V for every checkpoint trained now: module
        docstring).
        """
        m, cfg = drafter.meta, drafter.cfg
        H, V, N = m.hidden_size, m.vocab_size, int(drafter.d2t.numel())
        # vLLM builds its ResidualBlock linears with a bias only when medusa_fc_bias is true
        heads = {"num_heads": cfg.num_heads, "num_hidden_layers": cfg.num_layers,
                 "medusa_fc_bias": True, "original_lm_head": False}
        if cfg.export == "vllm-medusa":
            out = {"model_type": "medusa", "architectures": ["MedusaModel"], "hidden_size": H,
                   "vocab_size": V, **heads}
            if N < V:
                out["truncated_vocab_size"] = N
            return out
        layer = layer_config(m.target_config, num_hidden_layers=cfg.num_layers)
        return {
            "architectures": ["MedusaModel"],
            "speculators_model_type": "medusa",
            "speculators_config": export.speculators_config(drafter.algorithm, cfg.num_heads, m.name_or_path,
                                                            m.architectures),
            "transformer_layer_config": export.transformer_layer_config(layer),
            "draft_vocab_size": N,
            "medusa_hidden_size": H,
            "medusa_vocab_size": V,
            **heads,
            "truncated_vocab_size": N if N < V else 0,  # speculators' convention: 0 = full vocab
            "head_weight_decay": cfg.head_decay,
            "tie_word_embeddings": False,
            "torch_dtype": "float32",
        }

    def state_dict(self, drafter: MedusaDrafter) -> dict[str, torch.Tensor]:
        """Weights of the configured layout.

        speculators: ``blocks.{k}.layers.{j}.weight|bias``, ``lm_heads.{k}.weight [N, H]``, ``d2t [N]``,
        ``t2d [V]`` and, when N < V, ``token_map [N]`` int64 (target ids; what vLLM reads).
        vllm-medusa: ``blocks.*``, ``lm_heads.{k}.weight [V, H]`` over the full vocabulary (rows outside the
        draft vocab are zero; vLLM keeps only the ``token_map`` rows when ``truncated_vocab_size < V``)
        and ``token_map`` when N < V; no d2t/t2d.
        """
        sd = super().state_dict(drafter)
        if not drafter.full_vocab:
            sd["token_map"] = drafter.draft_ids.detach().clone()
        if drafter.cfg.export == "vllm-medusa":
            del sd["d2t"], sd["t2d"]
            if not drafter.full_vocab:
                V, ids = drafter.t2d.numel(), drafter.draft_ids
                for i in range(drafter.num_heads):
                    w = sd[f"lm_heads.{i}.weight"]
                    full = torch.zeros(V, w.shape[1], dtype=w.dtype, device=w.device)
                    full[ids] = w
                    sd[f"lm_heads.{i}.weight"] = full
        return sd

    def load_state_dict(self, drafter: MedusaDrafter, sd: dict[str, torch.Tensor]) -> None:
        """Load either layout (see :meth:`state_dict`) into the module.

        Raises:
            SpeculatorsError: the draft vocabulary or weight names/shapes do not match this module.
        """
        sd = dict(sd)
        token_map = sd.pop("token_map", None)
        if "d2t" not in sd:  # vLLM layout: rebuild d2t/t2d from token_map, gather the lm_head rows
            V, N = drafter.t2d.numel(), drafter.d2t.numel()
            ids = token_map.to(torch.int64) if token_map is not None else torch.arange(V)
            if ids.numel() != N:
                raise SpeculatorsError(f"medusa checkpoint: token_map has {ids.numel()} ids, expected {N}")
            t2d = torch.zeros(V, dtype=torch.bool)
            t2d[ids] = True
            sd["d2t"], sd["t2d"] = ids - torch.arange(N), t2d
            for i in range(drafter.num_heads):
                w = sd.get(f"lm_heads.{i}.weight")
                if w is not None and w.shape[0] == V and N < V:
                    sd[f"lm_heads.{i}.weight"] = w[ids]
        super().load_state_dict(drafter, sd)


@register
class MedusaDrafter(DraftVocabBuffers, Drafter):
    """Medusa drafter (see module docstring). Shapes: ``B`` batch, ``T`` sequence, ``H`` hidden,
    ``V`` target vocab, ``N`` draft vocab, ``K`` heads."""

    algorithm = "medusa"
    config_class = MedusaConfig

    @property
    def distills(self) -> bool:
        """``distill: true``: the stages' loss is a divergence to the target's distribution (``train.loss``)."""
        return bool(self.cfg.distill)

    serving = MedusaFormat()

    def __init__(self, cfg: MedusaConfig, meta: TargetMeta, draft_vocab_size: int):
        super().__init__(cfg, meta)
        H, V = self.meta.hidden_size, self.meta.vocab_size
        self.blocks = nn.ModuleList([_ResBlocks(H, cfg.num_layers) for _ in range(cfg.num_heads)])
        self.lm_heads = nn.ModuleList([nn.Linear(H, draft_vocab_size, bias=False) for _ in range(cfg.num_heads)])
        self.register_draft_vocab(draft_vocab_size, V)

    # ------------------------------------------------------------------ construction
    def output_heads(self) -> list[nn.Module]:
        """The K ``lm_heads`` (:meth:`Drafter.output_heads`)."""
        return list(self.lm_heads)

    @classmethod
    def from_target(cls, cfg: MedusaConfig, target, vocab: DraftVocab) -> MedusaDrafter:
        """Fresh drafter: zero residual blocks (W and b), each head's lm_head = the target's rows of the
        draft vocabulary (so every head starts as the target's own next-token head)."""
        if cfg.export == "vllm-medusa" and vocab.size < target.vocab_size:
            raise SpeculatorsError(
                f"drafter.export: vllm-medusa needs the full vocabulary (drafter.draft_vocab_size: null; here "
                f"{vocab.size} of {target.vocab_size}): vLLM 0.32's Medusa builds every head's lm_head with vocab_size "
                "rows and cuts a loaded head to its token_map rows, which then fails the shape check, so it cannot "
                "load per-head heads over a reduced vocabulary; keep export: speculators for a reduced vocabulary")
        d = cls(cfg, TargetMeta.from_target(target), vocab.size)
        d.init_draft_vocab(target, vocab, list(d.lm_heads))
        with torch.no_grad():
            for block in d.blocks:
                for layer in block.layers:
                    layer.weight.zero_()
                    layer.bias.zero_()
        d.attach_target(target)
        return d

    @classmethod
    def _build(cls, cfg: MedusaConfig, meta: TargetMeta, weights: dict[str, torch.Tensor]) -> MedusaDrafter:
        """Empty module for either layout: the draft vocab size is ``d2t``'s length (speculators layout),
        else ``token_map``'s (vLLM layout with a truncated vocab), else the full target vocab."""
        if "d2t" in weights:
            n = weights["d2t"].numel()
        elif "token_map" in weights:
            n = weights["token_map"].numel()
        else:
            n = meta.vocab_size
        return cls(cfg, meta, n)

    @property
    def joint_loss_weight(self) -> float:
        return self.cfg.joint_head_weight

    @property
    def num_heads(self) -> int:
        return len(self.lm_heads)

    max_speculative_tokens_source = "drafter.num_heads"

    @property
    def max_speculative_tokens(self) -> int:
        """The most drafts one step gives: one per trained head (``num_heads``); a larger K is refused
        by :func:`speculators.decode.proposal.check_speculative_tokens`, never silently capped."""
        return self.num_heads


    @property
    def full_vocab(self) -> bool:
        return self.d2t.numel() == self.t2d.numel()

    def head_logits(self, top: torch.Tensor, heads: int | None = None) -> list[torch.Tensor]:
        """``[..., H]`` target top hidden states -> list of ``[..., N]`` draft-vocab logits, one per head
        (the first ``heads`` heads; default all). Head k's logits at ``t`` predict ``x_{t+k+1}``."""
        n = self.num_heads if heads is None else heads
        return [self.lm_heads[i](self.blocks[i](top)) for i in range(n)]

    def _teacher_logits(self, top: torch.Tensor) -> torch.Tensor:
        """The frozen target head on ``top [..., H]``, restricted to the draft vocabulary: ``[..., N]``.

        Raises:
            RuntimeError: ``attach_target`` was not called.
        """
        if self.frozen_target.head_weight is None:
            raise RuntimeError("attach_target(target) first: the target's output head is missing")
        return self.frozen_target.teacher_logits(top, None if self.full_vocab else self.draft_ids)

    # ------------------------------------------------------------------ training
    @property
    def counts_use_argmax(self) -> bool:
        # distillation skips positions whose target argmax is outside a reduced draft vocabulary
        return bool(self.cfg.distill) and not self.full_vocab

    def _valid_masks(self, batch) -> list[torch.Tensor]:
        """Per head k = 1..K: ``[B, max(T - k - 1, 0)]`` bool, index t valid when ``x_{t+k+1}`` is an
        assistant token and its label is in the draft vocabulary (``distill``: the target's argmax at
        ``t + k``; otherwise the data token). Used by :meth:`loss` and :meth:`loss_counts`."""
        T = batch.input_ids.shape[1]
        assistant = batch.loss_mask & batch.attention_mask  # [B, T]: token at this index is to be predicted
        t2d = self.t2d
        if self.cfg.distill:
            ok = t2d[batch.argmax.to(t2d.device)].to(assistant.device)  # [B, T]: argmax at t in the vocab
            return [assistant[:, k + 1:] & ok[:, k:T - 1] for k in range(1, self.num_heads + 1)]
        ok = t2d[batch.input_ids.to(t2d.device)].to(assistant.device)  # [B, T]: data token in the vocab
        return [assistant[:, k + 1:] & ok[:, k + 1:] for k in range(1, self.num_heads + 1)]

    def loss_counts(self, batch) -> torch.Tensor:
        """``[num_heads]`` int64: valid positions of each head's term (see :meth:`Drafter.loss_counts`)."""
        return torch.stack([v.sum() for v in self._valid_masks(batch)])

    def loss(self, batch, norm: torch.Tensor | None = None) -> tuple[torch.Tensor, dict[str, float]]:
        """Medusa-1 loss ``sum_k head_decay^(k-1) * loss_k`` (see the module docstring for the labels);
        ``loss_k`` sums head k's CE over its valid positions and divides by ``norm[k-1]`` (default: their
        count, i.e. the mean; see :meth:`Drafter.loss`).

        Args:
            batch: :class:`speculators.data.dataset.Batch` (uses ``top``, ``input_ids``, ``loss_mask``,
                ``attention_mask``, ``argmax``).
            norm: ``[num_heads]`` divisors, see :meth:`loss_counts`.
        Returns:
            loss (scalar) and metrics, with ``j = k - 1`` (0-based draft position):
            ``loss_j`` (this batch's mean); ``full_acc_j``, ``cond_acc_j``, ``sim_tau`` from
            :func:`speculators.losses.chained_acceptance`: head i's draft at t is correct when it equals
            the target's greedy token ``argmax[t+i]`` (target-id space; a token outside the draft vocab
            counts as a miss), labelled when ``x_{t+i+1}`` is an assistant token.
        Raises:
            RuntimeError: ``distill`` without ``attach_target``.
        """
        cfg: MedusaConfig = self.cfg
        T = batch.input_ids.shape[1]
        draft_ids = self.draft_ids
        assistant = batch.loss_mask & batch.attention_mask  # [B, T]: token at this index is to be predicted
        if cfg.distill:
            with torch.no_grad():
                teacher_p = torch.softmax(self._teacher_logits(batch.top).float(), dim=-1)  # [B, T, N]
        # data token -> draft index (only meaningful where the token is in the draft vocab)
        tok_draft = target_to_draft(batch.input_ids, self.t2d)[0]
        valids = self._valid_masks(batch)
        counts = torch.stack([v.sum() for v in valids])
        sums: list[torch.Tensor] = []
        metrics: dict[str, float] = {}
        corrects: list[torch.Tensor] = []
        labels: list[torch.Tensor] = []
        for k in range(1, self.num_heads + 1):
            L = max(T - k - 1, 0)  # positions t = 0..L-1 have a label at t+k+1 < T (empty when T is short)
            logits = self.lm_heads[k - 1](self.blocks[k - 1](batch.top[:, :L])).float()  # [B, L, N]
            if cfg.distill:
                sums.append(self.distill_loss.sum(logits, teacher_p[:, k:T - 1], valids[k - 1]))
            else:
                sums.append(hard_cross_entropy(logits, tok_draft[:, k + 1:], valids[k - 1]))
            with torch.no_grad():
                # head k vs the target's greedy token at t+k (target-id space: out-of-vocab is a miss)
                corrects.append(draft_ids[logits.argmax(-1)] == batch.argmax[:, k:T - 1])  # [B, L]
                labels.append(assistant[:, k + 1:])  # [B, L]: x_{t+k+1} is an assistant token
                metrics[f"loss_{k - 1}"] = float(sums[-1].detach() / counts[k - 1].clamp(min=1))
        metrics.update(chained_acceptance(corrects, labels))
        total, self.last_own_loss = combine_terms(sums, [cfg.head_decay ** j for j in range(self.num_heads)],
                                                  counts, norm, where=self.algorithm)
        return total, metrics

    # ------------------------------------------------------------------ inference
    def _run_heads(self, features) -> torch.Tensor:
        top = features.top.reshape(-1, features.top.shape[-1])
        if top.shape[0] == 0:
            raise SpeculatorsError("medusa: no target features given (need the features of position n-1)")
        w = self.lm_heads[0].weight
        h = top[-1:].to(device=w.device, dtype=w.dtype)  # newest feature h_top[n-1]
        return torch.cat(self.head_logits(h), dim=0).float()  # [K, N]

    @torch.no_grad()
    def start(self, input_ids: torch.Tensor, features) -> MedusaState:
        """``input_ids [n+1]`` (prompt + first target token), features of positions ``0..n-1``.
        Only the newest feature ``top[n-1]`` is used: Medusa heads see no tokens and keep no cache."""
        return MedusaState(self._run_heads(features))

    @torch.no_grad()
    def _advance_one(self, state: MedusaState, new_ids: torch.Tensor, features) -> None:
        """Append ``m`` verified tokens; features of positions ``n..n+m-1`` (only the last is used)."""
        state.logits = self._run_heads(features)

    @torch.no_grad()
    def _propose_one(self, state: MedusaState, k: int, sampling: SamplingParams | None = None,
                     generator: torch.Generator | None = None) -> Proposal:
        """Drafts ``x_{n+1}..x_{n+k}`` from heads ``1..k`` (one pass; the loop and eval refuse
        ``k > num_heads`` first, see :attr:`max_speculative_tokens`).

        The heads' draft-vocabulary logits go through :func:`speculators.losses.sample_draft` under
        ``sampling`` (the request's :class:`speculators.verify.SamplingParams`, batch of one; ``None`` =
        greedy): greedy gives each head's top-1 and ``probs=None``; otherwise draft i is drawn from head
        i's distribution under the same temperature/top-k/top-p as the target (one multinomial call
        for the k' rows, with ``generator``, default the request's own) and the ``[k', V]`` float32
        full-vocabulary distributions (zero outside the draft vocab) are returned. The state is not
        modified.

        Raises:
            SpeculatorsError: ``sampling`` is not one request's valid ``SamplingParams``.
        """
        kk = max(0, min(int(k), self.num_heads))
        if kk == 0:
            return Proposal(torch.empty(0, dtype=torch.int64))
        ids, probs = sample_draft(state.logits[:kk], sampling, generator, d2t=self.d2t, vocab_size=self.t2d.numel())
        return Proposal(ids, probs)

    drafts_trees = True  # declared capability: propose_tree (Medusa trees: EAGLE-2 dynamic or static choices)

    @torch.no_grad()
    def propose_tree(self, states: list[MedusaState], spec, depth_caps: list[int], sampling=None,
                     generators=None) -> list:
        """Medusa trees (Cai et al. arXiv 2401.10774, "tree attention"; Medusa choices = a static
        ``speculative_token_tree``) for B requests, by :func:`speculators.drafters.tree_drafting.slot_tree`.

        Head k sees only ``h_top[n-1]``, never a draft, so its distribution is the same under every parent:
        a node at depth k takes one of head k's top-k tokens, scored by the sum of the heads' log-softmax
        along its path. The heads' logits are the ones the last ``advance`` computed (``state.logits``, the
        chain's); no forward runs. Depth is at most ``num_heads``. Children are top-k tokens (point masses
        for the verifier), so ``sampling`` / ``generators`` are not drawn from; the states are not modified.

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
        logits = torch.stack([s.logits for s in states]).float().cpu()  # [B, K, N]
        return slot_tree(logits, spec, self.d2t, caps)
