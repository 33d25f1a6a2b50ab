"""Medusa drafter: label shift of every head, hand-computed loss, metrics, training/inference
consistency, both checkpoint layouts (speculators / vLLM-native), the vLLM-native layout through the CLI.

Greedy == plain, seeded sampling, save/load round trip, ``propose`` purity and CLI train -> eval are
checked for every family in tests/drafters/test_contracts.py."""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
from safetensors.torch import load_file

import speculators.drafters.medusa  # noqa: F401  (registers "medusa")
from speculators.data.dataset import Batch
from speculators.drafters import Drafter, registry
from speculators.data.vocab import DraftVocab
from speculators.drafters.checkpoint import TargetMeta
from speculators.errors import SpeculatorsError
from speculators.decode.loop import plain_decode, speculative_decode
from speculators.verify import SamplingParams
from speculators.target import build_tiny_target
from conftest import batch_for

V = 96
K = 4
TINY = Path(__file__).resolve().parents[2] / "recipes" / "tiny-medusa.yaml"


@pytest.fixture(scope="module")
def target():
    return build_tiny_target(vocab_size=V, hidden_size=64, num_layers=4, seed=1)


def make_drafter(target, vocab_size=None, seed=0, randomize=True, **kw):
    torch.manual_seed(seed)
    family = registry.get("medusa")
    cfg = family.config_class(algorithm="medusa", draft_vocab_size=vocab_size, **kw)
    counts = torch.randperm(V, generator=torch.Generator().manual_seed(123))  # scattered draft ids
    d = family.from_target(cfg, target, DraftVocab.from_counts(counts, vocab_size))
    if randomize:  # non-zero residual blocks so that every block matters
        with torch.no_grad():
            for name, p in d.named_parameters():
                if name.startswith("blocks."):
                    p.normal_(0, 0.2)
                else:
                    p.add_(torch.randn_like(p) * 0.3)
    return d



def capture_head_logits(drafter, batch):
    """Run drafter.loss and capture every head's lm_head output ``[B, L_k, N]`` (head order)."""
    seen = {}
    hooks = [h.register_forward_hook(lambda m, i, o, k=k: seen.__setitem__(k, o.detach().float()))
             for k, h in enumerate(drafter.lm_heads)]
    try:
        loss, metrics = drafter.loss(batch)
    finally:
        for h in hooks:
            h.remove()
    return loss, metrics, [seen[k] for k in range(len(drafter.lm_heads))]


# ----------------------------------------------------------------------------- structure


def test_shapes_init_and_distinct_modules(target):
    d = make_drafter(target, vocab_size=40, randomize=False, num_layers=2)
    H = target.hidden_size
    assert len(d.blocks) == K and len(d.lm_heads) == K
    mods = [lin for b in d.blocks for lin in b.layers]
    assert len(mods) == 2 * K and len({id(m) for m in mods}) == 2 * K  # never one module reused
    assert len({id(h) for h in d.lm_heads}) == K
    for lin in mods:
        assert lin.weight.shape == (H, H) and lin.bias.shape == (H,)
        assert not lin.weight.any() and not lin.bias.any()  # zero init: every block is the identity
    assert all(h.weight.shape == (40, H) for h in d.lm_heads)
    top = torch.randn(2, 5, H)
    outs = d.head_logits(top)
    assert len(outs) == K and all(o.shape == (2, 5, 40) for o in outs)
    # fresh heads reproduce the target's own head on the draft vocabulary
    ref = target.lm_head(top)[..., d.draft_ids]
    for o in outs:
        torch.testing.assert_close(o, ref)
    assert d.head_logits(top, heads=2).__len__() == 2


