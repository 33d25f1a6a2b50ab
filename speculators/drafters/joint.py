"""Joint training: fine-tune the target with LoRA together with the drafter.

Two published recipes train the target and the draft heads in one loss:

* Medusa-2 (Cai et al., arXiv 2401.10774, section 2.3.2): ``L = L_LM + w * sum_k lambda^(k-1) CE_k`` with the
  backbone fine-tuned (LoRA/QLoRA in the paper's code) and a larger learning rate for the heads;
* DeepSeek-V3 MTP (arXiv 2412.19437, section 2.2): ``L = L_Main + lambda * L_MTP`` with lambda 0.3.

Both are the same mechanism seen from the trainer: the target's forward runs *inside* the training
step (with gradients through LoRA adapters, peft), its top hidden state replaces the cached one in the
batch, and an LM loss on the assistant tokens is added. A family opts in with the ``joint`` and
``joint_target`` keys of :class:`JointConfig`; everything else lives in :class:`~.base.Drafter`
(``training_loss``, ``param_groups``, adapter save/load and :meth:`~.base.Drafter.prepare_target`),
so the trainer and ``speculators eval`` never look at the family.

Checkpoint. The LoRA adapter is written beside the drafter as ``target_adapter/`` (peft's
``adapter_config.json`` + ``adapter_model.safetensors``). ``speculators eval`` loads the base target named
by the checkpoint, merges the adapter into it (``merge_and_unload``) and verifies against the merged,
fine-tuned target: the drafter is only valid with that target. To serve it, merge the adapter into the
base model (same call) and point vLLM at the merged model.
"""

from __future__ import annotations

import dataclasses
from pathlib import Path

import torch
import torch.nn.functional as F
from pydantic import BaseModel, ConfigDict, Field, field_validator, model_validator
from torch import nn

from ..errors import SpeculatorsError
from .layers import shift_left

ADAPTER_DIR = "target_adapter"
ADAPTER_WEIGHTS = "adapter_model.safetensors"
LLAMA_LORA_MODULES = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]
# shared with the drafters (frozen copies / the frozen head they draft through): never adapted
FROZEN_MODULES = {"lm_head", "embed_tokens", "norm"}


class JointTargetConfig(BaseModel):
    """``drafter.joint_target``: how the target is fine-tuned when ``drafter.joint: true``.

    Keys:
        lora_r, lora_alpha, lora_dropout: LoRA rank, scale numerator (scale = alpha / r) and dropout.
        lora_modules: names of the target's linear layers that get adapters (Llama names by default;
            the embedding, final norm and lm_head stay frozen, so drafters that share them stay exact).
        lr: learning rate of the LoRA parameters; ``None`` = ``0.1 * train.lr`` (the drafter's own
            parameters use ``train.lr``: Medusa-2 trains its heads faster than the backbone).
        lm_weight: weight of the target's LM loss (cross entropy of the next assistant token).
    """

    model_config = ConfigDict(extra="forbid")

    lora_r: int = Field(default=16, ge=1, le=1024)
    lora_alpha: float = Field(default=32.0, gt=0.0)
    lora_dropout: float = Field(default=0.0, ge=0.0, lt=1.0)
    lora_modules: list[str] = Field(default_factory=lambda: list(LLAMA_LORA_MODULES), min_length=1)
    lr: float | None = Field(default=None, gt=0.0)
    lm_weight: float = Field(default=1.0, ge=0.0)

    @field_validator("lora_modules")
    @classmethod
    def _not_shared(cls, v: list[str]) -> list[str]:
        bad = sorted(set(v) & FROZEN_MODULES)
        if bad:
            raise ValueError(f"{bad} cannot be adapted: the drafter shares these target modules frozen "
                             f"(choose among the attention/MLP projections, e.g. {LLAMA_LORA_MODULES})")
        return v


class JointConfig(BaseModel):
    """Mixin for the ``drafter:`` config of a family that supports joint training."""

    joint: bool = Field(default=False, description="also fine-tune the target with LoRA (joint loss)")
    joint_target: JointTargetConfig = Field(default_factory=JointTargetConfig)

    @model_validator(mode="after")
    def _joint_keys_need_joint(self):
        # a non-default joint_target without joint is a mistake; the default (written by every dump) is not
        if not self.joint and self.joint_target != JointTargetConfig():
            raise ValueError("drafter.joint_target is only read with drafter.joint: true")
        return self


