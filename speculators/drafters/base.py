"""The drafter interface: the model a family trains and drafts with.

A family is one file in ``speculators/drafters/``: it subclasses :class:`Drafter` (the model), declares its
pydantic config (``config_class``) and its serving format (``serving``, an instance of its own
:class:`~.serving_format.ServingFormat` subclass: the checkpoint as engines see it), and registers itself
with :func:`~.registry.register`. The trainer, the
generation loop, the evaluator and the CLI only use this interface (docs/ARCHITECTURE.md, "The Drafter interface"):

* ``from_target(cfg, target, vocab)``: build a fresh drafter for a frozen target (its
  :class:`~.checkpoint.TargetMeta` is ``TargetMeta.from_target(target)``);
* ``loss(batch, norm=None) -> (loss, metrics)``: training objective on a
  :class:`speculators.data.dataset.Batch`, a weighted sum of terms each divided by ``norm[i]``;
  ``loss_counts(batch) -> [n_terms]``: each term's valid count from the masks (gradient accumulation
  normalises by the counts of the whole window);
* ``start(input_ids, features) -> state`` (one request); the batched ``propose(states, ks, sampling,
  generators=None) -> list[Proposal]`` and ``advance(states, new_ids, features)`` (B requests, ragged:
  :class:`speculators.decode.proposal.Proposer`), by default loops (:func:`propose_each` /
  :func:`advance_each`) over the per-request ``_propose_one(state, k, sampling_1, generator)`` and
  ``_advance_one(state, new_ids, features)`` each family implements; a family may override the
  batched methods (EAGLE-3);
* ``serving`` (:mod:`speculators.drafters.serving_format`): the checkpoint as a serving engine sees it,
  ``serving.config(drafter) -> dict`` (``config.json`` as vLLM loads it, built with the helpers of
  :mod:`speculators.export`), ``serving.state_dict(drafter)`` / ``serving.load_state_dict(drafter, sd)``
  (weights under the serving engine's names), ``serving.vllm_serving(config)`` /
  ``serving.speculative_tokens(config)``, the target taps the format allows
  (``serving.check_aux_layer_ids`` / ``serving.default_aux_layer_ids``), and the export gate's
  ``serving.reference_parity_step``; the drafter keeps ``_build(cfg, meta, weights)`` (an empty module
  for a checkpoint);
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
from pathlib import Path
from typing import Any, ClassVar

import torch
from pydantic import BaseModel, ConfigDict, Field, field_validator
from torch import nn

from ..divergences import LossMix
from ..errors import SpeculatorsError
from ..verify import SamplingParams
from . import checkpoint
from .layers import FrozenTarget
from ..data.vocab import DraftVocab
from ..decode.proposal import Proposal, advance_each, propose_each
from .checkpoint import TargetMeta
from .serving_format import ServingFormat


class DrafterConfig(BaseModel):
    """Hyper-parameters common to every family; families subclass and add their own."""

    model_config = ConfigDict(extra="forbid")

    algorithm: str
    draft_vocab_size: int | None = Field(
        default=None, gt=0, description="size of the draft vocabulary (`d2t`/`t2d`, the most frequent assistant "
                                        "tokens); null = the full target vocabulary; it must stay null for the "
                                        "families that draft over the full vocabulary only: `eagle`, `mtp`, "
                                        "`mlp_speculator`, `draft_model`")
    #: why the family drafts over the full vocabulary only, said in the error ("" = it takes a draft vocabulary);
    #: a non-empty reason makes a set ``draft_vocab_size`` a validation error
    full_vocab_only: ClassVar[str] = ""

    @field_validator("draft_vocab_size")
    @classmethod
    def _draft_vocab_allowed(cls, v):
        if v is not None and cls.full_vocab_only:
            raise ValueError(f"must be null, got {v}: {cls.full_vocab_only} (no d2t/t2d); leave "
                             "drafter.draft_vocab_size unset")
        return v


class Drafter(nn.Module):
    """Base class of every drafter family (see the module docstring for the protocol)."""

    algorithm: ClassVar[str] = ""
    config_class: ClassVar[type[DrafterConfig]] = DrafterConfig
    #: the family's serving format (its own :class:`ServingFormat` subclass, ``algorithm`` equal to the
    #: drafter's): config.json, weight names, what vLLM serves, the target taps it allows
    serving: ClassVar[ServingFormat] = ServingFormat()

    def __init__(self, cfg: DrafterConfig, meta: TargetMeta | Mapping[str, Any]):
        """``meta``: the facts about the target recorded in the checkpoint (:class:`TargetMeta`; a
        mapping of its JSON keys is validated into one).

        Raises:
            SpeculatorsError: ``meta`` is a mapping with missing or invalid target facts, or taps aux layers
                this family's serving format refuses (``serving.check_aux_layer_ids``).
        """
        super().__init__()
        self.cfg = cfg
        self.meta: TargetMeta = meta if isinstance(meta, TargetMeta) else TargetMeta.from_json(dict(meta), "meta")
        self.serving.check_aux_layer_ids(self.meta.aux_layer_ids, self.meta.target_num_layers)
        #: the target's frozen head, final norm and embedding (:meth:`attach_target`); empty until then
        self.frozen_target = FrozenTarget()
        #: True when the config asks for joint training (``drafter.joint: true``, see ``joint.py``): the drafter is
        #: trained together with a LoRA-adapted target (``Target.adapt_lora``, stepped by
        #: :class:`speculators.train.unit.TrainingUnit`) and is only valid with that fine-tuned target.
        self.trains_target: bool = bool(getattr(cfg, "joint", False))
        #: the last :meth:`loss` with every term divided by that batch's OWN counts (a float, for metrics; the
        #: loss itself when ``norm`` was None), set by :func:`speculators.losses.combine_terms`'s callers; None
        #: before any call. A training unit reports it as ``drafter_loss`` under window normalisation.
        self.last_own_loss: float | None = None
        # joint runs: directory of the target's LoRA adapter that came with a loaded checkpoint
        self.target_adapter_dir: Path | None = None
        #: the divergence(s) to the target's distribution the family's distillation terms use (``train.loss``,
        #: :class:`speculators.divergences.LossMix`; set by the trainer; default forward KL = soft cross-entropy)
        self.distill_loss: LossMix = LossMix()

    # ---------------------------------------------------------------- construction
    @classmethod
    def from_target(cls, cfg: DrafterConfig, target, vocab: DraftVocab) -> "Drafter":
        """A fresh drafter of this family for the frozen ``target`` (a :class:`speculators.target.Target`)
        and draft vocabulary ``vocab``; records ``TargetMeta.from_target(target)`` and attaches the target.

        Raises:
            SpeculatorsError: ``vocab`` is not one this family supports (e.g. reduced, for full-vocab families).
        """
        raise NotImplementedError

    def attach_target(self, target) -> None:
        """Give the drafter the frozen target pieces it may use (:class:`.layers.FrozenTarget`: output head,
        final norm, token embedding), kept outside the module tree, and restore the frozen copies a published
        checkpoint left out (:func:`.checkpoint.fill_frozen_copies`).

        Args:
            target: a :class:`speculators.target.Target`.
        """
        self.frozen_target = FrozenTarget(target)
        checkpoint.fill_frozen_copies(self, target)  # the frozen copies a published checkpoint left out

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

    #: True when :meth:`loss_counts` reads ``batch.argmax`` (a mask on the target's greedy token); in joint
    #: training the counts then need the live target's argmax
    #: (:meth:`speculators.train.unit.TrainingUnit.loss_counts`). A family whose answer depends on its
    #: config overrides it with a property.
    counts_use_argmax: ClassVar[bool] = False
    #: True when :meth:`loss` distils the target's distribution through :attr:`distill_loss` (so ``train.loss``
    #: applies); families whose config switches to hard labels override it with a property
    distills: ClassVar[bool] = False
    #: weight of :meth:`loss` in the joint loss ``lm_weight * L_LM + w * loss`` (1.0; Medusa-2 reads its config)
    joint_loss_weight: ClassVar[float] = 1.0

    # ---------------------------------------------------------------- inference
    #: THE K cap: the most drafts ONE step of this drafter can give (``num_speculative_tokens`` / eval ``K``),
    #: or None when K is unbounded (autoregressive families: one more drafter step per draft). Parallel
    #: families override it (a property) with what they were trained for (P-EAGLE: ``num_depths``; DFlash:
    #: ``block_size - 1``); :func:`speculators.decode.proposal.check_speculative_tokens` refuses a larger K, naming
    #: :attr:`max_speculative_tokens_source` (what sets the cap, e.g. ``"drafter.num_depths"``).
    max_speculative_tokens: ClassVar[int | None] = None
    max_speculative_tokens_source: ClassVar[str] = ""

    def start(self, input_ids: torch.Tensor, features) -> Any:
        """The per-request drafting state after a prompt: ``input_ids [n+1]`` int64 (the prompt and the first
        target token) and the target's :class:`speculators.target.TargetFeatures` of positions ``0..n-1``
        (module docstring: features lag tokens by one)."""
        raise NotImplementedError

    def propose(self, states: list, ks: list[int], sampling: SamplingParams | None = None,
                generators: list[torch.Generator | None] | None = None) -> list[Proposal]:
        """Drafts for a batch of requests (:class:`speculators.decode.proposal.Proposer`'s batched ``propose``).

        Default: :func:`propose_each` over the family's ``_propose_one(state, k, sampling_1, generator)``
        (one request at a time, each drawing only from its own generator; ``sampling_1`` is the request's
        own :class:`~speculators.verify.SamplingParams`, None = greedy; it returns one :class:`Proposal`,
        ``token_ids [k']`` int64 target ids with ``k' <= k`` and ``probs [k', V]`` float32 or None when
        greedy, drawn with :func:`speculators.losses.sample_draft`); a family either defines
        ``_propose_one`` or overrides this method with a truly batched one (EAGLE-3). Batch 1 is
        ``propose([state], [k], sampling, [generator])[0]``.

        Args:
            states: ``B`` per-request states from :meth:`start` / :meth:`advance`; left as found.
            ks: ``B`` ints >= 0, the max drafts of each request (0 = an empty :class:`Proposal`).
            sampling: the ``B`` requests' :class:`speculators.verify.SamplingParams` (per-request
                temperature / top-k / top-p); ``None`` = all greedy.
            generators: ``B`` generators (or None entries); wins over ``sampling.generators``.
        Returns:
            ``B`` :class:`Proposal` s, in order (request i: ``token_ids [k_i']``, ``k_i' <= k_i``).
        Raises:
            SpeculatorsError: lengths that differ from ``len(states)``, a negative or non-integer ``k``,
                or ``sampling`` that is not ``B`` requests' ``SamplingParams``.
        """
        return propose_each(self._propose_one, states, ks, sampling, generators)

    def advance(self, states: list, new_ids: list[torch.Tensor], features: list) -> None:
        """Append each request's verified tokens (batched ``advance`` of the protocol). Default:
        :func:`advance_each` over the family's ``_advance_one(state, new_ids [m], features)`` (one request's
        ``m`` verified tokens and the target features of its positions ``n..n+m-1``, updating ``state``);
        a family either defines ``_advance_one`` or overrides this method.

        Args:
            states: ``B`` per-request states (updated in place).
            new_ids: ``B`` tensors ``[m_i]`` int64 (accepted drafts + the recovered/bonus token).
            features: ``B`` :class:`speculators.target.TargetFeatures` of positions ``n_i..n_i+m_i-1``.
        Raises:
            SpeculatorsError: the three lists differ in length.
        """
        advance_each(self._advance_one, states, new_ids, features)

    # ---------------------------------------------------------------- training-side state
    def output_heads(self) -> list[nn.Module]:
        """The drafter's own modules that turn a hidden state into (draft-)vocabulary logits, trained or frozen
        (a head borrowed from the target is not the drafter's and is not listed). Shared code asks this
        declaration instead of probing names or shapes: Muon (``train.optimizer: muon``) never takes these
        matrices (:func:`speculators.train.optimizers.muon_split`). Every family declares its own.

        Raises:
            NotImplementedError: a family that does not declare its heads.
        """
        raise NotImplementedError(f"{type(self).__name__}: declare output_heads() (its vocabulary-logit modules)")

    def confidence_calibration(self) -> tuple[torch.Tensor, torch.Tensor] | None:
        """The per-position calibration of the confidence head (:class:`Proposal` ``.confidence_logits``):
        ``(temperature [B] float32 > 0, bias [B] float32)`` (copies, CPU), with the calibrated confidence
        ``sigmoid(z_k / T_k + b_k)`` (:mod:`speculators.calibration`); None for a drafter without a
        confidence head (the default)."""
        return None

    def set_confidence_calibration(self, temperature: torch.Tensor, bias: torch.Tensor | None = None,
                                   where: str = "") -> None:
        """Set the calibration :meth:`confidence_calibration` returns.

        Args:
            temperature: ``[B]`` positive finite temperatures. bias: ``[B]`` finite shifts (None: zeros).
            where: a prefix of the errors (the file an entry came from).
        Raises:
            SpeculatorsError: the drafter has no confidence head (the default), or values of another
                length, a temperature <= 0 or a value that is not finite.
        """
        raise SpeculatorsError(f"the {self.algorithm} drafter has no confidence head: nothing to calibrate")

    def save_pretrained(self, path: str | Path, recipe_yaml: str | None = None,
                        extra_files: dict[str, str] | None = None, overwrite: bool = True,
                        extra=None, target=None) -> Path:
        """Write the checkpoint directory ``path`` atomically (:func:`.checkpoint.save_pretrained`):
        ``config.json``, ``model.safetensors``, ``recipe.yaml`` when given, ``extra_files`` (name -> text),
        and for a joint drafter (:attr:`trains_target`) the target's LoRA adapter ``target_adapter/``, from
        ``target`` (the adapted :class:`speculators.target.Target`) or copied from the checkpoint this
        drafter was loaded from; ``extra(tmp_dir)`` may write more files inside the same rename.

        Raises:
            SpeculatorsError: ``path`` exists and ``overwrite`` is False, or is not a directory; a joint
                drafter with neither an adapted ``target`` nor a loaded adapter.
        """
        return checkpoint.save_pretrained(self, path, recipe_yaml=recipe_yaml, extra_files=extra_files,
                                          overwrite=overwrite, extra=extra, target=target)

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


def full_vocab_drafter(cls: type[Drafter], cfg: DrafterConfig, target, vocab: DraftVocab) -> Drafter:
    """``from_target`` of families that draft through the target's own head over the full vocabulary
    (EAGLE-1, MTP): build ``cls``, copy the (frozen) ``embed_tokens`` from the target, attach the target.

    Raises:
        SpeculatorsError: ``vocab`` is a reduced draft vocabulary (naming ``drafter.draft_vocab_size``).
    """
    if vocab.size != target.vocab_size:
        raise SpeculatorsError(f"drafter.draft_vocab_size: {cls.algorithm} drafts over the full target "
                               f"vocabulary ({target.vocab_size}); got a draft vocabulary of {vocab.size}")
    d = cls(cfg, TargetMeta.from_target(target))
    with torch.no_grad():
        d.embed_tokens.weight.copy_(target.embed_tokens.weight.float())
    d.attach_target(target)
    return d


def check_target(drafter: Drafter, target, warn=None) -> None:
    """Check that ``target`` can serve ``drafter`` (the target facts its checkpoint recorded,
    :class:`TargetMeta`); only checks, never changes ``target``.

    The target must be loaded with the checkpoint's aux layer ids:
    ``Target.load(ref, dtype, aux_layer_ids=drafter.meta.aux_layer_ids)``.

    Args:
        drafter: a :class:`Drafter`. target: a :class:`speculators.target.Target`.
        warn: called with one message when the shapes fit but the weights differ from the training
            target's (fingerprint); ``None`` = no warning.
    Raises:
        SpeculatorsError: the vocab or hidden size differs from the training target's, or the target
            taps other aux layers than the drafter was trained on (naming both lists).
    """
    m = drafter.meta
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