def test_recipe_validation_of_joint_and_export(tiny_target_dir):
    cfg_cls = registry.get("medusa").config_class
    assert cfg_cls(algorithm="medusa", joint=True).joint is True  # Medusa-2 (tests/drafters/test_joint.py)
    assert cfg_cls(algorithm="medusa").joint is False
    from speculators.recipe import load_recipe

    with pytest.raises(SpeculatorsError, match="joint_target"):
        load_recipe(TINY, [f"target.model={tiny_target_dir}", "drafter.joint=true", "drafter.joint_target.rank=4"])
    with pytest.raises(SpeculatorsError, match="drafter.export"):
        load_recipe(TINY, [f"target.model={tiny_target_dir}", "drafter.export=onnx"])


# ----------------------------------------------------------------------------- loss and labels


def _hand_drafter():
    """H=2, V=N=3, two heads, identity blocks; head 1 logits = [h0, h1, 0], head 2 = [0, h0, h1]."""
    family = registry.get("medusa")
    cfg = family.config_class(algorithm="medusa", num_heads=2)
    meta = TargetMeta(name_or_path="hand", hidden_size=2, vocab_size=3, aux_layer_ids=[], target_config={})
    d = family(cfg, meta, 3)
    with torch.no_grad():
        for b in d.blocks:
            for lin in b.layers:
                lin.weight.zero_()
                lin.bias.zero_()
        d.lm_heads[0].weight.copy_(torch.tensor([[1.0, 0.0], [0.0, 1.0], [0.0, 0.0]]))
        d.lm_heads[1].weight.copy_(torch.tensor([[0.0, 0.0], [1.0, 0.0], [0.0, 1.0]]))
    return d


def test_loss_on_a_hand_computed_example():
    d = _hand_drafter()
    ln2, ln3 = math.log(2), math.log(3)
    ids = torch.tensor([[0, 1, 2, 1]])
    top = torch.tensor([[[ln2, 0.0], [0.0, 0.0], [0.0, ln3], [0.0, 0.0]]])
    mask = torch.ones(1, 4, dtype=torch.bool)
    argmax = torch.tensor([[1, 2, 1, 0]])
    batch = Batch(ids, mask, mask.clone(), argmax, torch.zeros(1, 4, 6), top)
    loss, m = d.loss(batch)
    # head 1 (predicts x_{t+2}): t=0 logits [ln2,0,0] p=[1/2,1/4,1/4], label x_2=2 -> ln 4;
    #                            t=1 logits [0,0,0], label x_3=1 -> ln 3
    # head 2 (predicts x_{t+3}): t=0 logits [0,ln2,0] p=[1/4,1/2,1/4], label x_3=1 -> ln 2
    assert m["loss_0"] == pytest.approx((math.log(4) + ln3) / 2)
    assert m["loss_1"] == pytest.approx(ln2)
    assert float(loss.detach()) == pytest.approx((math.log(4) + ln3) / 2 + 0.8 * ln2)
    # x_3 not an assistant token: head 1 keeps only t=0, head 2 has no valid position
    mask2 = mask.clone()
    mask2[0, 3] = False
    loss, m = d.loss(Batch(ids, mask2, mask.clone(), argmax, torch.zeros(1, 4, 6), top))
    assert m["loss_0"] == pytest.approx(math.log(4)) and m["loss_1"] == 0.0
    assert float(loss.detach()) == pytest.approx(math.log(4))
    # metrics: head 1 predicts 0 at t=0 (target greedy argmax[1]=2: miss) and 0 at t=1 (argmax[2]=1: miss)
    _, m = d.loss(batch)
    assert m["full_acc_0"] == 0.0 and m["sim_tau"] == 1.0


