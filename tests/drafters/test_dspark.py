"""DSpark's own maths (the protocol contracts run in tests/drafters/test_contracts.py): the Markov correction at
inference against a hand computation, the detached confidence label, the loss by hand, the one-forward
training path against each block alone through the inference path, export, calibrated confidences and
the config errors."""

from __future__ import annotations

import json
import math

import pytest
import torch

from speculators.drafters import Drafter
from speculators.data.vocab import DraftVocab
from speculators.drafters import dspark as dspark_module
from speculators.drafters.dspark import DSparkConfig, DSparkDrafter, calibrated_confidences
from speculators.errors import SpeculatorsError
from speculators.recipe import recipe_from_dict
from speculators.target import TargetFeatures, build_tiny_target
from speculators.verify import SamplingParams
from conftest import batch_for

V, HIDDEN, LAYERS = 128, 32, 2
BS, RANK = 4, 8


def make(block_size: int = BS, vocab: int | None = None, seed: int = 0, counts: torch.Tensor | None = None,
         **kw) -> tuple:
    """(target, drafter) in eval mode with randomised norms and a NON-zero Markov W2 (fresh heads start
    at zero, which would hide the correction). ``counts``: token counts the reduced draft vocabulary is
    built from (default: descending by id, so the draft ids are the lowest ``vocab`` target ids)."""
    target = build_tiny_target(vocab_size=V, hidden_size=HIDDEN, num_layers=LAYERS, seed=1)
    torch.manual_seed(seed)
    kw.setdefault("markov_rank", RANK)
    cfg = DSparkConfig(block_size=block_size, num_layers=2, num_anchors=64, draft_vocab_size=vocab, **kw)
    counts = torch.arange(V, 0, -1) if counts is None else counts
    dv = DraftVocab.full(V) if vocab is None else DraftVocab.from_counts(counts, vocab)
    d = DSparkDrafter.from_target(cfg, target, dv)
    with torch.no_grad():
        for n, p in d.named_parameters():
            if n.endswith("norm.weight"):
                p.copy_(1.0 + 0.3 * torch.randn(p.shape))
        d.markov_head.markov_w2.weight.copy_(torch.randn(d.markov_head.markov_w2.weight.shape))
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


def state_at(d, batch, b: int, a: int):
    """The inference state of row ``b`` anchored at ``a``: ``x_0..x_a`` and the features of ``0..a-1``."""
    feats = TargetFeatures(batch.aux[b:b + 1], batch.top[b:b + 1])
    return d.start(batch.input_ids[b, :a + 1], feats.slice(0, a))


def draft_ids(d) -> torch.Tensor:
    return d.draft_ids if d.reduced_vocab else torch.arange(V)


# ----------------------------------------------------------------------------- Markov head at inference


@pytest.mark.parametrize("vocab", [None, 48])
def test_markov_correction_at_inference_equals_hand_computation(vocab):
    target, d = make(vocab=vocab)
    with torch.no_grad():  # a correction large enough to change the argmax chain
        d.markov_head.markov_w2.weight.mul_(20.0)
    torch.set_grad_enabled(False)
    try:
        _check_markov_at_inference(d, make_batch(target))
    finally:
        torch.set_grad_enabled(True)


