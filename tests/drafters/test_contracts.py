"""Contracts every registered drafter family must meet.

Parametrised over ``registry.names()`` (plus a ``+joint`` variant for every family whose config has a
``joint`` field), so a new family gets these tests for free:

* greedy speculative decoding == plain greedy decoding, several prompt lengths, K in {1, 3, 5}, with a
  briefly trained drafter that has both accepted and rejected drafts;
* batched: B > 1 with prompts of different lengths, per-request K and continuous batching
  (batch_size < number of prompts) gives every request its plain greedy output; the batched
  ``propose`` / ``advance`` equal the batch-of-one calls under mixed per-request sampling settings;
* seeded sampling is reproducible (same seed -> same tokens, other seeds -> other tokens) and
  ``Proposal.probs`` rows are distributions consistent with the sampled ids (support, top-k, and the
  empirical frequency of the first draft);
* ``save_pretrained`` -> ``Drafter.from_pretrained`` gives identical weights, config and proposals;
* ``propose`` leaves the state unchanged, and ``advance`` after a ``propose`` equals ``advance`` alone;
* CLI ``train`` -> ``eval`` on the family's tiny recipe (``recipes/tiny-*.yaml`` whose
  ``drafter.algorithm`` is the family).

The family-specific maths (label shifts, masks, losses by hand, export names) stays in the per-family
test files. Every per-request call of ``Drafter.propose`` goes through :func:`propose` below (a batch of one).
"""

from __future__ import annotations

import copy
import dataclasses
import json
from pathlib import Path

import pytest
import torch
import yaml

from speculators.drafters import Drafter, registry
from speculators.data.vocab import DraftVocab
from speculators.drafters.checkpoint import TargetMeta
from speculators.errors import SpeculatorsError
from speculators.decode.proposal import request_sampling
from speculators.decode.loop import plain_decode, speculative_decode, speculative_generate
from speculators.decode.proposers import NGramProposer
from speculators.verify import SamplingParams
from speculators.target import build_tiny_target
from speculators.train.unit import TrainingUnit
from speculators.decode.tree_spec import TreeSpec
from conftest import batch_for, cli_train_then_eval

V = 128            # tiny target: vocab 128, hidden 32, 2 layers (seconds for everything below)
HIDDEN, LAYERS = 32, 3  # 3 layers: EAGLE-3 / P-EAGLE need three distinct taps
REDUCED = 64       # draft vocabulary for families that support one
RECIPES = Path(__file__).resolve().parents[2] / "recipes"
GEN = 20           # new tokens per decoded request
PROMPT_LENGTHS = (3, 8, 17)
SAMPLING = SamplingParams.uniform(1, temperature=0.9, top_k=8, top_p=0.95)

FAMILIES = registry.names()
JOINT = [n for n in FAMILIES if "joint" in registry.get(n).config_class.model_fields]
VARIANTS = [(n, False) for n in FAMILIES] + [(n, True) for n in JOINT]
VARIANT_IDS = [n + ("+joint" if j else "") for n, j in VARIANTS]


def propose(drafter, state, k: int, sampling: SamplingParams | None = None,
            generator: torch.Generator | None = None):
    """ONE request through the batched ``Drafter.propose`` (a batch of one; greedy when ``sampling`` is
    None): the call site of the per-request view in this module."""
    out = drafter.propose([state], [k], sampling, None if generator is None else [generator])
    assert isinstance(out, list) and len(out) == 1
    return out[0]


def advance(drafter, state, new_ids, features) -> None:
    """ONE request through the batched ``Drafter.advance`` (a batch of one)."""
    drafter.advance([state], [new_ids], [features])


