"""The trainer's normalisation and divergence handling.

* Gradient accumulation weights tokens, not micro-batches: one optimizer step over two conversations
  with 3 and 57 assistant tokens gives the same gradient with ``grad_accum: 1`` (both in one
  micro-batch) as with ``grad_accum: 2`` (one each), for every registered family and joint mode.
* Held-out metrics are per token: ``held_out/loss`` over two batches equals the loss of the two as one.
* A "last good checkpoint" is good: finite weights that gave a finite loss. A NaN loss at step s+1
  condemns checkpoint s (renamed ``diverged-step-N``, skipped by ``--resume`` and ``speculators eval``);
  non-finite weights are never written, never resumed from and refused by ``Drafter.from_pretrained``.
* The trainer steps one training unit: what it logs and writes about the target comes
  from the unit (held-out perplexity, model card lines, per-group learning rates).
"""

from __future__ import annotations

import math
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch
import yaml
from safetensors.torch import load_file, save_file
from typer.testing import CliRunner

import speculators.drafters.eagle  # noqa: F401  (registers the families)
import speculators.drafters.eagle3  # noqa: F401
import speculators.drafters.medusa  # noqa: F401
import speculators.drafters.mtp  # noqa: F401
from speculators.cli import app
from speculators.data.dataset import collate
from speculators.data.features import FeatureStore
from speculators.drafters import Drafter, registry
from speculators.data.vocab import DraftVocab
from speculators.drafters.checkpoint import init_from_checkpoint
from speculators.errors import SpeculatorsError
from speculators.recipe import load_recipe
from speculators.target import build_tiny_target
from speculators.train.run_dir import checkpoints, model_card
from speculators.train.trainer import Trainer
from speculators.train.unit import TrainingUnit

ROOT = Path(__file__).resolve().parents[2]
V = 96
N_DRAFT = 64  # a reduced draft vocabulary: masks that read the target's argmax are exercised too
LENGTHS = (12, 64)
N_ASSISTANT = (3, 57)  # assistant tokens of the two conversations (the last ones of each)


def tiny_recipe(algorithm: str) -> Path:
    recipes = {yaml.safe_load(p.read_text())["drafter"]["algorithm"]: p for p in ROOT.glob("recipes/tiny-*.yaml")}
    return recipes[algorithm]


# (id, algorithm, drafter overrides, joint)
CASES = [(a, a, {}, False) for a in registry.names()] + [
    ("medusa-joint-distill", "medusa", {"distill": True}, True),
    ("mtp-joint", "mtp", {}, True),
]


def family_fields(algorithm: str) -> set[str]:
    return set(registry.get(algorithm).config_class.model_fields)


def make_drafter(target, algorithm: str, overrides: dict, joint: bool, counts: torch.Tensor) -> TrainingUnit:
    """The training unit of a fresh ``algorithm`` drafter (with ``joint``: and ``target`` adapted with
    LoRA in place, its adapters perturbed)."""
    raw = yaml.safe_load(tiny_recipe(algorithm).read_text())["drafter"]
    raw.update(overrides)
    if raw.get("draft_vocab_size"):
        raw["draft_vocab_size"] = N_DRAFT
    if algorithm == "eagle":
        raw["noise"] = 0.0  # random feature noise is drawn per padded batch shape: not split-invariant
    # families that SAMPLE their training elements (P-EAGLE's COD depths, DFlash's anchors) draw per batch: keep
    # every element so that the loss is a deterministic function of the data and a split can be compared
    if "r_min" in family_fields(algorithm):
        raw.update(r=1.0, r_min=1.0)
    if "num_anchors" in family_fields(algorithm):
        raw["num_anchors"] = 100_000
    if "init" in family_fields(algorithm):
        # a layer-skip copy of the tiny random target reproduces it (loss ~1e-15): no gradient to compare
        raw["init"] = "random"
    if joint:
        raw["joint"] = True
    family = registry.get(algorithm)
    cfg = family.config_class.model_validate(raw)
    torch.manual_seed(0)
    d = family.from_target(cfg, target, DraftVocab.from_counts(counts, cfg.draft_vocab_size))
    if joint:
        target.adapt_lora(cfg.joint_target)
        g = torch.Generator().manual_seed(3)
        with torch.no_grad():  # B = 0 at init: perturb so that the live target differs from the cache
            for p in target.lora_parameters():
                p.add_(torch.randn(p.shape, generator=g) * 0.3)
    return TrainingUnit(d, target if joint else None)


