"""Feature cache (``speculators.data.features.extract_features``): hit, miss, partial overlap, damaged
caches (truncated / garbage / missing shard, unreadable index) and the extraction batches' budget.

Every test counts the target forwards through a wrapper around ``target.features``."""

from __future__ import annotations

import json

import pytest
import torch
from safetensors import safe_open

from speculators.data import features as F
from speculators.data.features import STORE_DTYPE, TokenizedExample, extract_features, feature_cache_dir
from speculators.errors import SpeculatorsError
from speculators.target import build_tiny_target

V = 128


@pytest.fixture()
def target(isolated_cache):
    """A tiny target whose ``features`` calls are recorded in ``target.calls`` as ``(ids, attention)``."""
    t = build_tiny_target(vocab_size=V, hidden_size=32, num_layers=2, seed=3)
    t.calls = []
    orig = t.features

    def counted(ids, attention_mask=None, *a, **kw):
        t.calls.append((ids.clone(), None if attention_mask is None else attention_mask.clone()))
        return orig(ids, attention_mask, *a, **kw)

    t.features = counted
    return t


def examples(n: int, seed: int = 0, prefix: str = "ex") -> list[TokenizedExample]:
    g = torch.Generator().manual_seed(seed)
    out = []
    for i in range(n):
        L = int(torch.randint(4, 20, (1,), generator=g))
        ids = torch.randint(0, V, (L,), generator=g).tolist()
        mask = (torch.rand(L, generator=g) > 0.4).int().tolist()
        out.append(TokenizedExample(f"{prefix}{i}", ids, mask))
    return out


def extracted_rows(t) -> list[list[int]]:
    """Token ids of every example the target was run on (padding removed)."""
    rows = []
    for ids, att in t.calls:
        for r in range(ids.shape[0]):
            rows.append(ids[r, :int(att[r].sum())].tolist())
    return rows


def assert_store_matches(t, store, exs):
    """The store holds exactly the target's own features of ``exs``, in order."""
    assert store.ids == [e.id for e in exs] and len(store) == len(exs)
    assert store.lengths().tolist() == [len(e.input_ids) for e in exs]
    for i, e in enumerate(exs):
        row = store.example(i)
        assert row["input_ids"].tolist() == e.input_ids
        assert row["loss_mask"].tolist() == [bool(m) for m in e.loss_mask]
        with torch.no_grad():
            f = type(t).features(t, torch.tensor([e.input_ids]))  # the unwrapped method: not counted
        assert row["aux"].dtype == STORE_DTYPE and row["top"].dtype == STORE_DTYPE
        torch.testing.assert_close(row["aux"].float(), f.aux[0].to(STORE_DTYPE).float(), atol=2e-3, rtol=2e-3)
        torch.testing.assert_close(row["top"].float(), f.top[0].to(STORE_DTYPE).float(), atol=2e-3, rtol=2e-3)
        assert row["argmax"].tolist() == t.lm_head(f.top[0]).argmax(-1).tolist()


def shards(t) -> list[str]:
    return json.loads((feature_cache_dir(t) / "index.json").read_text())["shards"]


def quiet(*_):
    pass


# ----------------------------------------------------------------------------- hit / miss / overlap


def test_miss_then_hit_runs_the_target_once(target):
    exs = examples(6)
    logs = []
    store = extract_features(target, exs, batch_tokens=64, log=logs.append)
    assert sorted(map(tuple, extracted_rows(target))) == sorted(tuple(e.input_ids) for e in exs)
    assert_store_matches(target, store, exs)
    assert any("extracting 6 of 6" in m for m in logs)
    target.calls.clear()
    logs.clear()
    again = extract_features(target, exs, batch_tokens=64, log=logs.append)
    assert target.calls == []  # cache hit: no target forward
    assert any("cache hit" in m for m in logs)
    for name in ("input_ids", "loss_mask", "argmax", "aux", "top", "offsets"):
        assert torch.equal(getattr(again, name), getattr(store, name)), name
    # another order and a subset: still no forward, store in the requested order
    sub = [exs[4], exs[0], exs[2]]
    assert_store_matches(target, extract_features(target, sub, log=quiet), sub)
    assert target.calls == []


