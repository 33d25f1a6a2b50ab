"""K larger than what a parallel drafter was trained for: P-EAGLE drafts at most ``num_depths``
tokens per step, DFlash at most ``block_size - 1``. Such a K is ONE clear error naming the setting
(``k`` in Python, ``-k`` on the command line, ``eval.k`` / ``eval.k_sweep`` from a recipe) and the allowed
maximum, raised before any decoding: by the generation loop (``speculative_generate`` /
``speculative_decode``), by ``eval_run`` for every K of a sweep, and by the drafter's own ``propose``
(P-EAGLE no longer caps silently). Autoregressive families and model-free proposers are unbounded."""

from __future__ import annotations

import json

import pytest
import torch
from typer.testing import CliRunner

from speculators.cli import _EVAL_OPTIONS, app
from speculators.drafters import Drafter, registry
from speculators.data.vocab import DraftVocab
from speculators.decode.proposal import max_speculative_tokens_of
from speculators.errors import SpeculatorsError
from speculators.decode.loop import speculative_decode, speculative_generate
from speculators.decode.proposers import HybridProposer, NGramProposer, SuffixProposer
from speculators.target import build_tiny_target

V = 96
# both families built to draft at most 3 tokens per step
BOUNDED = {"peagle": {"num_depths": 3}, "dflash": {"block_size": 4}}
SOURCE = {"peagle": "drafter.num_depths", "dflash": "drafter.block_size - 1"}


@pytest.fixture(scope="module")
def target():
    return build_tiny_target(vocab_size=V, hidden_size=32, num_layers=3, seed=1)


def make(target, name: str, **kw) -> Drafter:
    fam = registry.get(name)
    torch.manual_seed(0)
    cfg = fam.config_class(algorithm=name, num_layers=1, **{**BOUNDED.get(name, {}), **kw})
    return fam.from_target(cfg, target, DraftVocab.full(V)).eval()


@pytest.fixture(scope="module", params=sorted(BOUNDED))
def bounded(request, target):
    return request.param, make(target, request.param)


def prompts(n=2):
    g = torch.Generator().manual_seed(3)
    return [torch.randint(0, V, (4 + 3 * i,), generator=g).tolist() for i in range(n)]


def test_the_bound_is_what_the_family_was_trained_for(target, bounded):
    name, d = bounded
    assert d.max_speculative_tokens == 3 and max_speculative_tokens_of(d) == 3
    deeper = make(target, name, **{k: v + 2 for k, v in BOUNDED[name].items()})
    assert deeper.max_speculative_tokens == 5
    assert make(target, "eagle3").max_speculative_tokens is None  # autoregressive: unbounded
    assert max_speculative_tokens_of(NGramProposer()) is None and max_speculative_tokens_of(None) is None
    assert max_speculative_tokens_of(HybridProposer(d, SuffixProposer())) == 3  # asks its drafter for K


def test_the_generation_loop_refuses_k_above_the_bound_before_decoding(target, bounded, monkeypatch):
    name, d = bounded
    calls = []
    monkeypatch.setattr(type(d), "start", lambda self, *a: calls.append(a))  # must never be reached
    for k in (4, [1, 4]):  # one K for all, or per request
        with pytest.raises(SpeculatorsError, match=rf"^k=4: this {name} drafter drafts at most 3 tokens per step "
                                                   rf"\({SOURCE[name]} = 3.*use k <= 3"):
            speculative_generate(target, d, prompts(), k, 6)
    with pytest.raises(SpeculatorsError, match=r"k=5: .*at most 3"):
        speculative_decode(target, d, prompts()[0], 5, 6)
    with pytest.raises(SpeculatorsError, match=rf"k=4: this {name} drafter"):  # the hybrid wraps the drafter
        speculative_generate(target, HybridProposer(d, SuffixProposer()), prompts(), 4, 6)
    assert calls == []


def test_k_at_the_bound_drafts_the_whole_block(target, bounded):
    _, d = bounded
    out = speculative_generate(target, d, prompts(), 3, 12, eos_ids=set())
    drafted = [n for r in out.results for n in r.drafted]
    assert max(drafted) == 3 and all(n <= 3 for n in drafted)
    # model-free proposers are not bounded by anything
    speculative_generate(target, NGramProposer(), prompts(), 9, 6, eos_ids=set())


def test_the_drafter_itself_refuses_instead_of_capping(target, bounded):
    """P-EAGLE used to return ``num_depths`` drafts when asked for more (an eval's 'K' was then a lie)."""
    _, d = bounded
    sess = target.session()
    p = prompts()[1]
    logits, feats = sess.forward(torch.tensor(p))
    state = d.start(torch.tensor(p + [int(logits[-1].argmax())]), feats)
    assert d.propose([state], [3])[0].token_ids.numel() == 3
    with pytest.raises(SpeculatorsError, match=r"\b4\b.*3"):
        d.propose([state], [4])


def write_prompts(path):
    path.write_text(json.dumps({"messages": [{"role": "user", "content": "hi"}]}) + "\n")
    return path


