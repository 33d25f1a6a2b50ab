"""Recipe validation: YAML in, validated objects out; every bad input is one SpeculatorsError line
that names the field path (and what is allowed)."""

from __future__ import annotations

from pathlib import Path

import pytest
import yaml

from speculators.drafters import registry
from speculators.errors import SpeculatorsError
from speculators.recipe import (
    Recipe,
    SourceSpec,
    dump_recipe,
    load_recipe,
    parse_overrides,
    recipe_from_dict,
)

TINY = Path(__file__).resolve().parent.parent / "recipes" / "tiny-eagle3.yaml"


def tiny_raw() -> dict:
    raw = yaml.safe_load(TINY.read_text())
    raw["target"]["model"] = "/some/target/dir"
    return raw


def write_recipe(tmp_path: Path, raw, name: str = "recipe.yaml") -> Path:
    p = tmp_path / name
    p.write_text(raw if isinstance(raw, str) else yaml.safe_dump(raw, sort_keys=False))
    return p


def error_of(fn, *args, **kwargs) -> str:
    with pytest.raises(SpeculatorsError) as ei:
        fn(*args, **kwargs)
    msg = str(ei.value)
    assert msg.strip(), "empty error message"
    assert "\n" not in msg, f"error message is not one line: {msg!r}"
    return msg


# ----------------------------------------------------------------------------- valid recipes


def test_tiny_recipe_parses_with_defaults_filled():
    rec = load_recipe(TINY, ["target.model=/some/target/dir"])
    assert isinstance(rec, Recipe)
    assert rec.target.model == "/some/target/dir"
    assert rec.target.dtype == "float32"
    assert [s.source for s in rec.data.sources] == ["chatterbot", "humaneval"]
    assert all(isinstance(s, SourceSpec) for s in rec.data.sources)
    assert rec.data.sources[0].regenerate is True and rec.data.sources[1].regenerate is False
    assert rec.data.sources[0].max_examples == 24
    assert rec.data.regeneration.max_new_tokens == 12 and rec.data.regeneration.batch_size == 8
    assert rec.data.regeneration.temperature == 0.0  # default
    assert rec.train.steps == 6 and rec.train.checkpoint_every == 2
    assert rec.train.lr == pytest.approx(1e-3)
    assert rec.train.epochs is None  # steps given: no epoch default
    assert rec.eval.k == 3 and rec.eval.num_prompts == 3
    # the drafter section is validated once into the family's typed config: every hyper-parameter is present
    cfg = rec.drafter
    assert type(cfg) is registry.get("eagle3").config_class
    assert cfg.algorithm == "eagle3" and cfg.ttt_steps == 2 and cfg.draft_vocab_size == 512
    assert set(type(cfg).model_fields) == set(rec.model_dump()["drafter"])


def test_epochs_default_when_no_length_given():
    raw = tiny_raw()
    del raw["train"]["steps"]
    rec = recipe_from_dict(raw)
    assert rec.train.epochs == 1.0 and rec.train.steps is None


def test_string_sources_become_specs():
    raw = tiny_raw()
    raw["data"]["sources"] = ["humaneval", {"source": "chatterbot", "max_examples": 3}]
    rec = recipe_from_dict(raw)
    assert [(s.source, s.max_examples) for s in rec.data.sources] == [("humaneval", None), ("chatterbot", 3)]


def test_overrides_dotted_paths_yaml_typed():
    rec = load_recipe(TINY, [
        "target.model=/other/dir",
        "train.lr=1e-4",                 # PyYAML reads this as a string; pydantic makes it a float
        "train.lr=2.5e-4",               # later overrides win
        "eval.k=8",
        "data.regenerate=false",
        "data.held_out.fraction=0.5",
        "drafter.ttt_steps=5",
        "target.aux_layer_ids=[0, 2, 3]",
        "data.chat_template=a=b",        # only the first '=' separates key and value
        "output_dir=null",
        "train.schedule=linear",
    ])
    assert rec.target.model == "/other/dir"
    assert rec.train.lr == pytest.approx(2.5e-4) and isinstance(rec.train.lr, float)
    assert rec.eval.k == 8 and isinstance(rec.eval.k, int)
    assert rec.data.regenerate is False
    assert rec.data.held_out.fraction == 0.5
    assert rec.data.held_out.seed == 0  # untouched sibling of an overridden key
    assert rec.drafter.ttt_steps == 5
    assert rec.target.aux_layer_ids == [0, 2, 3]
    assert rec.data.chat_template == "a=b"
    assert rec.output_dir is None
    assert rec.train.schedule == "linear"
    # untouched keys keep the file's values
    assert rec.train.steps == 6 and rec.drafter.draft_vocab_size == 512


