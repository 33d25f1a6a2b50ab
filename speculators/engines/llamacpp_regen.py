"""llama-server started for the regeneration (``data.regeneration.server.engine: llama.cpp``).

The data layer only talks HTTP (:mod:`speculators.data.server_regen`); this module starts the server it talks
to: ``llama-server`` (``make llama-cpp`` builds it) on the target's GGUF, ``concurrency`` parallel slots (a batch
of requests decoded together), ``--ctx-size`` = slots x (longest prompt + ``max_new_tokens``), stopped when the
regeneration ends (and killed with our process). The workflow hands a :class:`LlamaServerRegeneration` to
:func:`speculators.data.pipeline.prepare_data`.

Which GGUF is served: a GGUF target (the ``smollm2-135m-instruct`` alias, a ``.gguf`` file) as it is, unless
``outtype`` asks for another type (f16, bf16, q8_0), converted by llama.cpp's own converter
(:func:`.llamacpp_targets.engine_gguf`); an HF target is converted (``outtype``, default f16). The identity of
the producer (llama.cpp version, GGUF name and size) joins the regeneration cache key and is recorded in the run
card and ``config.json``.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from ..data.server_regen import RegenerationServer, ServerClient
from .llamacpp_build import LlamaCpp, require_llama_cpp
from .llamacpp_server import LlamaServer
from .llamacpp_targets import engine_gguf


class LlamaServerRegeneration(RegenerationServer):
    """llama-server on the target's GGUF, started by :meth:`open` for the regeneration.

    Args:
        spec: ``data.regeneration.server`` (``engine: llama.cpp``, ``concurrency``, ``outtype``, ``threads``,
            ``timeout_s``, ``retries``).
        lc: the llama.cpp build (None: :func:`speculators.engines.llamacpp_build.require_llama_cpp` when needed).
    Raises:
        LlamaCppUnavailable: (at first use) llama.cpp is not built.
    """

    def __init__(self, spec, lc: LlamaCpp | None = None):
        super().__init__(spec)
        self._lc = lc
        self._gguf: Path | None = None

    @property
    def lc(self) -> LlamaCpp:
        if self._lc is None:
            self._lc = require_llama_cpp()
        return self._lc

    def gguf(self, target, log=print) -> Path:
        """The GGUF served (:func:`engine_gguf`), resolved once."""
        if self._gguf is None:
            self._gguf = engine_gguf(target, self.lc, self.spec.outtype, log, field="data.regeneration.server.outtype")
        return self._gguf

    def _compute_identity(self, target, log) -> dict[str, Any]:
        g = self.gguf(target, log)
        return {"producer": "llama.cpp llama-server", "llama_cpp": f"llama-cpp-python {self.lc.version}",
                "gguf": g.name, "gguf_bytes": g.stat().st_size}

    @contextlib.contextmanager
    def open(self, target, ctx_per_slot: int, log=print) -> Iterator[ServerClient]:
        n = self.concurrency
        g = self.gguf(target, log)
        with LlamaServer(self.lc, g, parallel=n, ctx_size=n * int(ctx_per_slot), threads=self.spec.threads,
                         startup_timeout=300.0) as srv:
            log(f"regeneration: llama-server on {g.name} at {srv.url}, {n} slots of {ctx_per_slot} tokens")
            yield self.client(srv.url, "llama.cpp")


__all__ = ["LlamaServerRegeneration", "engine_gguf"]
