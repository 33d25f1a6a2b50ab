"""Joint training: fine-tune the target with LoRA together with the drafter (the ``drafter:`` keys).

Two published recipes train the target and the draft heads in one loss:

* Medusa-2 (Cai et al., arXiv 2401.10774, section 2.3.2): ``L = L_LM + w * sum_k lambda^(k-1) CE_k`` with the
  backbone fine-tuned (LoRA/QLoRA in the paper's code) and a larger learning rate for the heads;
* DeepSeek-V3 MTP (arXiv 2412.19437, section 2.2): ``L = L_Main + lambda * L_MTP`` with lambda 0.3.

Both are the same mechanism seen from the trainer: the target's forward runs *inside* the training
step (with gradients through LoRA adapters), its top hidden state and greedy tokens replace the cached
ones in the batch, and an LM loss on the assistant tokens is added. A family opts in by mixing
:class:`JointConfig` into its config (``drafter.joint`` / ``drafter.joint_target``) and may weight its
own loss (``Drafter.joint_loss_weight``). The pieces live where they belong:

* the target side (:class:`speculators.target.Target`): ``adapt_lora`` (called by the train workflow
  when the run builds the target), ``lora_parameters``, ``train_forward``, ``save_adapter`` /
  ``load_adapter`` and ``merge_adapter``;
* the trainer side (:class:`speculators.train.unit.TrainingUnit`): the joint loss
  ``lm_weight * L_LM + joint_loss_weight * drafter.loss(batch')``, the two learning rates, saving the
  adapter with the drafter, and the target's held-out perplexity in the logs and the model card.

Checkpoint. The LoRA adapter is written beside the drafter as ``target_adapter/`` (peft's
``adapter_config.json`` + ``adapter_model.safetensors``). ``speculators eval`` loads the base target named
by the checkpoint, merges the adapter into it (``Target.merge_adapter``) and verifies against the merged,
fine-tuned target: the drafter is only valid with that target. To serve it, merge the adapter into the
base model (same call) and point vLLM at the merged model.
"""

from __future__ import annotations

from pydantic import BaseModel, ConfigDict, Field, field_validator, model_validator


LLAMA_LORA_MODULES = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]
# shared with the drafters (frozen copies / the frozen head they draft through): never adapted
FROZEN_MODULES = {"lm_head", "embed_tokens", "norm"}


class JointTargetConfig(BaseModel):
    """``drafter.joint_target``: how the target is fine-tuned when ``drafter.joint: true``.

    Keys:
        lora_r, lora_alpha, lora_dropout: LoRA rank, scale numerator (scale = alpha / r) and dropout.
        lora_modules: names of the target's linear layers that get adapters; None (the default) = every
            plain ``nn.Linear`` of the decoder stack of whatever architecture the target is (for Llama the seven projections of :data:`LLAMA_LORA_MODULES`, for GPT-NeoX
            ``query_key_value`` / ``dense*``, for DeepSeek-V3's MLA its ``q_a_proj`` / ``kv_b_proj`` / ...).
            The embedding, final norm and lm_head stay frozen, so drafters that share them stay exact.
        lr: learning rate of the LoRA parameters; ``None`` = ``0.1 * train.lr`` (the drafter's own
            parameters use ``train.lr``: Medusa-2 trains its heads faster than the backbone).
        lm_weight: weight of the target's LM loss (cross entropy of the next assistant token).
    """

    model_config = ConfigDict(extra="forbid")

    lora_r: int = Field(default=16, ge=1, le=1024, description="LoRA rank r")
    lora_alpha: float = Field(default=32.0, gt=0.0, description="LoRA alpha (scale = alpha / r)")
    lora_dropout: float = Field(default=0.0, ge=0.0, lt=1.0, description="LoRA dropout")
    lora_modules: list[str] | None = Field(
        default=None, min_length=1, description="target modules that get LoRA adapters (not the ones the drafter "
        "shares frozen: `lm_head`, `embed_tokens`, `norm`); null = every plain linear layer of the decoder stack, "
        "whatever the architecture")
    lr: float | None = Field(default=None, gt=0.0, description="learning rate of the adapters; null = 0.1 x "
                             "`train.lr` (the drafter's own parameters use `train.lr`)")
    lm_weight: float = Field(default=1.0, ge=0.0, description="weight of the target's LM loss (cross entropy of the "
                                                              "next assistant token)")

    @field_validator("lora_modules")
    @classmethod
    def _not_shared(cls, v: list[str] | None) -> list[str] | None:
        bad = sorted(set(v or ()) & FROZEN_MODULES)
        if bad:
            raise ValueError(f"{bad} cannot be adapted: the drafter shares these target modules frozen "
                             f"(choose among the attention/MLP projections, e.g. {LLAMA_LORA_MODULES})")
        return v


class JointConfig(BaseModel):
    """Mixin for the ``drafter:`` config of a family that supports joint training."""

    joint: bool = Field(default=False, description="also fine-tune the target with LoRA (joint loss)")
    joint_target: JointTargetConfig = Field(default_factory=JointTargetConfig,
                                            description="LoRA settings of joint training")

    @model_validator(mode="after")
    def _joint_keys_need_joint(self):
        # a non-default joint_target without joint is a mistake; the default (written by every dump) is not, nor
        # the default of checkpoints written before lora_modules defaulted to every decoder linear (the Llama list)
        jt = self.joint_target
        if jt.lora_modules == LLAMA_LORA_MODULES:
            jt = jt.model_copy(update={"lora_modules": None})
        if not self.joint and jt != JointTargetConfig():
            raise ValueError("drafter.joint_target is only read with drafter.joint: true")
        return self
