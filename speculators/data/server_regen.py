"""Regeneration through an inference server: token ids in, token ids out, over HTTP.

The prompt is rendered and tokenized with the target's chat template exactly as for our own PyTorch loop
(:func:`speculators.data.regenerate.regenerate`) and sent as token ids; the response is stored as the token
ids the server returns, with the stop token. A server that does not return token ids is refused: its text is
never tokenized again (a re-tokenized answer is not what the target produced).

Three wire protocols (``data.regeneration.server.api``):

* ``openai``: vLLM's OpenAI-compatible ``POST /v1/completions`` with a token-array ``prompt``,
  ``stop_token_ids`` and ``return_token_ids: true``; the ids are ``choices[0].token_ids``, the end in
  ``finish_reason`` (``stop`` / ``length``) and ``stop_reason`` (the stop token id, or None for EOS).
* ``sglang``: SGLang's native ``POST /generate`` with ``input_ids`` and ``sampling_params``; the ids are
  ``output_ids``, the end in ``meta_info.finish_reason`` (``{"type": "stop", "matched": id}`` / ``length``).
* ``llama.cpp``: llama-server's native ``POST /completion`` with a token-array ``prompt`` and
  ``return_tokens: true``; the ids are ``tokens``, the end in ``stop_type`` (``eos`` / ``limit``).

Whether a server keeps the stop token in its ids or strips it, it is stored once, as our loop stores it
(``stop``); a stop on a token outside the target's stop ids (:meth:`speculators.target.Target.stop_ids_for`) is
refused, and ids past our first stop id are cut (our loop stops there too).

Requests run concurrently (``concurrency`` in flight, a thread pool), each with a timeout; connection errors,
timeouts, HTTP 429 and 5xx are retried with exponential backoff, then reported with the URL and status; other
4xx are reported at once. Starting a server (llama-server on the target's GGUF) is not this layer's concern:
:mod:`speculators.engines.llamacpp_regen` subclasses :class:`RegenerationServer` and the workflow hands it in.
"""

from __future__ import annotations

import contextlib
import http.client
import json
import threading
import time
import urllib.error
import urllib.request
from collections.abc import Callable, Iterator
from concurrent.futures import FIRST_COMPLETED, ThreadPoolExecutor, wait
from dataclasses import dataclass
from typing import Any

from ..errors import SpeculatorsError

# who regenerated the answers when no server did (the run card's line and config.json's data_producer)
PYTORCH_PRODUCER = {"producer": "speculators (PyTorch)"}


@dataclass(frozen=True)
class Generated:
    """One regenerated response: ``ids`` (generated token ids, the stop token excluded) and ``stop`` (the
    stop token id that ended it, or None when ``max_new_tokens`` cut it), as the regeneration cache stores them."""

    ids: list[int]
    stop: int | None


class ServerError(SpeculatorsError):
    """A request to the regeneration server failed (after retries), or its answer cannot be trained on."""


def _finish(ids: list[int], stops: list[int], finish: str, matched: Any, max_new_tokens: int,
            where: str) -> Generated:
    """The :class:`Generated` of a server's answer: ``ids`` cut at our first stop id (kept in the ids or stripped
    by the server: stored once). ``finish`` is the server's end reason as ``"stop"``, ``"length"`` or anything
    else; ``matched`` the server's own report of the stop token (None when it gives none).

    Raises:
        ServerError: the answer ended otherwise than on a stop token or at ``max_new_tokens`` (aborted, a full
            context: a partial answer is never trained as a complete or cut one), or it stopped on a token that
            is not one of ``stops``, or on a string.
    """
    stop_set = set(stops)
    for i, t in enumerate(ids):
        if t in stop_set:
            return Generated(ids[:i], t)
    if finish == "length":
        if len(ids) < max_new_tokens:
            raise ServerError(f"{where}: the answer ended at {len(ids)} of max_new_tokens={max_new_tokens} tokens "
                              "without a stop token (the server's context is full?): a partial answer is not "
                              "trained; give the server a longer context (vLLM --max-model-len)")
        return Generated(ids, None)
    if finish != "stop":
        raise ServerError(f"{where}: the answer ended with finish reason {finish!r} (allowed: a stop token or "
                          "max_new_tokens): an aborted answer is not trained")
    if matched is None and ids:
        matched = ids[-1]  # a server that keeps its stop token in the ids: the last one is where it stopped
    if isinstance(matched, int) and not isinstance(matched, bool):
        if matched in stop_set:
            return Generated(ids, matched)
        raise ServerError(f"{where}: the server stopped on token {matched}, which is not one of the target's stop "
                          f"ids {sorted(stop_set)}: the answer would end where the target does not; serve the "
                          "target with its own tokenizer and generation config")
    raise ServerError(f"{where}: the server says it stopped but returned no stop token id (matched: {matched!r}); "
                      "a stop on a string cannot be trained as the target's end of turn")


