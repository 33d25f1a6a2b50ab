"""The drafter interface and the family registry.

A family is one file in ``speculators/drafters/``: it subclasses :class:`Drafter`, declares its
pydantic config (``config_class``) and registers itself with :func:`register`. The trainer, the
generation loop, the evaluator and the CLI only use this interface (DESIGN.md, principles 1-2):

* ``from_target(cfg, target, vocab)``: build a fresh drafter for a frozen target (its
  :class:`~.checkpoint.TargetMeta` is ``TargetMeta.from_target(target)``);
* ``loss(batch, norm=None) -> (loss, metrics)``: training objective on a
  :class:`speculators.data.dataset.Batch`, a weighted sum of terms each divided by ``norm[i]``;
  ``loss_counts(batch) -> [n_terms]``: each term's valid count from the masks (gradient accumulation
  normalises by the counts of the whole window);
* ``start(input_ids, features) -> state``; ``propose(state, k, sampling, generator=None) -> Proposal``;
  ``advance(state, new_ids, features)``: inference, one request at a time;
* formats: ``export_config() -> dict`` (``config.json`` as vLLM loads it, built with the helpers of
  :mod:`speculators.export`), ``export_state_dict()`` / ``load_export_state_dict(sd)`` (weights under
  the serving engine's names), ``_build(cfg, meta, weights)`` (an empty module for a checkpoint), and
  the class hooks ``vllm_serving(config)`` / ``speculative_tokens(config)``;
* ``save_pretrained(dir)`` / ``Drafter.from_pretrained(dir)``: thin methods over
  :mod:`speculators.drafters.checkpoint`, which owns the checkpoint directory (layout, atomic write,
  finite-weight checks, the recorded target facts).

Inference protocol (features lag tokens by one): after ``start``/``advance`` the drafter has seen
tokens ``x_0..x_n`` and target features of positions ``0..n-1``; ``x_n`` is the newest (bonus or
recovered) token, not yet run through the target. ``advance(new_ids, features)`` appends ``m``
tokens ``x_{n+1}..x_{n+m}`` together with the target features of positions ``n..n+m-1``.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any, ClassVar

import torch
from pydantic import BaseModel, ConfigDict, Field
from torch import nn

from .. import export
from ..data.vocab import DraftVocab  # noqa: F401  (moved to the data layer; re-exported)
from ..errors import SpeculatorsError
from ..verify import SamplingParams
from . import checkpoint
from .checkpoint import (  # noqa: F401  (old import paths of the checkpoint names keep working)
    CONFIG_NAME,
    RECIPE_NAME,
    TRAINING_KEY,
    WEIGHTS_NAME,
    TargetMeta,
    check_finite_weights,
    read_checkpoint_config,
)


class DrafterConfig(BaseModel):
    """Hyper-parameters common to every family; families subclass and add their own."""

    model_config = ConfigDict(extra="forbid")

    algorithm: str
    draft_vocab_size: int | None = Field(
        default=None, gt=0, description="size of the draft vocabulary (d2t/t2d); None = full target vocab")


@dataclass
class Proposal:
    """Draft tokens for one request.

    Attributes:
        token_ids: ``[k]`` int64 draft tokens in target-vocabulary ids.
        probs: ``[k, V]`` float32 draft distributions q the tokens were sampled from (target vocab),
            or None for drafters that only give ids (the verifier then treats q as a point mass).
    """

    token_ids: torch.Tensor
    probs: torch.Tensor | None = None


_REGISTRY: dict[str, type["Drafter"]] = {}


def register(cls: type["Drafter"]) -> type["Drafter"]:
    """Class decorator: make a family available under ``cls.algorithm``."""
    _REGISTRY[cls.algorithm] = cls
    return cls


class _Registry:
    def names(self) -> list[str]:
        return sorted(_REGISTRY)

    def get(self, name: str) -> type["Drafter"]:
        try:
            return _REGISTRY[name]
        except KeyError:
            raise SpeculatorsError(f"unknown drafter algorithm {name!r}; allowed: {self.names()}") from None


registry = _Registry()


class Drafter(nn.Module):
    """Base class of every drafter family (see the module docstring for the protocol)."""

    algorithm: ClassVar[str] = ""
    config_class: ClassVar[type[DrafterConfig]] = DrafterConfig

    def __init__(self, cfg: DrafterConfig, meta: TargetMeta | Mapping[str, Any]):
        """``meta``: the facts about the target recorded in the checkpoint (:class:`TargetMeta`; a
        mapping of its JSON keys is validated into one).

        Raises:
            SpeculatorsError: ``meta`` is a mapping with missing or invalid target facts.
        """
        super().__init__()
        self.cfg = cfg
        self.meta: TargetMeta = meta if isinstance(meta, TargetMeta) else TargetMeta.from_json(dict(meta), "meta")
        self._teacher_head: torch.Tensor | None = None
        # joint runs: directory of the target's LoRA adapter that came with a loaded checkpoint
        self.target_adapter_dir: Path | None = None

    # ---------------------------------------------------------------- construction
    @classmethod
    def from_target(cls, cfg: DrafterConfig, target, vocab: DraftVocab) -> "Drafter":
        """A fresh drafter of this family for the frozen ``target`` (a :class:`speculators.target.Target`)
        and draft vocabulary ``vocab``; records ``TargetMeta.from_target(target)`` and attaches the target.

        Raises:
            SpeculatorsError: ``vocab`` is not one this family supports (e.g. reduced, for full-vocab families).
        """
        raise NotImplementedError

    @classmethod
    def _from_target_full_vocab(cls, cfg: DrafterConfig, target, vocab: DraftVocab) -> "Drafter":
        """``from_target`` of families that draft through the target's own head over the full
        vocabulary: build, copy the (frozen) ``embed_tokens`` from the target, attach the target.

        Raises:
            SpeculatorsError: ``vocab`` is a reduced draft vocabulary.
        """
        if vocab.size != target.vocab_size:
            raise SpeculatorsError(f"drafter.draft_vocab_size: {cls.algorithm} drafts over the full target "
                                   f"vocabulary ({target.vocab_size}); got a draft vocabulary of {vocab.size}")
        d = cls(cfg, TargetMeta.from_target(target))
        with torch.no_grad():
            d.embed_tokens.weight.copy_(target.embed_tokens.weight.float())
        d.attach_target(target)
        return d

    def attach_target(self, target) -> None:
        """Give the drafter the frozen target pieces it may use: the output head (teacher
        distributions in training; drafting through the target's head for EAGLE-1/MTP-style
        families) and the final norm. Kept outside the module tree: never trained, never saved."""
        self._teacher_head = target.lm_head_weight.detach()
        object.__setattr__(self, "_target_norm", target.final_norm)
        self._head_on_device: torch.Tensor | None = None

    def target_lm_head(self, h: torch.Tensor) -> torch.Tensor:
        """Frozen target output head: ``[..., H]`` post-norm hidden -> ``[..., V]`` logits.

        Raises:
            RuntimeError: ``attach_target`` was not called.
        """
        if self._teacher_head is None:
            raise RuntimeError("attach_target(target) first: the target's output head is missing")
        head = getattr(self, "_head_on_device", None)
        if head is None or head.device != h.device or head.dtype != h.dtype:
            head = self._teacher_head.to(device=h.device, dtype=h.dtype)  # copied once, not per call
            self._head_on_device = head
        return torch.nn.functional.linear(h, head)

    def target_final_norm(self, h: torch.Tensor) -> torch.Tensor:
        """The target's frozen final RMSNorm (``[..., H]`` -> ``[..., H]``)."""
        norm = getattr(self, "_target_norm", None)
        if norm is None:
            raise RuntimeError("attach_target(target) first: the target's final norm is missing")
        return norm(h)

    def check_target(self, target, warn=None) -> None:
        """Check that ``target`` can serve this drafter; only checks, never changes ``target``.

        The target must be loaded with the checkpoint's aux layer ids:
        ``Target.load(ref, dtype, aux_layer_ids=drafter.meta.aux_layer_ids)``.

        Args:
            target: a :class:`speculators.target.Target`.
            warn: called with one message when the shapes fit but the weights differ from the training
                target's (fingerprint); ``None`` = no warning.
        Raises:
            SpeculatorsError: the vocab or hidden size differs from the training target's, or the target
                taps other aux layers than the drafter was trained on (naming both lists).
        """
        m = self.meta
        problems = []
        if m.vocab_size != target.vocab_size:
            problems.append(f"vocab size {m.vocab_size} != target's {target.vocab_size}")
        if m.hidden_size != target.hidden_size:
            problems.append(f"hidden size {m.hidden_size} != target's {target.hidden_size}")
        if problems:
            raise SpeculatorsError(
                f"checkpoint was trained for {m.name_or_path!r}, not {target.name_or_path!r}: " + "; ".join(problems))
        if list(m.aux_layer_ids) != list(target.aux_layer_ids):
            raise SpeculatorsError(
                f"target.aux_layer_ids: the target taps layers {list(target.aux_layer_ids)} but this drafter was "
                f"trained on layers {list(m.aux_layer_ids)}; load the target with "
                f"aux_layer_ids={list(m.aux_layer_ids)} (the checkpoint's)")
        if warn is not None and m.fingerprint not in (None, target.fingerprint):
            warn(f"warning: {target.name_or_path!r} is not the target this drafter was trained for "
                 f"({m.name_or_path!r}, fingerprint {m.fingerprint}); acceptance may suffer")

    # ---------------------------------------------------------------- training
    def loss(self, batch, norm: torch.Tensor | None = None) -> tuple[torch.Tensor, dict[str, float]]:
        """Training objective: a weighted sum of terms, term i being a sum over its own valid positions
        divided by ``norm[i]`` (``norm [n_terms]``, see :meth:`loss_counts`; default: this batch's own
        counts, i.e. each term is the mean over its valid positions). Passing the counts of a whole
        gradient-accumulation window (all micro-batches, all processes) makes the summed micro-batch
        gradients equal the gradient of the window as one batch. Metrics are always this batch's own
        means."""
        raise NotImplementedError

    def loss_counts(self, batch) -> torch.Tensor:
        """``[n_terms]`` int64: the number of valid positions of each term of :meth:`loss` in ``batch``,
        computed from the batch's masks by the same code the loss uses (no forward). Reads only
        ``input_ids``, ``loss_mask``, ``attention_mask`` and ``argmax`` (``aux``/``top`` may be empty)."""
        raise NotImplementedError

    @property
    def counts_use_argmax(self) -> bool:
        """True when :meth:`loss_counts` reads ``batch.argmax`` (a mask on the target's greedy token);
        in joint mode the counts then need the live target's argmax (:meth:`training_loss_counts`)."""
        return False

    def _combine_terms(self, sums: list[torch.Tensor], weights: list[float], counts: torch.Tensor,
                       norm: torch.Tensor | None, scale: float = 1.0) -> tuple[torch.Tensor, float]:
        """``scale * sum_i weights[i] * sums[i] / max(den[i], 1)`` with ``den = norm`` (window counts) or
        ``counts`` (this batch's, the default); also returns the same value with this batch's own counts
        (a float, for metrics).

        Raises:
            SpeculatorsError: ``norm`` does not have one entry per term.
        """
        own_den = counts.clamp(min=1)
        if norm is None:
            den = own_den
        else:
            norm = torch.as_tensor(norm).to(counts.device)
            if norm.shape != counts.shape:
                raise SpeculatorsError(f"{self.algorithm} loss: norm has shape {tuple(norm.shape)}, expected "
                                       f"{tuple(counts.shape)} (one count per loss term, see loss_counts)")
            den = norm.clamp(min=1)
        total = sums[0].new_zeros(())
        own = 0.0
        for i, (s, w) in enumerate(zip(sums, weights)):
            total = total + w * (s / den[i])
            own += w * float(s.detach()) / float(own_den[i])
        self._last_own_loss = scale * own  # read by training_loss for the joint `drafter_loss` metric
        return scale * total, scale * own

    @property
    def trains_target(self) -> bool:
        """True when the config asks for joint training (``drafter.joint: true``, see ``joint.py``)."""
        return bool(getattr(self.cfg, "joint", False))

    @property
    def joint_loss_weight(self) -> float:
        """Weight of :meth:`loss` in the joint loss ``lm_weight * L_LM + w * loss`` (1.0; Medusa-2: 0.2)."""
        return 1.0

    def enable_joint_training(self, target) -> None:
        """For a joint config, wrap ``target.model`` with LoRA adapters (in place) and register it as
        the submodule ``joint_target`` so that its adapters train with the drafter; no-op otherwise.
        Call once, after :meth:`from_target`, before building the optimizer."""
        if self.trains_target and getattr(self, "joint_target", None) is None:
            from .joint import JointTarget

            self.joint_target = JointTarget(target, self.cfg.joint_target)

    def training_loss(self, batch, norm: torch.Tensor | None = None) -> tuple[torch.Tensor, dict[str, float]]:
        """What the trainer minimises: :meth:`loss`, or in joint mode
        ``lm_weight * L_LM + joint_loss_weight * loss(batch')`` where ``batch'`` carries the live
        (adapted) target's top hidden states and argmax (:class:`~.joint.JointTarget`). Joint metrics
        add ``lm_loss``, ``lm_nll_sum``, ``lm_tokens`` (the trainer turns these into the target's
        held-out perplexity) and ``drafter_loss``.

        ``norm``: ``[n_terms]`` from :meth:`training_loss_counts` (summed over a gradient-accumulation
        window); ``None`` = this batch's own counts. Metrics are this batch's own means whatever ``norm``.
        """
        jt = getattr(self, "joint_target", None)
        if jt is None:
            return self.loss(batch, norm)
        batch, lm_loss, lm_metrics = jt(batch, norm=None if norm is None else norm[-1])
        loss, metrics = self.loss(batch, None if norm is None else norm[:-1])
        total = self.cfg.joint_target.lm_weight * lm_loss + self.joint_loss_weight * loss
        own = getattr(self, "_last_own_loss", None)
        return total, {**metrics, "drafter_loss": float(loss.detach()) if norm is None or own is None else own,
                       **lm_metrics}

    def training_loss_counts(self, batch) -> torch.Tensor:
        """``[n_terms]`` int64 counts of :meth:`training_loss`'s terms in ``batch``: :meth:`loss_counts`,
        plus, in joint mode, the target's LM-loss label count (last entry). Sum them over the micro-batches
        of an accumulation window (and over processes) and pass the sum as ``norm`` to every micro-batch.

        Cheap (masks only) except in joint mode for a family whose masks read the target's argmax
        (:attr:`counts_use_argmax`): the live target then runs once more without gradients (torch RNG
        state preserved; with ``lora_dropout > 0`` its argmax may differ from the training forward's).
        """
        jt = getattr(self, "joint_target", None)
        if jt is None:
            return self.loss_counts(batch)
        if self.counts_use_argmax:
            devices = [batch.input_ids.device] if batch.input_ids.is_cuda else []
            with torch.no_grad(), torch.random.fork_rng(devices=devices):
                batch = jt(batch)[0]
        own = self.loss_counts(batch).to(torch.int64)
        return torch.cat([own, jt.lm_count(batch).to(own.device).view(1)])

    def param_groups(self, lr: float) -> list[dict[str, Any]]:
        """Optimizer parameter groups: the drafter's trainable parameters at ``lr`` and, in joint mode,
        the target's LoRA parameters at ``joint_target.lr`` (default ``0.1 * lr``)."""
        own = [p for n, p in self.named_parameters() if p.requires_grad and not n.startswith("joint_target.")]
        groups = [{"params": own, "lr": lr}]
        jt = getattr(self, "joint_target", None)
        if jt is not None:
            groups.append({"params": jt.lora_parameters(), "lr": self.cfg.joint_target.lr or 0.1 * lr})
        return groups

    def drafter_state_dict(self) -> dict[str, torch.Tensor]:
        """The drafter's own tensors (the joint target, saved as an adapter, excluded), detached."""
        return {k: v.detach().contiguous() for k, v in self.state_dict().items()
                if not k.startswith("joint_target.")}

    def load_target_adapter(self, checkpoint: str | Path) -> None:
        """Resume: load the LoRA adapter saved in ``checkpoint`` into the live joint target (no-op
        for a frozen-target drafter).

        Raises:
            SpeculatorsError: the checkpoint has no adapter.
        """
        jt = getattr(self, "joint_target", None)
        if jt is not None:
            from .joint import ADAPTER_DIR

            jt.load_adapter(Path(checkpoint) / ADAPTER_DIR)

    def prepare_target(self, target, log=print) -> None:
        """Make ``target`` the verifier this drafter was trained with: merge the LoRA adapter of a
        joint checkpoint into it (in place); no-op for frozen-target checkpoints. Call after
        :meth:`check_target` (which compares against the base target) and before decoding."""
        if self.target_adapter_dir is not None:
            from .joint import merge_adapter

            merge_adapter(target, self.target_adapter_dir)
            log(f"target: merged the jointly trained LoRA adapter {self.target_adapter_dir} "
                f"(verifying against the fine-tuned target)")

    def init_from_checkpoint(self, path: str | Path) -> None:
        """Initialise the drafter's weights from another checkpoint of the same family and shapes
        (``train.init_from``: e.g. joint training started from a frozen-target run). The target
        adapter, optimizer and schedule are not taken over. A relative path is relative to the
        current working directory.

        Raises:
            SpeculatorsError: not a checkpoint, another family, another target (fingerprint), or
                weights that do not fit or are not finite.
        """
        weights = checkpoint.read_init_weights(path, self.algorithm, self.meta.fingerprint)
        self.load_export_state_dict(weights)

    # ---------------------------------------------------------------- inference
    def start(self, input_ids: torch.Tensor, features) -> Any:
        raise NotImplementedError

    def propose(self, state: Any, k: int, sampling: SamplingParams | None = None,
                generator: torch.Generator | None = None) -> Proposal:
        """Up to ``k`` drafts for one request (:class:`speculators.generate.Proposer`'s ``propose``).

        Args:
            state: this drafter's per-request state from :meth:`start` / :meth:`advance`; left as found.
            k: max drafts (>= 0).
            sampling: the request's :class:`speculators.verify.SamplingParams` (batch of one); ``None`` =
                greedy. Families draw each draft with :func:`speculators.losses.sample_draft`.
            generator: torch generator of the draws; ``None`` = the request's own
                (``sampling.generators[0]``), else torch's global RNG.
        Returns:
            :class:`Proposal`: ``token_ids [k']`` int64 target ids (``k' <= k``) and ``probs [k', V]``
            float32 draft distributions, or ``None`` when greedy.
        Raises:
            SpeculatorsError: ``sampling`` is not one request's valid ``SamplingParams``.
        """
        raise NotImplementedError

    def advance(self, state: Any, new_ids: torch.Tensor, features) -> None:
        raise NotImplementedError

    # ---------------------------------------------------------------- formats
    def export_config(self) -> dict[str, Any]:
        """``config.json`` in the format vLLM loads (FORMATS.md)."""
        raise NotImplementedError

    vllm_method: ClassVar[str | None] = None  # vLLM's --speculative-config "method" for this format
    vllm_note: ClassVar[str] = ""  # why vLLM cannot load it as written (when vllm_method is None)

    @classmethod
    def vllm_serving(cls, config: dict[str, Any]) -> tuple[str | None, str]:
        """How vLLM serves a checkpoint of this family whose ``config.json`` is ``config``.

        Returns ``(method, note)`` (:func:`speculators.export.vllm_serving`): ``method`` is the
        ``--speculative-config`` ``"method"`` vLLM accepts for this layout, or ``None`` when vLLM cannot
        load the checkpoint as written (``note`` says why and what to do). Default: the class's
        ``vllm_method`` / ``vllm_note``; a family with several layouts overrides this.
        """
        return export.vllm_serving(cls.algorithm, cls.vllm_method, cls.vllm_note)

    @classmethod
    def speculative_tokens(cls, config: dict[str, Any]) -> int | None:
        """K (``num_speculative_tokens``) that a checkpoint's ``config.json`` declares
        (:func:`speculators.export.speculative_tokens`); ``None`` when the layout does not say. A family
        with its own layout overrides this."""
        return export.speculative_tokens(config)

    def export_state_dict(self) -> dict[str, torch.Tensor]:
        """Weights under the names vLLM expects (default: the module's own state dict)."""
        return self.drafter_state_dict()

    def load_export_state_dict(self, sd: dict[str, torch.Tensor]) -> None:
        """Load weights written by :meth:`export_state_dict`.

        Raises:
            SpeculatorsError: missing/unexpected names or shapes that do not match this config.
        """
        try:
            missing, unexpected = self.load_state_dict(sd, strict=False)
        except RuntimeError as e:
            raise SpeculatorsError(f"checkpoint weights do not match this {self.algorithm} config: "
                                   f"{str(e).splitlines()[-1].strip()}") from None
        missing = [k for k in missing if not k.startswith("joint_target.")]
        if missing or unexpected:
            raise SpeculatorsError(f"checkpoint weights do not match {self.algorithm}: "
                                   f"missing {missing[:5]}, unexpected {unexpected[:5]}")

    def save_pretrained(self, path: str | Path, recipe_yaml: str | None = None,
                        extra_files: dict[str, str] | None = None, overwrite: bool = True,
                        extra=None) -> Path:
        """Write the checkpoint directory ``path`` atomically (:func:`.checkpoint.save_pretrained`):
        ``config.json``, ``model.safetensors``, ``recipe.yaml`` when given, ``extra_files`` (name -> text),
        a joint run's ``target_adapter/``; ``extra(tmp_dir)`` may write more files inside the same rename.

        Raises:
            SpeculatorsError: ``path`` exists and ``overwrite`` is False, or is not a directory.
        """
        return checkpoint.save_pretrained(self, path, recipe_yaml=recipe_yaml, extra_files=extra_files,
                                          overwrite=overwrite, extra=extra)

    @classmethod
    def _build(cls, cfg: DrafterConfig, meta: TargetMeta, weights: dict[str, torch.Tensor]) -> "Drafter":
        """Construct an empty module of this family from a checkpoint's config, target facts and weights
        (``weights`` only to read sizes the config does not hold, e.g. the draft vocabulary's)."""
        raise NotImplementedError

    @staticmethod
    def from_pretrained(path: str | Path) -> "Drafter":
        """Load a checkpoint directory written by ``save_pretrained`` (:func:`.checkpoint.from_pretrained`),
        in eval mode, as the family its config names.

        Raises:
            SpeculatorsError: missing directory/files, unknown family, invalid config or target facts,
                weights that do not match, or a NaN/inf in a weight (of the drafter or of a joint run's
                target adapter), naming the file and the tensor.
        """
        return checkpoint.from_pretrained(path)
