"""P-EAGLE drafter: the one-forward COD training path equals the inference path element by element,
COD counts and ancestry, the export format, bad input.

Greedy == plain, seeded sampling, save/load round trip, ``propose`` purity and CLI train -> eval are
checked for every family in tests/drafters/test_contracts.py."""

from __future__ import annotations

import json
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch
import yaml

from speculators.drafters import Drafter, registry
from speculators.data.vocab import DraftVocab
from speculators.errors import SpeculatorsError
from speculators.decode.proposal import check_speculative_tokens
from speculators.recipe import recipe_from_dict
from speculators.target import build_tiny_target
from conftest import batch_for

V = 96
N = 64  # draft vocabulary
RECIPES = Path(__file__).resolve().parents[2] / "recipes"


@pytest.fixture(scope="module")
def target():
    return build_tiny_target(vocab_size=V, hidden_size=64, num_layers=4, seed=1)


def make_drafter(target, seed=0, **kw):
    """A P-EAGLE drafter with random (non-zero) weights everywhere, so that every input matters."""
    torch.manual_seed(seed)
    fam = registry.get("peagle")
    cfg = fam.config_class(algorithm="peagle", draft_vocab_size=N, **kw)
    d = fam.from_target(cfg, target, DraftVocab.from_counts(torch.arange(V, 0, -1), N))
    with torch.no_grad():
        for name, p in d.named_parameters():
            if p.requires_grad and "norm" not in name:
                p.normal_(0, 0.2)
    return d


def make_batch(target, lengths=(22, 15, 19), prompt=(4, 2, 6), seed=0):
    """Random token rows (right-padded) with the target's own features; loss on tokens after ``prompt``."""
    g = torch.Generator().manual_seed(seed)
    T = max(lengths)
    ids = torch.randint(0, V, (len(lengths), T), generator=g)
    mask = torch.zeros(len(lengths), T, dtype=torch.bool)
    for i, p in enumerate(prompt):
        mask[i, p:lengths[i]] = True
    batch, _ = batch_for(target, ids, mask, list(lengths))
    return batch


def incremental_state(d, ids: torch.Tensor, aux: torch.Tensor, chunks=(1, 3, 2)):
    """The inference state after tokens ``ids [n+1]`` and features ``aux [1, n, W]``, built as decoding
    builds it: ``start`` on at most the first two positions, then ``advance`` in chunks of 1, 3, 2, ...
    tokens, so the last forward (real inputs + mask slots) runs against a NON-empty cache."""
    n = ids.numel() - 1
    done = min(2, n)
    state = d.start(ids[:done + 1], SimpleNamespace(aux=aux[:, :done]))
    i = 0
    while done < n:
        m = min(chunks[i % len(chunks)], n - done)
        d.advance([state], [ids[done + 1:done + 1 + m]], [SimpleNamespace(aux=aux[:, done:done + m])])
        done, i = done + m, i + 1
    return state


def reference_logits(d, batch, b: int, a: int, depth: int) -> torch.Tensor:
    """Element (a, depth) of row b through the INFERENCE path alone: the tokens x_0..x_{a+1} with the
    features of positions 0..a fed as decoding feeds them (:func:`incremental_state`), then the stored
    drafts of the last step's ONE forward (real inputs + ``num_depths - 1`` mask slots)."""
    state = incremental_state(d, batch.input_ids[b, :a + 2], batch.aux[b:b + 1, :a + 1])
    return d.draft_logits(state, depth + 1)[depth]


def kept_elements(out, plan):
    """``[(b, j, a, d)]``: every kept element of the training forward (row b, slot j, anchor a, depth d)."""
    res = []
    for d, (s, e) in enumerate(out["offsets"]):
        for b, j in (out["exists"][:, s:e]).nonzero().tolist():
            a = int(out["anchor"][b, s + j])
            if plan.kept[d][b, a]:
                res.append((b, s + j, a, d))
    return res


# ----------------------------------------------------------------------------- 1. sparse == dense


