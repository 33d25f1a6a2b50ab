"""Target features and the layer taps that produce them.

Layer-id convention (ALGORITHMS.md): ``aux_layer_ids`` are 0-based indices of decoder layers whose
OUTPUT is tapped: the PRE-norm residual stream leaving decoder layer ``l`` (read with a forward hook on
decoder layer ``l``; equal to HF ``hidden_states[l + 1]`` for ``l < L - 1``, whereas HF's
``hidden_states[L]`` is taken AFTER the final norm). vLLM / EAGLE count the layer whose INPUT is
tapped: ``vllm_id = our_id + 1`` (for ``L - 1`` vLLM supplies the pre-norm residual too). Both are
recorded in checkpoints.

* :class:`TargetFeatures`: ``aux [B, T, n_aux*H]``, ``top [B, T, H]`` (post-norm), optional logits;
* :func:`default_aux_layer_ids` (EAGLE-3's three taps) and :func:`distinct_layer_ids` (taps made
  distinct and ascending on shallow targets);
* :func:`tap_layers`: the forward hooks behind :meth:`speculators.target.Target.tap_layers`.
"""

from __future__ import annotations

import contextlib
from dataclasses import dataclass

import torch

from ..errors import SpeculatorsError
from .architecture import decoder_layers

def distinct_layer_ids(preferred: list[int], num_layers: int) -> list[int]:
    """``preferred`` taps made distinct and strictly ascending inside ``[0, L - 1]``, each moved as little
    as needed: sorted and clamped, then pushed up past its predecessor and down below its successor (ids
    that already are distinct, ascending and in range come back unchanged).

    Args:
        preferred: n layer ids (any order, may repeat or lie outside the range).
        num_layers: L, the target's decoder layers.
    Returns:
        n distinct ascending ids in ``[0, L - 1]``.
    Raises:
        SpeculatorsError: ``L < n`` (too shallow for n distinct taps), naming both.
    """
    n = len(preferred)
    if num_layers < n:
        raise SpeculatorsError(f"target.aux_layer_ids: a target with {num_layers} decoder layer(s) cannot give {n} "
                               f"distinct aux layers (one tap per layer); use a deeper target")
    ids = sorted(min(max(int(i), 0), num_layers - 1) for i in preferred)
    for j in range(1, n):
        ids[j] = max(ids[j], ids[j - 1] + 1)
    for j in reversed(range(n)):
        ids[j] = min(ids[j], num_layers - 1 if j == n - 1 else ids[j + 1] - 1)
    return ids


def default_aux_layer_ids(num_layers: int) -> list[int]:
    """EAGLE-3 default taps as outputs of layers ``[1, L//2 - 1, L - 4]`` (0-based).

    Equivalent to vLLM's ``eagle_aux_hidden_state_layer_ids = [2, L//2, L - 3]`` (inputs of layers).
    On shallow targets (L < 8) where those repeat a layer or leave the range, the nearest distinct
    ascending ids (:func:`distinct_layer_ids`: ``[0, 1, 2]`` for L = 4); a target of fewer than 3 layers
    taps every layer (``list(range(L))``: too shallow for EAGLE-3's three, which its drafter refuses).
    """
    if num_layers < 3:
        return list(range(num_layers))
    return distinct_layer_ids([1, num_layers // 2 - 1, num_layers - 4], num_layers)

@dataclass
class TargetFeatures:
    """Target features of a batch of sequences.

    Attributes:
        aux: ``[B, T, n_aux * H]`` concatenated aux hidden states: the PRE-norm residual outputs of the
            decoder layers ``aux_layer_ids``, in order (also for the last layer).
        top: ``[B, T, H]`` final hidden state after the target's final norm (input of ``lm_head``).
        logits: ``[B, T, V]`` target logits, or None when not requested.
    """

    aux: torch.Tensor
    top: torch.Tensor
    logits: torch.Tensor | None = None

    def slice(self, start: int, end: int) -> "TargetFeatures":
        """Positions ``[start, end)`` of every batch row (views)."""
        return TargetFeatures(self.aux[:, start:end], self.top[:, start:end],
                              None if self.logits is None else self.logits[:, start:end])

def _layer_output(out) -> torch.Tensor:
    """The hidden state a decoder layer returns (a tensor in transformers 5, a tuple before)."""
    return out[0] if isinstance(out, (tuple, list)) else out


@contextlib.contextmanager
def tap_layers(target):
    """Record the PRE-norm output of every aux layer of ``target`` (a :class:`speculators.target.Target`)
    during the forwards run inside the block.

    Forward hooks on the decoder layers ``i`` (removed on exit) capture the residual stream each
    tapped decoder layer returns, for every id including ``L - 1`` (transformers'
    ``hidden_states[L]`` is post-norm: it is NOT used).

    Yields:
        an object whose ``aux()`` returns ``[B, T, n_aux * H]``: the last captured output of each
        aux layer, concatenated in ``aux_layer_ids`` order, on ``target.device`` (each tap is moved
        there from its layer's device when a ``device_map`` spread the layers).
    """
    captured: dict[int, torch.Tensor] = {}
    layers = decoder_layers(target.model)
    handles = []

    def hook_for(i):
        def hook(_module, _args, output):
            captured[i] = _layer_output(output)
        return hook

    for i in sorted(set(target.aux_layer_ids)):
        handles.append(layers[i].register_forward_hook(hook_for(i)))

    class _Taps:
        @staticmethod
        def aux() -> torch.Tensor:
            missing = [i for i in target.aux_layer_ids if i not in captured]
            if missing:
                raise SpeculatorsError(f"target.aux_layer_ids: layers {missing} did not run in the forward")
            dev = target.device
            return torch.cat([captured[i].to(dev) for i in target.aux_layer_ids], dim=-1)

    try:
        yield _Taps()
    finally:
        for h in handles:
            h.remove()