@pytest.mark.parametrize("overrides, names, needle", [
    ({"k_sweep": [1, 2, 8]}, _EVAL_OPTIONS, r"-k 8: "),          # one bad value of a command-line sweep
    ({"k_sweep": [4, 5, 1]}, _EVAL_OPTIONS, r"-k 4,5: "),        # every bad value, in one error
    ({"k": 5}, None, r"eval\.k=5: "),                            # a Python override without option names
    ({}, None, r"eval\.k=4: "),                                  # EvalSpec's default K=4 (no recipe)
])
def test_eval_run_refuses_every_k_of_the_sweep_above_the_bound(target, bounded, tmp_path, monkeypatch,
                                                                overrides, names, needle):
    import speculators.workflows as wf

    name, d = bounded
    ckpt = d.save_pretrained(tmp_path / "ckpt")
    loads = []
    monkeypatch.setattr(wf, "load_for_eval", lambda *a, **kw: loads.append(a))  # no target loads first
    with pytest.raises(SpeculatorsError) as e:
        wf.eval_run(ckpt, eval_overrides=overrides, override_names=names, target_model=str(tmp_path / "none"),
                    prompts=str(write_prompts(tmp_path / "p.jsonl")), output=tmp_path / "out")
    msg = str(e.value)
    assert len(msg.splitlines()) == 1 and loads == []
    assert msg.startswith(str(ckpt)) and f"this {name} drafter drafts at most 3 tokens per step" in msg, msg
    assert __import__("re").search(needle, msg), msg
    assert not (tmp_path / "out").exists()


def test_eval_run_checks_compared_checkpoints_too(target, tmp_path, monkeypatch):
    import speculators.workflows as wf

    deep = make(target, "peagle", num_depths=5).save_pretrained(tmp_path / "deep")
    shallow = make(target, "peagle").save_pretrained(tmp_path / "shallow")
    monkeypatch.setattr(wf, "load_for_eval", lambda *a, **kw: pytest.fail("loaded a target before the K check"))
    with pytest.raises(SpeculatorsError, match=rf"^--compare {shallow}: -k 5: this peagle drafter drafts at most 3"):
        wf.eval_run(deep, eval_overrides={"k": 5}, override_names=_EVAL_OPTIONS, target_model="none",
                    prompts=str(write_prompts(tmp_path / "p.jsonl")), compare=[shallow])


def test_eval_run_checks_k_per_method(target, tmp_path, monkeypatch):
    """Review finding: the pre-load check read the drafter's bound for every method, so an eval of prompt
    lookup and a hybrid whose drafter_k stays under the bound was refused at K = 6, while a drafter_k
    above the bound passed it and failed only once the eval ran, naming no setting."""
    import speculators.workflows as wf

    ckpt = make(target, "dflash").save_pretrained(tmp_path / "ckpt")  # drafts at most 3
    loaded = []
    monkeypatch.setattr(wf, "load_for_eval", lambda *a, **kw: loaded.append(1) or (_ for _ in ()).throw(KeyError))
    kw = dict(override_names=_EVAL_OPTIONS, target_model="none", prompts=str(write_prompts(tmp_path / "p.jsonl")))
    with pytest.raises(KeyError):  # passed the K check: reached the target load
        wf.eval_run(ckpt, eval_overrides={"k": 6, "methods": ["ngram", "hybrid"], "hybrid_drafter_k": 2}, **kw)
    with pytest.raises(SpeculatorsError, match=r"--hybrid-drafter-k 4: this dflash drafter drafts at most 3"):
        wf.eval_run(ckpt, eval_overrides={"k": 6, "methods": ["hybrid"], "hybrid_drafter_k": 4}, **kw)
    with pytest.raises(SpeculatorsError, match=r"-k 6: this dflash drafter drafts at most 3"):  # uncapped hybrid
        wf.eval_run(ckpt, eval_overrides={"k": 6, "methods": ["ngram", "hybrid"]}, **kw)
    with pytest.raises(SpeculatorsError, match=r"-k 6: this dflash"):  # the drafter row itself
        wf.eval_run(ckpt, eval_overrides={"k": 6, "methods": ["drafter", "hybrid"], "hybrid_drafter_k": 2}, **kw)
    assert loaded == [1]


def test_cli_eval_k_sweep_above_the_bound_is_one_error_line(target, tmp_path):
    ckpt = make(target, "dflash").save_pretrained(tmp_path / "ckpt")
    r = CliRunner().invoke(app, ["eval", str(ckpt), "--target", str(tmp_path / "none"), "--prompts",
                                 str(write_prompts(tmp_path / "p.jsonl")), "-k", "1,2,8"])
    assert r.exit_code == 2, r.output
    out = " ".join(r.output.split())
    assert "error:" in out and "-k 8: this dflash drafter drafts at most 3 tokens per step" in out, out
    assert "drafter.block_size - 1 = 3" in out and "use -k <= 3" in out
    assert "Traceback" not in r.output


def test_eval_run_checks_tree_depths_before_decoding(target, tmp_path, monkeypatch):
    """A draft tree's path is as long as a chain: ``--tree depth=5`` for a drafter of at most 3 drafts per step
    is the same one error, before any target loads (not after the chain passes)."""
    import speculators.workflows as wf

    ckpt = make(target, "peagle").save_pretrained(tmp_path / "ckpt")  # drafts at most 3
    monkeypatch.setattr(wf, "load_for_eval", lambda *a, **kw: pytest.fail("loaded a target before the depth check"))
    with pytest.raises(SpeculatorsError, match=r"--tree depth 5: this peagle drafter drafts at most 3"):
        wf.eval_run(ckpt, eval_overrides={"k": 2, "trees": ["depth=3,topk=2", "depth=5,topk=2"]},
                    override_names=_EVAL_OPTIONS, target_model="none", prompts=str(write_prompts(tmp_path / "p.jsonl")))