def test_one_forward_training_path_equals_the_inference_path_for_every_kept_element(target):
    d = make_drafter(target, num_depths=4, r=0.6, r_min=0.3).double().eval()
    batch = make_batch(target).to("cpu", torch.float64)
    plan = d.cod_plan(batch)
    with torch.no_grad():
        out = d.cod_forward(batch, plan)
    elements = kept_elements(out, plan)
    assert {dd for *_, dd in elements} == {0, 1, 2, 3}  # every depth has kept elements
    assert len(elements) == sum(int(k.sum()) for k in plan.kept)
    for b, j, a, dd in elements:
        torch.testing.assert_close(out["logits"][b, j], reference_logits(d, batch, b, a, dd).to(torch.float32),
                                   atol=1e-5, rtol=0, msg=lambda m: f"element b={b} a={a} d={dd}: {m}")


@pytest.mark.parametrize("leak", ["future", "foreign"])
def test_one_extra_visible_key_breaks_the_equality(target, leak):
    """The check above can fail: let ONE element see one position it must not (the next real position,
    or another chain's mask slot) and its logits no longer match the inference path."""
    d = make_drafter(target, num_depths=3, r=0.8, r_min=0.5).double().eval()
    batch = make_batch(target).to("cpu", torch.float64)
    plan = d.cod_plan(batch)
    with torch.no_grad():
        out = d.cod_forward(batch, plan)
    anchor, depth, exists = out["anchor"], out["depth"], out["exists"]
    b, (s, e) = 0, out["offsets"][1]
    j = s + int(exists[b, s:e].nonzero()[0])  # the first kept depth-1 element of row 0
    a = int(anchor[b, j])
    if leak == "future":
        k = a + 1  # the real position right after the anchor (a depth-0 element, index = position)
        assert exists[b, k] and depth[b, k] == 0
    else:
        k = s + int(exists[b, s:e].nonzero()[1])  # another chain's depth-1 mask slot
        assert anchor[b, k] != a
    assert not _mask_of(d, batch, plan)[b, 0, j, k]  # the real mask hides it

    def hook(mask, elements):
        mask = mask.clone()
        mask[b, 0, j, k] = True
        return mask

    with torch.no_grad():
        leaked = d.cod_forward(batch, plan, mask_hook=hook)["logits"]
    ref = reference_logits(d, batch, b, a, 1).to(torch.float32)
    torch.testing.assert_close(out["logits"][b, j], ref, atol=1e-5, rtol=0)
    assert float((leaked[b, j] - ref).abs().max()) > 1e-3
    others = torch.ones(leaked.shape[:2], dtype=torch.bool)
    others[b] = anchor[b] != a  # chain a's deeper elements see j (2 layers): they change too
    torch.testing.assert_close(leaked[others], out["logits"][others], atol=1e-5, rtol=0)  # nothing else


def _mask_of(d, batch, plan):
    seen = {}

    def grab(mask, elements):
        seen["mask"] = mask
        return mask

    with torch.no_grad():
        d.cod_forward(batch, plan, mask_hook=grab)
    return seen["mask"]


# ----------------------------------------------------------------------------- 2. COD counts


@pytest.mark.parametrize("r,r_min,depths", [(0.7, 0.2, 5), (0.5, 0.3, 4), (0.9, 0.05, 6), (1.0, 1.0, 3)])
def test_cod_keeps_n_max_r_d_r_min_per_depth_among_the_previous_depth(target, r, r_min, depths):
    d = make_drafter(target, num_depths=depths, r=r, r_min=r_min).train()
    batch = make_batch(target, lengths=(60, 41, 55, 30), prompt=(5, 20, 0, 12), seed=3)
    plan = d.cod_plan(batch)
    lm = batch.loss_mask & batch.attention_mask
    anchors = torch.zeros_like(lm)
    anchors[:, :-2] = lm[:, 2:]  # x_{a+2} is a real assistant token
    assert torch.equal(plan.kept[0], anchors)
    n = anchors.sum(1)
    for dd in range(1, depths):
        want = n.double() * max(r ** dd, r_min)
        got = plan.kept[dd].sum(1)
        assert ((got - want).abs() <= 1).all(), (dd, got.tolist(), want.tolist())
        assert not (plan.kept[dd] & ~plan.kept[dd - 1]).any()  # (a, d) kept => (a, d-1) kept
    # the forward holds exactly these elements, and loss_counts counts its loss-valid ones
    with torch.no_grad():
        out = d.cod_forward(batch, plan)
    for dd, (s, e) in enumerate(out["offsets"][1:], start=1):
        assert int(out["exists"][:, s:e].sum()) == int(plan.kept[dd].sum())
    assert d.loss_counts(batch).tolist() == [int((k & v).sum()) for k, v in zip(plan.kept, plan.valid)]


