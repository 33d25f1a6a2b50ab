"""The serving-format helpers (speculators/export.py), the checkpoint module and its typed
target facts (drafters/checkpoint.py: TargetMeta), and ``check_target`` that only checks.

The fixtures in ``tests/fixtures/checkpoints_v0/`` are ``config.json`` files written by the code before
this refactor (same tiny target and drafters as :func:`drafters` below): the format must not drift and
old checkpoints must keep loading.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch

from speculators import export
from speculators.data.vocab import DraftVocab
from speculators.drafters import registry
from speculators.drafters.base import check_target
from speculators.drafters.checkpoint import (
    CONFIG_NAME,
    TRAINING_KEY,
    WEIGHTS_NAME,
    TargetMeta,
    checkpoint_config,
    from_pretrained,
    read_checkpoint_config,
)
from speculators.errors import SpeculatorsError
from speculators.target import build_tiny_target

FIXTURES = Path(__file__).resolve().parents[1] / "fixtures" / "checkpoints_v0"
V, AUX = 96, [0, 2, 3]
COMMON = {"architectures", "speculators_model_type", "speculators_config", "transformer_layer_config",
          "tie_word_embeddings", "torch_dtype", "speculators_version", TRAINING_KEY}
# family-specific keys FORMATS.md lists (plus our own documented extras)
FAMILY_KEYS = {
    "eagle3": {"draft_vocab_size", "eagle_aux_hidden_state_layer_ids", "target_hidden_size", "norm_before_residual",
               "norm_before_fc", "embed_requires_grad"},
    "eagle": {"transformer_layer_architecture", "layernorms", "fusion_bias"},
    "medusa": {"draft_vocab_size", "medusa_hidden_size", "medusa_vocab_size", "num_heads", "num_hidden_layers",
               "medusa_fc_bias", "original_lm_head", "truncated_vocab_size", "head_weight_decay"},
    "mtp": {"num_nextn_predict_layers", "draft_vocab_size"},
    "peagle": {"draft_vocab_size", "eagle_aux_hidden_state_layer_ids", "target_hidden_size", "norm_before_residual",
               "norm_before_fc", "embed_requires_grad", "mask_token_id"},
    "dflash": {"block_size", "aux_hidden_state_layer_ids", "mask_token_id", "sample_from_anchor", "draft_vocab_size",
               "target_hidden_size"},
    "dspark": {"block_size", "aux_hidden_state_layer_ids", "mask_token_id", "sample_from_anchor", "draft_vocab_size",
               "target_hidden_size", "markov_rank", "markov_head_type", "enable_confidence_head",
               "confidence_head_with_markov"},
}
# vLLM's native Medusa layout: no speculators block (FORMATS.md, "Medusa")
VLLM_MEDUSA_KEYS = {"model_type", "architectures", "hidden_size", "vocab_size", "num_heads", "num_hidden_layers",
                    "medusa_fc_bias", "original_lm_head", "speculators_version", TRAINING_KEY}  # full vocabulary
TARGET_KEYS = ["name_or_path", "reference", "architectures", "fingerprint", "vocab_size", "hidden_size",
               "num_layers", "aux_layer_ids", "aux_layer_ids_convention", "target_config", "dtype"]


@pytest.fixture(scope="module")
def target():
    t = build_tiny_target(vocab_size=V, hidden_size=64, num_layers=4, seed=1)
    t.aux_layer_ids = list(AUX)
    return t


def make(target, name: str, **kw):
    """The drafter the v0 fixture of ``name`` was written from (seeded; reduced vocab where supported)."""
    torch.manual_seed(0)
    cls = registry.get(name.split("-")[0])
    reduced = cls.algorithm == "eagle3" or name == "medusa"  # vllm-medusa serves the full vocabulary only
    vocab = DraftVocab.from_counts(torch.arange(V, 0, -1), 64 if reduced else None)
    extra = {"ttt_steps": 2} if cls.algorithm == "eagle3" else {}
    if name == "medusa-vllm":
        extra["export"] = "vllm-medusa"
    return cls.from_target(cls.config_class(algorithm=cls.algorithm, **extra, **kw), target, vocab)


VARIANTS = sorted(registry.names()) + ["medusa-vllm"]
# the families that existed when the v0 fixtures were written (newer families have no previous version)
V0_VARIANTS = [n for n in VARIANTS if (FIXTURES / f"{n}.json").is_file()]


# ----------------------------------------------------------------------------- helpers, one by one


def test_vllm_aux_layer_ids_is_ours_plus_one():
    assert export.vllm_aux_layer_ids([0, 2, 3]) == [1, 3, 4]
    assert export.vllm_aux_layer_ids((1, 14, 26)) == [2, 15, 27]
    assert export.vllm_aux_layer_ids([]) == []
    for bad in ([-1], ["2"], [1.0], [True]):
        with pytest.raises(SpeculatorsError, match="aux_layer_ids"):
            export.vllm_aux_layer_ids(bad)


def test_target_and_meta_use_the_same_rule(target):
    meta = TargetMeta.from_target(target)
    assert target.vllm_aux_layer_ids == meta.vllm_aux_layer_ids == [i + 1 for i in AUX]
    d = make(target, "eagle3")
    assert d.serving.config(d)["eagle_aux_hidden_state_layer_ids"] == [1, 3, 4]


def test_speculators_config_block():
    block = export.speculators_config("eagle3", 5, "org/model", ("LlamaForCausalLM",))
    assert block == {"algorithm": "eagle3", "default_proposal_method": "greedy",
                     "proposal_methods": [{"proposal_type": "greedy", "speculative_tokens": 5,
                                           "verifier_accept_k": 1, "accept_tolerance": 0.0}],
                     "verifier": {"name_or_path": "org/model", "architectures": ["LlamaForCausalLM"]}}
    assert export.speculative_tokens({"speculators_config": block}) == 5
    assert export.speculative_tokens({"model_type": "medusa"}) is None
    with pytest.raises(SpeculatorsError, match="num_speculative_tokens"):
        export.speculators_config("eagle3", 0, "x", [])


def test_transformer_layer_config_writes_rope_explicitly_and_drops_bookkeeping():
    src = {"hidden_size": 64, "torch_dtype": "float32", "_name_or_path": "x", "tie_word_embeddings": True,
           "architectures": ["Qwen3ForCausalLM"], "model_type": "qwen3",
           "rope_parameters": {"rope_type": "yarn", "rope_theta": 5e5, "factor": 4.0}}
    before = json.loads(json.dumps(src))
    out = export.transformer_layer_config(src)
    assert src == before  # the input is not modified
    assert out["rope_theta"] == 5e5 and out["rope_scaling"] == {"rope_type": "yarn", "factor": 4.0}
    assert out["model_type"] == "llama" and out["architectures"] == ["LlamaForCausalLM"]
    assert not {"torch_dtype", "_name_or_path", "tie_word_embeddings"} & out.keys()
    plain = export.transformer_layer_config({"rope_parameters": {"rope_type": "default", "rope_theta": 1e4}})
    assert plain["rope_theta"] == 1e4 and plain["rope_scaling"] is None


def test_vllm_serving_facts():
    assert export.vllm_serving("eagle3", "eagle3") == ("eagle3", "")
    assert export.vllm_serving("mtp", None, "needs a converter") == (None, "needs a converter")
    method, note = export.vllm_serving("x", None)
    assert method is None and "`x`" in note
    medusa = registry.get("medusa")
    assert medusa.serving.vllm_serving({"model_type": "medusa"}) == ("medusa", "")
    assert medusa.serving.vllm_serving({"speculators_model_type": "medusa"})[0] is None
    assert medusa.serving.speculative_tokens({"model_type": "medusa", "num_heads": 3}) == 3


# ----------------------------------------------------------------------------- round trip per family


@pytest.mark.parametrize("name", sorted(registry.names()))
def test_every_family_round_trips_its_checkpoint_byte_for_byte(target, name, tmp_path):
    """Any registered family (a new one included): config.json is the checkpoint config, the typed target
    facts come back, and a loaded checkpoint saves the same bytes."""
    d = make(target, name)
    path = d.save_pretrained(tmp_path / name)
    cfg = json.loads((path / CONFIG_NAME).read_text())
    assert cfg == json.loads(json.dumps(checkpoint_config(d), default=str))
    assert list(cfg[TRAINING_KEY]["target"]) == TARGET_KEYS
    loaded = from_pretrained(path)
    assert type(loaded) is type(d) and loaded.meta == d.meta and loaded.cfg == d.cfg
    again = loaded.save_pretrained(tmp_path / f"{name}-again")
    assert (again / CONFIG_NAME).read_text() == (path / CONFIG_NAME).read_text()
    assert (again / WEIGHTS_NAME).read_bytes() == (path / WEIGHTS_NAME).read_bytes()


# the layouts FORMATS.md pins (a family's own format keys belong to its own test file)
@pytest.mark.parametrize("name", sorted(FAMILY_KEYS) + ["medusa-vllm"])
def test_config_keys_per_family_and_round_trip(target, name, tmp_path):
    d = make(target, name)
    path = d.save_pretrained(tmp_path / name)
    cfg = json.loads((path / CONFIG_NAME).read_text())
    assert cfg == json.loads(json.dumps(checkpoint_config(d), default=str))
    if name == "medusa-vllm":
        assert set(cfg) == VLLM_MEDUSA_KEYS
        assert cfg["model_type"] == "medusa" and cfg["hidden_size"] == 64 and cfg["vocab_size"] == V
    else:
        assert set(cfg) == COMMON | FAMILY_KEYS[name]
        assert cfg["speculators_model_type"] == name
        sc = cfg["speculators_config"]
        assert sc["algorithm"] == name and sc["verifier"]["name_or_path"] == target.verifier_name
        assert sc["proposal_methods"][0]["speculative_tokens"] == registry.get(name).serving.speculative_tokens(cfg) >= 1
        layer = cfg["transformer_layer_config"]
        assert layer["model_type"] in ("llama", "qwen3") and layer["rope_theta"] == 10000.0 and "rope_scaling" in layer
        assert layer["hidden_size"] == 64 and layer["vocab_size"] == V
    # the training block: the typed target facts under today's keys and order
    tblock = cfg[TRAINING_KEY]["target"]
    assert list(tblock) == TARGET_KEYS
    assert tblock["aux_layer_ids"] == AUX and tblock["aux_layer_ids_convention"] == export.AUX_LAYER_IDS_CONVENTION
    loaded = from_pretrained(path)
    assert type(loaded) is type(d) and loaded.meta == d.meta and loaded.cfg == d.cfg
    assert loaded.meta.vllm_aux_layer_ids == [i + 1 for i in loaded.meta.aux_layer_ids]
    again = loaded.save_pretrained(tmp_path / f"{name}-again")
    assert (again / CONFIG_NAME).read_text() == (path / CONFIG_NAME).read_text()
    assert (again / WEIGHTS_NAME).read_bytes() == (path / WEIGHTS_NAME).read_bytes()


def _strip(cfg: dict) -> dict:
    """A config without what legitimately changes between versions of our dependencies: our version, the
    target fingerprint (weight sums), and the HF config dicts beyond the keys FORMATS.md names."""
    cfg = json.loads(json.dumps(cfg))
    cfg.pop("speculators_version", None)
    tb = cfg[TRAINING_KEY]["target"]
    tb.pop("fingerprint")
    tb.pop("dtype", None)  # the target's dtype: recorded since it follows the hardware (target.dtype: auto)
    keep = ("hidden_size", "intermediate_size", "num_attention_heads", "num_key_value_heads", "head_dim",
            "rms_norm_eps", "rope_theta", "rope_scaling", "max_position_embeddings", "num_hidden_layers",
            "vocab_size", "model_type", "architectures")
    for holder, key in ((cfg, "transformer_layer_config"), (tb, "target_config")):
        if key in holder:
            holder[key] = {k: holder[key].get(k) for k in keep}
    return cfg


# drafter-config fields added since v0, at the defaults that keep v0's behaviour (a v0 checkpoint, without
# them, loads with these values: test_checkpoint_written_by_the_previous_version_loads)
ADDED_SINCE_V0 = {"eagle3": {"norm_output": False, "train_lm_head": True,  # (Eagle 3.1 feed, frozen head,
                              "norm_before_residual": False}}  # layer-0 residual from hidden_norm)


@pytest.mark.parametrize("name", V0_VARIANTS)
def test_config_is_what_the_previous_version_wrote(target, name, tmp_path):
    old = json.loads((FIXTURES / f"{name}.json").read_text())
    if name == "medusa-vllm":  # v0 wrote it over a reduced vocabulary, which vLLM cannot load: now full vocabulary only
        assert old.pop("truncated_vocab_size") == 64
    new = json.loads((make(target, name).save_pretrained(tmp_path / name) / CONFIG_NAME).read_text())
    assert list(new) == list(old)  # same keys, same order
    block, old_block = new[TRAINING_KEY]["drafter"], old[TRAINING_KEY]["drafter"]
    added = {k: block.pop(k) for k in list(block) if k not in old_block}
    assert added == ADDED_SINCE_V0.get(name.split("-")[0], {})
    if "joint_target" in old_block:  # the default changed from Llama's seven projections to None (every decoder
        assert block["joint_target"]["lora_modules"] is None  # linear of whatever architecture the target is)
        block["joint_target"]["lora_modules"] = old_block["joint_target"]["lora_modules"]
    assert _strip(new) == _strip(old)


@pytest.mark.parametrize("name", V0_VARIANTS)
def test_checkpoint_written_by_the_previous_version_loads(target, name, tmp_path):
    d = make(target, name)
    path = d.save_pretrained(tmp_path / name)
    shutil.copy(FIXTURES / f"{name}.json", path / CONFIG_NAME)  # today's weights beside the old config
    old_block = json.loads((FIXTURES / f"{name}.json").read_text())[TRAINING_KEY]["target"]
    loaded = from_pretrained(path)
    assert isinstance(loaded.meta, TargetMeta)
    assert loaded.meta.to_json() == old_block  # read by attribute, written back under the same keys
    assert loaded.meta.aux_layer_ids == tuple(AUX) and loaded.meta.vocab_size == V
    assert loaded.meta.name_or_path == old_block["name_or_path"]


def test_older_target_block_without_optional_facts_loads(target, tmp_path):
    path = make(target, "eagle").save_pretrained(tmp_path / "ck")
    raw = json.loads((path / CONFIG_NAME).read_text())
    for key in ("reference", "fingerprint", "num_layers", "aux_layer_ids_convention", "architectures"):
        del raw[TRAINING_KEY]["target"][key]
    raw[TRAINING_KEY]["target"]["some_future_fact"] = 1  # unknown keys are ignored
    (path / CONFIG_NAME).write_text(json.dumps(raw))
    meta = from_pretrained(path).meta
    assert meta.fingerprint is None and meta.reference is None and meta.architectures == ()
    assert meta.hidden_size == 64 and meta.to_json()["aux_layer_ids_convention"] == export.AUX_LAYER_IDS_CONVENTION


# ----------------------------------------------------------------------------- bad checkpoints: one clear error


@pytest.mark.parametrize("edit, needles", [
    (lambda t: t.pop("target_config"), ["speculators_training.target.target_config", "required"]),
    (lambda t: t.update(vocab_size=-3), ["speculators_training.target.vocab_size", "greater than 0"]),
    (lambda t: t.update(aux_layer_ids="1,2"), ["speculators_training.target.aux_layer_ids"]),
])
def test_invalid_target_facts_name_the_file_and_field(target, tmp_path, edit, needles):
    path = make(target, "eagle3").save_pretrained(tmp_path / "ck")
    raw = json.loads((path / CONFIG_NAME).read_text())
    edit(raw[TRAINING_KEY]["target"])
    (path / CONFIG_NAME).write_text(json.dumps(raw))
    with pytest.raises(SpeculatorsError) as e:
        from_pretrained(path)
    assert str(path / CONFIG_NAME) in str(e.value)
    for needle in needles:
        assert needle in str(e.value)


def test_training_block_that_is_not_an_object(target, tmp_path):
    path = make(target, "mtp").save_pretrained(tmp_path / "ck")
    raw = json.loads((path / CONFIG_NAME).read_text())
    raw[TRAINING_KEY] = ["not", "an", "object"]
    (path / CONFIG_NAME).write_text(json.dumps(raw))
    with pytest.raises(SpeculatorsError, match="no 'speculators_training' block"):
        read_checkpoint_config(path)
    with pytest.raises(SpeculatorsError, match="no 'speculators_training' block"):
        from_pretrained(path)


def test_eagle3_weights_without_lm_head(target, tmp_path):
    from safetensors.torch import load_file, save_file

    path = make(target, "eagle3").save_pretrained(tmp_path / "ck")
    w = load_file(str(path / WEIGHTS_NAME))
    del w["lm_head.weight"]
    save_file(w, str(path / WEIGHTS_NAME))
    with pytest.raises(SpeculatorsError, match="lm_head.weight"):
        from_pretrained(path)


def test_drafter_meta_is_typed_and_a_mapping_is_validated(target):
    d = make(target, "mtp")
    assert isinstance(d.meta, TargetMeta)
    with pytest.raises(Exception):  # frozen: the recorded facts cannot drift after construction
        d.meta.vocab_size = 3
    cls = registry.get("mtp")
    rebuilt = cls(d.cfg, d.meta.to_json())
    assert rebuilt.meta == d.meta
    with pytest.raises(SpeculatorsError, match="meta.hidden_size"):
        cls(d.cfg, {k: v for k, v in d.meta.to_json().items() if k != "hidden_size"})


# ----------------------------------------------------------------------------- check_target only checks


def test_check_target_never_changes_the_target(target):
    d = make(target, "eagle3")
    other = build_tiny_target(vocab_size=V, hidden_size=64, num_layers=4, seed=1)  # default taps [0, 1, 2]
    assert other.aux_layer_ids != AUX
    with pytest.raises(SpeculatorsError) as e:
        check_target(d, other)
    assert other.aux_layer_ids == [0, 1, 2]  # not rewritten behind the caller's back
    assert "target.aux_layer_ids" in str(e.value) and "[0, 2, 3]" in str(e.value) and "[0, 1, 2]" in str(e.value)
    # the eval path: load the target with the checkpoint's ids, then the check passes
    right = build_tiny_target(vocab_size=V, hidden_size=64, num_layers=4, seed=1)
    right.aux_layer_ids = list(d.meta.aux_layer_ids)
    warnings = []
    check_target(d, right, warn=warnings.append)
    assert warnings == [] and right.aux_layer_ids == AUX


def test_check_target_sizes_and_fingerprint(target):
    d = make(target, "medusa")
    small = build_tiny_target(vocab_size=V, hidden_size=32, num_layers=4, seed=1)
    small.aux_layer_ids = list(AUX)
    with pytest.raises(SpeculatorsError, match="hidden size 64 != target's 32"):
        check_target(d, small)
    fine_tuned = build_tiny_target(vocab_size=V, hidden_size=64, num_layers=4, seed=2)
    fine_tuned.aux_layer_ids = list(AUX)
    warnings = []
    check_target(d, fine_tuned, warn=warnings.append)
    assert len(warnings) == 1 and "fingerprint" in warnings[0]


# ----------------------------------------------------------------------------- tap convention of old checkpoints

OLD_CONVENTION = ("0-based index of the decoder layer whose OUTPUT is tapped (HF hidden_states[i+1]); "
                  "vLLM ids = these + 1")  # written by speculators before the L-1 tap became pre-norm


def _old_checkpoint(target, tmp_path, name: str, convention: str | None, aux=None) -> Path:
    """Today's weights beside a v0 fixture config, its convention sentence (and taps) replaced."""
    path = make(target, name).save_pretrained(tmp_path / name)
    raw = json.loads((FIXTURES / f"{name}.json").read_text())
    tb = raw[TRAINING_KEY]["target"]
    assert tb["num_layers"] == 4 and tb["aux_layer_ids"] == AUX  # L-1 = 3 is tapped
    if convention is None:
        del tb["aux_layer_ids_convention"]
    else:
        tb["aux_layer_ids_convention"] = convention
    if aux is not None:
        tb["aux_layer_ids"] = aux
    (path / CONFIG_NAME).write_text(json.dumps(raw))
    return path