def feature_store(target, lengths=LENGTHS, n_assistant=N_ASSISTANT, seed: int = 0) -> FeatureStore:
    """Conversations of ``lengths`` tokens whose last ``n_assistant`` tokens are the assistant's, with
    the target's own features (as the feature cache stores them)."""
    g = torch.Generator().manual_seed(seed)
    rows = {k: [] for k in ("input_ids", "loss_mask", "argmax", "aux", "top")}
    for n, a in zip(lengths, n_assistant):
        ids = torch.randint(0, V, (1, n), generator=g)
        f = target.features(ids, with_logits=True)
        mask = torch.zeros(n, dtype=torch.bool)
        mask[n - a:] = True
        for k, v in (("input_ids", ids[0]), ("loss_mask", mask), ("argmax", f.logits[0].argmax(-1)),
                     ("aux", f.aux[0].float()), ("top", f.top[0].float())):
            rows[k].append(v)
    offsets = torch.tensor([0, *torch.tensor(lengths).cumsum(0).tolist()])
    return FeatureStore([f"ex{i}" for i in range(len(lengths))], offsets,
                        *(torch.cat(rows[k]) for k in ("input_ids", "loss_mask", "argmax", "aux", "top")))


def trainer(tmp_path: Path, algorithm: str, drafter, store, grad_accum: int, batch_tokens: int,
            held_out=None) -> Trainer:
    rec = load_recipe(tiny_recipe(algorithm), [f"train.grad_accum={grad_accum}",
                                               f"train.batch_tokens={batch_tokens}"])
    data = SimpleNamespace(train=store, held_out=held_out)
    return Trainer(rec, drafter, data, tmp_path / f"run-ga{grad_accum}", log=lambda *_: None)


def grads(d) -> torch.Tensor:
    ps = [p for p in d.parameters() if p.requires_grad]
    return torch.cat([(p.grad if p.grad is not None else torch.zeros_like(p)).flatten() for p in ps])


def zero_grads(d) -> None:
    for p in d.parameters():
        p.grad = None


def cosine(a: torch.Tensor, b: torch.Tensor) -> float:
    return float(torch.nn.functional.cosine_similarity(a.double(), b.double(), dim=0))


# ----------------------------------------------------------------------------- item 7


@pytest.mark.parametrize("case", CASES, ids=[c[0] for c in CASES])
def test_accumulated_gradient_equals_the_big_batch_gradient(case, tmp_path):
    _, algorithm, overrides, joint = case
    target = build_tiny_target(vocab_size=V, hidden_size=64, num_layers=4, seed=1)
    store = feature_store(target)
    counts = torch.bincount(store.input_ids, minlength=V) + torch.bincount(store.argmax, minlength=V)
    d = make_drafter(target, algorithm, overrides, joint, counts)

    big = trainer(tmp_path, algorithm, d, store, grad_accum=1, batch_tokens=4096)
    window = big._next_window()
    assert len(window) == 1 and window[0].input_ids.shape[0] == 2  # both conversations, one micro-batch
    loss_big, _ = big._backward_window(window)
    g_big = grads(d)
    assert float(g_big.norm()) > 1e-3  # a gradient worth comparing (cosine's eps would swamp a ~1e-16 one)
    zero_grads(d)

    acc = trainer(tmp_path, algorithm, d, store, grad_accum=2, batch_tokens=64)
    window = acc._next_window()
    assert [b.input_ids.shape[0] for b in window] == [1, 1]  # one conversation per micro-batch
    assert sorted(int(b.loss_mask.sum()) for b in window) == sorted(N_ASSISTANT)
    assert (acc.epoch, acc.batch_idx) == (0, 2)  # data position after the window
    loss_acc, _ = acc._backward_window(window)
    g_acc = grads(d)
    zero_grads(d)

    assert cosine(g_acc, g_big) > 0.9999
    # float32: padded vs unpadded forwards round differently (the joint target's gradients reach ~30)
    torch.testing.assert_close(g_acc, g_big, rtol=1e-4, atol=1e-5 * float(g_big.abs().max()))
    assert loss_acc == pytest.approx(loss_big, rel=1e-5)  # the logged window loss is the big-batch loss

    # the example discriminates: averaging the micro-batches' own means (the old behaviour) differs
    for b in window:
        loss, _ = d.loss(b)
        (loss / len(window)).backward()
    assert cosine(grads(d), g_big) < 0.999
    zero_grads(d)