def new_target():
    """The tiny random Llama with an UNTIED random output head: with the tied head a random model just
    repeats its last token, so every draft of "the same token again" would be accepted; untied, its
    greedy chains are varied (they fall into a cycle of a dozen distinct tokens)."""
    t = build_tiny_target(vocab_size=V, hidden_size=HIDDEN, num_layers=LAYERS, seed=1)
    head = torch.randn(V, HIDDEN, generator=torch.Generator().manual_seed(1))
    t.model.lm_head.weight = torch.nn.Parameter(head, requires_grad=False)
    t.model.config.tie_word_embeddings = False
    return t


def prompts(seed: int = 0) -> list[list[int]]:
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(0, V, (n,), generator=g).tolist() for n in PROMPT_LENGTHS]


def greedy_data(target, n_other: int = 2):
    """Training rows: prompts + the target's greedy continuation. The first two test prompts are
    among them (memorised: drafts get accepted), the third is not (drafts get rejected)."""
    ps = prompts()[:2] + [torch.randint(0, V, (5,), generator=torch.Generator().manual_seed(100 + i)).tolist()
                          for i in range(n_other)]
    rows = [p + plain_decode(target, p, GEN + 8, eos_ids=set()).tokens for p in ps]
    T = max(len(r) for r in rows)
    ids = torch.zeros(len(rows), T, dtype=torch.int64)
    mask = torch.zeros(len(rows), T, dtype=torch.bool)
    for i, (p, r) in enumerate(zip(ps, rows)):
        ids[i, :len(r)] = torch.tensor(r)
        mask[i, len(p):len(r)] = True
    return ids, mask, [len(r) for r in rows]


def build_drafter(name: str, joint: bool, train_steps: int = 15):
    """A briefly trained drafter of family ``name`` (and its target, LoRA-adapted in place when
    ``joint``), in eval mode. Uses a reduced draft vocabulary when the family accepts one."""
    target = new_target()
    family = registry.get(name)
    kw: dict = {"algorithm": name}
    for depth in ("num_depths", "num_heads", "n_predict"):  # P-EAGLE, Medusa, MLP speculator: as deep as the largest K
        if depth in family.config_class.model_fields:  # (a K above the trained depth is refused, not capped)
            kw[depth] = 5
    if "init" in family.config_class.model_fields:  # draft model: layer-skip init from this tiny target agrees with
        kw["init"] = "random"                        # it everywhere (its embedding dominates); a random start rejects
    if joint:
        kw.update(joint=True, joint_target={"lora_r": 4, "lr": 3e-3})
    ids, mask, lengths = greedy_data(target)
    counts = torch.bincount(ids[mask], minlength=V) + 1  # the draft vocab covers the target's tokens
    torch.manual_seed(0)
    try:
        cfg = family.config_class(**kw, draft_vocab_size=REDUCED)
        d = family.from_target(cfg, target, DraftVocab.from_counts(counts, REDUCED))
    except (ValueError, SpeculatorsError):  # full-vocabulary family
        cfg = family.config_class(**kw)
        d = family.from_target(cfg, target, DraftVocab.full(V))
    if joint:
        target.adapt_lora(cfg.joint_target)
    unit = TrainingUnit(d, target if joint else None)
    batch, _ = batch_for(target, ids, mask, lengths)
    opt = torch.optim.AdamW(unit.param_groups(1e-2))
    unit.train()
    for _ in range(train_steps):
        loss, _ = unit.loss(batch)
        opt.zero_grad()
        loss.backward()
        opt.step()
    unit.eval()
    if joint:
        with torch.no_grad():  # make sure the adapter really moved the verifier
            for p in target.lora_parameters():
                p.add_(torch.randn(p.shape, generator=torch.Generator().manual_seed(3)) * 0.05)
    return target, d


@pytest.fixture(scope="module", params=VARIANTS, ids=VARIANT_IDS)
def family(request):
    """``(name, joint, target, trained drafter)``, built once per variant."""
    name, joint = request.param
    target, d = build_drafter(name, joint)
    return name, joint, target, d


def started(target, d, prompt):
    """The drafter state right after the prompt + the target's first greedy token (as the loop does)."""
    sess = target.session()
    logits, feats = sess.forward(torch.tensor(prompt))
    first = int(logits[-1].argmax())
    return d.start(torch.tensor(prompt + [first]), feats)