@pytest.mark.parametrize("distill", [False, True])
def test_every_head_k_is_trained_on_token_t_plus_k_plus_1(target, distill):
    """Recompute each head's loss by hand with the documented shift and masks (fails if any head's
    label, teacher position or validity mask is off by one)."""
    d = make_drafter(target, vocab_size=48, distill=distill, head_decay=0.7)
    d.attach_target(target)
    g = torch.Generator().manual_seed(3)
    ids = torch.randint(0, V, (2, 14), generator=g)
    mask = torch.rand(2, 14, generator=g) > 0.3
    batch, f = batch_for(target, ids, mask)
    loss, m, head_logits = capture_head_logits(d, batch)
    draft_ids = d.draft_ids
    teacher = torch.softmax(f.logits[..., draft_ids], -1)
    argmax = f.logits.argmax(-1)
    T = ids.shape[1]
    total = 0.0
    for k in range(1, K + 1):
        assert head_logits[k - 1].shape[1] == T - k - 1
        num, den = 0.0, 0
        for b in range(2):
            for t in range(T - k - 1):
                lp = torch.log_softmax(head_logits[k - 1][b, t], -1)
                if not mask[b, t + k + 1]:
                    continue
                if distill:
                    if not d.t2d[argmax[b, t + k]]:
                        continue
                    num += float(-(teacher[b, t + k] * lp).sum())
                else:
                    tok = int(ids[b, t + k + 1])
                    if not d.t2d[tok]:
                        continue
                    num += float(-lp[int((draft_ids == tok).nonzero())])
                den += 1
        assert den > 0
        manual = num / den
        assert m[f"loss_{k - 1}"] == pytest.approx(manual, rel=1e-4, abs=1e-5)
        total += 0.7 ** (k - 1) * manual
    assert float(loss.detach()) == pytest.approx(total, rel=1e-4)


def test_metrics_full_and_conditional_accuracy(target):
    d = make_drafter(target, vocab_size=48)
    g = torch.Generator().manual_seed(5)
    ids = torch.randint(0, V, (2, 16), generator=g)
    mask = torch.rand(2, 16, generator=g) > 0.2
    batch, f = batch_for(target, ids, mask)
    _, m, head_logits = capture_head_logits(d, batch)
    argmax = f.logits.argmax(-1)
    T = 16
    full, live, tau = None, None, 1.0
    for k in range(1, K + 1):
        L = T - k - 1
        pred = d.draft_ids[head_logits[k - 1].argmax(-1)]  # [2, L]
        correct = pred == argmax[:, k:k + L]  # head k vs the target's greedy token at t+k
        lbl = mask[:, k + 1:]
        # the one definition (speculators.losses.chained_acceptance): chains whose drafts 1..k are all labelled
        live = lbl if live is None else live[:, :L] & lbl
        new_full = correct if full is None else full[:, :L] & correct
        acc = float((new_full & live).sum() / live.sum())
        assert m[f"full_acc_{k - 1}"] == pytest.approx(acc)
        if full is not None:
            den = (full[:, :L] & live).sum()
            assert m[f"cond_acc_{k - 1}"] == pytest.approx(float((new_full & live).sum() / den) if den else 0.0)
        full = new_full
        tau += acc
    assert m["sim_tau"] == pytest.approx(tau)
    # a fresh drafter's head 1 = the target's head: it predicts x_{t+1}, not x_{t+2}, so it is
    # right exactly where the target's greedy chain repeats a token (argmax[t] == argmax[t+1])
    fresh = make_drafter(target, randomize=False)
    _, m0 = fresh.loss(batch)
    rep = (argmax[:, :T - 2] == argmax[:, 1:T - 1]) & mask[:, 2:]
    assert m0["full_acc_0"] == pytest.approx(float(rep.sum() / mask[:, 2:].sum()))


