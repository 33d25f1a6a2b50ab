"""MLP speculator: the export against vLLM's loader (names and shapes), a forward written here from the published
equations (vLLM's ``MLPSpeculator.generate_proposals``; Wertheimer et al. arXiv 2404.19124) reading only the
exported ``config.json`` and ``model.safetensors``, the teacher-forced loss by hand, and the config's refusals.
The family contracts (lossless chains and trees, batching, sampling, save/load) are in test_contracts.py."""

from __future__ import annotations

import json
import math

import pytest
import torch
from safetensors.torch import load_file, save_file

from speculators.data.vocab import DraftVocab
from speculators.drafters import registry
from speculators.errors import SpeculatorsError
from speculators.export.vllm_layout import check_layout
from speculators.target import build_tiny_target

V, H = 96, 32
FAMILY = registry.get("mlp_speculator")


@pytest.fixture(scope="module")
def target():
    return build_tiny_target(vocab_size=V, hidden_size=H, num_layers=2, seed=3)


def make(target, **kw):
    torch.manual_seed(0)
    d = FAMILY.from_target(FAMILY.config_class(algorithm="mlp_speculator", **kw), target, DraftVocab.full(V))
    with torch.no_grad():  # random LN affine terms, so that the check sees them
        for p in d.parameters():
            p.add_(0.05 * torch.randn_like(p))
    return d.eval()


def equations(config: dict, w: dict, h: torch.Tensor, token: int, n: int) -> tuple[list[torch.Tensor], list[int]]:
    """vLLM's greedy MLP speculator from its equations, on the exported files only: per stage the logits ``[V]``
    and the greedy token fed to the next stage."""
    K, E = config["n_predict"], config["emb_dim"]
    D = config["inner_dim"] or E
    state_weight = 0.5 ** (0.5 / K)
    emb_weight = math.sqrt((1 - state_weight ** 2) * (D / 2))
    s = h.double()
    if config["scale_input"]:
        s = s / torch.sqrt((s * s).mean() + 1e-6) / math.sqrt(2)
    logits, tokens = [], []
    for i in range(n):
        x = w[f"proj.{i}.weight"].double() @ s + (emb_weight / state_weight) * w[f"emb.{i}.weight"].double()[token]
        x = x / torch.sqrt((x * x).mean() + 1e-6)
        x = w[f"ln.{i}.weight"].double() * x + w[f"ln.{i}.bias"].double()
        s = 0.5 * x * (1 + torch.erf(x / math.sqrt(2)))  # exact GELU
        out = w[f"head.{i}.weight"].double() @ s
        logits.append(out)
        token = int(out.argmax())
        tokens.append(token)
    return logits, tokens


@pytest.mark.parametrize("kw", [{}, {"tie_weights": True, "scale_input": True}, {"inner_dim": 24, "n_predict": 4}])
def test_export_matches_vllms_loader_and_the_published_equations(target, tmp_path, kw):
    d = make(target, **kw)
    path = d.save_pretrained(tmp_path / "ckpt")
    assert check_layout(path) == []
    config = json.loads((path / "config.json").read_text())
    assert config["model_type"] == "mlp_speculator" and config["architectures"] == ["MLPSpeculatorPreTrainedModel"]
    assert config["n_predict"] == config["num_lookahead_tokens"] == d.n_predict and config["emb_dim"] == H
    w = load_file(str(path / "model.safetensors"))

    ids = torch.randint(0, V, (1, 9), generator=torch.Generator().manual_seed(5))
    feats = target.features(ids)
    state = d.start(ids[0], feats)
    ref_logits, ref_tokens = equations(config, w, feats.top[0, -1], int(ids[0, -1]), d.n_predict)
    assert torch.allclose(state.logits.double(), ref_logits[0], atol=1e-5)
    s, ours = state.s1, [state.logits]
    for i, tok in enumerate(ref_tokens[:-1], start=1):  # our stages on the same greedy chain
        s = d.stage(i, s, torch.tensor(tok))
        ours.append(d.stage_logits(i, s).float())
    for a, b in zip(ours, ref_logits):
        assert (a.double() - b).abs().max() < 1e-5
    assert d.propose([state], [d.n_predict])[0].token_ids.tolist() == ref_tokens


def test_the_layout_check_reads_names_as_vllms_loader_does(target, tmp_path):
    path = make(target).save_pretrained(tmp_path / "ckpt")
    w = load_file(str(path / "model.safetensors"))
    w["speculator.emb.0.weight"] = w.pop("emb.0.weight")  # IBM's prefix: vLLM drops it
    save_file(w, str(path / "model.safetensors"))
    assert check_layout(path) == []
    w["heads.0.weight"] = w.pop("head.0.weight")  # a name vLLM skips silently: head 0 would stay unloaded
    w["proj.1.weight"] = w["proj.1.weight"][:, :-1].contiguous()
    save_file(w, str(path / "model.safetensors"))
    problems = "\n".join(check_layout(path))
    assert "`heads.0.weight`" in problems and "skips it silently" in problems
    assert "`head.0.weight` is missing" in problems and "`proj.1.weight`: shape" in problems


def test_teacher_forced_loss_by_hand(target):
    d = make(target, n_predict=2, stage_decay=0.5)
    ids = torch.randint(0, V, (2, 12), generator=torch.Generator().manual_seed(7))
    from conftest import batch_for

    batch, feats = batch_for(target, ids)
    loss, metrics = d.loss(batch)
    total = 0.0
    for k in (1, 2):
        ces = []
        for b in range(2):
            for t in range(12 - k - 1):
                s = d.initial_state(feats.top[b, t])
                for j in range(k):
                    s = d.stage(j, s, ids[b, t + j + 1])
                ces.append(torch.nn.functional.cross_entropy(d.stage_logits(k - 1, s)[None].float(), ids[b, t + k + 1][None]))
        total += 0.5 ** (k - 1) * torch.stack(ces).mean()
        assert metrics[f"loss_{k - 1}"] == pytest.approx(float(torch.stack(ces).mean().detach()), rel=1e-5)
    assert float(loss.detach()) == pytest.approx(float(total.detach()), rel=1e-5)


def test_the_config_refuses_what_vllm_cannot_load(target):
    cfg = FAMILY.config_class
    with pytest.raises(ValueError, match="full vocabulary"):
        cfg(algorithm="mlp_speculator", draft_vocab_size=64)
    with pytest.raises(ValueError, match="n_predict >= 2"):
        cfg(algorithm="mlp_speculator", tie_weights=True, n_predict=1)
    with pytest.raises(SpeculatorsError, match="full vocabulary"):
        FAMILY.from_target(cfg(algorithm="mlp_speculator"), target,
                           DraftVocab.from_counts(torch.arange(V, 0, -1), 64))