def assert_same(a, b, path="state"):
    """Deep equality of drafter states: tensors (shape, dtype, values), containers, dataclasses, objects."""
    if isinstance(a, torch.Tensor):
        assert isinstance(b, torch.Tensor), path
        assert a.shape == b.shape and a.dtype == b.dtype and torch.equal(a, b), path
    elif isinstance(a, (list, tuple)):
        assert type(a) is type(b) and len(a) == len(b), path
        for i, (x, y) in enumerate(zip(a, b)):
            assert_same(x, y, f"{path}[{i}]")
    elif isinstance(a, dict):
        assert a.keys() == b.keys(), path
        for k in a:
            assert_same(a[k], b[k], f"{path}[{k!r}]")
    elif dataclasses.is_dataclass(a) or hasattr(a, "__dict__"):
        assert type(a) is type(b), path
        assert_same(vars(a), vars(b), path)
    else:
        assert a == b, path


# ----------------------------------------------------------------------------- greedy == plain


def test_greedy_speculative_equals_plain(family):
    name, _, target, d = family
    accepted = rejected = 0
    for prompt in prompts():
        plain = plain_decode(target, prompt, GEN)
        for k in (1, 3, 5):
            spec = speculative_decode(target, d, prompt, k, GEN)
            assert spec.tokens == plain.tokens, (name, len(prompt), k)
            assert len(spec.accepted) == len(spec.drafted) == spec.target_forwards
            assert all(0 <= a <= n <= k for a, n in zip(spec.accepted, spec.drafted))
            accepted += sum(spec.accepted)
            rejected += sum(n - a for a, n in zip(spec.accepted, spec.drafted))
    assert accepted > 0 and rejected > 0, (accepted, rejected)  # both verifier branches exercised


@pytest.mark.parametrize("k", [1, 3, 5])
def test_ngram_greedy_speculative_equals_plain(k):
    target = new_target()
    for prompt in prompts(1):
        prompt = prompt + prompt  # repeats: the n-gram proposer finds matches
        assert speculative_decode(target, NGramProposer(), prompt, k, GEN).tokens == \
            plain_decode(target, prompt, GEN).tokens


# ----------------------------------------------------------------------------- batched (B > 1)
BATCH_LENGTHS = (3, 8, 17, 5, 12)
BATCH_KS = [1, 3, 5, 0, 4]  # per request; 0 = plain decoding inside the speculative batch


def batch_prompts(seed: int = 0) -> list[list[int]]:
    """The contract prompts (two memorised by the drafter) plus two more, of different lengths."""
    g = torch.Generator().manual_seed(50 + seed)
    extra = [torch.randint(0, V, (n,), generator=g).tolist() for n in BATCH_LENGTHS[3:]]
    return prompts(seed) + extra


def check_result_steps(r, k: int) -> None:
    n = r.target_forwards
    assert len(r.accepted) == len(r.drafted) == len(r.emitted) == len(r.verifier_accepted) == n
    assert all(0 <= va <= d <= k and 1 <= e <= va + 1 for va, d, e in zip(r.verifier_accepted, r.drafted, r.emitted))
    assert len(r.tokens) == (1 + sum(r.emitted) if r.tokens else 0)


