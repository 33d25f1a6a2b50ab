"""EAGLE-3 drafter: TTT/inference consistency, label shift, metrics, export format.

Greedy == plain, seeded sampling, save/load round trip, ``propose`` purity and CLI train -> eval are
checked for every family in tests/drafters/test_contracts.py."""

from __future__ import annotations

import json

import pytest
import torch

from speculators.data.vocab import DraftVocab
from speculators.drafters import registry
from speculators.decode.loop import plain_decode, speculative_decode
from speculators.decode.proposers import NGramProposer
from speculators.target import build_tiny_target
from speculators.verify import SamplingParams
from conftest import batch_for

V = 96


@pytest.fixture(scope="module")
def target():
    return build_tiny_target(vocab_size=V, hidden_size=64, num_layers=4, seed=1)


def make_drafter(target, ttt_steps=3, vocab_size=None, seed=0, **kw):
    torch.manual_seed(seed)
    cfg = registry.get("eagle3").config_class(algorithm="eagle3", ttt_steps=ttt_steps,
                                              draft_vocab_size=vocab_size, **kw)
    counts = torch.arange(V, 0, -1)  # lower ids more frequent
    d = registry.get("eagle3").from_target(cfg, target, DraftVocab.from_counts(counts, vocab_size))
    # random (non-zero) weights everywhere so that every input matters
    with torch.no_grad():
        for name, p in d.named_parameters():
            if p.requires_grad and "norm" not in name:
                p.normal_(0, 0.2)
    return d



def capture_step_logits(drafter, batch):
    """Run drafter.loss with the output head on every row (``labelled_rows_only = False``; the selection is
    compared with it in :func:`test_labelled_rows_only_gives_the_same_loss_metrics_and_gradients`) and capture
    the lm_head output ``[B, T, N]`` of every TTT step."""
    seen = []
    h = drafter.lm_head.register_forward_hook(lambda m, i, o: seen.append(o.detach().float()))
    drafter.labelled_rows_only = False
    try:
        loss, metrics = drafter.loss(batch)
    finally:
        h.remove()
        del drafter.labelled_rows_only
    return loss, metrics, seen


@pytest.mark.parametrize("eagle31,nbr", [(False, False), (True, False), (True, True), (False, True)])
def test_ttt_steps_match_inference_chain(target, eagle31, nbr):
    """Step j of training at index t must compute exactly what inference computes for draft j+1.

    Fails if the token shift, the position ids, the fed-back hidden state or the diagonal mask of
    the TTT attention differ from the drafter's autoregressive inference with its KV cache; with
    ``eagle31`` (``norm_before_fc`` + ``norm_output``) also if training and inference feed different
    hidden states (pre- vs post-norm) to the next step; with ``nbr`` (``norm_before_residual``) if the
    two start layer 0's residual differently.
    """
    d = make_drafter(target, ttt_steps=3, norm_before_fc=eagle31, norm_output=eagle31,
                     norm_before_residual=nbr).eval()
    g = torch.Generator().manual_seed(0)
    n = 9  # prompt x_0..x_{n-1}, first target token x_n
    prefix = torch.randint(0, V, (n + 1,), generator=g)
    feats = target.features(prefix[None])
    state = d.start(prefix, feats.slice(0, n))
    prop = d._propose_one(state, 3, SamplingParams.uniform(1, 1.0), g)  # sampled: probs = softmax(logits)
    seq = torch.cat([prefix, prop.token_ids, torch.randint(0, V, (3,), generator=g)])
    batch, _ = batch_for(target, seq[None])
    _, _, step_logits = capture_step_logits(d, batch)
    t = n - 1  # index whose input is (g[n-1], x_n)
    for j in range(3):
        train_p = torch.softmax(step_logits[j][0, t], -1)
        infer_p = prop.probs[j][d.draft_ids]
        torch.testing.assert_close(train_p, infer_p, atol=2e-5, rtol=1e-4)


