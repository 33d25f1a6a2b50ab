"""``vllm serve`` started for the regeneration (``data.regeneration.server.engine: vllm``).

The data layer only talks HTTP (:mod:`speculators.data.server_regen`, ``api: openai``); this module starts the
server it talks to: vLLM's OpenAI server (:class:`.vllm_server.VllmServer`) on the target as vLLM loads it
(:func:`.vllm_runner.vllm_target_dir`: for a GGUF target, the float32 weights our loader dequantized), in the
target's compute dtype, ``concurrency`` requests decoded together, a context of the longest prompt plus
``max_new_tokens``, stopped when the regeneration ends (and with our process). The producer's identity (vLLM's
version, the target's fingerprint and dtype) joins the regeneration cache key and is recorded in the run card and
``config.json``.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from typing import Any

from ..data.server_regen import RegenerationServer, ServerClient
from .vllm_env import ensure_vllm_python, probe
from .vllm_runner import fit_context, vllm_target_dir
from .vllm_server import VllmServer


class VllmServeRegeneration(RegenerationServer):
    """``vllm serve`` on the target, started by :meth:`open` for the regeneration.

    Args:
        spec: ``data.regeneration.server`` (``engine: vllm``, ``concurrency``, ``timeout_s``, ``retries``).
        python: the vLLM venv's interpreter (default: found at first use).
    Raises:
        VllmUnavailable: (at first use) no vLLM venv.
    """

    def __init__(self, spec, python=None):
        super().__init__(spec)
        self._python = python

    @property
    def python(self):
        if self._python is None:
            self._python = ensure_vllm_python()
        return self._python

    @staticmethod
    def _dtype(target) -> str:
        return str(target.dtype).removeprefix("torch.")

    def _compute_identity(self, target, log) -> dict[str, Any]:
        return {"producer": "vLLM vllm serve", "vllm": probe(self.python), "target": target.fingerprint,
                "dtype": self._dtype(target)}

    @contextlib.contextmanager
    def open(self, target, ctx_per_slot: int, log=print) -> Iterator[ServerClient]:
        d = vllm_target_dir(target, log)
        with VllmServer(d, dtype=self._dtype(target), max_model_len=fit_context(d, int(ctx_per_slot)),
                        max_num_seqs=self.concurrency, served_name="target", python=self.python) as srv:
            log(f"regeneration: vllm serve on {d} ({self._dtype(target)}) at {srv.url}, {self.concurrency} requests "
                "in flight")
            client = self.client(srv.url, "openai")
            client.model = "target"
            yield client


__all__ = ["VllmServeRegeneration"]