@pytest.mark.parametrize("batch_size", [2, 5])
def test_batched_greedy_equals_plain(family, batch_size):
    """B > 1 with prompts of different lengths, per-request K (one of them 0) and continuous
    batching (batch_size < number of prompts: requests join as others finish): every request's greedy
    output equals its plain greedy output, and its steps are recorded as a batch-1 decode records them."""
    name, _, target, d = family
    ps = batch_prompts()
    plain = [plain_decode(target, p, GEN).tokens for p in ps]
    # different lengths per request too, so requests leave at different steps
    max_new = [GEN, GEN - 7, GEN, GEN - 3, GEN]
    out = speculative_generate(target, d, ps, BATCH_KS, max_new, None, batch_size)
    assert [len(r.tokens) for r in out.results] == max_new  # no stop ids on the tiny target
    accepted = rejected = 0
    for i, r in enumerate(out.results):
        assert r.tokens == plain[i][:max_new[i]], (name, i, len(ps[i]), BATCH_KS[i])
        check_result_steps(r, BATCH_KS[i])
        accepted += sum(r.verifier_accepted)
        rejected += sum(n - a for n, a in zip(r.drafted, r.verifier_accepted))
    assert sum(out.results[3].drafted) == 0  # k = 0: plain steps
    assert accepted > 0 and rejected > 0, (accepted, rejected)
    assert out.target_forwards < sum(r.target_forwards for r in out.results)  # steps were shared


def test_batched_propose_and_advance_equal_per_request(family):
    """The batched ``propose`` / ``advance`` of a family (its own or the default loop) give every request
    what a batch of one gives it: same ids, same probabilities, same state afterwards. Mixed per-request
    sampling (one greedy, one top-k, one top-p), per-request generators, ragged K (one 0)."""
    _, _, target, d = family
    ps = batch_prompts()[:4]
    sp = SamplingParams(temperature=torch.tensor([0.9, 0.0, 1.2, 0.7]), top_k=torch.tensor([8, 0, 0, 5]),
                        top_p=torch.tensor([1.0, 1.0, 0.9, 1.0]))
    ks = [3, 2, 5, 0]

    def states():
        return [started(target, d, p) for p in ps]

    def gens(seed):
        return [torch.Generator().manual_seed(seed + i) for i in range(len(ps))]

    batched = d.propose(states(), ks, sp, gens(7))
    assert isinstance(batched, list) and len(batched) == len(ps)
    assert batched[3].token_ids.numel() == 0
    for i, (state, k) in enumerate(zip(states(), ks)):
        one = propose(d, state, k, request_sampling(sp, i), gens(7)[i])
        assert batched[i].token_ids.tolist() == one.token_ids.tolist(), i
        if one.probs is None or one.token_ids.numel() == 0:
            assert batched[i].probs is None or batched[i].token_ids.numel() == 0, i
        else:
            torch.testing.assert_close(batched[i].probs, one.probs, atol=1e-5, rtol=1e-4)
    assert batched[1].probs is None  # the greedy request: point masses
    # batched advance with ragged new tokens == advance one at a time (same proposals afterwards)
    seqs = [p + plain_decode(target, p, 6, eos_ids=set()).tokens for p in ps]
    feats = [target.session().forward(torch.tensor(s))[1] for s in seqs]
    m = [1, 3, 2, 4]
    a_states, b_states = [], []
    for s, f, mi, p in zip(seqs, feats, m, ps):
        n = len(p)
        a_states.append(d.start(torch.tensor(s[:n + 1]), f.slice(0, n)))
        b_states.append(d.start(torch.tensor(s[:n + 1]), f.slice(0, n)))
    new_ids = [torch.tensor(s[len(p) + 1:len(p) + 1 + mi]) for s, p, mi in zip(seqs, ps, m)]
    new_feats = [f.slice(len(p), len(p) + mi) for f, p, mi in zip(feats, ps, m)]
    d.advance(a_states, new_ids, new_feats)
    for st, ids, f in zip(b_states, new_ids, new_feats):
        advance(d, st, ids, f)
    after_a = d.propose(a_states, [3] * 4)
    after_b = [propose(d, st, 3) for st in b_states]
    assert [p.token_ids.tolist() for p in after_a] == [p.token_ids.tolist() for p in after_b]
    with pytest.raises(SpeculatorsError, match="ks"):
        d.propose(states(), [1, 2], None)