def test_parse_overrides_types():
    assert parse_overrides(["a.b=3", "c=true", "d=x y", "e=[1, 2]", "f=1.5"]) == [
        ("a.b", 3), ("c", True), ("d", "x y"), ("e", [1, 2]), ("f", 1.5)]


@pytest.mark.parametrize("override", ["data.chat_template={{ bos_token }}{% for m in messages %}",
                                      "target.model=[unclosed"])
def test_override_value_that_is_not_yaml(override):
    key, value = override.split("=", 1)
    try:
        rec = load_recipe(TINY, ["target.model=/x", override])
    except SpeculatorsError as e:  # acceptable: a one-line error naming the key
        assert key in str(e) and "\n" not in str(e)
    else:  # also acceptable: the raw string is used
        assert getattr(getattr(rec, key.split(".")[0]), key.split(".")[1]) == value


def test_override_without_equals_is_an_error():
    msg = error_of(load_recipe, TINY, ["train.lr"])
    assert "train.lr" in msg and "=" in msg


def test_override_list_elements_by_index():
    rec = load_recipe(TINY, ["target.model=/x", "data.sources.0.source=hf:foo/bar",
                             "data.sources.1.max_examples=5", "data.sources.1.regenerate=true"])
    assert [(s.source, s.max_examples, s.regenerate) for s in rec.data.sources] == [
        ("hf:foo/bar", 24, True), ("humaneval", 5, True)]
    # a whole element, and a string element expanded before one of its keys is set
    rec = load_recipe(TINY, ["target.model=/x", "data.sources=[chatterbot, humaneval]",
                             "data.sources.1.max_examples=7", "data.sources.0=hf:x"])
    assert [(s.source, s.max_examples) for s in rec.data.sources] == [("hf:x", None), ("humaneval", 7)]
    rec = load_recipe(TINY, ["target.model=/x", "target.aux_layer_ids=[0, 1, 2]", "target.aux_layer_ids.2=3"])
    assert rec.target.aux_layer_ids == [0, 1, 3]


def test_override_whole_list():
    rec = load_recipe(TINY, ["target.model=/x", "data.sources=[humaneval]"])
    assert [(s.source, s.max_examples) for s in rec.data.sources] == [("humaneval", None)]


@pytest.mark.parametrize("override, needles", [
    ("data.sources.2.source=x", ["data.sources.2.source", "out of range", "list of 2", "0..1"]),
    ("data.sources.9=x", ["data.sources.9", "list of 2"]),
    ("data.sources.-1.source=x", ["data.sources.-1.source", "list of 2", "index"]),
    ("data.sources.first.source=x", ["data.sources.first.source", "list of 2", "index"]),
    ("train.lr.0=1", ["train.lr.0", "train.lr", "number"]),            # index on a non-list
    ("train.lr.x=1", ["train.lr.x", "train.lr", "number", "'x'"]),     # key below a scalar
    ("train.lr.x.y=1", ["train.lr.x.y", "train.lr", "number"]),
    ("data.sources.0.source.x=1", ["data.sources.0.source", "string", "chatterbot"]),
    ("target.aux_layer_ids.0=1", ["target.aux_layer_ids.0", "not set", "target.aux_layer_ids=[...]"]),
    ("train..lr=1", ["train..lr", "empty"]),
    (".lr=1", ["'.lr'", "empty"]),
    ("train.=1", ["'train.'", "empty"]),
    ("=1", ["empty"]),
])
def test_bad_override_paths_are_one_clear_error(override, needles):
    msg = error_of(load_recipe, TINY, ["target.model=/x", override])
    for needle in needles:
        assert needle in msg, (needle, msg)


def test_bad_override_path_leaves_scalar_alone():
    """Old code silently replaced ``train.lr`` by ``{x: 1}``: the error must be about the path."""
    msg = error_of(load_recipe, TINY, ["target.model=/x", "train.lr.x=1"])
    assert "valid number" not in msg and "no key 'x'" in msg


# ----------------------------------------------------------------------------- bad recipes


