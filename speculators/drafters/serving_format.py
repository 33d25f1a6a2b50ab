"""A drafter family's serving format: its checkpoint as a serving engine (vLLM) sees it.

:class:`speculators.drafters.base.Drafter` is the model (what trains and drafts); its :class:`ServingFormat`
is how a checkpoint of it is written and read: the ``config.json`` vLLM loads (:meth:`ServingFormat.config`,
built with the helpers of :mod:`speculators.export`), the weights under the engine's names
(:meth:`~ServingFormat.state_dict` / :meth:`~ServingFormat.load_state_dict`, with the renames of earlier
versions), how vLLM serves a written config (:meth:`~ServingFormat.vllm_serving`,
:meth:`~ServingFormat.speculative_tokens`), the target taps the format allows
(:meth:`~ServingFormat.check_aux_layer_ids`, :meth:`~ServingFormat.default_aux_layer_ids`), which weights a
published checkpoint leaves out or keeps in full precision, and the reference implementation's first drafting
step (:meth:`~ServingFormat.reference_parity_step`, the export gate's).

Each family declares ONE instance of its own subclass, in its family file, as the class attribute
``serving`` (``serving: ClassVar[ServingFormat] = Eagle3Format()``), with ``algorithm`` equal to the
drafter's (:func:`speculators.drafters.registry.register` checks it). Config-level methods take a written
``config.json`` or weights; drafter-level methods take the drafter as their first argument
(``drafter.serving.config(drafter)``). The directory itself (atomic write, dtypes, frozen copies, finite
checks) is :mod:`speculators.drafters.checkpoint`'s.
"""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING, Any, ClassVar

import torch

from .. import export
from ..errors import SpeculatorsError
from .training_state import load_training_state

if TYPE_CHECKING:
    from .base import Drafter, DrafterConfig