def test_loss_counts_and_the_next_loss_draw_the_same_sample_then_a_new_one(target):
    """The trainer normalises by ``loss_counts`` computed BEFORE the loss: both must see one sample
    (else the window normaliser is wrong); the following epoch draws a new one."""
    d = make_drafter(target, num_depths=4).train()
    batch = make_batch(target, lengths=(60, 41), prompt=(5, 3), seed=4)
    light = make_batch(target, lengths=(60, 41), prompt=(5, 3), seed=4)  # another object, same content
    light.aux, light.top = light.aux[..., :0], light.top[..., :0]  # counts read masks only
    counts = d.loss_counts(light)
    assert torch.equal(counts, d.loss_counts(batch))
    plan = d.cod_plan(light)
    loss, metrics = d.loss(batch, norm=counts)
    assert abs(float(loss.detach()) - d.last_own_loss) < 1e-4 * abs(float(loss.detach()))  # norm == this sample's counts
    assert [metrics[f"kept_{i}"] for i in range(4)] == [float(k.sum()) for k in plan.kept]
    before = [k.clone() for k in d.cod_plan(light).kept]  # what the NEXT loss will use
    d.loss(batch)
    after = d.cod_plan(light).kept
    assert any(not torch.equal(x, y) for x, y in zip(before[1:], after[1:]))  # resampled every epoch
    d.eval()  # held-out evaluation: one fixed sample
    assert torch.equal(d.loss_counts(batch), d.loss_counts(batch))
    d.loss(batch)
    assert all(torch.equal(x, y) for x, y in zip(d.cod_plan(batch).kept, d.cod_plan(light).kept))


def test_loss_is_one_soft_ce_term_per_depth_without_decay(target):
    d = make_drafter(target, num_depths=3).eval()
    batch = make_batch(target, seed=5)
    plan = d.cod_plan(batch)
    loss, metrics = d.loss(batch)
    with torch.no_grad():
        out = d.cod_forward(batch, plan)
        head = target.lm_head_weight.float()[d.draft_ids]
        teacher = torch.softmax(batch.top @ head.T, -1)  # [B, T, N]
    T = batch.input_ids.shape[1]
    total = 0.0
    for dd, (s, e) in enumerate(out["offsets"]):
        num, cnt = 0.0, 0
        for b, j in out["exists"][:, s:e].nonzero().tolist():
            a = int(out["anchor"][b, s + j])
            if plan.valid[dd][b, a] and plan.kept[dd][b, a]:
                assert a + 1 + dd < T
                p = teacher[b, a + 1 + dd]
                num += float(-(p * torch.log_softmax(out["logits"][b, s + j], -1)).sum())
                cnt += 1
        assert cnt == int(d.loss_counts(batch)[dd]) and cnt > 0
        assert metrics[f"loss_{dd}"] == pytest.approx(num / cnt, rel=1e-4)
        total += num / cnt
    assert float(loss.detach()) == pytest.approx(total, rel=1e-4)  # weights 1, 1, 1
    assert {"full_acc_0", "cond_acc_2", "sim_tau"} <= metrics.keys()


# ----------------------------------------------------------------------------- inference


