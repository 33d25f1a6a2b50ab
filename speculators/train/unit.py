"""What the trainer steps: one training unit, the drafter plus (for a joint run) the LoRA-adapted target.

The trainer (:mod:`speculators.train.trainer`) never looks at the family nor at whether the target trains: it
asks the unit for the loss-term counts, the loss, the optimizer groups, the checkpoint save/load, the
held-out metrics of several batches as one, the held-out summary line and the model card's lines.

* Frozen target (``TrainingUnit(drafter)``): the unit is the drafter; the batch's cached target
  features are the inputs of ``drafter.loss``.
* Online features (``TrainingUnit(drafter, target, features="online")``, ``data.features: online``): the
  batches carry token ids and masks only; the frozen target (eval mode, no gradients, no autocast, never
  a submodule: not trained, not in the optimizer, not saved) computes each batch's aux/top hidden states
  and greedy tokens inside the step with :func:`speculators.data.features.batch_features`, the function
  the offline cache is filled with (same taps, same ``data.feature_dtype`` rounding), so a step sees the
  same numbers in both modes. A batch's features are computed once: :meth:`TrainingUnit.loss_counts`
  keeps them (up to :data:`ONLINE_CACHE_BATCHES` batches) for the :meth:`TrainingUnit.loss` of the same batch.
* Joint training (``TrainingUnit(drafter, target)`` with ``drafter.joint: true`` and a target adapted
  by ``Target.adapt_lora``): the Medusa-2 (arXiv 2401.10774, section 2.3.2) / DeepSeek-V3 MTP
  (arXiv 2412.19437, section 2.2) loss ``lm_weight * L_LM + drafter.joint_loss_weight * drafter.loss(batch')``
  where ``batch'`` carries the live adapted target's top hidden states and greedy tokens
  (``Target.train_forward``) and ``L_LM`` is the target's cross entropy on the assistant tokens. The
  LoRA parameters are a second optimizer group (``drafter.joint_target.lr``, default ``0.1 * lr``); the
  adapter is saved beside the drafter (``target_adapter/``); the target's held-out perplexity
  (``exp`` of the NLL summed over all held-out assistant tokens) is reported before and after training.
"""

from __future__ import annotations

import dataclasses
import math
from pathlib import Path
from typing import Any

import torch
from torch import nn

from ..errors import SpeculatorsError

# per-batch metrics that are sums (combined by adding), not means (combined weighted by counts)
_SUMS = ("lm_nll_sum", "lm_tokens")
#: online features: how many batches' features loss_counts keeps for their loss (a gradient-accumulation
#: window or the trainer's held-out batches); beyond it a batch's target forward runs again.
ONLINE_CACHE_BATCHES = 8