@pytest.mark.parametrize("batch_size", [1, 3])
def test_ngram_batched_greedy_equals_plain(batch_size):
    target = new_target()
    ps = [p + p for p in batch_prompts(1)]  # repeats: the n-gram proposer finds matches
    out = speculative_generate(target, NGramProposer(), ps, [2, 4, 1, 3, 5], GEN, None, batch_size)
    drafted = 0
    for p, r, k in zip(ps, out.results, [2, 4, 1, 3, 5]):
        assert r.tokens == plain_decode(target, p, GEN).tokens
        check_result_steps(r, k)
        drafted += sum(r.drafted)
    assert drafted > 0


# ----------------------------------------------------------------------------- seeded sampling


def test_seeded_sampling_is_reproducible(family):
    _, _, target, d = family
    prompt = prompts()[1]
    runs = {s: speculative_decode(target, d, prompt, 3, GEN, SAMPLING, seed=s).tokens for s in range(3)}
    assert speculative_decode(target, d, prompt, 3, GEN, SAMPLING, seed=0).tokens == runs[0]
    assert all(len(t) == GEN for t in runs.values())
    assert len({tuple(t) for t in runs.values()}) > 1  # other seeds give other tokens somewhere
    state = started(target, d, prompt)
    a = propose(d, state, 3, SAMPLING, torch.Generator().manual_seed(7))
    b = propose(d, state, 3, SAMPLING, torch.Generator().manual_seed(7))
    assert a.token_ids.tolist() == b.token_ids.tolist() and torch.equal(a.probs, b.probs)


def test_proposal_probs_are_distributions_consistent_with_the_ids(family):
    _, _, target, d = family
    state = started(target, d, prompts()[2])
    p = propose(d, state, 3, SAMPLING, torch.Generator().manual_seed(1))
    n = p.token_ids.numel()
    assert 1 <= n <= 3 and p.token_ids.dtype == torch.int64
    assert p.probs is not None and p.probs.shape == (n, V) and p.probs.dtype == torch.float32
    assert (p.probs >= 0).all()
    torch.testing.assert_close(p.probs.sum(-1), torch.ones(n))
    assert all(p.probs[i, p.token_ids[i]] > 0 for i in range(n))  # each id drawn from its own row
    assert ((p.probs > 0).sum(-1) <= SAMPLING.top_k).all()  # the request's top-k applies to drafts
    # the first draft's empirical frequency matches probs[0]
    g = torch.Generator().manual_seed(2)
    first = SamplingParams.uniform(1, temperature=1.0, top_k=4, top_p=1.0)
    q = propose(d, state, 1, first, torch.Generator().manual_seed(0)).probs[0]
    N = 400
    counts = torch.bincount(torch.tensor([int(propose(d, state, 1, first, g).token_ids[0]) for _ in range(N)]),
                            minlength=V).float()
    assert counts[q == 0].sum() == 0
    assert 0.5 * float((counts / N - q).abs().sum()) < 0.1
    # greedy proposals carry no probabilities or point masses on the ids
    gp = propose(d, state, 3)
    if gp.probs is not None:
        torch.testing.assert_close(gp.probs, torch.nn.functional.one_hot(gp.token_ids, V).float())


# ----------------------------------------------------------------------------- save / load