def dense_ttt_reference(d, batch) -> list[torch.Tensor]:
    """Step logits ``[B, T, N]`` of every TTT step, computed with ONE dense boolean mask per step over the
    concatenated keys of steps 0..j (not :func:`speculators.drafters.layers.ttt_attention`): query t of
    step j sees step-0 keys ``s <= t`` of real inputs and, of each step 1..j, only the key at t. Step j
    takes token ``x_{t+1+j}``, position id ``t+1+j`` and step j-1's output hidden state at t: ``h``, or
    ``norm(h)`` with ``norm_output``. Layer 0's residual is its hidden input, or ``hidden_norm`` of it with
    ``norm_before_residual`` (vLLM's Eagle3 decoder layer)."""
    import torch.nn.functional as F

    B, T = batch.input_ids.shape
    key_valid = torch.zeros(B, T, dtype=torch.bool)
    key_valid[:, :T - 1] = batch.attention_mask[:, 1:]  # input t = (g[t], x_{t+1}) is real
    causal = torch.ones(T, T, dtype=torch.bool).tril()
    eye = torch.eye(T, dtype=torch.bool)
    hidden = d.fuse(batch.aux.float())
    ks = [[] for _ in d.layers]
    vs = [[] for _ in d.layers]
    out = []
    for j in range(d.cfg.ttt_steps):
        tokens = torch.zeros(B, T, dtype=torch.int64)
        tokens[:, :T - 1 - j] = batch.input_ids[:, 1 + j:]
        emb = d.embed_tokens(tokens)
        cos, sin = d.rotary(hidden, (torch.arange(T) + 1 + j)[None].expand(B, T))
        mask = torch.cat([causal[None] & key_valid[:, None, :]] + [eye[None].expand(B, T, T)] * j, dim=-1)
        h = hidden
        for i, layer in enumerate(d.layers):
            if i == 0:
                hn = layer.hidden_norm(h)
                x = torch.cat([layer.input_layernorm(emb), hn], dim=-1)
                residual = hn if d.cfg.norm_before_residual else h
            else:
                residual, x = h, layer.input_layernorm(h)
            q, k, v = layer.self_attn.qkv(x, cos, sin)
            ks[i].append(k)
            vs[i].append(v)
            o = F.scaled_dot_product_attention(q, torch.cat(ks[i], dim=2), torch.cat(vs[i], dim=2),
                                               attn_mask=mask[:, None], enable_gqa=True)
            h = residual + layer.self_attn.out(o)
            h = h + layer.mlp(layer.post_attention_layernorm(h))
        out.append(d.lm_head(d.norm(h)).float())
        hidden = d.norm(h) if d.cfg.norm_output else h
    return out


@pytest.mark.parametrize("norm_output,num_layers,nbr", [(False, 1, False), (True, 1, False), (True, 2, False),
                                                         (False, 1, True), (True, 2, True)])
def test_ttt_steps_equal_dense_reference(target, norm_output, num_layers, nbr):
    """Every TTT step's logits equal :func:`dense_ttt_reference` (explicit mask over all steps'
    keys, explicit hidden-state feed, explicit layer-0 residual), on right-padded rows. Fails if the fed
    hidden state is pre-norm while ``norm_output`` asks for ``norm(h)`` (the old code had no Eagle 3.1
    feed at all), if layer 0's residual is the raw hidden state while ``norm_before_residual`` asks for
    ``hidden_norm`` of it (the old code had no such option), or if step j sees other keys or position
    ids than the reference."""
    d = make_drafter(target, ttt_steps=3, num_layers=num_layers, norm_before_fc=norm_output,
                     norm_output=norm_output, norm_before_residual=nbr)
    ids = torch.randint(0, V, (2, 12), generator=torch.Generator().manual_seed(11))
    batch, _ = batch_for(target, ids, lengths=[12, 8])
    _, _, step_logits = capture_step_logits(d, batch)
    with torch.no_grad():
        ref = dense_ttt_reference(d, batch)
    real = torch.zeros(2, 12, dtype=torch.bool)
    real[:, :11] = batch.attention_mask[:, 1:]
    for j in range(3):
        torch.testing.assert_close(step_logits[j][real], ref[j][real], atol=1e-4, rtol=1e-4)


def test_norm_output_is_exported_only_when_set(target, tmp_path):
    """Eagle 3.1's ``norm_output`` reaches vLLM's config only for drafters trained with it (a default
    export keeps FORMATS.md's key set); ``norm_before_fc`` is always written."""
    plain = json.loads((make_drafter(target).save_pretrained(tmp_path / "a") / "config.json").read_text())
    e31 = make_drafter(target, norm_before_fc=True, norm_output=True).save_pretrained(tmp_path / "b")
    cfg = json.loads((e31 / "config.json").read_text())
    assert "norm_output" not in plain and plain["norm_before_fc"] is False
    assert cfg["norm_output"] is True and cfg["norm_before_fc"] is True
    back = registry.get("eagle3").from_pretrained(e31)
    assert back.cfg.norm_output and back.cfg.norm_before_fc


