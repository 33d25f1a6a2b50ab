"""The drafter interface, the family registry, and checkpoint save/load.

A family is one file in ``speculators/drafters/``: it subclasses :class:`Drafter`, declares its
pydantic config (``config_class``) and registers itself with :func:`register`. The trainer, the
generation loop, the evaluator and the CLI only use this interface (DESIGN.md, principles 1-2):

* ``from_target(cfg, target, vocab)``: build a fresh drafter for a frozen target;
* ``loss(batch, norm=None) -> (loss, metrics)``: training objective on a
  :class:`speculators.data.dataset.Batch`, a weighted sum of terms each divided by ``norm[i]``;
  ``loss_counts(batch) -> [n_terms]``: each term's valid count from the masks (gradient accumulation
  normalises by the counts of the whole window);
* ``start(input_ids, features) -> state``; ``propose(state, k, sampling) -> Proposal``;
  ``advance(state, new_ids, features)``: inference, one request at a time;
* ``save_pretrained(dir)`` / ``Drafter.from_pretrained(dir)``: the vLLM-loadable checkpoint format.

Inference protocol (features lag tokens by one): after ``start``/``advance`` the drafter has seen
tokens ``x_0..x_n`` and target features of positions ``0..n-1``; ``x_n`` is the newest (bonus or
recovered) token, not yet run through the target. ``advance(new_ids, features)`` appends ``m``
tokens ``x_{n+1}..x_{n+m}`` together with the target features of positions ``n..n+m-1``.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any, ClassVar

import torch
from pydantic import BaseModel, ConfigDict, Field
from safetensors.torch import load_file, save_file
from torch import nn

from .. import __version__
from ..errors import SpeculatorsError
from ..utils import atomic_dir

CONFIG_NAME = "config.json"
WEIGHTS_NAME = "model.safetensors"
RECIPE_NAME = "recipe.yaml"
TRAINING_KEY = "speculators_training"  # our own extra block in config.json (vLLM ignores it)


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


class DraftVocab:
    """Draft vocabulary mapping (ALGORITHMS.md, "Draft vocabulary").

    Attributes:
        d2t: ``[N]`` int64 offsets: ``target_id = i + d2t[i]`` (vLLM's convention).
        t2d: ``[V]`` bool, True for the N target ids in the draft vocabulary.
    """

    def __init__(self, d2t: torch.Tensor, t2d: torch.Tensor):
        self.d2t = d2t.to(torch.int64)
        self.t2d = t2d.to(torch.bool)
        n = int(self.t2d.sum())
        if n != self.d2t.numel():
            raise SpeculatorsError(f"draft vocab: t2d has {n} True entries but d2t has {self.d2t.numel()}")

    @property
    def size(self) -> int:
        return self.d2t.numel()

    @property
    def target_ids(self) -> torch.Tensor:
        """``[N]`` int64 sorted target ids of the draft vocabulary."""
        return torch.arange(self.size, dtype=torch.int64) + self.d2t

    @classmethod
    def full(cls, vocab_size: int) -> "DraftVocab":
        return cls(torch.zeros(vocab_size, dtype=torch.int64), torch.ones(vocab_size, dtype=torch.bool))

    @classmethod
    def from_counts(cls, counts: torch.Tensor, size: int | None) -> "DraftVocab":
        """Keep the ``size`` most frequent ids (ties: lower id), sorted; ``size=None`` = full vocab.

        Args:
            counts: ``[V]`` int64 token frequencies on loss-masked (assistant) tokens.
        Raises:
            SpeculatorsError: ``size`` larger than the target vocabulary.
        """
        V = counts.numel()
        if size is None or size == V:
            return cls.full(V)
        if size > V:
            raise SpeculatorsError(f"drafter.draft_vocab_size {size} exceeds the target vocab {V}")
        # stable descending sort by count keeps the lower id first among ties
        order = torch.sort(-counts.to(torch.int64), stable=True).indices[:size]
        ids = torch.sort(order).values
        t2d = torch.zeros(V, dtype=torch.bool)
        t2d[ids] = True
        return cls(ids - torch.arange(size), t2d)


_REGISTRY: dict[str, type["Drafter"]] = {}


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
    if not isinstance(raw, dict) or TRAINING_KEY not in raw:
        raise SpeculatorsError(f"{what}{cfg_file}: no {TRAINING_KEY!r} block; not written by speculators")
    return raw


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

    def __init__(self, cfg: DrafterConfig, meta: dict[str, Any]):
        super().__init__()
        self.cfg = cfg
        # meta: facts about the target recorded in the checkpoint (name, fingerprint, sizes, layer ids)
        self.meta = dict(meta)
        self._teacher_head: torch.Tensor | None = None
        # joint runs: directory of the target's LoRA adapter that came with a loaded checkpoint
        self.target_adapter_dir: Path | None = None

    # ---------------------------------------------------------------- construction
    @classmethod
    def from_target(cls, cfg: DrafterConfig, target, vocab: DraftVocab) -> "Drafter":
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
        d = cls(cfg, cls.target_meta(target))
        with torch.no_grad():
            d.embed_tokens.weight.copy_(target.embed_tokens.weight.float())
        d.attach_target(target)
        return d

    @staticmethod
    def target_meta(target) -> dict[str, Any]:
        """What a checkpoint records about its target, and checks at eval time."""
        return {"name_or_path": target.verifier_name, "reference": target.name_or_path,
                "architectures": list(getattr(target.config, "architectures", None) or
                                      [target.architecture]),
                "fingerprint": target.fingerprint, "vocab_size": target.vocab_size,
                "hidden_size": target.hidden_size, "num_layers": target.num_layers,
                "aux_layer_ids": list(target.aux_layer_ids),
                "aux_layer_ids_convention": "0-based index of the decoder layer whose OUTPUT is tapped "
                                            "(pre-norm residual, also for L-1; HF hidden_states[i+1] for "
                                            "i < L-1); vLLM ids = these + 1",
                "target_config": target.layer_config_dict()}

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
        """Raise SpeculatorsError if ``target`` cannot serve this drafter (vocab or hidden size differ);
        call ``warn(message)`` when the shapes fit but the weights differ from the training target's."""
        m = self.meta
        problems = []
        if m.get("vocab_size") != target.vocab_size:
            problems.append(f"vocab size {m.get('vocab_size')} != target's {target.vocab_size}")
        if m.get("hidden_size") != target.hidden_size:
            problems.append(f"hidden size {m.get('hidden_size')} != target's {target.hidden_size}")
        if problems:
            raise SpeculatorsError(
                f"checkpoint was trained for {m.get('name_or_path')!r}, not {target.name_or_path!r}: "
                + "; ".join(problems))
        if warn is not None and m.get("fingerprint") not in (None, target.fingerprint):
            warn(f"warning: {target.name_or_path!r} is not the target this drafter was trained for "
                 f"({m.get('name_or_path')!r}, fingerprint {m.get('fingerprint')}); acceptance may suffer")
        if list(m.get("aux_layer_ids", target.aux_layer_ids)) != list(target.aux_layer_ids):
            target.aux_layer_ids = list(m["aux_layer_ids"])

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
        path = Path(path)
        block = read_checkpoint_config(path, what="train.init_from: ")[TRAINING_KEY]
        algo = block.get("drafter", {}).get("algorithm")
        if algo != self.algorithm:
            raise SpeculatorsError(f"train.init_from: {path} is a {algo!r} checkpoint; this recipe trains "
                                   f"{self.algorithm!r}")
        fp = block.get("target", {}).get("fingerprint")
        if fp != self.meta.get("fingerprint"):
            raise SpeculatorsError(f"train.init_from: {path} was trained for another target "
                                   f"({block.get('target', {}).get('name_or_path')!r}, fingerprint {fp}); "
                                   f"this recipe's target has fingerprint {self.meta.get('fingerprint')}")
        weights = load_file(str(path / WEIGHTS_NAME))
        check_finite_weights(weights, path / WEIGHTS_NAME)
        self.load_export_state_dict(weights)

    # ---------------------------------------------------------------- inference
    def start(self, input_ids: torch.Tensor, features) -> Any:
        raise NotImplementedError

    def propose(self, state: Any, k: int, sampling=None, generator: torch.Generator | None = None) -> Proposal:
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

        Returns ``(method, note)``: ``method`` is the ``--speculative-config`` ``"method"`` vLLM accepts
        for this layout, or ``None`` when vLLM cannot load the checkpoint as written (``note`` says why
        and what to do). Default: the class's ``vllm_method`` / ``vllm_note``.
        """
        if cls.vllm_method is not None:
            return cls.vllm_method, ""
        return None, cls.vllm_note or f"vLLM has no loader for speculators `{cls.algorithm}` checkpoints"

    @classmethod
    def speculative_tokens(cls, config: dict[str, Any]) -> int | None:
        """K (``num_speculative_tokens``) that a checkpoint's ``config.json`` declares: the speculators
        proposal method's ``speculative_tokens``; ``None`` when the layout does not say."""
        methods = (config.get("speculators_config") or {}).get("proposal_methods") or [{}]
        return methods[0].get("speculative_tokens")

    def speculators_config(self, num_speculative_tokens: int) -> dict[str, Any]:
        """The ``speculators_config`` block of the vllm-project/speculators format (FORMATS.md):
        algorithm, greedy proposal method with ``speculative_tokens`` (vLLM's
        ``num_speculative_tokens``) and the verifier (hub id or path, architectures)."""
        m = self.meta
        return {"algorithm": self.algorithm, "default_proposal_method": "greedy",
                "proposal_methods": [{"proposal_type": "greedy", "speculative_tokens": int(num_speculative_tokens),
                                      "verifier_accept_k": 1, "accept_tolerance": 0.0}],
                "verifier": {"name_or_path": m["name_or_path"], "architectures": m["architectures"]}}

    @staticmethod
    def transformer_layer_config(layer_cfg) -> dict[str, Any]:
        """A drafter's decoder config as the plain HF Llama dict vLLM expects in
        ``transformer_layer_config``: RoPE written explicitly as ``rope_theta`` / ``rope_scaling``
        (older readers ignore transformers 5's ``rope_parameters`` and would silently fall back to
        the default theta), bookkeeping keys dropped."""
        d = layer_cfg.to_dict() if hasattr(layer_cfg, "to_dict") else dict(layer_cfg)
        for key in ("architectures", "transformers_version", "dtype", "torch_dtype", "_name_or_path",
                    "_model_name_or_path", "quantization_config", "tie_word_embeddings"):
            d.pop(key, None)
        rp = d.get("rope_parameters") or {}
        if "rope_theta" not in d and "rope_theta" in rp:
            d["rope_theta"] = rp["rope_theta"]
        if "rope_scaling" not in d:
            d["rope_scaling"] = None if rp.get("rope_type", "default") == "default" else \
                {k: v for k, v in rp.items() if k != "rope_theta"}
        d["model_type"] = "llama"
        d["architectures"] = ["LlamaForCausalLM"]
        return d

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
        """Write ``config.json``, ``model.safetensors`` (and ``recipe.yaml``) atomically to ``path``.

        ``extra(tmp_dir)`` may write more files (e.g. optimizer state) inside the same atomic rename.
        A joint run also writes the target's LoRA adapter to ``target_adapter/`` (see ``joint.py``).
        """
        from .joint import ADAPTER_DIR

        jt = getattr(self, "joint_target", None)
        cfg = self.export_config()
        cfg["speculators_version"] = __version__
        cfg[TRAINING_KEY] = {"drafter": self.cfg.model_dump(), "target": self.meta}
        if jt is not None:
            cfg[TRAINING_KEY]["target_adapter"] = ADAPTER_DIR
            if "speculators_config" in cfg:  # the verifier is the base model with this adapter merged
                cfg["speculators_config"]["verifier"]["lora_adapter"] = ADAPTER_DIR
        with atomic_dir(path, overwrite=overwrite) as tmp:
            (tmp / CONFIG_NAME).write_text(json.dumps(cfg, indent=2, default=str))
            save_file(self.export_state_dict(), str(tmp / WEIGHTS_NAME), metadata={"format": "pt"})
            if recipe_yaml is not None:
                (tmp / RECIPE_NAME).write_text(recipe_yaml)
            for name, text in (extra_files or {}).items():
                (tmp / name).write_text(text)
            if jt is not None:
                jt.save_adapter(tmp / ADAPTER_DIR)
            if extra is not None:
                extra(tmp)
        return Path(path)

    @classmethod
    def _build(cls, cfg: DrafterConfig, meta: dict[str, Any], weights: dict[str, torch.Tensor]) -> "Drafter":
        """Construct an empty module of this family from a checkpoint's config and weights."""
        raise NotImplementedError

    @staticmethod
    def from_pretrained(path: str | Path) -> "Drafter":
        """Load a checkpoint directory written by ``save_pretrained``.

        Raises:
            SpeculatorsError: missing directory/files, unknown family, weights that do not match, or a
                NaN/inf in a weight (of the drafter or of a joint run's target adapter), naming the file
                and the tensor.
        """
        path = Path(path)
        cfg_file = path / CONFIG_NAME
        raw = read_checkpoint_config(path)
        cls = registry.get(raw[TRAINING_KEY].get("drafter", {}).get("algorithm"))
        try:
            cfg = cls.config_class.model_validate(raw[TRAINING_KEY]["drafter"])
        except ValueError as e:  # pydantic ValidationError
            raise SpeculatorsError(f"{cfg_file}: invalid drafter config: {e}".splitlines()[0]) from None
        try:
            weights = load_file(str(path / WEIGHTS_NAME))
        except Exception as e:  # noqa: BLE001 - safetensors raises its own error types
            raise SpeculatorsError(f"{path / WEIGHTS_NAME}: cannot read weights ({e})") from None
        check_finite_weights(weights, path / WEIGHTS_NAME)
        drafter = cls._build(cfg, raw[TRAINING_KEY]["target"], weights)
        drafter.load_export_state_dict(weights)
        adapter = raw[TRAINING_KEY].get("target_adapter")
        if adapter is not None:
            if not (path / adapter / "adapter_config.json").is_file():
                raise SpeculatorsError(f"{path}: a joint checkpoint without its target adapter "
                                       f"({path / adapter}/adapter_config.json is missing)")
            from .joint import ADAPTER_WEIGHTS

            adapter_file = path / adapter / ADAPTER_WEIGHTS
            if adapter_file.is_file():
                try:
                    adapter_weights = load_file(str(adapter_file))
                except Exception as e:  # noqa: BLE001 - safetensors raises its own error types
                    raise SpeculatorsError(f"{adapter_file}: cannot read the adapter weights ({e})") from None
                check_finite_weights(adapter_weights, adapter_file)
            drafter.target_adapter_dir = path / adapter
        return drafter.eval()
