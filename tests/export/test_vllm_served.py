"""The export served by vLLM itself (speculators.export.vllm_served): the pieces without vLLM, then the real engine
(vLLM's CPU build, ``make vllm``) serving every family that has a vLLM method, on a tiny target whose head_dim (32)
vLLM's CPU attention accepts."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

from speculators.export.vllm_served import _compare, check_served, emitted_accepted, perturbed_copy

ROOT = Path(__file__).resolve().parents[2]


# ----------------------------------------------------------------------------- pieces, no vLLM


def test_emitted_accepted_counts_what_each_step_emitted():
    # 1 token from the prefill, then steps of accepted + 1 tokens; 10 tokens out in all
    assert emitted_accepted([2, 3, 0, 1], 11) == [2, 3, 0, 1]  # 1 + 3 + 4 + 1 + 2 = 11
    assert emitted_accepted([2, 3, 0, 1], 10) == [2, 3, 0, 0]  # the last step emits 1 token: no draft of it counts
    # the last step emitted only 1 token (max_tokens): its drafts beyond do not count, as our loop drafts none there
    assert emitted_accepted([4, 4], 7) == [4, 0]
    # a stop token inside the step: its accepted drafts up to the stop are emitted
    assert emitted_accepted([3, 3], 4) == [2]
    # steps after the end (vLLM's record of a step whose tokens were all cut) are dropped
    assert emitted_accepted([0, 0, 5], 3) == [0, 0]


def test_compare_finds_the_first_differing_step_and_stops_where_outputs_part():
    compared, equal, diffs = _compare([[1, 0, 2], [0, 0]], [[1, 1, 2], [0, 0]], [None, None])
    assert (compared, equal) == (5, 4) and diffs == [{"prompt": 0, "step": 1, "loop": 0, "vllm": 1}]
    # outputs part at token 3: steps from the one holding it on are not compared
    compared, equal, diffs = _compare([[1, 0, 2]], [[1, 0, 0]], [3])
    assert (compared, equal, diffs) == (1, 1, [])


def test_drafts_are_compared_step_by_step_until_the_outputs_part():
    from speculators.export.vllm_served import _compare_drafts

    ours = [[[5, 6], [7, 8], [9]], [[1, 2]]]  # K = 2; prompt 0's last step drafted 1 (max_tokens): not compared
    acc = [[1, 0, 0], [0]]
    vllm = [[[5, 6], [7, 8], [3, 9], [4, 4]], [[1, 3]]]  # vLLM drafts K every step, and one step more at the end
    d = _compare_drafts(ours, acc, vllm, [None, None], 2)
    assert d["compared"] == 3 and d["equal"] == 2
    assert d["differences"] == [{"prompt": 1, "step": 0, "loop": [1, 2], "vllm": [1, 3]}]
    # prompt 0's outputs part at token 3 (the second step holds tokens 3..): only its first step is compared
    d = _compare_drafts(ours[:1], acc[:1], vllm[:1], [3], 2)
    assert (d["compared"], d["equal"]) == (1, 1)
    assert _compare_drafts(ours, acc, [None, None], [None, None], 2) is None  # the worker recorded nothing


def _write(path: Path, cfg: dict, sd: dict) -> Path:
    path.mkdir(parents=True)
    (path / "config.json").write_text(json.dumps(cfg))
    save_file(sd, str(path / "model.safetensors"))
    return path


def test_perturbed_copy_rolls_the_head_and_unties_a_tied_one(tmp_path):
    head = torch.randn(8, 4)
    src = _write(tmp_path / "a", {"draft_vocab_size": 8}, {"lm_head.weight": head, "fc.weight": torch.randn(4, 12),
                                                          "embed_tokens.weight": torch.randn(16, 4)})
    out, what = perturbed_copy(src, tmp_path / "a-control")
    sd = load_file(str(out / "model.safetensors"))
    assert torch.equal(sd["lm_head.weight"], torch.roll(head, 1, 0)) and "lm_head.weight" in what
    assert torch.equal(sd["embed_tokens.weight"], load_file(str(src / "model.safetensors"))["embed_tokens.weight"])
    assert torch.equal(load_file(str(src / "model.safetensors"))["lm_head.weight"], head)  # the source is untouched
    emb = torch.randn(16, 4)  # a tied draft model: rolling the tied matrix would relabel inputs and outputs alike
    src = _write(tmp_path / "b", {"tie_word_embeddings": True}, {"model.embed_tokens.weight": emb})
    out, what = perturbed_copy(src, tmp_path / "b-control")
    sd = load_file(str(out / "model.safetensors"))
    assert torch.equal(sd["model.embed_tokens.weight"], emb) and torch.equal(sd["lm_head.weight"], torch.roll(emb, 1, 0))
    assert json.loads((out / "config.json").read_text())["tie_word_embeddings"] is False and "untied" in what


@pytest.mark.parametrize("family", ["eagle1", "mtp", "mlp_speculator"])
def test_a_family_without_a_vllm_method_is_skipped_by_name(tmp_path, tiny_target_dir, family, isolated_cache):
    """No vLLM is needed to say so: the format's own note names why."""
    from conftest import cli_train

    out = cli_train(ROOT / f"recipes/tiny-{family}.yaml", tiny_target_dir, tmp_path / family, "train.steps=1")
    res = check_served(out / "final")
    assert res.passed is None and res.skipped.startswith("vLLM has no method for this layout")