class TrainingUnit(nn.Module):
    """The drafter plus, for a joint run, the LoRA-adapted target: what one optimizer steps.

    An ``nn.Module`` whose submodules are the drafter and (joint runs) the adapted target model
    (``Target.lora_module``), so that ``train()``/``eval()``, device moves, data-parallel wrappers and
    ``parameters()`` (gradient clipping, finiteness checks) reach every trained weight.

    Args:
        drafter: a :class:`speculators.drafters.Drafter` with its target attached.
        target: for a drafter with ``trains_target`` (``drafter.joint: true``): the run's
            :class:`speculators.target.Target`, adapted with ``target.adapt_lora(drafter.cfg.joint_target)``;
            for a frozen-target drafter: the frozen target (required with ``features="online"``, else
            ignored) or ``None``.
        features: ``data.features``: ``"offline"`` (the batches carry the cached features) or ``"online"``
            (the frozen ``target`` computes them in the step).
        feature_dtype: ``data.feature_dtype`` (bfloat16 | float32 | float16): the rounding of online features.
    Raises:
        SpeculatorsError: a joint drafter without an adapted target, or an adapted target with a
            frozen-target drafter; online features without a target, with an adapted target or a joint
            drafter; an unknown ``features`` mode or ``feature_dtype``.
    """

    def __init__(self, drafter, target=None, features: str = "offline", feature_dtype: str = "bfloat16"):
        super().__init__()
        from ..data.features import feature_dtype as check_dtype

        if features not in ("offline", "online"):
            raise SpeculatorsError(f"data.features: {features!r} is not a feature mode; allowed: ['offline', 'online']")
        online = features == "online"
        if online and (target is None or target.adapted or drafter.trains_target):
            raise SpeculatorsError("data.features: online runs the frozen target inside the training step: build the "
                                   "training unit with the frozen (not LoRA-adapted) target and a drafter without "
                                   "drafter.joint")
        self.feature_dtype = check_dtype(feature_dtype)
        # online: the frozen feature source; a plain attribute (not a module): never trained, moved or saved
        object.__setattr__(self, "feature_target", target if online else None)
        self._online_cache: dict = {}
        adapted = target is not None and target.adapted
        if drafter.trains_target and not adapted:
            raise SpeculatorsError("drafter.joint: true trains the target: build the training unit with the target "
                                   "adapted by target.adapt_lora(drafter.joint_target)")
        if adapted and not drafter.trains_target:
            raise SpeculatorsError("the target carries LoRA adapters but drafter.joint is false: a frozen-target "
                                   "drafter trains on the frozen target's cached features")
        self.drafter = drafter
        object.__setattr__(self, "target", target if adapted else None)  # a Target, not a module
        if adapted:
            self.target_lora = target.lora_module  # registered: train/eval, .to, DDP reach the adapters
            jcfg = drafter.cfg.joint_target
            self.lm_weight, self.target_lr = float(jcfg.lm_weight), jcfg.lr

    @property
    def online(self) -> bool:
        """True when the frozen target computes the features inside the step (``data.features: online``)."""
        return self.feature_target is not None

    def _online_features(self, batch, keep: bool):
        """``batch`` with the frozen target's features (``data.features: online``): ``aux``/``top`` in float32
        after the ``data.feature_dtype`` rounding and ``argmax``, on the batch's device
        (:func:`speculators.data.features.batch_features`). Computed once per batch: ``keep=True`` (the
        counts) stores them for the ``keep=False`` call (the loss) of a batch with the same token ids."""
        import hashlib

        from ..data.features import batch_features

        ids, att = batch.input_ids, batch.attention_mask
        key = hashlib.sha1(ids.detach().cpu().numpy().tobytes() + att.detach().cpu().numpy().tobytes()
                           + repr(tuple(ids.shape)).encode()).hexdigest()
        feats = self._online_cache.pop(key, None)
        if feats is None:
            self.feature_target.model.eval()
            feats = batch_features(self.feature_target, ids, att, self.feature_dtype)
        if keep:
            self._online_cache[key] = feats
            while len(self._online_cache) > ONLINE_CACHE_BATCHES:
                self._online_cache.pop(next(iter(self._online_cache)))
        dev = ids.device
        return dataclasses.replace(batch, aux=feats["aux"].to(device=dev, dtype=torch.float32),
                                   top=feats["top"].to(device=dev, dtype=torch.float32),
                                   argmax=feats["argmax"].to(dev))

    @property
    def trains_target(self) -> bool:
        """True when the target changes in this run (joint training): its held-out quality is measured
        before the first update too."""
        return self.target is not None

    # ---------------------------------------------------------------- loss
    def forward(self, batch, norm: torch.Tensor | None = None) -> tuple[torch.Tensor, dict[str, float]]:
        """:meth:`loss`: the trainer calls the unit through the engine's wrapper (``accelerator.prepare``:
        DDP, FSDP, DeepSpeed), whose hooks (gradient all-reduce, parameter gathering) fire on ``forward``."""
        return self.loss(batch, norm)

    def loss_counts(self, batch) -> torch.Tensor:
        """``[n_terms]`` int64 counts of :meth:`loss`'s terms in ``batch``: ``drafter.loss_counts`` plus, in
        joint training, the target's LM label count (last entry). Sum them over the micro-batches of an
        accumulation window (and over processes) and pass the sum as ``norm`` to every micro-batch.

        Reads only the masks (and ``argmax``): ``aux``/``top`` may be empty. Cheap, except in joint
        training for a family whose masks read the target's greedy token (``drafter.counts_use_argmax``):
        the live target then runs once more without gradients (torch RNG state preserved; with
        ``lora_dropout > 0`` its argmax may differ from the training forward's); with online features
        such a family's counts run the frozen target's forward, kept for this batch's :meth:`loss`.
        """
        d = self.drafter
        if self.online:
            return d.loss_counts(self._online_features(batch, keep=True) if d.counts_use_argmax else batch)
        if self.target is None:
            return d.loss_counts(batch)
        if d.counts_use_argmax:
            devices = [batch.input_ids.device] if batch.input_ids.is_cuda else []
            with torch.no_grad(), torch.random.fork_rng(devices=devices):
                live = self.target.train_forward(batch.input_ids, batch.attention_mask, batch.loss_mask)
            batch = dataclasses.replace(batch, top=live.top.float(), argmax=live.argmax)
        own = d.loss_counts(batch).to(torch.int64)
        n_labels = self.target.lm_label_positions(batch.attention_mask, batch.loss_mask).sum()
        return torch.cat([own, n_labels.to(device=own.device, dtype=torch.int64).view(1)])

    def loss(self, batch, norm: torch.Tensor | None = None) -> tuple[torch.Tensor, dict[str, float]]:
        """What the trainer minimises, and this batch's metrics.

        Args:
            batch: a :class:`speculators.data.dataset.Batch` on the training device (online features: its
                ``aux``/``top``/``argmax`` are ignored and computed by the frozen target).
            norm: ``[n_terms]`` from :meth:`loss_counts` summed over a gradient-accumulation window (each
                term is divided by its entry); ``None`` = this batch's own counts (each term a mean).
        Returns:
            ``(loss, metrics)``: a scalar tensor with gradients and float metrics (this batch's own means
            whatever ``norm``): the drafter's, plus in joint training ``drafter_loss``, ``lm_loss`` (mean
            NLL per assistant token), ``lm_nll_sum`` and ``lm_tokens`` (sums: :meth:`metrics_summary`
            turns them into the target's perplexity over several batches).
        """
        d = self.drafter
        if self.online:
            return d.loss(self._online_features(batch, keep=False), norm)
        if self.target is None:
            return d.loss(batch, norm)
        live = self.target.train_forward(batch.input_ids, batch.attention_mask, batch.loss_mask,
                                         norm=None if norm is None else norm[-1])
        batch = dataclasses.replace(batch, top=live.top.float(), argmax=live.argmax)
        loss, metrics = d.loss(batch, None if norm is None else norm[:-1])
        total = self.lm_weight * live.lm_loss + d.joint_loss_weight * loss
        own = d.last_own_loss
        return total, {**metrics, "drafter_loss": float(loss.detach()) if norm is None or own is None else own,
                       "lm_loss": live.nll_sum / max(live.n_labels, 1), "lm_nll_sum": live.nll_sum,
                       "lm_tokens": float(live.n_labels)}

    def param_groups(self, lr: float) -> list[dict[str, Any]]:
        """Optimizer parameter groups, each named (``"name"``, the trainer logs ``train/lr_<name>`` for
        every group after the first): ``drafter`` (its trainable parameters at ``lr``) and, in joint
        training, ``target`` (the LoRA parameters at ``drafter.joint_target.lr``, default ``0.1 * lr``)."""
        groups = [{"params": [p for p in self.drafter.parameters() if p.requires_grad], "lr": lr, "name": "drafter"}]
        if self.target is not None:
            groups.append({"params": self.target.lora_parameters(), "lr": self.target_lr or 0.1 * lr,
                           "name": "target"})
        return groups

    # ---------------------------------------------------------------- checkpoints
    def save(self, path: str | Path, recipe_yaml: str | None = None, extra_files: dict[str, str] | None = None,
             extra=None, overwrite: bool = True, dtype: str | None = None, frozen_copies: bool = True,
             provenance: dict | None = None) -> Path:
        """Write the drafter checkpoint ``path`` atomically (:func:`speculators.drafters.checkpoint.save_pretrained`),
        with the target's LoRA adapter in ``target_adapter/`` for joint training. Never writes the frozen
        target (online features) nor its frozen weights.

        Args:
            dtype: ``train.save_dtype`` (bfloat16 | float16 | float32) of the drafter's floating-point weights,
                for a published checkpoint (``final/``); ``None`` = full precision, exact: what the
                resumable ``checkpoints/step-N`` (read back by :meth:`load`) are written in.
            frozen_copies: False for a published checkpoint: leave out the frozen target copies its serving
                format does not need (e.g. EAGLE-3's ``embed_tokens``; ``ServingFormat.frozen_target_weights``).
            provenance: more keys of ``config.json``'s ``speculators_training`` block (e.g. ``data_producer``).
        Raises:
            SpeculatorsError: ``path`` exists and ``overwrite`` is False, or is not a directory; an unknown
                ``dtype``.
        """
        from ..drafters.checkpoint import save_pretrained

        return save_pretrained(self.drafter, path, recipe_yaml=recipe_yaml, extra_files=extra_files,
                               overwrite=overwrite, extra=extra, target=self.target, dtype=dtype,
                               frozen_copies=frozen_copies, provenance=provenance)

    def load(self, path: str | Path) -> None:
        """Load the trained weights of checkpoint ``path`` written by :meth:`save` (resume): the drafter's
        and, in joint training, the target adapter's. Every file is read and checked before any weight
        is loaded.

        Raises:
            SpeculatorsError: a weight file is missing, unreadable or holds a NaN/inf (naming the file and
                the tensor); weights that do not fit this drafter or this LoRA config.
        """
        from ..drafters.checkpoint import WEIGHTS_NAME, adapter_weights_file, complete_frozen_copies, load_weights

        path = Path(path)
        weights = complete_frozen_copies(self.drafter, load_weights(path / WEIGHTS_NAME))
        adapter = None
        if self.target is not None:
            f = adapter_weights_file(path)
            if not f.is_file():
                raise SpeculatorsError(f"{f}: missing; the checkpoint has no target adapter to resume from")
            adapter = (f.parent, load_weights(f, "the adapter weights"))
        self.drafter.serving.load_state_dict(self.drafter, weights)
        if adapter is not None:
            self.target.load_adapter(*adapter)

    # ---------------------------------------------------------------- reporting
    @staticmethod
    def metrics_summary(parts: list[tuple[torch.Tensor, dict[str, float]]]) -> dict[str, float]:
        """The metrics of several batches as one (held-out evaluation).

        Args:
            parts: ``(counts, metrics)`` per batch: its :meth:`loss_counts` and the metrics :meth:`loss`
                returned for it.
        Returns:
            Each mean metric averaged with every batch weighted by its count of the first loss term (its
            first-draft positions); for joint training, ``lm_loss`` = summed NLL / summed tokens over all
            batches and ``ppl = exp(lm_loss)``, the target's perplexity on the assistant tokens (the sums
            ``lm_nll_sum`` / ``lm_tokens`` themselves are not returned).
        """
        sums: dict[str, float] = {}
        weight = 0.0
        for counts, metrics in parts:
            w = float(counts[0])
            weight += w
            for k, v in metrics.items():
                sums[k] = sums.get(k, 0.0) + (v if k in _SUMS else w * v)
        out = {k: v / max(weight, 1.0) for k, v in sums.items() if k not in _SUMS}
        if sums.get("lm_tokens"):
            out["lm_loss"] = sums["lm_nll_sum"] / sums["lm_tokens"]
            out["ppl"] = math.exp(out["lm_loss"])
        return out

    @staticmethod
    def summary(metrics: dict[str, float]) -> str:
        """One log line of (held-out) metrics without prefix: ``loss``, ``sim_tau``, ``full_acc_0`` and,
        when the target trains, its perplexity ``ppl``."""
        line = (f"loss {metrics['loss']:.3f} sim_tau {metrics.get('sim_tau', 0):.3f} "
                f"acc0 {metrics.get('full_acc_0', 0):.3f}")
        if "ppl" in metrics:
            line += f" target ppl {metrics['ppl']:.3f}"
        return line

    def card_lines(self, before: dict[str, float], after: dict[str, float]) -> list[str]:
        """The model card's lines about the target (Markdown, each paragraph followed by ``""``): nothing for
        a frozen target; for joint training, where the adapter is and what eval does with it, and the
        target's held-out perplexity before and after training (``before`` / ``after``: held-out metrics
        without prefix, as :meth:`metrics_summary` returns them)."""
        if self.target is None:
            return []
        from ..drafters.checkpoint import ADAPTER_DIR

        lines = ["Joint run: the target was fine-tuned with LoRA together with the drafter. The adapter is in "
                 f"`{ADAPTER_DIR}/`; `speculators eval` merges it into the base target and verifies against the "
                 "fine-tuned model, which is also the model to serve with this drafter.", ""]
        if "ppl" in after and "ppl" in before:
            rel = after["ppl"] / before["ppl"] - 1
            lines += [f"Target held-out perplexity: {before['ppl']:.4f} -> {after['ppl']:.4f} ({100 * rel:+.2f}%).",
                      ""]
        return lines


def set_distill_loss(drafter, spec) -> None:
    """Give ``drafter`` the recipe's ``train.loss`` (:meth:`speculators.recipe.TrainSpec.loss_mix`).

    Raises:
        SpeculatorsError: a loss other than the default for a drafter that does not distil the target's
            distribution (``Drafter.distills`` False: hard labels, e.g. DFlash, or ``distill: false``).
    """
    mix = spec.loss_mix()
    if not mix.is_default and not drafter.distills:
        raise SpeculatorsError(f"train.loss: {spec.loss} applies to drafters trained on the target's distribution; "
                               f"this {drafter.algorithm} drafter trains on hard labels (its own config: e.g. "
                               f"distill: true, or a loss: kl setting)")
    drafter.distill_loss = mix


__all__ = ["TrainingUnit", "set_distill_loss"]
