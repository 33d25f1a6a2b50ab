"""Drafter checkpoints: the directory layout, save/load, and the target facts a checkpoint records.

A checkpoint is a Hugging Face-style directory (FORMATS.md) that vLLM loads as written:

* ``config.json``: the family's serving config (``drafter.serving.config(drafter)``, a
  :class:`~.serving_format.ServingFormat`, built with
  :mod:`speculators.export`), plus ``speculators_version`` and our own block ``speculators_training``
  (vLLM ignores it): ``{"drafter": <the family's config>, "target": <TargetMeta>, "target_adapter":
  <dir, joint runs only>}``;
* ``model.safetensors``: ``serving.state_dict(drafter)`` (the serving engine's weight names, and nothing
  else: a family's training-side state, ``ServingFormat.training_state_tensors`` such as DSpark's confidence
  calibration, is refused there (:func:`check_serving_weights`) and written to ``speculators_training``
  instead (:func:`.training_state.training_state`; read back by
  :func:`.training_state.load_training_state`, which also moves it out of the weights of an earlier
  version's checkpoint)), in full
  precision or, for a published checkpoint (``train.save_dtype``, the trainer's ``final/``), with every
  floating-point weight cast to bfloat16 / float16 (:data:`SAVE_DTYPES`; integer and bool buffers such
  as ``d2t``/``t2d`` keep their dtype) and ``torch_dtype`` in ``config.json`` saying so. Loading casts
  the weights back into the drafter's float32 parameters (:func:`from_pretrained`), so a bf16
  checkpoint evaluates like any other (at bf16's rounding of the weights);
* frozen, unchanged copies of target tensors (``embed_tokens.weight`` of EAGLE-1, MTP:
  ``ServingFormat.frozen_target_weights``) are written in training checkpoints but left out of published ones
  (``final/``): vLLM shares the target's embedding when a draft checkpoint has none, and
  ``attach_target`` restores them from the target (:func:`fill_frozen_copies`). EAGLE-3 publishes its
  copy (``ServingFormat.publish_frozen_copies``: vllm-project/speculators' ``from_pretrained`` would keep zeros
  without it); its ``final/`` directories written by earlier versions without it still load;
* optionally ``recipe.yaml`` (how it was trained), a run card, a joint run's ``target_adapter/``
  (peft LoRA), and a trainer's extra files (optimizer state).

Writes are atomic (``utils.atomic_dir``: a temporary sibling renamed into place); every read refuses
a weight file with a NaN/inf (a diverged run's). ``Drafter.save_pretrained`` / ``Drafter.from_pretrained``
are thin methods over :func:`save_pretrained` / :func:`from_pretrained` (the transformers-style API).
"""

from __future__ import annotations

import json
import warnings
from pathlib import Path
from typing import TYPE_CHECKING, Any, Literal

import torch
from pydantic import BaseModel, ConfigDict, Field, ValidationError
from safetensors.torch import load_file, save_file

from .. import __version__
from ..errors import SpeculatorsError
from ..export import AUX_LAYER_IDS_CONVENTION, vllm_aux_layer_ids, with_lora_verifier
from ..target import ADAPTER_WEIGHTS
from ..utils import atomic_dir
from .training_state import load_training_state, training_state

if TYPE_CHECKING:
    from .base import Drafter

CONFIG_NAME = "config.json"
WEIGHTS_NAME = "model.safetensors"
RECIPE_NAME = "recipe.yaml"
TRAINING_KEY = "speculators_training"  # our own extra block in config.json (vLLM ignores it)
ADAPTER_DIR = "target_adapter"  # a joint run's target LoRA adapter (peft format), beside the drafter
#: ``train.save_dtype`` name -> dtype of the floating-point weights of a published checkpoint.
SAVE_DTYPES: dict[str, torch.dtype] = {"bfloat16": torch.bfloat16, "float16": torch.float16,
                                       "float32": torch.float32}


def save_dtype(name: str | None) -> torch.dtype | None:
    """The weight dtype named by ``train.save_dtype`` (``None`` -> ``None``: full precision, as trained).

    Raises:
        SpeculatorsError: a name outside :data:`SAVE_DTYPES`, naming ``train.save_dtype`` and the allowed ones.
    """
    if name is None:
        return None
    if name not in SAVE_DTYPES:
        raise SpeculatorsError(f"train.save_dtype: {name!r} is not a checkpoint dtype; allowed: {sorted(SAVE_DTYPES)}")
    return SAVE_DTYPES[name]