def test_unknown_algorithm_lists_allowed(tmp_path):
    raw = tiny_raw()
    raw["drafter"]["algorithm"] = "eagle9"
    msg = error_of(load_recipe, write_recipe(tmp_path, raw))
    assert "drafter.algorithm" in msg and "eagle9" in msg
    assert registry.names(), "no drafter family registered"
    for name in registry.names():
        assert name in msg
    assert "allowed" in msg


def test_missing_algorithm_names_the_field():
    raw = tiny_raw()
    del raw["drafter"]["algorithm"]
    msg = error_of(recipe_from_dict, raw)
    assert "drafter.algorithm" in msg


def test_misspelled_section_names_the_key(tmp_path):
    text = TINY.read_text().replace("REPLACE_WITH_TINY_TARGET_DIR", "/x").replace("\ntrain:", "\ntrian:")
    assert "trian:" in text
    p = write_recipe(tmp_path, text)
    msg = error_of(load_recipe, p)
    assert "trian" in msg and "unknown key" in msg
    assert str(p) in msg  # the file is named too


def test_misspelled_nested_key_names_the_path():
    msg = error_of(load_recipe, TINY, ["target.model=/x", "train.lrr=1e-3"])
    assert "train.lrr" in msg and "unknown key" in msg


def test_misspelled_drafter_key_names_the_path():
    msg = error_of(load_recipe, TINY, ["target.model=/x", "drafter.ttt_stepz=2"])
    assert "drafter.ttt_stepz" in msg


@pytest.mark.parametrize("value", ["-1e-3", "0"])
def test_non_positive_lr(value):
    msg = error_of(load_recipe, TINY, ["target.model=/x", f"train.lr={value}"])
    assert "train.lr" in msg and "greater than 0" in msg


def test_bad_drafter_hyper_parameter_names_the_path():
    msg = error_of(load_recipe, TINY, ["target.model=/x", "drafter.ttt_steps=0"])
    assert "drafter.ttt_steps" in msg


@pytest.mark.parametrize("override, path", [
    ("train.schedule=cosinus", "train.schedule"),
    ("target.dtype=int8", "target.dtype"),
    ("eval.top_p=1.5", "eval.top_p"),
    ("data.held_out.fraction=1.0", "data.held_out.fraction"),
    ("data.sources=[]", "data.sources"),
    ("train.steps=abc", "train.steps"),
])
def test_bad_values_name_the_path(override, path):
    msg = error_of(load_recipe, TINY, ["target.model=/x", override])
    assert path in msg


def test_bad_enum_lists_allowed_values():
    msg = error_of(load_recipe, TINY, ["target.model=/x", "train.schedule=cosinus"])
    for allowed in ("cosine", "linear", "constant"):
        assert allowed in msg


def test_several_errors_in_one_line():
    msg = error_of(load_recipe, TINY, ["target.model=/x", "train.lr=-1", "eval.k=0"])
    assert "train.lr" in msg and "eval.k" in msg


@pytest.mark.parametrize("section", ["target", "data", "drafter"])
def test_missing_required_section(section):
    raw = tiny_raw()
    del raw[section]
    msg = error_of(recipe_from_dict, raw, "my.yaml")
    assert section in msg and "missing" in msg and "my.yaml" in msg


def test_missing_target_model():
    raw = tiny_raw()
    del raw["target"]["model"]
    msg = error_of(recipe_from_dict, raw)
    assert "target.model" in msg and "missing" in msg


@pytest.mark.parametrize("text", ["- a\n- b\n", "just a string\n", "42\n", ""])
def test_non_mapping_yaml(tmp_path, text):
    p = write_recipe(tmp_path, text)
    msg = error_of(load_recipe, p)
    assert str(p) in msg and "mapping" in msg


def test_invalid_yaml_syntax(tmp_path):
    p = write_recipe(tmp_path, "target: {model: [unclosed\n")
    with pytest.raises(SpeculatorsError) as ei:
        load_recipe(p)
    assert str(p) in str(ei.value) and "YAML" in str(ei.value)


def test_invalid_yaml_syntax_is_one_line(tmp_path):
    p = write_recipe(tmp_path, "target: {model: [unclosed\n")
    msg = error_of(load_recipe, p)
    assert "line 1" in msg  # still says where


def test_missing_recipe_file(tmp_path):
    p = tmp_path / "nope.yaml"
    msg = error_of(load_recipe, p)
    assert str(p) in msg and "does not exist" in msg