def _int_ids(value: Any, field: str, where: str) -> list[int]:
    """``value`` as a list of token ids.

    Raises:
        ServerError: ``value`` is not a list of integers (the server returned text only).
    """
    if not isinstance(value, list) or not all(isinstance(t, int) and not isinstance(t, bool) for t in value):
        raise ServerError(f"{where}: the response has no token ids in {field!r} (got {type(value).__name__}); "
                          "regeneration stores exactly the ids the server produced and never re-tokenizes text: "
                          "use a server version that returns token ids (vLLM >= 0.10.2 with return_token_ids, "
                          "SGLang /generate, llama-server with return_tokens)")
    return [int(t) for t in value]


class ServerApi:
    """One wire protocol: the request of a generation and the :class:`Generated` of its answer. Every request
    pins the sampling completely (temperature and top-p from the recipe; no top-k, min-p or penalties): a
    server would otherwise fill the missing fields from the model's ``generation_config.json`` (a repetition
    penalty, say), and the answers would not be the target's own."""

    name = ""
    path = ""

    def body(self, prompt: list[int], max_new_tokens: int, temperature: float, top_p: float, seed: int,
             stops: list[int], model: str | None) -> dict[str, Any]:
        """The JSON request generating from ``prompt`` (token ids) with these settings."""
        raise NotImplementedError

    def parse(self, answer: dict[str, Any], stops: list[int], max_new_tokens: int, where: str) -> Generated:
        """The :class:`Generated` of the JSON ``answer``.

        Raises:
            ServerError: no token ids in it, or an end :func:`_finish` refuses.
        """
        raise NotImplementedError


class OpenAIApi(ServerApi):
    """vLLM's OpenAI-compatible ``/v1/completions`` (token-array prompt, ``return_token_ids``)."""

    name, path = "openai", "/v1/completions"

    def body(self, prompt, max_new_tokens, temperature, top_p, seed, stops, model):
        b = {"prompt": list(prompt), "max_tokens": max_new_tokens, "temperature": temperature, "top_p": top_p,
             "top_k": -1, "min_p": 0.0, "repetition_penalty": 1.0, "presence_penalty": 0.0, "frequency_penalty": 0.0,
             "seed": seed, "stop_token_ids": list(stops), "return_token_ids": True, "skip_special_tokens": False,
             "n": 1, "stream": False}
        if model:
            b["model"] = model
        return b

    def parse(self, answer, stops, max_new_tokens, where):
        choices = answer.get("choices")
        if not isinstance(choices, list) or not choices or not isinstance(choices[0], dict):
            raise ServerError(f"{where}: the response has no choices[0] ({str(answer)[:200]})")
        c = choices[0]
        ids = _int_ids(c.get("token_ids"), "choices[0].token_ids", where)
        # vLLM keeps the EOS / stop token in token_ids; stop_reason is the stop token id (None for EOS)
        return _finish(ids, stops, str(c.get("finish_reason")), c.get("stop_reason"), max_new_tokens, where)


class SGLangApi(ServerApi):
    """SGLang's native ``/generate`` (``input_ids`` in, ``output_ids`` out)."""

    name, path = "sglang", "/generate"

    def body(self, prompt, max_new_tokens, temperature, top_p, seed, stops, model):
        return {"input_ids": list(prompt), "stream": False,
                "sampling_params": {"max_new_tokens": max_new_tokens, "temperature": temperature, "top_p": top_p,
                                    "top_k": -1, "min_p": 0.0, "repetition_penalty": 1.0, "presence_penalty": 0.0,
                                    "frequency_penalty": 0.0, "stop_token_ids": list(stops),
                                    "skip_special_tokens": False, "sampling_seed": seed}}

    def parse(self, answer, stops, max_new_tokens, where):
        ids = _int_ids(answer.get("output_ids"), "output_ids", where)
        fin = (answer.get("meta_info") or {}).get("finish_reason") or {}
        kind = fin.get("type") if isinstance(fin, dict) else fin
        return _finish(ids, stops, str(kind), fin.get("matched") if isinstance(fin, dict) else None,
                       max_new_tokens, where)


