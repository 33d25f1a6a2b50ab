"""DSpark (arXiv 2607.05147): the DFlash backbone drafting from the anchor, a Markov (previous-token)
correction of the logits, and a confidence head.

Built on :class:`speculators.drafters.dflash.DFlashDrafter` (the context injection, the block, the
one-forward block-sparse training path, the anchors, the context cache and ``start`` / ``advance`` are
DFlash's, unchanged; see that module's docstring). What DSpark changes (ALGORITHMS.md "DSpark"):

* ``sample_from_anchor``: the block ``[x_a, MASK x (B-1)]`` at positions ``a..a+B-1`` gives ``B`` drafts;
  slot ``k`` (0..B-1) predicts ``x_{a+k+1}`` (DFlash: slot k predicts ``x_{a+k}``, slot 0 untrained).
  At inference the anchor is the newest token ``x_n`` and slot k drafts ``x_{n+k+1}``, so
  ``num_speculative_tokens = B``.
* Markov head (``markov_head_type: vanilla``; gated / rnn are rejected by the config):
  ``logits_k = head(h_k) + W2(W1[x_{k-1}])`` with ``W1 = markov_head.markov_w1: Embedding(V, r)``
  (indexed by TARGET ids), ``W2 = markov_head.markov_w2: Linear(r -> N, no bias)`` (N = draft
  vocabulary), ``r = markov_rank`` and ``x_{-1} = x_a`` (the anchor). ``W2`` starts at zero, so a fresh
  drafter is the DFlash backbone; ``W1`` starts as ``N(0, 1)`` (``nn.Embedding``'s default).
* Confidence head (``enable_confidence_head``): ``c_k = sigmoid(confidence_head.proj([h_k; W1[x_{k-1}]]))``
  (``confidence_head_with_markov: true``, ``proj: Linear(H + r -> 1)``) or ``sigmoid(proj(h_k))``
  (``Linear(H -> 1)``): the conditional probability that draft k is accepted given that drafts
  ``0..k-1`` were. It reads only ``h_k`` and the previous token, never ``x_k``, so a proposer may stop
  drafting on it without changing the output distribution. The calibration
  (:meth:`DSparkDrafter.confidence_calibration`: ``confidence_temperature`` ``[B]``, ones until
  calibrated, and ``confidence_bias`` ``[B]``, zeros until calibrated, float32) gives the calibrated
  confidence ``sigmoid(logit_k / T_k + b_k)`` (:func:`calibrated_confidences`,
  :meth:`DSparkDrafter.confidences`, :mod:`speculators.calibration`). It is training-side state
  (non-persistent buffers, ``training_state_tensors``): written to ``config.json`` as
  ``speculators_training.confidence_calibration = {"temperature": [B], "bias": [B]}``, never to
  ``model.safetensors`` (vLLM's DSpark loader cannot place it and applies no calibration). A checkpoint
  of an earlier version that holds the tensors in its weights file loads them (moved into the drafter; a
  missing ``confidence_bias`` reads as zeros).

Training (:meth:`DSparkDrafter.loss`): DFlash's anchors and one forward; the Markov input of slot k is
teacher-forced with the DATA token ``x_{a+k}`` (``x_a`` for slot 0): the prefix the target's
distribution at ``a+k`` is conditioned on (for ``labels: token`` it is also slot k-1's label). Per
supervised (anchor, slot k) pair, with ``z`` the corrected logits over the draft vocabulary:

* ``CE``: cross entropy of ``z`` to the label (``labels: token``: ``x_{a+k+1}``; ``argmax``: the
  target's greedy token at ``a+k``, ``Batch.argmax``);
* ``L1 = ||softmax(z) - p_target||_1`` where ``p_target`` is the target's next-token distribution at
  position ``a+k`` (``softmax(lm_head(Batch.top[a+k]))``, the frozen target head as every family's
  teacher), restricted to the draft vocabulary and renormalised (ALGORITHMS.md "Draft vocabulary").
  Both distributions therefore live on the N draft ids; with the full vocabulary (N = V) this is
  exactly twice the total variation, and ``1 - 0.5 * L1`` is the probability that a draft sampled
  from ``softmax(z)`` is accepted by the verifier at temperature 1. With a reduced vocabulary the
  target's mass outside it is left out (the label then overstates acceptance by at most that mass;
  the calibration temperatures absorb the bias);
* ``BCE(c_k, y_k)`` with the soft label ``y_k = 1 - 0.5 * L1`` DETACHED (:func:`confidence_label`):
  the confidence learns to predict the acceptance probability, it does not push the draft towards
  being easy to predict. That is the acceptance of a draft SAMPLED from ``p_draft`` at temperature 1
  (ALGORITHMS.md). ``confidence_label: greedy`` (a departure, for drafters served at temperature 0)
  uses instead the hard label ``y_k = 1[argmax z == the target's greedy token at a+k]``
  (:func:`greedy_confidence_label`): on greedy-regenerated spans (where the data tokens are the
  target's greedy tokens, so the teacher-forced prefix is the one a run accepted) exactly whether the
  greedy verifier accepts slot k's draft given that the drafts before it were accepted. As for ``tv``,
  only pairs whose label token is in the draft vocabulary enter the loss (a target token outside it is
  a sure reject at inference that the head is not shown: ~1% with the recipe's 4096 words).

``loss = sum_k exp(-k / position_decay) * (ce_weight * CE_k + l1_weight * L1_k + bce_weight * BCE_k)
/ norm[k]`` over slots k = 0..B-1 (defaults 0.1 / 0.9 / 1.0, decay 4), the sums running over the
supervised pairs of slot k (slot inside the sequence, loss-masked, label in the draft vocabulary):
one term per slot for the count normalisation (:meth:`Drafter.loss`, ``loss_counts`` = DFlash's with
``sample_from_anchor``).

Inference (:meth:`DSparkDrafter._propose_one`): ONE backbone forward of the block of ``k`` slots
(DFlash's ``block_hidden``; vLLM serves ``num_speculative_tokens = k`` as a block of k slots, shorter
than the trained one when ``k < B``), the frozen head over its slots, then k cheap sequential steps: step j adds
``W2(W1[x_{j-1}])`` to slot j's logits and draws ``x_j`` with :func:`speculators.losses.sample_draft`
under the request's sampling settings (greedy argmax, or the verifier's temperature/top-k/top-p
transform with the request's generator; the ``[k, V]`` draft distributions are returned), and reads
the confidence logit of slot j. Nothing is written to the state.

Export (``speculators_model_type: dspark``, FORMATS.md): DFlash's keys with ``sample_from_anchor: true``
and ``speculative_tokens = block_size``, plus ``markov_rank``, ``markov_head_type``,
``enable_confidence_head``, ``confidence_head_with_markov``; weights add ``markov_head.markov_w1.weight
[V, r]``, ``markov_head.markov_w2.weight [N, r]``, ``confidence_head.proj.{weight,bias} [1, H+r]``
(``[1, H]`` without the Markov input); the calibration goes to ``speculators_training`` (above).
vLLM serves it as ``method: dspark``.
"""

