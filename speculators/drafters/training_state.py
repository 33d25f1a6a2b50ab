"""A drafter's training-side state in ``config.json`` (the ``speculators_training`` block, which engines ignore).

Today that state is the calibration of a confidence head (DSpark, :mod:`speculators.calibration`): the
per-slot ``(temperature, bias)`` of ``sigmoid(z_k / T_k + b_k)``, read and set through the drafter's declared
interface ``confidence_calibration()`` / ``set_confidence_calibration(...)``. It never goes to
``model.safetensors``, which holds only what a serving engine places (vLLM refuses a name it cannot place);
checkpoints of earlier versions that wrote it there as tensors (``ServingFormat.training_state_tensors``) are
read and moved (:func:`load_training_state`'s ``legacy``).
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import TYPE_CHECKING, Any

import torch

from ..errors import SpeculatorsError

if TYPE_CHECKING:
    from .base import Drafter

CALIBRATION_KEY = "confidence_calibration"  # speculators_training entry of the confidence calibration


def training_state(drafter: Drafter) -> dict[str, Any]:
    """JSON entries of ``drafter``'s training-side state for ``speculators_training``:
    ``{"confidence_calibration": {"temperature": [B], "bias": [B]}}`` (float32 values as JSON numbers, exact)
    for a drafter with a confidence head, else ``{}``."""
    cal = drafter.confidence_calibration()
    if cal is None:
        return {}
    return {CALIBRATION_KEY: {"temperature": cal[0].tolist(), "bias": cal[1].tolist()}}


def load_training_state(drafter: Drafter, entries: Mapping[str, Any] | None,
                        legacy: Mapping[str, torch.Tensor] | None = None, where: str = "config.json") -> None:
    """Read back :func:`training_state` into ``drafter``: the ``confidence_calibration`` entry of ``entries``
    (the checkpoint's ``speculators_training`` block), else the ``confidence_temperature`` /
    ``confidence_bias`` tensors an earlier version wrote to ``model.safetensors`` (``legacy``; a checkpoint
    written before shifts existed: every shift 0), else unchanged. Nothing to read for a drafter without a
    confidence head (``confidence_calibration()`` is None).

    Raises:
        SpeculatorsError: an entry that is not ``{"temperature": [B], "bias": [B]}`` valid values, naming
            ``where`` and the entry.
    """
    if drafter.confidence_calibration() is None:
        return
    entry = (entries or {}).get(CALIBRATION_KEY)
    if entry is not None:
        if not isinstance(entry, dict) or "temperature" not in entry:
            raise SpeculatorsError(f"{where}.{CALIBRATION_KEY}: expected {{'temperature': [...], 'bias': [...]}}, "
                                   f"got {entry!r}")
        try:
            t = torch.tensor(entry["temperature"], dtype=torch.float32)
            b = None if entry.get("bias") is None else torch.tensor(entry["bias"], dtype=torch.float32)
        except (TypeError, ValueError):
            raise SpeculatorsError(f"{where}.{CALIBRATION_KEY}: temperature and bias must be lists of numbers, "
                                   f"got {entry!r}") from None
        drafter.set_confidence_calibration(t, b, where=f"{where}.{CALIBRATION_KEY}: ")
    elif legacy and "confidence_temperature" in legacy:
        drafter.set_confidence_calibration(legacy["confidence_temperature"], legacy.get("confidence_bias"),
                                           where=f"{where} (model.safetensors of an earlier version): ")