@pytest.mark.parametrize("distill", [False, True])
def test_training_reduces_the_loss(target, distill):
    d = make_drafter(target, randomize=False, distill=distill)
    g = torch.Generator().manual_seed(7)
    if distill:  # any text: the labels are the target's distributions
        ids = torch.randint(0, V, (4, 24), generator=g)
        mask = torch.ones(ids.shape, dtype=torch.bool)
    else:  # hard labels: the target's own greedy continuations, as regenerated training data is
        prompts = torch.randint(0, V, (4, 4), generator=g).tolist()
        ids = torch.tensor([p + plain_decode(target, p, 20, eos_ids=set()).tokens for p in prompts])
        mask = torch.zeros(ids.shape, dtype=torch.bool)
        mask[:, 4:] = True
    batch, _ = batch_for(target, ids, mask)
    opt = torch.optim.AdamW([p for p in d.parameters() if p.requires_grad], lr=1e-2)
    first, m0 = d.loss(batch)
    for _ in range(40):
        loss, m = d.loss(batch)
        opt.zero_grad()
        loss.backward()
        opt.step()
    assert float(loss.detach()) < 0.6 * float(first.detach())
    assert m["sim_tau"] >= m0["sim_tau"]
    if distill:
        assert m["full_acc_0"] > m0["full_acc_0"] + 0.3


# ----------------------------------------------------------------------------- inference


def test_training_logits_match_inference_proposal(target):
    """Head k's training logits at index t = n-1 must be exactly the distribution it drafts x_{n+k}
    from at inference after start(x_0..x_n, features 0..n-1)."""
    d = make_drafter(target, vocab_size=48).eval()
    g = torch.Generator().manual_seed(0)
    n = 6
    seq = torch.randint(0, V, (n + K + 6,), generator=g)
    feats = target.features(seq[None])
    state = d.start(seq[:n + 1], feats.slice(0, n))
    prop = d._propose_one(state, K, SamplingParams.uniform(1, 1.0), g)
    assert prop.token_ids.shape == (K,) and prop.probs.shape == (K, V)
    batch, _ = batch_for(target, seq[None])
    _, _, head_logits = capture_head_logits(d, batch)
    for k in range(K):
        torch.testing.assert_close(torch.softmax(head_logits[k][0, n - 1], -1), prop.probs[k][d.draft_ids],
                                   atol=2e-6, rtol=1e-5)
    assert float(prop.probs[:, ~d.t2d].abs().sum()) == 0.0
    torch.testing.assert_close(prop.probs.sum(-1), torch.ones(K))
    # advance with m tokens: only the features of the last new position matter
    d._advance_one(state, seq[n + 1:n + 4], feats.slice(n, n + 3))
    prop2 = d._propose_one(state, 2, SamplingParams.uniform(1, 1.0))
    torch.testing.assert_close(torch.softmax(head_logits[1][0, n + 2], -1), prop2.probs[1][d.draft_ids],
                               atol=2e-6, rtol=1e-5)
    greedy = d._propose_one(state, 9)  # k > K: only K drafts; greedy = each head's top-1
    assert greedy.probs is None and greedy.token_ids.tolist() == [
        int(d.draft_ids[head_logits[k][0, n + 2].argmax()]) for k in range(K)]
    assert d._propose_one(state, 0).token_ids.numel() == 0


def test_untrained_heads_get_accepted_on_a_repetitive_target(target):
    """Sanity check of the inference shift: a fresh Medusa (every head = the target's head on
    h_top[n-1]) drafts argmax p(. | x_<=n-1) for x_{n+1}; that is accepted exactly when the target's
    greedy chain repeats its token. Count both and compare."""
    d = make_drafter(target, randomize=False).eval()
    prompt = torch.randint(0, V, (8,), generator=torch.Generator().manual_seed(4)).tolist()
    plain = plain_decode(target, prompt, 40, eos_ids=set())
    spec = speculative_decode(target, d, prompt, 1, 40, eos_ids=set())
    assert spec.tokens == plain.tokens
    # newest token x_n = toks[j]; h_top[n-1] predicts x_n, so head 1 drafts x_n again for x_{n+1}:
    # accepted iff toks[j+1] == toks[j]; then the bonus token is emitted too (j += 2)
    toks, j, expected = plain.tokens, 0, 0
    while j <= len(toks) - 3:  # no draft once only one token may still be emitted
        accepted = toks[j + 1] == toks[j]
        expected += int(accepted)
        j += 2 if accepted else 1
    assert expected > 0  # precondition: the random target does repeat itself
    assert sum(spec.accepted) == expected


