"""Loading what an eval measures: the checkpoint's drafter, its target (in the dtype it was trained against, with
its aux-layer taps and a joint checkpoint's LoRA merged), the prompts, the K checks and the batch size.

:func:`speculators.workflows.eval_run` and :func:`speculators.workflows.calibrate_run` use these; each checkpoint's
drafter is loaded once (:func:`load_for_eval` takes it when already loaded).
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any

from ..errors import SpeculatorsError
from ..hardware import resolve_target_dtype
from ..recipe import EvalSpec, Recipe


def load_for_eval(ckpt: Path, rec: Recipe | None, target_model: str | None, device: str | None,
                   log: Callable[[str], None], dtype: str | None = None, drafter=None):
    """The checkpoint's drafter and its target, ready to decode: ``(drafter, target, target fingerprint
    as loaded)``. ``drafter``: the checkpoint's drafter already loaded (None = loaded here); it is moved to the
    target's device and given the target (families that draft through the target's frozen head need it). The
    target is :func:`load_target`'s."""
    if drafter is None:
        from ..drafters import Drafter

        drafter = Drafter.from_pretrained(ckpt)
    target, fingerprint = load_target(drafter, rec, target_model, device, log, dtype)
    drafter.to(target.device)
    drafter.attach_target(target)
    return drafter, target, fingerprint


def load_target(drafter, rec: Recipe | None, target_model: str | None, device: str | None,
                 log: Callable[[str], None], dtype: str | None = None):
    """The target ``drafter`` verifies against: ``(target, fingerprint as loaded)``. It taps the layers the
    drafter was trained on, loads on ``device`` (None = the recipe's ``target.device_map`` when set, else CUDA
    when present, else CPU; :meth:`speculators.target.Target.load`), merges a joint checkpoint's LoRA adapter,
    and stops at the recipe's chat template's end-of-turn. ``dtype`` (auto | float32 | bfloat16 | float16; None =
    the dtype the checkpoint was trained against, ``speculators_training.target.dtype``, else the recipe's
    ``target.dtype``, else float32) is resolved by :func:`speculators.hardware.resolve_target_dtype`; when the checkpoint records another dtype
    than the one served, a warning is logged (:func:`dtype_warning`)."""
    from ..drafters.base import check_target
    from ..target import Target

    served = resolve_target_dtype(dtype or drafter.meta.dtype or (rec.target.dtype if rec else "float32"), device, log)
    # the verifier taps the layers this drafter was trained on (check_target only checks)
    target = Target.load(target_model or rec.target.model, served,
                         aux_layer_ids=list(drafter.meta.aux_layer_ids), log=log, device=device,
                         device_map=None if rec is None or device is not None else rec.target.device_map)
    fingerprint = target.fingerprint
    warning = dtype_warning(drafter.meta.dtype, served)
    if warning:
        log(f"warning: {warning}")
    check_target(drafter, target, warn=log)
    if drafter.target_adapter_dir is not None:  # joint checkpoint: verify against the fine-tuned target
        target.merge_adapter(drafter.target_adapter_dir)
        log(f"target: merged the jointly trained LoRA adapter {drafter.target_adapter_dir} "
            f"(verifying against the fine-tuned target)")
    template = rec.data.chat_template if rec else None
    if template is not None:
        target.chat_template = template  # decoding stops at this template's end-of-turn too (stop_token_ids)
    return target, fingerprint


def dtype_warning(trained: str | None, served: str) -> str | None:
    """The warning an eval gives when the target is served in another dtype (``served``) than the one the
    drafter was trained against (``trained``: the checkpoint's ``speculators_training.target.dtype``; None =
    unknown, an older checkpoint: no warning). None when they agree."""
    if trained is None or trained == served:
        return None
    return (f"the drafter was trained against the target in {trained} (its features and logit labels), the target "
            f"is served in {served} here: acceptance can differ from what it was trained for; pass --dtype "
            f"{trained} to measure it as trained")


