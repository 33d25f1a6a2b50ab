"""One generic trainer for every drafter family (accelerate: CPU now, GPUs later with no code change).

AdamW, warmup + cosine/linear/constant schedule, gradient clipping and accumulation, fp32/bf16,
seeded, periodic held-out evaluation, atomic checkpoints every N steps, ``--resume`` from the last
checkpoint with the same optimizer/scheduler/RNG/data position, a rich progress bar (loss, acceptance
metrics, tokens/s) and TensorBoard scalars. The trainer steps ONE training unit
(:class:`speculators.train.unit.TrainingUnit`: the drafter plus, for a joint run, the LoRA-adapted
target) and never looks at the family nor at whether the target trains: it calls the unit's
``loss_counts(batch)``, ``loss(batch, norm)``, ``param_groups(lr)``, ``save(path)`` / ``load(path)``, and
logs what the unit reports (``metrics_summary``, ``summary``, ``card_lines``). The loss is computed
THROUGH the engine's wrapper of the unit (``accelerator.prepare``; ``TrainingUnit.forward`` is its loss),
so that DDP's gradient all-reduce (FSDP's / DeepSpeed's gathering) hooks fire.

Distributed (``accelerate launch --num_processes P ... speculators train RECIPE``; DDP on GPUs or, with
``--cpu``, gloo on CPU; FSDP and DeepSpeed ZeRO through the launcher's config file, see
``recipes/accelerate/`` and ``docs/DISTRIBUTED.md``; FSDP on CPU processes, which accelerate does not
shard, through torch's FSDP2 in :mod:`speculators.train.fsdp` behind the same config; DeepSpeed on CPU
processes on its CPU accelerator): every rank computes the SAME global batch plan (:func:`plan_batches`,
a pure function of the data, ``train.seed`` and the epoch); one optimizer step consumes the next
``grad_accum * P`` micro-batches of it (the global batch) and rank ``r`` takes micro-batches
``r, r + P, r + 2P, ...`` of them. The data position a checkpoint records (epoch, index into the global
plan) and the step are global, so ``--resume`` works with any number of processes; a 1-process run is
the ``P = 1`` case of the same code. Only rank 0 writes checkpoints, logs, trackers and the model card.

Gradient accumulation is by tokens: each loss term of every micro-batch is divided by that term's count
over the whole accumulation window (all micro-batches, all processes), so the accumulated gradient
equals the gradient of the window as one batch. ``train/loss`` is the window's loss; the family's other
logged metrics are the window's last micro-batch's.

Tracking (``train.report_to``, rank 0; helpers in :mod:`speculators.train.tracking`): accelerate's trackers,
TensorBoard in ``tensorboard/`` and Weights & Biases (optional, ``pip install 'speculators[wandb]'``;
its files in ``wandb/``, the run id in ``tracking.json`` so that ``--resume`` and ``speculators eval``
continue the same run). Logged: the resolved recipe and the run's identity (target fingerprint, data
hashes) once, the training and held-out scalars every ``log_every`` / ``eval_every`` steps, and an eval
report as a table (:func:`log_eval_report`).

Divergence: a NaN/inf loss (training or held-out) or gradient norm stops the run; a checkpoint is
"good" only if its weights are finite and gave a finite loss (``step-s`` holds the weights first used by
the loss of step ``s + 1``). Checkpoints that are not good are renamed ``diverged-step-N`` so that
``--resume`` and ``speculators eval RUN_DIR`` skip them; non-finite weights are never written.

Run directory layout::

    OUTPUT_DIR/recipe.yaml                 resolved recipe
    OUTPUT_DIR/checkpoints/step-000200/    drafter checkpoint + trainer_state.pt (resumable)
    OUTPUT_DIR/final/                      the trained drafter (what `speculators eval` loads)
    OUTPUT_DIR/tensorboard/, train_log.jsonl, wandb/, tracking.json
"""

from __future__ import annotations

import contextlib
import dataclasses
import json
import math
import os
import random
import shutil
import time
import uuid
from pathlib import Path

import torch

from ..data.dataset import make_batch, plan_batches
from ..drafters.checkpoint import RECIPE_NAME
from ..errors import SpeculatorsError
from .fsdp import (
    deepspeed_on_cpu_requested, full_parameters, full_value, fsdp_on_cpu_requested, is_engine_state, is_sharded,
    keep_full_parameters, load_engine_state, local_part, reshard, save_engine_state, set_gradient_sync, shard_unit,
)
from ..hardware import resolve_precision
from ..progress import NoProgress
from ..recipe import dump_recipe
from .run_dir import (
    CKPT_RE, DIVERGED_PREFIX, ENGINE_STATE_DIR, STATE_NAME, _unprefixed, checkpoint_weights_problem, checkpoints,
    model_card,
)
from .tracking import TRACKING_NAME, _markdown_table, _tracking_ids, _wandb_project, check_report_to
from .optimizers import build_optimizer
from .unit import TrainingUnit, set_distill_loss
from ..utils import atomic_write_text

