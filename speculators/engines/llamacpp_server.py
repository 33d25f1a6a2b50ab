"""``llama-server`` as a context manager: started on 127.0.0.1 at a free port, stopped on exit and on Ctrl-C.

The server (llama.cpp's ``tools/server``) is started with the target GGUF (``-m``) and, for speculative
decoding, a draft GGUF (``-md``) and ``--spec-type`` (``draft-eagle3``, ``draft-dflash``, ``draft-dspark``) or a
model-free type (``ngram-simple``, ``ngram-mod``, ...), with ``--spec-draft-n-max`` = K and
``--spec-draft-p-min``. This llama.cpp version reads those per server, not per request (its per-request
``speculative.*`` fields are compiled out), so a K sweep is one server per K. Requests go to its native
``/completion`` endpoint with token ids in and token ids out (``return_tokens``), so that nothing is
re-tokenised and outputs compare token for token.

Counts are the engine's own (``timings`` of the response): ``predicted_n`` tokens generated in
``predicted_ms``, ``draft_n`` tokens drafted and ``draft_n_accepted`` accepted. The first token comes from the
prompt's forward; after it, every decode step of the server emits its accepted drafts plus one token of the
target (a step without drafts emits one), so a generation takes ``predicted_n - 1 - draft_n_accepted`` decode
steps and the engine's tau is ``(predicted_n - 1) / steps``: tokens per verification step with the prefill left
out of both counts, as our loop counts it (:data:`speculators.evaluation.report.TAU_DEFINITION`). One bias is
the engine's: it adds a step's accepted drafts to ``draft_n_accepted`` before it stops at an end-of-sequence
token among them, so drafts accepted after a stop are counted though not emitted (steps are clamped at 0).
"""

from __future__ import annotations

import dataclasses
import json
import os
import shlex
import time
import urllib.error
import urllib.request
from pathlib import Path
from typing import Any

from ..errors import SpeculatorsError
from .llamacpp_build import LlamaCpp, repack_broken
from .server_process import ServerProcess


@dataclasses.dataclass
class Completion:
    """One ``/completion`` answer of ``llama-server``.

    Attributes:
        tokens: the generated token ids (an end-of-sequence token that stopped the generation included).
        seconds: generation time (``timings.predicted_ms`` / 1000; prompt processing excluded).
        prompt_seconds: prompt processing time (``timings.prompt_ms`` / 1000).
        draft_n / draft_accepted: tokens drafted / accepted by the server's speculative decoding (0 without).
        stop: the server's ``stop_type`` (``"eos"``, ``"limit"``, ``"word"``).
        top_logprobs: per generated token, ``{token id: log-probability}`` of the target's top ``n_probs``
            tokens before sampling (only for tokens the server sampled one at a time: this llama.cpp does not
            report them for tokens accepted from a draft); empty without ``n_probs``.
    """

    tokens: list[int]
    seconds: float
    prompt_seconds: float
    draft_n: int
    draft_accepted: int
    stop: str
    top_logprobs: list[dict[int, float]]

    @property
    def step_tokens(self) -> int:
        """Tokens emitted by decode steps: all but the first (which the prompt's forward produced)."""
        return max(len(self.tokens) - 1, 0)

    @property
    def steps(self) -> int:
        """Decode steps (target forwards after the prompt's; module docstring): ``len(tokens) - 1 - draft_accepted``,
        at least 0."""
        return max(self.step_tokens - self.draft_accepted, 0)


