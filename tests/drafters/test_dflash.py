"""DFlash's own maths (the protocol contracts run in tests/drafters/test_contracts.py): the one-forward block-sparse
training path against the per-anchor inference path, anchor sampling, the slot-weighted CE by hand,
export, default taps, and the errors."""

from __future__ import annotations

import math

import pytest
import torch
import torch.nn.functional as F

from speculators.drafters import Drafter, registry
from speculators.data.vocab import DraftVocab
from speculators.drafters.dflash import DFlashConfig, DFlashDrafter, default_gamma
from speculators.drafters.dflash_format import dflash_aux_layer_ids
from speculators.errors import SpeculatorsError
from speculators.recipe import recipe_from_dict
from speculators.target import TargetFeatures, build_tiny_target
from conftest import batch_for

V, HIDDEN, LAYERS = 128, 32, 2
BS = 4  # block size of most tests: 3 drafts per forward


def make(block_size: int = BS, num_layers: int = 2, num_anchors: int = 64, vocab: int | None = None,
         seed: int = 0, **kw) -> tuple:
    """(target, drafter) with randomised norms (so that every weight matters) in eval mode."""
    target = build_tiny_target(vocab_size=V, hidden_size=HIDDEN, num_layers=LAYERS, seed=1)
    torch.manual_seed(seed)
    cfg = DFlashConfig(block_size=block_size, num_layers=num_layers, num_anchors=num_anchors,
                       draft_vocab_size=vocab, **kw)
    dv = DraftVocab.full(V) if vocab is None else DraftVocab.from_counts(torch.arange(V, 0, -1), vocab)
    d = DFlashDrafter.from_target(cfg, target, dv)
    with torch.no_grad():
        for n, p in d.named_parameters():
            if n.endswith("norm.weight"):
                p.copy_(1.0 + 0.3 * torch.randn(p.shape))
    return target, d.eval()


def make_batch(target, lengths=(20, 13), prompt=4, seed=0):
    g = torch.Generator().manual_seed(seed)
    T = max(lengths)
    ids = torch.randint(0, V, (len(lengths), T), generator=g)
    mask = torch.zeros(len(lengths), T, dtype=torch.bool)
    for i, n in enumerate(lengths):
        mask[i, prompt:n] = True
    batch, _ = batch_for(target, ids, mask, list(lengths))
    return batch


def dense_hidden(d, batch, b: int, a: int, split: int | None = None) -> torch.Tensor:
    """Anchor ``a`` of row ``b`` alone through the INFERENCE path: start on ``x_0..x_a`` with the target
    features of positions ``0..a-1`` (optionally start at ``split`` and advance the rest), one block."""
    ids = batch.input_ids[b]
    feats = TargetFeatures(batch.aux[b:b + 1], batch.top[b:b + 1])
    if split is None or split >= a:
        state = d.start(ids[:a + 1], feats.slice(0, a))
    else:
        state = d.start(ids[:split + 1], feats.slice(0, split))
        d.advance([state], [ids[split + 1:a + 1]], [feats.slice(split, a)])
    assert state.num_positions == a and state.last_id == int(ids[a])
    return d.block_hidden(state)


# ----------------------------------------------------------------------------- (1) sparse == dense


