"""LoRA adaptation of the target for joint training (peft), as torchtune decides LoRA when it builds
the model: Medusa-2 (Cai et al., arXiv 2401.10774, section 2.3.2) and DeepSeek-V3 MTP (arXiv 2412.19437,
section 2.2).

:class:`LoraTarget` holds the methods :class:`speculators.target.Target` takes from it: ``adapt_lora(cfg)``
(peft adapters injected in place, once, before the optimizer is built), ``adapted``, ``lora_module``,
``lora_parameters()``, ``lm_label_positions``, ``train_forward(...)`` (the adapted forward with
gradients: :class:`LoraForward`), ``save_adapter`` / ``load_adapter`` (a checkpoint's
``target_adapter/``, :data:`ADAPTER_WEIGHTS`) and ``merge_adapter`` (``merge_and_unload`` into a base
target for eval). They read the target's ``model``, ``device``, ``fingerprint``, ``lm_head`` and its
``_lora`` / ``_fingerprint`` fields (set by ``Target.__init__``).
"""

from __future__ import annotations

from pathlib import Path
from typing import NamedTuple

import torch

from ..errors import SpeculatorsError

ADAPTER_WEIGHTS = "adapter_model.safetensors"  # the weight file of a peft adapter directory (save_adapter)


class LoraForward(NamedTuple):
    """What :meth:`Target.train_forward` returns (the adapted target's forward, with gradients).

    Attributes:
        top: ``[B, T, H]`` final post-norm hidden states (model or autocast dtype), with gradients.
        argmax: ``[B, T]`` int64 greedy next token at every real position (0 on padding), no graph.
        lm_loss: scalar, the summed LM cross entropy over the label positions divided by ``norm``.
        nll_sum: that summed cross entropy as a float (nats).
        n_labels: the number of labels (assistant tokens ``x_{t+1}``) it was summed over.
    """

    top: torch.Tensor
    argmax: torch.Tensor
    lm_loss: torch.Tensor
    nll_sum: float
    n_labels: int


