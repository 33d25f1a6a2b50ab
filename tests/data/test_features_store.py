"""The offline feature store keeps activations of any magnitude.

* ``data.feature_dtype`` (bfloat16 default, float32, float16): a cache round trip (written, then read
  back by a second extraction that runs no forward) keeps a 1e6-magnitude activation: exactly 1e6 in
  float32; in bfloat16 the value 999424 (= 244 * 2**12, the bf16 number nearest 1e6) exactly and 1e6
  itself within bf16's half-ulp (2**-9 relative), never ``inf``; float16 refuses it, naming the layer.
* Format 3 is keyed apart from format 2 (float16 only): a format-2 cache of the same target is reported
  and never read; a shard whose recorded format/dtype differs is re-extracted.
"""

from __future__ import annotations

import json

import pytest
import torch
from safetensors import safe_open
from safetensors.torch import load_file, save_file

from speculators.data import features as F
from speculators.data.features import (FEATURE_FORMAT_VERSION, FeatureStore, TokenizedExample, extract_features,
                                       feature_cache_dir, legacy_cache_dirs)
from speculators.errors import SpeculatorsError
from speculators.recipe import recipe_from_dict
from speculators.target import build_tiny_target

V, H = 64, 32
BIG_TOKEN = 5
BF16_EXACT = 999424.0  # 244 * 2**12: exactly representable in bfloat16 (8 significant bits)


def identity_target():
    """A tiny target whose decoder layers add nothing to the residual stream (o_proj and down_proj are
    zero), so every tapped aux layer outputs the token's embedding exactly; token ``BIG_TOKEN``'s
    embedding holds 1e6, -BF16_EXACT and 3.0 in its first three components."""
    t = build_tiny_target(vocab_size=V, hidden_size=H, num_layers=4, seed=1)
    with torch.no_grad():
        for layer in t.model.model.layers:
            layer.self_attn.o_proj.weight.zero_()
            layer.mlp.down_proj.weight.zero_()
        emb = t.model.get_input_embeddings().weight
        emb[BIG_TOKEN, :3] = torch.tensor([1e6, -BF16_EXACT, 3.0])
    t.calls = 0
    orig = t.features

    def counted(*a, **kw):
        t.calls += 1
        return orig(*a, **kw)

    t.features = counted
    return t


def examples():
    return [TokenizedExample("a", [1, BIG_TOKEN, 7, 9], [0, 1, 1, 1]),
            TokenizedExample("b", [3, 4, BIG_TOKEN, 2, 8, 11], [0, 0, 1, 1, 1, 1])]


def quiet(*_):
    pass


def big_values(store: FeatureStore, n_aux: int) -> torch.Tensor:
    """``[occurrences, n_aux, 3]``: the first three components of every aux tap at every ``BIG_TOKEN``."""
    rows = store.aux[store.input_ids == BIG_TOKEN]
    return rows.view(rows.shape[0], n_aux, H)[:, :, :3]


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_round_trip_keeps_a_1e6_activation(isolated_cache, dtype):
    t = identity_target()
    n_aux = len(t.aux_layer_ids)
    first = extract_features(t, examples(), log=quiet, dtype=dtype)
    assert t.calls > 0
    t.calls = 0
    again = extract_features(t, examples(), log=quiet, dtype=dtype)  # read back from the shards on disk
    assert t.calls == 0
    assert again.aux.dtype == F.FEATURE_DTYPES[dtype] and again.top.dtype == F.FEATURE_DTYPES[dtype]
    torch.testing.assert_close(again.aux, first.aux, rtol=0, atol=0)
    vals = big_values(again, n_aux).float()
    assert vals.shape == (2, n_aux, 3)
    assert bool(torch.isfinite(again.aux.float()).all())
    if dtype == "float32":
        assert bool((vals[..., 0] == 1e6).all())  # exact
    else:
        assert bool((vals[..., 0] == BF16_EXACT).all())  # 1e6 rounds to its nearest bf16 value
        assert abs(1e6 - BF16_EXACT) / 1e6 <= 2 ** -9
    assert bool((vals[..., 1] == -BF16_EXACT).all())  # exactly representable in both formats: kept exactly
    assert bool((vals[..., 2] == 3.0).all())


def test_float16_refuses_an_activation_beyond_65504_naming_the_layer(isolated_cache):
    t = identity_target()
    with pytest.raises(SpeculatorsError) as e:
        extract_features(t, examples(), log=quiet, dtype="float16")
    msg = str(e.value)
    assert "data.feature_dtype" in msg and "float16" in msg and "65504" in msg
    assert f"aux layer {t.aux_layer_ids[0]}" in msg and "1e+06" in msg
    # values float16 can hold are stored (no false alarm)
    small = build_tiny_target(vocab_size=V, hidden_size=H, num_layers=4, seed=2)
    store = extract_features(small, examples(), log=quiet, dtype="float16")
    assert store.aux.dtype == torch.float16 and bool(torch.isfinite(store.aux).all())


