"""Decoding: what each step emits (stop tokens, max_new_tokens), stop ids, argument checks.

Tiny random targets, oracle proposers that draft the target's own greedy continuation (computed with
plain_decode beforehand) including the tokens after the stop token.
"""

from __future__ import annotations

import pytest
import torch

from speculators.decode.proposal import Proposal
from speculators.errors import SpeculatorsError
from speculators.evaluation.acceptance import AcceptanceStats
from speculators.decode.state import GenerationResult
from speculators.decode.loop import plain_decode, speculative_decode
from speculators.decode.inputs import resolve_stop_ids
from speculators.decode.proposal import Proposer
from speculators.decode.proposers import NGramProposer
from speculators.target import build_tiny_target
from speculators.verify import SamplingParams

V = 96
K = 6


def untied_tiny_target():
    """A tiny random target with its own random lm_head: with tied embeddings a random model repeats its
    last token forever; untied, its greedy continuations run through several distinct tokens."""
    t = build_tiny_target(vocab_size=V, hidden_size=64, num_layers=2, seed=1)
    g = torch.Generator().manual_seed(123)
    t.model.lm_head.weight = torch.nn.Parameter(torch.randn(V, 64, generator=g))
    return t


@pytest.fixture(scope="module")
def target():
    return untied_tiny_target()


class Oracle(NGramProposer):
    """Drafts ``continuation`` (the target's greedy tokens, past any stop token) after ``prompt``."""

    def __init__(self, prompt, continuation):
        super().__init__()
        self.prompt, self.cont = list(prompt), list(continuation)

    def propose(self, states, ks, sampling=None, generators=None):
        out = []
        for state, k in zip(states, ks):
            assert state.tokens[:len(self.prompt)] == self.prompt
            n_gen = len(state.tokens) - len(self.prompt)
            out.append(Proposal(torch.tensor(self.cont[n_gen:n_gen + k], dtype=torch.int64)))
        return out


def greedy_with_fresh_token(target, lo, hi, n=24):
    """(prompt, greedy continuation without stop ids, j): continuation[j] (lo <= j <= hi) does not occur
    before position j, so making it the stop token ends greedy decoding at exactly j + 1 tokens."""
    for seed in range(10):
        prompt = torch.randint(0, V, (8,), generator=torch.Generator().manual_seed(seed)).tolist()
        cont = plain_decode(target, prompt, n, eos_ids=set()).tokens
        for j in range(lo, hi + 1):
            if cont[j] not in cont[:j]:
                return prompt, cont, j
    pytest.skip("no greedy continuation with a fresh token in range")


def check_steps(r: GenerationResult):
    """Per-step invariants of a result: the steps' emitted tokens are exactly the tokens after the first."""
    n = len(r.accepted)
    assert len(r.drafted) == len(r.emitted) == len(r.verifier_accepted) == n == r.target_forwards
    assert len(r.tokens) == (1 + sum(r.emitted) if r.tokens else 0)
    for a, d, e, va in zip(r.accepted, r.drafted, r.emitted, r.verifier_accepted):
        assert 0 <= va <= d and 1 <= e <= va + 1 and a == min(va, e)


def test_tau_counts_only_tokens_emitted_before_an_accepted_stop_token(target):
    """the stop token is accepted inside the 2nd draft block; the drafts after it are
    accepted by the verifier too, but not emitted and not counted in tau."""
    prompt, cont, j = greedy_with_fresh_token(target, 8, 12)
    stop = cont[j]
    ref = plain_decode(target, prompt, 40, eos_ids={stop})
    assert ref.tokens == cont[:j + 1]
    spec = speculative_decode(target, Oracle(prompt, cont), prompt, K, 40, eos_ids={stop})
    assert spec.tokens == ref.tokens
    check_steps(spec)
    # step 1: 6 drafts accepted + bonus; step 2: drafts up to the stop token (draft j - 7) only
    assert spec.drafted == [K, K]
    assert spec.verifier_accepted == [K, K]
    assert spec.emitted == [K + 1, j - 7]
    assert spec.accepted == [K, j - 7]
    stats = AcceptanceStats(K)
    stats.add(spec)
    assert stats.steps == 2 and stats.tokens == j + 1
    assert stats.tau == (len(spec.tokens) - 1) / stats.steps == j / 2  # the old code said 7.0
    assert stats.tau < K + 1
    assert stats.accepted_emitted == K + j - 7 and stats.accepted == stats.verifier_accepted == 2 * K
    assert stats.acceptance_rate == 1.0  # every verified draft was the target's greedy token
    assert stats.per_position == [1.0] * K and stats.conditional == [1.0] * K