def test_recipe_path_that_is_a_directory(tmp_path):
    msg = error_of(load_recipe, tmp_path)
    assert str(tmp_path) in msg


# ----------------------------------------------------------------------------- resolved dump


def test_dump_round_trips():
    rec = load_recipe(TINY, ["target.model=/some/target/dir", "train.lr=2e-4", "eval.temperature=0.5"])
    text = dump_recipe(rec)
    raw = yaml.safe_load(text)
    # the dump is resolved: defaults are written out
    assert raw["train"]["schedule"] == "cosine" and raw["data"]["max_length"] == 256
    assert set(type(rec.drafter).model_fields) == set(raw["drafter"])  # the family's fields, not the base's
    rec2 = recipe_from_dict(raw, "dump")
    assert rec2 == rec
    assert rec2.model_dump() == rec.model_dump()
    assert dump_recipe(rec2) == text


def test_dump_round_trips_through_load_recipe(tmp_path):
    rec = load_recipe(TINY, ["target.model=/some/target/dir"])
    p = write_recipe(tmp_path, dump_recipe(rec), "resolved.yaml")
    assert load_recipe(p) == rec


# ----------------------------------------------------------------------------- typed drafter section


@pytest.mark.parametrize("algorithm", ["eagle", "eagle3", "medusa", "mtp"])
def test_drafter_section_is_the_familys_typed_config(algorithm):
    """Validated once, through the registry, into ``config_class``; the dump keeps every family field
    (``SerializeAsAny``: not only the base ``DrafterConfig``'s) and loads back equal."""
    raw = tiny_raw()
    raw["drafter"] = {"algorithm": algorithm}
    rec = recipe_from_dict(raw)
    cls = registry.get(algorithm).config_class
    assert type(rec.drafter) is cls and rec.drafter.algorithm == algorithm
    dumped = yaml.safe_load(dump_recipe(rec))["drafter"]
    assert set(dumped) == set(cls.model_fields) and len(dumped) > 2
    assert dumped == cls(algorithm=algorithm).model_dump(mode="json")  # the family's defaults, resolved
    again = recipe_from_dict(yaml.safe_load(dump_recipe(rec)))
    assert again == rec and type(again.drafter) is cls


def test_drafter_assignment_is_validated_by_the_family():
    rec = recipe_from_dict(tiny_raw())
    rec.drafter = {"algorithm": "medusa", "num_heads": 2}
    assert type(rec.drafter) is registry.get("medusa").config_class and rec.drafter.num_heads == 2
    with pytest.raises(ValueError, match=r"drafter\.num_heads"):
        rec.drafter = {"algorithm": "medusa", "num_heads": 0}
    with pytest.raises(ValueError, match=r"drafter\.algorithm"):
        rec.drafter = {"algorithm": "nope"}
    # a base DrafterConfig is validated as its family's config (the family's defaults filled in)
    from speculators.drafters import DrafterConfig

    rec.drafter = DrafterConfig(algorithm="eagle3", draft_vocab_size=8)
    assert type(rec.drafter) is registry.get("eagle3").config_class and rec.drafter.draft_vocab_size == 8


@pytest.mark.parametrize("drafter, needles", [
    ({"algorithm": "eagle3", "ttt_steps": 0, "bogus": 1}, ["drafter.ttt_steps", "drafter.bogus", "unknown key"]),
    ({"algorithm": 3}, ["drafter.algorithm", "allowed", "eagle3"]),
    ("eagle3", ["drafter:"]),
])
def test_bad_drafter_sections_name_the_field(drafter, needles):
    raw = tiny_raw()
    raw["drafter"] = drafter
    msg = error_of(recipe_from_dict, raw, "r.yaml")
    for n in needles:
        assert n in msg, (n, msg)
    assert "r.yaml: r.yaml" not in msg and "Value error" not in msg


# ----------------------------------------------------------------------------- eval overrides


