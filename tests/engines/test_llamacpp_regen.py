"""Regeneration through the real llama-server (``data.regeneration.server.engine: llama.cpp``): the ids round trip
exactly (what the cache stores is what llama-server generated for those prompt ids), a killed regeneration resumes
asking only for the missing prompts, and ``speculators train`` through it records the producer. Needs
``make llama-cpp`` (skips without it, fails under ``CI=true``); the wire protocol's error paths are tested against
fake servers in tests/data/test_server_regen.py."""

from __future__ import annotations

import json
from pathlib import Path
from types import SimpleNamespace

import pytest

from speculators.data.regenerate import regenerate
from speculators.data.server_regen import LlamaCppApi, ServerClient, ServerError
from speculators.data.sources import Conversation
from speculators.engines import llamacpp_build
from speculators.engines.llamacpp_regen import LlamaServerRegeneration
from speculators.engines.llamacpp_server import LlamaServer

from conftest import CountingRegeneration

ROOT = Path(__file__).resolve().parents[2]
SPEC = SimpleNamespace(url=None, engine="llama.cpp", api=None, model=None, outtype=None, concurrency=2,
                       timeout_s=120.0, retries=1, threads=None)


class CountingEngine(CountingRegeneration, LlamaServerRegeneration):
    """llama-server as the regeneration starts it, counting the generation requests and able to stop after N."""


@pytest.fixture()
def served(llama_cpp, tiny_target_dir, isolated_cache, monkeypatch):
    from speculators.target import Target

    monkeypatch.setenv(llamacpp_build.ENV_VAR, str(llama_cpp.server.parent.parent))
    monkeypatch.setenv(llamacpp_build.SOURCE_ENV_VAR, str(llama_cpp.source))
    return Target.load(str(tiny_target_dir), "float32", log=lambda *a: None)


def _convs(n):
    return [Conversation(id=f"t/{i}", source="t", messages=[{"role": "user", "content": f"tell me about {i} cats"}])
            for i in range(n)]


def test_ids_round_trip_exactly_and_a_killed_run_resumes(served, llama_cpp, isolated_cache):
    target, convs = served, _convs(5)
    first = CountingEngine(SPEC, llama_cpp, stop_after=2)
    with pytest.raises(KeyboardInterrupt):
        regenerate(target, convs, "t", max_new_tokens=12, server=first, log=lambda *a: None)
    cache = list((isolated_cache / "regen").glob("t-*.jsonl"))
    assert len(cache) == 1 and len(cache[0].read_text().splitlines()) == 2

    second = CountingEngine(SPEC, llama_cpp)
    out = regenerate(target, convs, "t", max_new_tokens=12, server=second, log=lambda *a: None)
    assert len(second.requests) == 3 and not {tuple(p) for p in second.requests} & {tuple(p) for p in first.requests}
    recs = [json.loads(x) for x in cache[0].read_text().splitlines()]
    assert len(recs) == 5 == len({r["key"] for r in recs})
    ident = second.identity(target)
    assert ident["producer"] == "llama.cpp llama-server" and ident["gguf"].endswith(".gguf")

    # the stored ids are exactly what llama-server generates for those prompt ids, asked directly
    stops = set(target.stop_ids_for(None))
    with LlamaServer(llama_cpp, second.gguf(target), ctx_size=1024) as srv:
        for o in out:
            n_prompt = len(o.input_ids) - sum(o.loss_mask)  # the prompt carries no loss (one user turn)
            prompt, answer = o.input_ids[:n_prompt], o.input_ids[n_prompt:]
            direct = srv.complete(prompt, 12, temperature=0.0).tokens
            cut = next((i + 1 for i, t in enumerate(direct) if t in stops), len(direct))
            assert answer == direct[:cut], (answer, direct)


class NoIdsApi(LlamaCppApi):
    """llama-server's protocol without ``return_tokens``: the server answers text only."""

    def body(self, *a, **kw):
        b = super().body(*a, **kw)
        del b["return_tokens"]
        return b


def test_a_real_server_without_ids_or_gone_is_refused_with_its_url(served, llama_cpp):
    gguf = LlamaServerRegeneration(SPEC, llama_cpp).gguf(served)
    prompt = [int(t) for t in served.tokenizer("hello there", add_special_tokens=False)["input_ids"]]
    with LlamaServer(llama_cpp, gguf, ctx_size=512) as srv:
        client = ServerClient(srv.url, "llama.cpp", retries=1, backoff_s=0.01)
        assert client.generate(prompt, 4, served.stop_token_ids).ids  # the protocol works with ids
        client.api = NoIdsApi()
        with pytest.raises(ServerError, match="no token ids.*never re-tokenizes"):
            client.generate(prompt, 4, served.stop_token_ids)
        url = srv.url
    gone = ServerClient(url, "llama.cpp", retries=2, backoff_s=0.01)  # the server has exited: retried, then named
    with pytest.raises(ServerError, match=rf"{url}/completion: .* after 3 tries"):
        gone.generate(prompt, 4, served.stop_token_ids)


@pytest.mark.slow
def test_train_through_llama_server_records_the_producer(served, tmp_path, tiny_target_dir):
    from typer.testing import CliRunner

    from speculators.cli import app

    out = tmp_path / "run"
    r = CliRunner().invoke(app, ["train", str(ROOT / "recipes" / "tiny-eagle3.yaml"), f"target.model={tiny_target_dir}",
                                 "data.regeneration.batch_size=null", "data.regeneration.server.engine=llama.cpp",
                                 "data.regeneration.server.concurrency=4", "train.steps=2", "train.eval_every=2",
                                 "-o", str(out)])
    assert r.exit_code == 0, f"{r.exception!r}\n{r.output}"
    producer = json.loads((out / "final" / "config.json").read_text())["speculators_training"]["data_producer"]
    assert producer["producer"] == "llama.cpp llama-server" and producer["llama_cpp"].startswith("llama-cpp-python")
    assert "Answers regenerated by llama.cpp llama-server" in (out / "final" / "README.md").read_text()