def test_feature_dtype_names_the_field():
    with pytest.raises(SpeculatorsError, match=r"data.feature_dtype: 'int8'.*allowed"):
        F.feature_dtype("int8")
    raw = {"target": {"model": "x"}, "data": {"sources": ["humaneval"], "feature_dtype": "fp8"},
           "drafter": {"algorithm": "eagle3"}}
    with pytest.raises(SpeculatorsError, match=r"data.feature_dtype"):
        recipe_from_dict(raw)
    raw["data"]["feature_dtype"] = "float32"
    assert recipe_from_dict(raw).data.feature_dtype == "float32"
    assert recipe_from_dict({**raw, "data": {"sources": ["humaneval"]}}).data.feature_dtype == "bfloat16"


def test_a_format_2_cache_is_detected_and_not_read(isolated_cache):
    """A cache written before ``data.feature_dtype`` (format 2: float16, keyed by ``str(torch.float16)``,
    ``v: 2``) is reported by name and never read: the features are extracted again under the new key."""
    t = identity_target()
    old = isolated_cache / "features" / F.stable_hash(
        {"target": t.fingerprint, "aux": t.aux_layer_ids, "dtype": str(torch.float16), "v": 2})
    old.mkdir(parents=True)
    keys = [F.example_key(e.input_ids) for e in examples()]
    # an old-format shard holding garbage under the very keys of our examples: reading it would be a bug
    tensors = F._pack([(e, {"aux": torch.full((len(e.input_ids), len(t.aux_layer_ids) * H), float("inf"),
                                              dtype=torch.float16),
                            "top": torch.zeros(len(e.input_ids), H, dtype=torch.float16),
                            "argmax": torch.zeros(len(e.input_ids), dtype=torch.int64)}) for e in examples()])
    save_file(tensors, str(old / "shard-00000.safetensors"), metadata={"keys": json.dumps(keys)})
    (old / "index.json").write_text(json.dumps({"shards": ["shard-00000.safetensors"],
                                                "keys": {k: "shard-00000.safetensors" for k in keys}}))
    assert legacy_cache_dirs(t) == [old]
    new = feature_cache_dir(t)
    assert new != old and feature_cache_dir(t, "float32") not in (new, old)
    logs = []
    store = extract_features(t, examples(), log=logs.append)
    assert t.calls > 0  # extracted again, not read from the old cache
    assert bool(torch.isfinite(store.aux.float()).all())
    assert any(str(old) in m and "not read" in m and str(new) in m for m in logs), logs
    assert (new / "index.json").is_file() and (old / "index.json").is_file()  # the old one is left to the user


def test_a_shard_of_another_format_or_dtype_is_extracted_again(isolated_cache):
    t = identity_target()
    extract_features(t, examples(), log=quiet)
    d = feature_cache_dir(t)
    shard = d / json.loads((d / "index.json").read_text())["shards"][0]
    with safe_open(str(shard), "pt") as f:
        meta = f.metadata()
    assert meta["format"] == str(FEATURE_FORMAT_VERSION) and meta["dtype"] == "bfloat16"
    tensors = load_file(str(shard))
    tensors["aux"] = tensors["aux"].to(torch.float16)  # as format 2 stored them (1e6 -> inf)
    tensors["top"] = tensors["top"].to(torch.float16)
    save_file(tensors, str(shard), metadata={"keys": meta["keys"]})  # no format/dtype record
    t.calls = 0
    logs = []
    store = extract_features(t, examples(), log=logs.append)
    assert t.calls > 0
    assert any("warning" in m and "format 2" in m for m in logs), logs
    assert store.aux.dtype == torch.bfloat16 and bool(torch.isfinite(store.aux.float()).all())


def test_batch_features_zero_the_padding_and_round_like_the_store():
    t = build_tiny_target(vocab_size=V, hidden_size=H, num_layers=4, seed=4)
    ids = torch.tensor([[3, 4, 5, 6], [7, 8, 0, 0]])
    att = torch.tensor([[1, 1, 1, 1], [1, 1, 0, 0]])
    out = F.batch_features(t, ids, att, "bfloat16")
    assert out["aux"].dtype == torch.bfloat16 and out["argmax"].dtype == torch.int64
    assert bool((out["aux"][1, 2:] == 0).all()) and bool((out["top"][1, 2:] == 0).all())
    assert bool((out["argmax"][1, 2:] == 0).all())
    ref = t.features(ids[:1])
    torch.testing.assert_close(out["aux"][0], ref.aux[0].to(torch.bfloat16), rtol=0, atol=0)
    assert out["argmax"][0].tolist() == t.lm_head(ref.top[0]).argmax(-1).tolist()
    store = FeatureStore.tokens_only(examples(), "float32")
    assert not store.has_features and store.aux.shape == (10, 0) and store.num_tokens == 10
