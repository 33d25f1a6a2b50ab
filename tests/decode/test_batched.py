"""Batched speculative decoding: the ragged batch session, the continuous-batching loop, its
statistical losslessness under mixed per-request sampling settings, request isolation, and ``device``.

Tiny random fp32 targets (seconds). The family-by-family B > 1 greedy contracts live in
tests/drafters/test_contracts.py; these tests use a model-free proposer whose drafts are random (drawn from a
fixed next-token table with each request's own generator), half of them with probabilities and half as
point masses, so both verifier branches and the loop's ragged assembly are exercised.
"""

from __future__ import annotations

import random

import pytest
import torch

from speculators.decode.proposal import Proposal
from speculators.errors import SpeculatorsError
from speculators.decode.state import BatchResult
from speculators.decode.loop import plain_decode, speculative_decode, speculative_generate
from speculators.decode.proposal import advance_each, propose_each
from speculators.decode.proposers import NGramProposer
from speculators.target import Target, build_tiny_target, resolve_device
from speculators.verify import SamplingParams, apply_sampling
from speculators.verify.testing import assert_distribution, chi2_check

V = 48


def untied_target(vocab: int = V, hidden: int = 32, layers: int = 2, seed: int = 1,
                  attention_scale: float = 4.0) -> Target:
    """A tiny random Llama with its own random output head (tied, a random model repeats its last token)
    and attention weights scaled by ``attention_scale``: at the default init a tiny random model's next
    token hardly depends on the context (its greedy token changes for ~1% of contexts replaced whole),
    so a KV-cache bug would go unseen; scaled by 4, ~15% change."""
    t = build_tiny_target(vocab_size=vocab, hidden_size=hidden, num_layers=layers, seed=seed)
    head = torch.randn(vocab, hidden, generator=torch.Generator().manual_seed(seed + 100)) * 0.7
    t.model.lm_head.weight = torch.nn.Parameter(head, requires_grad=False)
    t.model.config.tie_word_embeddings = False
    with torch.no_grad():
        for layer in t.model.model.layers:
            for proj in ("q_proj", "k_proj", "v_proj", "o_proj"):
                getattr(layer.self_attn, proj).weight.mul_(attention_scale)
    return t


class AuditedSessions:
    """Wraps ``target.batch_session`` so that every batched forward is recorded: per listed request its
    visible length before the forward, its new ids and the logits the batch returned. :meth:`check`
    then recomputes every row from scratch (one plain forward over the request's TRUE sequence, prompt
    + emitted tokens, cut at that length, + the new ids) and compares the logits (atol 1e-4): the
    cache held exactly the accepted prefix of that request and nothing of the others."""

    def __init__(self, target, monkeypatch):
        self.target, self.records = target, []
        make = target.batch_session

        def batch_session(max_batch):
            sess = make(max_batch)
            forward = sess.forward

            def audited(rids, ids_list):
                lengths = [sess.length(r) for r in rids]
                logits, feats = forward(rids, ids_list)
                self.records += [(r, n, torch.as_tensor(x).tolist(), lg.clone())
                                 for r, n, x, lg in zip(rids, lengths, ids_list, logits)]
                return logits, feats

            sess.forward = audited
            return sess

        monkeypatch.setattr(target, "batch_session", batch_session)

    def check(self, prompts, results) -> int:
        for r, n, ids, logits in self.records:
            seq = prompts[r] + results[r].tokens
            assert ids[0] == seq[n], (r, n)  # the step starts from the request's newest token
            full = torch.tensor([seq[:n] + ids])
            want = self.target.features(full, with_logits=True).logits[0, n:].float()
            torch.testing.assert_close(logits, want, atol=1e-4, rtol=0)
        return len(self.records)


@pytest.fixture(scope="module")
def target():
    return untied_target()


def rand_prompt(n: int, seed: int, vocab: int = V) -> list[int]:
    return torch.randint(0, vocab, (n,), generator=torch.Generator().manual_seed(seed)).tolist()


