"""EAGLE-1 (Li et al., arXiv 2401.15077): feature-level autoregressive drafting with a feature loss.

Architecture (SafeAILab/EAGLE ``eagle/model/cnets1.py``; weight names as vLLM's ``EagleLlamaForCausalLM``,
``vllm/model_executor/models/llama_eagle.py``, loads them):

* ``fc: Linear(2H -> H)`` on ``concat(embed(x_{t+1}), h[t])`` -- the embedding half FIRST, as EAGLE's
  ``cnets1.Model.forward`` and vLLM's ``LlamaModel.forward`` concatenate (``fc.weight[:, :H]`` multiplies
  the embedding, ``fc.weight[:, H:]`` the feature);
* Llama decoder layers; layer 0 has NO ``input_layernorm`` (EAGLE's ``index != 0`` rule; vLLM replaces
  it with ``nn.Identity``); layers 1.. are plain Llama layers; no final norm;
* the output feature ``f`` is read by the TARGET's frozen ``lm_head`` (``FrozenTarget.lm_head``; the
  target's ``h_top`` is post-norm, so no extra norm); ``embed_tokens`` is copied from the target, frozen.

Indexing (the label shift). The drafter input at index t is ``(h_top[t], x_{t+1})`` at position id
``t + 1``; it outputs ``f[t+1]``, the predicted target feature of position ``t + 1``, whose head gives
the draft of ``x_{t+2}``. Training targets at index t: feature ``h_top[t+1]`` and distribution
``p_{t+1} = softmax(lm_head(h_top[t+1]))``; a position counts when ``x_{t+2}`` is a real assistant token.

Inference: step 0 drafts from the feature predicted by the newest real input; draft step j > 0 feeds
``(f, d)`` = its own previous predicted feature and the token it just drafted, at the next position,
with its own KV cache (rolled back after ``propose``). ``advance`` runs the verified positions with the
target's REAL features.

Draft trees (:meth:`EagleDrafter.propose_tree`, EAGLE-2 dynamic or vLLM static through
:func:`.tree_drafting.expand_tree`): one batched forward per level over every request's frontier, each node
``(its token, its parent's predicted feature)`` at its depth's position under a tree mask over the
request's cache and its ancestors, so a node's logits are the chain's after that node's path.
"""

from __future__ import annotations

import contextlib
from dataclasses import dataclass
from typing import Any, ClassVar, Literal

import torch
from pydantic import Field
from torch import nn

from .. import export
from ..data.vocab import DraftVocab
from ..losses import chained_acceptance, combine_terms, sample_draft, smooth_l1_feature_loss
from ..decode.proposal import check_batch
from ..verify import SamplingParams
from .base import Drafter, DrafterConfig, full_vocab_drafter
from ..decode.proposal import Proposal
from .checkpoint import TargetMeta
from .registry import register
from .serving_format import ServingFormat
from .layers import (
    DecoderLayer,
    KVCache,
    RaggedKV,
    Rotary,
    cached_attend,
    causal_mask_with_cache,
    layer_config,
    shift_left,
    ttt_attention,
)

# EAGLE's AddUniformNoise (eagle/train/main.py): noise = (U[0,1) - 0.5) * std * 512 / seq_len
NOISE_REFERENCE_LENGTH = 512


class EagleConfig(DrafterConfig):
    """``drafter:`` section of an EAGLE-1 recipe."""

    algorithm: Literal["eagle"] = "eagle"
    num_layers: int = Field(default=1, ge=1, le=8, description="decoder layers in the drafter (EAGLE-1: 1)")
    w_feat: float = Field(default=1.0, ge=0.0, description="weight of the smooth-L1 feature loss (EAGLE v_w)")
    w_tok: float = Field(default=0.1, ge=0.0, description="weight of the soft-CE token loss (EAGLE p_w)")
    noise: float = Field(default=0.2, ge=0.0, description="uniform noise amplitude on the input features "
                         "(training only; scaled by 512/seq_len as EAGLE does); 0 disables it")
    fc_bias: bool = Field(default=True, description="bias on fc (EAGLE-1: true; vLLM's V1 EagleLlamaForCausalLM "
                          "builds fc without bias: set false to serve there)")
    sim_steps: int = Field(default=3, ge=1, le=8, description="draft steps simulated (no grad) for the "
                           "full_acc_j / sim_tau metrics; step j>0 feeds back the drafter's own feature and argmax")
    intermediate_size: int | None = Field(default=None, gt=0, description="MLP width; default: the target's")
    num_speculative_tokens: int = Field(default=4, ge=1, le=64, description="K written to the vLLM config")

    full_vocab_only: ClassVar[str] = "EAGLE-1 drafts through the target's own lm_head over the full vocabulary"