def cast_weights(weights: dict[str, torch.Tensor], dtype: torch.dtype | None,
                 keep: tuple[str, ...] | frozenset[str] = ()) -> dict[str, torch.Tensor]:
    """``weights`` with every floating-point tensor cast to ``dtype`` (``None``: unchanged); integer and
    bool tensors (``d2t``, ``t2d``, ``token_map``) and the names in ``keep`` (a family's
    ``ServingFormat.full_precision_weights``: constants that bf16 would round to 3 significant digits) keep
    their dtype.

    Raises:
        SpeculatorsError: a finite float32 weight that ``dtype`` cannot hold (float16 beyond +-65504 would
            be written as inf), naming the tensor.
    """
    if dtype is None:
        return dict(weights)
    out = {}
    for name, t in weights.items():
        if t.is_floating_point() and t.dtype != dtype and name not in keep:
            c = t.to(dtype)
            if bool(torch.isfinite(t).all()) and not bool(torch.isfinite(c).all()):
                raise SpeculatorsError(f"train.save_dtype: {name!r} holds values beyond {dtype}'s range "
                                       f"(max |w| = {float(t.abs().max()):.6g}); save in bfloat16 or float32")
            t = c
        out[name] = t.contiguous()
    return out


def adapter_weights_file(path: str | Path) -> Path:
    """The weight file of the target adapter of checkpoint directory ``path`` (a joint run's
    ``target_adapter/adapter_model.safetensors``; it may not exist)."""
    return Path(path) / ADAPTER_DIR / ADAPTER_WEIGHTS


#: ``aux_layer_ids_convention`` sentences written by earlier versions whose tap of the LAST decoder layer
#: (L - 1) may differ from today's (:data:`speculators.export.AUX_LAYER_IDS_CONVENTION`: the PRE-norm
#: residual for every id). Until the pre-norm change, L - 1 was HF ``hidden_states[L]``, i.e. AFTER the
#: final norm; the first pre-norm version still wrote this sentence, so it means "L - 1 may be post-norm".
OLD_AUX_LAYER_IDS_CONVENTIONS = {
    "0-based index of the decoder layer whose OUTPUT is tapped (HF hidden_states[i+1]); vLLM ids = these + 1":
        "read AFTER the target's final norm (HF hidden_states[L])",
}
_WARNED_TAPS: set[tuple[str, int]] = set()  # (config file, layer): warn once per process


#: the target dtypes a checkpoint records (``TargetMeta.dtype``)
TARGET_DTYPE_NAMES = ("float32", "bfloat16", "float16")


def _dtype_name(dtype) -> str | None:
    """``torch.bfloat16`` -> ``"bfloat16"``; None for a dtype a target is never loaded in."""
    name = str(dtype).removeprefix("torch.")
    return name if name in TARGET_DTYPE_NAMES else None