class TableProposer:
    """Random drafts from a fixed next-token table ``q(. | prev) = softmax(2 * T[prev])``.

    Request i draws only from ``generators[i]``. States of odd length return their drafts as point masses
    (``probs=None``), even ones with their probabilities, so a batch mixes both kinds (lossless either
    way: a random draft verified as a point mass is still accepted with probability ``p(d)``)."""

    def __init__(self, vocab: int = V, seed: int = 0):
        table = torch.randn(vocab, vocab, generator=torch.Generator().manual_seed(seed)) * 2
        self.q = table.softmax(-1)
        self.calls = []  # batch sizes of the propose calls

    def start(self, input_ids, features=None):
        return input_ids.reshape(-1).tolist()

    def propose(self, states, ks, sampling=None, generators=None):
        self.calls.append(len(states))
        out = []
        for i, (s, k) in enumerate(zip(states, ks)):
            g = generators[i] if generators is not None else None
            prev, toks, probs = s[-1], [], []
            for _ in range(k):
                q = self.q[prev]
                prev = int(torch.multinomial(q, 1, generator=g))
                toks.append(prev)
                probs.append(q)
            point = len(s) % 2 == 1 or not toks
            out.append(Proposal(torch.tensor(toks, dtype=torch.int64), None if point else torch.stack(probs)))
        return out

    def advance(self, states, new_ids, features):
        for s, ids in zip(states, new_ids):
            s.extend(ids.tolist())


# ----------------------------------------------------------------------------- the batch session
def test_batch_session_matches_the_batch1_session_through_rejections_joins_and_leaves(target):
    """Every request's logits and features (aux taps and final hidden state) equal the batch-1
    DecodeSession's over the same tokens (atol 1e-4, fp32) while other requests share the batch, after
    rejected drafts are rolled back, requests join (longer than the cache, shorter) and leave, and the
    cache is compacted (slack 0: every wasted slot triggers a re-pack)."""
    g = torch.Generator().manual_seed(0)
    sess = target.batch_session(5)
    sess.slack = 0
    ref = {}

    def join(rids, ns):
        ps = [torch.randint(0, V, (n,), generator=g) for n in ns]
        if len(rids) == 1:
            out = [sess.add(rids[0], ps[0].tolist())]
        else:  # several prompts prefilled together (right-padded)
            out = list(zip(*sess.add_many(rids, ps)))
        for rid, p, (blg, bf) in zip(rids, ps, out):
            s = target.session()
            lg, f = s.forward(p)
            ref[rid] = s
            torch.testing.assert_close(blg, lg[-1], atol=1e-4, rtol=0)
            torch.testing.assert_close(bf.aux, f.aux, atol=1e-4, rtol=0)
            torch.testing.assert_close(bf.top, f.top, atol=1e-4, rtol=0)

    join(["a"], [3])
    join(["b", "c"], [11, 6])
    checked = 0
    for step in range(8):
        rids = sess.request_ids
        listed = rids if step % 3 else rids[::-1][:-1]  # sometimes one row only carries padding
        new = {r: torch.randint(0, V, (1 + (step + len(r) + i) % 4,), generator=g) for i, r in enumerate(listed)}
        lengths = {r: sess.length(r) for r in rids}
        logits, feats = sess.forward(listed, [new[r] for r in listed])
        for r, lg, f in zip(listed, logits, feats):
            rl, rf = ref[r].forward(new[r])
            assert lg.shape == rl.shape and lg.dtype == torch.float32
            torch.testing.assert_close(lg, rl, atol=1e-4, rtol=0)
            torch.testing.assert_close(f.aux, rf.aux, atol=1e-4, rtol=0)
            torch.testing.assert_close(f.top, rf.top, atol=1e-4, rtol=0)
            checked += 1
            keep = lengths[r] + 1 + (step % 2) * (new[r].numel() - 1)  # odd steps keep all, even ones 1
            ref[r].crop(keep)
            sess.keep(r, keep)
            assert sess.length(r) == keep
        for r in set(rids) - set(listed):
            assert sess.length(r) == lengths[r]  # a padding-only row gains nothing
        if step == 2:
            sess.remove("b")  # the longest row leaves
        if step == 3:
            join(["d"], [25])  # longer than the cache: the cache is padded
        if step == 5:
            join(["e", "f"], [2, 4])
        assert sess.width >= max(sess.length(r) for r in sess.request_ids)
    assert checked >= 20
    assert sess.compactions > 0