# ----------------------------------------------------------------------------- formats


def vllm_like_logits(cfg: dict, w: dict, h: torch.Tensor) -> torch.Tensor:
    """What vLLM's Medusa (model_executor/models/medusa.py) computes from a checkpoint: residual
    blocks (bias iff medusa_fc_bias), per-head lm_heads; with truncated_vocab_size < vocab_size it keeps
    the token_map rows of a larger lm_head and scatters the logits into the full vocab (-inf elsewhere)."""
    Vt = cfg.get("medusa_vocab_size", cfg.get("vocab_size"))
    trunc = cfg.get("truncated_vocab_size") or Vt
    token_map = w["token_map"] if trunc < Vt else None
    assert (trunc == Vt) or token_map is not None
    out = []
    for k in range(cfg["num_heads"]):
        x = h
        for j in range(cfg["num_hidden_layers"]):
            b = w[f"blocks.{k}.layers.{j}.bias"] if cfg.get("medusa_fc_bias") else None
            x = x + F.silu(F.linear(x, w[f"blocks.{k}.layers.{j}.weight"], b))
        lw = w[f"lm_heads.{k}.weight"]
        if token_map is not None and lw.shape[0] > token_map.shape[0]:
            lw = lw[token_map]
        assert lw.shape[0] == trunc
        logits = x @ lw.T
        if token_map is not None:
            full = torch.full((Vt,), float("-inf"))
            full[token_map] = logits
            logits = full
        out.append(logits)
    return torch.stack(out)


@pytest.mark.parametrize("export, vocab", [("speculators", 40), ("speculators", None), ("vllm-medusa", None)])
def test_save_load_round_trip_and_formats(target, tmp_path, export, vocab):
    d = make_drafter(target, vocab_size=vocab, export=export, num_layers=2).eval()
    path = d.save_pretrained(tmp_path / "ckpt", recipe_yaml="x: 1\n")
    cfg = json.loads((path / "config.json").read_text())
    w = load_file(str(path / "model.safetensors"))
    H, N = target.hidden_size, vocab or V
    names = {f"blocks.{k}.layers.{j}.{p}" for k in range(K) for j in range(2) for p in ("weight", "bias")}
    names |= {f"lm_heads.{k}.weight" for k in range(K)}
    assert cfg["num_heads"] == K and cfg["num_hidden_layers"] == 2 and cfg["medusa_fc_bias"] is True
    assert cfg["architectures"] == ["MedusaModel"] and cfg["original_lm_head"] is False
    assert cfg["speculators_training"]["drafter"]["algorithm"] == "medusa"
    if export == "speculators":
        assert cfg["speculators_model_type"] == "medusa"
        sc = cfg["speculators_config"]
        assert sc["algorithm"] == "medusa" and sc["default_proposal_method"] == "greedy"
        assert sc["proposal_methods"][0]["proposal_type"] == "greedy"
        assert sc["proposal_methods"][0]["speculative_tokens"] == K
        assert sc["verifier"]["name_or_path"] == target.name_or_path
        tl = cfg["transformer_layer_config"]
        assert isinstance(tl, dict) and tl["hidden_size"] == H and tl["vocab_size"] == V
        assert cfg["draft_vocab_size"] == N and cfg["medusa_hidden_size"] == H and cfg["medusa_vocab_size"] == V
        assert cfg["truncated_vocab_size"] == (N if N < V else 0)
        names |= {"d2t", "t2d"}
        assert all(w[f"lm_heads.{k}.weight"].shape == (N, H) for k in range(K))
        assert w["d2t"].dtype == torch.int64 and int(w["t2d"].sum()) == N
    else:
        assert cfg["model_type"] == "medusa" and "speculators_model_type" not in cfg
        assert cfg["hidden_size"] == H and cfg["vocab_size"] == V
        assert cfg.get("truncated_vocab_size", V) == N
        assert all(w[f"lm_heads.{k}.weight"].shape == (V, H) for k in range(K))  # full vocab
        assert not any(n.startswith(("d2t", "t2d")) for n in w)
    if N < V:
        names.add("token_map")
        assert w["token_map"].dtype == torch.int64 and w["token_map"].tolist() == d.draft_ids.tolist()
    assert set(w) == names
    loaded = Drafter.from_pretrained(path)
    assert type(loaded) is type(d)
    for k, v in d.state_dict().items():
        assert torch.equal(v, loaded.state_dict()[k]), k
    # what vLLM would compute from these files == our drafter's distributions
    h = torch.randn(1, H)
    from speculators.target import TargetFeatures

    state = d.start(torch.tensor([1, 2]), TargetFeatures(torch.zeros(1, 1, 3 * H), h[None]))
    ours = d._propose_one(state, K, SamplingParams.uniform(1, 1.0)).probs
    torch.testing.assert_close(torch.softmax(vllm_like_logits(cfg, w, h[0]), -1), ours, atol=1e-6, rtol=1e-5)
    assert not any(p.name.startswith(".") for p in tmp_path.iterdir())


