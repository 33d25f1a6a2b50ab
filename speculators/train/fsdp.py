"""FSDP2 (PyTorch's ``fully_shard``) of a training unit across CPU processes joined over gloo.

accelerate shards with FSDP only on accelerator devices: its ``AcceleratorState`` turns the FSDP plugin
on for ``MULTI_GPU`` / ``MULTI_XPU`` / ``MULTI_NPU`` / ... processes, and a CPU launch (``MULTI_CPU``,
gloo) of an FSDP config silently runs plain DDP (measured with accelerate 1.15). The same launcher
config (``distributed_type: FSDP``, ``recipes/accelerate/fsdp.yaml``; the launcher exports
``ACCELERATE_USE_FSDP=true``) therefore selects this module on CPU processes and accelerate's own FSDP on
GPUs: :func:`fsdp_on_cpu_requested`.

What is sharded: the whole :class:`~speculators.train.unit.TrainingUnit` (the drafter and, in a
joint run, the LoRA-adapted target) as ONE FSDP2 unit (``fully_shard(unit)``, a 1-D CPU device mesh
over all ranks): every parameter is a ``DTensor`` sharded on dim 0, gradients are reduce-scattered
(averaged over the ranks, as DDP's all-reduce) and the optimizer (built on the sharded parameters) keeps
its states sharded. The unit's ``forward`` (its loss) gathers the full weights for the forward/backward
and frees them after the backward. One unit, not one per layer, because a joint run calls the target's
inner model (``Target.train_forward``) and not the modules FSDP would hook; FSDP2 needs one parameter
dtype per unit (:func:`shard_unit` says so when they differ).

Checkpoints: the drafter checkpoints (``checkpoints/step-N``, ``final/``) are written as full weights by
rank 0 inside :func:`full_parameters` (the same files as a 1-process run's); the sharded weights and
optimizer state go to ``engine_state/`` with ``torch.distributed.checkpoint`` (:func:`save_engine_state`,
re-shardable: :func:`load_engine_state` reads them with any number of processes, one included).
"""

from __future__ import annotations

import contextlib
import os
from pathlib import Path

import torch
from torch import nn

from ..errors import SpeculatorsError

#: the file torch.distributed.checkpoint writes beside its shards: marks an engine_state/ of this module
DCP_METADATA = ".metadata"


def fsdp_on_cpu_requested(distributed_type) -> bool:
    """True when the launcher asked for FSDP (``ACCELERATE_USE_FSDP=true``, set by ``accelerate launch``
    from a config with ``distributed_type: FSDP``; set it by hand under ``torchrun``) and accelerate runs
    the processes on CPUs over gloo (``distributed_type`` ``MULTI_CPU``), where it would not shard."""
    from accelerate.utils import DistributedType

    wanted = os.environ.get("ACCELERATE_USE_FSDP", "false").lower() in ("true", "1")
    return wanted and distributed_type == DistributedType.MULTI_CPU


def shard_unit(unit: nn.Module) -> nn.Module:
    """``fully_shard`` ``unit`` in place over every rank of the default (gloo) process group, as one
    FSDP2 unit; returns it (its class becomes an ``FSDPModule`` subclass; parameters become ``DTensor``
    shards). Build the optimizer AFTER this, from the unit's (now sharded) parameters.

    Raises:
        SpeculatorsError: the default process group is not initialised (launch with ``accelerate launch``
            or ``torchrun``); the unit's floating-point parameters have more than one dtype (FSDP2 gathers
            one flat buffer per unit: e.g. a bfloat16 target with float32 adapters; use ``target.dtype:
            float32``).
    """
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    if not dist.is_initialized():
        raise SpeculatorsError("FSDP on CPU processes needs the process group of a multi-process launch "
                               "(accelerate launch --config_file recipes/accelerate/fsdp.yaml, or torchrun)")
    dtypes = sorted({str(p.dtype).removeprefix("torch.") for p in unit.parameters() if p.is_floating_point()})
    if len(dtypes) > 1:
        raise SpeculatorsError(f"FSDP shards the training unit as one group, whose parameters must share one "
                               f"dtype; they have {dtypes} (set target.dtype: float32 for a joint run on CPU "
                               "processes, or train with the DDP config recipes/accelerate/cpu.yaml)")
    mesh = init_device_mesh("cpu", (dist.get_world_size(),))
    fully_shard(unit, mesh=mesh, reshard_after_forward=True)
    return unit


