"""One generic trainer for every drafter family (accelerate: CPU now, GPUs later with no code change).

AdamW, warmup + cosine/linear/constant schedule, gradient clipping and accumulation, fp32/bf16,
seeded, periodic held-out evaluation, atomic checkpoints every N steps, ``--resume`` from the last
checkpoint with the same optimizer/scheduler/RNG/data position, a rich progress bar (loss, acceptance
metrics, tokens/s) and TensorBoard scalars. The trainer steps ONE training unit
(:class:`speculators.training_unit.TrainingUnit`: the drafter plus, for a joint run, the LoRA-adapted
target) and never looks at the family nor at whether the target trains: it calls the unit's
``loss_counts(batch)``, ``loss(batch, norm)``, ``param_groups(lr)``, ``save(path)`` / ``load(path)``, and
logs what the unit reports (``metrics_summary``, ``summary``, ``card_lines``).

Gradient accumulation is by tokens: each loss term of every micro-batch is divided by that term's count
over the whole accumulation window (all micro-batches, all processes), so the accumulated gradient
equals the gradient of the window as one batch. ``train/loss`` is the window's loss; the family's other
logged metrics are the window's last micro-batch's.

Divergence: a NaN/inf loss (training or held-out) or gradient norm stops the run; a checkpoint is
"good" only if its weights are finite and gave a finite loss (``step-s`` holds the weights first used by
the loss of step ``s + 1``). Checkpoints that are not good are renamed ``diverged-step-N`` so that
``--resume`` and ``speculators eval RUN_DIR`` skip them; non-finite weights are never written.

Run directory layout::

    OUTPUT_DIR/recipe.yaml                 resolved recipe
    OUTPUT_DIR/checkpoints/step-000200/    drafter checkpoint + trainer_state.pt (resumable)
    OUTPUT_DIR/final/                      the trained drafter (what `speculators eval` loads)
    OUTPUT_DIR/tensorboard/, train_log.jsonl
"""

from __future__ import annotations

import dataclasses
import json
import math
import os
import random
import re
import shutil
import time
from pathlib import Path

import torch

from .data.dataset import make_batch, plan_batches
from .drafters.checkpoint import RECIPE_NAME, check_weights
from .errors import SpeculatorsError
from .recipe import dump_recipe
from .training_unit import TrainingUnit
from .utils import atomic_write_text

STATE_NAME = "trainer_state.pt"
CKPT_RE = re.compile(r"^step-(\d+)$")
DIVERGED_PREFIX = "diverged-"  # a checkpoint found not good after a divergence: step-N -> diverged-step-N


def checkpoints(output_dir: Path) -> list[Path]:
    """Complete checkpoints of a run, oldest first (temporary ``.step-*`` dirs are ignored)."""
    d = Path(output_dir) / "checkpoints"
    if not d.is_dir():
        return []
    found = [p for p in d.iterdir() if CKPT_RE.match(p.name) and (p / STATE_NAME).is_file()]
    return sorted(found, key=lambda p: int(CKPT_RE.match(p.name).group(1)))


def checkpoint_weights_problem(path: Path) -> str | None:
    """Why checkpoint ``path`` cannot be used: one of its weight files cannot be read or holds a NaN/inf
    (:func:`speculators.drafters.checkpoint.check_weights`); ``None`` when every tensor is finite."""
    try:
        check_weights(path)
    except SpeculatorsError as e:
        return str(e)
    return None


def fast_bf16() -> bool:
    """True when bf16 autocast is faster than fp32 here: a CUDA device with bf16 support, or a CPU with
    native bf16 matrix instructions (``avx512_bf16`` or ``amx_bf16`` in ``/proc/cpuinfo``). On an
    AVX2-only CPU torch emulates bf16 matmuls, ~10x slower than fp32 (measured on this project's AMD EPYC
    machines)."""
    if torch.cuda.is_available():
        return bool(torch.cuda.is_bf16_supported())
    try:
        flags = Path("/proc/cpuinfo").read_text()
    except OSError:
        return False
    return "avx512_bf16" in flags or "amx_bf16" in flags


def resolve_precision(precision: str) -> str:
    """``train.precision`` -> ``"fp32"`` or ``"bf16"`` (``"auto"``: bf16 where :func:`fast_bf16`)."""
    if precision == "auto":
        return "bf16" if fast_bf16() else "fp32"
    return precision