class LoraTarget:
    """The LoRA side of :class:`speculators.target.Target` (a base class of it; not used on its own)."""

    def adapt_lora(self, cfg, where: str = "drafter.joint_target") -> None:
        """Inject LoRA adapters into the target IN PLACE (peft ``get_peft_model``), to fine-tune it together
        with a drafter: Medusa-2 (Cai et al., arXiv 2401.10774, section 2.3.2) and DeepSeek-V3 MTP
        (arXiv 2412.19437, section 2.2). Done once, when the target is built for a run (as torchtune builds
        a LoRA model), before the optimizer is built.

        The adapters start as the identity (peft: ``B = 0``), so until the first update every forward equals
        the frozen target's. Only the LoRA matrices require gradients; the embedding, final norm and output
        head stay frozen (drafters share them). :attr:`fingerprint` keeps naming the BASE model (it is fixed
        before the injection): a checkpoint records the base target plus its adapter, and
        :meth:`merge_adapter` on a fresh base target gives the fine-tuned verifier.

        Args:
            cfg: the LoRA settings, read as attributes: ``lora_r`` (rank), ``lora_alpha`` (scale =
                alpha / r), ``lora_dropout`` (probability), ``lora_modules`` (names of linear layers, e.g.
                ``["q_proj", "v_proj"]``; None = the names of every plain ``nn.Linear`` of the decoder stack); e.g. a :class:`speculators.drafters.joint.JointTargetConfig`.
            where: the recipe path of ``cfg``, named in errors.
        Raises:
            SpeculatorsError: the target is already adapted; a name of ``lora_modules`` does not exist in
                the model, or peft cannot adapt it.
        """
        from peft import LoraConfig, get_peft_model

        if self._lora is not None:
            raise SpeculatorsError(f"{where}: the target already has LoRA adapters (adapt_lora is called once)")
        _ = self.fingerprint  # the base model's identity, fixed before the adapters join the state dict
        names = {n.rsplit(".", 1)[-1] for n, _m in self.model.named_modules()}
        shared = self._shared_module_names()
        modules = list(cfg.lora_modules) if cfg.lora_modules else _default_lora_modules(self.decoder, shared)
        bad = sorted(set(cfg.lora_modules or ()) & shared)
        if bad:
            raise SpeculatorsError(f"{where}.lora_modules: {bad} cannot be adapted: the drafter shares these target "
                                   f"modules frozen (the embedding, final norm and output head)")
        missing = [m for m in cfg.lora_modules or () if m not in names]
        if missing:
            raise SpeculatorsError(f"{where}.lora_modules: {missing} not found in the target "
                                   f"(it has e.g. {sorted(n for n in names if n.endswith('proj'))[:8]})")
        lcfg = LoraConfig(r=cfg.lora_r, lora_alpha=cfg.lora_alpha, lora_dropout=cfg.lora_dropout,
                          target_modules=modules, bias="none")
        try:
            self._lora = get_peft_model(self.model, lcfg)
        except (ValueError, TypeError) as e:
            raise SpeculatorsError(f"{where}.lora_modules: peft cannot adapt {modules}: {e}") from None

    def _shared_module_names(self) -> set[str]:
        """Leaf names of the modules drafters share frozen: the input embedding, output head, final norm."""
        keep = {id(m) for m in (self.model.get_input_embeddings(), self.model.get_output_embeddings(),
                                self.final_norm) if m is not None}
        return {n.rsplit(".", 1)[-1] for n, m in self.model.named_modules() if id(m) in keep and n}

    @property
    def adapted(self) -> bool:
        """True after :meth:`adapt_lora`: the target carries trainable LoRA adapters."""
        return self._lora is not None

    @property
    def lora_module(self) -> torch.nn.Module:
        """The adapted model as one ``nn.Module`` (LoRA matrices trainable, base weights frozen). A training
        unit registers it as a submodule so that ``train()``/``eval()`` (LoRA dropout), device moves and
        data-parallel wrappers reach the adapters; everything else goes through this class's methods.

        Raises:
            SpeculatorsError: the target is not adapted (:meth:`adapt_lora`).
        """
        return self._adapted("lora_module")

    def _adapted(self, what: str):
        if self._lora is None:
            raise SpeculatorsError(f"Target.{what}: the target has no LoRA adapters; call adapt_lora(cfg) first")
        return self._lora

    def lora_parameters(self) -> list[torch.nn.Parameter]:
        """The trainable LoRA parameters (peft's ``lora_A`` / ``lora_B`` matrices), in module order.

        Raises:
            SpeculatorsError: the target is not adapted.
        """
        return [p for p in self._adapted("lora_parameters").parameters() if p.requires_grad]

    @staticmethod
    def lm_label_positions(attention_mask: torch.Tensor, loss_mask: torch.Tensor) -> torch.Tensor:
        """``[B, T]`` bool: positions ``t`` whose next token ``x_{t+1}`` is a real assistant token, i.e. the
        positions of the LM loss of :meth:`train_forward` (logits at ``t`` against ``x_{t+1}``; the last
        position never has a label). Masks only, no forward.

        Args:
            attention_mask, loss_mask: ``[B, T]`` bool (or 0/1): real tokens, assistant tokens.
        """
        m = attention_mask.bool() & loss_mask.bool()
        pos = torch.zeros_like(m)
        pos[:, :-1] = m[:, 1:]
        return pos

    def train_forward(self, input_ids: torch.Tensor, attention_mask: torch.Tensor, loss_mask: torch.Tensor,
                      norm: torch.Tensor | float | None = None) -> "LoraForward":
        """The adapted target's forward WITH gradients through the LoRA adapters (joint training).

        Args:
            input_ids: ``[B, T]`` int64, right-padded; attention_mask: ``[B, T]`` bool, True on real tokens;
                loss_mask: ``[B, T]`` bool, True on assistant tokens (the LM loss's labels).
            norm: divisor of the summed LM loss (the label count of a whole gradient-accumulation window);
                ``None`` = this call's own label count (the loss is then the mean NLL per label).
        Returns:
            :class:`LoraForward`: ``top [B, T, H]`` post-norm hidden states (model or autocast dtype, with
            gradients), ``argmax [B, T]`` int64 greedy token at every real position (0 on padding, no
            graph), ``lm_loss`` (scalar: summed cross entropy of the logits at ``t`` against ``x_{t+1}``
            over :meth:`lm_label_positions`, divided by ``norm``), ``nll_sum`` (float, nats) and
            ``n_labels`` (int).
        Raises:
            SpeculatorsError: the target is not adapted.
        """
        import torch.nn.functional as F

        self._adapted("train_forward")
        att = attention_mask.to(self.device).bool()
        ids = input_ids.to(self.device)
        out = self.decoder(input_ids=ids, attention_mask=att.long(), use_cache=False)
        top = out.last_hidden_state.to(self.device)  # [B, T, H] after the final norm, with gradients
        argmax = torch.zeros_like(ids)
        with torch.no_grad():  # the greedy token at every real position (metrics, masks), no graph
            argmax[att] = self.lm_head(top.detach()[att]).argmax(-1)
        label_pos = self.lm_label_positions(att, loss_mask.to(self.device))
        labels = ids[:, 1:][label_pos[:, :-1]]  # x_{t+1} for every label position t
        if labels.numel():
            nll = F.cross_entropy(self.lm_head(top[label_pos]).float(), labels, reduction="sum")
        else:
            nll = top.sum() * 0.0  # keeps the graph (and the device) for a batch without labels
        n = int(labels.numel())
        den = max(n, 1) if norm is None else max(float(norm), 1.0)
        return LoraForward(top, argmax, nll / den, float(nll.detach()), n)

    def save_adapter(self, directory: str | Path) -> None:
        """Write the LoRA adapter into ``directory`` in peft's format (``adapter_config.json`` +
        ``adapter_model.safetensors``, what ``PeftModel.from_pretrained`` reads).

        Raises:
            SpeculatorsError: the target is not adapted.
        """
        self._adapted("save_adapter").save_pretrained(str(directory))

    def load_adapter(self, directory: str | Path, weights: dict[str, torch.Tensor] | None = None) -> None:
        """Load adapter weights written by :meth:`save_adapter` into this adapted target (resume).

        Args:
            directory: the adapter directory.
            weights: its ``adapter_model.safetensors`` tensors when the caller already read (and checked)
                them; ``None`` = read them here.
        Raises:
            SpeculatorsError: not adapted; the adapter file is missing; its tensors do not match this
                target's LoRA config.
        """
        from peft import set_peft_model_state_dict

        lora = self._adapted("load_adapter")
        f = Path(directory) / ADAPTER_WEIGHTS
        if weights is None:
            if not f.is_file():
                raise SpeculatorsError(f"{f}: missing; there is no target adapter to load")
            from safetensors.torch import load_file

            weights = load_file(str(f))
        result = set_peft_model_state_dict(lora, weights)
        unexpected = list(getattr(result, "unexpected_keys", []) or [])
        if unexpected:
            raise SpeculatorsError(f"{f}: adapter weights do not match this run's LoRA config "
                                   f"(unexpected {unexpected[:3]})")

    def merge_adapter(self, directory: str | Path) -> None:
        """Merge a LoRA adapter written by :meth:`save_adapter` into this (base) target, in place
        (peft ``merge_and_unload``): the target becomes the fine-tuned model, frozen and in eval mode, and
        its :attr:`fingerprint` is recomputed. This is the verifier a joint checkpoint's drafter was
        trained with, and the model to serve it with.

        Raises:
            SpeculatorsError: the target carries trainable adapters (merge into a freshly loaded base
                target); the adapter cannot be read or does not fit the target.
        """
        from peft import PeftModel

        if self._lora is not None:
            raise SpeculatorsError(f"{directory}: cannot merge an adapter into a target that is being trained "
                                   "with its own LoRA adapters; load the base target again")
        try:
            merged = PeftModel.from_pretrained(self.model, str(directory)).merge_and_unload()
        except Exception as e:  # noqa: BLE001 - peft raises several types for a bad adapter
            raise SpeculatorsError(f"{directory}: cannot apply the target adapter ({type(e).__name__}: {e})") from None
        merged.eval()
        for p in merged.parameters():
            p.requires_grad_(False)
        self.model = merged
        self._fingerprint = None


_ROUTERS = ("gate", "router", "shared_expert_gate")  # MoE routers: their logits pick experts, no LoRA there


def _default_lora_modules(decoder: torch.nn.Module, shared: set[str]) -> list[str]:
    """Leaf names of every linear layer of the decoder stack that peft can adapt (``nn.Linear`` and its
    subclasses, GPT-2's ``Conv1D``), except MoE routers (leaf ``gate`` / ``router`` / ``shared_expert_gate``,
    or a class named ``*Router``) and the modules drafters share (``shared``).

    Raises:
        SpeculatorsError: the decoder has no such layer.
    """
    from transformers.pytorch_utils import Conv1D

    out = set()
    for name, m in decoder.named_modules():
        leaf = name.rsplit(".", 1)[-1]
        if isinstance(m, (torch.nn.Linear, Conv1D)) and leaf not in _ROUTERS and leaf not in shared \
                and "router" not in type(m).__name__.lower():
            out.add(leaf)
    if not out:
        raise SpeculatorsError(f"drafter.joint_target.lora_modules: {type(decoder).__name__} has no linear layer "
                               f"peft can adapt; name the modules to adapt")
    return sorted(out)
