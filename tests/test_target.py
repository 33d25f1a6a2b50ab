"""Target: layer taps, KV-cache decoding and rollback, batched generation with compaction."""

from __future__ import annotations

import pytest
import torch

from speculators.errors import SpeculatorsError
from speculators.generate import plain_decode
from speculators.target import Target, build_tiny_target, default_aux_layer_ids, resolve_model_ref


@pytest.fixture(scope="module")
def target():
    return build_tiny_target(vocab_size=128, hidden_size=64, num_layers=6, seed=2)


def test_default_aux_layers_follow_the_eagle3_convention():
    assert default_aux_layer_ids(30) == [1, 14, 26]
    assert default_aux_layer_ids(32) == [1, 15, 28]  # vLLM / EAGLE: inputs of layers [2, 16, 29]
    assert default_aux_layer_ids(4) == [1, 1, 0]


def test_features_tap_layer_outputs(target):
    ids = torch.randint(0, 128, (2, 9))
    f = target.features(ids, with_logits=True)
    hs = target.model(ids, output_hidden_states=True).hidden_states
    H = target.hidden_size
    for n, layer in enumerate(target.aux_layer_ids):
        torch.testing.assert_close(f.aux[..., n * H:(n + 1) * H], hs[layer + 1])
    torch.testing.assert_close(f.logits, target.model(ids).logits)


def test_session_crop_rolls_back(target):
    ids = torch.randint(0, 128, (12,))
    full = target.features(ids[None], with_logits=True).logits[0]
    s = target.session()
    s.forward(ids[:8])
    s.forward(torch.randint(0, 128, (3,)))  # rejected drafts
    s.crop(8)
    logits, feats = s.forward(ids[8:])
    torch.testing.assert_close(logits, full[8:], atol=1e-5, rtol=1e-5)
    assert s.length == 12 and feats.aux.shape == (1, 4, 3 * 64)


def test_generate_batch_matches_plain_greedy_decoding(target):
    g = torch.Generator().manual_seed(0)
    prompts = [torch.randint(0, 128, (n,), generator=g).tolist() for n in (3, 9, 5, 12)]
    eos = 7
    outs = target.generate_batch(prompts, 20, eos_token_id=eos)
    for p, o in zip(prompts, outs):
        ref = plain_decode(target, p, 20, eos_ids={eos}).tokens
        if ref and ref[-1] == eos:
            ref = ref[:-1]
        assert o == ref
    assert any(len(o) < 20 for o in outs) or eos not in sum(outs, [])


def test_generate_batch_sampling_is_seeded(target):
    prompts = [[1, 2, 3], [4, 5]]
    a = target.generate_batch(prompts, 10, None, temperature=1.0, generator=torch.Generator().manual_seed(1))
    b = target.generate_batch(prompts, 10, None, temperature=1.0, generator=torch.Generator().manual_seed(1))
    assert a == b and all(len(x) == 10 for x in a)


def test_model_reference_errors(tmp_path):
    with pytest.raises(SpeculatorsError, match="does not exist"):
        resolve_model_ref(str(tmp_path / "missing.gguf"))
    with pytest.raises(SpeculatorsError, match="not an existing directory"):
        resolve_model_ref(str(tmp_path / "nope"))
    assert resolve_model_ref("HuggingFaceTB/SmolLM2-135M-Instruct") == ("HuggingFaceTB/SmolLM2-135M-Instruct", None)
    with pytest.raises(SpeculatorsError, match="aux_layer_ids"):
        Target(build_tiny_target(num_layers=2).model, aux_layer_ids=[5])
