"""Large-target placement: ``target.device_map`` / ``Target.load(device_map=...)``.

* A tiny random target saved with ``save_pretrained`` loads with ``device_map="auto"`` in bfloat16: the
  device_map and dtype reach ``from_pretrained``, the weights are bf16, and its aux taps, final hidden
  state and logits equal those of a plain bf16 load of the same weights exactly (also for a GGUF target,
  placed from its converted copy in the cache).
* An explicit mapping module -> device is honoured (passed through, recorded in ``Target.placement``);
  names that are not modules, uncovered parameters, offloaded weights and every malformed value are one
  clear error naming ``target.device_map``; so is a device_map in a multi-process run, where each rank
  loads the whole target on its own device (``process_device_map``).
* The frozen target: a whole drafter run (``train_run``, target placed with ``device_map=auto``) never
  gives a target parameter to the optimizer, never changes or grads it, and writes no target tensor into
  the run directory besides the embedding copy the family's format keeps.
* CUDA only (``scripts/gpu_check.sh``): a target spread over cuda:0 and the CPU by accelerate's
  ``dispatch_model`` returns every feature, logit and session output on the embedding's device, equal to
  the same model on one device.
"""

from __future__ import annotations

import copy
from pathlib import Path

import pytest
import torch

from speculators.errors import SpeculatorsError
from speculators.target import Target, build_tiny_target, check_device_map, gguf_cache_dir, process_device_map
from speculators.target.loading import _placement_device

ROOT = Path(__file__).resolve().parents[2]
EXPLICIT = {"model.embed_tokens": "cpu", "model.rotary_emb": "cpu", "model.layers": "cpu", "model.norm": "cpu",
            "lm_head": "cpu"}


@pytest.fixture()
def spy_from_pretrained(monkeypatch):
    """Record the keyword arguments of every ``AutoModelForCausalLM.from_pretrained`` call."""
    from transformers import AutoModelForCausalLM

    calls: list[dict] = []
    orig = AutoModelForCausalLM.from_pretrained

    def spy(*args, **kwargs):
        calls.append(kwargs)
        return orig(*args, **kwargs)

    monkeypatch.setattr(AutoModelForCausalLM, "from_pretrained", spy)
    return calls