@pytest.mark.parametrize("case", CASES, ids=[c[0] for c in CASES])
def test_loss_counts_match_the_default_normalisation(case):
    """``loss(batch, norm=loss_counts(batch))`` is today's loss; ``norm`` scales each term separately."""
    _, algorithm, overrides, joint = case
    target = build_tiny_target(vocab_size=V, hidden_size=64, num_layers=4, seed=1)
    store = feature_store(target)
    counts = torch.bincount(store.input_ids, minlength=V)
    d = make_drafter(target, algorithm, overrides, joint, counts)
    batch = collate([store.example(0), store.example(1)])
    c = d.loss_counts(batch)
    assert c.dtype == torch.int64 and (c > 0).all()
    ref, _ = d.loss(batch)
    same, _ = d.loss(batch, c)
    torch.testing.assert_close(same, ref)
    double, _ = d.loss(batch, 2 * c)
    torch.testing.assert_close(double, ref / 2)
    with pytest.raises(SpeculatorsError, match="norm"):
        d.drafter.loss(batch, torch.ones(len(c) + 3, dtype=torch.int64))


def test_held_out_loss_is_per_token_not_per_batch(tmp_path):
    target = build_tiny_target(vocab_size=V, hidden_size=64, num_layers=4, seed=1)
    store = feature_store(target)
    counts = torch.bincount(store.input_ids, minlength=V)
    d = make_drafter(target, "eagle3", {}, False, counts)
    t = trainer(tmp_path, "eagle3", d, store, grad_accum=1, batch_tokens=64, held_out=store)
    ev = t.evaluate_held_out()
    with torch.no_grad():
        d.eval()
        whole, _ = d.loss(collate([store.example(0), store.example(1)]))
        per_batch = [float(d.loss(collate([store.example(i)]))[0]) for i in range(2)]
        d.train()
    assert ev["held_out/loss"] == pytest.approx(float(whole), rel=1e-5)
    assert abs(sum(per_batch) / 2 - float(whole)) > 1e-3  # a per-batch mean would be wrong here


