"""Every causal-LM config class of the installed transformers, at tiny size: it trains, or it is refused before
training by what it is (a layer kind, an encoder-decoder, a multimodal checkpoint, ALiBi, a layout or an output
head the project does not read), never by an accident later on.

The classes are those of ``MODEL_FOR_CAUSAL_LM_MAPPING`` (every ``*Config`` transformers builds a causal LM from),
each made tiny by :func:`speculators.target.tiny.tiny_config_of` (a hybrid stays hybrid: one layer of each kind its
default holds). A class that cannot be made tiny by field names, or whose tiny model transformers cannot run, is
outside the claim and listed as such. The outcomes are printed as a table (also under ``pytest -q``).
"""

from __future__ import annotations

import pytest
import torch

from speculators.errors import SpeculatorsError
from speculators.target import Target
from speculators.target.architecture import check_supported
from speculators.target.tiny import tiny_config_of

import test_architectures as arch_tests  # its checks, not its tests (a module import is not collected)

V = arch_tests.V

#: what a refusal must name: a layer kind, or a feature of the architecture (the phrases of check_supported)
NAMED = ("layers (", "layers;", "encoder-decoder", "multimodal", "ALiBi", "layout is not one we read",
         "output head", "input embeddings", "no causal-LM class", "cannot build it", "has no attention",
         "layer types of")
#: a model past this size was not made tiny by field names (a composite config keeps its nested defaults)
MAX_PARAMS = 5_000_000
OUTCOMES: dict[str, str] = {}


def _classes():
    from transformers import MODEL_FOR_CAUSAL_LM_MAPPING

    return sorted({c for c in MODEL_FOR_CAUSAL_LM_MAPPING.keys() if c.__name__.endswith("Config")},
                  key=lambda c: c.__name__)


CLASSES = _classes()
#: LFM2 as its checkpoints are published (short-convolution blocks with attention every few layers); its config
#: class defaults to attention everywhere
OVERRIDES = {"Lfm2Config": {"layer_types": ["conv", "conv", "full_attention", "conv"], "num_hidden_layers": 4}}


def _outcome(cls) -> str:
    """``refused: ...`` / ``trained`` / ``outside: ...`` for one config class (raises on any other failure)."""
    try:
        cfg = tiny_config_of(cls, V, 32, 3, OVERRIDES.get(cls.__name__))
    except Exception as e:  # noqa: BLE001 - the class cannot be made tiny by field names: judge its default
        try:
            default = cls()
        except Exception:  # noqa: BLE001 - transformers' own default does not validate
            return f"outside: no tiny config, and its default does not validate ({type(e).__name__})"
        try:
            check_supported(default)  # from the config alone, on the meta device: nothing is allocated
        except SpeculatorsError as refusal:
            why = str(refusal).split(" is not supported: ")[-1].split(". Supported")[0]
            assert any(n in why for n in NAMED), f"{cls.__name__}: refused without naming why: {refusal}"
            return f"refused (at its default size): {why}"
        return f"outside: no tiny config ({type(e).__name__})"
    try:
        check_supported(cfg)
    except SpeculatorsError as e:
        why = str(e).split(" is not supported: ")[-1].split(". Supported")[0]
        assert any(n in why for n in NAMED), f"{cls.__name__}: refused without naming why: {e}"
        return f"refused: {why}"
    from transformers import AutoModelForCausalLM

    try:
        with torch.device("meta"):
            n = sum(p.numel() for p in AutoModelForCausalLM.from_config(cfg).parameters())
        if n > MAX_PARAMS:
            return f"outside: not tiny ({n / 1e6:.0f}M parameters at its nested defaults)"
        torch.manual_seed(0)
        model = AutoModelForCausalLM.from_config(cfg).eval()
        with torch.no_grad():
            model(input_ids=torch.tensor([[1, 5, 7, 9]]))
    except Exception as e:  # noqa: BLE001 - transformers' own tiny model does not run
        return f"outside: transformers' tiny model does not run ({type(e).__name__})"
    target = Target(model, None, name_or_path=f"tiny-random-{cls.__name__}")
    arch_tests.test_logits_equal_the_models_own_forward((cls.__name__, target))  # the verifier's logits are the model's
    arch_tests.train_drafter("eagle3", target, steps=2)
    return "trained (EAGLE-3, 2 steps)"


@pytest.mark.parametrize("cls", CLASSES, ids=lambda c: c.__name__)
def test_every_causal_lm_config_trains_or_is_refused_by_name(cls):
    OUTCOMES[cls.__name__] = _outcome(cls)


def test_lfm2_is_refused_by_its_convolution_layers():
    from transformers import Lfm2Config

    with pytest.raises(SpeculatorsError, match=r"'conv' layers \(layer_types: 3 of 4 layers\)"):
        check_supported(tiny_config_of(Lfm2Config, V, 32, 3, OVERRIDES["Lfm2Config"]))


@pytest.mark.parametrize("field,value,kind", [
    ("block_types", ["recurrent", "attention", "recurrent"], "'recurrent'"),
    ("layers_block_type", ["mamba", "attention", "mamba"], "'mamba'"),
    ("attn_type_list", [0, 1, 0], "'linear_attention'"),
    ("hybrid_override_pattern", "M*-", "'mamba'"),
    ("future_layer_types", ["full_attention", "retention", "full_attention"], "'retention'"),
])
def test_a_declared_kind_outside_the_allow_list_is_refused_by_name(field, value, kind):
    """A Llama config carrying another family's per-layer field (or one nobody listed, named like one): refused by
    the kind it declares, before transformers is asked anything."""
    from transformers import LlamaConfig

    cfg = LlamaConfig(vocab_size=V, hidden_size=32, intermediate_size=64, num_hidden_layers=3, num_attention_heads=4)
    setattr(cfg, field, value)
    with pytest.raises(SpeculatorsError, match=rf"{kind} layers \({field}: .*full_attention, sliding_attention"):
        check_supported(cfg)


def test_outcomes_table(capsys):
    """Print every class's outcome (runs last in this module: the parametrized test fills :data:`OUTCOMES`)."""
    if len(OUTCOMES) < len(CLASSES):
        pytest.skip("run with the whole module to print the table")
    rows = sorted(OUTCOMES.items())
    counts = {k: sum(v.startswith(k) for _, v in rows) for k in ("trained", "refused", "outside")}
    with capsys.disabled():
        print(f"\n{len(rows)} causal-LM config classes of transformers: " +
              ", ".join(f"{v} {k}" for k, v in counts.items()))
        for name, outcome in rows:
            print(f"  {name}: {outcome}")
    assert counts["trained"] >= 60 and counts["refused"] >= 40, counts