class TargetMeta(BaseModel):
    """What a checkpoint records about the target it was trained for (``speculators_training.target``).

    Immutable; built from a live target with :meth:`from_target`, written with :meth:`to_json` under the
    JSON keys below (plus ``aux_layer_ids_convention``, a sentence for readers), read back with
    :meth:`from_json` (unknown keys ignored; checkpoints that lack the optional facts still load).

    Attributes:
        name_or_path: the verifier name exported configs carry (hub id for the SmolLM2 alias).
        reference: how the target was referenced when training (path, hub id, alias, GGUF file).
        architectures: the target's HF architectures (e.g. ``("LlamaForCausalLM",)``).
        fingerprint: the target's weight/config/template hash (``Target.fingerprint``); eval warns when
            it differs, ``train.init_from`` refuses.
        vocab_size, hidden_size, num_layers: the target's sizes (eval refuses another vocab or hidden size).
        aux_layer_ids: 0-based decoder layers whose OUTPUT the drafter was trained on, in tap order
            (ALGORITHMS.md); eval must load the target with these (``Target.load(..., aux_layer_ids=...)``).
        aux_layer_ids_convention: the convention sentence the checkpoint recorded (None when it recorded
            none: today's is assumed); kept as read, so re-saving an old checkpoint keeps its sentence.
            :meth:`tap_convention_problem` compares it with today's.
        target_config: the target's HF config as a JSON-normalised dict (the drafter's layers copy RoPE,
            eps and sizes from it).
        dtype: the dtype the target ran in when the drafter's data were made (regeneration, features and
            the logit labels: ``"float32"``, ``"bfloat16"`` or ``"float16"``; the resolved ``target.dtype``);
            None when the checkpoint recorded none (an older version: unknown, eval does not warn).
            Written only when known, so an older checkpoint re-saved keeps its keys.
    """

    model_config = ConfigDict(frozen=True, extra="ignore")

    name_or_path: str
    reference: str | None = None
    architectures: tuple[str, ...] = ()
    fingerprint: str | None = None
    vocab_size: int = Field(gt=0)
    hidden_size: int = Field(gt=0)
    num_layers: int | None = Field(default=None, gt=0)
    aux_layer_ids: tuple[int, ...]
    aux_layer_ids_convention: str | None = None
    target_config: dict[str, Any]
    dtype: Literal["float32", "bfloat16", "float16"] | None = None

    @classmethod
    def from_target(cls, target) -> "TargetMeta":
        """The facts of ``target`` (a :class:`speculators.target.Target`). ``target_config`` is stored as
        JSON will hold it (int dict keys become strings), so a loaded checkpoint's meta equals this."""
        return cls(name_or_path=target.verifier_name, reference=target.name_or_path,
                   architectures=list(getattr(target.config, "architectures", None) or [target.architecture]),
                   fingerprint=target.fingerprint, vocab_size=target.vocab_size, hidden_size=target.hidden_size,
                   num_layers=target.num_layers, aux_layer_ids=list(target.aux_layer_ids),
                   aux_layer_ids_convention=AUX_LAYER_IDS_CONVENTION,
                   target_config=json.loads(json.dumps(target.layer_config_dict(), default=str)),
                   dtype=_dtype_name(target.dtype))

    @classmethod
    def from_json(cls, data: Any, where: str = "speculators_training.target") -> "TargetMeta":
        """Read the ``speculators_training.target`` block of a checkpoint's ``config.json``.

        Raises:
            SpeculatorsError: not a JSON object, or a missing/invalid fact, naming ``where`` and the field.
        """
        if not isinstance(data, dict):
            raise SpeculatorsError(f"{where}: expected a JSON object of target facts, got {type(data).__name__}")
        try:
            return cls.model_validate(data)
        except ValidationError as e:
            err = e.errors()[0]
            field = ".".join(str(x) for x in err["loc"])
            raise SpeculatorsError(f"{where}.{field}: {err['msg']}") from None

    def to_json(self) -> dict[str, Any]:
        """The JSON object written to ``config.json`` (the keys and order of every earlier version, then
        ``dtype`` when known)."""
        out = {"name_or_path": self.name_or_path, "reference": self.reference,
               "architectures": list(self.architectures), "fingerprint": self.fingerprint,
               "vocab_size": self.vocab_size, "hidden_size": self.hidden_size, "num_layers": self.num_layers,
               "aux_layer_ids": list(self.aux_layer_ids),
               "aux_layer_ids_convention": self.aux_layer_ids_convention or AUX_LAYER_IDS_CONVENTION,
               "target_config": self.target_config}
        if self.dtype is not None:
            out["dtype"] = self.dtype
        return out

    @property
    def target_refs(self) -> tuple[str, ...]:
        """Where the recorded target may be loaded from, in order: :attr:`reference` (how training referenced it:
        an alias, a path or a GGUF file, which load offline on the machine that trained), then
        :attr:`name_or_path` (the verifier's name, e.g. a Hub id)."""
        return tuple(dict.fromkeys(r for r in (self.reference, self.name_or_path) if r))

    def load_target(self, dtype: str = "float32", log=print):
        """The recorded target (:attr:`target_refs`, the first that loads) in ``dtype`` (a
        :meth:`speculators.target.Target.load` dtype name), tapping :attr:`aux_layer_ids`.

        Raises:
            SpeculatorsError: none of the references loads (every reference tried, with its error).
        """
        from ..target import Target

        errors = []
        for ref in self.target_refs:
            try:
                return Target.load(ref, dtype=dtype, aux_layer_ids=list(self.aux_layer_ids), log=log)
            except SpeculatorsError as e:
                errors.append(f"{ref!r}: {e}")
        raise SpeculatorsError("the recorded target cannot be loaded: " + "; ".join(errors))

    @property
    def target_num_layers(self) -> int | None:
        """L, the target's decoder layers: :attr:`num_layers`, else ``target_config["num_hidden_layers"]``
        (None when neither is recorded)."""
        n = self.num_layers if self.num_layers is not None else self.target_config.get("num_hidden_layers")
        return n if isinstance(n, int) and not isinstance(n, bool) else None

    def tap_convention_problem(self) -> tuple[int, str] | None:
        """Whether the features served today differ from the ones this checkpoint was trained on.

        Today every aux layer, including the last one (L - 1), is tapped PRE-norm
        (:meth:`speculators.target.Target.tap_layers`). A checkpoint whose recorded
        :attr:`aux_layer_ids_convention` is one of :data:`OLD_AUX_LAYER_IDS_CONVENTIONS` and that taps
        L - 1 may have been trained on that layer's POST-norm output.

        Returns:
            ``(layer, message)`` for such a checkpoint (``layer`` = L - 1), else None (today's or no
            recorded convention, an unknown sentence, no L - 1 tap, or L unknown).
        """
        old = OLD_AUX_LAYER_IDS_CONVENTIONS.get(self.aux_layer_ids_convention or "")
        last = self.target_num_layers
        if old is None or last is None or (last - 1) not in self.aux_layer_ids:
            return None
        layer = last - 1
        return layer, (f"aux layer {layer} (the target's last decoder layer, L-1) was recorded under an old "
                       f"aux_layer_ids_convention ({self.aux_layer_ids_convention!r}) in which it may have been "
                       f"{old}; speculators now serves its PRE-norm output ({AUX_LAYER_IDS_CONVENTION!r}), so this "
                       f"drafter may get other features than it was trained on (lower acceptance). Retrain it, "
                       f"or train with aux_layer_ids without {layer}")

    @property
    def vllm_aux_layer_ids(self) -> list[int]:
        """:attr:`aux_layer_ids` in vLLM's convention (+1: the layer whose input is tapped)."""
        return vllm_aux_layer_ids(self.aux_layer_ids)


