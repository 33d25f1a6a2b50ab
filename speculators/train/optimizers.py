"""The trainer's optimizer (``train.optimizer``): AdamW, or Muon on the weight matrices with AdamW on the rest.

Muon (Jordan et al. 2024, "Muon: An optimizer for hidden layers"; ``torch.optim.Muon``): momentum SGD whose
update of a 2-D weight matrix is orthogonalised by Newton-Schulz iterations. It applies to hidden matrices
only, so, as vllm-project/speculators splits them (its ``split_named_params_for_muon``), a parameter goes to
Muon when it is trainable, 2-D with both dimensions > 1, and not an embedding or an output head; everything else
(embeddings, heads, norms, biases, vectors) keeps AdamW. Embeddings are found by module (``nn.Embedding``),
heads by the drafter's declaration (:meth:`speculators.drafters.Drafter.output_heads`: the modules that produce
vocabulary logits), never by a name or a shape, so a hidden matrix whose size equals a vocabulary stays on Muon.
Defaults follow the reference: ``muon_lr`` = ``train.lr``, momentum 0.95 (Nesterov), 5 Newton-Schulz steps,
weight decay 0.1, ``adjust_lr_fn: match_rms_adamw`` (the update scaled to AdamW's RMS, ``0.2 * sqrt(max(A, B))``,
so one learning rate suits both).

:class:`MuonAdamW` steps both as one optimizer (one ``param_groups`` list for the learning-rate schedule, one
``state_dict`` for exact resume). Sharded training (FSDP / DeepSpeed) keeps AdamW: torch's Muon needs whole
matrices.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

import torch
from torch import nn

from ..errors import SpeculatorsError

ADAMW_BETAS = (0.9, 0.95)


def _not_muon(unit: nn.Module, heads: Iterable[nn.Module]) -> set[int]:
    """ids of the parameters Muon must not take: every ``nn.Embedding``'s and the declared heads'."""
    out = {id(p) for h in heads for p in h.parameters()}
    for module in unit.modules():
        if isinstance(module, nn.Embedding):
            out.update(id(p) for p in module.parameters(recurse=False))
    return out


def muon_split(unit: nn.Module, groups: list[dict[str, Any]],
               heads: Iterable[nn.Module]) -> tuple[list[dict], list[dict]]:
    """Split each parameter group into its Muon part (trainable hidden matrices) and its AdamW part.

    Args:
        unit: the module whose parameters ``groups`` holds (for the embedding modules and names).
        groups: the training unit's named groups (``{"params", "lr", "name"}``).
        heads: the modules that produce vocabulary logits (the drafter's ``output_heads()``); AdamW keeps them.
    Returns:
        ``(muon_groups, adamw_groups)``, each keeping its group's name (``<name>_muon`` for the Muon part) and
        lr; empty groups dropped.
    """
    skip = _not_muon(unit, heads)
    muon, adamw = [], []
    for g in groups:
        m = [p for p in g["params"] if p.requires_grad and p.dim() == 2 and min(p.shape) > 1 and id(p) not in skip]
        ids = {id(p) for p in m}
        rest = [p for p in g["params"] if id(p) not in ids]
        if m:
            muon.append({**g, "params": m, "name": f"{g.get('name', 'group')}_muon"})
        if rest:
            adamw.append({**g, "params": rest})
    return muon, adamw


class MuonAdamW(torch.optim.Optimizer):
    """Muon and AdamW stepped as one optimizer: ``param_groups`` is Muon's groups then AdamW's (the same dicts,
    so a learning-rate scheduler sets both), ``state_dict`` holds both (exact resume).

    Args:
        muon: a ``torch.optim.Muon`` (None when no matrix qualifies). adamw: a ``torch.optim.AdamW`` (None when
            every trainable parameter is a hidden matrix).
    Raises:
        SpeculatorsError: both None.
    """

    def __init__(self, muon: torch.optim.Optimizer | None, adamw: torch.optim.Optimizer | None):
        # the two inner optimizers own their groups and state: torch.optim.Optimizer.__init__ is not called
        self.parts = [o for o in (muon, adamw) if o is not None]
        if not self.parts:
            raise SpeculatorsError("train.optimizer: no trainable parameter")
        self.defaults: dict[str, Any] = {}
        self._optimizer_step_pre_hooks: dict = {}
        self._optimizer_step_post_hooks: dict = {}
        self._optimizer_state_dict_pre_hooks: dict = {}
        self._optimizer_state_dict_post_hooks: dict = {}
        self._optimizer_load_state_dict_pre_hooks: dict = {}
        self._optimizer_load_state_dict_post_hooks: dict = {}

    @property
    def param_groups(self) -> list[dict[str, Any]]:  # type: ignore[override]
        return [g for o in self.parts for g in o.param_groups]

    @property
    def state(self) -> dict:  # type: ignore[override]
        return {k: v for o in self.parts for k, v in o.state.items()}

    def __repr__(self) -> str:
        return f"MuonAdamW({', '.join(type(o).__name__ for o in self.parts)})"

    @torch.no_grad()
    def step(self, closure=None):
        """One step of every part (a ``closure`` is evaluated once, before)."""
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        for o in self.parts:
            o.step()
        return loss

    def zero_grad(self, set_to_none: bool = True) -> None:
        for o in self.parts:
            o.zero_grad(set_to_none=set_to_none)

    def state_dict(self) -> dict[str, Any]:
        return {"parts": [type(o).__name__ for o in self.parts], "states": [o.state_dict() for o in self.parts]}

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        """Raises:
            SpeculatorsError: a state of other optimizers (e.g. an AdamW-only run resumed with Muon)."""
        names = [type(o).__name__ for o in self.parts]
        if not isinstance(state_dict, dict) or state_dict.get("parts") != names:
            got = state_dict.get("parts") if isinstance(state_dict, dict) else type(state_dict).__name__
            raise SpeculatorsError(f"optimizer state of {got} cannot resume train.optimizer {names}: resume with the "
                                   f"run's own train.optimizer")
        for o, s in zip(self.parts, state_dict["states"]):
            o.load_state_dict(s)


def build_optimizer(unit: nn.Module, groups: list[dict[str, Any]], spec, heads: Iterable[nn.Module],
                    sharded: bool = False) -> tuple[torch.optim.Optimizer, list[str]]:
    """The optimizer of ``train.optimizer`` over the unit's parameter groups, and the groups' names in
    ``param_groups`` order (``train/lr_<name>``).

    Args:
        unit: the training unit (parameter names and embedding modules). groups: its named parameter groups.
        spec: the recipe's ``train`` section (:class:`speculators.recipe.TrainSpec`).
        heads: the drafter's ``output_heads()``, kept on AdamW (:func:`muon_split`).
        sharded: FSDP / DeepSpeed training.
    Raises:
        SpeculatorsError: Muon with sharded training.
    """
    if spec.optimizer == "adamw":
        opt = torch.optim.AdamW(groups, lr=spec.lr, weight_decay=spec.weight_decay, betas=ADAMW_BETAS)
        return opt, [g.get("name", f"group{i}") for i, g in enumerate(groups)]
    if sharded:
        raise SpeculatorsError("train.optimizer: muon needs whole weight matrices; with FSDP / DeepSpeed use adamw")
    muon_groups, adamw_groups = muon_split(unit, groups, heads)
    lr = spec.muon_lr if spec.muon_lr is not None else spec.lr
    muon = None
    if muon_groups:
        muon = torch.optim.Muon([{**g, "lr": lr * g["lr"] / spec.lr} for g in muon_groups], lr=lr,
                                weight_decay=spec.muon_weight_decay, momentum=spec.muon_momentum, nesterov=True,
                                ns_steps=spec.muon_ns_steps, adjust_lr_fn=spec.muon_adjust_lr_fn)
    adamw = torch.optim.AdamW(adamw_groups, lr=spec.lr, weight_decay=spec.weight_decay, betas=ADAMW_BETAS) \
        if adamw_groups else None
    opt = MuonAdamW(muon, adamw)
    return opt, [g.get("name", f"group{i}") for i, g in enumerate(opt.param_groups)]


__all__ = ["MuonAdamW", "build_optimizer", "muon_split"]
