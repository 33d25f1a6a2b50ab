"""Target: layer taps, KV-cache decoding and rollback, batched generation with compaction."""

from __future__ import annotations

import pytest
import torch

from speculators.errors import SpeculatorsError
from speculators.decode.loop import plain_decode
from speculators.target import Target, build_tiny_target, default_aux_layer_ids, resolve_model_ref


@pytest.fixture(scope="module")
def target():
    return build_tiny_target(vocab_size=128, hidden_size=64, num_layers=6, seed=2)


def test_default_aux_layers_follow_the_eagle3_convention():
    assert default_aux_layer_ids(30) == [1, 14, 26]
    assert default_aux_layer_ids(32) == [1, 15, 28]  # vLLM / EAGLE: inputs of layers [2, 16, 29]
    assert default_aux_layer_ids(4) == [0, 1, 2]  # shallow targets: distinct and ascending, never [1, 1, 0]


def _hooked_layer_outputs(model, ids):
    """Reference taps: the output of EVERY decoder layer, read with forward hooks (pre-norm)."""
    seen = {}
    hs = [layer.register_forward_hook(lambda m, a, o, i=i: seen.__setitem__(i, o[0] if isinstance(o, tuple) else o))
          for i, layer in enumerate(model.model.layers)]
    try:
        with torch.no_grad():
            model(ids)
    finally:
        for h in hs:
            h.remove()
    return seen


def test_features_tap_layer_outputs(target):
    """Every aux id, L - 1 included, taps the PRE-norm output of that decoder layer (a forward hook), in
    training features and in decode sessions; ``top`` stays the post-norm final state. (transformers'
    ``hidden_states[L]`` is post-norm: the old tap of layer L - 1 failed this.)"""
    L = target.num_layers
    t = Target(target.model, aux_layer_ids=[0, L // 2, L - 2, L - 1])
    ids = torch.randint(0, 128, (2, 9))
    f = t.features(ids, with_logits=True)
    ref = _hooked_layer_outputs(t.model, ids)
    H = t.hidden_size
    for n, layer in enumerate(t.aux_layer_ids):
        torch.testing.assert_close(f.aux[..., n * H:(n + 1) * H], ref[layer])
    hs = t.model(ids, output_hidden_states=True).hidden_states
    assert not torch.allclose(f.aux[..., -H:], hs[L])  # hidden_states[L] is after the final norm
    torch.testing.assert_close(f.top, hs[L])
    torch.testing.assert_close(f.logits, t.model(ids).logits)
    # decode sessions (speculative decoding, eval) tap the same
    n_hooks = [len(layer._forward_hooks) for layer in t.model.model.layers]
    s = t.session()
    _, fa = s.forward(ids[0, :5])
    _, fb = s.forward(ids[0, 5:])
    torch.testing.assert_close(torch.cat([fa.aux, fb.aux], dim=1), f.aux[:1], atol=1e-5, rtol=1e-5)
    assert [len(layer._forward_hooks) for layer in t.model.model.layers] == n_hooks  # taps removed


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
    stops = {7, 11}
    outs = target.generate_batch(prompts, 20, stops)
    for p, (o, stop) in zip(prompts, outs):
        ref = plain_decode(target, p, 20, eos_ids=stops).tokens
        if ref and ref[-1] in stops:
            assert stop == ref[-1]
            ref = ref[:-1]
        else:
            assert stop is None and len(o) == 20  # cut by max_new_tokens
        assert o == ref
    assert any(s is not None for _, s in outs) or not stops & set(sum((o for o, _ in outs), []))


def test_generate_batch_reports_cut_responses(target):
    outs = target.generate_batch([[1, 2, 3], [4, 5]], 6, [])
    assert [s for _, s in outs] == [None, None] and all(len(o) == 6 for o, _ in outs)
    first = outs[0].ids[2]  # make the third generated token of prompt 0 a stop token
    o, s = target.generate_batch([[1, 2, 3]], 6, {first})[0]
    assert s == first and o == outs[0].ids[:outs[0].ids.index(first)]


def test_generate_batch_sampling_is_seeded(target):
    prompts = [[1, 2, 3], [4, 5]]
    a = target.generate_batch(prompts, 10, [], temperature=1.0, generator=torch.Generator().manual_seed(1))
    b = target.generate_batch(prompts, 10, [], temperature=1.0, generator=torch.Generator().manual_seed(1))
    assert a == b and all(len(x.ids) == 10 and x.stop is None for x in a)


def test_generate_batch_samples_each_row_from_its_own_generator(target):
    """One generator per prompt: a prompt's sample is the same alone, in a batch, and in another order,
    also after rows that stopped early left the batch (generator ``r`` stays with original row ``r``)."""
    prompts = [[1, 2, 3], [4, 5], [6, 7, 8, 9], [10, 11], [12, 13, 14]]
    T = 30.0  # the tiny target is nearly deterministic at T = 1
    stops = set(range(0, 128, 9))  # rows finish at different steps: the batch compacts

    def gens(seeds):
        return [torch.Generator().manual_seed(s) for s in seeds]

    seeds = [10, 11, 12, 13, 14]
    batch = target.generate_batch(prompts, 12, stops, temperature=T, generator=gens(seeds))
    alone = [target.generate_batch([p], 12, stops, temperature=T, generator=gens([s]))[0]
             for p, s in zip(prompts, seeds)]
    flipped = target.generate_batch(prompts[::-1], 12, stops, temperature=T, generator=gens(seeds[::-1]))
    assert batch == alone == flipped[::-1]
    assert len({t for g in batch for t in g.ids}) > 6  # really sampled
    assert len({len(g.ids) for g in batch}) > 1 and any(g.stop is not None for g in batch)  # compacted
    assert batch != target.generate_batch(prompts, 12, stops, temperature=T, generator=gens([10, 11, 12, 13, 15]))
    with pytest.raises(SpeculatorsError, match="2 generators for 5 prompts"):
        target.generate_batch(prompts, 8, [], temperature=T, generator=gens([1, 2]))


def test_stop_token_ids_without_tokenizer(target):
    assert target.stop_token_ids == []  # tokenizer-less tiny target, no generation-config EOS
    t = build_tiny_target(vocab_size=64, num_layers=2)
    t.model.generation_config.eos_token_id = [5, 3, 5]
    assert t.stop_token_ids == [3, 5]
    t.stop_token_ids = [9]
    assert t.stop_token_ids == [9]
    t.stop_token_ids = None
    assert t.stop_token_ids == [3, 5]


def test_model_reference_errors(tmp_path):
    with pytest.raises(SpeculatorsError, match="does not exist"):
        resolve_model_ref(str(tmp_path / "missing.gguf"))
    with pytest.raises(SpeculatorsError, match="not an existing directory"):
        resolve_model_ref(str(tmp_path / "nope"))
    assert resolve_model_ref("HuggingFaceTB/SmolLM2-135M-Instruct") == ("HuggingFaceTB/SmolLM2-135M-Instruct", None)
    with pytest.raises(SpeculatorsError, match="aux_layer_ids"):
        Target(build_tiny_target(num_layers=2).model, aux_layer_ids=[5])


def test_load_resolves_dtype_auto(tiny_target_dir):
    """``Target.load(ref, "auto")`` takes the one dtype rule (bf16 where this CPU is fast in it, else float32),
    so scripts that pass a recipe's ``target.dtype`` as it is load the target."""
    from speculators.hardware import resolve_target_dtype

    t = Target.load(str(tiny_target_dir), "auto", log=lambda *_: None)
    assert str(t.dtype) == f"torch.{resolve_target_dtype('auto', 'cpu')}"