class JointTarget(nn.Module):
    """The target's causal LM with LoRA adapters, run inside the training step.

    Args:
        target: the :class:`speculators.target.Target`. LoRA layers are injected IN PLACE into
            ``target.model`` by peft; they start as the identity (B = 0), so before the first update
            the forward equals the frozen target's.
        cfg: :class:`JointTargetConfig`.
    Raises:
        SpeculatorsError: a name of ``cfg.lora_modules`` does not exist in the model, or peft cannot
            adapt it.
    """

    def __init__(self, target, cfg: JointTargetConfig):
        super().__init__()
        from peft import LoraConfig, get_peft_model

        self.cfg = cfg
        object.__setattr__(self, "_target", target)  # not a submodule: self.peft holds the weights
        model = target.model
        names = {n.rsplit(".", 1)[-1] for n, _ in model.named_modules()}
        missing = [m for m in cfg.lora_modules if m not in names]
        if missing:
            raise SpeculatorsError(f"drafter.joint_target.lora_modules: {missing} not found in the target "
                                   f"(it has e.g. {sorted(n for n in names if n.endswith('proj'))[:8]})")
        lcfg = LoraConfig(r=cfg.lora_r, lora_alpha=cfg.lora_alpha, lora_dropout=cfg.lora_dropout,
                          target_modules=list(cfg.lora_modules), bias="none")
        try:
            self.peft = get_peft_model(model, lcfg)
        except (ValueError, TypeError) as e:
            raise SpeculatorsError(f"drafter.joint_target.lora_modules: peft cannot adapt "
                                   f"{cfg.lora_modules}: {e}") from None

    def lora_parameters(self) -> list[nn.Parameter]:
        return [p for p in self.peft.parameters() if p.requires_grad]

    @staticmethod
    def label_positions(batch) -> torch.Tensor:
        """``[B, T]`` bool: index ``t`` whose next token ``x_{t+1}`` is a real assistant token (the LM
        loss's positions; the same mask for the loss and :meth:`lm_count`)."""
        return shift_left(batch.loss_mask & batch.attention_mask, 1)

    def lm_count(self, batch) -> torch.Tensor:
        """Scalar int64: the number of LM-loss labels in ``batch`` (masks only, no forward)."""
        return self.label_positions(batch).sum()

    def forward(self, batch, norm: torch.Tensor | int | None = None):
        """Run the (adapted) target on ``batch.input_ids``.

        Args:
            batch: :class:`speculators.data.dataset.Batch`; only ``input_ids``, ``attention_mask`` and
                ``loss_mask`` are read.
            norm: divisor of the summed LM loss (the label count of a whole accumulation window, see
                ``Drafter.training_loss_counts``); ``None`` = this batch's own label count.
        Returns:
            ``(batch', lm_loss, metrics)``: ``batch'`` is ``batch`` with ``top [B, T, H]`` (float32,
            with gradients) and ``argmax [B, T]`` replaced by the live target's; ``lm_loss`` is the summed
            cross entropy of the target's logits at ``t`` against ``x_{t+1}`` over the assistant tokens
            ``x_{t+1}``, divided by ``norm`` (default: their count, i.e. the mean); metrics ``lm_loss``
            (this batch's mean), ``lm_nll_sum`` and ``lm_tokens`` (summed NLL and token count: a
            held-out perplexity is ``exp(sum nll / sum tokens)`` over all batches).
        """
        target = self._target
        att = batch.attention_mask
        top = target.top_hidden(batch.input_ids, att)  # [B, T, H] after the final norm, with gradients
        argmax = torch.zeros_like(batch.input_ids)
        with torch.no_grad():  # the greedy token at every real position (metrics), no graph
            argmax[att] = target.lm_head(top.detach()[att]).argmax(-1)
        label_pos = self.label_positions(batch)  # [B, T]: x_{t+1} is an assistant token
        labels = shift_left(batch.input_ids, 1)[label_pos]
        if labels.numel():
            nll = F.cross_entropy(target.lm_head(top[label_pos]).float(), labels, reduction="sum")
        else:
            nll = top.sum() * 0.0
        n = max(int(labels.numel()), 1)
        den = n if norm is None else max(float(norm), 1.0)
        lm_loss = nll / den
        new = dataclasses.replace(batch, top=top.float(), argmax=argmax)
        return new, lm_loss, {"lm_loss": float(nll.detach()) / n, "lm_nll_sum": float(nll.detach()),
                              "lm_tokens": float(labels.numel())}

    def save_adapter(self, directory: Path) -> None:
        """Write peft's ``adapter_config.json`` + ``adapter_model.safetensors`` into ``directory``."""
        self.peft.save_pretrained(str(directory))

    def load_adapter(self, directory: Path) -> None:
        """Load adapter weights written by :meth:`save_adapter` (resume).

        Raises:
            SpeculatorsError: the adapter file is missing, or holds a NaN/inf.
        """
        from peft import set_peft_model_state_dict
        from safetensors.torch import load_file

        f = Path(directory) / ADAPTER_WEIGHTS
        if not f.is_file():
            raise SpeculatorsError(f"{f}: missing; the checkpoint has no target adapter to resume from")
        from .checkpoint import check_finite_weights

        weights = load_file(str(f))
        check_finite_weights(weights, f)
        result = set_peft_model_state_dict(self.peft, weights)
        unexpected = list(getattr(result, "unexpected_keys", []) or [])
        if unexpected:
            raise SpeculatorsError(f"{f}: adapter weights do not match this run's LoRA config "
                                   f"(unexpected {unexpected[:3]})")


def merge_adapter(target, directory: Path) -> None:
    """Merge a LoRA adapter written by a joint run into ``target`` (a :class:`speculators.target.Target`),
    in place: ``target.model`` becomes the fine-tuned model (frozen, eval mode) and its fingerprint is
    recomputed.

    Raises:
        SpeculatorsError: the adapter cannot be read or does not fit the target.
    """
    from peft import PeftModel

    try:
        merged = PeftModel.from_pretrained(target.model, str(directory)).merge_and_unload()
    except Exception as e:  # noqa: BLE001 - peft raises several types for a bad adapter
        raise SpeculatorsError(f"{directory}: cannot apply the target adapter ({type(e).__name__}: {e})") from None
    merged.eval()
    for p in merged.parameters():
        p.requires_grad_(False)
    target.model = merged
    target._fingerprint = None
