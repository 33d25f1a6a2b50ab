"""Regeneration through the real vLLM server (vLLM's CPU build, ``make vllm``): ``data.regeneration.server.engine:
vllm`` starts ``vllm serve`` on the target; the ids round trip exactly (what the cache stores is what vLLM generates
for those prompt ids), a killed regeneration resumes asking only for the missing prompts, and the ``url`` + ``api:
openai`` client talks to a running vLLM token ids in, token ids out. The wire protocol's error paths are tested
against fake servers in tests/data/test_server_regen.py."""

from __future__ import annotations

import json
from pathlib import Path
from types import SimpleNamespace

import pytest

from speculators.data.regenerate import regenerate
from speculators.data.server_regen import OpenAIApi, RunningServer, ServerClient, ServerError
from speculators.data.sources import Conversation
from speculators.engines.vllm_regen import VllmServeRegeneration

from conftest import CountingRegeneration

ROOT = Path(__file__).resolve().parents[2]
SPEC = SimpleNamespace(url=None, engine="vllm", api=None, model=None, outtype=None, concurrency=2, timeout_s=120.0,
                       retries=1, threads=None)


class CountingEngine(CountingRegeneration, VllmServeRegeneration):
    """vllm serve as the regeneration starts it, counting the generation requests and able to stop after N."""


@pytest.fixture(scope="module")
def vllm_target(vllm_target_dir):
    """A tiny target vLLM's CPU attention takes (head_dim 32), loaded as the regeneration loads it."""
    from speculators.target import Target

    return Target.load(str(vllm_target_dir), "float32", log=lambda *a: None)


def _convs(n):
    return [Conversation(id=f"t/{i}", source="t", messages=[{"role": "user", "content": f"tell me about {i} cats"}])
            for i in range(n)]


@pytest.mark.slow
def test_ids_round_trip_exactly_and_a_killed_run_resumes(vllm_python, vllm_target, isolated_cache):
    from speculators.engines.vllm_runner import engine, generate_job, run_vllm, vllm_target_dir

    target, convs = vllm_target, _convs(5)
    first = CountingEngine(SPEC, vllm_python, stop_after=2)
    with pytest.raises(KeyboardInterrupt):
        regenerate(target, convs, "t", max_new_tokens=12, server=first, log=lambda *a: None)
    cache = list((isolated_cache / "regen").glob("t-*.jsonl"))
    assert len(cache) == 1 and len(cache[0].read_text().splitlines()) == 2

    second = CountingEngine(SPEC, vllm_python)
    out = regenerate(target, convs, "t", max_new_tokens=12, server=second, log=lambda *a: None)
    assert len(second.requests) == 3 and not {tuple(p) for p in second.requests} & {tuple(p) for p in first.requests}
    recs = [json.loads(x) for x in cache[0].read_text().splitlines()]
    assert len(recs) == 5 == len({r["key"] for r in recs})
    ident = second.identity(target)
    assert ident["producer"] == "vLLM vllm serve" and ident["vllm"].startswith("0.32") and ident["dtype"] == "float32"

    # the stored ids are exactly what vLLM generates for those prompt ids, asked through its offline engine
    stops = sorted(set(target.stop_ids_for(None)))
    prompts, answers = [], []
    for o in out:
        n_prompt = len(o.input_ids) - sum(o.loss_mask)  # the prompt carries no loss (one user turn)
        prompts.append(o.input_ids[:n_prompt])
        answers.append(o.input_ids[n_prompt:])
    _, runs = run_vllm(vllm_target_dir(target), [engine("plain", None, [generate_job(prompts, 12, stops)])],
                       python=vllm_python, log=lambda *a: None)
    for answer, direct in zip(answers, runs[0].jobs[0].outputs):
        assert answer == direct.token_ids, (answer, direct.token_ids)


class NoIdsApi(OpenAIApi):
    """vLLM's protocol without ``return_token_ids``: the server answers text only."""

    def body(self, *a, **kw):
        b = super().body(*a, **kw)
        del b["return_token_ids"]
        return b


@pytest.mark.slow
def test_a_running_vllm_at_a_url_talks_ids_and_is_refused_without_them(vllm_python, vllm_target, isolated_cache):
    from speculators.engines.vllm_runner import vllm_target_dir
    from speculators.engines.vllm_server import VllmServer

    prompt = [int(t) for t in vllm_target.tokenizer("hello there", add_special_tokens=False)["input_ids"]]
    stops = vllm_target.stop_token_ids
    with VllmServer(vllm_target_dir(vllm_target), max_model_len=256, max_num_seqs=2, python=vllm_python) as srv:
        spec = SimpleNamespace(url=srv.url, engine=None, api="openai", model=None, concurrency=2, timeout_s=60.0,
                               retries=1)
        running = RunningServer(spec)
        ident = running.identity(vllm_target, log=lambda *a: None)  # the served model's name, from /v1/models
        assert ident["model"] == srv.served_name and ident["api"] == "openai"
        out = regenerate(vllm_target, _convs(2), "u", max_new_tokens=6, server=running, log=lambda *a: None)
        assert len(out) == 2 and all(sum(o.loss_mask) >= 1 for o in out)
        client = ServerClient(srv.url, "openai", retries=1, backoff_s=0.01)
        assert client.generate(prompt, 4, stops).ids
        client.api = NoIdsApi()
        with pytest.raises(ServerError, match="no token ids.*never re-tokenizes"):
            client.generate(prompt, 4, stops)


@pytest.mark.slow
def test_a_target_vllm_cannot_decode_fails_at_start_in_vllms_words(vllm_python, tiny_target_dir, isolated_cache):
    """vLLM's /health answers before its engine has run a forward, and the CPU attention refuses head_dim 16 only
    at the first step: the regeneration fails before any request, quoting the engine worker's own error, and
    caches nothing."""
    from speculators.errors import SpeculatorsError
    from speculators.target import Target

    target = Target.load(str(tiny_target_dir), "float32", log=lambda *a: None)  # head_dim 16
    with pytest.raises(SpeculatorsError, match=r"could not decode one token.*head_dim=16"):
        regenerate(target, _convs(2), "t", max_new_tokens=4, server=VllmServeRegeneration(SPEC, vllm_python),
                   log=lambda *a: None)
    assert not list((isolated_cache / "regen").glob("t-*.jsonl"))