def is_sharded(module: nn.Module) -> bool:
    """True when ``module`` (or a submodule) was sharded with ``fully_shard`` (FSDP2, this module's or
    accelerate's)."""
    from torch.distributed.fsdp import FSDPModule

    return any(isinstance(m, FSDPModule) for m in module.modules())


def local_part(t: torch.Tensor) -> torch.Tensor:
    """This rank's shard of a ``DTensor`` (``to_local()``), else ``t`` itself: for per-rank checks (a
    finite-weights test of the shards needs no communication)."""
    return t.to_local() if hasattr(t, "to_local") else t


def full_value(t) -> torch.Tensor:
    """A replicated or sharded ``DTensor`` as a plain tensor (``full_tensor()``, collective: every rank
    calls it), else ``t`` as a tensor (e.g. the gradient norm of ``clip_grad_norm_``)."""
    return t.full_tensor() if hasattr(t, "full_tensor") else torch.as_tensor(t)


def reshard(module: nn.Module) -> None:
    """Free the gathered full weights of every FSDP2 unit in ``module`` (``FSDPModule.reshard``; a no-op
    where they are already sharded): their parameters are the ``DTensor`` shards again."""
    from torch.distributed.fsdp import FSDPModule

    for m in module.modules():
        if isinstance(m, FSDPModule):
            m.reshard()


@contextlib.contextmanager
def full_parameters(module: nn.Module):
    """A context in which every ``DTensor`` parameter of ``module`` is replaced by a plain
    ``nn.Parameter`` holding its full value (``full_tensor()``: collective, every rank enters; the full
    weights then exist on every rank), so that ``state_dict()``, ``save_pretrained`` (drafter, peft
    adapter) and a plain forward see the whole model exactly as in a 1-process run. Parameters shared
    by several modules stay shared. On exit the ``DTensor`` parameters (those the optimizer holds) are
    put back; changes made to the full copies are NOT written back (read-only use: saving, counting).

    The units are resharded first (:func:`reshard`): FSDP2's ``state_dict`` pre-hook then has nothing to
    swap back under the full copies.
    """
    reshard(module)
    slots = [(m, name, p) for m in module.modules() for name, p in m.named_parameters(recurse=False)
             if hasattr(p, "full_tensor")]
    full: dict[int, nn.Parameter] = {}
    try:
        for m, name, p in slots:
            if id(p) not in full:
                full[id(p)] = nn.Parameter(p.full_tensor().detach().clone(), requires_grad=p.requires_grad)
            m._parameters[name] = full[id(p)]
        yield
    finally:
        for m, name, p in slots:
            m._parameters[name] = p


def keep_full_parameters(module: nn.Module) -> None:
    """End of training: replace every ``DTensor`` parameter of ``module`` by a plain ``nn.Parameter``
    holding its full value, for good (collective), so that the in-memory model is the trained model on
    every rank, as after a 1-process run (e.g. for a check that compares it with the written files).
    The optimizer keeps the shards; train no further after this."""
    with full_parameters(module):
        full = [(m, name, p) for m in module.modules() for name, p in m.named_parameters(recurse=False)]
    for m, name, p in full:
        m._parameters[name] = p


def set_gradient_sync(module: nn.Module, sync: bool) -> None:
    """FSDP2: reduce-scatter the gradients in this backward (``sync``) or accumulate them unsharded for
    a later one (the micro-batches of a gradient-accumulation window but its last)."""
    if hasattr(module, "set_requires_gradient_sync"):
        module.set_requires_gradient_sync(sync)


def _optimizer(optimizer):
    """The torch optimizer under accelerate's ``AcceleratedOptimizer`` wrapper(s)."""
    while hasattr(optimizer, "optimizer"):
        optimizer = optimizer.optimizer
    return optimizer