def test_max_new_tokens_cut_gives_ragged_last_step(target):
    prompt, cont, _ = greedy_with_fresh_token(target, 8, 12)
    spec = speculative_decode(target, Oracle(prompt, cont), prompt, K, 10, eos_ids=set())
    assert spec.tokens == cont[:10]
    check_steps(spec)
    assert spec.drafted == [K, 1] and spec.emitted == [K + 1, 2] and spec.accepted == [K, 1]
    stats = AcceptanceStats(K)
    stats.add(spec)
    assert stats.tau == 9 / 2 and stats.tokens == 10
    assert stats.per_position == [1.0] * K and stats.pos_drafted == [2] + [1] * (K - 1)


@pytest.mark.parametrize("how", ["stop", "max_new_tokens"])
def test_first_token_from_the_prefill_can_end_the_request(target, how):
    prompt, cont, _ = greedy_with_fresh_token(target, 8, 12)
    kw = {"eos_ids": {cont[0]}, "max_new_tokens": 40} if how == "stop" else {"eos_ids": set(), "max_new_tokens": 1}
    for r in (speculative_decode(target, Oracle(prompt, cont), prompt, K, **kw), plain_decode(target, prompt, **kw)):
        assert r.tokens == cont[:1] and r.emitted == [] and r.target_forwards == 0
        stats = AcceptanceStats(K)
        stats.add(r)
        assert stats.steps == 0 and stats.tokens == 1 and stats.tau == 1.0


def test_plain_decode_records_one_token_per_step_and_stops_at_the_stop_token(target):
    prompt, cont, j = greedy_with_fresh_token(target, 8, 12)
    r = plain_decode(target, prompt, 40, eos_ids={cont[j]})
    assert r.tokens == cont[:j + 1]
    check_steps(r)
    assert r.emitted == [1] * j and r.drafted == [0] * j and r.target_forwards == j
    stats = AcceptanceStats(K)
    stats.add(r)
    assert stats.tau == 1.0 and stats.tokens == j + 1 and stats.acceptance_rate is None  # nothing drafted: n/a


@pytest.mark.parametrize("temperature", [0.0, 0.9])
def test_ngram_steps_count_what_they_emit_with_frequent_stop_tokens(target, temperature):
    """Ten stop ids out of 96 end requests inside n-gram draft blocks; every result's steps add up to its
    tokens, and only the last token is a stop token."""
    stop = set(range(10))
    for seed in range(6):
        prompt = torch.randint(0, V, (12,), generator=torch.Generator().manual_seed(seed)).tolist() * 2
        r = speculative_decode(target, NGramProposer(), prompt, 4, 30, SamplingParams.uniform(1, temperature), eos_ids=stop,
                               seed=seed)
        check_steps(r)
        assert not set(r.tokens[:-1]) & stop
        assert len(r.tokens) == 30 or r.tokens[-1] in stop
        if temperature == 0.0:
            assert r.tokens == plain_decode(target, prompt, 30, eos_ids=stop).tokens


# ----------------------------------------------------------------------------- stop ids
class FakeTarget:
    """Delegates decoding to a tiny target; stop ids from a property, a method, or a tokenizer."""

    def __init__(self, inner, stop=None, kind="property", tokenizer_eos=None):
        self._inner, self._stop, self._kind = inner, stop, kind
        self.tokenizer = type("Tok", (), {"eos_token_id": tokenizer_eos})() if tokenizer_eos is not None else None

    def __getattr__(self, name):
        if name == "stop_token_ids" and self._kind is not None:
            if self._kind == "property":
                return self._stop
            return lambda chat_template=None: self._stop
        raise AttributeError(name)

    def session(self):
        return self._inner.session()

    def batch_session(self, max_batch):
        return self._inner.batch_session(max_batch)