from __future__ import annotations

import math
from typing import Any, ClassVar, Literal

import torch
import torch.nn.functional as F
from pydantic import Field, field_validator, model_validator
from torch import nn

from .. import export
from ..errors import SpeculatorsError
from ..losses import chained_acceptance, combine_terms, hard_cross_entropy, sample_draft, target_to_draft
from ..verify import SamplingParams
from ..decode.proposal import Proposal, calibrated_confidence_logits
from .checkpoint import TargetMeta
from .registry import register
from .dflash import DFlashBlockConfig, DFlashDrafter, DFlashState
from .dflash_format import DFlashFormat

MARKOV_HEAD_TYPES = ("vanilla",)  # implemented; the paper's "gated" and "rnn" variants are not


def calibrated_confidences(logits: torch.Tensor, temperature: torch.Tensor,
                           bias: torch.Tensor | None = None) -> torch.Tensor:
    """Calibrated conditional confidences ``c_k = sigmoid(logits[k] / temperature[k] + bias[k])``.

    Args:
        logits: ``[k]`` float raw confidence logits of drafts ``0..k-1`` (``Proposal.confidence_logits``).
        temperature: ``[>= k]`` float per-slot temperatures (> 0), the drafter's
            ``confidence_temperature`` ``[block_size]`` buffer (ones = uncalibrated); its first k are used.
        bias: ``[>= k]`` float per-slot shifts (Platt scaling), the drafter's ``confidence_bias`` buffer
            (zeros = uncalibrated), or None (all 0).
    Returns:
        ``[k]`` float32 on ``logits``' device: P(draft k accepted | drafts 0..k-1 accepted); the
        survival probability of drafts 0..k is their cumulative product.
    Raises:
        SpeculatorsError: ``logits`` not 1-D, fewer temperatures or shifts than logits, a temperature <= 0
            or a shift that is not finite.
    """
    if logits.dim() != 1:
        raise SpeculatorsError(f"calibrated_confidences: logits must be [k], got shape {tuple(logits.shape)}")
    return torch.sigmoid(calibrated_confidence_logits(logits, temperature, bias))