# ----------------------------------------------------------------------------- the real engine

#: family -> overrides: the tiny recipe, in the layout vLLM loads, trained until it accepts drafts on the tiny
#: target (the draft model starts as the target's own first layers and Medusa's heads as the target's head: they
#: accept from the start, and a step over the full vocabulary costs seconds)
SERVED = {"eagle3": ["train.steps=20"], "peagle": ["train.steps=20"], "dflash": ["train.steps=20"],
          "draft_model": ["train.steps=1"],
          "medusa": ["drafter.export=vllm-medusa", "drafter.draft_vocab_size=null", "train.steps=1"]}


@pytest.mark.slow
def test_vllm_serves_every_export_losslessly_with_our_acceptance(vllm_python, vllm_target_dir, tmp_path,
                                                                 isolated_cache):
    """(a) vLLM's speculative output equals its plain output, (b) vLLM's accepted drafts per step equal our loop's,
    (c) the head-perturbed copy is told apart: on the real engine, for every family it has a method for (EAGLE-3
    through the end gate of `speculators train`, the others in one vLLM worker). DSpark, whose method vLLM's CPU
    model runner lacks, is reported in vLLM's words, not failed."""
    from conftest import cli_train
    from speculators.export.vllm_served import check_served_many

    # EAGLE-3 through `speculators train`'s own gate (train.parity_check: layout, reference parity, then vLLM)
    e3 = cli_train(ROOT / "recipes/tiny-eagle3.yaml", vllm_target_dir, tmp_path / "eagle3", *SERVED["eagle3"],
                   "train.parity_check=true")
    g = json.loads((e3 / "final" / "parity.json").read_text())
    assert g["passed"] is True and g["served"]["passed"] is True, g["served"]
    assert g["served"]["inputs"] == "held-out prompts of the run" and g["served"]["method"] == "eagle3"
    card = (e3 / "final" / "README.md").read_text()
    assert "## Served by vLLM" in card and "verdict: **PASS**" in card
    from speculators.hub import hub_card

    assert "- served by vLLM 0.32.0 (method `eagle3`" in hub_card(e3 / "final", "me/d")
    runs = {f: cli_train(ROOT / f"recipes/tiny-{f}.yaml", vllm_target_dir, tmp_path / f, *o)
            for f, o in {**SERVED, "dspark": ["train.steps=1"]}.items() if f != "eagle3"}
    results = dict(zip(runs, check_served_many([r / "final" for r in runs.values()], num_prompts=2, max_tokens=24,
                                               python=vllm_python)))
    dspark = results.pop("dspark")
    assert dspark.passed is None and "refuses method `dspark`" in dspark.skipped and "does not support" in dspark.skipped
    assert set(results) == set(SERVED) - {"eagle3"}
    for family, res in results.items():
        assert res.skipped is None and res.error is None, (family, res.to_markdown())
        assert res.lossless["equal"] == 2 and res.lossless["failures"] == 0, family
        a = res.acceptance
        assert a["steps_compared"] > 0 and a["steps_equal"] == a["steps_compared"], (family, a)
        assert a["vllm_per_pos"] == a["loop_per_pos"] and sum(a["loop_per_pos"]) > 0, (family, a)
        assert a["counters_agree"], (family, a)  # vLLM's Prometheus counters say what its per-request records say
        d = a["drafts"]  # vLLM's drafted ids, recorded by the worker, equal ours at every step compared
        assert d is not None and d["compared"] > 0 and d["equal"] == d["compared"], (family, d)
        assert res.control["informative"] and res.control["breaks"], (family, res.control)
        assert res.passed is True, family