def save_engine_state(unit: nn.Module, optimizer, directory: str | Path) -> None:
    """Write the unit's weights and the optimizer state to ``directory`` with
    ``torch.distributed.checkpoint`` (every rank writes its shards; collective). Keys are parameter
    names (``get_model_state_dict`` / ``get_optimizer_state_dict``), so :func:`load_engine_state` can
    read them with another number of processes."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import get_model_state_dict, get_optimizer_state_dict

    reshard(unit)
    opt = _optimizer(optimizer)
    state = {"model": get_model_state_dict(unit), "optimizer": get_optimizer_state_dict(unit, opt)}
    dcp.save(state, checkpoint_id=str(directory))


def load_engine_state(unit: nn.Module, optimizer, directory: str | Path) -> None:
    """Restore the unit's weights and the optimizer state written by :func:`save_engine_state` (sharded or
    not, with any number of processes: ``torch.distributed.checkpoint`` re-shards; collective).

    Raises:
        SpeculatorsError: ``directory`` is not such a checkpoint, or it does not fit this unit/optimizer.
    """
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import (get_model_state_dict, get_optimizer_state_dict,
                                                         set_model_state_dict, set_optimizer_state_dict)

    directory = Path(directory)
    if not (directory / DCP_METADATA).is_file():
        raise SpeculatorsError(f"{directory}: not a torch.distributed.checkpoint directory (no {DCP_METADATA})")
    reshard(unit)
    opt = _optimizer(optimizer)
    state = {"model": get_model_state_dict(unit), "optimizer": get_optimizer_state_dict(unit, opt)}
    try:
        dcp.load(state, checkpoint_id=str(directory))
    except Exception as e:  # noqa: BLE001 - DCP raises CheckpointException (and others) for a mismatch
        raise SpeculatorsError(f"{directory}: the sharded weights/optimizer state do not fit this run: "
                               f"{str(e).strip().splitlines()[-1] if str(e).strip() else type(e).__name__}") from None
    set_model_state_dict(unit, state["model"])
    set_optimizer_state_dict(unit, opt, state["optimizer"])


def is_engine_state(directory: str | Path) -> bool:
    """True when ``directory`` holds a :func:`save_engine_state` checkpoint (``.metadata`` of
    ``torch.distributed.checkpoint``), not accelerate's ``save_state``."""
    return (Path(directory) / DCP_METADATA).is_file()


def deepspeed_on_cpu_requested() -> bool:
    """True when ``accelerate launch`` started this process for DeepSpeed (``ACCELERATE_USE_DEEPSPEED=true``,
    ``LOCAL_RANK`` set: a config with ``distributed_type: DEEPSPEED``) on a machine without CUDA: the
    trainer then runs DeepSpeed on its CPU accelerator (``DS_ACCELERATOR=cpu``) over gloo.

    Raises:
        SpeculatorsError: DeepSpeed is asked for and the ``deepspeed`` package cannot be imported (how to
            install it, and the configs that run without it).
    """
    if os.environ.get("ACCELERATE_USE_DEEPSPEED", "false").lower() not in ("true", "1") or \
            int(os.environ.get("LOCAL_RANK", -1)) == -1:
        return False
    import importlib.util

    if importlib.util.find_spec("deepspeed") is None:
        raise SpeculatorsError("the launcher config asks for DeepSpeed (distributed_type: DEEPSPEED) but the deepspeed "
                               "package is not installed: pip install 'speculators[deepspeed]' (on a CPU machine: "
                               "see docs/DISTRIBUTED.md), or launch with recipes/accelerate/fsdp.yaml or cpu.yaml")
    return True


__all__ = ["deepspeed_on_cpu_requested", "fsdp_on_cpu_requested", "shard_unit", "is_sharded", "full_parameters", "keep_full_parameters", "reshard",
           "save_engine_state", "load_engine_state", "is_engine_state", "set_gradient_sync", "local_part",
           "full_value"]