def read_checkpoint_config(path: str | Path, what: str = "", require_weights: bool = True) -> dict[str, Any]:
    """``config.json`` of the checkpoint directory ``path``, checked to be one written by speculators.

    ``require_weights``: ``model.safetensors`` must sit beside it (a Hub pull checks the config before
    fetching the weights). ``what`` prefixes the error messages (e.g. ``"train.init_from: "``).

    Raises:
        SpeculatorsError: a missing ``config.json`` (or ``model.safetensors``), invalid JSON, or no
            ``speculators_training`` block.
    """
    path = Path(path)
    for name in (CONFIG_NAME, WEIGHTS_NAME) if require_weights else (CONFIG_NAME,):
        if not (path / name).is_file():
            raise SpeculatorsError(f"{what}{path} is not a drafter checkpoint: {name} is missing")
    cfg_file = path / CONFIG_NAME
    try:
        raw = json.loads(cfg_file.read_text())
    except json.JSONDecodeError as e:
        raise SpeculatorsError(f"{what}{cfg_file}: not valid JSON ({e})") from None
    if not isinstance(raw, dict) or not isinstance(raw.get(TRAINING_KEY), dict):
        raise SpeculatorsError(f"{what}{cfg_file}: no {TRAINING_KEY!r} block; not written by speculators")
    return raw


def read_target_meta(raw: dict[str, Any], cfg_file: str | Path) -> TargetMeta:
    """The :class:`TargetMeta` of a checkpoint config ``raw`` (as :func:`read_checkpoint_config` returns).

    A checkpoint written under an old tap convention that taps the target's last layer
    (:meth:`TargetMeta.tap_convention_problem`) loads with a ``UserWarning`` naming ``cfg_file`` and the
    layer, once per file and layer in a process; every other checkpoint loads silently.

    Raises:
        SpeculatorsError: the target block is missing or invalid, naming ``cfg_file`` and the field.
    """
    meta = TargetMeta.from_json(raw[TRAINING_KEY].get("target"), f"{cfg_file}: {TRAINING_KEY}.target")
    problem = meta.tap_convention_problem()
    if problem is not None and (str(cfg_file), problem[0]) not in _WARNED_TAPS:
        _WARNED_TAPS.add((str(cfg_file), problem[0]))
        warnings.warn(f"{cfg_file}: {TRAINING_KEY}.target: {problem[1]}", UserWarning, stacklevel=2)
    return meta