def test_norm_before_residual_is_exported_and_loaded(target, tmp_path):
    """vLLM's Eagle3 layer reads ``norm_before_residual`` from the config: it must say what the drafter was
    trained with (the old export always wrote false), and a saved drafter must load with it."""
    plain = json.loads((make_drafter(target).save_pretrained(tmp_path / "a") / "config.json").read_text())
    nbr = make_drafter(target, norm_before_residual=True).save_pretrained(tmp_path / "b")
    assert plain["norm_before_residual"] is False
    assert json.loads((nbr / "config.json").read_text())["norm_before_residual"] is True
    assert registry.get("eagle3").from_pretrained(nbr).cfg.norm_before_residual is True


@pytest.mark.parametrize("nbr", [False, True])
def test_norm_before_residual_removes_the_feature_scale(target, nbr):
    """SmolLM2's aux hidden states carry massive activations (fused g with rms ~50 against ~1
    for the layer's own attention/MLP output). With ``norm_before_residual`` layer 0's residual is
    ``hidden_norm(g)``, so every TTT step's logits are the same whatever the scale of the target's
    features (fc is linear, every later input is normalised); the raw-residual default is dominated by
    g: the same drafter's logits move when the features are scaled. Fails if the option does not reach
    the residual (the old code always used the raw g)."""
    d = make_drafter(target, ttt_steps=3, norm_before_residual=nbr)
    ids = torch.randint(0, V, (2, 12), generator=torch.Generator().manual_seed(5))
    batch, _ = batch_for(target, ids, lengths=[12, 9])
    real = torch.zeros(2, 12, dtype=torch.bool)
    real[:, :11] = batch.attention_mask[:, 1:]
    with torch.no_grad():
        _, _, base = capture_step_logits(d, batch)
        batch.aux = batch.aux * 1000.0
        _, _, scaled = capture_step_logits(d, batch)
    for j in range(3):
        diff = (base[j][real] - scaled[j][real]).abs().max().item()
        if nbr:
            assert diff < 1e-3, (j, diff)
        else:
            assert diff > 1e-1, (j, diff)


@pytest.mark.parametrize("train_lm_head", [True, False])
def test_train_lm_head_controls_whether_the_head_learns(target, train_lm_head):
    """``train_lm_head: false`` (vllm-project/speculators' choice) keeps the target's draft-vocabulary rows
    through training; the default trains them."""
    d = make_drafter(target, vocab_size=48, train_lm_head=train_lm_head)
    before = d.lm_head.weight.detach().clone()
    opt = torch.optim.AdamW([p for p in d.parameters() if p.requires_grad], lr=1e-2)
    batch, _ = batch_for(target, torch.randint(0, V, (2, 12), generator=torch.Generator().manual_seed(4)))
    loss, _ = d.loss(batch)
    loss.backward()
    opt.step()
    assert d.lm_head.weight.requires_grad is train_lm_head
    assert torch.equal(d.lm_head.weight, before) is not train_lm_head
    if not train_lm_head:
        torch.testing.assert_close(before, target.lm_head_weight.float()[d.draft_ids])


def test_loss_compares_step_j_with_target_at_t_plus_1_plus_j(target):
    """Recompute every TTT step's loss by hand with the documented shift and mask."""
    d = make_drafter(target, ttt_steps=3, vocab_size=48)
    g = torch.Generator().manual_seed(3)
    ids = torch.randint(0, V, (2, 14), generator=g)
    mask = torch.rand(2, 14, generator=g) > 0.3
    batch, f = batch_for(target, ids, mask)
    loss, metrics, step_logits = capture_step_logits(d, batch)
    draft_ids = d.draft_ids
    teacher = torch.softmax(f.logits[..., draft_ids], -1)
    in_vocab = d.t2d[f.logits.argmax(-1)]
    T = ids.shape[1]
    total = 0.0
    for j in range(3):
        num, den = 0.0, 0
        for b in range(2):
            for t in range(T - 2 - j):
                if not (mask[b, t + 2 + j] and in_vocab[b, t + 1 + j]):
                    continue
                lp = torch.log_softmax(step_logits[j][b, t], -1)
                num += float(-(teacher[b, t + 1 + j] * lp).sum())
                den += 1
        manual = num / max(den, 1)
        assert metrics[f"loss_{j}"] == pytest.approx(manual, rel=1e-4, abs=1e-5)
        total += 0.8 ** j * manual
    assert float(loss) == pytest.approx(total, rel=1e-4)


