"""The run directory of ``speculators train``: its rules and its checkpoints.

``--resume`` / ``--overwrite`` (:func:`check_output_dir`, :func:`prepare_output_dir`,
:func:`check_resume_recipe`), the default location (:func:`default_output_dir`), the resumable
checkpoints ``checkpoints/step-N/`` (:func:`checkpoints`, oldest first; :func:`checkpoint_weights_problem`),
the run card ``final/README.md`` (:func:`model_card`) and the names inside checkpoints (``trainer_state.pt``, ``engine_state/``, ``diverged-`` for checkpoints set
aside after a divergence). The layout itself is described in :mod:`speculators.train.trainer`.
"""

from __future__ import annotations

import re
import shutil
from pathlib import Path

from ..drafters.checkpoint import RECIPE_NAME, check_weights
from ..errors import SpeculatorsError
from ..recipe import Recipe

STATE_NAME = "trainer_state.pt"
ENGINE_STATE_DIR = "engine_state"  # FSDP / DeepSpeed: accelerate's save_state (sharded optimizer, weights)
CKPT_RE = re.compile(r"^step-(\d+)$")
RUN_RECIPE = "recipe.yaml"
RESUME_SECTIONS = ("target", "data", "drafter")
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


def _unprefixed(ev: dict[str, float], prefix: str = "held_out/") -> dict[str, float]:
    """Held-out metrics without their ``held_out/`` prefix (and without ``step``)."""
    return {k[len(prefix):]: v for k, v in ev.items() if k.startswith(prefix)}


def model_card(unit, steps: int, tokens: int, seconds: float, before: dict[str, float],
               after: dict[str, float], data_report: dict | None = None, data_producer: dict | None = None) -> str:
    """``final/README.md``: what was trained, on what, how long, the unit's own lines
    (``TrainingUnit.card_lines``: for a joint run the adapter and the target's held-out perplexity before
    and after training), the last held-out metrics (``before`` / ``after``: ``held_out/`` names) and the
    training data per source with the rows each filter dropped (``data_report``:
    :func:`speculators.data.pipeline.report_markdown`) and who regenerated its answers (``data_producer``:
    :func:`speculators.data.server_regen.producer_line`)."""
    m = unit.drafter.meta
    lines = [f"# {unit.drafter.algorithm} drafter for {m.name_or_path}", "",
             f"Trained by speculators from `{RECIPE_NAME}` (in this directory): {steps} steps, {tokens} tokens, "
             f"{seconds / 60:.1f} min.", "",
             f"Target dtype: {getattr(m, 'dtype', None) or 'not recorded'} (the target's dtype for regeneration, "
             "features and the "
             "logit labels; `speculators eval` serves it in this dtype by default and warns when told otherwise).", ""]
    lines += unit.card_lines(_unprefixed(before), _unprefixed(after))
    if after:
        lines += ["| held-out metric | before training | after training |", "|---|---|---|"]
        for k in sorted(k for k in after if k != "step"):
            name = k.replace("held_out/", "")
            b = before.get(k)
            lines.append(f"| {name} | {'-' if b is None else f'{b:.4f}'} | {after[k]:.4f} |")
    if data_report:
        from ..data.pipeline import report_markdown

        lines += [""] + report_markdown(data_report)
    from ..data.server_regen import producer_line

    if producer_line(data_producer):
        lines += [producer_line(data_producer), ""]
    return "\n".join(lines) + "\n"


__all__ = ["model_card", "CKPT_RE", "DIVERGED_PREFIX", "ENGINE_STATE_DIR", "STATE_NAME", "check_output_dir", "checkpoint_weights_problem",
           "checkpoints", "prepare_output_dir"]


def default_output_dir(recipe: Recipe, recipe_file: str | Path | None = None) -> Path:
    """The run directory when none is given: ``recipe.output_dir``, else ``outputs/<recipe file stem>``.

    Raises:
        SpeculatorsError: neither is known (a recipe built in Python without ``output_dir``).
    """
    if recipe.output_dir:
        return Path(recipe.output_dir)
    if recipe_file is not None:
        return Path("outputs") / Path(recipe_file).stem
    raise SpeculatorsError("no run directory: pass output_dir (or set output_dir in the recipe)")


def check_resume_recipe(run_dir: Path, recipe: Recipe) -> None:
    """``--resume``: refuse a recipe whose target, data or drafter section differs from the run's
    ``run_dir/recipe.yaml`` (both compared as resolved JSON, ``target.device_map`` excepted: a run may
    resume on other hardware; nothing to check when the run has none).

    Raises:
        SpeculatorsError: naming the sections that differ and the recorded recipe file.
    """
    f = Path(run_dir) / RUN_RECIPE
    if not f.is_file():
        return
    import yaml

    try:
        old = yaml.safe_load(f.read_text()) or {}
    except yaml.YAMLError as e:
        raise SpeculatorsError(f"--resume: {f} is not valid YAML ({str(e).splitlines()[0]}); use --overwrite") \
            from None
    if not isinstance(old, dict):
        raise SpeculatorsError(f"--resume: {f} is not a recipe mapping; use --overwrite")
    try:  # fields added since the run was started read as their defaults (e.g. data.features: offline)
        from ..recipe import recipe_from_dict

        old = recipe_from_dict(old, str(f)).model_dump(mode="json")
    except SpeculatorsError:
        pass  # no longer a valid recipe: compared as written
    new = recipe.model_dump(mode="json")
    for d in (old, new):  # where the target sits (target.device_map) does not change what is trained
        if isinstance(d.get("target"), dict):
            d["target"] = {k: v for k, v in d["target"].items() if k != "device_map"}
    changed = [k for k in RESUME_SECTIONS if old.get(k) != new.get(k)]
    if changed:
        raise SpeculatorsError(f"--resume: the recipe's {', '.join(changed)} section(s) differ from the run's "
                               f"{f}; resume with the same recipe or use --overwrite")