def test_save_load_round_trip(family, tmp_path):
    name, joint, target, d = family
    path = d.save_pretrained(tmp_path / "ckpt", recipe_yaml="x: 1\n", target=target)  # joint: + its adapter
    loaded = Drafter.from_pretrained(path)
    assert type(loaded) is type(d) and loaded.algorithm == name
    assert loaded.cfg == d.cfg
    # typed target facts survive the round trip exactly (target_config is stored JSON-normalised)
    assert isinstance(loaded.meta, TargetMeta) and loaded.meta == d.meta
    assert loaded.meta.to_json() == json.loads(json.dumps(d.meta.to_json()))
    mine, theirs = d.serving.state_dict(d), loaded.serving.state_dict(loaded)  # every exported tensor
    assert mine.keys() == theirs.keys()
    for k, v in mine.items():
        assert v.dtype == theirs[k].dtype and torch.equal(v, theirs[k]), k
    if joint:
        assert loaded.target_adapter_dir == path / "target_adapter"
    loaded.attach_target(target)  # target-head families need the (same, here adapted) verifier
    loaded.eval()
    for prompt in prompts():
        sa, sb = started(target, d, prompt), started(target, loaded, prompt)
        assert propose(d, sa, 3).token_ids.tolist() == propose(loaded, sb, 3).token_ids.tolist()
        a = propose(d, sa, 3, SAMPLING, torch.Generator().manual_seed(4))
        b = propose(loaded, sb, 3, SAMPLING, torch.Generator().manual_seed(4))
        assert a.token_ids.tolist() == b.token_ids.tolist() and torch.equal(a.probs, b.probs)
    assert speculative_decode(target, loaded, prompts()[0], 3, GEN).accepted == \
        speculative_decode(target, d, prompts()[0], 3, GEN).accepted
    assert not any(p.name.startswith(".") for p in tmp_path.iterdir())  # no temp dir left behind


# ----------------------------------------------------------------------------- propose is pure


def test_propose_leaves_the_state_unchanged(family):
    _, _, target, d = family
    prompt = prompts()[2]
    seq = prompt + plain_decode(target, prompt, 6, eos_ids=set()).tokens
    n = len(prompt)
    # the state after prompt + first token, then advanced by 3 verified tokens
    sess = target.session()
    _, feats = sess.forward(torch.tensor(seq))
    state = d.start(torch.tensor(seq[:n + 1]), feats.slice(0, n))
    advance(d, state, torch.tensor(seq[n + 1:n + 4]), feats.slice(n, n + 3))
    before = copy.deepcopy(state)
    g1 = propose(d, state, 5)
    assert_same(state, before)
    g2 = propose(d, state, 5)
    assert g1.token_ids.tolist() == g2.token_ids.tolist()
    propose(d, state, 4, SAMPLING, torch.Generator().manual_seed(0))
    assert_same(state, before)
    # advance after a propose == advance without one
    clean = copy.deepcopy(before)
    advance(d, state, torch.tensor(seq[n + 4:n + 6]), feats.slice(n + 3, n + 5))
    advance(d, clean, torch.tensor(seq[n + 4:n + 6]), feats.slice(n + 3, n + 5))
    assert_same(state, clean)
    assert propose(d, state, 5).token_ids.tolist() == propose(d, clean, 5).token_ids.tolist()


# ----------------------------------------------------------------------------- CLI


def tiny_recipes() -> dict[str, Path]:
    out: dict[str, Path] = {}
    for p in sorted(RECIPES.glob("tiny-*.yaml")):
        algo = (yaml.safe_load(p.read_text()).get("drafter") or {}).get("algorithm")
        out.setdefault(algo, p)
    return out


@pytest.fixture(scope="module")
def shared_cache(tmp_path_factory):
    """One speculators cache for the module's CLI runs: the first regenerates, the others reuse it."""
    mp = pytest.MonkeyPatch()
    path = tmp_path_factory.mktemp("contract-cache")
    mp.setenv("SPECULATORS_CACHE", str(path))
    yield path
    mp.undo()