@pytest.mark.parametrize("loss,norm_output,num_layers,nbr", [("kl", False, 1, False), ("kl", True, 2, True),
                                                           ("ce", False, 1, False)])
def test_labelled_rows_only_gives_the_same_loss_metrics_and_gradients(target, loss, norm_output, num_layers, nbr):
    """The training loss runs TTT steps >= 1 only on the rows a later head reads and each step's output head only
    on its labelled rows (prompt tokens, padding and the sequence ends skipped): its loss, every metric and every
    parameter's gradient equal those of every row everywhere. Fails if a selected row reads the teacher at another
    position than ``t + 1 + j``, if a step skips a row a later step reads (its chain would start from zeros), or if
    a selected query sees other keys or positions than the dense layout's. Equal up to float rounding (the matrix
    products have other shapes)."""
    d = make_drafter(target, ttt_steps=3, vocab_size=48, norm_before_fc=norm_output, norm_output=norm_output,
                     loss=loss, num_layers=num_layers, norm_before_residual=nbr)
    g = torch.Generator().manual_seed(13)
    ids = torch.randint(0, V, (3, 16), generator=g)
    mask = torch.zeros(3, 16, dtype=torch.bool)
    mask[0, 6:] = True  # a prompt of 6 tokens, then the answer
    mask[1, 3:9] = True  # an answer inside padding (length 11)
    mask[2] = torch.rand(16, generator=g) > 0.4  # several assistant turns
    batch, _ = batch_for(target, ids, mask, lengths=[16, 11, 16])
    with torch.no_grad():  # chains from every 4th start where each step's draft is the target's greedy token
        steps = capture_step_logits(d, batch)[2]  # (the drafts do not depend on argmax: hits at every step)
        for j, logits in enumerate(steps):
            batch.argmax[:, 1 + j::4] = d.draft_ids[logits.argmax(-1)][:, 0:16 - 1 - j:4]
    out = {}
    for every_row in (True, False):
        d.zero_grad()
        d.labelled_rows_only = not every_row
        total, metrics = d.loss(batch)
        total.backward()
        grads = {n: p.grad.clone() for n, p in d.named_parameters() if p.grad is not None}
        out[every_row] = (float(total), metrics, grads)
    del d.labelled_rows_only
    (l_all, m_all, g_all), (l_sel, m_sel, g_sel) = out[True], out[False]
    assert l_sel == pytest.approx(l_all, rel=1e-5) and l_all > 0
    assert m_sel.keys() == m_all.keys() and m_all["full_acc_2"] > 0.1
    for k in m_all:
        assert m_sel[k] == pytest.approx(m_all[k], rel=1e-5, abs=1e-6), k
    assert g_sel.keys() == g_all.keys() and len(g_all) > 3
    for n in g_all:
        torch.testing.assert_close(g_sel[n], g_all[n], atol=1e-6, rtol=1e-4, msg=n)


def test_metrics_full_and_conditional_accuracy(target):
    d = make_drafter(target, ttt_steps=3)
    ids = torch.randint(0, V, (2, 16), generator=torch.Generator().manual_seed(5))
    batch, f = batch_for(target, ids)
    _, m, step_logits = capture_step_logits(d, batch)
    argmax = f.logits.argmax(-1)
    T = 16
    full = None
    tau = 1.0
    for j in range(3):
        pred = d.draft_ids[step_logits[j].argmax(-1)]
        correct = torch.zeros(2, T, dtype=torch.bool)
        correct[:, :T - 1 - j] = pred[:, :T - 1 - j] == argmax[:, 1 + j:]
        valid = torch.zeros(2, T, dtype=torch.bool)
        valid[:, :T - 2 - j] = True
        new_full = correct if full is None else full & correct
        acc = float((new_full & valid).sum() / valid.sum())
        assert m[f"full_acc_{j}"] == pytest.approx(acc)
        if full is not None:
            den = (full & valid).sum()
            assert m[f"cond_acc_{j}"] == pytest.approx(float((new_full & valid).sum() / den) if den else 0.0)
        full = new_full
        tau += acc
    assert m["sim_tau"] == pytest.approx(tau)