def test_vllm_medusa_layout_refuses_a_reduced_vocabulary(target):
    """vLLM's Medusa loader cannot load per-head heads over a reduced vocabulary (the real engine raised on such
    a file): the layout is refused before training, naming the field and what is allowed."""
    with pytest.raises(SpeculatorsError, match=r"vllm-medusa needs the full vocabulary \(drafter.draft_vocab_size: null"):
        make_drafter(target, vocab_size=40, export="vllm-medusa")


def test_load_rejects_mismatched_weights(target, tmp_path):
    d = make_drafter(target, vocab_size=40)
    sd = d.serving.state_dict(d)
    sd.pop("lm_heads.3.weight")
    with pytest.raises(SpeculatorsError, match="missing"):
        d.serving.load_state_dict(d, sd)


# ----------------------------------------------------------------------------- CLI


def test_cli_vllm_medusa_layout_trains_and_evaluates(tmp_path, isolated_cache, tiny_target_dir):
    """The vLLM-native layout trains, checkpoints and evaluates like the default one (whose CLI run
    is in tests/drafters/test_contracts.py)."""
    from typer.testing import CliRunner

    from speculators.cli import app

    runner = CliRunner()
    out = tmp_path / "run-vllm"
    r = runner.invoke(app, ["train", str(TINY), f"target.model={tiny_target_dir}", "drafter.export=vllm-medusa",
                            "drafter.draft_vocab_size=null", "train.steps=2", "-o", str(out)])
    assert r.exit_code == 0, f"{r.exception!r}\n{r.output}"
    cfg = json.loads((out / "final" / "config.json").read_text())
    assert cfg["model_type"] == "medusa" and "truncated_vocab_size" not in cfg
    r = runner.invoke(app, ["eval", str(out), "--temperature", "0.7", "--num-prompts", "1", "-k", "5",
                            "--output", str(tmp_path / "rep")])
    assert r.exit_code == 2 and "-k 5" in r.output and "drafter.num_heads = 4" in r.output, r.output  # not capped
    r = runner.invoke(app, ["eval", str(out), "--temperature", "0.7", "--num-prompts", "1", "-k", "4",
                            "--output", str(tmp_path / "rep")])
    assert r.exit_code == 0, f"{r.exception!r}\n{r.output}"
    rep = json.loads((tmp_path / "rep" / "report.json").read_text())
    assert rep["drafter"]["steps"] > 0 and rep["drafter"]["drafted"] <= 4 * rep["drafter"]["steps"]