class LlamaCppApi(ServerApi):
    """llama-server's native ``/completion`` (token-array ``prompt``, ``return_tokens``). It takes no stop token
    ids: it stops at its end-of-generation tokens, so a template stop it does not count as one runs on to one or
    to ``n_predict`` and is cut at our first stop id (correct, with wasted tokens)."""

    name, path = "llama.cpp", "/completion"

    def body(self, prompt, max_new_tokens, temperature, top_p, seed, stops, model):
        return {"prompt": list(prompt), "n_predict": max_new_tokens, "temperature": temperature, "top_p": top_p,
                "top_k": 0, "min_p": 0.0, "typical_p": 1.0, "repeat_penalty": 1.0, "presence_penalty": 0.0,
                "frequency_penalty": 0.0, "dry_multiplier": 0.0, "xtc_probability": 0.0, "mirostat": 0,
                "seed": seed, "return_tokens": True, "cache_prompt": False, "stream": False}

    def parse(self, answer, stops, max_new_tokens, where):
        tokens = answer.get("tokens")
        if tokens == [] and answer.get("content"):  # text without ids: a request without return_tokens
            tokens = None
        ids = _int_ids(tokens, "tokens", where)
        finish = {"eos": "stop", "limit": "length"}.get(answer.get("stop_type"), str(answer.get("stop_type")))
        return _finish(ids, stops, finish, None, max_new_tokens, where)


APIS: dict[str, type[ServerApi]] = {a.name: a for a in (OpenAIApi, SGLangApi, LlamaCppApi)}


def _retryable(code: int) -> bool:
    """HTTP statuses worth another try: request timeout, too many requests, server errors (not 501)."""
    return code in (408, 429) or (code >= 500 and code != 501)