def test_propose_drafts_all_depths_from_one_state_and_refuses_deeper_k(target):
    d = make_drafter(target, num_depths=4).eval()
    batch = make_batch(target, seed=6)
    state = d.start(batch.input_ids[0, :12], SimpleNamespace(aux=batch.aux[:1, :11]))
    logits = d.draft_logits(state, 4)
    p = d._propose_one(state, 4)
    assert p.probs is None and p.token_ids.tolist() == d.draft_ids[logits.argmax(-1)].tolist()
    assert d._propose_one(state, 2).token_ids.tolist() == p.token_ids[:2].tolist()  # prefix-consistent
    with pytest.raises(SpeculatorsError, match=r"num_depths = 4"):  # no silent cap at the trained depth
        d._propose_one(state, 5)
    with pytest.raises(SpeculatorsError, match=r"num_depths = 4"):  # the batched call too
        d.propose([state], [5])
    assert d._propose_one(state, 0).token_ids.numel() == 0
    assert state.cache.length == state.num_positions == 11  # mask slots are never cached


def test_incremental_advance_equals_a_fresh_start(target):
    """Drafts after advancing chunk by chunk (cache non-empty, mask slots in the same forward as the new
    real inputs) equal those of one ``start`` on the whole prefix; the cache holds only real positions."""
    d = make_drafter(target, num_depths=4).eval()
    batch = make_batch(target, seed=8)
    for n in (3, 7, 12, 18):
        ids, aux = batch.input_ids[0, :n + 1], batch.aux[:1, :n]
        inc = incremental_state(d, ids, aux, chunks=(2, 1, 3))
        fresh = d.start(ids, SimpleNamespace(aux=aux))
        # fp32 through chunked vs one-shot matmuls: BLAS picks other kernels (summation orders) for other
        # row counts, ~1e-5 apart on AVX512/AMX CPUs; a wrong position or mask is off by orders more
        torch.testing.assert_close(d.draft_logits(inc, 4), d.draft_logits(fresh, 4), atol=1e-4, rtol=1e-4)
        assert inc.cache.length == inc.num_positions == n


# ----------------------------------------------------------------------------- 3. export


def test_export_config_and_weights_follow_the_peagle_format_and_round_trip(target, tmp_path):
    d = make_drafter(target, num_depths=5, num_layers=3).eval()
    mid = d.cfg.mask_token_id
    assert mid == V - 1  # no tokenizer: the last id
    cfg = d.serving.config(d)
    assert cfg["speculators_model_type"] == "peagle" and cfg["speculators_config"]["algorithm"] == "peagle"
    assert cfg["speculators_config"]["proposal_methods"][0]["speculative_tokens"] == 5
    assert cfg["mask_token_id"] == mid and cfg["embed_requires_grad"] is True
    assert cfg["eagle_aux_hidden_state_layer_ids"] == [i + 1 for i in target.aux_layer_ids]
    assert cfg["draft_vocab_size"] == N and cfg["transformer_layer_config"]["num_hidden_layers"] == 3
    assert d.serving.vllm_serving(cfg)[0] == "eagle3" and d.serving.speculative_tokens(cfg) == 5
    H, n_aux = target.hidden_size, len(target.aux_layer_ids)
    sd = d.serving.state_dict(d)
    assert "mask_embedding" not in sd
    assert sd["mask_hidden"].shape == (1, 1, n_aux * H)
    assert sd["fc.weight"].shape == (H, n_aux * H)
    assert sd["layers.0.self_attn.q_proj.weight"].shape[1] == 2 * H
    assert "layers.0.hidden_norm.weight" in sd and "layers.2.mlp.down_proj.weight" in sd
    assert sd["lm_head.weight"].shape == (N, H) and sd["d2t"].dtype == torch.int64 and sd["t2d"].numel() == V
    emb = target.embed_tokens.weight.float()
    assert torch.equal(sd["embed_tokens.weight"][mid], d.mask_embedding.detach())  # the learned row
    assert not torch.equal(sd["embed_tokens.weight"][mid], emb[mid])
    assert torch.equal(sd["embed_tokens.weight"][:mid], emb[:mid])  # every other row: the target's
    # the drafter embeds EVERY occurrence of mask_token_id with the learned row, as vLLM's table does
    assert torch.equal(d.embed(torch.tensor([mid, 3]))[0], d.mask_embedding.detach())
    assert torch.equal(d.embed(torch.tensor([mid, 3]))[1], emb[3])
    # round trip
    path = d.save_pretrained(tmp_path / "ckpt")
    on_disk = json.loads((path / "config.json").read_text())
    assert {k: on_disk[k] for k in cfg} == json.loads(json.dumps(cfg))
    loaded = Drafter.from_pretrained(path)
    assert loaded.cfg == d.cfg and torch.equal(loaded.mask_embedding, d.mask_embedding)
    assert torch.equal(loaded.mask_hidden, d.mask_hidden)
    batch = make_batch(target, seed=7)
    sa = d.start(batch.input_ids[1, :10], SimpleNamespace(aux=batch.aux[1:2, :9]))
    sb = loaded.start(batch.input_ids[1, :10], SimpleNamespace(aux=batch.aux[1:2, :9]))
    assert torch.equal(d.draft_logits(sa, 5), loaded.draft_logits(sb, 5))