def greedy_confidence_label(draft_ids: torch.Tensor, target_argmax: torch.Tensor) -> torch.Tensor:
    """The confidence head's hard BCE label for greedy serving (``confidence_label: greedy``): 1.0 where
    the draft's top-1 token equals the target's greedy token, else 0.0 (greedy verification accepts
    exactly those; a target token outside a reduced draft vocabulary is never matched).

    Args:
        draft_ids: ``[n]`` int64 argmax drafts in TARGET ids.
        target_argmax: ``[n]`` int64 the target's greedy ids at the same positions.
    Returns:
        ``[n]`` float32 in {0, 1}, no gradient.
    Raises:
        RuntimeError: shapes that do not broadcast (torch's comparison).
    """
    return (draft_ids == target_argmax).float()


def confidence_label(l1: torch.Tensor) -> torch.Tensor:
    """The confidence head's soft BCE label ``1 - 0.5 * l1`` (the acceptance probability of a draft
    sampled from ``p_draft`` when the target is ``p_target``, ``l1 = ||p_draft - p_target||_1``),
    DETACHED: no gradient reaches ``p_draft`` through the label. ``[n]`` float -> ``[n]`` float in [0, 1]."""
    return (1.0 - 0.5 * l1.detach()).clamp(0.0, 1.0)


class DSparkConfig(DFlashBlockConfig):
    """``drafter:`` section of a DSpark recipe: the DFlash backbone keys (:class:`DFlashBlockConfig`;
    here one forward drafts ``block_size`` tokens, ``labels: token`` is ``x_{a+k+1}``, ``argmax`` the
    target's greedy token at ``a+k``) plus

    Keys:
        markov_rank: r, the Markov head's rank (``W1: Embedding(V, r)``, ``W2: Linear(r -> N)``), >= 1.
        markov_head_type: ``vanilla`` (the only one implemented; ``gated`` / ``rnn`` are refused).
        enable_confidence_head: train and report the confidence head (``Proposal.confidence_logits``).
        confidence_head_with_markov: the confidence head reads ``[h_k; W1[x_{k-1}]]`` (else ``h_k``).
        ce_weight, l1_weight, bce_weight: loss weights of CE, ``||p_draft - p_target||_1`` and the
            confidence BCE (>= 0; 0.1 / 0.9 / 1.0; ce + l1 must be > 0).
        position_decay: slot k's weight ``exp(-k / position_decay)``, k from 0 (> 0; default 4).
        confidence_label: the BCE label of the confidence head: ``tv`` (default, ALGORITHMS.md: the
            detached ``1 - 0.5 * L1``, acceptance at temperature 1) or ``greedy`` (1 when the
            teacher-forced top-1 draft is the target's greedy token: acceptance at temperature 0).
    """

    algorithm: Literal["dspark"] = "dspark"
    markov_rank: int = Field(default=256, description="rank r of the Markov head `W2(W1[x_{k-1}])` (>= 1)")
    markov_head_type: str = Field(default="vanilla", description="Markov head variant: `vanilla` (the only one "
                                                                 "implemented; `gated` / `rnn` are refused)")
    enable_confidence_head: bool = Field(default=True, description="train and report the confidence head c_k")
    confidence_head_with_markov: bool = Field(default=True, description="c_k reads `[h_k; W1[x_{k-1}]]` (false: "
                                                                        "`h_k` only)")
    ce_weight: float = Field(default=0.1, ge=0.0, description="weight of the CE term (`ce_weight` and `l1_weight` "
                                                              "cannot both be 0)")
    l1_weight: float = Field(default=0.9, ge=0.0, description="weight of the L1 (2 x TV) term")
    bce_weight: float = Field(default=1.0, ge=0.0, description="weight of the confidence BCE term")
    position_decay: float = Field(default=4.0, gt=0.0, description="slot-k loss weight `exp(-k/position_decay)`, "
                                                                   "k from 0")
    confidence_label: Literal["tv", "greedy"] = Field(
        default="tv", description="confidence BCE label: tv (1 - TV, acceptance when sampling at temperature 1) "
        "or greedy (1[top-1 draft == target's greedy token], acceptance at temperature 0)")

    @field_validator("markov_rank")
    @classmethod
    def _markov_rank(cls, v: int) -> int:
        if v < 1:
            raise ValueError(f"markov_rank {v}: the Markov head W2(W1[x]) needs a rank >= 1 (default 256)")
        return v

    @field_validator("markov_head_type")
    @classmethod
    def _markov_head_type(cls, v: str) -> str:
        if v in ("gated", "rnn"):
            raise ValueError(f"markov_head_type {v!r} is not implemented; allowed: {', '.join(MARKOV_HEAD_TYPES)}")
        if v not in MARKOV_HEAD_TYPES:
            raise ValueError(f"markov_head_type {v!r}: unknown; allowed: {', '.join(MARKOV_HEAD_TYPES)}")
        return v

    @model_validator(mode="after")
    def _weights(self) -> "DSparkConfig":
        if self.ce_weight + self.l1_weight <= 0:
            raise ValueError("ce_weight and l1_weight are both 0: nothing would train the draft distribution "
                             "(defaults 0.1 and 0.9)")
        return self