def check_output_dir(output_dir: Path, resume: bool, overwrite: bool) -> None:
    """Check the ``--resume`` / ``--overwrite`` rules before any work starts (nothing is written).

    Raises:
        SpeculatorsError: the path exists and is not a directory; the directory exists (non-empty)
            and neither flag is given; both flags are given.
    """
    if resume and overwrite:
        raise SpeculatorsError("--resume and --overwrite are mutually exclusive")
    if output_dir.exists() and not output_dir.is_dir():
        raise SpeculatorsError(f"output directory {str(output_dir)!r} exists and is not a directory")
    if output_dir.exists() and any(output_dir.iterdir()) and not (resume or overwrite):
        raise SpeculatorsError(f"output directory {str(output_dir)!r} already exists; "
                               "pass --resume to continue it or --overwrite to replace it")


def prepare_output_dir(output_dir: Path, resume: bool, overwrite: bool) -> None:
    """Apply the rules of :func:`check_output_dir`, then create the run directory (deleting an
    existing one with ``overwrite``). Called once the run is about to start training."""
    check_output_dir(output_dir, resume, overwrite)
    if overwrite and output_dir.exists():
        shutil.rmtree(output_dir)
    output_dir.mkdir(parents=True, exist_ok=True)


class Trainer:
    """Train one training unit on ``data`` following ``recipe.train`` and write checkpoints to ``output_dir``.

    Args:
        recipe: the validated :class:`speculators.recipe.Recipe`.
        unit: the :class:`speculators.training_unit.TrainingUnit` to train (a bare frozen-target
            :class:`speculators.drafters.Drafter` is wrapped into one).
        data: :class:`speculators.data.pipeline.PreparedData`.
        output_dir: run directory (see module docstring).
        log: callable for log lines.
    Raises:
        SpeculatorsError: a bare drafter that trains the target (build its unit with the adapted target).
    """

    def __init__(self, recipe, unit, data, output_dir: str | Path, log=print, console=None):
        from accelerate import Accelerator

        if not isinstance(unit, TrainingUnit):
            unit = TrainingUnit(unit)

        self.recipe, self.spec = recipe, recipe.train
        self.data = data
        self.output_dir = Path(output_dir)
        self.log = log
        self.console = console
        self.precision = resolve_precision(self.spec.precision)
        self.accelerator = Accelerator(mixed_precision="bf16" if self.precision == "bf16" else "no",
                                       cpu=not torch.cuda.is_available(),
                                       gradient_accumulation_steps=self.spec.grad_accum)
        self.device = self.accelerator.device
        self.batches_per_epoch = len(plan_batches(data.train, self.spec.batch_tokens, self.spec.seed, 0))
        if self.spec.steps is not None:
            self.total_steps = self.spec.steps
        else:
            self.total_steps = max(1, math.ceil(self.spec.epochs * self.batches_per_epoch / self.spec.grad_accum))
        torch.manual_seed(self.spec.seed)
        groups = unit.param_groups(self.spec.lr)
        self.group_names = [g.get("name", f"group{i}") for i, g in enumerate(groups)]  # train/lr_<name>
        self.optimizer = torch.optim.AdamW(groups, lr=self.spec.lr, weight_decay=self.spec.weight_decay,
                                           betas=(0.9, 0.95))
        self.scheduler = self._scheduler()
        self.prepared, self.optimizer = self.accelerator.prepare(unit, self.optimizer)
        self.step, self.epoch, self.batch_idx = 0, 0, 0
        self.tb = None
        self.held_out_before: dict[str, float] = {}
        self.held_out_last: dict[str, float] = {}

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
        bad = next((n for n, p in self.unit.named_parameters() if p.requires_grad and not torch.isfinite(p).all()),
                   None)
        if bad is not None:
            raise self._diverged(f"weight {bad!r} became NaN/inf after the update of step {self.step}",
                                 at_step=self.step, condemn_from=None)
        path = self.output_dir / "checkpoints" / f"step-{self.step:06d}"
        state = {"step": self.step, "epoch": self.epoch, "batch_idx": self.batch_idx,
                 "optimizer": self.optimizer.state_dict(), "scheduler": self.scheduler.state_dict(),
                 "torch_rng": torch.get_rng_state(), "python_rng": random.getstate(),
                 "total_steps": self.total_steps, "held_out_before": self.held_out_before,
                 "held_out_last": self.held_out_last}
        self.unit.save(path, recipe_yaml=dump_recipe(self.recipe),
                       extra=lambda tmp: torch.save(state, tmp / STATE_NAME))
        for old in checkpoints(self.output_dir)[:-2]:  # keep the two newest
            shutil.rmtree(old, ignore_errors=True)
        return path

    def load_checkpoint(self, path: Path) -> None:
        """``--resume``: restore the unit's weights (``TrainingUnit.load``), the optimizer, scheduler, RNG
        states, data position and held-out history of checkpoint ``path``.

        Raises:
            SpeculatorsError: a weight file of ``path`` is unreadable, holds a NaN/inf, or does not fit.
        """
        try:
            self.unit.load(path)
        except SpeculatorsError as e:
            raise SpeculatorsError(f"--resume: checkpoint {path} is not good: {e}; delete it (or rename it "
                                   f"to {DIVERGED_PREFIX}{path.name}) to resume from an older one") from None
        state = torch.load(path / STATE_NAME, weights_only=False)
        self.optimizer.load_state_dict(state["optimizer"])
        self.scheduler.load_state_dict(state["scheduler"])
        torch.set_rng_state(state["torch_rng"])
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
        other metrics are the unit's :meth:`~speculators.training_unit.TrainingUnit.metrics_summary` of the
        batches (for a joint run it includes the target's perplexity ``held_out/ppl``).
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
        for b, c in zip(batches, counts):
            loss, metrics = self.unit.loss(b.to(self.device), norm)
            loss_sum += float(loss)
            parts.append((c, metrics))
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
        """The next ``train.grad_accum`` micro-batches (CPU :class:`Batch` es) of the data order,
        continuing into the next epoch when one ends; advances ``epoch``/``batch_idx`` past them (the
        data position a checkpoint written after this step resumes from)."""
        window = []
        while len(window) < self.spec.grad_accum:
            plan = self._plan()
            if self.batch_idx >= len(plan):
                self.epoch += 1
                self.batch_idx = 0
                continue
            window.append(make_batch(self.data.train, plan[self.batch_idx]))
            self.batch_idx += 1
        return window

    def _counts(self, batch) -> torch.Tensor:
        """``[n_terms]`` int64 loss-term counts of one CPU batch (``TrainingUnit.loss_counts``), on the
        device; only the masks travel (the cached features are not needed: a unit that needs the live
        target's reruns it itself)."""
        light = dataclasses.replace(batch, aux=batch.aux[..., :0], top=batch.top[..., :0])
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

        Returns:
            ``(window_loss, metrics)``: the window's loss (sum of the micro-batch losses, = the loss of
            the window as one batch) and the unit's metrics of the last micro-batch (its own means).
        Raises:
            SpeculatorsError: a micro-batch loss is NaN/inf (see :meth:`_diverged`).
        """
        norm = self._reduce_counts(torch.stack([self._counts(b) for b in window]).sum(0))
        scale = self.accelerator.gradient_accumulation_steps * self.accelerator.num_processes
        total, metrics = 0.0, {}
        for i, cpu_batch in enumerate(window):
            batch = cpu_batch.to(self.device)
            with self.accelerator.accumulate(self.prepared):
                if self.accelerator.sync_gradients != (i == len(window) - 1):
                    raise RuntimeError(f"gradient accumulation out of step: micro-batch {i + 1}/{len(window)} "
                                       f"with accelerate's gradient_accumulation_steps "
                                       f"{self.accelerator.gradient_accumulation_steps}")
                with self.accelerator.autocast():
                    loss, metrics = self.unit.loss(batch, norm)
                if not torch.isfinite(loss):
                    raise self._diverged(f"loss became {float(loss.detach())}", at_step=self.step + 1,
                                         condemn_from=self.step)
                self.accelerator.backward(loss * scale)
            total += float(loss.detach())
        return total, metrics

    def _optimizer_step(self) -> float:
        """Clip the accumulated gradient, update, zero the gradients; returns the pre-clip norm.

        Raises:
            SpeculatorsError: the gradient norm is NaN/inf (nothing is updated).
        """
        gnorm = self.accelerator.clip_grad_norm_(self.prepared.parameters(), self.spec.grad_clip)
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
        inspection; ``checkpoints()``, ``--resume`` and ``speculators eval RUN_DIR`` skip them).
        """
        bad = []
        for ck in checkpoints(self.output_dir):
            s = int(CKPT_RE.match(ck.name).group(1))
            why = "gave a NaN/inf loss" if condemn_from is not None and s >= condemn_from else \
                checkpoint_weights_problem(ck)
            if why is not None:
                dest = ck.parent / f"{DIVERGED_PREFIX}{ck.name}"
                shutil.rmtree(dest, ignore_errors=True)
                os.replace(ck, dest)
                bad.append(dest.name)
        good = checkpoints(self.output_dir)
        msg = (f"{what} at step {at_step}; stopping. Last good checkpoint: {good[-1] if good else 'none'}")
        if bad:
            msg += f" ({', '.join(bad)}: not good, renamed so that --resume and eval skip it)"
        return SpeculatorsError(msg + " (try a lower train.lr)")

    def _log_scalars(self, scalars: dict[str, float]) -> None:
        if self.tb is None:
            from torch.utils.tensorboard import SummaryWriter

            self.tb = SummaryWriter(str(self.output_dir / "tensorboard"))
        for k, v in scalars.items():
            self.tb.add_scalar(k, v, self.step)
        with open(self.output_dir / "train_log.jsonl", "a") as f:
            f.write(json.dumps({"step": self.step, **scalars}) + "\n")

    def train(self, resume: bool = False) -> Path:
        """Run the training loop; returns the final checkpoint directory (``OUTPUT_DIR/final``).

        Raises:
            SpeculatorsError: the loss, the held-out loss, the gradient norm or a weight became NaN/inf;
                the message names the last good checkpoint (or none) and the ones set aside
                (:meth:`_diverged`); ``--resume`` from a checkpoint with non-finite weights.
        """
        from .progress import ProgressReporter

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
        progress = ProgressReporter(console=self.console, log=self.log)
        self.log(f"train: {self.total_steps} steps, {self.batches_per_epoch} batches/epoch of <= "
                 f"{spec.batch_tokens} tokens, grad_accum {spec.grad_accum}, lr {spec.lr}, {self.precision}, {self.device}")
        with progress:
            task = progress.add_task("train", total=self.total_steps, completed=self.step, unit="steps", info="")
            while not stop:
                window = self._next_window()
                loss_value, metrics = self._backward_window(window)
                gnorm = self._optimizer_step()
                n_tok = sum(b.num_tokens for b in window)
                tokens_seen += n_tok
                tok_window += n_tok
                self.scheduler.step()
                self.step += 1
                if self.step % spec.log_every == 0 or self.step == 1:
                    now = time.time()
                    tps = tok_window / max(now - t_window, 1e-9)
                    t_window, tok_window = now, 0
                    lrs = self.scheduler.get_last_lr()
                    # train/loss: the whole window's loss (= the loss of its micro-batches as one batch);
                    # the family's metrics (loss_j, accuracies, sim_tau): the window's last micro-batch
                    scal = {"train/loss": loss_value, "train/lr": lrs[0],
                            **{f"train/lr_{n}": lr for n, lr in zip(self.group_names[1:], lrs[1:])},
                            "train/grad_norm": float(gnorm), "train/tokens_per_s": tps,
                            **{f"train/{k}": v for k, v in metrics.items()}}
                    self._log_scalars(scal)
                    progress.update(task, info=f"loss {loss_value:.3f} sim_tau {metrics.get('sim_tau', 0):.2f} "
                                               f"acc0 {metrics.get('full_acc_0', 0):.2f} {tps:.0f} tok/s")
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
        final = self.output_dir / "final"
        card = model_card(self.unit, self.step, tokens_seen, dt, self.held_out_before, self.held_out_last)
        self.unit.save(final, recipe_yaml=dump_recipe(self.recipe), extra_files={"README.md": card})
        if self.tb is not None:
            self.tb.close()
        self.log(f"train: final drafter written to {final}")
        return final