def test_compaction_keeps_the_cache_bounded(target):
    """Rejected drafts leave invisible slots; compaction reclaims them, so the cache width follows the
    longest visible row instead of growing with the number of steps."""
    sess = target.batch_session(2)
    sess.add(0, rand_prompt(5, 1))
    sess.add(1, rand_prompt(9, 2))
    for _ in range(40):  # 6 tokens per step, 5 of them rejected: 200 wasted slots per row
        ids = [torch.randint(0, V, (6,)), torch.randint(0, V, (6,))]
        lengths = [sess.length(0), sess.length(1)]
        sess.forward([0, 1], ids)
        sess.keep(0, lengths[0] + 1)
        sess.keep(1, lengths[1] + 1)
    longest = max(sess.length(0), sess.length(1))
    assert longest == 49
    assert sess.width <= longest + max(sess.slack, longest // 8) + 6
    assert sess.compactions > 0
    before = sess.width
    sess.compact()
    assert sess.width == longest <= before


def test_batch_session_refuses_bad_use(target):
    sess = target.batch_session(2)
    sess.add("x", [1, 2, 3])
    with pytest.raises(SpeculatorsError, match="already in the batch"):
        sess.add("x", [4])
    with pytest.raises(SpeculatorsError, match="empty"):
        sess.add("y", [])
    with pytest.raises(SpeculatorsError, match=r"outside \[0, 48\)"):
        sess.add("y", [V])
    sess.add("y", [5])
    with pytest.raises(SpeculatorsError, match="max_batch=2"):
        sess.add("z", [1])
    with pytest.raises(SpeculatorsError, match="not in the batch"):
        sess.forward(["z"], [[1]])
    with pytest.raises(SpeculatorsError, match="listed twice"):
        sess.forward(["x", "x"], [[1], [2]])
    with pytest.raises(SpeculatorsError, match=r"n_valid must be an integer in \[1, 3\]"):
        sess.keep("x", 4)
    with pytest.raises(SpeculatorsError, match="n_valid"):
        sess.keep("x", 0)
    sess.remove("x")
    with pytest.raises(SpeculatorsError, match="not in the batch"):
        sess.remove("x")
    assert sess.request_ids == ["y"] and len(sess) == 1
    sess.remove("y")
    assert sess.cache is None and sess.width == 0
    with pytest.raises(SpeculatorsError, match="max_batch"):
        target.batch_session(0)


def test_a_sliding_window_model_decodes_in_batches():
    """Sliding-window layers (a window of 3 positions, shorter than the prompts): the batch session keeps
    every key and masks by position, so plain and speculative decoding at batch 2 give each request the
    tokens of greedy decoding by hand with the batch-1 session."""
    from transformers import MistralConfig, MistralForCausalLM

    torch.manual_seed(0)
    cfg = MistralConfig(vocab_size=32, hidden_size=16, intermediate_size=32, num_hidden_layers=1,
                        num_attention_heads=2, num_key_value_heads=1, sliding_window=3)
    t = Target(MistralForCausalLM(cfg))
    assert t.attention.windows == [3]

    def by_hand(prompt):
        ref = t.session()
        toks = []
        logits, _ = ref.forward(torch.tensor(prompt))
        for _ in range(8):
            toks.append(int(logits[-1].argmax()))
            logits, _ = ref.forward(torch.tensor(toks[-1:]))
        return toks

    prompts = [[1, 2, 3, 1, 2], [3, 4, 1]]
    want = [by_hand(p) for p in prompts]
    assert plain_decode(t, prompts[0], 8, eos_ids=set()).tokens == want[0]
    assert speculative_decode(t, NGramProposer(), prompts[0], 3, 8, eos_ids=set()).tokens == want[0]
    for proposer, k in ((None, 0), (NGramProposer(), 2)):
        out = speculative_generate(t, proposer, prompts, k, 8, None, batch_size=2, eos_ids=set())
        assert [r.tokens for r in out.results] == want


# ----------------------------------------------------------------------------- the loop
def test_plain_batched_sampling_equals_plain_decode_per_request(target):
    """proposer=None through the batched loop, mixed settings and seeds: every request's tokens equal its
    own batch-1 plain decode with the same seed (plain decoding is the same loop with 0 drafts)."""
    ps = [rand_prompt(n, 10 + n) for n in (2, 7, 4, 12, 3)]
    temps = [0.0, 0.8, 1.3, 0.0, 1.0]
    sp = SamplingParams(temperature=torch.tensor(temps), top_k=torch.tensor([0, 6, 0, 0, 0]),
                        top_p=torch.tensor([1.0, 1.0, 0.85, 1.0, 1.0]))
    seeds = [5, 6, 7, None, 9]
    out = speculative_generate(target, None, ps, 4, 12, sp, batch_size=2, eos_ids=set(), seeds=seeds)
    assert isinstance(out, BatchResult) and out.seconds > 0 and out.tokens == 5 * 12
    for i, (p, r) in enumerate(zip(ps, out.results)):
        one = SamplingParams(temperature=sp.temperature[i:i + 1], top_k=sp.top_k[i:i + 1], top_p=sp.top_p[i:i + 1])
        assert r.tokens == plain_decode(target, p, 12, one, eos_ids=set(), seed=seeds[i]).tokens, i
        assert r.drafted == [0] * 11 and r.emitted == [1] * 11


def _mixed_batch(kinds, n_per_kind, seed0):
    """Prompts, SamplingParams, seeds and per-request K for ``n_per_kind`` copies of each kind, shuffled
    so that every batch mixes the kinds. ``kinds``: (prompt, temperature, top_k, top_p, k)."""
    order = [j for j in range(len(kinds)) for _ in range(n_per_kind)]
    random.Random(seed0).shuffle(order)
    sp = SamplingParams(temperature=torch.tensor([kinds[j][1] for j in order]),
                        top_k=torch.tensor([kinds[j][2] for j in order]),
                        top_p=torch.tensor([kinds[j][3] for j in order]))
    return order, [kinds[j][0] for j in order], sp, [seed0 + i for i in range(len(order))], [kinds[j][4] for j in order]


def _exact_first_tokens(target, prompt, temperature, top_k, top_p):
    """Exact distributions of plain sampling from the target: ``joint12 [V*V]`` of the first two tokens
    (index t1 * V + t2) and the marginal ``p3 [V]`` of the third."""
    def dist(seqs):
        ids = torch.tensor(seqs)
        logits = target.features(ids, with_logits=True).logits[:, -1].float()
        n = ids.shape[0]
        return apply_sampling(logits, torch.full((n,), temperature), torch.full((n,), top_k, dtype=torch.int64),
                              torch.full((n,), top_p))

    p1 = dist([prompt])[0]
    p2 = dist([prompt + [t] for t in range(V)])  # [V, V]: p(t2 | t1)
    joint12 = p1[:, None] * p2
    pairs = joint12.flatten().nonzero()[:, 0].tolist()
    p3_rows = dist([prompt + [j // V, j % V] for j in pairs])
    p3 = (joint12.flatten()[pairs][:, None] * p3_rows).sum(0)
    return joint12.flatten(), p3


def test_batched_sampling_is_lossless_with_mixed_per_request_settings(target):
    """The batched path samples each request from the target's own distribution
    under ITS settings, whatever the others in the batch use. Three sampled kinds (top-k, top-p, plain
    temperature) with random drafts (point masses and full q rows), ragged K, and a greedy kind, shuffled
    into one continuous batch: the first two tokens (jointly) and the third token of every kind follow
    the exact plain-sampling distributions (chi-square, p < 1e-6 with fixed seeds); the greedy kind gives
    its greedy tokens every time."""
    kinds = [(rand_prompt(6, 1), 0.8, 6, 1.0, 3), (rand_prompt(4, 2), 1.3, 0, 0.85, 2),
             (rand_prompt(9, 3), 1.0, 0, 1.0, 3), (rand_prompt(5, 4), 0.0, 0, 1.0, 2)]
    N = 400
    order, ps, sp, seeds, ks = _mixed_batch(kinds, N, 1000)
    prop = TableProposer()
    out = speculative_generate(target, prop, ps, ks, 4, sp, batch_size=48, eos_ids=set(), seeds=seeds)
    assert max(prop.calls) > 1  # the proposer saw real batches
    drafted = accepted = 0
    for j, (prompt, temp, top_k, top_p, _) in enumerate(kinds):
        res = [r for r, o in zip(out.results, order) if o == j]
        toks = torch.tensor([r.tokens[:3] for r in res])
        drafted += sum(sum(r.drafted) for r in res)
        accepted += sum(sum(r.verifier_accepted) for r in res)
        if temp == 0:
            assert (toks == torch.tensor(plain_decode(target, prompt, 3, eos_ids=set()).tokens)).all()
            continue
        joint12, p3 = _exact_first_tokens(target, prompt, temp, top_k, top_p)
        assert_distribution(toks[:, 0] * V + toks[:, 1], joint12, f"kind {j}: (t1, t2)")
        assert_distribution(toks[:, 2], p3, f"kind {j}: t3")
    assert drafted > 0 and 0 < accepted < drafted


def test_the_losslessness_check_detects_a_request_sampled_with_anothers_settings(target):
    """The check above has power: tokens of the top-p kind decoded with the top-k kind's settings (what a
    per-request mix-up of sampling rows would give) fail it."""
    kinds = [(rand_prompt(4, 2), 0.8, 6, 1.0, 2)]  # the top-p kind's prompt with the top-k kind's settings
    order, ps, sp, seeds, ks = _mixed_batch(kinds, 300, 2000)
    out = speculative_generate(target, TableProposer(), ps, ks, 3, sp, batch_size=48, eos_ids=set(), seeds=seeds)
    toks = torch.tensor([r.tokens[:2] for r in out.results])
    joint12, _ = _exact_first_tokens(target, kinds[0][0], 1.3, 0, 0.85)
    stat, thr, tv, _ = chi2_check(toks[:, 0] * V + toks[:, 1], joint12)
    assert stat > thr, (stat, thr, tv)


def test_a_request_does_not_depend_on_the_rest_of_its_batch(target):
    """Isolation: the same request with the same seed gives identical tokens alone (batch 1, and through
    the batch-1 wrapper) and inside different batches (other prompts, lengths, settings, seeds, K, batch
    sizes and positions, with requests joining and leaving around it). Fails if one request's randomness
    (a shared generator, draws in another order) or KV state (a mask that lets rows see each other's
    slots) leaks into another's."""
    me = rand_prompt(7, 42)
    my_sp = dict(temperature=1.0, top_k=0, top_p=1.0)
    others = [(rand_prompt(n, 50 + n), t, tk, tp) for n, t, tk, tp in
              ((3, 0.7, 5, 1.0), (15, 0.0, 0, 1.0), (5, 1.5, 0, 0.9), (10, 1.0, 0, 1.0), (2, 0.9, 0, 1.0))]

    def run(position, companions, batch_size, proposer, k):
        reqs = list(companions)
        reqs.insert(position, (me, my_sp["temperature"], my_sp["top_k"], my_sp["top_p"]))
        sp = SamplingParams(temperature=torch.tensor([r[1] for r in reqs]),
                            top_k=torch.tensor([r[2] for r in reqs]), top_p=torch.tensor([r[3] for r in reqs]))
        seeds = [1234 if i == position else 77 + i * 13 + batch_size for i in range(len(reqs))]
        kk = [k if i == position else (i * 2 + batch_size) % 5 for i in range(len(reqs))]
        mx = [16 if i == position else 5 + 3 * i for i in range(len(reqs))]
        out = speculative_generate(target, proposer, [r[0] for r in reqs], kk, mx, sp, batch_size,
                                   eos_ids=set(), seeds=seeds)
        return out.results[position].tokens

    for proposer, k in ((TableProposer(), 3), (NGramProposer(), 2), (None, 0)):
        alone = run(0, [], 1, proposer, k)
        assert len(alone) == 16
        for position, companions, batch_size in ((0, others[:3], 4), (2, others, 3), (5, others, 6), (1, others, 2)):
            assert run(position, companions, batch_size, proposer, k) == alone, (type(proposer).__name__, position,
                                                                                 batch_size)
        one = SamplingParams.uniform(1, **my_sp)
        if proposer is None:
            assert plain_decode(target, me, 16, one, eos_ids=set(), seed=1234).tokens == alone
        else:
            assert speculative_decode(target, proposer, me, k, 16, one, eos_ids=set(), seed=1234).tokens == alone
    assert len({tuple(run(0, [], 1, None, 0)), tuple(plain_decode(target, me, 16, SamplingParams.uniform(
        1, **my_sp), eos_ids=set(), seed=4321).tokens)}) == 2  # another seed, other tokens: the seed matters


@pytest.mark.parametrize("temperature", [0.0, 1.0])
def test_every_batched_forward_sees_exactly_the_accepted_prefix(target, monkeypatch, temperature):
    """The loop's KV bookkeeping end to end: every row of every batched forward equals a fresh forward
    over that request's own accepted tokens (rejected drafts rolled back, nothing of other requests),
    through joins, leaves and both kinds of drafts; greedy outputs equal plain greedy decoding."""
    ps = [rand_prompt(n, 400 + n) for n in (3, 11, 6, 2, 8)]
    ps = [p + p[:4] for p in ps]  # some repeats for the n-gram proposer
    audit = AuditedSessions(target, monkeypatch)
    sp = SamplingParams.uniform(len(ps), temperature, top_k=10)
    for proposer in (TableProposer(), NGramProposer()):
        audit.records = []
        out = speculative_generate(target, proposer, ps, [3, 1, 4, 2, 3], [14, 6, 14, 10, 3], sp, 3,
                                   eos_ids=set(), seeds=list(range(len(ps))))
        rejected = sum(d - a for r in out.results for d, a in zip(r.drafted, r.verifier_accepted))
        assert rejected > 0
        assert audit.check(ps, out.results) == sum(r.target_forwards for r in out.results)
        if temperature == 0:
            for p, r, m in zip(ps, out.results, [14, 6, 14, 10, 3]):
                assert r.tokens == plain_decode(target, p, m, eos_ids=set()).tokens


def test_continuous_batching_keeps_at_most_batch_size_requests_and_reports_progress(target):
    ps = [rand_prompt(n, n) for n in (3, 6, 2, 9, 4, 5, 7)]
    prop = TableProposer()
    seen = []
    out = speculative_generate(target, prop, ps, 2, [3, 12, 5, 2, 9, 4, 6], None, batch_size=3,
                               eos_ids=set(), progress=lambda done, total: seen.append((done, total)))
    assert seen == [(i, 7) for i in range(1, 8)]
    assert max(prop.calls) == 3  # at most batch_size live requests
    assert [len(r.tokens) for r in out.results] == [3, 12, 5, 2, 9, 4, 6]
    assert out.target_forwards < sum(r.target_forwards for r in out.results)


def test_stop_tokens_end_requests_inside_a_batch(target):
    ps = [rand_prompt(n, 200 + n) for n in (4, 8, 3)]
    plain = [plain_decode(target, p, 20, eos_ids=set()).tokens for p in ps]
    stop = {plain[1][5]}  # ends request 1 at its 6th token at the latest, maybe the others too
    out = speculative_generate(target, NGramProposer(), ps, 3, 20, None, 2, eos_ids=stop)
    for p, r in zip(ps, out.results):
        assert r.tokens == plain_decode(target, p, 20, eos_ids=stop).tokens
    assert len(out.results[1].tokens) <= 6 and out.results[1].tokens[-1] in stop


@pytest.mark.parametrize("kw, match", [
    ({"prompts": [[1, 2], []]}, r"prompts\[1\]: empty"),
    ({"prompts": [[1, 2], [V]]}, r"prompts\[1\]: token ids must lie in \[0, 48\)"),
    ({"prompts": "hello"}, "prompts"),
    ({"k": [1, 2, 3]}, "k .*list of 2"),
    ({"k": -1}, "k"),
    ({"max_new_tokens": [4, 0]}, r"max_new_tokens\[1\]"),
    ({"batch_size": 0}, "batch_size"),
    ({"seeds": [1]}, "seeds"),
    ({"seeds": [1, "x"]}, r"seeds\[1\]"),
    ({"sampling": SamplingParams.uniform(3, 0.5)}, "sampling"),
    ({"sampling": {"temperature": 0.5}}, "sampling"),
    ({"eos_ids": {-2}}, "eos_ids"),
])
def test_bad_arguments_are_named(target, kw, match):
    args = {"prompts": [[1, 2], [3]], "k": 2, "max_new_tokens": 4, **kw}
    with pytest.raises(SpeculatorsError, match=match):
        speculative_generate(target, NGramProposer(), args.pop("prompts"), args.pop("k"), args.pop("max_new_tokens"),
                             **args)


def test_bad_proposals_are_refused(target):
    class TooMany(TableProposer):
        def propose(self, states, ks, sampling=None, generators=None):
            return [Proposal(torch.zeros(k + 1, dtype=torch.int64)) for k in ks]

    class Short(TableProposer):
        def propose(self, states, ks, sampling=None, generators=None):
            return super().propose(states, ks, sampling, generators)[:-1]

    class OutOfVocab(TableProposer):
        def propose(self, states, ks, sampling=None, generators=None):
            return [Proposal(torch.full((k,), V, dtype=torch.int64)) for k in ks]

    for cls, match in ((TooMany, "returned 3 drafts when asked for at most 2"), (Short, "one Proposal per request"),
                       (OutOfVocab, r"draft ids outside \[0, 48\)")):
        with pytest.raises(SpeculatorsError, match=match):
            speculative_generate(target, cls(), [[1, 2, 3], [4, 5]], 2, 8, None, 2, eos_ids=set())


def test_a_proposer_written_one_request_at_a_time_works(target):
    """A proposer whose batched propose/advance loop over ONE request at a time (the protocol's
    ``propose_each`` / ``advance_each``) gives the same output as the batched n-gram proposer."""
    class OneAtATime:
        def __init__(self):
            self.inner = NGramProposer()

        def start(self, input_ids, features=None):
            return self.inner.start(input_ids)

        def propose(self, states, ks, sampling=None, generators=None):
            return propose_each(lambda state, k, *_: self.inner._propose_one(state, k), states, ks, sampling,
                                generators)

        def advance(self, states, new_ids, features=None):
            advance_each(lambda state, ids, _: self.inner._advance_one(state, ids), states, new_ids, features)

    ps = [p + p for p in (rand_prompt(5, 1), rand_prompt(8, 2), rand_prompt(3, 3))]
    a = speculative_generate(target, OneAtATime(), ps, 3, 12, None, 2, eos_ids=set())
    b = speculative_generate(target, NGramProposer(), ps, 3, 12, None, 2, eos_ids=set())
    assert [r.tokens for r in a.results] == [r.tokens for r in b.results]
    assert [r.drafted for r in a.results] == [r.drafted for r in b.results]


def test_on_step_reports_each_verification_step_of_each_request(target):
    """The outcome hook is called once per request per verification step with the prompt's index, the
    verified Proposal, the verifier's accepted count and the emitted ids: per request these retell the
    GenerationResult (drafted, verifier_accepted, emitted, and the tokens after the prefill's first)."""
    ps = [rand_prompt(n, 300 + n) for n in (4, 7, 3, 6, 5)]
    plain = [plain_decode(target, p, 12, eos_ids=set()).tokens for p in ps]
    stop = {plain[2][4]}
    for proposer, k in ((TableProposer(), 3), (NGramProposer(), 2), (None, 0)):
        calls = []
        out = speculative_generate(target, proposer, ps, k, [12, 5, 12, 9, 1], None, batch_size=2,
                                   eos_ids=stop, seeds=list(range(5)),
                                   on_step=lambda *a: calls.append(a))
        for i, r in enumerate(out.results):
            mine = [c for c in calls if c[0] == i]
            assert len(mine) == r.target_forwards
            assert all(isinstance(c[1], Proposal) for c in mine)
            assert [int(c[1].token_ids.numel()) for c in mine] == r.drafted
            assert [c[2] for c in mine] == r.verifier_accepted
            assert [len(c[3]) for c in mine] == r.emitted
            assert [t for c in mine for t in c[3]] == r.tokens[1:]
        assert out.results[4].target_forwards == 0  # max_new_tokens 1: the prefill's token only
    with pytest.raises(SpeculatorsError, match="on_step"):
        speculative_generate(target, None, ps, 0, 4, on_step=3)


# ----------------------------------------------------------------------------- device
def test_resolve_device():
    assert resolve_device(None) == torch.device("cuda" if torch.cuda.is_available() else "cpu")
    assert resolve_device("cpu") == torch.device("cpu")
    with pytest.raises(SpeculatorsError, match="device: 'gpu0' is not a torch device"):
        resolve_device("gpu0")
    if not torch.cuda.is_available():
        with pytest.raises(SpeculatorsError, match="device: 'cuda' requested but CUDA is not available"):
            resolve_device("cuda")
    else:
        with pytest.raises(SpeculatorsError, match="CUDA device"):
            resolve_device(f"cuda:{torch.cuda.device_count()}")


def test_target_load_puts_the_model_on_the_device(tiny_target_dir):
    lines = []
    t = Target.load(str(tiny_target_dir), device="cpu", log=lines.append)
    assert t.device == torch.device("cpu") and "float32 on cpu" in lines[0]
    assert Target.load(str(tiny_target_dir), log=lines.append).device == resolve_device(None)
    with pytest.raises(SpeculatorsError, match="device"):
        Target.load(str(tiny_target_dir), device="nonsense", log=lines.append)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA (scripts/gpu_check.sh runs it on a GPU)")
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_batched_greedy_on_cuda_equals_plain_on_cuda(dtype):
    """On CUDA (fp32 and bf16 targets): the batched greedy output equals batch-1 plain greedy decoding
    on the same device, the verifier running its Triton kernels (impl="auto")."""
    t = untied_target()
    t.model.to("cuda", dtype)
    ps = [rand_prompt(n, 300 + n) for n in (3, 9, 5, 14)]
    out = speculative_generate(t, NGramProposer(), [p + p for p in ps], 3, 16, None, 3, eos_ids=set())
    for p, r in zip(ps, out.results):
        assert r.tokens == plain_decode(t, p + p, 16, eos_ids=set()).tokens
    sp = SamplingParams.uniform(4, 0.9, top_k=8, device="cuda")
    a = speculative_generate(t, TableProposer(), ps, 2, 12, sp, 4, eos_ids=set(), seeds=[1, 2, 3, 4])
    b = speculative_generate(t, TableProposer(), ps[2:3], 2, 12, SamplingParams.uniform(1, 0.9, top_k=8, device="cuda"),
                             1, eos_ids=set(), seeds=[3])
    assert a.results[2].tokens == b.results[0].tokens
