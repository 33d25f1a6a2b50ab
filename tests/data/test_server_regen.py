"""Regeneration through an inference server (speculators.data.server_regen) against in-process fake servers in
vLLM's, SGLang's and llama-server's wire shapes: token ids in and out, the stop token stored once, servers that
return no ids refused, retries and their final error, concurrency, kill-and-resume through the cache, the
server's identity in the cache key, and the run card / config.json recording who regenerated the answers.
The same protocol against the real llama-server: tests/engines/test_llamacpp_regen.py."""

from __future__ import annotations

import json
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from types import SimpleNamespace

import pytest

from speculators.data.regenerate import regenerate
from speculators.data.server_regen import (Generated, RunningServer, ServerClient, ServerError, _finish, generate_all,
                                           producer_line, regeneration_server)
from speculators.data.sources import Conversation
from speculators.errors import SpeculatorsError

ROOT = Path(__file__).resolve().parents[2]
STOP = 2  # the stop id the fake servers answer with (one of the tiny target's stop ids in the tests that use it)


class FakeServer:
    """A threaded HTTP server on 127.0.0.1; ``answer(path, body) -> (status, json)`` decides every response.
    ``bodies`` keeps every request (path, body); ``in_flight_max`` the most requests served at once."""

    def __init__(self, answer, delay: float = 0.0):
        self.answer, self.delay, self.bodies = answer, delay, []
        self.lock, self.in_flight, self.in_flight_max = threading.Lock(), 0, 0
        fake = self

        class Handler(BaseHTTPRequestHandler):
            def _reply(self, body):
                with fake.lock:
                    fake.bodies.append((self.path, body))
                    fake.in_flight += 1
                    fake.in_flight_max = max(fake.in_flight_max, fake.in_flight)
                time.sleep(fake.delay)
                status, out = fake.answer(self.path, body)
                with fake.lock:
                    fake.in_flight -= 1
                data = json.dumps(out).encode()
                self.send_response(status)
                self.send_header("Content-Type", "application/json")
                self.send_header("Content-Length", str(len(data)))
                self.end_headers()
                self.wfile.write(data)

            def do_POST(self):
                n = int(self.headers.get("Content-Length", 0))
                self._reply(json.loads(self.rfile.read(n)))

            def do_GET(self):
                self._reply(None)

            def log_message(self, *a):
                pass

        self.httpd = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.url = f"http://127.0.0.1:{self.httpd.server_address[1]}"
        threading.Thread(target=self.httpd.serve_forever, daemon=True).start()

    def close(self):
        self.httpd.shutdown()
        self.httpd.server_close()

    def generations(self) -> int:
        return sum(1 for p, _ in self.bodies if p in ("/v1/completions", "/generate", "/completion"))


def response_for(prompt: list[int]) -> list[int]:
    """The fake model's answer to a prompt: three ids derived from it (deterministic)."""
    return [100 + (sum(prompt) + i) % 50 for i in range(3)]


def answer_as(api: str, keep_stop: bool = True, ids_field: bool = True):
    """A fake server of ``api``: answers :func:`response_for` + the stop token (kept in the ids or stripped and
    reported the way that server reports it); ``ids_field=False`` answers text only."""
    def answer(path, body):
        if body is None:  # model probes
            return 200, {"data": [{"id": "fake-model"}], "model_path": "fake-model"}
        prompt = body.get("prompt", body.get("input_ids"))
        ids = response_for(prompt) + ([STOP] if keep_stop else [])
        if api == "openai":
            c = {"text": "hello", "finish_reason": "stop", "stop_reason": None if keep_stop else STOP}
            if ids_field:
                c["token_ids"] = ids
            return 200, {"choices": [c]}
        if api == "sglang":
            out = {"text": "hello", "meta_info": {"finish_reason": {"type": "stop", "matched": STOP}}}
            if ids_field:
                out["output_ids"] = ids
            return 200, out
        out = {"content": "hello", "stop_type": "eos"}
        if ids_field:
            out["tokens"] = ids
        return 200, out
    return answer


@pytest.fixture()
def fake():
    servers = []

    def start(answer, delay=0.0):
        s = FakeServer(answer, delay)
        servers.append(s)
        return s

    yield start
    for s in servers:
        s.close()