@pytest.mark.parametrize("kind", ["property", "method"])
def test_decoding_stops_at_the_targets_stop_token_ids(target, kind):
    """Stop ids on the decode side: a stop id that is not the tokenizer's EOS ends plain and
    speculative decoding; explicit eos_ids win."""
    prompt, cont, j = greedy_with_fresh_token(target, 8, 12)
    fake = FakeTarget(target, stop=[cont[j], V - 1 if cont[j] != V - 1 else 0], kind=kind, tokenizer_eos=None)
    assert resolve_stop_ids(fake) == set(fake.stop_token_ids if kind == "property" else fake.stop_token_ids())
    assert plain_decode(fake, prompt, 40).tokens == cont[:j + 1]
    spec = speculative_decode(fake, Oracle(prompt, cont), prompt, K, 40)
    assert spec.tokens == cont[:j + 1]
    assert plain_decode(fake, prompt, 24, eos_ids=set()).tokens == cont


def test_stop_ids_fall_back_to_the_tokenizer_eos(target):
    prompt, cont, j = greedy_with_fresh_token(target, 8, 12)
    fake = FakeTarget(target, kind=None, tokenizer_eos=cont[j])
    assert resolve_stop_ids(fake) == {cont[j]}
    assert plain_decode(fake, prompt, 40).tokens == cont[:j + 1]
    assert resolve_stop_ids(FakeTarget(target, kind=None)) == set()
    assert resolve_stop_ids(FakeTarget(target, stop=[], kind="method", tokenizer_eos=3)) == set()
    assert resolve_stop_ids(fake, eos_ids=5) == {5}
    assert resolve_stop_ids(fake, eos_ids=[torch.tensor(7), 2]) == {2, 7}


def test_a_real_target_uses_its_stop_token_ids(target):
    """Target.stop_token_ids (tokenizer EOS ∪ generation_config EOS ∪ chat-template end-of-turn) is what
    plain and speculative decoding stop on when no eos_ids are given."""
    if not isinstance(getattr(type(target), "stop_token_ids", None), property):
        pytest.skip("Target.stop_token_ids is not a property here")
    assert resolve_stop_ids(target) == set(target.stop_token_ids)
    prompt, cont, j = greedy_with_fresh_token(target, 8, 12)
    target.stop_token_ids = [cont[j]]
    try:
        assert plain_decode(target, prompt, 24).tokens == cont[:j + 1]
        assert speculative_decode(target, Oracle(prompt, cont), prompt, K, 24).tokens == cont[:j + 1]
        assert speculative_decode(target, Oracle(prompt, cont), prompt, K, 24, eos_ids=set()).tokens == cont
    finally:
        target.stop_token_ids = None


# ----------------------------------------------------------------------------- bad input
@pytest.mark.parametrize("kw, match", [
    ({"max_new_tokens": 0}, "max_new_tokens"), ({"max_new_tokens": 2.5}, "max_new_tokens"),
    ({"k": -1}, "k"), ({"eos_ids": {"x"}}, "eos_ids"), ({"eos_ids": [-1]}, "eos_ids"),
])
def test_bad_decode_arguments_are_named(target, kw, match):
    args = {"k": 3, "max_new_tokens": 5, **kw}
    with pytest.raises(SpeculatorsError, match=match):
        speculative_decode(target, NGramProposer(), [1, 2, 3], args.pop("k"), args.pop("max_new_tokens"), **args)
    if "k" not in kw:
        args = {"max_new_tokens": 5, **kw}
        with pytest.raises(SpeculatorsError, match=match):
            plain_decode(target, [1, 2, 3], args.pop("max_new_tokens"), **args)


def test_max_new_tokens_zero_used_to_emit_a_token(target):
    """Same kind as item 9: max_new_tokens=0 emitted one token; now it is refused."""
    with pytest.raises(SpeculatorsError, match="max_new_tokens must be an integer >= 1"):
        plain_decode(target, [1, 2, 3], 0, eos_ids=set())


def test_a_proposer_that_drafts_more_than_asked_is_refused(target):
    class Greedy(NGramProposer):
        def propose(self, states, ks, sampling=None, generators=None):
            return [Proposal(torch.zeros(k + 2, dtype=torch.int64)) for k in ks]

    with pytest.raises(SpeculatorsError, match="returned 5 drafts when asked for at most 3"):
        speculative_decode(target, Greedy(), [1, 2, 3], 3, 20, eos_ids=set())