class MarkovHead(nn.Module):
    """DSpark's vanilla Markov head: ``markov_w1: Embedding(V, r)`` over target ids and
    ``markov_w2: Linear(r -> N, no bias)`` (zero-initialised: a fresh head adds nothing)."""

    def __init__(self, vocab_size: int, draft_vocab_size: int, rank: int):
        super().__init__()
        self.markov_w1 = nn.Embedding(vocab_size, rank)
        self.markov_w2 = nn.Linear(rank, draft_vocab_size, bias=False)
        nn.init.zeros_(self.markov_w2.weight)

    def forward(self, prev_ids: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """``prev_ids [...]`` int64 target ids -> ``(correction [..., N], e = W1[prev] [..., r])``."""
        e = self.markov_w1(prev_ids.to(self.markov_w1.weight.device))
        return self.markov_w2(e), e


class ConfidenceHead(nn.Module):
    """``proj: Linear(H (+ r) -> 1)``: the confidence logit of a slot (pre-sigmoid)."""

    def __init__(self, in_features: int):
        super().__init__()
        self.proj = nn.Linear(in_features, 1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """``x [..., H (+ r)]`` -> ``[...]`` float32 logits."""
        return self.proj(x).squeeze(-1).float()


class DSparkFormat(DFlashFormat):
    """DSpark's serving format: DFlash's (its aux taps and weight names) with a ``dspark`` config that adds the
    Markov and confidence keys (vLLM: ``method: dspark``); its confidence calibration stays out of the weights."""

    algorithm = "dspark"
    vllm_method = "dspark"  # vLLM's DSparkProposer (vllm/v1/spec_decode/dspark.py) and its DSpark model loader
    llamacpp_spec_type = "draft-dspark"  # llama.cpp's dflash architecture with its Markov head (dflash.cpp)
    # the confidence calibration is training-side state: config.json's speculators_training.confidence_calibration,
    # never model.safetensors (vLLM's DSpark loader cannot place it)
    training_state_tensors = ("confidence_temperature", "confidence_bias")

    def llamacpp_max_draft(self, config: dict[str, Any]) -> int | None:
        """``block_size``: llama.cpp's anchor-first DSpark block is ``[x_n, MASK x (K-1)]``, drafts from slots 0..K-1."""
        b = config.get("block_size")
        return int(b) if isinstance(b, int) else None

    def llamacpp_p_min_note(self, config: dict[str, Any]) -> str | None:
        """llama.cpp's DSpark ``--spec-draft-p-min`` cuts the draft where the confidence head's sigmoid falls below
        it; without a confidence head the server refuses to start."""
        if not config.get("enable_confidence_head"):
            return "this DSpark drafter has no confidence head (llama.cpp's DSpark p_min thresholds its output)"
        return None

    def check_llamacpp(self, config: dict[str, Any], where: str) -> None:
        """Refuse a confidence head without the Markov input: llama.cpp's DSpark graph reads ``[h; w1[prev]]``
        (``H + markov_rank`` wide) and would not load an ``H``-wide head. (Its converter runs the ``vanilla``
        Markov head only, the only one this config allows.)

        Raises:
            SpeculatorsError: naming ``where`` and the setting.
        """
        if config.get("enable_confidence_head") and not config.get("confidence_head_with_markov", True):
            raise SpeculatorsError(f"{where}: drafter.confidence_head_with_markov is false; llama.cpp's DSpark "
                                   "confidence head reads the hidden state and the Markov embedding (H + markov_rank "
                                   "inputs), so this H-input head cannot load there (train with "
                                   "confidence_head_with_markov: true, or enable_confidence_head: false)")

    def config(self, drafter: DSparkDrafter) -> dict[str, Any]:
        """vllm-project/speculators-style ``dspark`` config (FORMATS.md): DFlash's keys with
        ``sample_from_anchor: true`` and ``speculative_tokens = block_size`` plus the Markov and
        confidence keys."""
        cfg: DSparkConfig = drafter.cfg
        out = super().config(drafter)
        out.update({
            "architectures": ["DSparkDraftModel"],
            "speculators_model_type": "dspark",
            "speculators_config": export.speculators_config(drafter.algorithm, cfg.block_size,
                                                            drafter.meta.name_or_path, drafter.meta.architectures),
            "sample_from_anchor": True,
            "markov_rank": cfg.markov_rank,
            "markov_head_type": cfg.markov_head_type,
            "enable_confidence_head": cfg.enable_confidence_head,
            "confidence_head_with_markov": cfg.confidence_head_with_markov,
        })
        return out

    def speculative_tokens(self, config: dict[str, Any]) -> int | None:
        """``block_size`` (the speculators block), else ``config["block_size"]``."""
        k = export.speculative_tokens(config)
        if k is None and isinstance(config.get("block_size"), int):
            k = config["block_size"]
        return k

    def reference_parity_step(self, drafter: DSparkDrafter, config: dict[str, Any], ids: list[int], feats_ours,
                              feats_ref):
        """One block anchored at ``x_a`` (the export gate, :meth:`ServingFormat.reference_parity_step`): the
        Markov-corrected logits of every slot along OUR greedy chain (slot j conditions on the anchor,
        then on draft j-1: vLLM's ``sample_from_anchor`` chain) and the raw confidence logits. The
        reference reads the chain from ``input_ids`` after the anchor."""
        from .parity_inputs import ParityStep, block_reference_inputs, reference_anchor_pin

        t = torch.tensor(ids, dtype=torch.long)
        a, B = len(ids) - 1, drafter.block_size
        st = drafter.start(t, feats_ours.slice(0, a))
        h = drafter.block_hidden(st)
        base = drafter.head(h).float()
        prev = torch.tensor([st.last_id], dtype=torch.long)
        rows, confs, chain = [], [], []
        for j in range(B):
            corr, e = drafter.markov_head(prev)
            c = drafter._confidence(h[j:j + 1], e)
            if c is not None:
                confs.append(c.reshape(1).float())
            row = (base[j:j + 1] + corr.float())[0]
            rows.append(row)
            tok = int(row.argmax())
            tok = tok + int(drafter.d2t[tok]) if drafter.reduced_vocab else tok
            chain.append(tok)
            prev = torch.tensor([tok], dtype=torch.long)
        out = {"logits": torch.stack(rows)}
        if confs:
            out["confidence_logits"] = torch.cat(confs)
        pin = reference_anchor_pin(a, "speculators.models.dspark.core", confidence_arg=2)
        return ParityStep(block_reference_inputs(B, ids, feats_ref, chain[:B - 1]), {"max_anchors": 1}, pin, out)


@register
class DSparkDrafter(DFlashDrafter):
    """DSpark drafter (see the module docstring). Shapes: ``B`` batch, ``T`` sequence, ``A`` anchors per
    sequence, ``Bs`` block size, ``H`` hidden, ``V`` target vocab, ``N`` draft vocab, ``r`` Markov rank."""

    algorithm = "dspark"
    config_class = DSparkConfig
    serving = DSparkFormat()
    sample_from_anchor: ClassVar[bool] = True
    max_speculative_tokens_source = "drafter.block_size"

    def __init__(self, cfg: DSparkConfig, meta: TargetMeta | dict, draft_vocab_size: int | None = None):
        """Raises:
            SpeculatorsError: see :class:`DFlashDrafter` (mask token, draft vocabulary size).
        """
        super().__init__(cfg, meta, draft_vocab_size)
        H, V = self.layer_cfg.hidden_size, self.meta.vocab_size
        N = V if draft_vocab_size is None else int(draft_vocab_size)
        r = cfg.markov_rank
        self.markov_head = MarkovHead(V, N, r)
        if cfg.enable_confidence_head:
            self.confidence_head = ConfidenceHead(H + r if cfg.confidence_head_with_markov else H)
            # non-persistent: not in state_dict, hence never in model.safetensors (training_state_tensors)
            self.register_buffer("confidence_temperature", torch.ones(cfg.block_size, dtype=torch.float32),
                                 persistent=False)
            self.register_buffer("confidence_bias", torch.zeros(cfg.block_size, dtype=torch.float32),
                                 persistent=False)

    # ------------------------------------------------------------------ calibration (training-side state)
    def output_heads(self) -> list[nn.Module]:
        """DFlash's heads plus the Markov head's ``markov_w2`` (``r -> N`` logits added to the head's;
        ``markov_w1`` is an embedding) (:meth:`Drafter.output_heads`)."""
        return [*super().output_heads(), self.markov_head.markov_w2]

    def confidence_calibration(self) -> tuple[torch.Tensor, torch.Tensor] | None:
        """``(confidence_temperature [Bs], confidence_bias [Bs])`` float32 CPU copies (ones / zeros until
        calibrated), or None without a confidence head (:meth:`Drafter.confidence_calibration`)."""
        if not self.cfg.enable_confidence_head:
            return None
        return (self.confidence_temperature.detach().float().cpu().clone(),
                self.confidence_bias.detach().float().cpu().clone())

    def set_confidence_calibration(self, temperature: torch.Tensor, bias: torch.Tensor | None = None,
                                   where: str = "") -> None:
        """Set the per-slot calibration (:meth:`Drafter.set_confidence_calibration`); ``where`` prefixes the
        errors (the file an entry came from).

        Raises:
            SpeculatorsError: no confidence head; not ``[block_size]`` values, a temperature <= 0 or a value
                that is not finite (naming ``confidence_temperature`` / ``confidence_bias``).
        """
        if not self.cfg.enable_confidence_head:
            super().set_confidence_calibration(temperature, bias)
        Bs = self.cfg.block_size
        t = torch.as_tensor(temperature).detach().float().cpu().reshape(-1)
        b = torch.zeros(Bs) if bias is None else torch.as_tensor(bias).detach().float().cpu().reshape(-1)
        if t.shape != (Bs,) or not bool(torch.isfinite(t).all() and (t > 0).all()):
            raise SpeculatorsError(f"{where}confidence_temperature must be ({Bs},) positive finite values (one per "
                                   f"block slot), got {t.tolist()}")
        if b.shape != (Bs,) or not bool(torch.isfinite(b).all()):
            raise SpeculatorsError(f"{where}confidence_bias must be ({Bs},) finite values (one per block slot), "
                                   f"got {b.tolist()}")
        with torch.no_grad():
            self.confidence_temperature.copy_(t)
            self.confidence_bias.copy_(b)

    @property
    def max_speculative_tokens(self) -> int:
        """``block_size``: every slot of the block drafts (``sample_from_anchor``)."""
        return self.cfg.block_size

    # ------------------------------------------------------------------ pieces
    def corrected_logits(self, h: torch.Tensor, prev_ids: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor | None]:
        """Slot logits with the Markov correction, and the confidence logits: the ONE formula of training
        and inference.

        Args:
            h: ``[..., H]`` final-normed backbone hidden states of the slots.
            prev_ids: ``[...]`` int64 target ids ``x_{k-1}`` of each slot (the anchor for slot 0).
        Returns:
            ``(logits [..., N] float32 = head(h) + W2(W1[prev]), conf [...] float32 raw confidence
            logits or None without a confidence head)``.
        """
        corr, e = self.markov_head(prev_ids)
        logits = self.head(h).float() + corr.float()
        return logits, self._confidence(h, e)

    def _confidence(self, h: torch.Tensor, e: torch.Tensor) -> torch.Tensor | None:
        if not self.cfg.enable_confidence_head:
            return None
        x = torch.cat([h, e.to(h.dtype)], dim=-1) if self.cfg.confidence_head_with_markov else h
        return self.confidence_head(x)

    def teacher_probs(self, top: torch.Tensor) -> torch.Tensor:
        """The target's next-token distribution over the draft vocabulary (restricted and renormalised):
        ``top [n, H]`` final hidden states -> ``[n, N]`` float32 (no gradient).

        Raises:
            RuntimeError: ``attach_target`` was not called (no teacher head).
        """
        head = self.frozen_target.head_weight
        if head is None:
            raise RuntimeError("attach_target(target) before training: the teacher head is missing")
        with torch.no_grad():
            rows = self.draft_ids if self.reduced_vocab else None
            return torch.softmax(self.frozen_target.teacher_logits(top.float(), rows), dim=-1)

    def teacher_forced_prev(self, batch, anchors: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """The training path's Markov inputs: slot k of the block anchored at a gets the data token at
        ``a + k`` (the anchor for slot 0), the prefix the target's distribution at ``a + k`` conditions on.

        Args:
            batch: a :class:`speculators.data.dataset.Batch` (``input_ids [B, T]``).
            anchors: ``[B, A]`` int64 anchor positions.
        Returns:
            ``(prev [B, A, Bs] int64 target ids, pos [B, A, Bs] int64 = min(a + k, T - 1))``; ``pos`` is
            also where the teacher distribution of slot k is read (``Batch.top``). Entries past the
            sequence are clamped (never supervised).
        """
        B, T = batch.input_ids.shape
        pos = (anchors.unsqueeze(-1) + torch.arange(self.block_size, device=anchors.device)).clamp(max=T - 1)
        return batch.input_ids.gather(1, pos.reshape(B, -1)).view_as(pos), pos

    def slot_weights(self) -> list[float]:
        """``exp(-k / position_decay)`` for slots k = 0..Bs-1."""
        return [math.exp(-k / self.cfg.position_decay) for k in range(self.block_size)]

    def confidences(self, proposal: Proposal) -> torch.Tensor | None:
        """Calibrated conditional confidences of a proposal's drafts: :func:`calibrated_confidences` of
        ``proposal.confidence_logits`` with this drafter's ``confidence_temperature`` and ``confidence_bias``;
        ``[k]`` float32, or None when the proposal carries no confidence logits (no confidence head).

        Raises:
            SpeculatorsError: see :func:`calibrated_confidences`.
        """
        if proposal.confidence_logits is None or not self.cfg.enable_confidence_head:
            return None
        return calibrated_confidences(proposal.confidence_logits, self.confidence_temperature, self.confidence_bias)

    # ------------------------------------------------------------------ training
    def loss(self, batch, norm: torch.Tensor | None = None) -> tuple[torch.Tensor, dict[str, float]]:
        """``sum_k exp(-k/position_decay) * (ce_w * CE_k + l1_w * L1_k + bce_w * BCE_k) / norm[k]`` over
        slots k = 0..Bs-1 (module docstring; ``norm`` default: this batch's counts, each term a mean).

        Returns:
            loss (scalar) and metrics: ``loss_j`` (slot j's weighted-sum mean, unweighted by position),
            ``ce_j``, ``l1_j``, ``bce_j`` (slot j's means), ``conf_j`` (mean raw confidence
            ``sigmoid(logit)``), ``num_anchors``, and ``full_acc_j, cond_acc_j, sim_tau`` from
            :func:`speculators.losses.chained_acceptance`: slot j's teacher-forced top-1 draft (target id)
            equals the target's greedy token at ``a + j``; labelled when ``x_{a+j+1}`` is a real
            assistant token inside the sequence.
        Raises:
            RuntimeError: ``attach_target`` was not called.
        """
        cfg: DSparkConfig = self.cfg
        anchors, ok = self._anchors(batch, for_counts=False)
        labels, labelled, valid = self._slot_labels(batch, anchors, ok)  # [B, A, Bs]
        counts = valid.sum(dim=(0, 1))
        B = batch.input_ids.shape[0]
        Bs, dev = self.block_size, batch.input_ids.device
        prev, pos = self.teacher_forced_prev(batch, anchors)
        rows = torch.arange(B, device=dev).view(B, 1, 1).expand_as(pos)
        sel = labelled
        h = self.slot_logits(batch, anchors)  # [B, A, Bs, H], one forward
        logits, conf = self.corrected_logits(h[sel], prev[sel])  # [n, N], [n] | None
        p_target = self.teacher_probs(batch.top[rows[sel], pos[sel]])  # [n, N], position a + k
        p_draft = torch.softmax(logits, dim=-1)
        l1 = (p_draft - p_target).abs().sum(-1)  # [n]
        lbl = labels[sel]
        if self.reduced_vocab:
            lbl = target_to_draft(lbl, self.t2d)[0]
        slot = torch.arange(Bs, device=dev).expand_as(sel)[sel]
        ce_valid = valid[sel]
        zero = l1.new_zeros(())
        sums, parts = [], {"ce": [], "l1": [], "bce": []}
        bce = None
        if conf is not None:
            if cfg.confidence_label == "greedy":
                y = greedy_confidence_label(self.to_target_ids(logits.detach().argmax(-1)),
                                            batch.argmax[rows[sel], pos[sel]])
            else:
                y = confidence_label(l1)
            bce = F.binary_cross_entropy_with_logits(conf, y, reduction="none")
        for k in range(Bs):
            m = ce_valid & (slot == k)
            ce_k = hard_cross_entropy(logits, lbl, m)
            l1_k = torch.where(m, l1, zero).sum()
            bce_k = torch.where(m, bce, zero).sum() if bce is not None else zero
            sums.append(cfg.ce_weight * ce_k + cfg.l1_weight * l1_k + cfg.bce_weight * bce_k)
            for name, v in (("ce", ce_k), ("l1", l1_k), ("bce", bce_k)):
                parts[name].append(v)
        metrics: dict[str, float] = {}
        with torch.no_grad():
            pred = torch.zeros_like(labels)
            pred[sel] = self.to_target_ids(logits.argmax(-1))
            goal = batch.argmax.gather(1, pos.reshape(B, -1)).view_as(pos)  # greedy token at a + k
            correct = (pred == goal) & sel
            for j in range(Bs):
                c = counts[j].clamp(min=1)
                metrics[f"loss_{j}"] = float(sums[j].detach() / c)
                for name in ("ce", "l1", "bce") if bce is not None else ("ce", "l1"):
                    metrics[f"{name}_{j}"] = float(parts[name][j].detach() / c)
                if conf is not None:
                    m = ce_valid & (slot == j)
                    metrics[f"conf_{j}"] = float(torch.sigmoid(conf[m]).mean()) if bool(m.any()) else 0.0
            metrics.update(chained_acceptance([correct[..., j] for j in range(Bs)],
                                              [labelled[..., j] for j in range(Bs)]))
            metrics["num_anchors"] = float(ok.sum()) / max(1, ok.shape[0])
        total, self.last_own_loss = combine_terms(sums, self.slot_weights(), counts, norm, where=self.algorithm)
        return total, metrics

    # ------------------------------------------------------------------ inference
    @torch.no_grad()
    def _propose_one(self, state: DFlashState, k: int, sampling: SamplingParams | None = None,
                     generator: torch.Generator | None = None) -> Proposal:
        """``k`` drafts: ONE backbone forward of the block ``[x_n, MASK x (k-1)]`` (``k`` slots) anchored at
        ``x_n``, then k sequential Markov steps (module docstring). The block shrinks with ``k`` as vLLM's
        DSpark proposer builds it (``num_speculative_tokens`` query slots per request, anchor first,
        ``vllm/v1/spec_decode/dspark.py``); the block attends bidirectionally, so for ``k < block_size``
        every slot differs from the full trained block's, and this is what the engine serves. Step j draws ``x_j`` from slot j's corrected logits with
        :func:`speculators.losses.sample_draft` (greedy argmax and ``probs=None`` when ``sampling`` is
        None or greedy; else the verifier's transform with ``generator``, default the request's own).

        Returns:
            :class:`Proposal` with ``token_ids [k]`` int64 target ids, ``probs [k, V]`` float32 or None,
            ``confidence_logits [k]`` float32 raw confidence logits (None without a confidence head).
            The state is not changed.
        Raises:
            SpeculatorsError: ``k`` larger than ``block_size``, or ``sampling`` not one request's valid
                ``SamplingParams``.
        """
        if k > self.block_size:
            raise SpeculatorsError(f"K={k}: a dspark drafter with block_size {self.block_size} drafts at most "
                                   f"{self.block_size} tokens per step; use K <= {self.block_size} or train with "
                                   "a larger drafter.block_size")
        if k <= 0:
            return Proposal(torch.zeros(0, dtype=torch.int64), None)
        h = self.block_hidden(state, k)  # [k, H]: vLLM's block of num_speculative_tokens = k slots
        base = self.head(h).float()  # [k, N]
        d2t = self.d2t if self.reduced_vocab else None
        prev = torch.tensor([state.last_id], dtype=torch.int64, device=h.device)
        ids, probs, confs = [], [], []
        for j in range(k):
            corr, e = self.markov_head(prev)  # [1, N], [1, r]
            c = self._confidence(h[j:j + 1], e)
            if c is not None:
                confs.append(c.reshape(1))
            tok, q = sample_draft(base[j:j + 1] + corr.float(), sampling, generator, d2t=d2t,
                                  vocab_size=self.meta.vocab_size)
            ids.append(tok.reshape(1))
            if q is not None:
                probs.append(q)
            prev = tok.reshape(1).to(device=h.device, dtype=torch.int64)
        return Proposal(torch.cat(ids).to(torch.int64), torch.cat(probs) if probs else None,
                        torch.cat(confs).float().cpu() if confs else None)

    def propose_tree(self, states: list[DFlashState], spec, depth_caps: list[int], sampling=None,
                     generators=None) -> list:
        """Draft trees whose children are conditioned on their parent's token through the Markov head, one
        backbone forward per request as the chain's (:func:`speculators.drafters.dflash_tree.dspark_markov_tree`:
        shapes, errors); states left as found."""
        from .dflash_tree import dspark_markov_tree

        return dspark_markov_tree(self, states, spec, depth_caps, sampling, generators)