@pytest.mark.parametrize("name", ["eagle3", "medusa", "mtp"])
def test_old_convention_checkpoint_tapping_the_last_layer_warns_once(target, name, tmp_path):
    """Review finding: the L-1 tap changed from post-norm to pre-norm; a checkpoint recorded under the old
    convention that taps L-1 would silently be served other features. It loads with one warning naming the
    file and the layer."""
    import warnings

    path = _old_checkpoint(target, tmp_path, name, OLD_CONVENTION)
    with pytest.warns(UserWarning) as rec:
        loaded = from_pretrained(path)
    msgs = [str(w.message) for w in rec if "aux_layer_ids_convention" in str(w.message)]
    assert len(msgs) == 1
    assert str(path / CONFIG_NAME) in msgs[0] and "aux layer 3" in msgs[0] and "PRE-norm" in msgs[0]
    assert loaded.meta.aux_layer_ids_convention == OLD_CONVENTION
    assert loaded.meta.tap_convention_problem()[0] == 3
    # re-saved, it keeps the convention it was trained under (no silent upgrade of the record)
    again = loaded.save_pretrained(tmp_path / f"{name}-again")
    assert json.loads((again / CONFIG_NAME).read_text())[TRAINING_KEY]["target"]["aux_layer_ids_convention"] \
        == OLD_CONVENTION
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        from_pretrained(path)  # once per file and layer: the second load is silent