def test_eval_spec_with_overrides_goes_through_the_schema():
    from speculators.recipe import EvalSpec, eval_spec_with

    base = recipe_from_dict(tiny_raw()).eval
    ev = eval_spec_with(base, {"k": 5, "top_p": None})
    assert ev.k == 5 and ev.top_p == base.top_p and ev.num_prompts == base.num_prompts  # None keeps the base
    assert eval_spec_with(None, {}) == EvalSpec()  # no recipe: the schema's defaults
    names = {"k": "-k", "top_p": "--top-p", "temperature": "--temperature"}
    for overrides, needles in [({"k": 0}, ["-k 0", "eval.k", "greater than 0"]),
                               ({"k": 65}, ["-k 65", "eval.k", "64"]),
                               ({"top_p": 2.0}, ["--top-p 2.0", "eval.top_p", "less than or equal to 1"]),
                               ({"temperature": -1.0, "top_p": 0}, ["--temperature -1.0", "--top-p 0"]),
                               ({"num_prompts": 0}, ["override num_prompts=0", "eval.num_prompts"]),
                               ({"kk": 1}, ["eval.kk", "unknown key"])]:
        msg = error_of(eval_spec_with, base, overrides, names)
        for n in needles:
            assert n in msg, (n, msg)


def test_a_single_k_override_replaces_the_recipes_sweep():
    from speculators.recipe import EvalSpec, eval_spec_with

    base = EvalSpec(k=4, k_sweep=[1, 2, 4])
    assert eval_spec_with(base, {"k": 6}).ks == [6]
    assert eval_spec_with(base, {}).ks == [1, 2, 4]
    assert eval_spec_with(base, {"k_sweep": [2, 3]}).ks == [2, 3]


# ----------------------------------------------------------------------------- target.dtype: auto

RECIPES = TINY.parent


def test_target_dtype_defaults_to_auto_and_names_the_allowed_values():
    raw = tiny_raw()
    del raw["target"]["dtype"]
    assert recipe_from_dict(raw, "r.yaml").target.dtype == "auto"
    raw["target"]["dtype"] = "fp8"
    with pytest.raises(SpeculatorsError, match=r"target\.dtype") as e:
        recipe_from_dict(raw, "r.yaml")
    assert "auto" in str(e.value) and "bfloat16" in str(e.value)


def test_smollm2_recipes_use_auto_and_no_wall_clock_cap_tiny_ones_float32():
    """What a SmolLM2 recipe trains is set by its steps / epochs alone (train.max_minutes would make it
    depend on the machine's load) and its target follows the hardware; the tiny test targets stay float32."""
    smollm2 = sorted(RECIPES.glob("smollm2-*.yaml"))
    tiny = sorted(RECIPES.glob("tiny-*.yaml"))
    assert len(smollm2) >= 8 and len(tiny) >= 7
    gemma = load_recipe(RECIPES / "gemma3-eagle3.yaml")  # the second real target: a base model, its own template
    assert gemma.target.model == "gemma3-270m" and gemma.data.chat_template
    for f in smollm2 + [RECIPES / "gemma3-eagle3.yaml"]:
        rec = load_recipe(f)
        assert rec.target.dtype == "auto", f
        assert rec.train.max_minutes is None, f
        assert rec.train.epochs is not None or rec.train.steps is not None, f
    assert load_recipe(RECIPES / "smollm2-eagle3.yaml").train.epochs == 4
    for f in tiny:
        assert load_recipe(f, ["target.model=/x"]).target.dtype == "float32", f


@pytest.mark.parametrize("fast,device,expected", [(True, None, "bfloat16"), (False, None, "float32"),
                                                  (True, "cpu", "bfloat16"), (False, "cuda:1", "float32")])
def test_auto_target_dtype_follows_the_hardware(monkeypatch, fast, device, expected):
    from speculators import hardware

    seen = []
    monkeypatch.setattr(hardware, "fast_bf16", lambda d=None: seen.append(d) or fast)
    assert hardware.resolve_target_dtype("auto", device) == expected
    assert seen == [device]
    for name in ("float32", "bfloat16", "float16"):  # an explicit dtype is kept whatever the hardware
        assert hardware.resolve_target_dtype(name, device) == name
    with pytest.raises(SpeculatorsError, match="allowed auto, float32, bfloat16, float16"):
        hardware.resolve_target_dtype("int8")


def test_fast_bf16_reads_the_cpu_flags_for_a_cpu(monkeypatch, tmp_path):
    from speculators import hardware

    for flags, fast in (("flags : fpu avx2 avx512f avx512_bf16", True), ("flags : fpu amx_bf16", True),
                        ("flags : fpu avx2", False)):
        f = tmp_path / "cpuinfo"
        f.write_text(flags + "\n")
        monkeypatch.setattr(hardware, "Path", lambda _p, f=f: f)
        assert hardware.fast_bf16("cpu") is fast
    assert hardware.fast_bf16("mps") is False  # no bf16 matrix units known there