class ServingFormat:
    """The base of every family's serving format (see the module docstring). Stateless: a family's
    subclass sets the class attributes below and overrides the methods its layout changes."""

    #: the family this format writes (the drafter's ``algorithm``)
    algorithm: ClassVar[str] = ""
    vllm_method: ClassVar[str | None] = None  # vLLM's --speculative-config "method" for this format
    #: further ``--speculative-config`` keys vLLM needs to serve this layout as trained (P-EAGLE:
    #: ``parallel_drafting``; with an explicit ``method`` vLLM does not infer it from the checkpoint)
    vllm_extra: ClassVar[dict[str, Any]] = {}
    vllm_note: ClassVar[str] = ""  # why vLLM cannot load it as written (when vllm_method is None)
    #: llama-server's ``--spec-type`` for this format's GGUF (llama.cpp's ``common/speculative.cpp``), or None
    #: when llama.cpp cannot serve it (:attr:`llamacpp_note` says why); :mod:`speculators.engines.gguf_export`
    llamacpp_spec_type: ClassVar[str | None] = None
    llamacpp_note: ClassVar[str] = "llama.cpp has no speculative type that runs this family's drafter"
    # whether vLLM drafts trees (speculative_token_tree) for this format: its EAGLE proposer's tree drafting
    vllm_tree: ClassVar[bool] = False
    #: the ``config.json`` key of the aux layer ids in vLLM's convention (None: the format has none)
    serving_aux_ids_key: ClassVar[str | None] = None
    #: ``{export weight name: Target attribute}``: frozen, unchanged copies of target tensors that the serving
    #: format does not need (the engine shares the target's), left out of published checkpoints and restored
    #: from the target by ``Drafter.attach_target`` (:func:`.checkpoint.fill_frozen_copies`).
    frozen_target_weights: ClassVar[dict[str, str]] = {}
    #: True when published checkpoints keep :attr:`frozen_target_weights` all the same (EAGLE-3: the reference
    #: library, vllm-project/speculators, does not take the embedding from the target); the table then only
    #: lets checkpoints of earlier versions that omitted them load (:func:`.checkpoint.omittable_target_weights`).
    publish_frozen_copies: ClassVar[bool] = False
    #: export weight names that a published checkpoint keeps in their trained dtype whatever
    #: ``train.save_dtype`` says (:func:`.checkpoint.cast_weights`; none today: calibration constants are config keys).
    full_precision_weights: ClassVar[tuple[str, ...]] = ()
    #: ``{name an earlier version exported: today's name}``, renamed when weights are read
    #: (:meth:`load_state_dict`); e.g. EAGLE-3's ``fc_norm.weight``, today ``input_norm.weight``.
    legacy_weight_names: ClassVar[dict[str, str]] = {}
    #: names of the drafter's training-side tensors (non-persistent buffers, e.g. DSpark's confidence
    #: calibration): never written to ``model.safetensors``, which holds only what a serving engine places
    #: (vLLM refuses a name it cannot place); they go to ``config.json``
    #: (:func:`.training_state.training_state`) and the checkpoint writer refuses them in the weights (:func:`.checkpoint.check_serving_weights`). Found in
    #: the weights of an earlier version's checkpoint, they are read and moved (:meth:`load_state_dict`).
    training_state_tensors: ClassVar[tuple[str, ...]] = ()
    #: ``(min, max)`` number of aux layers the format allows (max None: any). Default: any (families that
    #: read no aux hidden state: EAGLE-1, Medusa, MTP); EAGLE-3 / P-EAGLE: exactly 3 (vLLM sizes the
    #: speculators format's ``fc`` as 3 x hidden); DFlash / DSpark: >= 1 (``fc`` is n x hidden).
    aux_layer_count: ClassVar[tuple[int, int | None]] = (0, None)
    aux_layer_count_reason: ClassVar[str] = ""  # why, in the error of check_aux_layer_ids

    def __repr__(self) -> str:
        return f"{type(self).__name__}(algorithm={self.algorithm!r})"

    # ---------------------------------------------------------------- a written config / weights
    def vllm_serving(self, config: dict[str, Any]) -> tuple[str | None, str]:
        """How vLLM serves a checkpoint of this family whose ``config.json`` is ``config``.

        Returns ``(method, note)`` (:func:`speculators.export.vllm_serving`): ``method`` is the
        ``--speculative-config`` ``"method"`` vLLM accepts for this layout, or ``None`` when vLLM cannot
        load the checkpoint as written (``note`` says why and what to do). Default: the format's
        :attr:`vllm_method` / :attr:`vllm_note`; a family with several layouts overrides this.
        """
        return export.vllm_serving(self.algorithm, self.vllm_method, self.vllm_note)

    def vllm_speculative_config(self, config: dict[str, Any], model: str, k: int) -> dict[str, Any] | None:
        """vLLM's ``--speculative-config`` that serves the checkpoint ``model`` (a directory or Hub id whose
        ``config.json`` is ``config``) at ``k`` drafts per step as it was trained: ``{"model", "num_speculative_tokens",
        "method", **vllm_extra}``; ``None`` where :meth:`vllm_serving` gives no method. Every place that starts or
        prints a vLLM engine for a checkpoint (the gate, the eval, the model card) builds its config here."""
        method, _ = self.vllm_serving(config)
        if method is None:
            return None
        return {"model": str(model), "num_speculative_tokens": int(k), "method": method, **self.vllm_extra}

    def check_llamacpp(self, config: dict[str, Any], where: str) -> None:
        """Refuse a checkpoint (its ``config.json``) whose settings llama.cpp's graph for this family would
        silently ignore (default: none). Called by :func:`speculators.engines.gguf_export.export_gguf`.

        Raises:
            SpeculatorsError: naming ``where``, the setting and why.
        """

    def llamacpp_converter_config(self, config: dict[str, Any]) -> dict[str, Any]:
        """Keys that llama.cpp's ``convert_hf_to_gguf.py`` must read in place of this checkpoint's own (a view
        of ``config.json``; the checkpoint is never changed), e.g. which of the converter's registered
        architectures reads this layout. Default: none (the converter reads the export as written)."""
        return {}

    def llamacpp_max_draft(self, config: dict[str, Any]) -> int | None:
        """The largest ``--spec-draft-n-max`` llama.cpp serves this checkpoint with (it clamps a larger one
        silently, so a sweep must stop there); None: no bound of the format's own."""
        return None

    def llamacpp_p_min_note(self, config: dict[str, Any]) -> str | None:
        """Why ``--spec-draft-p-min`` cannot be used with this checkpoint in llama.cpp (None: it can)."""
        return None

    def speculative_tokens(self, config: dict[str, Any]) -> int | None:
        """K (``num_speculative_tokens``) that a checkpoint's ``config.json`` declares
        (:func:`speculators.export.speculative_tokens`); ``None`` when the layout does not say. A family
        with its own layout overrides this."""
        return export.speculative_tokens(config)

    def upgrade_legacy_weights(self, sd: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        """``sd`` with every name of :attr:`legacy_weight_names` renamed to today's (a copy; ``sd`` as it is
        when it holds none). A checkpoint holding both names keeps today's tensor.

        Args:
            sd: ``{export name: tensor}`` as read from a checkpoint.
        """
        old = [n for n in self.legacy_weight_names if n in sd]
        if not old:
            return sd
        out = dict(sd)
        for name in old:
            t = out.pop(name)
            out.setdefault(self.legacy_weight_names[name], t)
        return out

    def draft_vocab_size_of(self, weights: dict[str, torch.Tensor]) -> int:
        """The draft vocabulary size of a checkpoint's weights: ``lm_head.weight``'s row count.

        Raises:
            SpeculatorsError: the weights have no ``lm_head.weight``.
        """
        if "lm_head.weight" not in weights:
            raise SpeculatorsError(f"{self.algorithm} checkpoint: model.safetensors has no 'lm_head.weight' "
                                   "(needed for the draft vocabulary size)")
        return int(weights["lm_head.weight"].shape[0])

    # ---------------------------------------------------------------- the target taps
    def check_aux_layer_ids(self, ids, num_layers: int | None = None, where: str = "target.aux_layer_ids") -> list[int]:
        """Validate the target taps of this family (the one check of the recipe, the defaults, a new
        drafter and a loaded checkpoint): distinct 0-based layer ids in strictly ascending order (vLLM
        collects the tapped states once per layer, in layer order), each in ``[0, L - 1]`` when L
        (``num_layers``) is known, and as many as :attr:`aux_layer_count` allows.

        Returns:
            ``ids`` as a list of ints.
        Raises:
            SpeculatorsError: ONE error naming ``where``, what is wrong (repeated, unsorted, out of range,
                too many/few, a target too shallow) and what is allowed.
        """
        ids = list(ids)
        lo, hi = self.aux_layer_count
        problems = []
        if any(isinstance(i, bool) or not isinstance(i, int) for i in ids):
            problems.append("not all integers")
        else:
            if len(set(ids)) != len(ids):
                problems.append(f"layer(s) {sorted({i for i in ids if ids.count(i) > 1})} repeated")
            elif ids != sorted(ids):
                problems.append("not in ascending order")
            bad = [i for i in ids if i < 0 or (num_layers is not None and i >= num_layers)]
            if bad:
                problems.append(f"layer(s) {bad} outside [0, {'L - 1' if num_layers is None else num_layers - 1}]")
        if len(ids) < lo or (hi is not None and len(ids) > hi):
            want = f"exactly {lo}" if lo == hi else f"at least {lo}" if hi is None else f"{lo} to {hi}"
            why = f" ({self.aux_layer_count_reason})" if self.aux_layer_count_reason else ""
            problems.append(f"{len(ids)} layer(s) where the {self.algorithm} format takes {want}{why}")
            if num_layers is not None and num_layers < lo:
                problems.append(f"a target of {num_layers} decoder layer(s) is too shallow for {lo} distinct taps")
        if problems:
            rng = "[0, L - 1]" if num_layers is None else f"[0, {num_layers - 1}]"
            count = (f"exactly {lo}" if lo == hi else f"{lo} or more" if hi is None else f"{lo} to {hi}")
            raise SpeculatorsError(f"{where}: {ids}: {'; '.join(problems)}. Allowed: {count} distinct 0-based "
                                   f"decoder-layer ids (outputs tapped) in strictly ascending order, each in {rng}")
        return ids

    def default_aux_layer_ids(self, num_layers: int, cfg: DrafterConfig | None) -> list[int]:
        """The target taps (0-based OUTPUT-of-layer ids) this family trains on when the recipe leaves
        ``target.aux_layer_ids`` unset; ``num_layers`` is the target's decoder-layer count, ``cfg`` the
        family's drafter config. Default: EAGLE-3's three (:func:`speculators.target.default_aux_layer_ids`,
        distinct and ascending on every target of >= 3 layers); families override it. Always distinct,
        ascending, in range and of a count :meth:`check_aux_layer_ids` accepts.

        Raises:
            SpeculatorsError: a target too shallow for the family's taps (naming ``target.aux_layer_ids``).
        """
        from ..target import default_aux_layer_ids

        return self.check_aux_layer_ids(default_aux_layer_ids(num_layers), num_layers)

    # ---------------------------------------------------------------- a drafter's checkpoint
    def config(self, drafter: Drafter) -> dict[str, Any]:
        """``config.json`` of ``drafter`` in the format vLLM loads (FORMATS.md), built with the helpers of
        :mod:`speculators.export` (:func:`.checkpoint.checkpoint_config` adds our own block)."""
        raise NotImplementedError

    def state_dict(self, drafter: Drafter) -> dict[str, torch.Tensor]:
        """``drafter``'s weights under the names vLLM expects (default: the module's own state dict,
        detached and contiguous)."""
        return {k: v.detach().contiguous() for k, v in drafter.state_dict().items()}

    def load_state_dict(self, drafter: Drafter, sd: dict[str, torch.Tensor]) -> None:
        """Load weights written by :meth:`state_dict` into ``drafter`` (or by an earlier version: names in
        :attr:`legacy_weight_names` are renamed first). Tensors the family declares as training-side
        state (:attr:`training_state_tensors`) are not expected here: they live in ``config.json``
        (:func:`.training_state.load_training_state`), and those an earlier version wrote here are moved there.

        Raises:
            SpeculatorsError: missing/unexpected names or shapes that do not match this config.
        """
        sd = self.upgrade_legacy_weights(sd)
        legacy = {n: sd[n] for n in self.training_state_tensors if n in sd}  # earlier versions wrote them here
        if legacy:
            sd = {n: t for n, t in sd.items() if n not in legacy}
        try:
            missing, unexpected = drafter.load_state_dict(sd, strict=False)
        except RuntimeError as e:
            raise SpeculatorsError(f"checkpoint weights do not match this {self.algorithm} config: "
                                   f"{str(e).splitlines()[-1].strip()}") from None
        if missing or unexpected:
            raise SpeculatorsError(f"checkpoint weights do not match {self.algorithm}: "
                                   f"missing {missing[:5]}, unexpected {unexpected[:5]}")
        if legacy:
            load_training_state(drafter, {}, legacy)

    def write_companion_files(self, drafter: Drafter, directory: Path) -> None:
        """Write the files a serving engine reads beside ``config.json`` and ``model.safetensors`` into
        ``directory`` (inside :func:`speculators.drafters.checkpoint.save_pretrained`'s atomic write). Default:
        none; a draft model writes the target's tokenizer files."""

    def reference_parity_step(self, drafter: Drafter, config: dict[str, Any], ids: list[int], feats_ours,
                              feats_ref):
        """``drafter``'s first drafting step on one sequence, and how the reference implementation
        (vllm-project/speculators) computes the same step: a
        :class:`speculators.drafters.parity_inputs.ParityStep`, or None when the reference has no model
        for this family in our export layout (the default). Used by the export gate
        (:mod:`speculators.export.parity`).

        Args:
            drafter: the drafter whose checkpoint ``config`` is.
            config: the checkpoint's ``config.json``. ids: the sequence, ``T`` token ids.
            feats_ours / feats_ref: the target's :class:`speculators.target.TargetFeatures` of the ``T``
                positions tapped at this drafter's layers / at the layers the config names.
        """
        return None


__all__ = ["ServingFormat"]