@pytest.mark.parametrize("api, keep_stop", [("openai", True), ("openai", False), ("sglang", True), ("sglang", False),
                                            ("llama.cpp", True)])
def test_token_ids_go_in_and_come_out_with_the_stop_token_once(fake, api, keep_stop):
    srv = fake(answer_as(api, keep_stop))
    prompt = [1, 5, 9, 33]
    gen = ServerClient(srv.url, api).generate(prompt, 16, [STOP, 7], temperature=0.0, seed=3)
    assert gen == Generated(response_for(prompt), STOP)
    path, body = srv.bodies[-1]
    if api == "openai":
        assert path == "/v1/completions" and body["prompt"] == prompt and body["return_token_ids"] is True
        assert body["stop_token_ids"] == [STOP, 7] and body["max_tokens"] == 16
    elif api == "sglang":
        assert path == "/generate" and body["input_ids"] == prompt
        assert body["sampling_params"]["stop_token_ids"] == [STOP, 7]
    else:
        assert path == "/completion" and body["prompt"] == prompt and body["return_tokens"] is True
        assert body["n_predict"] == 16


@pytest.mark.parametrize("api", ["openai", "sglang", "llama.cpp"])
def test_a_server_that_returns_no_token_ids_is_refused(fake, api):
    srv = fake(answer_as(api, ids_field=False))
    with pytest.raises(ServerError, match="no token ids.*never re-tokenizes"):
        ServerClient(srv.url, api).generate([1, 2, 3], 8, [STOP])


def test_only_a_stop_token_or_max_new_tokens_ends_a_trained_answer():
    assert _finish([5, 6, STOP, 8, STOP], [STOP], "stop", None, 8, "w") == Generated([5, 6], STOP)  # first stop
    assert _finish([5, 6], [STOP], "stop", STOP, 8, "w") == Generated([5, 6], STOP)  # stripped, reported
    assert _finish([5, 6, 7], [STOP], "length", None, 3, "w") == Generated([5, 6, 7], None)  # cut by max_new_tokens
    assert _finish([5, STOP, 7], [STOP], "length", None, 3, "w") == Generated([5], STOP)  # a stop it did not honour
    with pytest.raises(ServerError, match="token 9, which is not one of the target's stop ids"):
        _finish([5, 6], [STOP], "stop", 9, 8, "w")
    with pytest.raises(ServerError, match="token 6, which is not one"):  # kept in the ids, unreported: the last
        _finish([5, 6], [STOP], "stop", None, 8, "w")
    with pytest.raises(ServerError, match="returned no stop token id"):
        _finish([5, 6], [STOP], "stop", "</s>", 8, "w")
    with pytest.raises(ServerError, match="finish reason 'abort'.*not trained"):
        _finish([5, 6], [STOP], "abort", None, 8, "w")
    with pytest.raises(ServerError, match="ended at 2 of max_new_tokens=8 tokens"):  # a full context, not the limit
        _finish([5, 6], [STOP], "length", None, 8, "w")


def test_every_request_pins_the_sampling_and_foreign_ids_are_refused(fake):
    srv = fake(answer_as("sglang"))
    ServerClient(srv.url, "sglang").generate([1, 2], 8, [STOP], temperature=0.7, top_p=0.9)
    sp = srv.bodies[-1][1]["sampling_params"]
    assert (sp["temperature"], sp["top_p"], sp["top_k"], sp["min_p"], sp["repetition_penalty"]) == (0.7, 0.9, -1, 0.0, 1.0)
    with pytest.raises(ServerError, match="outside the target's vocabulary"):
        ServerClient(srv.url, "sglang").generate([1, 2], 8, [STOP], vocab_size=104)  # the fake answers 103, 104, 105