# ----------------------------------------------------------------------------- 4. errors


def _tiny_recipe(**drafter):
    raw = yaml.safe_load((RECIPES / "tiny-peagle.yaml").read_text())
    raw["drafter"].update(drafter)
    return raw


@pytest.mark.parametrize("field,value", [("r", 0), ("r", 1.5), ("r_min", 0.0), ("r_min", -0.1),
                                         ("r", "x"), ("num_depths", 0)])
def test_bad_cod_settings_are_one_clear_error(field, value):
    with pytest.raises(SpeculatorsError, match=rf"drafter\.{field}"):
        recipe_from_dict(_tiny_recipe(**{field: value}), "tiny-peagle.yaml")


def test_the_tiny_recipe_is_valid():
    rec = recipe_from_dict(_tiny_recipe(), "tiny-peagle.yaml")
    assert rec.drafter.algorithm == "peagle"
    for name in ("smollm2-peagle.yaml",):  # the SmolLM2 recipe reuses the EAGLE-3 demo's data exactly
        raw = yaml.safe_load((RECIPES / name).read_text())
        base = yaml.safe_load((RECIPES / "smollm2-eagle3.yaml").read_text())
        assert raw["target"] == base["target"] and raw["data"] == base["data"]
        assert recipe_from_dict(raw, name).drafter.num_depths == 4


def test_k_deeper_than_the_trained_depth_is_refused(target):
    d = make_drafter(target, num_depths=3).eval()
    batch = make_batch(target, seed=8)
    state = d.start(batch.input_ids[0, :8], SimpleNamespace(aux=batch.aux[:1, :7]))
    with pytest.raises(SpeculatorsError, match=r"k=4.*num_depths = 3"):
        d.draft_logits(state, 4)
    with pytest.raises(SpeculatorsError, match=r"num_depths = 3"):
        check_speculative_tokens(d, 4)
    check_speculative_tokens(d, 3)  # the trained depth itself is allowed
    assert d.draft_logits(state, 3).shape[0] == 3


def test_a_mask_token_outside_the_vocabulary_is_refused(target):
    fam = registry.get("peagle")
    with pytest.raises(SpeculatorsError, match=r"drafter\.mask_token_id: 96 .*0\.\.95"):
        fam.from_target(fam.config_class(algorithm="peagle", mask_token_id=V), target, DraftVocab.full(V))


def test_advance_refuses_features_that_do_not_match_the_tokens(target):
    d = make_drafter(target).eval()
    batch = make_batch(target, seed=9)
    state = d.start(batch.input_ids[0, :8], SimpleNamespace(aux=batch.aux[:1, :7]))
    with pytest.raises(SpeculatorsError, match=r"features\.aux: expected .* 2 positions"):
        d._advance_one(state, batch.input_ids[0, 8:10], SimpleNamespace(aux=batch.aux[:1, 7:8]))