class LlamaServer(ServerProcess):
    """A running ``llama-server`` (use as ``with LlamaServer(...) as srv: srv.complete(...)``).

    Args:
        lc: the llama.cpp build (:func:`speculators.engines.llamacpp_build.require_llama_cpp`).
        model: the target GGUF. draft: a draft GGUF (``-md``) or None.
        spec_type: ``--spec-type`` (None: plain decoding, or the type the draft GGUF declares).
        draft_n_max: ``--spec-draft-n-max`` (K). p_min: ``--spec-draft-p-min`` (a draft stops below it).
        parallel: ``--parallel`` slots (each its own sequence; requests run concurrently up to this).
        ctx_size: ``--ctx-size`` of all slots together. threads: ``--threads`` (default: all cores).
        extra: further command-line arguments.
        startup_timeout: seconds to wait for ``/health``.
    Raises:
        SpeculatorsError: the server exits or is not healthy in time (its log's last lines in the message).
    """

    def __init__(self, lc: LlamaCpp, model: str | Path, *, draft: str | Path | None = None,
                 spec_type: str | None = None, draft_n_max: int | None = None, p_min: float | None = None,
                 parallel: int = 1, ctx_size: int = 4096, threads: int | None = None,
                 extra: list[str] | tuple[str, ...] = (), startup_timeout: float = 120.0):
        super().__init__(startup_timeout)
        self.name = "llama-server"
        cmd = [str(lc.server), "-m", str(model), "--host", "127.0.0.1", "--port", str(self.port),
               "--parallel", str(parallel), "--ctx-size", str(ctx_size), "--threads", str(threads or os.cpu_count()), "--no-webui"]
        if repack_broken():
            cmd.append("--no-repack")
        if draft is not None:
            cmd += ["-md", str(draft)]
        if spec_type is not None:
            cmd += ["--spec-type", spec_type]
        if draft_n_max is not None:
            cmd += ["--spec-draft-n-max", str(draft_n_max)]
        if p_min is not None:
            cmd += ["--spec-draft-p-min", str(p_min)]
        self.cmd = cmd + list(extra)

    def command_line(self, port: int = 8080) -> str:
        """This server's command line as a user would type it, at ``port`` instead of the free port it was given."""
        cmd = list(self.cmd)
        cmd[cmd.index("--port") + 1] = str(port)
        return shlex.join(cmd)

    def log_tail(self, n: int = 8) -> str:
        """The server log's first failed assertion or error line when it has one (an abort is followed by a
        debugger's backtrace), else its last ``n`` lines (joined by `` | ``)."""
        lines = self.log_lines()
        fatal = [ln for ln in lines if ("GGML_ASSERT" in ln or " E " in ln or ln.startswith("error"))
                 and "warning is normal" not in ln]  # a DFlash draft's memory-fitting probe logs one benign E line
        return " | ".join(fatal[:3] if fatal else lines[-n:])

    # ---------------------------------------------------------------- requests
    def _post(self, path: str, body: dict[str, Any], timeout: float = 600.0) -> dict[str, Any]:
        req = urllib.request.Request(self.url + path, data=json.dumps(body).encode(),
                                     headers={"Content-Type": "application/json"})
        try:
            with urllib.request.urlopen(req, timeout=timeout) as r:
                return json.loads(r.read())
        except urllib.error.HTTPError as e:
            raise SpeculatorsError(f"llama-server {path}: HTTP {e.code}: {e.read().decode(errors='replace')[:300]}") from None
        except (urllib.error.URLError, ConnectionError, TimeoutError, json.JSONDecodeError) as e:
            time.sleep(0.5)  # a server that aborted: let its log reach the file
            raise SpeculatorsError(f"llama-server {path}: {e} ({self.log_tail(4)})") from None

    def last_logprobs(self, prefix: list[int], chunk: int, n_probs: int) -> dict[int, float]:
        """The target's top ``n_probs`` log-probabilities for the token after ``prefix``, computed by a forward
        over only the last ``chunk`` tokens of ``prefix`` on top of the server's cached KV of the rest (the shape
        of a verify step of ``chunk - 1`` drafts). Uses the prompt cache: the slot first processes
        ``prefix[:-chunk]`` alone.

        Raises:
            SpeculatorsError: ``chunk`` not in ``[1, len(prefix) - 1]``, or a failed request.
        """
        if not 1 <= chunk < len(prefix):
            raise SpeculatorsError(f"last_logprobs: chunk {chunk} outside [1, {len(prefix) - 1}]")
        self._post("/completion", {"prompt": list(map(int, prefix[:-chunk])), "n_predict": 0, "cache_prompt": True})
        r = self._post("/completion", {"prompt": list(map(int, prefix)), "n_predict": 1, "temperature": 0.0,
                                       "cache_prompt": True, "n_probs": int(n_probs)})
        probs = r.get("completion_probabilities") or [{}]
        return {int(p["id"]): float(p["logprob"]) for p in probs[0].get("top_logprobs", [])}

    def complete(self, prompt_ids: list[int], max_new_tokens: int, *, temperature: float = 0.0, top_k: int = 0,
                 top_p: float = 1.0, seed: int = 0, n_probs: int = 0) -> Completion:
        """Generate from ``prompt_ids`` (token ids, BOS included as the target adds it) through ``/completion``.

        Sampling: ``temperature`` 0 is greedy; above 0 the server samples with ``top_k`` (0: off) and ``top_p``
        (1: off), seeded by ``seed``, and verifies drafts by its own rule. The prompt cache is off so that every
        request measures the whole prompt. ``n_probs`` > 0 asks for the target's top log-probabilities.

        Raises:
            SpeculatorsError: the request failed (HTTP error or the server gone).
        """
        body = {"prompt": list(map(int, prompt_ids)), "n_predict": int(max_new_tokens), "temperature": float(temperature),
                "top_k": int(top_k), "top_p": float(top_p), "min_p": 0.0, "seed": int(seed), "return_tokens": True,
                "cache_prompt": False, "stream": False, "n_probs": int(n_probs)}
        r = self._post("/completion", body)
        t = r.get("timings", {})
        probs = []
        for entry in r.get("completion_probabilities", []) or []:
            probs.append({int(p["id"]): float(p["logprob"]) for p in entry.get("top_logprobs", [])})
        return Completion(tokens=[int(x) for x in r.get("tokens", [])], seconds=float(t.get("predicted_ms", 0.0)) / 1e3,
                          prompt_seconds=float(t.get("prompt_ms", 0.0)) / 1e3, draft_n=int(t.get("draft_n", 0)),
                          draft_accepted=int(t.get("draft_n_accepted", 0)), stop=str(r.get("stop_type", "")),
                          top_logprobs=probs)


__all__ = ["Completion", "LlamaServer"]