def test_joint_held_out_perplexity_log_line_and_card_come_from_the_unit(tmp_path):
    """the trainer steps a training unit and reports what the unit gives. For a joint
    unit ``held_out/ppl`` is the target's perplexity over ALL held-out assistant tokens (summed NLL /
    summed tokens, not a mean of per-batch perplexities), the summary line and the model card carry it;
    a frozen-target unit adds no target line."""
    target = build_tiny_target(vocab_size=V, hidden_size=64, num_layers=4, seed=1)
    store = feature_store(target)
    counts = torch.bincount(store.input_ids, minlength=V) + torch.bincount(store.argmax, minlength=V)
    unit = make_drafter(target, "mtp", {}, True, counts)
    t = trainer(tmp_path, "mtp", unit, store, grad_accum=1, batch_tokens=64, held_out=store)
    ev = t.evaluate_held_out()
    with torch.no_grad():
        outs = [target.train_forward(b.input_ids, b.attention_mask, b.loss_mask)
                for b in (collate([store.example(i)]) for i in range(2))]  # the two held-out batches
    nll, n = sum(o.nll_sum for o in outs), sum(o.n_labels for o in outs)
    assert n == sum(N_ASSISTANT)  # every assistant token is a label (none is the first token)
    assert ev["held_out/lm_loss"] == pytest.approx(nll / n, rel=1e-5)
    assert ev["held_out/ppl"] == pytest.approx(math.exp(nll / n), rel=1e-5)
    assert abs(sum(math.exp(o.nll_sum / o.n_labels) for o in outs) / 2 - ev["held_out/ppl"]) > 1e-3
    assert not [k for k in ev if k.endswith(("lm_nll_sum", "lm_tokens"))]  # sums are not metrics
    assert "drafter_loss" in " ".join(ev)
    lines = []
    t.log = lines.append
    t._held_out_eval()
    assert lines and f"target ppl {ev['held_out/ppl']:.3f}" in lines[-1]

    before = {**ev, "held_out/ppl": 2.0 * ev["held_out/ppl"]}
    card = model_card(t.unit, 3, 100, 60.0, before, ev)
    assert f"Target held-out perplexity: {before['held_out/ppl']:.4f} -> {ev['held_out/ppl']:.4f} (-50.00%)." in card
    assert "`target_adapter/`" in card and "| ppl |" in card and "# mtp drafter for" in card

    frozen = make_drafter(target, "eagle3", {}, False, counts)
    assert frozen.card_lines({"ppl": 2.0}, {"ppl": 1.0}) == []
    plain = model_card(frozen, 3, 100, 60.0, {}, {"held_out/loss": 1.0, "step": 3})
    assert "perplexity" not in plain and "target_adapter" not in plain and "| loss | - | 1.0000 |" in plain
    assert "target ppl" not in frozen.summary({"loss": 1.0, "sim_tau": 1.5})


# ----------------------------------------------------------------------------- item 8


def _nan_checkpoint(tmp_path: Path) -> tuple[Path, str]:
    target = build_tiny_target(vocab_size=V, hidden_size=64, num_layers=3, seed=1)  # EAGLE-3: three distinct taps
    d = make_drafter(target, "eagle3", {}, False, torch.ones(V, dtype=torch.int64))
    path = d.save(tmp_path / "ck")
    w = load_file(str(path / "model.safetensors"))
    name = sorted(k for k, v in w.items() if v.is_floating_point())[0]
    w[name].view(-1)[0] = float("nan")
    save_file(w, str(path / "model.safetensors"), metadata={"format": "pt"})
    return path, name


def test_from_pretrained_and_init_from_refuse_non_finite_weights(tmp_path):
    path, name = _nan_checkpoint(tmp_path)
    with pytest.raises(SpeculatorsError) as e:
        Drafter.from_pretrained(path)
    assert "model.safetensors" in str(e.value) and name in str(e.value) and "NaN" in str(e.value)
    target = build_tiny_target(vocab_size=V, hidden_size=64, num_layers=3, seed=1)
    d = make_drafter(target, "eagle3", {}, False, torch.ones(V, dtype=torch.int64))
    with pytest.raises(SpeculatorsError, match=name):
        init_from_checkpoint(d.drafter, path)


def _invoke(*args):
    return CliRunner().invoke(app, [str(a) for a in args])