def test_server_errors_are_retried_then_reported_with_the_url_and_status(fake):
    calls = {"n": 0}

    def flaky(path, body):
        calls["n"] += 1
        return (503, {"error": "busy"}) if calls["n"] <= 2 else answer_as("llama.cpp")(path, body)

    srv = fake(flaky)
    gen = ServerClient(srv.url, "llama.cpp", retries=3, backoff_s=0.01).generate([4, 4], 8, [STOP])
    assert gen.stop == STOP and calls["n"] == 3  # two 503s, then the answer

    down = fake(lambda p, b: (500, {"error": "boom"}))
    with pytest.raises(ServerError) as e:
        ServerClient(down.url, "llama.cpp", retries=2, backoff_s=0.01).generate([4], 8, [STOP])
    assert f"{down.url}/completion" in str(e.value) and "HTTP 500" in str(e.value) and "3 tries" in str(e.value)
    assert down.generations() == 3

    bad = fake(lambda p, b: (400, {"error": "bad prompt"}))
    with pytest.raises(ServerError, match=r"HTTP 400.*not retried"):
        ServerClient(bad.url, "llama.cpp", retries=3, backoff_s=0.01).generate([4], 8, [STOP])
    assert bad.generations() == 1

    dead = bad.url.rsplit(":", 1)[0] + ":1"
    with pytest.raises(ServerError, match=r"127\.0\.0\.1:1/completion: .* after 2 tries"):
        ServerClient(dead, "llama.cpp", retries=1, backoff_s=0.01).generate([4], 8, [STOP])


def test_requests_run_concurrency_in_flight_and_every_one_is_answered(fake):
    srv = fake(answer_as("openai"), delay=0.2)
    reqs = {f"k{i}": {"prompt": [i, i + 1], "max_new_tokens": 8, "stops": [STOP]} for i in range(8)}
    got = {}
    generate_all(ServerClient(srv.url, "openai"), reqs, 4, lambda k, g: got.__setitem__(k, g))
    assert srv.in_flight_max == 4
    assert got == {k: Generated(response_for(r["prompt"]), STOP) for k, r in reqs.items()}


def _spec(url, api="llama.cpp", **kw):
    base = dict(url=url, engine=None, api=api, model=None, concurrency=2, timeout_s=30.0, retries=0)
    return SimpleNamespace(**{**base, **kw})


def _convs(n):
    return [Conversation(id=f"t/{i}", source="t", messages=[{"role": "user", "content": f"question number {i}?"}])
            for i in range(n)]


def test_kill_and_resume_regenerates_nothing_twice(fake, tiny_target_dir, isolated_cache):
    from speculators.target import Target

    target = Target.load(str(tiny_target_dir), "float32", log=lambda *a: None)
    stop = target.stop_token_ids[0]
    calls = {"n": 0}

    def dies_after_two(path, body):
        if body is None:
            return 200, {"model_path": "fake-model"}
        calls["n"] += 1
        if calls["n"] > 2:
            return 400, {"error": "server going down"}
        return 200, {"tokens": response_for(body["prompt"]) + [stop], "stop_type": "eos"}

    convs = _convs(6)
    srv = fake(dies_after_two)
    server = RunningServer(_spec(srv.url, concurrency=1))
    with pytest.raises(ServerError, match="HTTP 400"):
        regenerate(target, convs, "t", max_new_tokens=8, server=server, log=lambda *a: None)
    cache = list((isolated_cache / "regen").glob("t-*.jsonl"))
    assert len(cache) == 1 and len(cache[0].read_text().splitlines()) == 2  # the two answers kept

    healthy = fake(lambda p, b: (200, {"model_path": "fake-model"}) if b is None else
                   (200, {"tokens": response_for(b["prompt"]) + [stop], "stop_type": "eos"}))
    out = regenerate(target, convs, "t", max_new_tokens=8, server=RunningServer(_spec(healthy.url)),
                     log=lambda *a: None)
    assert healthy.generations() == 4  # only the four missing prompts
    keys = [json.loads(x)["key"] for x in cache[0].read_text().splitlines()]
    assert len(keys) == 6 == len(set(keys))
    for c, o in zip(convs, out):
        prompt = o.input_ids[: len(o.input_ids) - 4]
        assert o.input_ids[-4:] == response_for(prompt) + [stop] and o.loss_mask[-4:] == [1, 1, 1, 1]

    # another served model is another producer: its own cache; our loop's key does not carry a server
    other = fake(lambda p, b: (200, {"model_path": "other-model"}) if b is None else
                 (200, {"tokens": response_for(b["prompt"]) + [stop], "stop_type": "eos"}))
    regenerate(target, convs[:1], "t", max_new_tokens=8, server=RunningServer(_spec(other.url)), log=lambda *a: None)
    assert other.generations() == 1 and len(list((isolated_cache / "regen").glob("t-*.jsonl"))) == 2