def eval_prompts(prompts: list[str] | None, rec: Recipe | None, target, limit: int,
                  log: Callable[[str], None] | None = None) -> tuple[list[dict], str]:
    """``(prompt list, label)``: the distinct prompts of the ``prompts`` data sources (in order, at most
    ``limit`` from EACH source, so that every source is measured; a prompt already taken from an earlier
    source is not repeated), each with ``"source"`` = the source as given (``--prompts`` value); else the
    recipe's held-out prompts (at most ``limit``; ``"source"`` = the recipe source they came from).
    Rows a ``--prompts`` source's loader skipped (duplicates, empty or malformed rows:
    :func:`speculators.data.sources.load_source`'s ``drops``) are logged, one line per source and reason,
    as ``eval prompts: dropped N of SOURCE (the whole source, before --num-prompts): REASON`` (N counts
    rows, or files for the reasons that say so)."""
    import dataclasses
    from collections import Counter

    from ..data.pipeline import held_out_prompts, load_data, unique_prompts
    from ..data.sources import load_source

    template = rec.data.chat_template if rec else None
    if prompts:
        plist, seen = [], set()
        for src in prompts:
            drops: Counter = Counter()
            try:
                convs = [dataclasses.replace(c, source=src) for c in load_source(src, drops=drops)]
            except SpeculatorsError:
                raise
            except ValueError as e:
                raise SpeculatorsError(f"--prompts {src}: {e}") from None
            for reason, n in sorted(drops.items()):
                if log is not None and n > 0:
                    log(f"eval prompts: dropped {n} of {src} (the whole source, before --num-prompts): {reason}")
            for p in unique_prompts(convs, target.tokenizer, template, limit=limit):
                if repr(p["messages"]) not in seen:
                    seen.add(repr(p["messages"]))
                    plist.append(p)
        if not plist:
            raise SpeculatorsError(f"--prompts {', '.join(prompts)}: no prompts in these sources")
        return plist, ", ".join(prompts)
    loaded = load_data(rec.data, target=target)  # target: source self
    plist = held_out_prompts(rec.data, target.tokenizer, loaded[0], limit=limit, dropped_groups=loaded.dropped_groups)
    if not plist:
        raise SpeculatorsError("the recipe has no held-out prompts (data.held_out.fraction = 0); pass --prompts")
    return plist, "held-out split of the recipe's sources"


def check_eval_k(drafter, ev: EvalSpec, overrides: Mapping[str, Any], names: Mapping[str, str], what: str) -> None:
    """Refuse every K of the eval (``ev.ks``: the sweep or ``[k]``) above what ``drafter`` can draft per
    step (:func:`speculators.decode.proposal.check_speculative_tokens`), for the methods that ask the
    drafter for K drafts: ``drafter`` (gated or not), ``drafter_argmax`` and ``hybrid`` without
    ``hybrid_drafter_k``. A
    hybrid with ``hybrid_drafter_k`` asks the drafter for at most that many (its lookup drafts the whole
    K), so that value is checked instead. The error names the setting the value came from: the
    command-line option (``names``, e.g. ``-k``, ``--hybrid-drafter-k``) when overridden, else
    ``eval.k`` / ``eval.k_sweep`` / ``eval.hybrid_drafter_k`` of the checkpoint's recipe.

    Raises:
        SpeculatorsError: one line with the offending values, the allowed maximum and ``what``.
    """
    from ..decode.proposal import check_speculative_tokens

    def setting(field: str) -> str:
        return (names.get(field) if overrides.get(field) is not None else None) or f"eval.{field}"

    methods = set(ev.methods)
    capped_hybrid = "hybrid" in methods and ev.hybrid_drafter_k is not None
    try:
        if {"drafter", "drafter_argmax"} & methods or ("hybrid" in methods and not capped_hybrid):
            check_speculative_tokens(drafter, ev.ks, setting("k_sweep" if ev.k_sweep else "k"))
        if capped_hybrid:
            check_speculative_tokens(drafter, [ev.hybrid_drafter_k], setting("hybrid_drafter_k"))
        if ev.trees:  # a tree's path is as long as a chain: the same cap, before any decoding
            from ..decode.tree_spec import TreeSpec

            check_speculative_tokens(drafter, [TreeSpec.parse(t, "eval.trees").depth for t in ev.trees],
                                     setting("trees") + " depth")
    except SpeculatorsError as e:
        raise SpeculatorsError(f"{what}: {e}") from None


def eval_batch_size(ev: EvalSpec, target, log) -> int:
    """The loaded batch size of an eval: ``eval.batch_size``, else the device's default, which falls back
    to 1 (with a log line) where the target cannot decode a batch."""
    from .runner import default_batch_size

    batch = ev.batch_size or default_batch_size(str(target.device))
    if batch > 1 and ev.batch_size is None:
        try:
            target.batch_session(batch)
        except SpeculatorsError as e:
            log(f"eval: batch 1 only: {e}")
            batch = 1
    return batch
