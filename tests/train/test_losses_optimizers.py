"""Every family trains with every ``train.loss`` that applies to it (the ones that distil the target's
distribution) and with Muon; a family trained on hard labels refuses another loss. Exact resume with Muon and
another divergence is in test_resume.py."""

from __future__ import annotations

import copy

import pytest
import torch

from speculators.data.vocab import DraftVocab
from speculators.divergences import DIVERGENCES
from speculators.drafters import registry
from speculators.errors import SpeculatorsError
from speculators.recipe import TrainSpec
from speculators.target import build_tiny_target
from speculators.train.optimizers import MuonAdamW, build_optimizer, muon_split
from speculators.train.unit import TrainingUnit, set_distill_loss
from conftest import batch_for

V, H = 128, 32
FAMILIES = registry.names()


@pytest.fixture(scope="module")
def target():
    t = build_tiny_target(vocab_size=V, hidden_size=H, num_layers=3, seed=2)
    with torch.no_grad():  # a smoother target distribution than the peaked default: the divergences then differ
        t.model.get_input_embeddings().weight.mul_(0.1)
    return t


@pytest.fixture(scope="module")
def batch(target):
    g = torch.Generator().manual_seed(0)
    ids = torch.randint(0, V, (2, 24), generator=g)
    mask = torch.zeros(2, 24, dtype=torch.bool)
    mask[:, 6:] = True
    return batch_for(target, ids, mask, [24, 20])[0]


def drafter(name: str, target):
    """A fresh drafter of family ``name`` that distils the target's distribution where its config can (``distill:
    true``), with a reduced draft vocabulary where the family takes one."""
    family = registry.get(name)
    fields = family.config_class.model_fields
    kw: dict = {"algorithm": name, **({"distill": True} if "distill" in fields else {})}
    for depth in ("num_depths", "num_heads", "n_predict"):
        if depth in fields:
            kw[depth] = 3
    torch.manual_seed(0)
    try:
        return family.from_target(family.config_class(**kw, draft_vocab_size=64), target,
                                  DraftVocab.from_counts(torch.arange(V, 0, -1), 64))
    except (ValueError, SpeculatorsError):
        return family.from_target(family.config_class(**kw), target, DraftVocab.full(V))


def _train(unit: TrainingUnit, opt, batch, steps: int = 3) -> list[float]:
    before = {n: p.detach().clone() for n, p in unit.named_parameters() if p.requires_grad}
    losses = []
    unit.train()
    for _ in range(steps):
        loss, _ = unit.loss(batch)
        opt.zero_grad()
        loss.backward()
        opt.step()
        losses.append(float(loss.detach()))
    assert all(torch.isfinite(torch.tensor(losses))), losses
    moved = [n for n, p in unit.named_parameters() if p.requires_grad and not torch.equal(p.detach(), before[n])]
    assert moved, "no parameter changed"
    return losses


@pytest.mark.parametrize("name", FAMILIES)
def test_every_family_trains_with_every_loss_that_applies(name, target, batch):
    base = drafter(name, target)
    if not base.distills:  # hard labels (DFlash, DSpark): only the default, and a clear refusal otherwise
        with pytest.raises(SpeculatorsError, match="train.loss"):
            set_distill_loss(base, TrainSpec(loss="tv"))
        set_distill_loss(base, TrainSpec())
        return
    first = {}
    for loss in DIVERGENCES:
        d = copy.deepcopy(base)
        d.attach_target(target)
        set_distill_loss(d, TrainSpec(loss=loss))
        assert d.distill_loss.terms == {loss: 1.0}
        unit = TrainingUnit(d)
        first[loss] = _train(unit, torch.optim.AdamW(unit.param_groups(3e-3)[0]["params"], lr=3e-3), batch)[0]
    assert len(set(first.values())) == len(first), first  # each loss is its own objective