def test_an_engine_is_not_started_by_the_data_layer():
    from speculators.engines import regeneration_engine
    from speculators.engines.llamacpp_regen import LlamaServerRegeneration

    engine = SimpleNamespace(url=None, engine="llama.cpp")
    with pytest.raises(SpeculatorsError, match="started by the workflow"):
        regeneration_server(engine)
    assert regeneration_server(None) is None
    assert isinstance(regeneration_server(_spec("http://h:1")), RunningServer)
    assert isinstance(regeneration_engine(engine), LlamaServerRegeneration)
    from speculators.engines.vllm_regen import VllmServeRegeneration

    vllm = SimpleNamespace(url=None, engine="vllm", concurrency=3)
    with pytest.raises(SpeculatorsError, match="started by the workflow"):
        regeneration_server(vllm)
    assert isinstance(regeneration_engine(vllm), VllmServeRegeneration) and regeneration_engine(vllm).concurrency == 3
    assert regeneration_engine(_spec("http://h:1")) is None and regeneration_engine(None) is None


def test_the_server_settings_are_checked_by_the_recipe():
    from speculators.recipe import load_recipe

    tiny = ROOT / "recipes" / "tiny-eagle3.yaml"
    r = load_recipe(tiny, ["data.regeneration.batch_size=null", "data.regeneration.server.url=http://h:8000"])
    assert r.data.regeneration.server.api == "openai"  # vLLM's protocol unless told
    for bad, msg in [(["data.regeneration.server.concurrency=4"], "exactly one of url"),
                     (["data.regeneration.batch_size=null", "data.regeneration.server.url=gpu-node:8000"],
                      "not an http:// or https:// URL"),
                     (["data.regeneration.server.engine=llama.cpp"], "batch_size"),
                     (["data.regeneration.batch_size=null", "data.regeneration.server.engine=llama.cpp",
                       "data.regeneration.server.api=openai"], "api: only with url"),
                     (["data.regeneration.batch_size=null", "data.regeneration.server.url=http://h",
                       "data.regeneration.server.outtype=q8_0"], "outtype: only with engine"),
                     (["data.regeneration.batch_size=null", "data.regeneration.server.engine=vllm",
                       "data.regeneration.server.threads=2"], "threads: only with engine: llama.cpp"),
                     (["data.regeneration.batch_size=null", "data.regeneration.server.engine=sglang"], "engine")]:
        with pytest.raises(SpeculatorsError, match=msg):
            load_recipe(tiny, bad)


def test_the_run_card_and_config_say_who_regenerated_the_answers(fake, tmp_path, tiny_target_dir, isolated_cache):
    """``speculators train`` with ``data.regeneration.server.url`` (a fake llama-server): every regenerated answer
    is the server's, and final/config.json and final/README.md name the producer."""
    from typer.testing import CliRunner

    from speculators.cli import app
    from speculators.target import Target

    stop = Target.load(str(tiny_target_dir), "float32", log=lambda *a: None).stop_token_ids[0]
    srv = fake(lambda p, b: (200, {"model_path": "fake-model"}) if b is None else
               (200, {"tokens": response_for(b["prompt"]) + [stop], "stop_type": "eos"}))
    out = tmp_path / "run"
    r = CliRunner().invoke(app, ["train", str(ROOT / "recipes" / "tiny-eagle3.yaml"), f"target.model={tiny_target_dir}",
                                 "data.regeneration.batch_size=null", f"data.regeneration.server.url={srv.url}",
                                 "data.regeneration.server.api=llama.cpp", "train.steps=2", "train.eval_every=2",
                                 "-o", str(out)])
    assert r.exit_code == 0, f"{r.exception!r}\n{r.output}"
    assert srv.generations() > 0
    cfg = json.loads((out / "final" / "config.json").read_text())
    assert cfg["speculators_training"]["data_producer"] == {"producer": "inference server", "api": "llama.cpp",
                                                            "model": "fake-model"}
    card = (out / "final" / "README.md").read_text()
    assert producer_line(cfg["speculators_training"]["data_producer"]) in card
    assert "Answers regenerated by inference server" in card