@pytest.mark.parametrize("warmup", [0, 1])
def test_diverged_run_names_only_a_good_checkpoint_and_eval_refuses_a_bad_run(
        warmup, tmp_path, isolated_cache, tiny_target_dir):
    """``train.lr=1e30 train.checkpoint_every=1``: with warmup 1 the first update has lr 0 (step-1 = the
    initial weights, good); every later checkpoint gave a NaN loss at the next step and is set aside."""
    import json

    out = tmp_path / "run"
    r = _invoke("train", ROOT / "recipes" / "tiny-eagle3.yaml", f"target.model={tiny_target_dir}",
                "train.lr=1e30", "train.checkpoint_every=1", "train.eval_every=100",
                f"train.warmup_steps={warmup}", "-o", out)
    assert r.exit_code == 2, r.output
    err = " ".join(line.strip() for line in r.output.splitlines())
    assert "stopping" in err and "Last good checkpoint" in err
    good = checkpoints(out)
    logged = {row["step"]: row["train/loss"] for row in map(json.loads, (out / "train_log.jsonl").read_text().splitlines())
              if "train/loss" in row} if (out / "train_log.jsonl").is_file() else {}
    for ck in good:  # what is still called a checkpoint is good: finite weights that gave a finite loss
        s = int(ck.name.split("-")[1])
        assert math.isfinite(logged[s + 1]), (ck, logged)
        Drafter.from_pretrained(ck)
        assert str(ck) in err
    diverged = sorted(p.name for p in (out / "checkpoints").glob("diverged-step-*"))
    assert diverged  # the checkpoint written just before the NaN is not good
    for name in diverged:
        assert name in err
        assert not good or int(name.split("-")[-1]) > int(good[-1].name.split("-")[1])
    assert not (out / "final").exists()
    if warmup == 0:
        assert not good and "Last good checkpoint: none" in err
        r = _invoke("eval", out, "--temperature", "0")
        assert r.exit_code == 2, r.output
        assert "no good checkpoint" in r.output and diverged[0] in r.output
        assert "Traceback" not in r.output
    else:
        assert [p.name for p in good] == ["step-000001"]


def test_nan_loss_at_step_s_plus_1_condemns_checkpoint_s_only(tmp_path, isolated_cache, tiny_target_dir,
                                                                monkeypatch):
    family = registry.get("eagle3")
    original = family.loss
    calls = {"n": 0}

    def poisoned(self, batch, norm=None):
        loss, metrics = original(self, batch, norm)
        calls["n"] += 1
        return (loss * float("nan") if calls["n"] >= 4 else loss), metrics

    monkeypatch.setattr(family, "loss", poisoned)
    out = tmp_path / "run"
    r = _invoke("train", ROOT / "recipes" / "tiny-eagle3.yaml", f"target.model={tiny_target_dir}",
                "train.checkpoint_every=1", "train.eval_every=100", "-o", out)
    assert r.exit_code == 2, r.output
    err = " ".join(line.strip() for line in r.output.splitlines())
    # NaN at step 4 used the weights of update 3: step-3 is condemned, step-2 (finite loss at step 3) is good
    assert "step 4" in err and "Last good checkpoint:" in err and "step-000002" in err
    assert "diverged-step-000003" in err
    assert [p.name for p in checkpoints(out)] == ["step-000002"]
    assert (out / "checkpoints" / "diverged-step-000003" / "model.safetensors").is_file()
    # --resume continues from the good checkpoint, never the condemned one
    monkeypatch.setattr(family, "loss", original)
    r = _invoke("train", ROOT / "recipes" / "tiny-eagle3.yaml", f"target.model={tiny_target_dir}",
                "train.checkpoint_every=1", "train.eval_every=100", "-o", out, "--resume")
    assert r.exit_code == 0, r.output
    assert "step-000002" in r.output and "step 2/" in r.output.replace("\n", " ")
    assert math.isfinite(float(load_file(str(out / "final" / "model.safetensors"))["fc.weight"].sum()))


def test_resume_refuses_a_checkpoint_with_non_finite_weights(tmp_path):
    from speculators.train.run_dir import checkpoint_weights_problem

    path, name = _nan_checkpoint(tmp_path)
    problem = checkpoint_weights_problem(path)
    assert problem is not None and name in problem
    assert checkpoint_weights_problem(tmp_path / "nope") is not None


# ----------------------------------------------------------------------------- multi-process normalisation