def _check_markov_at_inference(d, batch):
    state = state_at(d, batch, 0, 9)
    h = d.block_hidden(state)  # [Bs, H]
    w1, w2 = d.markov_head.markov_w1.weight, d.markov_head.markov_w2.weight
    proj = d.confidence_head.proj
    ids = draft_ids(d)
    # one chosen previous token: logits = head(h_0) + W2 @ W1[prev], by hand
    prev = 77
    hand = d.head(h[0]).float() + w2 @ w1[prev]
    logits, conf = d.corrected_logits(h[:1], torch.tensor([prev]))
    torch.testing.assert_close(logits[0], hand, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(conf[0], proj.weight[0] @ torch.cat([h[0], w1[prev]]) + proj.bias[0])
    other, _ = d.corrected_logits(h[:1], torch.tensor([3]))
    assert (other[0] - logits[0]).abs().max() > 1e-2  # the previous token matters
    # greedy proposal: x_{-1} = anchor, then each step feeds the draft it just took
    p = d.propose([state], [BS])[0]
    x, toks, confs = int(state.last_id), [], []
    for j in range(BS):
        z = d.head(h[j]).float() + w2 @ w1[x]
        confs.append(float(proj.weight[0] @ torch.cat([h[j], w1[x]]) + proj.bias[0]))
        x = int(ids[int(z.argmax())])
        toks.append(x)
    assert p.token_ids.tolist() == toks and p.probs is None
    assert p.confidence_logits.dtype == torch.float32
    torch.testing.assert_close(p.confidence_logits, torch.tensor(confs), atol=1e-5, rtol=1e-5)
    # without the correction the chain would differ somewhere (the test can see the Markov head)
    plain = [int(ids[int(i)]) for i in d.head(h).float().argmax(-1)]
    assert plain != toks
    # sampled: row j of probs is softmax(head(h_j) + W2 W1[x_{j-1}]) with x_{j-1} the SAMPLED draft
    sp = SamplingParams.uniform(1, temperature=1.0, top_k=0, top_p=1.0)
    q = d.propose([state], [BS], sp, [torch.Generator().manual_seed(3)])[0]
    prev_ids = [int(state.last_id)] + q.token_ids.tolist()[:-1]
    for j in range(BS):
        expect = torch.zeros(V)
        expect[ids] = torch.softmax(d.head(h[j]).float() + w2 @ w1[prev_ids[j]], -1)
        torch.testing.assert_close(q.probs[j], expect, atol=1e-6, rtol=1e-5)
    assert q.token_ids.shape == (BS,) and q.confidence_logits.shape == (BS,)


def test_propose_bounds_and_no_trace():
    target, d = make()
    batch = make_batch(target)
    state = state_at(d, batch, 0, 8)
    k_before = [t.clone() for t in state.cache.k]
    d.propose([state], [BS])
    d.propose([state], [2])
    assert all(torch.equal(a, b) for a, b in zip(k_before, state.cache.k)) and state.num_positions == 8
    assert d.propose([state], [0])[0].token_ids.numel() == 0
    assert d.max_speculative_tokens == BS
    with pytest.raises(SpeculatorsError, match=rf"K={BS + 1}.*block_size {BS}.*at most {BS}"):
        d.propose([state], [BS + 1])


def test_k_below_the_block_runs_vllms_shrunken_block():
    """Served with K < block_size, vLLM's DSpark proposer (``sample_from_anchor``) runs a block of K slots
    (anchor + K-1 masks); the block is bidirectional, so a K-draft proposal is the K-slot block's forward
    followed by the Markov chain, not the first K slots of the full block."""
    target, d = make(block_size=8)
    batch = make_batch(target)
    state = state_at(d, batch, 0, 9)
    w1, w2 = d.markov_head.markov_w1.weight, d.markov_head.markov_w2.weight
    sp = SamplingParams.uniform(1, temperature=1.0)
    with torch.no_grad():
        full = d.block_hidden(state)  # [8, H]
        for k in (1, 3, 5):
            shrunk = d.block_hidden(state, k)  # [k, H]
            q = d.propose([state], [k], sp, [torch.Generator().manual_seed(k)])[0]
            prev = [int(state.last_id)] + q.token_ids.tolist()[:-1]
            expect = torch.stack([torch.softmax(d.head(shrunk[j]).float() + w2 @ w1[prev[j]], -1) for j in range(k)])
            torch.testing.assert_close(q.probs, expect, atol=1e-6, rtol=1e-5)
            assert (d.head(shrunk).float() - d.head(full[:k]).float()).abs().max() > 1e-2  # not the truncation
            conf = torch.stack([d.confidence_head.proj.weight[0] @ torch.cat([shrunk[j], w1[prev[j]]])
                                + d.confidence_head.proj.bias[0] for j in range(k)])
            torch.testing.assert_close(q.confidence_logits, conf, atol=1e-5, rtol=1e-5)


# ----------------------------------------------------------------------------- training path == inference path


@pytest.mark.parametrize("vocab", [None, 48])
def test_one_forward_training_equals_each_block_through_the_inference_path(vocab):
    target, d = make(vocab=vocab)
    batch = make_batch(target)
    anchors = torch.tensor([[0, 5, 9, 16, 19], [0, 3, 7, 11, 12]])  # incl. empty context, blocks past the end
    T = batch.input_ids.shape[1]
    with torch.no_grad():
        prev, _ = d.teacher_forced_prev(batch, anchors)
        sparse, sconf = d.corrected_logits(d.slot_logits(batch, anchors), prev)  # [B, A, Bs, N], [B, A, Bs]
    for b in range(2):
        for i, a in enumerate(anchors[b].tolist()):
            state = state_at(d, batch, b, a)
            n = min(BS, T - a)  # slots whose previous token x_{a+k} exists
            hand_prev = batch.input_ids[b, a:a + n]  # x_{-1} = anchor, then the data tokens
            dense, dconf = d.corrected_logits(d.block_hidden(state)[:n], hand_prev)
            torch.testing.assert_close(sparse[b, i, :n], dense, atol=1e-5, rtol=1e-5, msg=f"row {b} anchor {a}")
            torch.testing.assert_close(sconf[b, i, :n], dconf, atol=1e-5, rtol=1e-5)


# ----------------------------------------------------------------------------- loss


def fixed_anchors(d, monkeypatch):
    anchors = torch.tensor([[4, 10, 16, 18], [5, 9, 11, 4]])
    ok = torch.tensor([[True, True, True, True], [True, True, True, False]])
    monkeypatch.setattr(d, "_anchors", lambda b, for_counts: (anchors, ok))
    return anchors, ok


@pytest.mark.parametrize("vocab,labels,conf_label", [(None, "token", "tv"), (100, "argmax", "tv"),
                                                     (100, "token", "tv"), (100, "argmax", "greedy"),
                                                     (None, "token", "greedy")])
def test_loss_by_hand(vocab, labels, conf_label, monkeypatch):
    weights = dict(ce_weight=0.3, l1_weight=0.5, bce_weight=0.7, position_decay=2.5)
    # greedy: a scattered draft vocabulary, so that draft index != target id (to_target_ids is exercised)
    counts = torch.randperm(V, generator=torch.Generator().manual_seed(3)) + 1 if conf_label == "greedy" else None
    target, d = make(vocab=vocab, labels=labels, confidence_label=conf_label, counts=counts, **weights)
    if vocab and conf_label == "greedy":
        assert not torch.equal(d.draft_ids, torch.arange(vocab))
    batch = make_batch(target)
    anchors, ok = fixed_anchors(d, monkeypatch)
    with torch.no_grad():
        h = d.slot_logits(batch, anchors)
    T = batch.input_ids.shape[1]
    lm = batch.loss_mask & batch.attention_mask
    w1, w2 = d.markov_head.markov_w1.weight.detach(), d.markov_head.markov_w2.weight.detach()
    proj = d.confidence_head.proj
    ids = draft_ids(d)
    t2d = d.t2d if vocab else torch.ones(V, dtype=torch.bool)
    rank = torch.cumsum(t2d.long(), 0) - 1
    head_w = target.lm_head_weight.detach().float()[ids]  # the target's rows of the draft vocabulary
    sums, counts, hits = [0.0] * BS, [0] * BS, [0, 0]
    if conf_label == "greedy":
        # a random drafter's top-1 rarely is the target's greedy token: make it so at every other slot (the
        # hand computation below and the loss both read the edited batch.argmax)
        for b in range(2):
            for i in range(4):
                a = int(anchors[b, i])
                for k in range(0, BS, 2):
                    if a + k < T and ok[b, i]:
                        x_prev = int(batch.input_ids[b, a + k])
                        z = d.head(h[b, i, k]).float().detach() + w2 @ w1[x_prev]
                        batch.argmax[b, a + k] = int(ids[int(z.argmax())])
    for b in range(2):
        for i in range(4):
            a = int(anchors[b, i])
            for k in range(BS):
                p = a + k + 1  # slot k predicts x_{a+k+1}
                if not ok[b, i] or p >= T or not lm[b, p]:
                    continue
                label = int(batch.input_ids[b, p]) if labels == "token" else int(batch.argmax[b, p - 1])
                if not t2d[label]:
                    continue
                x_prev = int(batch.input_ids[b, a + k])
                z = d.head(h[b, i, k]).float().detach() + w2 @ w1[x_prev]
                pd = torch.softmax(z, -1)
                pt = torch.softmax(batch.top[b, a + k].float() @ head_w.T, -1)
                l1 = float((pd - pt).abs().sum())
                ce = float(-torch.log_softmax(z, -1)[int(rank[label])])
                c = torch.sigmoid(proj.weight[0] @ torch.cat([h[b, i, k], w1[x_prev]]) + proj.bias[0])
                # tv: the detached 1 - TV; greedy: 1 when the top-1 draft is the target's greedy token at a + k
                y = 1 - 0.5 * l1 if conf_label == "tv" else float(int(ids[int(z.argmax())]) == int(batch.argmax[b, a + k]))
                if conf_label == "greedy":
                    hits[int(y)] += 1
                bce = float(-(y * torch.log(c) + (1 - y) * torch.log(1 - c)).detach())
                sums[k] += 0.3 * ce + 0.5 * l1 + 0.7 * bce
                counts[k] += 1
    assert min(counts) > 0
    if conf_label == "greedy":  # both label values occur (the pre-pass planted matches)
        assert min(hits) > 0, hits
    w = [math.exp(-k / 2.5) for k in range(BS)]
    assert d.slot_weights() == pytest.approx(w)
    assert d.loss_counts(batch).tolist() == counts
    loss, metrics = d.loss(batch)
    assert float(loss.detach()) == pytest.approx(sum(wk * s / c for wk, s, c in zip(w, sums, counts)), rel=1e-5)
    for j in range(BS):
        assert metrics[f"loss_{j}"] == pytest.approx(sums[j] / counts[j], rel=1e-5)
    norm = torch.tensor([10, 20, 40, 80])  # window normalisation: term k divided by norm[k]
    loss_w, _ = d.loss(batch, norm)
    assert float(loss_w.detach()) == pytest.approx(sum(wk * s / n for wk, s, n in zip(w, sums, norm.tolist())),
                                                   rel=1e-5)
    assert {"ce_0", "l1_3", "bce_1", "conf_0", "full_acc_0", "cond_acc_3", "sim_tau"} <= metrics.keys()


def test_confidence_label_is_detached(monkeypatch):
    """W2 only moves the draft logits, never the confidence logit: so with a DETACHED label the BCE term
    gives W2 no gradient (grad(W2) with bce_weight 1 == with bce_weight 0), while it does train the
    confidence head and the backbone. A label that is not detached changes W2's gradient."""
    target, d = make(vocab=48)
    batch = make_batch(target)
    fixed_anchors(d, monkeypatch)
    d.train()

    def grads(bce_weight):
        d.cfg = d.cfg.model_copy(update={"bce_weight": bce_weight})
        d.zero_grad()
        d.loss(batch)[0].backward()
        return {n: p.grad.clone() for n, p in d.named_parameters() if p.grad is not None}

    with_bce, without = grads(1.0), grads(0.0)
    torch.testing.assert_close(with_bce["markov_head.markov_w2.weight"], without["markov_head.markov_w2.weight"],
                               atol=1e-7, rtol=1e-6)
    assert with_bce["confidence_head.proj.weight"].abs().sum() > 0
    assert "confidence_head.proj.weight" not in without or without["confidence_head.proj.weight"].abs().sum() == 0
    assert (with_bce["fc.weight"] - without["fc.weight"]).abs().max() > 1e-6  # BCE trains the backbone
    # the same check sees a leaking label
    monkeypatch.setattr(dspark_module, "confidence_label", lambda l1: (1.0 - 0.5 * l1).clamp(0.0, 1.0))
    leaky = grads(1.0)
    assert (leaky["markov_head.markov_w2.weight"] - without["markov_head.markov_w2.weight"]).abs().max() > 1e-6


def test_loss_backward_reaches_every_trained_weight_and_not_the_frozen_ones():
    target, d = make(vocab=48)
    d.train()
    loss, _ = d.loss(make_batch(target))
    loss.backward()
    for n, p in d.named_parameters():
        if p.requires_grad:
            assert p.grad is not None and p.grad.abs().sum() > 0, n
    assert not d.lm_head.weight.requires_grad and d.lm_head.weight.grad is None


def test_fresh_markov_head_is_the_backbone():
    """W2 starts at zero: a fresh drafter's corrected logits are the backbone's."""
    target = build_tiny_target(vocab_size=V, hidden_size=HIDDEN, num_layers=LAYERS, seed=1)
    d = DSparkDrafter.from_target(DSparkConfig(block_size=BS, markov_rank=RANK), target, DraftVocab.full(V))
    h = torch.randn(3, HIDDEN)
    logits, _ = d.corrected_logits(h, torch.tensor([1, 2, 3]))
    torch.testing.assert_close(logits, d.head(h).float())
    assert torch.equal(d.confidence_temperature, torch.ones(BS)) and torch.equal(d.confidence_bias, torch.zeros(BS))


# ----------------------------------------------------------------------------- confidences


def test_calibrated_confidences():
    logits = torch.tensor([2.0, -1.0, 0.5])
    temp = torch.tensor([2.0, 0.5, 1.0, 3.0])
    expect = torch.sigmoid(torch.tensor([1.0, -2.0, 0.5]))
    torch.testing.assert_close(calibrated_confidences(logits, temp), expect)
    target, d = make()
    state = state_at(d, make_batch(target), 0, 8)
    p = d.propose([state], [3])[0]
    with torch.no_grad():
        d.confidence_temperature.copy_(temp)
    torch.testing.assert_close(d.confidences(p), torch.sigmoid(p.confidence_logits / temp[:3]))
    shift = torch.tensor([0.5, -1.0, 2.0, 0.0])  # Platt: sigmoid(z / T + b)
    torch.testing.assert_close(calibrated_confidences(logits, temp, shift),
                               torch.sigmoid(torch.tensor([1.5, -3.0, 2.5])))
    with torch.no_grad():
        d.confidence_bias.copy_(shift)
    torch.testing.assert_close(d.confidences(p), torch.sigmoid(p.confidence_logits / temp[:3] + shift[:3]))
    with pytest.raises(SpeculatorsError, match="shifts"):
        calibrated_confidences(logits, temp, torch.zeros(2))
    with pytest.raises(SpeculatorsError, match="temperatures"):
        calibrated_confidences(logits, torch.ones(2))
    with pytest.raises(SpeculatorsError, match="> 0"):
        calibrated_confidences(logits, torch.tensor([1.0, 0.0, 1.0]))


# ----------------------------------------------------------------------------- export


@pytest.mark.parametrize("vocab,with_markov", [(None, True), (48, True), (48, False)])
def test_export_config_weights_and_round_trip(vocab, with_markov, tmp_path):
    target, d = make(block_size=8, vocab=vocab, mask_token_id=5, confidence_head_with_markov=with_markov)
    with torch.no_grad():
        d.confidence_temperature.copy_(torch.linspace(0.5, 2.0, 8))  # as a calibration would leave it
        d.confidence_bias.copy_(torch.linspace(-1.0, 0.4, 8))
    cfg = d.serving.config(d)
    assert cfg["speculators_model_type"] == "dspark" and cfg["architectures"] == ["DSparkDraftModel"]
    assert cfg["sample_from_anchor"] is True and cfg["block_size"] == 8 and cfg["mask_token_id"] == 5
    assert cfg["markov_rank"] == RANK and cfg["markov_head_type"] == "vanilla"
    assert cfg["enable_confidence_head"] is True and cfg["confidence_head_with_markov"] is with_markov
    assert cfg["speculators_config"]["algorithm"] == "dspark"
    assert cfg["speculators_config"]["proposal_methods"][0]["speculative_tokens"] == 8
    assert DSparkDrafter.serving.speculative_tokens(cfg) == 8 and DSparkDrafter.serving.speculative_tokens({"block_size": 8}) == 8
    assert cfg["aux_hidden_state_layer_ids"] == [i + 1 for i in target.aux_layer_ids]
    assert cfg["draft_vocab_size"] == (vocab or V) and cfg["transformer_layer_config"]["model_type"] == "qwen3"
    sd = d.serving.state_dict(d)
    N = vocab or V
    shapes = {"markov_head.markov_w1.weight": (V, RANK), "markov_head.markov_w2.weight": (N, RANK),
              "confidence_head.proj.weight": (1, HIDDEN + (RANK if with_markov else 0)),
              "confidence_head.proj.bias": (1,),
              "fc.weight": (HIDDEN, len(target.aux_layer_ids) * HIDDEN), "hidden_norm.weight": (HIDDEN,),
              "norm.weight": (HIDDEN,)}
    for name, shape in shapes.items():
        assert tuple(sd[name].shape) == shape, name
    assert ("lm_head.weight" in sd) == bool(vocab) and not any("mask_hidden" in n or "embed_tokens" in n for n in sd)
    assert not any(n.startswith("confidence_temperature") or n.startswith("confidence_bias") for n in sd)
    path = d.save_pretrained(tmp_path / "ckpt")
    from safetensors.torch import load_file

    assert set(load_file(str(path / "model.safetensors"))) == set(sd)  # only what vLLM's DSpark loader places
    block = json.loads((path / "config.json").read_text())["speculators_training"]
    assert block["confidence_calibration"] == {"temperature": torch.linspace(0.5, 2.0, 8).tolist(),
                                               "bias": torch.linspace(-1.0, 0.4, 8).tolist()}
    loaded = Drafter.from_pretrained(path)
    assert isinstance(loaded, DSparkDrafter) and loaded.cfg == d.cfg
    assert all(torch.equal(a, b) for a, b in zip(loaded.confidence_calibration(), d.confidence_calibration()))
    for k, v in d.serving.state_dict(d).items():
        assert torch.equal(v, loaded.serving.state_dict(loaded)[k]), k
    loaded.attach_target(target)
    batch = make_batch(target)
    sa, sb = state_at(d, batch, 0, 11), state_at(loaded, batch, 0, 11)
    pa, pb = d.propose([sa], [8])[0], loaded.propose([sb], [8])[0]
    assert pa.token_ids.tolist() == pb.token_ids.tolist()
    torch.testing.assert_close(loaded.confidences(pb), d.confidences(pa))


def _old_layout(path, temperature, bias=None):
    """Rewrite checkpoint ``path`` as an earlier version wrote it: the calibration tensors in
    ``model.safetensors`` (``bias`` None: a checkpoint from before the shifts) and none in ``config.json``."""
    from safetensors.torch import load_file, save_file

    sd = load_file(str(path / "model.safetensors"))
    sd["confidence_temperature"] = temperature
    if bias is not None:
        sd["confidence_bias"] = bias
    save_file(sd, str(path / "model.safetensors"), metadata={"format": "pt"})
    cfg = json.loads((path / "config.json").read_text())
    del cfg["speculators_training"]["confidence_calibration"]
    (path / "config.json").write_text(json.dumps(cfg))
    return sd


@pytest.mark.parametrize("with_bias", [True, False])
def test_an_old_checkpoint_with_the_calibration_in_its_weights_loads_and_calibrate_moves_it(with_bias, tmp_path):
    """Earlier versions wrote ``confidence_temperature`` (and later ``confidence_bias``) into
    ``model.safetensors``: such a checkpoint loads with its calibration (no shifts: every shift 0), and
    ``store_temperatures`` writes the new calibration to ``config.json`` and the weights file without them."""
    from safetensors.torch import load_file

    from speculators.calibration import store_temperatures

    _, d = make()
    path = d.save_pretrained(tmp_path / "old")
    T0, b0 = torch.tensor([0.7, 1.2, 1.9, 3.1]), torch.tensor([0.25, -0.5, 0.0, 1.0])
    sd = _old_layout(path, T0, b0 if with_bias else None)
    loaded = Drafter.from_pretrained(path)
    assert torch.equal(loaded.confidence_temperature, T0)
    assert torch.equal(loaded.confidence_bias, b0 if with_bias else torch.zeros(4))
    T, b = torch.tensor([1.5, 1.0, 2.0, 0.5]), torch.tensor([-0.25, 0.5, 0.0, 1.0])
    store_temperatures(path, T, b)
    stored = load_file(str(path / "model.safetensors"))
    assert set(stored) == set(sd) - {"confidence_temperature", "confidence_bias"}
    assert all(torch.equal(stored[k], sd[k]) for k in stored)  # every other tensor as it was
    block = json.loads((path / "config.json").read_text())["speculators_training"]
    assert block["confidence_calibration"] == {"temperature": T.tolist(), "bias": b.tolist()}
    recal = Drafter.from_pretrained(path)
    assert torch.equal(recal.confidence_temperature, T) and torch.equal(recal.confidence_bias, b)
    store_temperatures(path, T)  # temperature-only: the shifts become 0
    assert torch.equal(Drafter.from_pretrained(path).confidence_bias, torch.zeros(4))
    with pytest.raises(SpeculatorsError, match="confidence_bias must be"):
        store_temperatures(path, T, torch.tensor([0.0, float("inf"), 0.0, 0.0]))
    with pytest.raises(SpeculatorsError, match="confidence_temperature must be"):
        store_temperatures(path, torch.tensor([1.0, 0.0, 1.0, 1.0]))
    with pytest.raises(SpeculatorsError, match="confidence_temperature must be"):
        store_temperatures(path, torch.ones(3))
    assert torch.equal(Drafter.from_pretrained(path).confidence_temperature, T)  # refused: nothing written


def test_the_writer_refuses_calibration_tensors_in_the_weights_file(tmp_path):
    """A family declares its training-side state; the checkpoint writer refuses to put it in
    ``model.safetensors`` (vLLM's loader would refuse the file)."""
    _, d = make()
    sd = d.serving.state_dict(d)

    class Leaky(type(d.serving)):  # a format that would write the calibration into the weights
        def state_dict(self, drafter):
            return {**sd, "confidence_temperature": torch.ones(BS)}

    d.serving = Leaky()
    with pytest.raises(SpeculatorsError, match=r"confidence_temperature.*training-side state.*may not be written"):
        d.save_pretrained(tmp_path / "bad")
    assert not (tmp_path / "bad").exists()


def test_a_bad_calibration_entry_is_one_clear_error(tmp_path):
    _, d = make()
    path = d.save_pretrained(tmp_path / "ck")
    cfg = json.loads((path / "config.json").read_text())
    cfg["speculators_training"]["confidence_calibration"] = {"temperature": [1.0, -1.0, 1.0, 1.0], "bias": [0.0] * 4}
    (path / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(SpeculatorsError, match=r"config.json.*confidence_calibration.*confidence_temperature must be"):
        Drafter.from_pretrained(path)


def test_bf16_checkpoint_keeps_the_calibration_exact(tmp_path):
    """A published (train.save_dtype: bfloat16) checkpoint casts the weights; the calibration lives in
    config.json as float32 values (bf16 would round a fitted T such as 1.2345 to 1.234375)."""
    from safetensors.torch import load_file

    from speculators.drafters.checkpoint import save_pretrained

    _, d = make()
    temp, shift = torch.tensor([0.7031, 1.2345, 1.9999, 3.1416]), torch.tensor([-0.1234, 0.5678, 1.0001, -2.3456])
    d.set_confidence_calibration(temp, shift)
    path = save_pretrained(d, tmp_path / "final", dtype="bfloat16", frozen_copies=False)
    sd = load_file(str(path / "model.safetensors"))
    assert sd["fc.weight"].dtype == torch.bfloat16 and "confidence_temperature" not in sd
    reloaded = Drafter.from_pretrained(path)
    assert torch.equal(reloaded.confidence_temperature, temp) and torch.equal(reloaded.confidence_bias, shift)


def test_without_confidence_head():
    target, d = make(enable_confidence_head=False)
    assert not any(n.startswith("confidence") for n in d.serving.state_dict(d))
    state = state_at(d, make_batch(target), 0, 8)
    p = d.propose([state], [3])[0]
    assert p.confidence_logits is None and d.confidences(p) is None
    d.train()
    _, metrics = d.loss(make_batch(target))
    assert "bce_0" not in metrics and "ce_0" in metrics


# ----------------------------------------------------------------------------- errors


@pytest.mark.parametrize("key,value,needle", [
    ("markov_rank", 0, r"drafter\.markov_rank.*rank >= 1"),
    ("markov_head_type", "gated", r"drafter\.markov_head_type.*'gated' is not implemented; allowed: vanilla"),
    ("markov_head_type", "rnn", r"drafter\.markov_head_type.*not implemented"),
    ("markov_head_type", "lstm", r"drafter\.markov_head_type.*unknown; allowed: vanilla"),
    ("position_decay", 0.0, r"drafter\.position_decay"),
    ("bce_weight", -1.0, r"drafter\.bce_weight"),
    ("block_size", 1, r"drafter\.block_size"),
    ("confidence_label", "soft", r"drafter\.confidence_label.*'tv' or 'greedy'"),
])
def test_bad_config_is_one_clear_error(key, value, needle):
    raw = {"target": {"model": "x"}, "data": {"sources": [{"source": "humaneval"}]},
           "drafter": {"algorithm": "dspark", key: value}}
    with pytest.raises(SpeculatorsError, match=needle):
        recipe_from_dict(raw)


def test_no_draft_loss_is_an_error():
    raw = {"target": {"model": "x"}, "data": {"sources": [{"source": "humaneval"}]},
           "drafter": {"algorithm": "dspark", "ce_weight": 0.0, "l1_weight": 0.0}}
    with pytest.raises(SpeculatorsError, match="ce_weight and l1_weight are both 0"):
        recipe_from_dict(raw)
    with pytest.raises(SpeculatorsError, match="draft_vocab_size"):
        target = build_tiny_target(vocab_size=V, hidden_size=HIDDEN, num_layers=LAYERS, seed=1)
        DSparkDrafter.from_target(DSparkConfig(), target, DraftVocab.from_counts(torch.ones(V), 64))