@dataclass
class EagleState:
    """Per-request inference state: drafter KV cache, newest predicted feature and its logits."""

    cache: KVCache
    num_positions: int          # real-feature inputs in the cache (position ids 1..n)
    last_feature: torch.Tensor  # [1, 1, H] feature f predicted by the newest real input
    last_logits: torch.Tensor   # [V] target-head logits of last_feature


class EagleFormat(ServingFormat):
    """EAGLE-1's serving format: vllm-project/speculators' ``eagle`` config over vLLM's native EAGLE-1 weight
    names (``EagleLlamaForCausalLM``); vLLM's speculators loader has no ``eagle`` entry (:attr:`vllm_note`)."""

    algorithm = "eagle"
    vllm_note = ("vLLM's speculators loader does not register `eagle`; its EAGLE-1 model "
                 "(`method: eagle`) reads EAGLE's own config and weight layout (FORMATS.md)")
    llamacpp_note = ("llama.cpp serves EAGLE-3 only: its draft-eagle3 graph takes three fused aux taps, "
                     "not EAGLE-1's last hidden state with its own fc")
    frozen_target_weights = {"embed_tokens.weight": "embed_tokens"}  # vLLM shares the target's (not in final/)

    def config(self, drafter: EagleDrafter) -> dict[str, Any]:
        """Speculators-style ``eagle`` config (keys of vllm-project/speculators' EagleSpeculatorConfig).

        Weights (``state_dict``) use vLLM's native EAGLE-1 names: ``fc.weight [H, 2H]``
        (``fc.bias [H]`` when ``fc_bias``), ``layers.{i}.*`` (layer 0 without ``input_layernorm``),
        ``embed_tokens.weight [V, H]`` (vLLM skips it and shares the target's); no lm_head, no norm.
        """
        m, cfg = drafter.meta, drafter.cfg
        return {
            "architectures": ["EagleSpeculator", "LlamaDecoderLayer"],
            "speculators_model_type": "eagle",
            "speculators_config": export.speculators_config(drafter.algorithm, cfg.num_speculative_tokens,
                                                            m.name_or_path, m.architectures),
            "transformer_layer_architecture": "LlamaDecoderLayer",
            "transformer_layer_config": export.transformer_layer_config(drafter.layer_cfg),
            "layernorms": False,
            "fusion_bias": cfg.fc_bias,
            "tie_word_embeddings": False,
            "torch_dtype": "float32",
        }