def test_two_process_gradient_equals_the_one_batch_gradient(tmp_path):
    """Two DDP processes simulated in one: each rank accumulates its own micro-batches with the counts
    summed over both ranks (``accelerator.reduce``, patched) and its backward scaled by
    ``gradient_accumulation_steps * num_processes``; the DDP average of the two ranks' gradients must be
    the gradient of all four conversations as one batch. Without the ``num_processes`` factor the
    average is half of it; without the reduction each rank normalises by its own tokens only."""
    target = build_tiny_target(vocab_size=V, hidden_size=64, num_layers=4, seed=1)
    everything = feature_store(target, lengths=(12, 64, 40, 30), n_assistant=(3, 57, 10, 25))
    counts = torch.bincount(everything.input_ids, minlength=V) + torch.bincount(everything.argmax, minlength=V)
    d = make_drafter(target, "eagle3", {}, False, counts)

    def subset(store: FeatureStore, idx: list[int]) -> FeatureStore:
        ex = [store.example(i) for i in idx]
        offsets = torch.tensor([0, *torch.tensor([len(e["input_ids"]) for e in ex]).cumsum(0).tolist()])
        keys = ("input_ids", "loss_mask", "argmax", "aux", "top")
        return FeatureStore([store.ids[i] for i in idx], offsets, *(torch.cat([e[k] for e in ex]) for k in keys))

    class Rank:
        """The trainer's accelerator as rank ``r`` of 2 sees it (everything else is the real one)."""

        def __init__(self, real, other_counts: torch.Tensor):
            self._real, self._other, self.reduced = real, other_counts, []

        num_processes = 2

        def reduce(self, tensor, reduction="mean"):
            assert reduction == "sum"
            self.reduced.append(tensor.clone())
            return tensor + self._other.to(tensor.device)

        def __getattr__(self, name):
            return getattr(self._real, name)

    ranks = [trainer(tmp_path / f"rank{r}", "eagle3", d, subset(everything, idx), grad_accum=2, batch_tokens=64)
             for r, idx in enumerate(([0, 1], [2, 3]))]
    windows = [t._next_window() for t in ranks]
    assert [[b.input_ids.shape[0] for b in w] for w in windows] == [[1, 1], [1, 1]]  # one conversation each
    own = [torch.stack([t._counts(b) for b in w]).sum(0) for t, w in zip(ranks, windows)]
    per_rank = []
    for r, (t, w) in enumerate(zip(ranks, windows)):
        t.accelerator = Rank(t.accelerator, own[1 - r])
        t._backward_window(w)
        assert len(t.accelerator.reduced) == 1 and torch.equal(t.accelerator.reduced[0], own[r])
        per_rank.append(grads(d))
        zero_grads(d)
    g_ddp = (per_rank[0] + per_rank[1]) / 2  # DDP all-reduce: the mean over processes
    # the example discriminates: rank 0 normalising by its own counts only gives another gradient
    t = ranks[0]
    # (accelerate's gradient state is process-wide: this runs before another Trainer is built)
    t.accelerator = Rank(t.accelerator._real, torch.zeros_like(own[1]))
    t._backward_window(windows[0])
    unreduced0 = grads(d)
    zero_grads(d)

    big = trainer(tmp_path / "big", "eagle3", d, everything, grad_accum=1, batch_tokens=4096)
    window = big._next_window()
    assert len(window) == 1 and window[0].input_ids.shape[0] == 4
    big._backward_window(window)
    g_big = grads(d)
    zero_grads(d)
    assert g_big.abs().sum() > 0
    assert cosine(g_ddp, g_big) > 0.9999
    torch.testing.assert_close(g_ddp, g_big, rtol=1e-4, atol=1e-5 * float(g_big.abs().max()))
    assert cosine((unreduced0 + per_rank[1]) / 2, g_big) < 0.999


def test_precision_auto_picks_bf16_only_where_it_is_fast(monkeypatch):
    """``train.precision: auto`` is bf16 only on hardware with native bf16 matmuls (else fp32: on AVX2 CPUs
    bf16 autocast is ~10x slower); explicit values are kept."""
    from speculators import hardware as train_mod  # where the precision is resolved

    monkeypatch.setattr(train_mod, "fast_bf16", lambda: False)
    assert train_mod.resolve_precision("auto") == "fp32"
    monkeypatch.setattr(train_mod, "fast_bf16", lambda: True)
    assert train_mod.resolve_precision("auto") == "bf16"
    assert train_mod.resolve_precision("fp32") == "fp32" and train_mod.resolve_precision("bf16") == "bf16"