def test_metrics_count_out_of_vocabulary_greedy_tokens_as_misses(target):
    """full_acc_j's denominator is every labelled chain start, whatever the draft
    vocabulary (a greedy token outside it is a miss, as greedy verification would see it); the LOSS
    still skips those positions. The old EAGLE-3 divided by the in-vocabulary positions only (here
    4/8 = 0.5 instead of 4/12)."""
    d = make_drafter(target, ttt_steps=1, vocab_size=48)  # draft vocabulary = target ids 0..47
    T = 14
    ids = torch.randint(0, V, (1, T), generator=torch.Generator().manual_seed(2))
    batch, _ = batch_for(target, ids)
    _, _, step_logits = capture_step_logits(d, batch)
    pred = d.draft_ids[step_logits[0].argmax(-1)][0]  # [T] step-0 draft at t (target ids)
    argmax = torch.zeros(1, T, dtype=torch.int64)
    for t in range(T - 2):  # labelled chain starts: t + 2 < T -> 12 of them
        kind = t % 3  # 0: the draft is right; 1: greedy token outside the draft vocab; 2: in-vocab miss
        argmax[0, t + 1] = int(pred[t]) if kind == 0 else (90 if kind == 1 else (int(pred[t]) + 1) % 48)
    batch.argmax = argmax
    _, m = d.loss(batch)
    assert m["full_acc_0"] == pytest.approx(4 / 12) and m["cond_acc_0"] == pytest.approx(4 / 12)
    assert m["sim_tau"] == pytest.approx(1 + 4 / 12)
    assert d.loss_counts(batch).tolist() == [8]  # the loss keeps only the in-vocabulary labels


def test_training_reduces_loss_and_improves_acceptance(target):
    d = make_drafter(target, ttt_steps=2)
    ids = torch.randint(0, V, (4, 24), generator=torch.Generator().manual_seed(7))
    batch, _ = batch_for(target, ids)
    opt = torch.optim.AdamW([p for p in d.parameters() if p.requires_grad], lr=3e-3)
    first, m0 = d.loss(batch)
    for _ in range(60):
        loss, m = d.loss(batch)
        opt.zero_grad()
        loss.backward()
        opt.step()
    assert float(loss) < 0.5 * float(first)
    assert m["full_acc_0"] > m0["full_acc_0"] + 0.2


def test_draft_vocab_from_counts():
    counts = torch.tensor([5, 9, 9, 0, 7, 1])
    v = DraftVocab.from_counts(counts, 3)
    assert v.target_ids.tolist() == [1, 2, 4]  # ties (9, 9) keep both; lower id first among equal counts
    assert (torch.arange(3) + v.d2t).tolist() == [1, 2, 4]  # vLLM: target = i + d2t[i]
    assert v.t2d.tolist() == [False, True, True, False, True, False]
    tie = DraftVocab.from_counts(torch.tensor([1, 3, 3, 3]), 2)
    assert tie.target_ids.tolist() == [1, 2]
    assert DraftVocab.from_counts(counts, None).size == 6


def test_export_format_is_vllm_eagle3(target, tmp_path):
    d = make_drafter(target, vocab_size=40)
    path = d.save_pretrained(tmp_path / "ckpt", recipe_yaml="x: 1\n")
    cfg = json.loads((path / "config.json").read_text())
    assert cfg["speculators_model_type"] == "eagle3"
    assert cfg["architectures"] == ["Eagle3DraftModel"]
    sc = cfg["speculators_config"]
    assert sc["algorithm"] == "eagle3"
    assert sc["proposal_methods"][0]["proposal_type"] == "greedy"
    assert sc["proposal_methods"][0]["speculative_tokens"] == 4
    assert sc["verifier"]["name_or_path"] == target.name_or_path
    assert isinstance(cfg["transformer_layer_config"], dict)
    assert cfg["transformer_layer_config"]["rope_theta" if "rope_theta" in cfg["transformer_layer_config"]
                                          else "rope_parameters"] is not None
    assert cfg["draft_vocab_size"] == 40
    assert cfg["eagle_aux_hidden_state_layer_ids"] == [i + 1 for i in target.aux_layer_ids]
    from safetensors.torch import load_file

    w = load_file(str(path / "model.safetensors"))
    H = target.hidden_size
    assert w["fc.weight"].shape == (H, 3 * H)
    assert w["layers.0.self_attn.q_proj.weight"].shape[1] == 2 * H
    for name in ("layers.0.input_layernorm.weight", "layers.0.hidden_norm.weight",
                 "layers.0.post_attention_layernorm.weight", "layers.0.mlp.gate_proj.weight", "norm.weight"):
        assert name in w
    assert w["lm_head.weight"].shape == (40, H)
    assert w["embed_tokens.weight"].shape == (V, H)
    assert w["d2t"].dtype == torch.int64 and w["t2d"].dtype == torch.bool and int(w["t2d"].sum()) == 40
    # weights/config/proposals after from_pretrained: tests/drafters/test_contracts.py


