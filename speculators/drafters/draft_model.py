"""Distilled draft model: a small independent causal LM of the target's architecture and vocabulary (Leviathan
et al., "Fast Inference from Transformers via Speculative Decoding", arXiv 2211.17192; distillation as
DistillSpec, Zhou et al., arXiv 2310.08461; vLLM ``method: draft_model``; llama.cpp ``--spec-type draft-simple``
with ``-md draft.gguf``).

It reads no target features at all: it drafts from the token ids alone with its own KV cache, which is why
a closed serving stack, a CPU, or llama.cpp can run it today.

Model (:mod:`speculators.target.small_lm`): the target's own ``*ForCausalLM`` class built from the target's
config with ``num_layers`` decoder layers. ``init: target`` (default) copies the target's embedding, final norm,
output head and decoder layers ``init_layers`` (default the first ``num_layers``: LayerSkip's early exit) into
it; ``init: random`` starts from transformers' initialisation. ``train_embeddings: false`` (default) keeps the
embedding and the head (tied or not) frozen at their initial values: on a data budget they are the largest
and best-initialised tensors.

Loss (knowledge distillation on the target's own responses): at every position ``t`` whose next token
``x_{t+1}`` is an assistant token, the draft model's next-token distribution ``q_t`` is pulled towards the
target's ``p_t = softmax(target head(h_top[t]))`` (the teacher, logit rule included) by ``train.loss``
(:class:`speculators.divergences.LossMix`): forward KL by default, or total variation (exactly one minus the
chance that a draft sampled from q is accepted against p at temperature 1: DistillSpec's case for it), reverse KL,
JSD, the LK losses, hard CE to the target's top token, or a weighted mix, averaged over the valid positions.
Metrics: ``accept_t1 = 1 - TV`` (mean), and ``full_acc_j`` / ``sim_tau`` of the teacher-forced greedy chain of
``num_speculative_tokens`` drafts (draft j at chain start t is the top-1 at ``t + j`` against the target's
greedy token there).

Inference. The state is the model's KV cache over ``x_0..x_n`` (every verified token) and its logits at
``x_n``; ``propose`` drafts token by token (each draft fed back through the cache, drawn with the request's
sampling settings as vLLM's draft model draws them) and crops the cache back, ``advance`` feeds the verified
tokens. Trees: level by level through the same cache with a tree mask
(:func:`speculators.drafters.tree_drafting.expand_tree`), cropped back after.

Export: the model as ``save_pretrained`` writes it (``config.json`` of the architecture, ``model.safetensors``
under transformers' names, the target's tokenizer files): ``AutoModelForCausalLM.from_pretrained`` loads it,
vLLM serves it as ``draft_model``, llama.cpp's ``convert_hf_to_gguf.py`` converts it as any model of that
architecture (FORMATS.md, "draft_model").
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any, ClassVar, Literal

import torch
from torch import nn
from pydantic import Field, model_validator

from ..data.vocab import DraftVocab
from ..decode.proposal import Proposal, check_batch
from ..errors import SpeculatorsError
from ..divergences import masked_sum, per_position
from ..losses import chained_acceptance, combine_terms, sample_draft
from ..target.small_lm import (SmallLMDecoder, build_small_lm, checkpoint_state_dict, layer_skip_init,
                               load_checkpoint_state_dict)
from ..verify import SamplingParams
from .base import Drafter, DrafterConfig
from .checkpoint import TRAINING_KEY, TargetMeta
from .registry import register
from .serving_format import ServingFormat

class DraftModelConfig(DrafterConfig):
    """``drafter:`` section of a draft-model recipe."""

    algorithm: Literal["draft_model"] = "draft_model"
    num_layers: int | None = Field(default=None, ge=1, description="decoder layers of the draft model (the target's "
                                   "architecture and widths); null = an eighth of the target's, rounded up")
    init: Literal["target", "random"] = Field(default="target", description="target: copy the target's embedding, "
                                              "final norm, head and layers `init_layers` (layer-skip); random: "
                                              "transformers' initialisation")
    init_layers: list[int] | None = Field(default=None, description="0-based target layers copied into the draft "
                                          "model's layers (init: target); null = the first num_layers")
    train_embeddings: bool = Field(default=False, description="also train the embedding and output head (frozen at "
                                                              "their initial values by default)")
    num_speculative_tokens: int = Field(default=4, ge=1, le=64, description="K the serving commands of the card "
                                        "use and the depth of the training metric sim_tau (any K can be drafted)")

    full_vocab_only: ClassVar[str] = ("a draft model has the target's full vocabulary (vLLM and llama.cpp "
                                      "require it)")

    @model_validator(mode="after")
    def _layers(self):
        if self.init_layers is not None:
            if self.init == "random":
                raise ValueError("drafter.init_layers: only with init: target (random init copies no layers)")
            if not self.init_layers or min(self.init_layers) < 0 or (
                    self.num_layers is not None and len(self.init_layers) != self.num_layers):
                raise ValueError(f"drafter.init_layers: {self.init_layers} must be num_layers ({self.num_layers}) "
                                 f"0-based target layer ids")
        return self

    def layers_for(self, target_layers: int) -> int:
        """The draft model's decoder layers for a target of ``target_layers`` layers: ``num_layers``, else as many
        as ``init_layers`` names, else ``ceil(target_layers / 8)``."""
        if self.num_layers is not None:
            return self.num_layers
        return len(self.init_layers) if self.init_layers else max(1, -(-int(target_layers) // 8))


@dataclass
class DraftLMState:
    """Per-request state: the KV ``cache`` over the ``length`` verified tokens ``x_0..x_n`` and the draft model's
    next-token ``logits [V]`` float32 at ``x_n``."""

    cache: Any
    length: int
    logits: torch.Tensor


class DraftModelFormat(ServingFormat):
    """A plain transformers checkpoint of the draft model (``save_pretrained``'s layout) plus the tokenizer."""

    algorithm = "draft_model"
    vllm_method = "draft_model"
    llamacpp_spec_type = "draft-simple"

    def speculative_tokens(self, config: dict[str, Any]) -> int | None:
        """K for the serving command: the recipe's ``num_speculative_tokens`` (a draft model has none of its own)."""
        return ((config.get(TRAINING_KEY) or {}).get("drafter") or {}).get("num_speculative_tokens")

    def config(self, drafter: DraftModelDrafter) -> dict[str, Any]:
        """The model's own config (``PretrainedConfig.to_dict``), ``architectures`` its class, weights float32."""
        d = drafter.lm.config.to_dict()
        for k in ("_name_or_path", "dtype"):
            d.pop(k, None)
        d["architectures"] = [type(drafter.lm).__name__]
        d["torch_dtype"] = "float32"
        return d

    def state_dict(self, drafter: DraftModelDrafter) -> dict[str, torch.Tensor]:
        """transformers' checkpoint names and shapes, as ``save_pretrained`` writes them
        (:func:`~speculators.target.small_lm.checkpoint_state_dict`: ``model.layers.{i}...``, per-expert MoE
        weights, a tied head once, as the embedding)."""
        return checkpoint_state_dict(drafter.lm)

    def load_state_dict(self, drafter: DraftModelDrafter, sd: dict[str, torch.Tensor]) -> None:
        """Load :meth:`state_dict`'s names (:func:`~speculators.target.small_lm.load_checkpoint_state_dict`).

        Raises:
            SpeculatorsError: a missing or unexpected name, or a shape this config does not have.
        """
        load_checkpoint_state_dict(drafter.lm, sd)

    def write_companion_files(self, drafter: DraftModelDrafter, directory: Path) -> None:
        """The target's tokenizer files (``tokenizer.json``, ``tokenizer_config.json``, ...), which vLLM and
        llama.cpp's converter read beside the weights; nothing when the drafter has no tokenizer (a tokenizer-free
        test target)."""
        if drafter.tokenizer is not None:
            drafter.tokenizer.save_pretrained(str(directory))


@register
class DraftModelDrafter(Drafter):
    """Distilled draft model (module docstring). Shapes: ``B`` batch, ``T`` sequence, ``V`` vocabulary."""

    algorithm = "draft_model"
    config_class = DraftModelConfig
    serving = DraftModelFormat()
    distills = True  # its whole loss is a divergence to the target's distribution (train.loss)

    def __init__(self, cfg: DraftModelConfig, meta: TargetMeta):
        """An uninitialised draft model (transformers' init) of ``cfg.layers_for(target layers)`` layers, built from
        ``meta.target_config``; embedding and head frozen unless ``train_embeddings``."""
        super().__init__(cfg, meta)
        self.lm = build_small_lm(self.meta.target_config, cfg.layers_for(self.meta.target_num_layers or 1))
        self.decoder = SmallLMDecoder(self.lm)
        self.tokenizer = None  # the target's, for the export (attach_target)
        if not cfg.train_embeddings:
            for m in (self.lm.get_input_embeddings(), self.lm.get_output_embeddings()):
                m.weight.requires_grad_(False)

    # ------------------------------------------------------------------ construction
    def output_heads(self) -> list[nn.Module]:
        """The small LM's output embeddings (its ``lm_head``, tied or not) (:meth:`Drafter.output_heads`)."""
        return [self.lm.get_output_embeddings()]

    @classmethod
    def from_target(cls, cfg: DraftModelConfig, target, vocab: DraftVocab) -> DraftModelDrafter:
        """A draft model for ``target`` (initialisation: module docstring).

        Raises:
            SpeculatorsError: a reduced draft vocabulary, or ``init_layers`` (or, by default, ``num_layers``)
                beyond the target's layers, or a target whose weights do not fit its own architecture's names.
        """
        if vocab.size != target.vocab_size:
            raise SpeculatorsError(f"drafter.draft_vocab_size: a draft model has the target's full vocabulary "
                                   f"({target.vocab_size}); got a draft vocabulary of {vocab.size}")
        layers = cfg.init_layers if cfg.init_layers is not None else list(range(cfg.layers_for(target.num_layers)))
        if cfg.init == "target" and max(layers) >= target.num_layers:
            raise SpeculatorsError(f"drafter.init_layers: {layers} reaches beyond the target's {target.num_layers} "
                                   f"layers (0-based); use fewer num_layers or name the layers")
        d = cls(cfg, TargetMeta.from_target(target))
        if cfg.init == "target":
            layer_skip_init(d.lm, target, layers)
        d.attach_target(target)
        return d

    @classmethod
    def _build(cls, cfg: DraftModelConfig, meta: TargetMeta, weights: dict[str, torch.Tensor]) -> DraftModelDrafter:
        return cls(cfg, meta)

    def attach_target(self, target) -> None:
        """As :meth:`Drafter.attach_target` (the teacher's head for the loss), and keep the target's tokenizer
        for the export."""
        super().attach_target(target)
        self.tokenizer = getattr(target, "tokenizer", None)

    # ------------------------------------------------------------------ training
    def _valid(self, batch) -> torch.Tensor:
        """``[B, T-1]`` bool: position t is trained when ``x_{t+1}`` is an assistant token."""
        return (batch.loss_mask & batch.attention_mask)[:, 1:]

    def loss_counts(self, batch) -> torch.Tensor:
        """``[1]`` int64: the valid positions (:meth:`_valid`)."""
        return self._valid(batch).sum().reshape(1)

    def loss(self, batch, norm: torch.Tensor | None = None) -> tuple[torch.Tensor, dict[str, float]]:
        """The distillation loss :attr:`distill_loss` (``train.loss``; default forward KL) summed over the valid
        positions and divided by ``norm[0]`` (default: their count).

        Args:
            batch: :class:`speculators.data.dataset.Batch` (``input_ids``, ``attention_mask``, ``loss_mask``,
                ``top`` for the teacher, ``argmax``).
            norm: ``[1]`` divisor (:meth:`loss_counts` of the accumulation window).
        Returns:
            loss and metrics ``loss_<divergence>`` per term of ``train.loss``, ``accept_t1``, ``full_acc_j``,
            ``cond_acc_j``, ``sim_tau``.
        Raises:
            RuntimeError: without ``attach_target``.
        """
        cfg: DraftModelConfig = self.cfg
        valid = self._valid(batch)
        am = batch.attention_mask.to(torch.long)
        logits = self.lm(input_ids=batch.input_ids, attention_mask=am).logits[:, :-1].float()  # [B, T-1, V]
        if self.frozen_target.head_weight is None:
            raise RuntimeError("attach_target(target) first: the target's output head is missing")
        with torch.no_grad():
            teacher = torch.softmax(self.frozen_target.teacher_logits(batch.top[:, :-1]).float(), dim=-1)
        counts = valid.sum().reshape(1)
        mix = self.distill_loss
        total_sum = mix.sum(logits, teacher, valid)
        metrics = {}
        with torch.no_grad():
            n = counts[0].clamp(min=1)
            for name in mix.terms:
                metrics[f"loss_{name}"] = float(masked_sum(per_position(name, logits, teacher, valid, jsd_beta=mix.jsd_beta,
                                                                        lk_eta=mix.lk_eta), valid) / n)
            metrics["accept_t1"] = 1.0 - float(masked_sum(per_position("tv", logits, teacher, valid), valid) / n)
            correct = logits.argmax(-1) == batch.argmax[:, :-1]
            assistant = batch.loss_mask & batch.attention_mask
            D = cfg.num_speculative_tokens
            metrics.update(chained_acceptance([correct[:, j:] for j in range(D)],
                                              [assistant[:, j + 1:] for j in range(D)]))
        total, self.last_own_loss = combine_terms([total_sum], [1.0], counts, norm, where=self.algorithm)
        return total, metrics

    # ------------------------------------------------------------------ inference
    @torch.no_grad()
    def start(self, input_ids: torch.Tensor, features) -> DraftLMState:
        """``input_ids [n+1]`` (prompt + first target token) through the draft model; ``features`` unused."""
        cache = self.decoder.new_cache()
        ids = torch.as_tensor(input_ids).reshape(-1)
        if ids.numel() == 0:
            raise SpeculatorsError("draft_model: start needs at least one token")
        logits = self.decoder.forward(cache, ids)[-1]
        return DraftLMState(cache, int(ids.numel()), logits)

    @torch.no_grad()
    def _advance_one(self, state: DraftLMState, new_ids: torch.Tensor, features) -> None:
        """Feed the ``m`` verified tokens; ``features`` unused."""
        ids = torch.as_tensor(new_ids).reshape(-1)
        if ids.numel() == 0:
            return
        self.decoder.crop(state.cache, state.length)
        state.logits = self.decoder.forward(state.cache, ids)[-1]
        state.length += int(ids.numel())

    @torch.no_grad()
    def _propose_one(self, state: DraftLMState, k: int, sampling: SamplingParams | None = None,
                     generator: torch.Generator | None = None) -> Proposal:
        """``k`` drafts, each drawn (:func:`speculators.losses.sample_draft`; greedy when ``sampling`` is None) from
        the draft model's distribution and fed back; ``probs [k, V]`` float32 when sampled. The cache is cropped
        back to the verified tokens, so the state is left as found."""
        kk = max(0, int(k))
        if kk == 0:
            return Proposal(torch.empty(0, dtype=torch.int64))
        ids, probs, logits = [], [], state.logits
        try:
            for i in range(kk):
                tok, p = sample_draft(logits[None], sampling, generator)
                ids.append(tok.reshape(1).cpu())
                if p is not None:
                    probs.append(p.reshape(1, -1))
                if i + 1 < kk:
                    logits = self.decoder.forward(state.cache, tok.reshape(1))[-1]
        finally:
            self.decoder.crop(state.cache, state.length)
        return Proposal(torch.cat(ids).to(torch.int64), torch.cat(probs) if probs else None)

    drafts_trees = True  # declared capability: propose_tree (EAGLE-2 dynamic or vLLM static trees)

    @torch.no_grad()
    def propose_tree(self, states: list[DraftLMState], spec, depth_caps: list[int], sampling=None,
                     generators=None) -> list:
        """Draft trees for B requests (:func:`speculators.drafters.tree_drafting.expand_tree`): each level of
        nodes runs through the request's own cache after its verified tokens, a node at depth d at position
        ``n + d`` seeing the context, its ancestors and itself; the caches are cropped back after. Children are
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
        run_pos = [torch.empty(0, dtype=torch.int64) for _ in states]  # positions of the nodes run so far

        def forward(tokens, parents, visible, depth):
            out = []
            F = tokens.shape[1]
            for r, st in enumerate(states):
                pos = torch.full((F,), st.length - 1 + depth, dtype=torch.int64)
                vis = torch.cat([torch.ones(F, st.length, dtype=torch.bool), visible[r]], dim=1)
                k_pos = torch.cat([torch.arange(st.length), run_pos[r], pos])
                out.append(self.decoder.forward(st.cache, tokens[r], positions=pos, visible=vis, key_positions=k_pos))
                run_pos[r] = torch.cat([run_pos[r], pos])
            return torch.stack(out)

        try:
            root = torch.stack([st.logits for st in states])
            return expand_tree(root, forward, spec, None, caps)
        finally:
            for st in states:
                self.decoder.crop(st.cache, st.length)


__all__ = ["DraftLMState", "DraftModelConfig", "DraftModelDrafter", "DraftModelFormat"]