@pytest.mark.parametrize("name", FAMILIES)
def test_cli_train_then_eval_on_the_tiny_recipe(name, tiny_target_dir, shared_cache, tmp_path):
    recipe = tiny_recipes().get(name)
    assert recipe is not None, f"family {name!r} has no recipes/tiny-*.yaml with drafter.algorithm: {name}"
    k = yaml.safe_load(recipe.read_text())["eval"]["k"]
    cfg, log, rep = cli_train_then_eval(recipe, tiny_target_dir, tmp_path / "run", "train.steps=3")
    layout = cfg.get("speculators_model_type", cfg.get("model_type"))
    # a draft model is a plain LM of the target's own architecture: its model_type is the target's
    assert layout == (cfg["speculators_training"]["target"]["target_config"]["model_type"] if name == "draft_model"
                      else name)
    assert cfg["speculators_training"]["drafter"]["algorithm"] == name
    train = {key.split("/", 1)[1] for row in log for key in row if key.startswith("train/")}
    held = {key.split("/", 1)[1] for row in log for key in row if key.startswith("held_out/")}
    assert {"loss", "sim_tau", "full_acc_0"} <= train
    assert train - {"lr", "grad_norm", "tokens_per_s"} <= held  # every drafter metric is also held out
    assert rep["k"] == k and rep["temperature"] == 0.0
    assert rep["greedy_mismatches"] == []
    dr = rep["drafter"]
    assert dr["tokens"] == rep["plain"]["tokens"] > 0
    assert dr["steps"] > 0 and 0 <= dr["accepted"] <= dr["drafted"] <= k * dr["steps"]
    assert 1.0 <= dr["tau"] <= k + 1


# ----------------------------------------------------------------------------- draft trees
TREES = [TreeSpec(depth=3, topk=2, total_tokens=6), TreeSpec.static("[(0,), (1,), (0, 0), (1, 0), (0, 0, 0)]")]


@pytest.mark.parametrize("tree", TREES, ids=["dynamic", "static"])
@pytest.mark.parametrize("batch_size", [1, 3])
def test_greedy_tree_decoding_equals_plain(family, tree, batch_size):
    """Every family decodes with draft trees (its own ``propose_tree`` where it declares ``drafts_trees``, else
    its chain verified as a one-branch tree): greedy output equals plain greedy decoding at batch 1 and
    batched, and the steps verify at most the tree's nodes and accept at most its depth."""
    name, _, target, d = family
    ps = batch_prompts()
    plain = [plain_decode(target, p, GEN).tokens for p in ps]
    out = speculative_generate(target, d, ps, 0, GEN, None, batch_size, tree=tree)
    accepted = 0
    for i, r in enumerate(out.results):
        assert r.tokens == plain[i], (name, i, tree.label)
        assert all(0 <= va <= min(n, tree.depth) and n <= tree.total_tokens
                   for va, n in zip(r.verifier_accepted, r.drafted))
        assert [len(x) for x in r.tree_ranks] == r.verifier_accepted
        accepted += sum(r.verifier_accepted)
    assert accepted > 0


def test_tree_drafting_leaves_the_states_unchanged(family):
    name, _, target, d = family
    if not getattr(d, "drafts_trees", False):
        pytest.skip(f"{name} drafts chains only (verified as one-branch trees)")
    states = [started(target, d, p) for p in batch_prompts()[:3]]
    before = copy.deepcopy(states)
    trees = d.propose_tree(states, TREES[1], [3, 1, 0])  # the static tree: every node it names, up to the cap
    assert [t.num_nodes for t in trees] == [5, 2, 0]
    assert int(trees[0].depths().max()) == 3 and int(trees[1].depths().max()) == 1
    for a, b in zip(states, before):
        assert_same(a, b)


@pytest.mark.parametrize("name", registry.names())
def test_a_full_vocabulary_family_refuses_a_draft_vocabulary_and_the_schema_says_so(name):
    """A family with ``full_vocab_only`` refuses ``draft_vocab_size`` with its reason; the others take one. The
    field's description (the recipe reference of docs/USAGE.md) names exactly the refusing families."""
    from pydantic import ValidationError

    cls = registry.get(name).config_class
    described = cls.model_fields["draft_vocab_size"].description
    if cls.full_vocab_only:
        with pytest.raises(ValidationError, match="draft_vocab_size") as e:
            cls(algorithm=name, draft_vocab_size=8)
        assert cls.full_vocab_only in str(e.value) and "full vocabulary" in cls.full_vocab_only
        assert f"`{name}`" in described, described
    else:
        assert cls(algorithm=name, draft_vocab_size=8).draft_vocab_size == 8
        assert f"`{name}`" not in described, described