def test_greedy_accepts_everything_when_drafter_is_the_target_chain(target):
    """A proposer that returns the target's own greedy continuation gets tau = K + 1."""
    prompt = torch.randint(0, V, (8,), generator=torch.Generator().manual_seed(9)).tolist()
    plain = plain_decode(target, prompt, 25, eos_ids=set())

    class Oracle(NGramProposer):
        def propose(self, states, ks, *a, **kw):
            from speculators.decode.proposal import Proposal
            return [Proposal(torch.tensor(plain.tokens[len(s.tokens) - len(prompt):][:k], dtype=torch.int64))
                    for s, k in zip(states, ks)]

    spec = speculative_decode(target, Oracle(), prompt, 4, 25, eos_ids=set())
    assert spec.tokens == plain.tokens
    assert all(a == n for a, n in zip(spec.accepted[:-1], spec.drafted[:-1]))
    assert spec.accepted[0] == 4


# ----------------------------------------------------------------------------- batched inference

PROMPT_LENS = (5, 12, 3, 9)


def batched_states(target, d, lens=PROMPT_LENS, seed=11, advance_by=(0, 2, 3, 1)):
    """One state per prompt length (different context lengths), each advanced per request by a few
    verified tokens so the caches hold ragged numbers of real-feature entries."""
    g = torch.Generator().manual_seed(seed)
    states = []
    for n, m in zip(lens, advance_by):
        seq = torch.randint(0, V, (n + 1 + m,), generator=g)
        feats = target.features(seq[None])
        s = d.start(seq[:n + 1], feats.slice(0, n))
        if m:
            d._propose_one(s, 3)  # a chain before advance: its speculative entries must not survive
            d._advance_one(s, seq[n + 1:], feats.slice(n, n + m))
        states.append(s)
    return states


def assert_states_equal(a, b, exact=True):
    assert a.num_positions == b.num_positions
    assert a.cache.length == b.cache.length == a.num_positions
    check = torch.equal if exact else (lambda x, y: torch.allclose(x, y, atol=1e-5, rtol=1e-4))
    for x, y in zip(a.cache.k + a.cache.v + [a.last_hidden, a.last_logits],
                    b.cache.k + b.cache.v + [b.last_hidden, b.last_logits]):
        assert x.shape == y.shape and check(x, y)


@pytest.mark.parametrize("num_layers,vocab_size", [(1, None), (2, 48)])
def test_batched_greedy_propose_equals_per_request(target, num_layers, vocab_size):
    """ONE forward per draft step over ragged ks (incl. 0) and different context lengths gives each
    request exactly its own greedy chain; the states are left as found."""
    import copy

    d = make_drafter(target, num_layers=num_layers, vocab_size=vocab_size).eval()
    states = batched_states(target, d)
    before = copy.deepcopy(states)
    ks = [3, 0, 5, 1]
    calls = []
    hook = d.lm_head.register_forward_hook(lambda m, i, o: calls.append(o.shape[0]))
    try:
        props = d.propose(states, ks)
    finally:
        hook.remove()
    assert calls == [2, 2, 1, 1]  # one forward per chain step for the rows still drafting (k=5 and k=3, then k=5)
    for s, b in zip(states, before):
        assert_states_equal(s, b)
    for i, (s, k) in enumerate(zip(states, ks)):
        alone = d._propose_one(copy.deepcopy(s), k)
        assert props[i].token_ids.dtype == torch.int64 and props[i].probs is None
        assert props[i].token_ids.tolist() == alone.token_ids.tolist(), i
    assert props[1].token_ids.shape == (0,)
    if vocab_size:  # draft ids are mapped to target ids inside the draft vocabulary
        assert all(bool(d.t2d[t]) for p in props for t in p.token_ids.tolist())