@register
class EagleDrafter(Drafter):
    """EAGLE-1 drafter (see module docstring). Shapes: ``B`` batch, ``T`` sequence, ``H`` hidden, ``V`` vocab."""

    algorithm = "eagle"
    config_class = EagleConfig
    distills = True  # the token loss is a divergence to the target's distribution (train.loss)
    serving = EagleFormat()

    def __init__(self, cfg: EagleConfig, meta: TargetMeta):
        super().__init__(cfg, meta)
        over = {"intermediate_size": cfg.intermediate_size} if cfg.intermediate_size else {}
        self.layer_cfg = layer_config(self.meta.target_config, num_hidden_layers=cfg.num_layers, **over)
        H, V = self.layer_cfg.hidden_size, self.meta.vocab_size
        self.embed_tokens = nn.Embedding(V, H)
        self.embed_tokens.weight.requires_grad_(False)
        self.fc = nn.Linear(2 * H, H, bias=cfg.fc_bias)
        self.layers = nn.ModuleList([DecoderLayer(self.layer_cfg, input_norm=i > 0) for i in range(cfg.num_layers)])
        self.rotary = Rotary(self.layer_cfg)

    # ------------------------------------------------------------------ construction
    def output_heads(self) -> list[nn.Module]:
        """None: the features are read by the target's own ``lm_head`` (:meth:`Drafter.output_heads`)."""
        return []

    @classmethod
    def from_target(cls, cfg: EagleConfig, target, vocab: DraftVocab) -> EagleDrafter:
        """Fresh drafter: embedding copied from the target (frozen), target head attached.

        Raises:
            SpeculatorsError: ``vocab`` is a reduced draft vocabulary (EAGLE-1 uses the full one).
        """
        return full_vocab_drafter(cls, cfg, target, vocab)

    @classmethod
    def _build(cls, cfg: EagleConfig, meta: TargetMeta, weights: dict[str, torch.Tensor]) -> EagleDrafter:
        """Empty module: every size comes from ``cfg`` and ``meta`` (full target vocabulary)."""
        return cls(cfg, meta)

    # ------------------------------------------------------------------ the network
    def _run_layers(self, emb: torch.Tensor, feat: torch.Tensor, cos, sin, attend) -> torch.Tensor:
        """``emb, feat [B, T, H]`` -> predicted features ``f [B, T, H]``.

        ``attend(layer_idx, q, k, v) -> o [B, nh, T, hd]`` supplies the attention pattern.
        """
        h = self.fc(torch.cat([emb.to(feat.dtype), feat], dim=-1))
        for i, layer in enumerate(self.layers):
            residual = h
            x = layer.input_layernorm(h) if i > 0 else h
            q, k, v = layer.self_attn.qkv(x, cos, sin)
            h = residual + layer.self_attn.out(attend(i, q, k, v))
            h = h + layer.mlp(layer.post_attention_layernorm(h))
        return h

    def _unroll(self, tokens: torch.Tensor, feats: torch.Tensor, key_valid: torch.Tensor, steps: int,
                rows_fn) -> list[tuple[torch.Tensor, torch.Tensor, torch.Tensor]]:
        """Step 0 over the real features (with grad) and ``steps - 1`` greedy draft steps (no grad).

        Step j at index t has position id ``t + 1 + j``; its input is ``(f_{j-1}[t], argmax of step j-1
        at t)`` for j > 0; it attends to step-0 keys ``<= t`` and to its own chain's keys at index t
        (``ttt_attention``): exactly the drafter's KV cache when it proposes draft j at inference.

        Args:
            tokens: ``[B, T]`` step-0 tokens ``x_{t+1}``.
            feats: ``[B, T, H]`` step-0 features ``h_top[t]`` (possibly noised).
            key_valid: ``[B, T]`` bool, False on padding.
            rows_fn: ``rows_fn(j, prev_rows, prev_pred) -> [B, T] bool``: indices whose logits step j
                computes (``prev_*`` are None for j = 0; ``prev_pred [n_prev]`` target ids).
        Returns:
            per step ``(f_j [B, T, H], rows_j [B, T] bool, logits_j [rows_j.sum(), V] float32)``.
        """
        B, T = tokens.shape
        ks: list[list[torch.Tensor]] = [[] for _ in self.layers]
        vs: list[list[torch.Tensor]] = [[] for _ in self.layers]

        def attend(i, q, k, v):
            ks[i].append(k)
            vs[i].append(v)
            return ttt_attention(q, ks[i], vs[i], key_valid)

        rows = rows_fn(0, None, None)
        hidden, out = feats, []
        for j in range(steps):
            with contextlib.nullcontext() if j == 0 else torch.no_grad():
                pos = (torch.arange(T, device=tokens.device) + 1 + j).unsqueeze(0).expand(B, T)
                cos, sin = self.rotary(hidden, pos)
                hidden = self._run_layers(self.embed_tokens(tokens), hidden, cos, sin, attend)
                logits = self.frozen_target.lm_head(hidden[rows]).float()
            out.append((hidden, rows, logits))
            if j + 1 == steps:
                break
            with torch.no_grad():
                pred = logits.argmax(-1)
                next_rows = rows_fn(j + 1, rows, pred)
                tokens = torch.zeros_like(tokens)
                tokens[rows] = pred
                hidden = hidden.detach()
                rows = next_rows
        return out

    def add_noise(self, feats: torch.Tensor, attention_mask: torch.Tensor) -> torch.Tensor:
        """EAGLE's uniform feature noise (``AddUniformNoise`` in SafeAILab/EAGLE ``eagle/train/main.py``).

        ``feats + (U[0,1) - 0.5) * noise * 512 / L_b``, drawn from torch's global RNG in float32,
        where ``L_b`` is example b's own (unpadded) length, as EAGLE applies it per example before
        padding: amplitude ``noise`` at 512 tokens, larger on shorter sequences.
        Args: ``feats [B, T, H]``, ``attention_mask [B, T]`` bool. Returns ``[B, T, H]``.
        """
        a = self.cfg.noise
        if a == 0:
            return feats
        L = attention_mask.sum(1).clamp(min=1).to(torch.float32)
        scale = (a * NOISE_REFERENCE_LENGTH / L).view(-1, 1, 1)
        u = torch.rand(feats.shape, device=feats.device, dtype=torch.float32)
        return feats + ((u - 0.5) * scale).to(feats.dtype)

    # ------------------------------------------------------------------ training
    def _valid_masks(self, batch) -> list[torch.Tensor]:
        """``[B, T]`` bool per simulated step j: ``x_{t+2+j}`` is a real assistant token (step 0's mask is
        the loss's; used by :meth:`loss` and :meth:`loss_counts`)."""
        lm = batch.loss_mask & batch.attention_mask
        return [shift_left(lm, 2 + j) for j in range(self.cfg.sim_steps)]

    def loss_counts(self, batch) -> torch.Tensor:
        """``[1]`` int64: the valid positions shared by the feature and token terms (see
        :meth:`Drafter.loss_counts`)."""
        return self._valid_masks(batch)[0].sum().view(1)

    def loss(self, batch, norm: torch.Tensor | None = None) -> tuple[torch.Tensor, dict[str, float]]:
        """``w_feat * SmoothL1(f[t+1], h_top[t+1]) + w_tok * softCE(lm_head(f[t+1]), p_{t+1})``.

        Index t (input ``(h_top[t], x_{t+1})``) is valid when ``x_{t+2}`` is an assistant token inside
        the sequence. SmoothL1 (beta 1) is averaged over the H features of a position, as EAGLE does;
        both terms are summed over valid positions and divided by ``norm[0]`` (default: their number;
        see :meth:`Drafter.loss`). Input features are noised in training mode only
        (:meth:`add_noise`); the targets are always clean. Metrics ``loss_feat``/``loss_tok`` are this
        batch's means.

        Returns:
            loss (scalar) and metrics ``loss_feat, loss_tok, full_acc_j, cond_acc_j`` (j < sim_steps)
            and ``sim_tau = 1 + sum_j full_acc_j`` (:func:`speculators.losses.chained_acceptance`).
            Step j's draft at t is correct when it equals the target's greedy token at ``t + 1 + j``
            and labelled when ``x_{t+2+j}`` is an assistant token; step j > 0 replays inference (own
            feature and argmax fed back) and runs only at indices whose chain is still accepted and
            labelled (the only ones the metric can count).
        """
        cfg: EagleConfig = self.cfg
        w = self.frozen_target.head_weight
        if w is None:
            raise RuntimeError("attach_target(target) before training: the target's head is missing")
        valid = self._valid_masks(batch)
        goal = [shift_left(batch.argmax, 1 + j) for j in range(cfg.sim_steps)]
        feats = batch.top
        if self.training:
            feats = self.add_noise(feats, batch.attention_mask)
        corrects: list[torch.Tensor] = []  # per step: correct where the step computed logits, else False

        def rows_fn(j, prev_rows, prev_pred):
            if j == 0:
                return valid[0]
            correct = torch.zeros_like(prev_rows)
            correct[prev_rows] = prev_pred == goal[j - 1][prev_rows]
            corrects.append(correct)
            # step j only runs where the chain is still accepted and labelled: no other index can count
            return correct & valid[j] if j < len(valid) else None

        steps = self._unroll(shift_left(batch.input_ids, 1), feats, shift_left(batch.attention_mask, 1),
                             cfg.sim_steps, rows_fn)
        f0, rows0, logits0 = steps[0]
        counts = valid[0].sum().view(1)
        n_valid = counts[0].clamp(min=1)
        with torch.no_grad():
            target_feat = shift_left(batch.top, 1)[rows0]
            teacher_p = torch.softmax(self.frozen_target.teacher_logits(target_feat).float(), dim=-1)
        sum_feat = smooth_l1_feature_loss(f0[rows0], target_feat, beta=1.0)
        sum_tok = self.distill_loss.sum(logits0, teacher_p)
        loss_feat, loss_tok = sum_feat.detach() / n_valid, sum_tok.detach() / n_valid
        # one count for both terms: (w_feat * S_feat + w_tok * S_tok) / norm[0]
        total, self.last_own_loss = combine_terms([cfg.w_feat * sum_feat + cfg.w_tok * sum_tok], [1.0],
                                                  counts, norm, where=self.algorithm)
        with torch.no_grad():  # the last step's correctness (earlier ones were recorded by rows_fn)
            _, rows, logits = steps[-1]
            rows_fn(cfg.sim_steps, rows, logits.argmax(-1))
        metrics = chained_acceptance(corrects, valid)
        metrics["loss_feat"] = float(loss_feat.detach())
        metrics["loss_tok"] = float(loss_tok.detach())
        return total, metrics

    # ------------------------------------------------------------------ inference
    def _forward_cached(self, cache: KVCache, emb, feat, start_pos: int):
        m = emb.shape[1]
        pos = torch.arange(start_pos, start_pos + m, device=emb.device).unsqueeze(0)
        cos, sin = self.rotary(feat, pos)
        mask = causal_mask_with_cache(m, cache.length, device=emb.device)
        h = self._run_layers(emb, feat, cos, sin, lambda i, q, k, v: cached_attend(cache, i, q, k, v, mask))
        last = h[:, -1:]
        return last, self.frozen_target.lm_head(last).float()[0, 0]

    @torch.no_grad()
    def start(self, input_ids: torch.Tensor, features) -> EagleState:
        """``input_ids [n+1]`` (prompt + first target token), features of positions ``0..n-1``."""
        state = EagleState(KVCache(), 0, None, None)
        self._advance_one(state, input_ids.reshape(-1)[1:], features)
        return state

    @torch.no_grad()
    def _advance_one(self, state: EagleState, new_ids: torch.Tensor, features) -> None:
        """Append inputs ``(h_top[t], x_{t+1})`` for the ``m`` newly verified positions (real features)."""
        dt = self.fc.weight.dtype
        top = features.top.reshape(1, -1, features.top.shape[-1]).to(device=self.fc.weight.device, dtype=dt)
        ids = new_ids.reshape(1, -1).to(self.fc.weight.device)
        state.cache.crop(state.num_positions)  # drop the chain entries of the last proposal
        f, logits = self._forward_cached(state.cache, self.embed_tokens(ids), top,
                                         start_pos=state.num_positions + 1)
        state.num_positions += ids.shape[1]
        state.last_feature, state.last_logits = f, logits

    @torch.no_grad()
    def _propose_one(self, state: EagleState, k: int, sampling: SamplingParams | None = None,
                     generator: torch.Generator | None = None) -> Proposal:
        """Autoregressive chain of ``k`` drafts; draft i > 0 feeds back ``(f, d_{i-1})``.

        Each draft comes from :func:`speculators.losses.sample_draft` on the target-head logits under
        ``sampling`` (the request's :class:`speculators.verify.SamplingParams`, batch of one; ``None``
        = greedy): greedy gives the argmax and ``probs=None``; otherwise the draft is drawn under the
        same temperature/top-k/top-p as the target, with ``generator`` (default: the request's own),
        and the ``[k, V]`` float32 distributions are returned for the verifier. The KV cache is
        rolled back.

        Raises:
            SpeculatorsError: ``sampling`` is not one request's valid ``SamplingParams``.
        """
        feat, logits = state.last_feature, state.last_logits
        toks, probs = [], []
        for i in range(k):
            ids, q = sample_draft(logits, sampling, generator)
            d = int(ids[0])
            if q is not None:
                probs.append(q[0])
            toks.append(d)
            if i + 1 < k:
                emb = self.embed_tokens(torch.tensor([[d]], device=self.fc.weight.device))
                feat, logits = self._forward_cached(state.cache, emb, feat, start_pos=state.num_positions + 1 + i)
        state.cache.crop(state.num_positions)
        return Proposal(torch.tensor(toks, dtype=torch.int64), torch.stack(probs) if probs else None)

    # ------------------------------------------------------------------ draft trees
    drafts_trees = True  # declared capability: propose_tree (EAGLE-2 dynamic trees, vLLM static trees)

    @torch.no_grad()
    def propose_tree(self, states: list[EagleState], spec, depth_caps: list[int], sampling=None,
                     generators=None) -> list:
        """Draft trees for B requests (:func:`speculators.drafters.tree_drafting.expand_tree`: EAGLE-2's
        dynamic expansion, Li et al. arXiv 2406.16858, or a static vLLM ``speculative_token_tree``), batched
        over the requests; their states are left unchanged.

        Each level is ONE drafter forward over every request's frontier nodes: a node's input is
        ``(embed(its token), its parent's predicted feature)`` (the root's: ``last_feature``) at position id
        ``num_positions + depth``, exactly the chain's draft step at that depth (:meth:`_propose_one`); its
        keys go to the appended region of a padded :class:`~.layers.RaggedKV` gathered from the requests'
        caches and its query sees the request's cached keys and its ancestors' appended keys only (the tree
        mask). Its children are the top-k of the target head's logits on its predicted feature (full
        vocabulary, point masses for the verifier), so ``sampling`` / ``generators`` are not drawn from.

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
        from .tree_drafting import expand_tree, level_inputs, level_mask, tree_extra_slots

        check_batch(states, depth_caps, sampling, generators, who="propose_tree", ks_name="depth_caps")
        if not states:
            return []
        dev, dt = self.fc.weight.device, self.fc.weight.dtype
        root_logits = torch.stack([s.last_logits.to(dev) for s in states])  # [R, V]
        root_feat = torch.cat([s.last_feature.to(device=dev, dtype=dt) for s in states])  # [R, 1, H]
        extra = tree_extra_slots(spec, depth_caps)
        attn = self.layers[0].self_attn
        kv = RaggedKV.gather([s.cache for s in states], [s.num_positions for s in states], extra,
                             num_layers=len(self.layers), num_kv_heads=attn.num_kv, head_dim=attn.head_dim,
                             dtype=dt, device=dev) if extra else None
        feats: list[torch.Tensor] = []  # per run node, [R, H] its predicted feature

        def forward(tokens, parents, visible, depth):
            R, F = tokens.shape
            n_run = visible.shape[2] - F
            feat = level_inputs(root_feat, feats, parents)
            cos, sin = self.rotary(feat, (kv.lengths[:, None] + depth).expand(R, F))
            mask = level_mask(kv, visible)  # [R, 1, F, S]: own cache + ancestors + itself
            f = self._run_layers(self.embed_tokens(tokens.to(dev)), feat, cos, sin,
                                 lambda i, q, k, v: kv.attend(i, q, k, v, n_run, mask))
            feats.extend(f.unbind(1))
            return self.frozen_target.lm_head(f).float()

        return expand_tree(root_logits, forward, spec, None, [int(c) for c in depth_caps])
