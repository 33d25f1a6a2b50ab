"""The recipe: one YAML file validated by pydantic (target, data, drafter, train, eval).

Unknown keys and bad values are errors naming the field path (e.g. ``train.lr``) and what is allowed.
The ``drafter`` section is validated by the config class that the chosen family registers
(``speculators.drafters.registry``), so this module never names a family.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any, Literal

import yaml
from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator, model_validator

from .errors import SpeculatorsError


class Strict(BaseModel):
    """Base for recipe sections: unknown keys are errors, assignments are validated."""

    model_config = ConfigDict(extra="forbid", validate_assignment=True)


class TargetSpec(Strict):
    model: str = Field(description="hub id, local dir, .gguf file, or the alias smollm2-135m-instruct")
    dtype: Literal["float32", "bfloat16", "float16"] = "float32"
    aux_layer_ids: list[int] | None = Field(
        default=None, description="0-based decoder layers whose OUTPUT is tapped; default [1, L//2-1, L-4]")


class SourceSpec(Strict):
    source: str = Field(description="humaneval | chatterbot | path to .jsonl/.json | hf:NAME[:SPLIT]")
    max_examples: int | None = Field(default=None, gt=0)
    regenerate: bool | None = Field(default=None, description="overrides data.regenerate for this source")


class RegenerationSpec(Strict):
    max_new_tokens: int = Field(default=256, gt=0)
    temperature: float = Field(default=0.0, ge=0.0)
    top_p: float = Field(default=1.0, gt=0.0, le=1.0)
    batch_size: int = Field(default=16, gt=0)
    seed: int = 0


class HeldOutSpec(Strict):
    fraction: float = Field(default=0.1, ge=0.0, lt=1.0)
    seed: int = 0


class DataSpec(Strict):
    sources: list[SourceSpec] = Field(min_length=1)
    regenerate: bool = Field(default=True, description="regenerate assistant turns with the target")
    regeneration: RegenerationSpec = RegenerationSpec()
    max_length: int = Field(default=1024, gt=8)
    held_out: HeldOutSpec = HeldOutSpec()
    chat_template: str | None = None
    feature_batch_tokens: int = Field(default=4096, gt=0, description="tokens per feature-extraction forward")

    @field_validator("sources", mode="before")
    @classmethod
    def _strings_to_specs(cls, v: Any) -> Any:
        if isinstance(v, list):
            return [{"source": x} if isinstance(x, str) else x for x in v]
        return v


class TrainSpec(Strict):
    epochs: float | None = Field(default=None, gt=0)
    steps: int | None = Field(default=None, gt=0)
    max_minutes: float | None = Field(default=None, gt=0, description="stop training after this wall time")
    lr: float = Field(default=3e-4, gt=0.0)
    weight_decay: float = Field(default=0.0, ge=0.0)
    schedule: Literal["cosine", "linear", "constant"] = "cosine"
    warmup_steps: int = Field(default=20, ge=0)
    batch_tokens: int = Field(default=4096, gt=0, description="tokens per optimizer micro-batch (padded)")
    grad_accum: int = Field(default=1, gt=0)
    grad_clip: float = Field(default=1.0, gt=0.0)
    precision: Literal["fp32", "bf16"] = "fp32"
    seed: int = 0
    checkpoint_every: int = Field(default=200, gt=0, description="steps between checkpoints")
    eval_every: int = Field(default=100, gt=0, description="steps between held-out evaluations")
    log_every: int = Field(default=10, gt=0)
    init_from: str | None = Field(default=None, description="checkpoint directory of the same family to "
                                                            "start the drafter's weights from")

    @model_validator(mode="after")
    def _length(self) -> "TrainSpec":
        if self.epochs is None and self.steps is None:
            self.epochs = 1.0
        return self


class EvalSpec(Strict):
    k: int = Field(default=4, gt=0, le=64, description="num_speculative_tokens")
    temperature: float = Field(default=0.0, ge=0.0)
    top_p: float = Field(default=1.0, gt=0.0, le=1.0)
    top_k: int = Field(default=0, ge=0)
    num_prompts: int = Field(default=16, gt=0)
    max_new_tokens: int = Field(default=128, gt=0)
    ngram_max: int = Field(default=3, gt=0, description="prompt-lookup baseline: longest n-gram matched")
    seed: int = 0


class Recipe(Strict):
    target: TargetSpec
    data: DataSpec
    drafter: dict[str, Any]
    train: TrainSpec = TrainSpec()
    eval: EvalSpec = EvalSpec()
    output_dir: str | None = None

    def drafter_config(self):
        """The family's validated config object for ``drafter``."""
        from .drafters import registry

        return registry.get(self.drafter["algorithm"]).config_class.model_validate(self.drafter)