def test_batched_seeded_sampling_equals_per_request(target):
    """Mixed per-request settings: every request draws only from its own generator and gets the tokens
    and q rows it gets alone (a leak of one request's randomness or cache into another's fails)."""
    import copy

    d = make_drafter(target, num_layers=2, vocab_size=48).eval()
    states = batched_states(target, d)
    sampling = SamplingParams(temperature=torch.tensor([0.8, 0.0, 1.0, 1.3]), top_k=torch.tensor([8, 0, 0, 5]),
                              top_p=torch.tensor([1.0, 1.0, 0.9, 0.95]))
    ks = [4, 2, 0, 3]
    seeds = [3, 4, 5, 6]
    gens = [torch.Generator().manual_seed(s) for s in seeds]
    before = copy.deepcopy(states)
    props = d.propose(states, ks, sampling, gens)
    for s, b in zip(states, before):
        assert_states_equal(s, b)
    for i in range(4):
        one = SamplingParams(temperature=sampling.temperature[i:i + 1], top_k=sampling.top_k[i:i + 1],
                             top_p=sampling.top_p[i:i + 1])
        g = torch.Generator().manual_seed(seeds[i])
        alone = d._propose_one(copy.deepcopy(states[i]), ks[i], one, g)
        assert props[i].token_ids.tolist() == alone.token_ids.tolist(), i
        if ks[i] and i != 1:
            assert props[i].probs.shape == (ks[i], V) and props[i].probs.dtype == torch.float32
            torch.testing.assert_close(props[i].probs, alone.probs, atol=1e-5, rtol=0)
            assert torch.equal(gens[i].get_state(), g.get_state())  # the same number of draws, from its own
        else:
            assert props[i].probs is None
    # sampling.generators are used when no generators argument is given
    sampling.generators = [torch.Generator().manual_seed(s) for s in seeds]
    again = d.propose(states, ks, sampling)
    assert [p.token_ids.tolist() for p in again] == [p.token_ids.tolist() for p in props]


def test_batched_advance_equals_per_request(target):
    """ONE forward appends every request's m_i verified positions; the states equal _advance_one's and
    the next proposals agree."""
    import copy

    d = make_drafter(target, num_layers=2, vocab_size=48).eval()
    states = batched_states(target, d)
    g = torch.Generator().manual_seed(21)
    ms = [3, 1, 4, 2]
    new_ids, feats = [], []
    for m in ms:
        seq = torch.randint(0, V, (m + 1,), generator=g)
        new_ids.append(seq[1:])
        feats.append(target.features(seq[None]).slice(0, m))
    alone = copy.deepcopy(states)
    d.propose(states, [2, 2, 2, 2])  # speculative entries of a batched chain must not leak into advance
    for s, ids, f in zip(alone, new_ids, feats):
        d._advance_one(s, ids, f)
    d.advance(states, new_ids, feats)
    for s, a in zip(states, alone):
        assert_states_equal(s, a, exact=False)
    ks = [3, 2, 4, 1]
    assert [p.token_ids.tolist() for p in d.propose(states, ks)] == \
        [d._propose_one(a, k).token_ids.tolist() for a, k in zip(alone, ks)]


def test_batched_propose_and_advance_reject_bad_input(target):
    from speculators.errors import SpeculatorsError

    d = make_drafter(target).eval()
    states = batched_states(target, d, lens=(4, 6), advance_by=(0, 0))
    with pytest.raises(SpeculatorsError, match="ks"):
        d.propose(states, [1])
    with pytest.raises(SpeculatorsError, match=r"ks\[1\]"):
        d.propose(states, [1, -2])
    with pytest.raises(SpeculatorsError, match="temperature"):
        d.propose(states, [1, 1], SamplingParams.uniform(3, 1.0))
    with pytest.raises(SpeculatorsError, match="generators"):
        d.propose(states, [1, 1], SamplingParams.uniform(2, 1.0), [None])
    f = target.features(torch.tensor([[1, 2, 3]]))
    with pytest.raises(SpeculatorsError, match="request 1: new_ids"):
        d.advance(states, [torch.tensor([5]), torch.tensor([], dtype=torch.int64)], [f.slice(0, 1), f.slice(0, 0)])
    with pytest.raises(SpeculatorsError, match="request 0: features.aux"):
        d.advance(states, [torch.tensor([5, 6]), torch.tensor([7])], [f.slice(0, 1), f.slice(0, 1)])
    assert d.propose([], []) == []