def check_finite_weights(weights: dict[str, torch.Tensor], file: str | Path) -> None:
    """Refuse a checkpoint whose weights are not all finite (a diverged run's).

    Args:
        weights: tensors as read from ``file`` (any dtype; integer tensors are always finite).
        file: the file they came from (named in the error).
    Raises:
        SpeculatorsError: naming ``file``, the first tensor with a NaN/inf and how many of its values are.
    """
    for name, t in weights.items():
        if t.is_floating_point() or t.is_complex():
            bad = ~torch.isfinite(t)
            if bool(bad.any()):
                raise SpeculatorsError(f"{file}: tensor {name!r} has {int(bad.sum())} non-finite (NaN/inf) "
                                       f"value(s) of {t.numel()}; the checkpoint comes from a diverged run "
                                       "and cannot be used")


def load_weights(file: str | Path, what: str = "weights") -> dict[str, torch.Tensor]:
    """Read a safetensors file (CPU tensors) and check that every weight is finite.

    Raises:
        SpeculatorsError: the file cannot be read (``"{file}: cannot read {what} (...)"``) or holds a
            NaN/inf (:func:`check_finite_weights`).
    """
    try:
        weights = load_file(str(file))
    except Exception as e:  # noqa: BLE001 - safetensors raises its own error types
        raise SpeculatorsError(f"{file}: cannot read {what} ({e})") from None
    check_finite_weights(weights, file)
    return weights


def check_weights(path: str | Path) -> None:
    """Check every weight file of checkpoint directory ``path``: ``model.safetensors`` and, when present,
    the target adapter's weights; each must be readable and finite (:func:`load_weights`).

    Raises:
        SpeculatorsError: naming the file that cannot be read, or the file and tensor holding a NaN/inf.
    """
    load_weights(Path(path) / WEIGHTS_NAME)
    adapter = adapter_weights_file(path)
    if adapter.is_file():
        load_weights(adapter, "the adapter weights")


OMITTED_KEY = "omitted_target_weights"  # speculators_training: frozen target copies left out of the weights


def frozen_target_weights(drafter: "Drafter") -> dict[str, str]:
    """``{export weight name: Target attribute}`` of the drafter's frozen, unchanged copies of target tensors
    that its serving format does not need (the family's ``ServingFormat.frozen_target_weights``; e.g. EAGLE-3's
    ``embed_tokens.weight``: vLLM shares the target's embedding when a draft checkpoint has none)."""
    return dict(drafter.serving.frozen_target_weights)


def omittable_target_weights(drafter: "Drafter") -> dict[str, str]:
    """The frozen target copies a published checkpoint of ``drafter`` leaves out: :func:`frozen_target_weights`,
    or none when the family publishes them all the same (``ServingFormat.publish_frozen_copies``, EAGLE-3: what
    vllm-project/speculators' ``from_pretrained`` needs to reproduce the drafts)."""
    return {} if drafter.serving.publish_frozen_copies else frozen_target_weights(drafter)