def _format_validation_error(e: ValidationError, source: str) -> str:
    lines = []
    for err in e.errors():
        path = ".".join(str(p) for p in err["loc"] if p != "__root__")
        msg = err["msg"]
        if err["type"] == "extra_forbidden":
            msg = "unknown key (misspelled?)"
        elif err["type"] == "missing":
            msg = "required key is missing"
        lines.append(f"{source}: {path}: {msg}")
    return "; ".join(lines)


def _set_path(d: dict, dotted: str, value: Any) -> None:
    keys = dotted.split(".")
    cur = d
    for k in keys[:-1]:
        if not isinstance(cur.get(k), dict):
            cur[k] = {}
        cur = cur[k]
    cur[keys[-1]] = value


def parse_overrides(overrides: list[str]) -> list[tuple[str, Any]]:
    """Parse ``key.path=value`` overrides; values are YAML scalars (``train.lr=1e-4``, ``eval.k=8``).

    Raises:
        SpeculatorsError: an override without ``=``.
    """
    out = []
    for o in overrides:
        if "=" not in o:
            raise SpeculatorsError(f"override {o!r} must look like key.path=value (e.g. train.lr=1e-4)")
        k, v = o.split("=", 1)
        try:
            value = yaml.safe_load(v)
        except yaml.YAMLError:
            value = v  # not a YAML scalar (e.g. a Jinja template): keep the raw string
        out.append((k.strip(), value))
    return out


def load_recipe(path: str | Path, overrides: list[str] | None = None) -> Recipe:
    """Read, override and validate a recipe YAML file.

    Raises:
        SpeculatorsError: missing file, bad YAML, unknown keys or bad values (message names the field path).
    """
    path = Path(path)
    if not path.is_file():
        raise SpeculatorsError(f"recipe file {str(path)!r} does not exist")
    try:
        raw = yaml.safe_load(path.read_text())
    except yaml.YAMLError as e:
        mark, ctx = getattr(e, "problem_mark", None), getattr(e, "context_mark", None)
        where = f" (line {mark.line + 1}, column {mark.column + 1}" if mark is not None else ""
        if where and ctx is not None:
            where += f"; {getattr(e, 'context', None) or 'started'} at line {ctx.line + 1}, column {ctx.column + 1}"
        where += ")" if where else ""
        problem = getattr(e, "problem", None) or str(e).splitlines()[0]
        raise SpeculatorsError(f"{path}: not valid YAML{where}: {problem}") from None
    if not isinstance(raw, dict):
        raise SpeculatorsError(f"{path}: a recipe is a mapping with keys target, data, drafter, train, eval")
    for k, v in parse_overrides(overrides or []):
        _set_path(raw, k, v)
    return recipe_from_dict(raw, source=str(path))


def recipe_from_dict(raw: dict, source: str = "recipe") -> Recipe:
    """Validate a recipe given as a dict (see ``load_recipe``)."""
    from .drafters import registry

    try:
        recipe = Recipe.model_validate(raw)
    except ValidationError as e:
        raise SpeculatorsError(_format_validation_error(e, source)) from None
    algo = recipe.drafter.get("algorithm")
    if algo not in registry.names():
        raise SpeculatorsError(f"{source}: drafter.algorithm: {algo!r} is not a drafter family; "
                               f"allowed: {registry.names()}")
    try:
        cfg = registry.get(algo).config_class.model_validate(recipe.drafter)
    except ValidationError as e:
        msg = _format_validation_error(e, source)
        raise SpeculatorsError(msg.replace(f"{source}: ", f"{source}: drafter.")) from None
    recipe.drafter = cfg.model_dump()
    return recipe


def dump_recipe(recipe: Recipe) -> str:
    """The resolved recipe as YAML (saved beside every checkpoint)."""
    return yaml.safe_dump(recipe.model_dump(mode="json"), sort_keys=False)