@pytest.mark.parametrize("kw", [{"min_n": 0}, {"max_n": 1, "min_n": 2}])
def test_ngram_rejects_bad_lengths(kw):
    with pytest.raises(SpeculatorsError, match="NGramProposer"):
        NGramProposer(**kw)


# ----------------------------------------------------------------------------- the proposer protocol
def _protocol_params(method) -> list[tuple[str, object]]:
    import inspect

    params = list(inspect.signature(method).parameters.values())
    return [(p.name, p.default) for p in params if p.name != "self"]


def test_every_family_and_the_ngram_proposer_implement_the_proposer_protocol():
    """one BATCHED protocol, one sampling type. Every registered family and
    NGramProposer are Proposers (runtime isinstance) and their start / propose / advance have the
    protocol's parameters (names, order, defaults): propose(states, ks, sampling=None, generators=None)
    takes lists of per-request states and draft counts and the verifier's SamplingParams of the batch;
    every family also has the per-request _propose_one / _advance_one the default batched loops call."""
    import inspect

    from speculators.drafters import Drafter, registry

    classes = [registry.get(n) for n in registry.names()] + [NGramProposer]
    assert len(classes) >= 5
    want = {name: _protocol_params(getattr(Proposer, name)) for name in ("start", "propose", "advance")}
    assert want["propose"] == [("states", inspect.Parameter.empty), ("ks", inspect.Parameter.empty),
                               ("sampling", None), ("generators", None)]
    assert [n for n, _ in want["advance"]] == ["states", "new_ids", "features"]
    one = [("state", inspect.Parameter.empty), ("k", inspect.Parameter.empty), ("sampling", None),
           ("generator", None)]
    for cls in classes:
        assert _protocol_params(cls._propose_one) == one, cls.__name__
        assert [n for n, _ in _protocol_params(cls._advance_one)] == ["state", "new_ids", "features"], cls.__name__
        if cls is not NGramProposer:
            # the family's own (the base declares none: its default propose/advance loop over these)
            assert cls._propose_one is not getattr(Drafter, "_propose_one", None), cls.__name__
            assert cls._advance_one is not getattr(Drafter, "_advance_one", None), cls.__name__
        for name, params in want.items():
            got = _protocol_params(getattr(cls, name))
            # parameter names and order must match; start/advance may default ``features`` (model-free)
            assert [n for n, _ in got] == [n for n, _ in params], (cls.__name__, name, got)
            if name == "propose":
                assert got == params, (cls.__name__, got)
    assert isinstance(NGramProposer(), Proposer)
    for cls in classes[:-1]:  # the runtime check on an instance (no target needed: object.__new__)
        assert isinstance(object.__new__(cls), Proposer), cls.__name__
    assert not isinstance(object(), Proposer)


def test_sampling_settings_are_the_verifiers_sampling_params(target):
    """One sampling-settings type: decodes take ``SamplingParams`` (batch of one) or None (greedy), and
    anything else is refused with an error naming ``sampling``."""
    prompt = [5, 6, 7, 5, 6]
    greedy = plain_decode(target, prompt, 8, eos_ids=set()).tokens
    assert plain_decode(target, prompt, 8, SamplingParams.uniform(1), eos_ids=set()).tokens == greedy
    assert speculative_decode(target, NGramProposer(), prompt, 3, 8, None, eos_ids=set()).tokens == greedy
    sp = SamplingParams.uniform(1, 0.9, top_k=8)
    a = speculative_decode(target, NGramProposer(), prompt, 3, 12, sp, eos_ids=set(), seed=4).tokens
    assert a == speculative_decode(target, NGramProposer(), prompt, 3, 12, sp, eos_ids=set(), seed=4).tokens
    for bad in ({"temperature": 0.9}, SamplingParams.uniform(2, 0.9)):
        with pytest.raises(SpeculatorsError, match="sampling"):
            plain_decode(target, prompt, 4, bad, eos_ids=set())
        with pytest.raises(SpeculatorsError, match="sampling"):
            speculative_decode(target, NGramProposer(), prompt, 3, 4, bad, eos_ids=set())