def complete_frozen_copies(drafter: "Drafter", weights: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """``weights`` plus the drafter's CURRENT value of every frozen target copy they omit
    (:func:`frozen_target_weights`): for a drafter built from its target (resume, ``train.init_from``) that
    value is the target's tensor."""
    missing = [n for n in frozen_target_weights(drafter) if n not in weights]
    if not missing:
        return weights
    current = drafter.serving.state_dict(drafter)
    return {**weights, **{n: current[n] for n in missing}}


def fill_frozen_copies(drafter: "Drafter", target) -> None:
    """Copy the target's tensors into the frozen copies a loaded checkpoint omitted (``Drafter.attach_target``
    calls it; until then they hold NaN so that a drafter used without its target fails visibly).

    Raises:
        SpeculatorsError: the target's tensor has another shape than the drafter's copy (another target).
    """
    missing = drafter.__dict__.get("_frozen_from_target") or ()
    table = frozen_target_weights(drafter)
    for name in list(missing):
        src = getattr(target, table[name])
        src = src.weight if isinstance(src, torch.nn.Module) else src
        dst = drafter.get_parameter(name) if name in dict(drafter.named_parameters()) else drafter.get_buffer(name)
        if tuple(src.shape) != tuple(dst.shape):
            raise SpeculatorsError(f"{name}: the target's {table[name]} has shape {tuple(src.shape)}, the drafter's "
                                   f"copy {tuple(dst.shape)}; load the target this drafter was trained for")
        with torch.no_grad():
            dst.copy_(src.detach())
    drafter.__dict__["_frozen_from_target"] = set()


def check_serving_weights(drafter: "Drafter", weights: dict[str, torch.Tensor], path: str | Path) -> None:
    """Refuse to write training-side state to ``model.safetensors``: every tensor of the weights file must
    be one a serving engine places (vLLM's loader raises "There is no module or parameter named ..." for
    any other name). A family declares its training-side tensors (``ServingFormat.training_state_tensors``, e.g.
    DSpark's ``confidence_temperature`` / ``confidence_bias``); they belong in ``config.json``
    (:func:`.training_state.training_state`).

    Args:
        weights: ``{export name: tensor}`` about to be written. path: the checkpoint (named in the error).
    Raises:
        SpeculatorsError: a training-side tensor among ``weights``, naming it and where it belongs.
    """
    declared = tuple(drafter.serving.training_state_tensors)
    bad = sorted(n for n in weights if n in declared or n.rsplit(".", 1)[-1] in declared)
    if bad:
        raise SpeculatorsError(f"{path}: {bad} is training-side state of the {drafter.algorithm} drafter and may "
                               f"not be written to {WEIGHTS_NAME} (it holds only tensors a serving engine places; "
                               f"vLLM refuses any other name); it belongs in {CONFIG_NAME} ({TRAINING_KEY})")


def checkpoint_config(drafter: "Drafter", dtype: torch.dtype | None = None) -> dict[str, Any]:
    """The ``config.json`` of ``drafter``: its serving format's ``config(drafter)``, ``speculators_version`` and the
    ``speculators_training`` block (family config, :class:`TargetMeta`, and, when the drafter was trained
    jointly with the target (``drafter.trains_target``), the adapter directory ``target_adapter``).
    ``dtype``: the dtype the weights are written in (``torch_dtype`` then names it; None = as exported)."""
    cfg = drafter.serving.config(drafter)
    if dtype is not None and "torch_dtype" in cfg:
        cfg["torch_dtype"] = str(dtype).removeprefix("torch.")
    cfg["speculators_version"] = __version__
    cfg[TRAINING_KEY] = {"drafter": drafter.cfg.model_dump(), "target": drafter.meta.to_json(),
                         **training_state(drafter)}
    if drafter.trains_target:
        cfg[TRAINING_KEY]["target_adapter"] = ADAPTER_DIR
        with_lora_verifier(cfg, ADAPTER_DIR)  # the verifier is the base model with this adapter merged
    return cfg


def save_pretrained(drafter: "Drafter", path: str | Path, recipe_yaml: str | None = None,
                    extra_files: dict[str, str] | None = None, overwrite: bool = True, extra=None,
                    target=None, dtype: str | None = None, frozen_copies: bool = True,
                    provenance: dict | None = None) -> Path:
    """Write ``config.json`` (:func:`checkpoint_config`), ``model.safetensors`` (``serving.state_dict``),
    ``recipe.yaml`` (when given) and ``extra_files`` (name -> text) atomically to ``path``.

    ``dtype`` (``train.save_dtype``: bfloat16 | float16 | float32; None = as trained, exact) is the dtype
    of the floating-point weights (:func:`cast_weights`): published checkpoints use it, resumable
    training checkpoints keep None so that ``--resume`` continues from the exact weights.
    ``frozen_copies=False`` (published checkpoints) leaves out the frozen target copies the serving format
    does not need (:func:`frozen_target_weights`; listed under ``speculators_training.omitted_target_weights``);
    :func:`from_pretrained` then takes them from the target at ``attach_target``. ``provenance`` adds keys to
    the ``speculators_training`` block (the trainer records ``data_producer``: who regenerated the answers).

    ``extra(tmp_dir)`` may write more files (e.g. optimizer state) inside the same atomic rename. A drafter
    trained jointly with its target (``drafter.trains_target``) is only valid with the fine-tuned target, so
    its LoRA adapter is always written beside it, to ``target_adapter/`` (peft format): from ``target``
    (the live adapted :class:`speculators.target.Target`, ``Target.save_adapter``) or, for a drafter loaded
    from a joint checkpoint, copied from that checkpoint's adapter (``drafter.target_adapter_dir``).
    ``target`` is ignored for a frozen-target drafter.

    Raises:
        SpeculatorsError: ``path`` exists and ``overwrite`` is False, or is not a directory; a joint
            drafter without an adapted ``target`` and without a loaded adapter; an unknown ``dtype`` or a
            weight beyond its range (:func:`cast_weights`).
    """
    import shutil

    dt = save_dtype(dtype)
    weights = cast_weights(drafter.serving.state_dict(drafter), dt, tuple(drafter.serving.full_precision_weights))
    check_serving_weights(drafter, weights, path)
    omitted = [] if frozen_copies else sorted(n for n in omittable_target_weights(drafter) if n in weights)
    for name in omitted:
        del weights[name]

    adapter_from = None
    if drafter.trains_target:
        if target is not None and target.adapted:
            adapter_from = target
        elif drafter.target_adapter_dir is not None:
            adapter_from = Path(drafter.target_adapter_dir)
        else:
            raise SpeculatorsError(f"{path}: this drafter was trained with the target (drafter.joint: true) and is "
                                   "only valid with the target's LoRA adapter; save it with the adapted target "
                                   "(TrainingUnit(drafter, target).save(path), or "
                                   "save_pretrained(path, target=target))")
    cfg = checkpoint_config(drafter, dt)
    cfg[TRAINING_KEY].update(provenance or {})
    if omitted:
        cfg[TRAINING_KEY][OMITTED_KEY] = omitted
    with atomic_dir(path, overwrite=overwrite) as tmp:
        (tmp / CONFIG_NAME).write_text(json.dumps(cfg, indent=2, default=str))
        save_file(weights, str(tmp / WEIGHTS_NAME), metadata={"format": "pt"})
        drafter.serving.write_companion_files(drafter, tmp)
        if recipe_yaml is not None:
            (tmp / RECIPE_NAME).write_text(recipe_yaml)
        for name, text in (extra_files or {}).items():
            (tmp / name).write_text(text)
        if isinstance(adapter_from, Path):
            shutil.copytree(adapter_from, tmp / ADAPTER_DIR)
        elif adapter_from is not None:
            adapter_from.save_adapter(tmp / ADAPTER_DIR)
        if extra is not None:
            extra(tmp)
    return Path(path)


def from_pretrained(path: str | Path) -> "Drafter":
    """Load a checkpoint directory written by :func:`save_pretrained` (in eval mode). Weights saved in
    bfloat16 / float16 (``train.save_dtype``) are cast into the drafter's float32 parameters; move the
    drafter to the eval device/dtype afterwards as usual. Frozen target copies the checkpoint omitted
    (``speculators_training.omitted_target_weights``) hold NaN until ``drafter.attach_target(target)``
    copies them from the target (``speculators eval`` does).

    Raises:
        SpeculatorsError: missing directory/files, unknown family, invalid drafter config or target
            facts, weights that do not match, or a NaN/inf in a weight (of the drafter or of a joint
            run's target adapter), naming the file and the tensor.
    """
    from .registry import registry

    path = Path(path)
    cfg_file = path / CONFIG_NAME
    raw = read_checkpoint_config(path)
    block = raw[TRAINING_KEY]
    cls = registry.get((block.get("drafter") or {}).get("algorithm"))
    try:
        cfg = cls.config_class.model_validate(block["drafter"])
    except ValueError as e:  # pydantic ValidationError
        raise SpeculatorsError(f"{cfg_file}: invalid drafter config: {e}".splitlines()[0]) from None
    meta = read_target_meta(raw, cfg_file)
    cls.serving.check_aux_layer_ids(meta.aux_layer_ids, meta.target_num_layers,
                                    f"{cfg_file}: {TRAINING_KEY}.target.aux_layer_ids")
    weights = load_weights(path / WEIGHTS_NAME)
    drafter = cls._build(cfg, meta, weights)
    omitted = [n for n in block.get(OMITTED_KEY) or [] if n in frozen_target_weights(drafter) and n not in weights]
    drafter.serving.load_state_dict(drafter, complete_frozen_copies(drafter, weights) if omitted else weights)
    if omitted:  # taken from the target by attach_target; NaN until then
        with torch.no_grad():
            for name in omitted:
                (drafter.get_parameter(name) if name in dict(drafter.named_parameters())
                 else drafter.get_buffer(name)).fill_(float("nan"))
        drafter.__dict__["_frozen_from_target"] = set(omitted)
    load_training_state(drafter, block, None, f"{cfg_file}: {TRAINING_KEY}")  # e.g. DSpark's calibration
    adapter = block.get("target_adapter")
    if adapter is None and drafter.trains_target:
        raise SpeculatorsError(f"{cfg_file}: a joint checkpoint (drafter.joint: true) without its target adapter "
                               f"({TRAINING_KEY}.target_adapter is missing)")
    if adapter is not None:
        for name in ("adapter_config.json", ADAPTER_WEIGHTS):
            if not (path / adapter / name).is_file():
                raise SpeculatorsError(f"{path}: a joint checkpoint without its target adapter "
                                       f"({path / adapter}/{name} is missing)")
        load_weights(path / adapter / ADAPTER_WEIGHTS, "the adapter weights")
        drafter.target_adapter_dir = path / adapter
    return drafter.eval()


def read_init_weights(path: str | Path, algorithm: str, fingerprint: str | None) -> dict[str, torch.Tensor]:
    """Weights of checkpoint ``path`` for ``train.init_from``: it must be a checkpoint of the family
    ``algorithm`` trained for the target whose fingerprint is ``fingerprint``. A relative path is relative
    to the current working directory.

    Returns:
        The ``model.safetensors`` tensors (export names, CPU, all finite).
    Raises:
        SpeculatorsError: not a checkpoint, another family, another target (fingerprint), or weights that
            cannot be read or are not finite; every message starts with ``train.init_from:``.
    """
    path = Path(path)
    what = "train.init_from: "
    raw = read_checkpoint_config(path, what=what)
    block = raw[TRAINING_KEY]
    algo = (block.get("drafter") or {}).get("algorithm")
    if algo != algorithm:
        raise SpeculatorsError(f"train.init_from: {path} is a {algo!r} checkpoint; this recipe trains "
                               f"{algorithm!r}")
    meta = read_target_meta(raw, f"train.init_from: {path / CONFIG_NAME}")
    if meta.fingerprint != fingerprint:
        raise SpeculatorsError(f"train.init_from: {path} was trained for another target "
                               f"({meta.name_or_path!r}, fingerprint {meta.fingerprint}); "
                               f"this recipe's target has fingerprint {fingerprint}")
    return load_weights(path / WEIGHTS_NAME, "train.init_from weights")


__all__ = ["ADAPTER_DIR", "CONFIG_NAME", "RECIPE_NAME", "SAVE_DTYPES", "TRAINING_KEY", "WEIGHTS_NAME", "TargetMeta",
           "adapter_weights_file", "cast_weights", "check_finite_weights", "check_serving_weights", "complete_frozen_copies", "fill_frozen_copies",
           "frozen_target_weights", "omittable_target_weights", "check_weights", "checkpoint_config", "from_pretrained",
           "load_weights", "read_checkpoint_config", "read_init_weights", "read_target_meta", "save_dtype", "save_pretrained"]


def init_from_checkpoint(drafter: "Drafter", path: str | Path) -> None:
    """Initialise ``drafter``'s weights from another checkpoint of the same family and shapes
    (``train.init_from``: e.g. joint training started from a frozen-target run). The target adapter,
    optimizer and schedule are not taken over. A relative path is relative to the current working directory.

    Raises:
        SpeculatorsError: not a checkpoint, another family, another target (fingerprint), or weights that do
            not fit or are not finite.
    """
    weights = read_init_weights(path, drafter.algorithm, drafter.meta.fingerprint)
    drafter.serving.load_state_dict(drafter, complete_frozen_copies(drafter, weights))