def test_partial_overlap_extracts_only_the_new_examples(target):
    old = examples(4, seed=1)
    extract_features(target, old, log=quiet)
    target.calls.clear()
    new = examples(3, seed=2, prefix="new")
    mixed = [old[2], new[0], old[0], new[1], new[2], new[0]]  # duplicates are extracted once
    store = extract_features(target, mixed, log=quiet)
    assert sorted(map(tuple, extracted_rows(target))) == sorted(tuple(e.input_ids) for e in new)
    assert_store_matches(target, store, mixed)


def test_extraction_batches_respect_the_token_budget(target):
    exs = examples(12, seed=4)
    extract_features(target, exs, batch_tokens=40, log=quiet)
    assert target.calls
    for ids, _ in target.calls:
        B, T = ids.shape
        assert B * T <= 40 or B == 1, (B, T)


# ----------------------------------------------------------------------------- damaged caches


def corrupt(path, kind):
    if kind == "truncated":
        data = path.read_bytes()
        path.write_bytes(data[:len(data) // 2])
    elif kind == "garbage":
        path.write_bytes(b"not a safetensors file" * 20)
    elif kind == "missing":
        path.unlink()
    elif kind == "other ids":  # a valid safetensors file whose stored tokens are not its keys' examples
        from safetensors.torch import load_file, save_file

        t = load_file(str(path))
        with safe_open(str(path), "pt") as f:
            meta = f.metadata()
        t["input_ids"] = (t["input_ids"] + 1) % V
        save_file(t, str(path), metadata=meta)


@pytest.mark.parametrize("kind", ["truncated", "garbage", "missing", "other ids"])
@pytest.mark.parametrize("which", [0, -1])
def test_damaged_shard_is_detected_and_only_its_examples_are_extracted_again(target, kind, which):
    exs = examples(9, seed=5)
    extract_features(target, exs, batch_tokens=64, shard_tokens=1, log=quiet)  # one shard per batch
    names = shards(target)
    assert len(names) >= 3
    bad = names[which]
    d = feature_cache_dir(target)
    with safe_open(str(d / bad), "pt") as f:
        bad_keys = set(json.loads(f.metadata()["keys"]))
    intact = {n: (d / n).read_bytes() for n in names if n != bad}
    corrupt(d / bad, kind)
    target.calls.clear()
    logs = []
    store = extract_features(target, exs, batch_tokens=64, shard_tokens=1, log=logs.append)
    assert any(str(d / bad) in m and "warning" in m for m in logs), logs  # the file is named
    assert {F.example_key(r) for r in extracted_rows(target)} == bad_keys  # only its examples
    assert_store_matches(target, store, exs)
    assert set(intact) <= set(shards(target))  # the new shard never overwrites a listed one
    assert all((d / n).read_bytes() == b for n, b in intact.items())
    target.calls.clear()
    assert_store_matches(target, extract_features(target, exs, log=quiet), exs)
    assert target.calls == []  # repaired: a plain hit again


@pytest.mark.parametrize("content", ["{not json", "[]", '{"shards": ["a"], "keys": {"k": "b"}}'])
def test_unreadable_index_is_reported_and_the_cache_rebuilt(target, content):
    exs = examples(4, seed=6)
    extract_features(target, exs, log=quiet)
    index_file = feature_cache_dir(target) / "index.json"
    index_file.write_text(content)
    target.calls.clear()
    logs = []
    store = extract_features(target, exs, log=logs.append)
    assert any(str(index_file) in m for m in logs), logs
    assert len(extracted_rows(target)) == 4
    assert_store_matches(target, store, exs)
    target.calls.clear()
    extract_features(target, exs, log=quiet)
    assert target.calls == []


def test_a_shard_unreadable_right_after_writing_is_a_clear_error(target, monkeypatch):
    def bad_save(tensors, filename, metadata=None):
        with open(filename, "wb") as f:
            f.write(b"\0" * 16)

    monkeypatch.setattr(F, "save_file", bad_save)
    with pytest.raises(SpeculatorsError, match=r"shard-00000\.safetensors.*unreadable right after"):
        extract_features(target, examples(3, seed=7), log=quiet)
