"""Aux layer ids (the target taps): distinct, strictly ascending, in range and as many as the family's
serving format allows (EAGLE-3 / P-EAGLE: exactly 3, vLLM's ``fc`` is 3 x hidden; DFlash / DSpark: 1 or
more), checked by ONE rule (``ServingFormat.check_aux_layer_ids``) in the recipe (before any work), in the
defaults (never a repeated layer, also on shallow targets), for a new drafter and for a loaded checkpoint."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import yaml

import speculators.drafters  # noqa: F401  (registers the families)
from speculators.drafters import Drafter, registry
from speculators.data.vocab import DraftVocab
from speculators.errors import SpeculatorsError
from speculators.recipe import load_recipe
from speculators.target import build_tiny_target, default_aux_layer_ids, distinct_layer_ids

ROOT = Path(__file__).resolve().parents[2]


def tiny_recipe_file(algorithm: str) -> Path:
    """The tiny recipe of a family (``recipes/tiny-*.yaml`` whose drafter is ``algorithm``)."""
    for p in sorted((ROOT / "recipes").glob("tiny-*.yaml")):
        if yaml.safe_load(p.read_text())["drafter"]["algorithm"] == algorithm:
            return p
    raise AssertionError(f"no tiny recipe for {algorithm}")


def recipe(algorithm: str, ids: list[int]):
    return load_recipe(tiny_recipe_file(algorithm), ["target.model=/x", f"target.aux_layer_ids={ids}"])


@pytest.mark.parametrize("algorithm", ["eagle3", "peagle"])
@pytest.mark.parametrize("ids,what", [([1, 1, 2], r"layer\(s\) \[1\] repeated"), ([2, 1, 3], "not in ascending order"),
                                      ([0, 2], "2 layer.*takes exactly 3"), ([0, 1, 2, 3], "4 layer.*takes exactly 3"),
                                      ([-1, 1, 2], r"\[-1\] outside")])
def test_a_bad_recipe_is_one_clear_error_naming_the_field(algorithm, ids, what):
    with pytest.raises(SpeculatorsError, match=rf"target\.aux_layer_ids: .*{what}.*Allowed: exactly 3 distinct") as e:
        recipe(algorithm, ids)
    assert str(e.value).count("target.aux_layer_ids") == 1  # one error, not one per rule
    assert recipe(algorithm, [0, 1, 3]).target.aux_layer_ids == [0, 1, 3]


@pytest.mark.parametrize("algorithm", ["dflash", "dspark"])
def test_block_families_take_one_or_more_distinct_ascending_taps(algorithm):
    for ids in ([2], [0, 2], [0, 1, 2, 3]):
        assert recipe(algorithm, ids).target.aux_layer_ids == ids
    for ids, what in (([], "0 layer.*at least 1"), ([2, 2], "repeated"), ([3, 0], "ascending")):
        with pytest.raises(SpeculatorsError, match=rf"target\.aux_layer_ids: .*{what}.*Allowed: 1 or more"):
            recipe(algorithm, ids)


@pytest.mark.parametrize("algorithm", registry.names())
def test_defaults_never_repeat_a_layer_on_any_target_depth(algorithm):
    family = registry.get(algorithm)
    raw = load_recipe(tiny_recipe_file(algorithm), ["target.model=/x"]).drafter
    # the fewest layers giving distinct taps: 3 (EAGLE-3 / P-EAGLE), one per draft layer (DFlash / DSpark)
    need = raw.num_layers if algorithm in ("dflash", "dspark") else family.serving.aux_layer_count[0]
    for L in range(1, 40):
        if L < need:
            with pytest.raises(SpeculatorsError, match=r"target\.aux_layer_ids"):
                family.serving.default_aux_layer_ids(L, raw)
            continue
        ids = family.serving.default_aux_layer_ids(L, raw)
        assert ids == sorted(set(ids)) and ids[0] >= 0 and ids[-1] <= L - 1, (L, ids)
        family.serving.check_aux_layer_ids(ids, L)
    assert default_aux_layer_ids(30) == [1, 14, 26] and default_aux_layer_ids(8) == [1, 3, 4]  # unchanged where valid
    assert default_aux_layer_ids(4) == [0, 1, 2] and default_aux_layer_ids(6) == [1, 2, 3]


def test_distinct_layer_ids_moves_each_id_as_little_as_needed():
    assert distinct_layer_ids([1, 14, 26], 30) == [1, 14, 26]
    assert distinct_layer_ids([1, 1, 0], 4) == [0, 1, 2]
    assert distinct_layer_ids([5, 9, 9], 10) == [5, 8, 9]
    with pytest.raises(SpeculatorsError, match="2 decoder layer.*cannot give 3 distinct"):
        distinct_layer_ids([0, 1, 1], 2)


def test_a_too_shallow_target_is_refused_for_eagle3():
    with pytest.raises(SpeculatorsError, match=r"target\.aux_layer_ids: \[0, 1\].*too shallow for 3"):
        registry.get("eagle3").serving.default_aux_layer_ids(2, None)


def test_a_drafter_and_a_checkpoint_with_bad_taps_are_refused(tmp_path):
    target = build_tiny_target(vocab_size=64, hidden_size=32, num_layers=4, seed=0)
    fam = registry.get("eagle3")
    cfg = fam.config_class(algorithm="eagle3")
    target.aux_layer_ids = [1, 1, 0]  # what the old defaults gave on this target
    with pytest.raises(SpeculatorsError, match=r"target\.aux_layer_ids: \[1, 1, 0\].*repeated"):
        fam.from_target(cfg, target, DraftVocab.full(64))
    target.aux_layer_ids = [0, 1, 3]
    path = fam.from_target(cfg, target, DraftVocab.full(64)).save_pretrained(tmp_path / "ck")
    assert Drafter.from_pretrained(path).meta.aux_layer_ids == (0, 1, 3)
    raw = json.loads((path / "config.json").read_text())
    raw["speculators_training"]["target"]["aux_layer_ids"] = [0, 3, 1]
    (path / "config.json").write_text(json.dumps(raw))
    with pytest.raises(SpeculatorsError, match=r"config\.json: speculators_training\.target\.aux_layer_ids: .*ascending"):
        Drafter.from_pretrained(path)
    raw["speculators_training"]["target"]["aux_layer_ids"] = [0, 1, 4]  # L = 4
    (path / "config.json").write_text(json.dumps(raw))
    with pytest.raises(SpeculatorsError, match=r"\[4\] outside \[0, 3\]"):
        Drafter.from_pretrained(path)