def _ids(vocab: int, seed: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(0, vocab, (2, 9), generator=g)
    att = torch.ones(2, 9, dtype=torch.long)
    att[1, 6:] = 0  # a right-padded row
    return ids, att


def _assert_same_features(a: Target, b: Target) -> None:
    ids, att = _ids(a.vocab_size)
    fa, fb = a.features(ids, att, with_logits=True), b.features(ids, att, with_logits=True)
    for name in ("aux", "top", "logits"):
        x, y = getattr(fa, name), getattr(fb, name)
        assert x.dtype == y.dtype and x.device == y.device == a.device
        assert torch.equal(x, y), name


def test_auto_bf16_load_equals_a_plain_bf16_load(tiny_target_dir, spy_from_pretrained):
    plain = Target.load(str(tiny_target_dir), "bfloat16", log=lambda *_: None, device="cpu")
    assert spy_from_pretrained[-1].get("device_map") is None
    logs = []
    placed = Target.load(str(tiny_target_dir), "bfloat16", log=logs.append, device_map="auto")
    kw = spy_from_pretrained[-1]
    assert kw["device_map"] == "auto" and kw["dtype"] == torch.bfloat16  # accelerate places, in bf16
    assert {p.dtype for p in placed.model.parameters()} == {torch.bfloat16}
    assert placed.placement == {"": "cpu"} and placed.device == torch.device("cpu") and not placed.spread
    assert "device_map='auto'" in logs[-1]
    assert placed.fingerprint == plain.fingerprint  # the same weights
    _assert_same_features(placed, plain)


def test_an_explicit_device_map_is_honoured(tiny_target_dir, spy_from_pretrained):
    plain = Target.load(str(tiny_target_dir), "float32", log=lambda *_: None, device="cpu")
    dm = {**EXPLICIT, "lm_head": torch.device("cpu")}  # torch.device values are accepted
    placed = Target.load(str(tiny_target_dir), "float32", log=lambda *_: None, device_map=dm)
    assert spy_from_pretrained[-1]["device_map"] == EXPLICIT  # normalised (device -> "cpu"), passed through
    assert placed.placement == {k: "cpu" for k in EXPLICIT}
    _assert_same_features(placed, plain)
    whole = Target.load(str(tiny_target_dir), "float32", log=lambda *_: None, device_map={"": "cpu"})
    assert whole.placement == {"": "cpu"}


def test_device_map_names_that_are_not_modules_or_leave_parameters_out(tiny_target_dir):
    bad = {**EXPLICIT, "model.embedding": "cpu"}
    with pytest.raises(SpeculatorsError, match=r"target.device_map: \['model.embedding'\] are not modules"):
        Target.load(str(tiny_target_dir), log=lambda *_: None, device_map=bad)
    partial = {k: v for k, v in EXPLICIT.items() if k != "model.norm"}
    with pytest.raises(SpeculatorsError, match=r"target.device_map: no device for 1 parameters.*model.norm.weight"):
        Target.load(str(tiny_target_dir), log=lambda *_: None, device_map=partial)


@pytest.mark.parametrize("value, match", [
    ("everywhere", r"target.device_map: 'everywhere' is not a placement; allowed: None .*'auto'"),
    ("cuda:0", r"'cuda:0' is not a placement.*\{'': 'cuda:1'\}"),
    ([0, 1], r"target.device_map: a list is not a placement"),
    ({}, r"target.device_map: an empty mapping is not a placement"),
    ({"": "disk"}, r"target.device_map\[''\]: 'disk' offloads weights"),
    ({"lm_head": -1}, r"target.device_map\['lm_head'\]: -1 is not a device"),
    ({"lm_head": True}, r"True is not a device"),
    ({"lm_head": "gpu7"}, r"'gpu7' is not a device"),
    ({3: "cpu"}, r"the key 3 is not a module name"),
])
def test_bad_device_maps_are_one_clear_error(value, match, tiny_target_dir):
    with pytest.raises(SpeculatorsError, match=match):
        check_device_map(value)
    with pytest.raises(SpeculatorsError, match=match):  # Target.load checks before reading any weight
        Target.load(str(tiny_target_dir / "missing"), log=lambda *_: None, device_map=value)


def test_the_recipe_validates_target_device_map():
    from speculators.recipe import load_recipe

    base = ROOT / "recipes" / "tiny-eagle3.yaml"
    assert load_recipe(base, ["target.model=x"]).target.device_map is None  # default: one device
    assert load_recipe(base, ["target.model=x", "target.device_map=balanced"]).target.device_map == "balanced"
    rec = load_recipe(base, ["target.model=x", "target.device_map={model.embed_tokens: 0, '': 1}"])
    assert rec.target.device_map == {"model.embed_tokens": 0, "": 1}
    with pytest.raises(SpeculatorsError, match=r"target.device_map: .*'spread' is not a placement"):
        load_recipe(base, ["target.model=x", "target.device_map=spread"])
    with pytest.raises(SpeculatorsError, match=r"target.device_map: .*'disk' offloads weights"):
        load_recipe(base, ["target.model=x", "target.device_map={'': disk}"])


def test_device_and_device_map_together_and_missing_devices(tiny_target_dir):
    with pytest.raises(SpeculatorsError, match=r"target.device_map: 'auto' and device 'cpu' both given"):
        Target.load(str(tiny_target_dir), log=lambda *_: None, device="cpu", device_map="auto")
    if not torch.cuda.is_available():
        with pytest.raises(SpeculatorsError, match=r"target.device_map\[''\]: device: 'cuda:0' requested but CUDA "):
            Target.load(str(tiny_target_dir), log=lambda *_: None, device_map={"": 0})


def test_offloaded_weights_are_refused():
    from speculators.target.loading import _check_placement

    t = build_tiny_target(vocab_size=64, hidden_size=32, num_layers=2)
    _check_placement(t.model, "auto")  # resident: fine
    t.model.model.layers[1].to("meta")  # what accelerate leaves for a module offloaded to cpu / disk
    with pytest.raises(SpeculatorsError, match=r"target.device_map: .*model.layers.1.* offloaded"):
        _check_placement(t.model, "auto")


def test_each_process_of_a_distributed_run_loads_on_its_own_device():
    assert process_device_map(None, 1, torch.device("cpu")) is None  # one process: as before
    assert process_device_map("auto", 1, torch.device("cuda:0")) == "auto"
    assert process_device_map(None, 4, torch.device("cuda:3")) == {"": "cuda:3"}  # rank 3: its own GPU
    assert process_device_map(None, 2, torch.device("cpu")) == {"": "cpu"}  # gloo ranks
    with pytest.raises(SpeculatorsError, match=r"target.device_map: 'auto' is set, but this run has 2 processes .*"
                                               r"target.device_map=null"):
        process_device_map("auto", 2, torch.device("cuda:1"))
    with pytest.raises(SpeculatorsError, match=r"not a placement"):
        process_device_map("nope", 1, torch.device("cpu"))


def test_a_gguf_target_is_placed_from_its_converted_copy(tmp_path, isolated_cache, tiny_target_dir,
                                                         spy_from_pretrained):
    """The cached conversion of a GGUF file is what ``device_map`` places (a hit here: the cache holds the
    tiny target under the fake GGUF file's key, so no GGUF is read)."""
    import shutil

    gguf = tmp_path / "tiny.gguf"
    gguf.write_bytes(b"not read: the converted copy is cached")
    shutil.copytree(tiny_target_dir, gguf_cache_dir(gguf))
    placed = Target.load(str(gguf), "bfloat16", log=lambda *_: None, device_map="auto")
    kw = spy_from_pretrained[-1]
    assert kw["device_map"] == "auto" and kw["dtype"] == torch.bfloat16 and "gguf_file" not in kw
    assert {p.dtype for p in placed.model.parameters()} == {torch.bfloat16}
    plain = Target.load(str(tiny_target_dir), "bfloat16", log=lambda *_: None, device="cpu")
    _assert_same_features(placed, plain)


def test_a_drafter_run_never_trains_nor_saves_the_target(tmp_path, isolated_cache, tiny_target_dir, monkeypatch):
    """``train_run`` (offline features, target placed with ``device_map=auto``): the optimizer holds no target
    parameter, the target's weights are unchanged and gradient-free afterwards, and no file of the run
    directory holds a target tensor other than the token embedding (the copy EAGLE-3 keeps)."""
    from safetensors.torch import load_file

    from speculators.recipe import load_recipe
    from speculators.workflows import train_run

    loaded: list[Target] = []
    orig_load = Target.load.__func__

    def load(cls, *args, **kwargs):
        loaded.append(orig_load(cls, *args, **kwargs))
        return loaded[-1]

    monkeypatch.setattr(Target, "load", classmethod(load))
    optimized: list[int] = []

    class SpyAdamW(torch.optim.AdamW):
        def __init__(self, params, *args, **kwargs):
            params = list(params)
            for g in params:
                optimized.extend(id(p) for p in (g["params"] if isinstance(g, dict) else [g]))
            super().__init__(params, *args, **kwargs)

    monkeypatch.setattr(torch.optim, "AdamW", SpyAdamW)
    rec = load_recipe(ROOT / "recipes" / "tiny-eagle3.yaml", [f"target.model={tiny_target_dir}", "train.steps=2",
                                                              "train.checkpoint_every=1", "target.device_map=auto"])
    logs: list[str] = []
    run = train_run(rec, tmp_path / "run", log=logs.append).parent
    (target,) = loaded
    assert any("device_map='auto'" in m for m in logs)  # the recipe's placement reached Target.load
    in_optimizer = [n for n, p in target.model.named_parameters() if id(p) in set(optimized)]
    assert optimized and not in_optimizer, in_optimizer
    fresh = Target.load(str(tiny_target_dir), "float32", log=lambda *_: None, device="cpu")
    now = target.model.state_dict()
    assert all(torch.equal(now[k], v) for k, v in fresh.model.state_dict().items())
    assert all(p.grad is None and not p.requires_grad for p in target.model.parameters())
    embed = target.embed_tokens.weight
    weights = [(n, p) for n, p in target.model.named_parameters() if p.dim() >= 2 and p is not embed]
    files = sorted(run.rglob("*.safetensors"))
    assert any("final" in f.parts for f in files) and any("checkpoints" in f.parts for f in files)
    for f in files:
        for key, t in load_file(str(f)).items():
            for name, w in weights:
                assert not (t.shape == w.shape and torch.equal(t.float(), w.to(t.dtype).float())), (f, key, name)
    # eval loads the target with the recipe's device_map, unless --device names one device
    from speculators.evaluation.loading import load_for_eval

    for device, expect in ((None, "device_map='auto'"), ("cpu", "on cpu")):
        logs.clear()
        load_for_eval(run / "final", rec, None, device, logs.append)
        line = next(m for m in logs if m.startswith("target "))
        assert expect in line and (device is None or "device_map" not in line), line


# ---------------------------------------------------------------- CUDA: a target over two devices
cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA (scripts/gpu_check.sh runs it on a GPU)")
#: layers alternate between cuda:0 and the CPU; the embedding on cuda:0, the final norm and the (untied)
#: output head on the CPU: every hand-over of a spread target happens
SPREAD = {"model.embed_tokens": 0, "model.rotary_emb": 0, "model.layers.0": 0, "model.layers.1": "cpu",
          "model.layers.2": 0, "model.layers.3": "cpu", "model.norm": "cpu", "lm_head": "cpu"}


def _untied_model(seed: int = 0):
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(seed)
    cfg = LlamaConfig(vocab_size=256, hidden_size=64, intermediate_size=128, num_hidden_layers=4,
                      num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=512,
                      tie_word_embeddings=False, bos_token_id=None, eos_token_id=None, pad_token_id=None)
    model = LlamaForCausalLM(cfg)
    with torch.no_grad():  # peaked distributions: greedy choices far from ties
        model.get_input_embeddings().weight.normal_(0, 1.0)
        model.lm_head.weight.normal_(0, 0.5)
    return model.eval()


def _close(a: torch.Tensor, b: torch.Tensor, device: torch.device) -> None:
    assert a.device == device
    torch.testing.assert_close(a, b.to(device), atol=2e-4, rtol=2e-4)


def _check_spread(device_map: dict, dev: torch.device, force_hooks: bool = False) -> None:
    """A target dispatched by accelerate's ``dispatch_model`` over ``device_map`` (``main_device="cpu"``: the
    ``cpu`` entries are placed there, not offloaded) against the same weights on ``dev`` alone."""
    from accelerate import dispatch_model

    base = _untied_model()
    ref = Target(copy.deepcopy(base).to(dev), aux_layer_ids=[0, 1, 3])
    spread = Target(dispatch_model(copy.deepcopy(base), device_map=device_map, main_device="cpu",
                                   skip_keys=base._skip_keys_device_placement,  # as from_pretrained does
                                   force_hooks=force_hooks), aux_layer_ids=[0, 1, 3])
    assert spread.device == dev and not ref.spread
    assert spread.spread == (len({str(_placement_device(v)) for v in device_map.values()}) > 1)
    assert all(p.device.type != "meta" for p in spread.model.parameters())  # resident, not offloaded
    assert spread.placement == {k: str(_placement_device(v)) for k, v in device_map.items()}
    ids, att = _ids(256)
    fs, fr = spread.features(ids, att, with_logits=True), ref.features(ids, att, with_logits=True)
    for name in ("aux", "top", "logits"):
        _close(getattr(fs, name), getattr(fr, name), dev)
    h = torch.randn(3, 64, device=dev)  # a drafter's hidden states, on the target's device
    _close(spread.final_norm(h), ref.final_norm(h), dev)
    assert getattr(spread.final_norm, "weight") is spread.model.model.norm.weight
    _close(spread.lm_head(h), ref.lm_head(h), dev)
    _close(spread.embed(ids.to(dev)), ref.embed(ids.to(dev)), dev)
    # batch-1 decoding with a rollback
    s, r = spread.session(), ref.session()
    for chunk, crop in ((ids[0, :5], 3), (ids[1, :4], None)):
        (ls, xs), (lr, xr) = s.forward(chunk), r.forward(chunk)
        _close(ls, lr, dev), _close(xs.aux, xr.aux, dev), _close(xs.top, xr.top, dev)
        if crop:
            s.crop(crop), r.crop(crop)
    # the ragged batch session: join, forward, roll back, leave, re-pack
    outs = []
    for t in (spread, ref):
        b = t.batch_session(4)
        first = b.add_many(["a", "b", "c"], [ids[0, :5], ids[1, :3], ids[0, :2]])
        second = b.forward(["a", "c"], [ids[1, :2], ids[0, 2:5]])
        b.keep("a", 5)
        b.remove("b")
        b.compact()
        third = b.forward(["a", "c"], [ids[1, 3:5], ids[1, :1]])
        outs.append([x for o in (first, second, third) for lst in o for x in lst])
    assert len(outs[0]) == len(outs[1]) == 14  # logits and features of 3 + 2 + 2 requests
    for x, y in zip(*outs):
        for a, c in ((x, y),) if isinstance(x, torch.Tensor) else ((x.aux, y.aux), (x.top, y.top)):
            _close(a, c, dev)
    # batched generation, with a row that stops early (its KV cache rows leave on every device)
    prompts = [ids[0, :4].tolist(), ids[1, :6].tolist()]
    free = ref.generate_batch(prompts, 6, stop_token_ids=[])
    assert [g.ids for g in spread.generate_batch(prompts, 6, stop_token_ids=[])] == [g.ids for g in free]
    stop = next(t for t in free[0].ids[:3] if t not in free[1].ids)
    want = ref.generate_batch(prompts, 6, stop_token_ids=[stop])
    assert want[0].stop == stop and want[1].ids == free[1].ids  # row 1 went on alone
    assert spread.generate_batch(prompts, 6, stop_token_ids=[stop]) == want


def test_accelerate_hooks_change_nothing_on_one_device():
    """The CPU run of the spread checks: accelerate's hooks on every block (``force_hooks``), one device."""
    _check_spread({k: "cpu" for k in SPREAD}, torch.device("cpu"), force_hooks=True)


@cuda
def test_a_target_spread_over_two_devices_returns_everything_on_the_embedding_device():
    """accelerate's ``dispatch_model`` (what ``from_pretrained(device_map=...)`` runs over several GPUs; here
    cuda:0 + the CPU as a second real device): features, the frozen head / norm, the decode sessions,
    the ragged batch session and batched generation all return on the embedding's device and equal the
    same weights on one device."""
    _check_spread(SPREAD, torch.device("cuda:0"))


@cuda
def test_cpu_entries_beside_a_gpu_are_offloaded_and_refused(tiny_target_dir):
    """``from_pretrained`` offloads the ``cpu`` entries of a map that also names a GPU (their weights stay on
    ``meta``): a target must be resident, so this is one clear error; the same map on the GPU alone loads."""
    dm = {**EXPLICIT, "model.layers": 0, "model.embed_tokens": 0, "lm_head": 0}
    with pytest.raises(SpeculatorsError, match=r"target.device_map: .* offloaded"):
        Target.load(str(tiny_target_dir), "bfloat16", log=lambda *_: None, device_map=dm)
    on_gpu = Target.load(str(tiny_target_dir), "bfloat16", log=lambda *_: None, device_map={k: 0 for k in EXPLICIT})
    assert on_gpu.device == torch.device("cuda:0") and set(on_gpu.placement.values()) == {"cuda:0"}
    plain = Target.load(str(tiny_target_dir), "bfloat16", log=lambda *_: None, device="cuda:0")
    _assert_same_features(on_gpu, plain)


def test_a_joint_run_with_a_device_map_is_refused_before_any_work(tmp_path, tiny_target_dir):
    """Joint training puts the LoRA target inside the drafter's module, which accelerate does not move
    when the target is spread: refused with one error, before data or target load."""
    from speculators.recipe import load_recipe
    from speculators.workflows import train_run

    rec = load_recipe(ROOT / "recipes" / "tiny-mtp.yaml", [f"target.model={tiny_target_dir}", "drafter.joint=true",
                                                          "target.device_map=auto"])
    with pytest.raises(SpeculatorsError, match=r"target.device_map: a joint run"):
        train_run(rec, tmp_path / "run", log=lambda m: None)
    assert not (tmp_path / "run" / "final").exists()