@pytest.mark.parametrize("vocab", [None, 48])
def test_one_forward_training_equals_per_anchor_inference(vocab):
    target, d = make(vocab=vocab)
    batch = make_batch(target)
    # anchors of every kind: 0 (empty context), mid-sequence, blocks running past the end (row 1 has
    # 13 real tokens: anchors 11 and 12 put slots on padding), duplicates across rows
    anchors = torch.tensor([[0, 5, 9, 16, 19], [0, 3, 7, 11, 12]])
    with torch.no_grad():
        sparse = d.head(d.slot_logits(batch, anchors)).float()  # [B, A, Bs, N]
    for b in range(2):
        for i, a in enumerate(anchors[b].tolist()):
            dense = d.head(dense_hidden(d, batch, b, a, split=a // 2)).float()
            torch.testing.assert_close(sparse[b, i], dense, atol=1e-5, rtol=1e-5, msg=f"row {b} anchor {a}")


@pytest.mark.parametrize("leak", ["future", "foreign"])
def test_one_extra_visible_position_breaks_the_equality(leak, monkeypatch):
    target, d = make()
    batch = make_batch(target)
    anchors = torch.tensor([[3, 8, 12], [2, 6, 9]])
    T = batch.input_ids.shape[1]
    real = d.block_sparse_mask

    def leaky(anc, attention_mask):
        m = real(anc, attention_mask).clone()
        q = 1 * BS + 2  # row 0, block 1 (anchor 8), slot 2
        if leak == "future":
            m[0, 0, q, 8] = True  # the anchor's own position in the context: not yet verified
        else:
            m[0, 0, q, T + 2 * BS] = True  # the first slot of block 2 (another anchor's block)
        return m

    with torch.no_grad():
        good = d.head(d.slot_logits(batch, anchors)).float()
        monkeypatch.setattr(d, "block_sparse_mask", leaky)
        bad = d.head(d.slot_logits(batch, anchors)).float()
    dense = d.head(dense_hidden(d, batch, 0, 8)).float()
    torch.testing.assert_close(good[0, 1], dense, atol=1e-5, rtol=1e-5)
    assert (bad[0, 1, 2] - dense[2]).abs().max() > 1e-3  # the leaking query changed
    for i in (0, 2):  # the other blocks do not see the leaking query's block
        torch.testing.assert_close(bad[0, i], good[0, i], atol=1e-6, rtol=1e-6)
    torch.testing.assert_close(bad[1], good[1], atol=1e-6, rtol=1e-6)  # other rows untouched


# ----------------------------------------------------------------------------- (2) anchors


def test_anchor_sampling_valid_bounded_uniform():
    target, d = make(num_anchors=5)
    batch = make_batch(target, lengths=(20, 9, 6), prompt=4)
    ok = d.valid_anchor_positions(batch)
    # by hand: p with loss_mask[p] and loss_mask[p+1]: row 0 -> 4..18, row 1 -> 4..7, row 2 -> 4
    assert [torch.nonzero(r).flatten().tolist() for r in ok] == [list(range(4, 19)), [4, 5, 6, 7], [4]]
    anchors, valid = d.sample_anchors(batch, seed=3)
    assert anchors.shape == (3, 5)
    assert valid.sum(1).tolist() == [5, 4, 1]  # min(num_anchors, valid positions)
    for b in range(3):
        chosen = anchors[b][valid[b]].tolist()
        assert len(set(chosen)) == len(chosen) and all(ok[b, p] for p in chosen)
        assert chosen == sorted(chosen)
    # uniform: each of row 0's 15 valid positions is drawn with probability 5/15
    counts = torch.zeros(20)
    n = 600
    for s in range(n):
        a, v = d.sample_anchors(batch, seed=1000 + s)
        counts.index_add_(0, a[0][v[0]], torch.ones(int(v[0].sum())))
    freq = counts[4:19] / n
    assert counts[:4].sum() == 0 and counts[19:].sum() == 0
    assert (freq - 1 / 3).abs().max() < 0.08, freq


def test_anchors_resampled_every_step_shared_with_counts_and_reproducible(monkeypatch):
    target, d = make(num_anchors=3)
    batch = make_batch(target)
    seen = []
    real = d.slot_logits
    monkeypatch.setattr(d, "slot_logits", lambda b, a: (seen.append(a.clone()), real(b, a))[1])
    d.train()
    torch.manual_seed(7)
    counts = d.loss_counts(batch)
    d.loss(batch, counts)
    # the loss used the anchors of the preceding counts (same batch content, another Batch object)
    again = type(batch)(**{k: v.clone() for k, v in vars(batch).items()})
    torch.manual_seed(7)
    a_counts, v_counts = d._anchors(again, for_counts=False)
    assert torch.equal(seen[0], a_counts)
    assert torch.equal(counts, d._slot_labels(batch, a_counts, v_counts)[2].sum((0, 1)))
    # the next step draws new anchors
    d.loss(batch)
    d.loss(batch)
    assert not torch.equal(seen[1], seen[2]) or not torch.equal(seen[0], seen[1])
    # torch's RNG drives the draw (resume restores it): same seed, same anchors
    torch.manual_seed(11)
    x = d._anchors(batch, for_counts=False)[0]
    torch.manual_seed(11)
    assert torch.equal(x, d._anchors(batch, for_counts=False)[0])
    # eval mode: a function of the content, no RNG consumed
    d.eval()
    state = torch.get_rng_state()
    e1, e2 = d._anchors(batch, for_counts=True)[0], d._anchors(batch, for_counts=False)[0]
    assert torch.equal(e1, e2) and torch.equal(state, torch.get_rng_state())


# ----------------------------------------------------------------------------- (3) loss by hand


def pin_anchors(d, monkeypatch):
    """Fix ``d``'s anchors of :func:`make_batch`'s two rows (the last anchor of row 1 invalid)."""
    anchors = torch.tensor([[4, 10, 17, 18], [5, 9, 11, 4]])
    valid_anchor = torch.tensor([[True, True, True, True], [True, True, True, False]])
    monkeypatch.setattr(d, "_anchors", lambda b, for_counts: (anchors, valid_anchor))
    return anchors, valid_anchor


@pytest.mark.parametrize("vocab,labels", [(None, "token"), (100, "token"), (None, "argmax"), (100, "argmax")])
def test_loss_by_hand(vocab, labels, monkeypatch):
    target, d = make(vocab=vocab, labels=labels, gamma=2.5, position_weights="exp_decay")
    batch = make_batch(target)
    anchors, valid_anchor = pin_anchors(d, monkeypatch)
    with torch.no_grad():
        logits = d.head(d.slot_logits(batch, anchors)).float()
    T = batch.input_ids.shape[1]
    lm = batch.loss_mask & batch.attention_mask
    t2d = d.t2d if vocab else torch.ones(V, dtype=torch.bool)
    rank = torch.cumsum(t2d.long(), 0) - 1
    sums, counts = [0.0] * (BS - 1), [0] * (BS - 1)
    for b in range(2):
        for i in range(4):
            a = int(anchors[b, i])
            for k in range(1, BS):
                p = a + k
                if not valid_anchor[b, i] or p >= T or not lm[b, p]:
                    continue
                label = int(batch.input_ids[b, p]) if labels == "token" else int(batch.argmax[b, p - 1])
                if not t2d[label]:
                    continue
                sums[k - 1] += float(F.cross_entropy(logits[b, i, k][None], torch.tensor([int(rank[label])])))
                counts[k - 1] += 1
    assert min(counts) > 0
    w = [math.exp(-(k - 1) / 2.5) for k in range(1, BS)]
    expect = sum(wk * s / c for wk, s, c in zip(w, sums, counts))
    assert d.loss_counts(batch).tolist() == counts
    loss, metrics = d.loss(batch)
    loss = loss.detach()
    assert float(loss) == pytest.approx(expect, rel=1e-5)
    for j in range(BS - 1):
        assert metrics[f"loss_{j}"] == pytest.approx(sums[j] / counts[j], rel=1e-5)
    # window normalisation: each slot term divided by the given counts
    norm = torch.tensor([10, 20, 40])
    loss_w, _ = d.loss(batch, norm)
    by_hand = sum(wk * s / n for wk, s, n in zip(w, sums, norm.tolist()))
    assert float(loss_w.detach()) == pytest.approx(by_hand, rel=1e-5)
    assert {"full_acc_0", "cond_acc_2", "sim_tau"} <= metrics.keys()


@pytest.mark.parametrize("alpha", [0.5, 1.0])
def test_dpace_loss_by_hand(alpha, monkeypatch):
    """position_weights: dpace: slot k's term is sum over anchors of w_{a,k} * CE_{a,k} / count_k with D-PACE's
    weights of each block (s_k = (1 - alpha) exp(-CE_k) + alpha on supervised slots, w_k = sum_{j >= k} of the
    prefix products over supervised slots), every slot term weighted 1."""
    target, d = make(vocab=None, position_weights="dpace", dpace_alpha=alpha)
    batch = make_batch(target)
    anchors, valid_anchor = pin_anchors(d, monkeypatch)
    with torch.no_grad():
        logits = d.head(d.slot_logits(batch, anchors)).float()
    T = batch.input_ids.shape[1]
    lm = batch.loss_mask & batch.attention_mask
    sums, counts = [0.0] * (BS - 1), [0] * (BS - 1)
    for b in range(2):
        for i in range(4):
            a = int(anchors[b, i])
            ce = {}
            for k in range(1, BS):
                p = a + k
                if valid_anchor[b, i] and p < T and lm[b, p]:
                    ce[k] = float(F.cross_entropy(logits[b, i, k][None], batch.input_ids[b, p][None]))
            s = {k: (1 - alpha) * math.exp(-ce[k]) + alpha if k in ce else 1.0 for k in range(1, BS)}
            reach = {j: math.prod(s[i2] for i2 in range(1, j + 1)) for j in range(1, BS)}
            for k in ce:
                w = sum(reach[j] for j in range(k, BS) if j in ce)
                sums[k - 1] += w * ce[k]
                counts[k - 1] += 1
    loss, _ = d.loss(batch)
    assert float(loss.detach()) == pytest.approx(sum(x / c for x, c in zip(sums, counts)), rel=1e-5)
    _, exp_decay = make(vocab=None, position_weights="exp_decay")
    pin_anchors(exp_decay, monkeypatch)
    assert float(exp_decay.loss(batch)[0].detach()) != pytest.approx(float(loss.detach()), rel=1e-3)


def test_loss_backward_reaches_every_trained_weight_and_not_the_frozen_ones():
    target, d = make(vocab=48)
    d.train()
    loss, _ = d.loss(make_batch(target))
    loss.backward()
    for n, p in d.named_parameters():
        if p.requires_grad:
            assert p.grad is not None and p.grad.abs().sum() > 0, n
    assert not d.lm_head.weight.requires_grad and d.lm_head.weight.grad is None


def test_default_gamma_and_slot_weights():
    assert default_gamma(8) == 4.0 and default_gamma(16) == 7.0 and default_gamma(4) == 4.0
    assert DFlashConfig(block_size=16).gamma == 7.0 and DFlashConfig().gamma == 4.0
    assert DFlashConfig().position_weights == "dpace"  # the default since it measured better (docs/RESULTS.md)
    _, d = make(block_size=8, position_weights="exp_decay")
    assert d.slot_weights() == pytest.approx([math.exp(-(k - 1) / 4) for k in range(1, 8)])


# ----------------------------------------------------------------------------- inference


def test_propose_is_one_block_and_leaves_no_trace():
    target, d = make()
    batch = make_batch(target)
    ids, feats = batch.input_ids[0], TargetFeatures(batch.aux[:1], batch.top[:1])
    state = d.start(ids[:9], feats.slice(0, 8))
    k_before = [t.clone() for t in state.cache.k]
    p = d.propose([state], [3])[0]
    expect = d.head(d.block_hidden(state)[1:4]).float().argmax(-1)
    assert p.token_ids.tolist() == expect.tolist() and p.probs is None
    assert all(torch.equal(a, b) for a, b in zip(k_before, state.cache.k)) and state.num_positions == 8
    assert d.propose([state], [0])[0].token_ids.numel() == 0


def test_k_below_the_block_runs_vllms_shrunken_block():
    """Served with K < block_size - 1, vLLM's DFlash proposer runs ``1 + K`` query slots (anchor + K masks);
    the block is bidirectional, so every slot differs from the full block's: a proposal of K drafts is the
    forward of the shrunken block, not the first K slots of the full one."""
    from speculators.verify import SamplingParams

    target, d = make(block_size=8)
    batch = make_batch(target)
    ids, feats = batch.input_ids[0], TargetFeatures(batch.aux[:1], batch.top[:1])
    state = d.start(ids[:9], feats.slice(0, 8))
    full = d.head(d.block_hidden(state)).float()  # [8, V]
    for k in (1, 3, 6):
        shrunk = d.head(d.block_hidden(state, k + 1)).float()  # [k + 1, V]
        assert shrunk.shape[0] == k + 1
        p = d.propose([state], [k], SamplingParams.uniform(1, 1.0), [torch.Generator().manual_seed(0)])[0]
        torch.testing.assert_close(p.probs, torch.softmax(shrunk[1:], -1), atol=1e-6, rtol=1e-5)
        assert (shrunk[1:] - full[1:k + 1]).abs().max() > 1e-2  # not the truncated full block
        greedy = d.propose([state], [k])[0]
        assert greedy.token_ids.tolist() == shrunk[1:].argmax(-1).tolist()
    k = 7  # K = block_size - 1: the trained block itself
    p = d.propose([state], [k], SamplingParams.uniform(1, 1.0), [torch.Generator().manual_seed(0)])[0]
    torch.testing.assert_close(p.probs, torch.softmax(full[1:], -1), atol=1e-6, rtol=1e-5)
    with pytest.raises(SpeculatorsError, match="allowed 1..8"):
        d.block_hidden(state, 9)


# ----------------------------------------------------------------------------- (4) export


@pytest.mark.parametrize("vocab", [None, 48])
def test_export_config_weights_and_round_trip(vocab, tmp_path):
    target, d = make(block_size=8, num_layers=2, vocab=vocab, mask_token_id=5)
    cfg = d.serving.config(d)
    assert cfg["speculators_model_type"] == "dflash" and cfg["architectures"] == ["DFlashDraftModel"]
    assert cfg["block_size"] == 8 and cfg["mask_token_id"] == 5 and cfg["sample_from_anchor"] is False
    assert cfg["aux_hidden_state_layer_ids"] == [i + 1 for i in target.aux_layer_ids]
    assert cfg["speculators_config"]["proposal_methods"][0]["speculative_tokens"] == 7
    assert DFlashDrafter.serving.speculative_tokens(cfg) == 7
    assert cfg["draft_vocab_size"] == (vocab or V)
    layer = cfg["transformer_layer_config"]
    assert layer["model_type"] == "qwen3" and layer["num_hidden_layers"] == 2 and layer["vocab_size"] == V
    assert layer["head_dim"] == HIDDEN // 4 and layer["rope_theta"] == 10000.0
    assert DFlashDrafter.serving.vllm_serving(cfg) == ("dflash", "")
    names = set(d.serving.state_dict(d))
    per_layer = {"input_layernorm.weight", "post_attention_layernorm.weight", "self_attn.q_proj.weight",
                 "self_attn.k_proj.weight", "self_attn.v_proj.weight", "self_attn.o_proj.weight",
                 "self_attn.q_norm.weight", "self_attn.k_norm.weight", "mlp.gate_proj.weight",
                 "mlp.up_proj.weight", "mlp.down_proj.weight"}
    expect = {"fc.weight", "hidden_norm.weight", "norm.weight"}
    expect |= {f"layers.{i}.{n}" for i in range(2) for n in per_layer}
    if vocab:
        expect |= {"lm_head.weight", "d2t", "t2d"}
    assert names == expect and not any("mask_hidden" in n or "embed_tokens" in n for n in names)
    assert tuple(d.serving.state_dict(d)["fc.weight"].shape) == (HIDDEN, len(target.aux_layer_ids) * HIDDEN)
    path = d.save_pretrained(tmp_path / "ckpt")
    loaded = Drafter.from_pretrained(path)
    assert isinstance(loaded, DFlashDrafter) and loaded.cfg == d.cfg and loaded.reduced_vocab == bool(vocab)
    for k, v in d.serving.state_dict(d).items():
        assert torch.equal(v, loaded.serving.state_dict(loaded)[k]), k
    loaded.attach_target(target)
    batch = make_batch(target)
    feats = TargetFeatures(batch.aux[:1], batch.top[:1])
    sa = d.start(batch.input_ids[0, :12], feats.slice(0, 11))
    sb = loaded.start(batch.input_ids[0, :12], feats.slice(0, 11))
    assert d.propose([sa], [7])[0].token_ids.tolist() == loaded.propose([sb], [7])[0].token_ids.tolist()


# ----------------------------------------------------------------------------- default taps


def test_default_aux_layer_ids():
    assert dflash_aux_layer_ids(30, 1) == [15]
    assert dflash_aux_layer_ids(30, 3) == [1, 14, 27]
    assert dflash_aux_layer_ids(36, 5) == [1, 9, 17, 25, 33]  # the reference's spacing for Qwen3-8B
    # shallow targets: distinct and ascending (the rounded spacing would give [1, 1] and [1, 0, 0])
    assert dflash_aux_layer_ids(4, 2) == [1, 2] and dflash_aux_layer_ids(3, 3) == [0, 1, 2]
    for L in range(1, 12):
        for n in range(1, L + 1):
            ids = DFlashDrafter.serving.default_aux_layer_ids(L, DFlashConfig(num_layers=n))
            assert len(ids) == n and ids == sorted(set(ids)) and 0 <= ids[0] and ids[-1] < L, (L, n, ids)
    with pytest.raises(SpeculatorsError, match=r"target.aux_layer_ids.*2 decoder layer\(s\) cannot give 3 distinct"):
        dflash_aux_layer_ids(2, 3)
    assert DFlashDrafter.serving.default_aux_layer_ids(30, DFlashConfig(num_layers=3)) == [1, 14, 27]
    assert registry.get("eagle3").serving.default_aux_layer_ids(30, None) == [1, 14, 26]  # the base default


def test_train_workflow_uses_the_family_default_taps(monkeypatch, tmp_path):
    """An unset ``target.aux_layer_ids`` becomes the family's default before any feature is extracted."""
    import speculators.data.pipeline as pipeline
    from speculators import workflows
    from speculators.target import Target

    seen = {}

    class Stop(Exception):
        pass

    def fake_prepare(spec, target, **kw):
        seen["ids"] = list(target.aux_layer_ids)
        raise Stop

    monkeypatch.setattr(Target, "load", classmethod(
        lambda cls, *a, **k: build_tiny_target(vocab_size=V, hidden_size=HIDDEN, num_layers=30)))
    monkeypatch.setattr(pipeline, "load_data", lambda spec, log: (None, {}))
    monkeypatch.setattr(pipeline, "prepare_data", fake_prepare)
    raw = {"target": {"model": "x"}, "data": {"sources": [{"source": "humaneval"}]},
           "drafter": {"algorithm": "dflash", "num_layers": 3}}
    with pytest.raises(Stop):
        workflows.train_run(recipe_from_dict(raw), tmp_path / "run", log=lambda *_: None)
    assert seen["ids"] == [1, 14, 27]
    with pytest.raises(Stop):
        workflows.data_run(recipe_from_dict(raw), log=lambda *_: None)
    assert seen["ids"] == [1, 14, 27]
    raw["target"]["aux_layer_ids"] = [1, 14, 26]  # the recipe's own taps win
    with pytest.raises(Stop):
        workflows.train_run(recipe_from_dict(raw), tmp_path / "run2", log=lambda *_: None)
    assert seen["ids"] == [1, 14, 26]


# ----------------------------------------------------------------------------- (5) errors


@pytest.mark.parametrize("key,value,needle", [("block_size", 1, "drafter.block_size"),
                                              ("num_anchors", 0, "drafter.num_anchors"),
                                              ("gamma", 0.0, "drafter.gamma")])
def test_bad_config_is_one_clear_error(key, value, needle):
    raw = {"target": {"model": "x"}, "data": {"sources": [{"source": "humaneval"}]},
           "drafter": {"algorithm": "dflash", key: value}}
    with pytest.raises(SpeculatorsError, match=needle):
        recipe_from_dict(raw)


def test_bad_inputs_are_clear_errors():
    target, d = make(block_size=4)
    batch = make_batch(target)
    feats = TargetFeatures(batch.aux[:1], batch.top[:1])
    state = d.start(batch.input_ids[0, :6], feats.slice(0, 5))
    with pytest.raises(SpeculatorsError, match=r"K=4.*block_size 4.*at most 3"):
        d.propose([state], [4])
    with pytest.raises(SpeculatorsError, match="features of 2 positions"):
        d.advance([state], [batch.input_ids[0, 6:9]], [feats.slice(5, 7)])
    with pytest.raises(SpeculatorsError, match="draft_vocab_size"):  # a draft vocab for a full-vocab config
        DFlashDrafter.from_target(DFlashConfig(), target, DraftVocab.from_counts(torch.ones(V), 64))
    with pytest.raises(SpeculatorsError, match="draft_vocab_size"):  # sizes that disagree
        DFlashDrafter.from_target(DFlashConfig(draft_vocab_size=32), target, DraftVocab.from_counts(torch.ones(V), 64))
    with pytest.raises(SpeculatorsError, match="mask_token_id"):
        DFlashDrafter.from_target(DFlashConfig(mask_token_id=V), target, DraftVocab.full(V))