class Trainer:
    """Train one training unit on ``data`` following ``recipe.train`` and write checkpoints to ``output_dir``.

    Args:
        recipe: the validated :class:`speculators.recipe.Recipe`.
        unit: the :class:`speculators.train.unit.TrainingUnit` to train (a bare frozen-target
            :class:`speculators.drafters.Drafter` is wrapped into one).
        data: :class:`speculators.data.pipeline.PreparedData`.
        output_dir: run directory (see module docstring).
        log: callable for log lines (rank 0 only; the other ranks log nothing).
        run_info: ``{name: value}`` identifying the run (the target fingerprint, the data hashes of
            ``speculators.data.pipeline.record_run_identity``), logged once to the trackers.
    Raises:
        SpeculatorsError: a bare drafter that trains the target (build its unit with the adapted target);
            ``train.report_to`` names a tracker that is not installed (:func:`check_report_to`).
    """

    def __init__(self, recipe, unit, data, output_dir: str | Path, log=print, console=None,
                 run_info: dict[str, str] | None = None):
        from accelerate import Accelerator

        if not isinstance(unit, TrainingUnit):
            unit = TrainingUnit(unit)

        self.recipe, self.spec = recipe, recipe.train
        check_report_to(self.spec.report_to)
        self.data = data
        self.output_dir = Path(output_dir)
        self.console = console
        self.run_info = dict(run_info or {})
        self._wandb_ids: dict | None = None  # set by _trackers() when wandb is on
        self.precision = resolve_precision(self.spec.precision)
        cpu, handlers = not torch.cuda.is_available(), []
        if cpu and deepspeed_on_cpu_requested():  # accelerate starts DeepSpeed only when not forced to the CPU
            from accelerate.utils import InitProcessGroupKwargs

            os.environ.setdefault("DS_ACCELERATOR", "cpu")  # DeepSpeed's CPU accelerator (gloo)
            cpu, handlers = False, [InitProcessGroupKwargs(backend="gloo")]  # else accelerate counts 1 process
        self.accelerator = Accelerator(mixed_precision="bf16" if self.precision == "bf16" else "no",
                                       cpu=cpu, kwargs_handlers=handlers,
                                       gradient_accumulation_steps=self.spec.grad_accum,
                                       log_with=self._trackers() or None)
        self.is_main = self.accelerator.is_main_process
        self.log = log if self.is_main else (lambda *_: None)
        self.device = self.accelerator.device
        # FSDP asked for on CPU processes (accelerate would run DDP there): torch's fully_shard, speculators.train.fsdp
        self.fsdp_cpu = self.accelerator.num_processes > 1 and fsdp_on_cpu_requested(self.accelerator.distributed_type)
        self.batches_per_epoch = len(plan_batches(data.train, self.spec.batch_tokens, self.spec.seed, 0))
        if self.spec.steps is not None:
            self.total_steps = self.spec.steps
        else:  # one step = grad_accum micro-batches on each of the num_processes ranks
            per_step = self.spec.grad_accum * self.accelerator.num_processes
            self.total_steps = max(1, math.ceil(self.spec.epochs * self.batches_per_epoch / per_step))
        torch.manual_seed(self.spec.seed)
        if self.fsdp_cpu:  # before the optimizer: it must hold the sharded parameters
            unit = shard_unit(unit.to(self.device))
        set_distill_loss(unit.drafter, self.spec)
        self.optimizer, self.group_names = build_optimizer(  # group names: train/lr_<name>
            unit, unit.param_groups(self.spec.lr), self.spec, unit.drafter.output_heads(), sharded=self._sharded)
        self.scheduler = self._scheduler()
        plugin = getattr(self.accelerator.state, "deepspeed_plugin", None)
        if plugin is not None:  # one micro-batch per backward (ours hold train.batch_tokens tokens); the recipe clips
            plugin.deepspeed_config["train_micro_batch_size_per_gpu"] = 1
            plugin.deepspeed_config["gradient_clipping"] = self.spec.grad_clip
        if self.fsdp_cpu:  # the sharded unit is its own wrapper (no DDP around it)
            self.prepared, self.optimizer = unit, self.accelerator.prepare(self.optimizer)
        else:
            self.prepared, self.optimizer = self.accelerator.prepare(unit, self.optimizer)
        self.step, self.epoch, self.batch_idx = 0, 0, 0
        self._tracking = False  # trackers started (lazily, rank 0, at the first logged scalars)
        self.held_out_before: dict[str, float] = {}
        self.held_out_last: dict[str, float] = {}

    # ------------------------------------------------------------------ engines and trackers
    def _trackers(self) -> list:
        """accelerate trackers of ``train.report_to`` (not started): TensorBoard writing to
        ``OUTPUT_DIR/tensorboard``, W&B writing under ``OUTPUT_DIR/wandb`` with the run id of
        ``tracking.json`` (a resumed run continues its W&B run) or a new one."""
        from accelerate.tracking import TensorBoardTracker, WandBTracker

        out = []
        if "tensorboard" in self.spec.report_to:
            out.append(TensorBoardTracker("tensorboard", str(self.output_dir)))
        if "wandb" in self.spec.report_to:
            w = _tracking_ids(self.output_dir).get("wandb") or {"id": uuid.uuid4().hex[:8], "project": _wandb_project()}
            self._wandb_ids = {"id": w["id"], "project": w["project"]}
            out.append(WandBTracker(w["project"], id=w["id"], resume="allow", dir=str(self.output_dir),
                                    name=self.output_dir.name))
        return out

    def _start_tracking(self) -> None:
        """Start the trackers (rank 0, once), record their ids in ``tracking.json`` and log the resolved
        recipe and ``run_info`` (W&B: the run config; TensorBoard: text)."""
        if self._tracking or not self.is_main:
            return
        self._tracking = True
        self.output_dir.mkdir(parents=True, exist_ok=True)
        self._record_tracking()
        if not self.accelerator.log_with:
            return
        self.accelerator.init_trackers("speculators")
        recipe_yaml = dump_recipe(self.recipe)
        for tr in self.accelerator.trackers:
            if tr.name == "wandb":
                tr.store_init_configuration({"recipe": self.recipe.model_dump(mode="json"), **self.run_info})
            elif tr.name == "tensorboard":
                tr.log({"recipe": f"```yaml\n{recipe_yaml}```",
                        "run_identity": _markdown_table(["what", "identity"], [[k, v] for k, v in self.run_info.items()])},
                       step=self.step)

    def _record_tracking(self) -> None:
        """``tracking.json`` (rank 0, when a tracker is on): the W&B run id and project and the last step
        (:func:`log_eval_report` logs an eval's report into the same run, at that step)."""
        if not self.is_main or not self.spec.report_to:
            return
        ids = {**_tracking_ids(self.output_dir), "step": self.step}
        if self._wandb_ids is not None:
            ids["wandb"] = self._wandb_ids
        atomic_write_text(self.output_dir / TRACKING_NAME, json.dumps(ids, indent=1) + "\n")

    @property
    def _sharded(self) -> bool:
        """True under FSDP or DeepSpeed: parameters and/or optimizer states are split over the ranks
        (a checkpoint then carries ``engine_state/``: accelerate's ``save_state``, or for FSDP on CPU
        processes :func:`speculators.train.fsdp.save_engine_state`)."""
        from accelerate.utils import DistributedType

        return self.fsdp_cpu or self.accelerator.distributed_type in (DistributedType.FSDP, DistributedType.DEEPSPEED)

    @property
    def _gathers(self) -> bool:
        """True when the wrapped unit's forward gathers sharded weights (FSDP, DeepSpeed ZeRO-3): the unit's
        own methods then cannot run outside it."""
        from accelerate.utils import DistributedType

        dt = self.accelerator.distributed_type
        return self.fsdp_cpu or dt == DistributedType.FSDP or (
            dt == DistributedType.DEEPSPEED and self.accelerator.state.deepspeed_plugin.zero_stage == 3)

    @contextlib.contextmanager
    def _full_weights(self):
        """A context in which ``self.unit``'s parameters hold the full (unsharded) weights on every rank:
        FSDP2 (:func:`speculators.train.fsdp.full_parameters`, read-only), FSDP1 (``summon_full_params``) and
        DeepSpeed ZeRO-3 (``GatheredParameters``) gather them; DDP, ZeRO-1/2 and a single process already
        hold them. Collective: every rank enters it."""
        from accelerate.utils import DistributedType

        dt = self.accelerator.distributed_type
        if self.fsdp_cpu or is_sharded(self.unit):  # FSDP2: ours on CPU, accelerate's (fsdp_version: 2)
            with full_parameters(self.unit):
                yield
        elif dt == DistributedType.FSDP:
            from torch.distributed.fsdp import FullyShardedDataParallel as FSDP

            with FSDP.summon_full_params(self.prepared, writeback=False, offload_to_cpu=True):
                yield
        elif dt == DistributedType.DEEPSPEED and self.accelerator.state.deepspeed_plugin.zero_stage == 3:
            import deepspeed

            with deepspeed.zero.GatheredParameters(list(self.unit.parameters()), modifier_rank=None):
                yield
        else:
            yield

    def _all(self, flag: bool) -> bool:
        """True when ``flag`` is True on every rank (a collective where there are several)."""
        if self.accelerator.num_processes == 1:
            return flag
        t = torch.tensor([0.0 if flag else 1.0], device=self.device)
        return float(self.accelerator.reduce(t, reduction="sum")) == 0.0

    # ------------------------------------------------------------------ schedule
    def _scheduler(self):
        from transformers import get_scheduler

        name = {"cosine": "cosine", "linear": "linear", "constant": "constant_with_warmup"}[self.spec.schedule]
        return get_scheduler(name, self.optimizer, num_warmup_steps=min(self.spec.warmup_steps, self.total_steps),
                             num_training_steps=self.total_steps)

    @property
    def unit(self) -> TrainingUnit:
        """The training unit (unwrapped from accelerate's data-parallel wrapper, if any)."""
        return self.accelerator.unwrap_model(self.prepared)

    # ------------------------------------------------------------------ checkpoints
    def save_checkpoint(self) -> Path:
        """Write ``checkpoints/step-NNNNNN`` (the unit's checkpoint + trainer state) and keep the two newest.

        Raises:
            SpeculatorsError: a trainable weight is NaN/inf after update ``step`` (nothing is written;
                the message names the last good checkpoint, see :meth:`_diverged`).
        """
        bad = next((n for n, p in self.unit.named_parameters()
                    if p.requires_grad and not torch.isfinite(local_part(p)).all()), None)
        if not self._all(bad is None):  # (sharded engines: each rank checks its shard)
            raise self._diverged(f"weight {bad or '(on another rank)'!r} became NaN/inf after the update of step "
                                 f"{self.step}", at_step=self.step, condemn_from=None)
        path = self.output_dir / "checkpoints" / f"step-{self.step:06d}"
        n_proc = self.accelerator.num_processes
        rng = [torch.get_rng_state()]
        if n_proc > 1:  # every rank's generator: a resume with as many processes continues each one
            from accelerate.utils import gather_object

            rng = gather_object(rng)
        engine_tmp = None
        if self._sharded:  # FSDP / DeepSpeed: the sharded optimizer (and weights), all ranks
            engine_tmp = self.output_dir / "checkpoints" / f".{ENGINE_STATE_DIR}-{self.step:06d}.tmp"
            if self.fsdp_cpu:  # torch.distributed.checkpoint: every rank writes its shards into one directory
                if self.is_main:
                    shutil.rmtree(engine_tmp, ignore_errors=True)  # a killed run's leftover
                    engine_tmp.mkdir(parents=True)
                self.accelerator.wait_for_everyone()
                save_engine_state(self.unit, self.optimizer, engine_tmp)
            else:
                self.accelerator.save_state(str(engine_tmp))
            self.accelerator.wait_for_everyone()
        state = {"step": self.step, "epoch": self.epoch, "batch_idx": self.batch_idx,
                 "optimizer": None if self._sharded else self.optimizer.state_dict(),
                 "scheduler": self.scheduler.state_dict(),
                 "torch_rng": rng[0], "torch_rng_ranks": rng, "python_rng": random.getstate(),
                 "num_processes": n_proc, "total_steps": self.total_steps,
                 "held_out_before": self.held_out_before, "held_out_last": self.held_out_last}

        def extra(tmp: Path) -> None:
            if engine_tmp is not None:
                os.replace(engine_tmp, tmp / ENGINE_STATE_DIR)
            torch.save(state, tmp / STATE_NAME)  # written last: its presence marks a complete checkpoint

        with self._full_weights():
            if self.is_main:
                self.unit.save(path, recipe_yaml=dump_recipe(self.recipe), extra=extra)
                for old in checkpoints(self.output_dir)[:-2]:  # keep the two newest
                    shutil.rmtree(old, ignore_errors=True)
                self._record_tracking()
        self.accelerator.wait_for_everyone()
        return path

    def load_checkpoint(self, path: Path) -> None:
        """``--resume``: restore the unit's weights (``TrainingUnit.load``), the optimizer, scheduler, RNG
        states, data position and held-out history of checkpoint ``path``.

        Any number of processes: the step and data position are global, the optimizer state (DDP: the
        same on every rank) is rank 0's; each rank restores its own torch generator when the checkpoint
        was written by as many processes (else rank 0's). Under FSDP / DeepSpeed the weights and the
        sharded optimizer come from ``engine_state/`` (accelerate's ``load_state``; DeepSpeed needs the
        same number of processes); FSDP on CPU processes reads its ``torch.distributed.checkpoint`` there
        with any number of processes (one included: the unsharded run loads the optimizer state from it).

        Raises:
            SpeculatorsError: a weight file of ``path`` is unreadable, holds a NaN/inf, or does not fit;
                a sharded-engine run resumed from a checkpoint without ``engine_state/``.
        """
        try:
            if self._sharded:  # the weights come from engine_state/ below: only check the drafter's files here
                problem = checkpoint_weights_problem(path)
                if problem is not None:
                    raise SpeculatorsError(problem)
            else:
                self.unit.load(path)
        except SpeculatorsError as e:
            raise SpeculatorsError(f"--resume: checkpoint {path} is not good: {e}; delete it (or rename it "
                                   f"to {DIVERGED_PREFIX}{path.name}) to resume from an older one") from None
        state = torch.load(path / STATE_NAME, weights_only=False)
        if self._sharded:
            if not (path / ENGINE_STATE_DIR).is_dir():
                raise SpeculatorsError(f"--resume: {path} has no {ENGINE_STATE_DIR}/ (written without FSDP/DeepSpeed): "
                                       "resume it with the launcher config it was trained with")
            if self.fsdp_cpu != is_engine_state(path / ENGINE_STATE_DIR):
                writer = "accelerate (FSDP/DeepSpeed on GPUs)" if self.fsdp_cpu else "FSDP on CPU processes"
                raise SpeculatorsError(f"--resume: {path}/{ENGINE_STATE_DIR} was written by {writer}: resume it "
                                       "with the launcher config and devices it was trained with")
            if self.fsdp_cpu:
                load_engine_state(self.unit, self.optimizer, path / ENGINE_STATE_DIR)
            else:
                self.accelerator.load_state(str(path / ENGINE_STATE_DIR))
        elif state.get("optimizer") is None and is_engine_state(path / ENGINE_STATE_DIR):
            load_engine_state(self.unit, self.optimizer, path / ENGINE_STATE_DIR)  # FSDP on CPU, resumed unsharded
        elif state.get("optimizer") is None:
            raise SpeculatorsError(f"--resume: {path} holds a sharded optimizer ({ENGINE_STATE_DIR}/, FSDP/DeepSpeed): "
                                   "resume it with the launcher config it was trained with")
        else:
            self.optimizer.load_state_dict(state["optimizer"])
        self.scheduler.load_state_dict(state["scheduler"])
        ranks = state.get("torch_rng_ranks") or [state["torch_rng"]]
        r = self.accelerator.process_index
        torch.set_rng_state(ranks[r] if len(ranks) == self.accelerator.num_processes else state["torch_rng"])
        random.setstate(state["python_rng"])
        self.step, self.epoch, self.batch_idx = state["step"], state["epoch"], state["batch_idx"]
        self.held_out_before = state.get("held_out_before", {})
        self.held_out_last = state.get("held_out_last", {})
        self.log(f"resume: continuing from {path} (step {self.step}/{self.total_steps}, epoch {self.epoch}, "
                 f"batch {self.batch_idx})")

    # ------------------------------------------------------------------ evaluation
    @torch.no_grad()
    def evaluate_held_out(self, max_batches: int = 8) -> dict[str, float]:
        """Metrics of the unit's loss on up to ``max_batches`` held-out batches (fp32, no autocast), under
        ``held_out/`` names, plus ``step``; ``{}`` without held-out data.

        Weighted by tokens, not by batches: ``held_out/loss`` is the loss of all these batches as one
        batch (every term normalised by its count over all of them, as in :meth:`_backward_window`); the
        other metrics are the unit's :meth:`~speculators.train.unit.TrainingUnit.metrics_summary` of the
        batches (for a joint run it includes the target's perplexity ``held_out/ppl``). Every rank
        evaluates the same batches (same numbers everywhere, no communication; under FSDP / ZeRO-3
        through the wrapped unit, whose forward gathers the sharded weights).
        """
        store = self.data.held_out
        if store is None or len(store) == 0:
            return {}
        self.prepared.eval()
        plan = plan_batches(store, self.spec.batch_tokens, 0, 0)[:max_batches]
        batches = [make_batch(store, idx) for idx in plan]
        counts = [self._counts(b) for b in batches]
        norm = torch.stack(counts).sum(0)  # every process evaluates the same batches: no reduction
        loss_sum, parts = 0.0, []
        loss_fn = self.prepared if self._gathers else self.unit.loss  # the unit itself: fp32, no autocast wrapper
        for b, c in zip(batches, counts):
            loss, metrics = loss_fn(b.to(self.device), norm)
            loss_sum += float(loss)
            parts.append((c, metrics))
        if self.fsdp_cpu:
            reshard(self.prepared)  # no backward follows: free the gathered weights now
        self.prepared.train()
        out = {"held_out/loss": loss_sum}
        out.update({f"held_out/{k}": v for k, v in self.unit.metrics_summary(parts).items()})
        out["step"] = self.step
        return out

    def _held_out_eval(self, prefix: str = "held_out/") -> dict[str, float]:
        """:meth:`evaluate_held_out`, logged (scalars under ``prefix``, one summary line); ``{}`` without
        held-out data."""
        ev = self.evaluate_held_out()
        if ev and not math.isfinite(ev["held_out/loss"]):  # the weights of this step give a NaN/inf loss
            raise self._diverged(f"held-out loss became {ev['held_out/loss']}", at_step=self.step,
                                 condemn_from=self.step)
        if ev:
            self._log_scalars({k.replace("held_out/", prefix): v for k, v in ev.items() if k != "step"})
            self.log(f"step {self.step}: held-out " + self.unit.summary(_unprefixed(ev)))
        return ev

    # ------------------------------------------------------------------ loop
    def _plan(self) -> list[list[int]]:
        """The batch plan of ``self.epoch`` (cached: a pure function of the data, seed and epoch)."""
        if getattr(self, "_plan_cache", (None,))[0] != self.epoch:
            plan = plan_batches(self.data.train, self.spec.batch_tokens, self.spec.seed, self.epoch)
            if not plan:
                raise SpeculatorsError("train: the training set is empty; nothing to train on")
            self._plan_cache = (self.epoch, plan)
        return self._plan_cache[1]

    def _next_window(self) -> list:
        """This rank's ``train.grad_accum`` micro-batches (CPU :class:`Batch` es) of the next global batch.

        The global batch is the next ``grad_accum * P`` micro-batches (``P`` processes) of the global
        batch plan (the same on every rank), continuing into the next epoch when one ends; rank ``r``
        takes its micro-batches ``r, r + P, ...`` (only those are read from the store). Advances the
        global ``epoch``/``batch_idx`` past the whole global batch (the data position a checkpoint
        written after this step resumes from, whatever the number of processes then)."""
        n_proc, rank = self.accelerator.num_processes, self.accelerator.process_index
        window = []
        for i in range(self.spec.grad_accum * n_proc):
            plan = self._plan()
            while self.batch_idx >= len(plan):
                self.epoch += 1
                self.batch_idx = 0
                plan = self._plan()
            if i % n_proc == rank:
                window.append(make_batch(self.data.train, plan[self.batch_idx]))
            self.batch_idx += 1
        return window

    def _counts(self, batch) -> torch.Tensor:
        """``[n_terms]`` int64 loss-term counts of one CPU batch (``TrainingUnit.loss_counts``), on the
        device; only the masks travel (the cached features are not needed: a unit that needs the live
        target's reruns it itself)."""
        light = dataclasses.replace(batch, aux=batch.aux[..., :0], top=batch.top[..., :0])
        if self.fsdp_cpu and self.unit.trains_target:  # the live target runs outside the unit's forward:
            self.prepared.unshard()  # gather its weights (kept for the forward that follows)
        return self.unit.loss_counts(light.to(self.device)).to(device=self.device, dtype=torch.int64)

    def _reduce_counts(self, counts: torch.Tensor) -> torch.Tensor:
        """Sum ``counts`` over processes (every rank's micro-batches share one normaliser)."""
        if self.accelerator.num_processes > 1:
            counts = self.accelerator.reduce(counts, reduction="sum")
        return counts

    def _backward_window(self, window: list) -> tuple[float, dict[str, float]]:
        """Forward + backward of every micro-batch of an accumulation window, each loss term divided by
        its count over the WHOLE window (all micro-batches, all processes), so that the accumulated
        gradient equals the gradient of the window as one batch (whatever the split, whatever the
        number of tokens per micro-batch). accelerate divides every loss by
        ``gradient_accumulation_steps`` in ``backward`` and DDP averages gradients over processes: both
        are undone here (the window normaliser already accounts for every token).

        The loss is computed through the engine's wrapper (``self.prepared(batch, norm)``): DDP skips
        the all-reduce on all but the last micro-batch (``accelerator.accumulate``) and reduces there.

        Returns:
            ``(window_loss, metrics)``: this rank's share of the window's loss (sum of its micro-batch
            losses; summed over the ranks by :meth:`_global_loss`, the loss of the global batch as one
            batch) and the unit's metrics of the last micro-batch (its own means). A NaN/inf loss is
            NOT raised here (every rank must agree first): see :meth:`_global_loss`.
        """
        norm = self._reduce_counts(torch.stack([self._counts(b) for b in window]).sum(0))
        scale = self.accelerator.gradient_accumulation_steps * self.accelerator.num_processes
        total, metrics = 0.0, {}
        for i, cpu_batch in enumerate(window):
            batch = cpu_batch.to(self.device)
            if self.fsdp_cpu:  # reduce-scatter once, after the window's last micro-batch
                set_gradient_sync(self.prepared, i == len(window) - 1)
            with self.accelerator.accumulate(self.prepared):
                if self.accelerator.sync_gradients != (i == len(window) - 1):
                    raise RuntimeError(f"gradient accumulation out of step: micro-batch {i + 1}/{len(window)} "
                                       f"with accelerate's gradient_accumulation_steps "
                                       f"{self.accelerator.gradient_accumulation_steps}")
                with self.accelerator.autocast():
                    loss, metrics = self.prepared(batch, norm)
                self.accelerator.backward(loss * scale)
            total += float(loss.detach())
        return total, metrics

    def _global_loss(self, local_loss: float, local_tokens: int) -> tuple[float, int]:
        """``(loss, tokens)`` of the global batch: this rank's window loss and drafter tokens summed over
        the processes (one all-reduce; as they are with one process).

        Raises:
            SpeculatorsError: the loss is NaN/inf (on every rank alike; nothing is updated, see
                :meth:`_diverged`).
        """
        if self.accelerator.num_processes > 1:
            t = torch.tensor([local_loss, float(local_tokens)], dtype=torch.float64, device=self.device)
            t = self.accelerator.reduce(t, reduction="sum")
            local_loss, local_tokens = float(t[0]), int(t[1])
        if not math.isfinite(local_loss):
            raise self._diverged(f"loss became {local_loss}", at_step=self.step + 1, condemn_from=self.step)
        return local_loss, local_tokens

    def _optimizer_step(self) -> float:
        """Clip the accumulated gradient, update, zero the gradients; returns the pre-clip norm.

        Raises:
            SpeculatorsError: the gradient norm is NaN/inf (nothing is updated).
        """
        if self.fsdp_cpu:
            reshard(self.prepared)  # the update applies to the shards (a no-op after the backward)
        gnorm = self.accelerator.clip_grad_norm_(self.prepared.parameters(), self.spec.grad_clip)
        if gnorm is None:  # DeepSpeed clips (and steps) inside backward; its norm may be unavailable
            gnorm = 0.0
        gnorm = full_value(gnorm)  # FSDP2: a replicated DTensor
        if not torch.isfinite(torch.as_tensor(gnorm)):
            raise self._diverged(f"gradient norm became {float(gnorm)} (before the update)",
                                 at_step=self.step + 1, condemn_from=None)
        self.optimizer.step()
        self.optimizer.zero_grad(set_to_none=True)
        return float(gnorm)

    def _diverged(self, what: str, at_step: int, condemn_from: int | None) -> SpeculatorsError:
        """The error that stops a diverged run, after setting aside the checkpoints that are not good.

        A checkpoint is good when its weights are finite AND gave a finite loss. ``step-s`` holds the
        weights after update ``s``, first used by the loss of step ``s + 1``: a NaN/inf loss at step
        ``s + 1`` (or a NaN/inf held-out loss at step ``s``) condemns ``step-s``; pass its ``s`` as
        ``condemn_from`` (every checkpoint at or after it is condemned). Checkpoints with non-finite
        weights are condemned too. Condemned checkpoints are renamed ``diverged-step-N`` (kept for
        inspection; ``checkpoints()``, ``--resume`` and ``speculators eval RUN_DIR`` skip them). Rank 0
        renames; every rank calls this at the same point (the values it checks are global) and waits for
        it, so that no rank exits (ending the launch) before the renames are done.
        """
        bad = []
        for ck in (checkpoints(self.output_dir) if self.is_main else []):
            s = int(CKPT_RE.match(ck.name).group(1))
            why = "gave a NaN/inf loss" if condemn_from is not None and s >= condemn_from else \
                checkpoint_weights_problem(ck)
            if why is not None:
                dest = ck.parent / f"{DIVERGED_PREFIX}{ck.name}"
                shutil.rmtree(dest, ignore_errors=True)
                os.replace(ck, dest)
                bad.append(dest.name)
        if self.accelerator.num_processes > 1:
            self.accelerator.wait_for_everyone()
        good = checkpoints(self.output_dir)
        msg = (f"{what} at step {at_step}; stopping. Last good checkpoint: {good[-1] if good else 'none'}")
        if bad:
            msg += f" ({', '.join(bad)}: not good, renamed so that --resume and eval skip it)"
        return SpeculatorsError(msg + " (try a lower train.lr)")

    def _log_scalars(self, scalars: dict[str, float]) -> None:
        """Rank 0: ``scalars`` at the current step to the trackers (``train.report_to``) and
        ``train_log.jsonl``; the other ranks log nothing."""
        if not self.is_main:
            return
        self._start_tracking()
        if self.accelerator.trackers:
            self.accelerator.log(scalars, step=self.step)
        with open(self.output_dir / "train_log.jsonl", "a") as f:
            f.write(json.dumps({"step": self.step, **scalars}) + "\n")

    def train(self, resume: bool = False) -> Path:
        """Run the training loop; returns the final checkpoint directory (``OUTPUT_DIR/final``); the
        trackers are closed however it ends. Under FSDP on CPU processes the unit then holds the full
        trained weights on every rank (:func:`speculators.train.fsdp.keep_full_parameters`).

        Raises:
            SpeculatorsError: the loss, the held-out loss, the gradient norm or a weight became NaN/inf;
                the message names the last good checkpoint (or none) and the ones set aside
                (:meth:`_diverged`); ``--resume`` from a checkpoint with non-finite weights.
        """
        try:
            return self._train(resume)
        finally:
            if self._tracking:
                self.accelerator.end_training()

    def _train(self, resume: bool) -> Path:
        from ..progress import ProgressReporter

        if self.is_main:
            atomic_write_text(self.output_dir / RECIPE_NAME, dump_recipe(self.recipe))
        ckpts = checkpoints(self.output_dir) if resume else []
        if ckpts:
            self.load_checkpoint(ckpts[-1])
        elif resume:
            self.log("resume: no checkpoint found, starting from scratch")
        if self.unit.trains_target and self.step == 0:
            # the target changes in this run: record its held-out quality before the first update
            self.held_out_before = self._held_out_eval(prefix="held_out_before/")
        crash_at = int(os.environ.get("SPECULATORS_TEST_CRASH_AT_STEP", "0"))  # test hook: simulate a kill
        spec = self.spec
        self.prepared.train()
        t_start, tokens_seen, t_window, tok_window = time.time(), 0, time.time(), 0
        metrics: dict[str, float] = {}
        stop = self.step >= self.total_steps
        # a rich bar on a terminal, periodic plain lines in a log file/pipe, off with SPECULATORS_NO_PROGRESS=1
        progress = ProgressReporter(console=self.console, log=self.log) if self.is_main else NoProgress()
        n_proc = self.accelerator.num_processes
        engine = "FSDP2 on CPU, gloo" if self.fsdp_cpu else self.accelerator.distributed_type.value
        procs = f" x {n_proc} processes ({engine})" if n_proc > 1 else ""
        self.log(f"train: {self.total_steps} steps, {self.batches_per_epoch} batches/epoch of <= "
                 f"{spec.batch_tokens} tokens, grad_accum {spec.grad_accum}{procs}, lr {spec.lr}, {self.precision}, "
                 f"{self.device}")
        self._start_tracking()  # rank 0: the recipe and the run's identity are logged first
        with progress:
            task = progress.add_task("train", total=self.total_steps, completed=self.step, unit="steps", info="")
            while not stop:
                window = self._next_window()
                loss_value, metrics = self._backward_window(window)
                loss_value, n_tok = self._global_loss(loss_value, sum(b.num_tokens for b in window))
                gnorm = self._optimizer_step()
                tokens_seen += n_tok
                tok_window += n_tok
                self.scheduler.step()
                self.step += 1
                if self.step % spec.log_every == 0 or self.step == 1:
                    now = time.time()
                    tps = tok_window / max(now - t_window, 1e-9)
                    t_window, tok_window = now, 0
                    self._log_step(loss_value, gnorm, tps, metrics, progress, task)
                progress.update(task, completed=self.step)
                if self.step % spec.eval_every == 0 or self.step == self.total_steps:
                    self.held_out_last = self._held_out_eval() or self.held_out_last
                if self.step % spec.checkpoint_every == 0:
                    self.save_checkpoint()
                    if crash_at and self.step >= crash_at:
                        os._exit(3)
                out_of_time = spec.max_minutes is not None and (time.time() - t_start) > 60 * spec.max_minutes
                if self.step >= self.total_steps or out_of_time:
                    if out_of_time:
                        self.log(f"train: stopping at step {self.step}: train.max_minutes reached")
                    stop = True
        dt = time.time() - t_start
        self.log(f"train: {self.step} steps, {tokens_seen} tokens in {dt:.1f}s "
                 f"({tokens_seen / max(dt, 1e-9):.0f} drafter tokens/s)")
        if self.held_out_last.get("step") != self.step:  # stopped early (max_minutes) or resumed at the end
            self.held_out_last = self._held_out_eval() or self.held_out_last
        self.save_checkpoint()
        return self._write_final(tokens_seen, dt)

    def _log_step(self, loss_value: float, gnorm, tps: float, metrics: dict[str, float], progress, task) -> None:
        """The scalars of a logged step: ``train/loss`` is the global batch's loss (= the loss of its
        micro-batches as one batch, all ranks); the family's metrics (loss_j, accuracies, sim_tau) are
        rank 0's last micro-batch's."""
        lrs = self.scheduler.get_last_lr()
        scal = {"train/loss": loss_value, "train/lr": lrs[0],
                **{f"train/lr_{n}": lr for n, lr in zip(self.group_names[1:], lrs[1:])},
                "train/grad_norm": float(gnorm), "train/tokens_per_s": tps,
                **{f"train/{k}": v for k, v in metrics.items()}}
        self._log_scalars(scal)
        progress.update(task, info=f"loss {loss_value:.3f} sim_tau {metrics.get('sim_tau', 0):.2f} "
                                   f"acc0 {metrics.get('full_acc_0', 0):.2f} {tps:.0f} tok/s")

    def _write_final(self, tokens_seen: int, seconds: float) -> Path:
        """Write ``OUTPUT_DIR/final`` (rank 0; published: ``train.save_dtype``, no frozen target copies, the
        model card), full weights under FSDP; returns its path."""
        final = self.output_dir / "final"
        producer = getattr(self.data, "producer", None)  # who regenerated the answers (a server or our loop)
        card = model_card(self.unit, self.step, tokens_seen, seconds, self.held_out_before, self.held_out_last,
                          data_report=getattr(self.data, "report", None), data_producer=producer)
        with self._full_weights():
            if self.is_main:
                self.unit.save(final, recipe_yaml=dump_recipe(self.recipe), extra_files={"README.md": card},
                               dtype=self.spec.save_dtype, frozen_copies=False,  # published; step-N stay exact
                               provenance={"data_producer": producer} if producer else None)
        if self.fsdp_cpu:  # the unit in memory is the trained model on every rank, as after one process
            keep_full_parameters(self.unit)
        self.accelerator.wait_for_everyone()
        self.log(f"train: final drafter written to {final}")
        return final