def test_muon_takes_every_hidden_matrix_and_leaves_embeddings_and_declared_heads():
    """Only the embeddings and the declared heads stay on AdamW, whatever their names and sizes: a hidden matrix
    whose output equals the draft vocabulary (fc 3H -> H with draft_vocab_size == H) or the full vocabulary is
    still a hidden matrix, and a declared head of any name (``proj_out``) is still a head."""
    H = 8
    unit = torch.nn.Module()
    unit.embed_tokens = torch.nn.Embedding(32, H)
    unit.fc = torch.nn.Linear(3 * H, H, bias=False)
    unit.mlp = torch.nn.Linear(H, 32, bias=False)  # an up-projection the size of the full vocabulary
    unit.proj_out = torch.nn.Linear(H, H, bias=False)  # a head over a draft vocabulary of H tokens
    unit.heads = torch.nn.ModuleList([torch.nn.Linear(H, 32, bias=False)])
    unit.norm = torch.nn.LayerNorm(H)
    groups = [{"params": list(unit.parameters()), "lr": 1.0, "name": "all"}]
    muon, adamw = muon_split(unit, groups, [unit.proj_out, *unit.heads])
    on_muon = {id(p) for g in muon for p in g["params"]}
    assert on_muon == {id(unit.fc.weight), id(unit.mlp.weight)}
    assert [g["name"] for g in muon] == ["all_muon"]
    assert {id(p) for g in adamw for p in g["params"]} == {id(p) for p in unit.parameters()} - on_muon


@pytest.mark.parametrize("name", FAMILIES)
def test_every_family_declares_exactly_its_vocabulary_heads(name, target):
    """``output_heads()`` lists exactly the drafter's linear maps onto a vocabulary: with a draft vocabulary of 37
    tokens (a size no hidden matrix of the tiny target has), every ``nn.Linear`` whose output is 37 or the target's
    vocabulary is declared, and nothing else is."""
    family = registry.get(name)
    torch.manual_seed(0)
    try:
        d = family.from_target(family.config_class(algorithm=name, draft_vocab_size=37), target,
                               DraftVocab.from_counts(torch.arange(V, 0, -1), 37))
    except (ValueError, SpeculatorsError):  # a family that drafts over the full vocabulary only
        d = family.from_target(family.config_class(algorithm=name), target, DraftVocab.full(V))
    by_shape = {id(m) for m in d.modules() if isinstance(m, torch.nn.Linear) and m.out_features in (37, V)}
    declared = {id(m) for m in d.output_heads()}
    assert declared == by_shape, (name, [type(m).__name__ for m in d.output_heads()])


@pytest.mark.parametrize("name", FAMILIES)
def test_muon_splits_a_family_the_same_whether_or_not_the_draft_vocabulary_equals_the_hidden_size(name, target):
    """The split is by role: with ``draft_vocab_size == hidden_size`` every hidden matrix of that size (fc, o_proj,
    ...) is a head-sized matrix, and the same parameters must still go to Muon as with a draft vocabulary of
    another size (the split is compared by parameter name between the two builds)."""
    family = registry.get(name)
    if family.config_class.full_vocab_only:
        pytest.skip(f"{name} drafts over the full vocabulary only")
    split = {}
    for n in (64, H):
        torch.manual_seed(0)
        d = family.from_target(family.config_class(algorithm=name, draft_vocab_size=n), target,
                               DraftVocab.from_counts(torch.arange(V, 0, -1), n))
        unit = TrainingUnit(d)
        muon, _ = muon_split(unit, unit.param_groups(1e-3), d.output_heads())
        ids = {id(p) for g in muon for p in g["params"]}
        split[n] = sorted(k for k, p in unit.named_parameters() if id(p) in ids)
    assert split[64] and split[H] == split[64], (split[64], split[H])


@pytest.mark.parametrize("name", FAMILIES)
def test_every_family_trains_with_muon(name, target, batch):
    d = drafter(name, target)
    unit = TrainingUnit(d)
    opt, names = build_optimizer(unit, unit.param_groups(1e-3), TrainSpec(optimizer="muon", lr=1e-3),
                                 d.output_heads())
    assert isinstance(opt, MuonAdamW) and len(names) == len(opt.param_groups)
    muon = [p for g in opt.parts[0].param_groups for p in g["params"]] if type(opt.parts[0]).__name__ == "Muon" else []
    assert muon, "no hidden matrix went to Muon"
    kept = {id(m.weight) for m in unit.modules() if isinstance(m, torch.nn.Embedding)}
    kept |= {id(p) for h in d.output_heads() for p in h.parameters()}
    for p in muon:  # hidden matrices only: never an embedding or an output head
        assert p.dim() == 2 and min(p.shape) > 1 and id(p) not in kept
    trained = {id(p) for p in unit.parameters() if p.requires_grad}
    placed = {id(p) for g in opt.param_groups for p in g["params"]}
    assert trained == placed  # every trainable parameter has exactly one optimizer
    _train(unit, opt, batch)
    sd = opt.state_dict()
    assert sd["parts"][0] == "Muon" and len(sd["states"]) == len(opt.parts)