def _unprefixed(ev: dict[str, float], prefix: str = "held_out/") -> dict[str, float]:
    """Held-out metrics without their ``held_out/`` prefix (and without ``step``)."""
    return {k[len(prefix):]: v for k, v in ev.items() if k.startswith(prefix)}


def model_card(unit: TrainingUnit, steps: int, tokens: int, seconds: float, before: dict[str, float],
               after: dict[str, float]) -> str:
    """``final/README.md``: what was trained, on what, how long, the unit's own lines
    (``TrainingUnit.card_lines``: for a joint run the adapter and the target's held-out perplexity before
    and after training) and the last held-out metrics (``before`` / ``after``: ``held_out/`` names)."""
    m = unit.drafter.meta
    lines = [f"# {unit.drafter.algorithm} drafter for {m.name_or_path}", "",
             f"Trained by speculators from `{RECIPE_NAME}` (in this directory): {steps} steps, {tokens} tokens, "
             f"{seconds / 60:.1f} min.", ""]
    lines += unit.card_lines(_unprefixed(before), _unprefixed(after))
    if after:
        lines += ["| held-out metric | before training | after training |", "|---|---|---|"]
        for k in sorted(k for k in after if k != "step"):
            name = k.replace("held_out/", "")
            b = before.get(k)
            lines.append(f"| {name} | {'-' if b is None else f'{b:.4f}'} | {after[k]:.4f} |")
    return "\n".join(lines) + "\n"