class ServerClient:
    """Requests to one regeneration server (thread-safe: one urllib request per call).

    Args:
        url: base URL (``http://host:port``; a trailing ``/`` or ``/v1`` is dropped).
        api: ``openai``, ``sglang`` or ``llama.cpp`` (:data:`APIS`).
        model: the served model's name (``openai``'s ``model`` field; None = the server's default).
        timeout_s: seconds per request. retries: further tries after a retryable failure.
        backoff_s: the first wait before a retry (doubled each time).
    Raises:
        SpeculatorsError: an unknown ``api``.
    """

    def __init__(self, url: str, api: str, *, model: str | None = None, timeout_s: float = 600.0, retries: int = 4,
                 backoff_s: float = 1.0):
        if api not in APIS:
            raise SpeculatorsError(f"data.regeneration.server.api: {api!r} is not a server API; allowed: {sorted(APIS)}")
        base = url.rstrip("/")
        self.url = base[:-3] if base.endswith("/v1") else base
        self.api = APIS[api]()
        self.model, self.timeout_s, self.retries, self.backoff_s = model, float(timeout_s), int(retries), backoff_s
        #: set by :func:`generate_all` on an error or Ctrl-C: no new try starts and backoff waits end at once
        self.stopping = threading.Event()

    def post(self, path: str, body: dict[str, Any] | None) -> dict[str, Any]:
        """POST ``body`` as JSON (GET when None) to ``url + path``; retried as the class says.

        Raises:
            ServerError: naming the URL and the HTTP status (or the connection error) of the last try, or that
                the run is stopping (:attr:`stopping`).
        """
        where = self.url + path
        for attempt in range(self.retries + 1):
            if self.stopping.is_set():
                raise ServerError(f"regeneration server {where}: not sent, the regeneration is stopping")
            data = None if body is None else json.dumps(body).encode()
            req = urllib.request.Request(where, data=data, headers={"Content-Type": "application/json"})
            try:
                with urllib.request.urlopen(req, timeout=self.timeout_s) as r:
                    return json.loads(r.read())
            except urllib.error.HTTPError as e:
                try:
                    detail = e.read().decode(errors="replace")[:300]
                except (OSError, http.client.HTTPException):
                    detail = ""
                why = f"HTTP {e.code}: {detail}"
                if not _retryable(e.code):
                    raise ServerError(f"regeneration server {where}: {why} (not retried)") from None
            except (urllib.error.URLError, http.client.HTTPException, ConnectionError, TimeoutError, OSError) as e:
                why = f"{type(e).__name__}: {getattr(e, 'reason', e)}"
            except json.JSONDecodeError as e:
                raise ServerError(f"regeneration server {where}: the answer is not JSON ({e})") from None
            if attempt < self.retries:
                self.stopping.wait(self.backoff_s * 2 ** attempt)
        raise ServerError(f"regeneration server {where}: {why} after {self.retries + 1} tries "
                          f"(data.regeneration.server.retries={self.retries})")

    def generate(self, prompt: list[int], max_new_tokens: int, stops: list[int], temperature: float = 0.0,
                 top_p: float = 1.0, seed: int = 0, vocab_size: int | None = None) -> Generated:
        """Generate from ``prompt`` (token ids, the chat template rendered) and return the server's ids (at most
        ``max_new_tokens``, the stop token apart).

        Args:
            vocab_size: the target's vocabulary size; an id at or above it is refused (None: not checked).
        Raises:
            ServerError: the request failed, the answer has no token ids or ids outside the vocabulary (the server
                does not serve the target), or it ended otherwise than :func:`_finish` allows.
        """
        body = self.api.body(list(map(int, prompt)), int(max_new_tokens), float(temperature), float(top_p),
                             int(seed) % (2 ** 31), list(stops), self.model)
        where = self.url + self.api.path
        gen = self.api.parse(self.post(self.api.path, body), list(stops), int(max_new_tokens), where)
        bad = [t for t in gen.ids if t < 0 or (vocab_size is not None and t >= vocab_size)]
        if bad:
            raise ServerError(f"{where}: token id {bad[0]} is outside the target's vocabulary ({vocab_size} ids): the "
                              "server does not serve the recipe's target")
        return Generated(gen.ids[:max_new_tokens], gen.stop if len(gen.ids) <= max_new_tokens else None)


def generate_all(client: ServerClient, requests: dict[str, dict[str, Any]], concurrency: int,
                 on_result: Callable[[str, Generated], None]) -> None:
    """Run ``requests`` (key -> :meth:`ServerClient.generate` keyword arguments), ``concurrency`` in flight;
    ``on_result(key, generated)`` is called in THIS thread as each finishes (so the caller appends to its cache
    without locks). After a failed request nothing more is sent; the requests already in flight are waited for
    and their answers kept (``on_result``), then the first error is raised. On Ctrl-C the queued requests are
    dropped at once and the client's :attr:`ServerClient.stopping` ends every retry in flight.

    Raises:
        ServerError: the first request that failed (after its retries), or what ``on_result`` raised.
    """
    items = iter(requests.items())
    n = max(1, int(concurrency))
    pool = ThreadPoolExecutor(max_workers=n)
    pending: dict[Any, str] = {}
    first_error: BaseException | None = None

    def submit() -> None:
        item = next(items, None)
        if item is not None:
            pending[pool.submit(client.generate, **item[1])] = item[0]

    try:
        for _ in range(n):
            submit()
        while pending:
            finished, _ = wait(list(pending), return_when=FIRST_COMPLETED)
            for fut in finished:
                key = pending.pop(fut)
                try:
                    gen = fut.result()
                except BaseException as e:  # noqa: BLE001 - raised below, after the answers in flight are kept
                    if first_error is None:
                        first_error = ServerError(f"{e} (prompt {key})") if isinstance(e, ServerError) else e
                        client.stopping.set()  # the requests waiting to retry give up; those mid-request finish
                    continue
                on_result(key, gen)
                if first_error is None:
                    submit()
    except BaseException:
        client.stopping.set()  # Ctrl-C: the threads in flight start no further try
        raise
    finally:
        pool.shutdown(wait=False, cancel_futures=True)
    if first_error is not None:
        raise first_error