@pytest.mark.parametrize("convention, aux", [
    (export.AUX_LAYER_IDS_CONVENTION, None),  # today's sentence, L-1 tapped: the v0 fixtures as written
    (None, None),  # no sentence recorded: today's assumed
    (OLD_CONVENTION, [0, 1, 2]),  # old sentence, but L-1 not tapped: the same features
])
def test_other_checkpoints_load_silently(target, tmp_path, convention, aux):
    import warnings

    path = _old_checkpoint(target, tmp_path, "eagle3", convention, aux)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        meta = from_pretrained(path).meta
    assert meta.tap_convention_problem() is None
    assert meta.to_json()["aux_layer_ids_convention"] == (convention or export.AUX_LAYER_IDS_CONVENTION)


def test_tap_convention_problem_falls_back_to_the_target_config_layer_count(target):
    tb = dict(make(target, "eagle3").meta.to_json(), aux_layer_ids_convention=OLD_CONVENTION, num_layers=None)
    meta = TargetMeta.from_json(tb)
    assert meta.num_layers is None and meta.target_config["num_hidden_layers"] == 4
    assert meta.tap_convention_problem()[0] == 3
    assert TargetMeta.from_json(dict(tb, aux_layer_ids=[0, 1])).tap_convention_problem() is None


def test_model_config_fields_drops_what_describes_the_file():
    """A config.json rebuilt into a model config keeps the model's fields and none that describe the file."""
    config = {"model_type": "llama", "hidden_size": 8, "num_hidden_layers": 2, "architectures": ["LlamaForCausalLM"],
              "torch_dtype": "bfloat16", "transformers_version": "5.0", "speculators_training": {"x": 1}}
    fields = export.model_config_fields(config)
    assert fields == {"model_type": "llama", "hidden_size": 8, "num_hidden_layers": 2}
    assert not set(fields) & set(export.CONFIG_FILE_KEYS) and "architectures" in config  # the input is not changed