class RegenerationServer:
    """A server the regeneration talks to: its identity (part of the cache key and of the run's provenance)
    and a context that yields a :class:`ServerClient` while it serves.

    Args:
        spec: the recipe's ``data.regeneration.server`` section (``url``, ``api``, ``model``, ``concurrency``,
            ``timeout_s``, ``retries``, ...).
    """

    def __init__(self, spec):
        self.spec = spec
        self._identity: dict[str, Any] | None = None

    @property
    def concurrency(self) -> int:
        """Requests in flight (``data.regeneration.server.concurrency``)."""
        return int(self.spec.concurrency)

    def identity(self, target, log=print) -> dict[str, Any]:
        """Who produces the answers (``{"producer": ..., ...}``; never the URL: a server moved to another host
        serves the same answers). Computed once.

        Raises:
            ServerError: a running server that does not answer its model probe (with ``model`` unset).
        """
        if self._identity is None:
            self._identity = self._compute_identity(target, log)
        return self._identity

    def _compute_identity(self, target, log) -> dict[str, Any]:
        raise NotImplementedError

    def open(self, target, ctx_per_slot: int, log=print) -> contextlib.AbstractContextManager[ServerClient]:
        """A context yielding the client while the server serves (``ctx_per_slot``: the longest prompt plus
        ``max_new_tokens``, for a server we start)."""
        raise NotImplementedError

    def client(self, url: str, api: str) -> ServerClient:
        """A :class:`ServerClient` for ``url`` / ``api`` with the spec's model, timeout and retries."""
        return ServerClient(url, api, model=self.spec.model, timeout_s=self.spec.timeout_s, retries=self.spec.retries)


class RunningServer(RegenerationServer):
    """A server someone else runs at ``spec.url`` (vLLM, SGLang, llama-server)."""

    def _compute_identity(self, target, log) -> dict[str, Any]:
        c = self.client(self.spec.url, self.spec.api)
        model = self.spec.model
        if model is None:  # the served model's name, as the server reports it
            probe = {"openai": "/v1/models", "sglang": "/get_model_info", "llama.cpp": "/props"}[self.spec.api]
            try:
                info = c.post(probe, None)
            except ServerError as e:
                raise ServerError(f"{e}; the served model's name is part of the regeneration cache key: set "
                                  "data.regeneration.server.model to skip this probe") from None
            if self.spec.api == "openai":
                model = ((info.get("data") or [{}])[0]).get("id")
            else:
                model = info.get("model_path")
        ident = {"producer": "inference server", "api": self.spec.api, "model": str(model)}
        log(f"regeneration: through {self.spec.api} server {c.url} serving {model!r}")
        return ident

    @contextlib.contextmanager
    def open(self, target, ctx_per_slot: int, log=print) -> Iterator[ServerClient]:
        yield self.client(self.spec.url, self.spec.api)


def regeneration_server(spec, server: RegenerationServer | None = None) -> RegenerationServer | None:
    """The server of ``data.regeneration.server`` (``spec``): ``server`` when the caller started one (an
    ``engine``), a :class:`RunningServer` for a ``url``, None without a spec (our PyTorch loop).

    Raises:
        SpeculatorsError: ``spec.engine`` is set and no started server was handed in.
    """
    if server is not None:
        return server
    if spec is None:
        return None
    if getattr(spec, "engine", None):
        raise SpeculatorsError(f"data.regeneration.server.engine: {spec.engine!r} is started by the workflow "
                               "(speculators.engines.regeneration_engine); the data layer only "
                               "talks to a running server")
    return RunningServer(spec)


def producer_line(producer: dict[str, Any] | None) -> str | None:
    """The run card's sentence of who regenerated the answers (None: nothing was regenerated)."""
    if not producer:
        return None
    rest = ", ".join(f"{k} {v}" for k, v in producer.items() if k != "producer")
    return f"Answers regenerated by {producer['producer']}" + (f" ({rest})" if rest else "") + "."


__all__ = ["APIS", "Generated", "LlamaCppApi", "OpenAIApi", "PYTORCH_PRODUCER", "RegenerationServer",
           "RunningServer", "SGLangApi", "ServerApi", "ServerClient", "ServerError", "generate_all",
           "producer_line", "regeneration_server"]
