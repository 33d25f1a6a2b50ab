"""A serving engine's HTTP server as a child process: started on 127.0.0.1 at a free port, healthy when ``/health``
answers 200, stopped on exit, on Ctrl-C and when our process dies. :class:`.llamacpp_server.LlamaServer` and
:class:`.vllm_server.VllmServer` are its subclasses: each builds its command line, this class runs it."""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import tempfile
import time
import urllib.error
import urllib.request

from ..errors import SpeculatorsError


def die_with_parent() -> None:
    """In the child before exec: ask Linux to SIGTERM the server when the Python process that started it dies
    (killed, timed out), so that no orphaned server keeps the cores busy. A no-op elsewhere."""
    try:
        import ctypes

        ctypes.CDLL("libc.so.6", use_errno=True).prctl(1, signal.SIGTERM)  # PR_SET_PDEATHSIG
    except (OSError, AttributeError):
        pass


def free_port() -> int:
    """A TCP port free on 127.0.0.1 now (the OS picks it)."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class ServerProcess:
    """A server run as a child process (``with Sub(...) as srv: srv.url``). A subclass sets :attr:`cmd` (the command
    line, listening on :attr:`port`), :attr:`name` (for messages) and may set :attr:`env` / :attr:`cwd`.

    Attributes:
        port / url: where it listens. startup_timeout: seconds to wait for ``/health``. stop_timeout: seconds
            between SIGTERM and SIGKILL to its process group when it is stopped.
    """

    name = "server"
    stop_timeout = 10.0

    def __init__(self, startup_timeout: float):
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.startup_timeout = startup_timeout
        self.cmd: list[str] = []
        self.env: dict[str, str] | None = None
        self.cwd: str | None = None
        self.proc: subprocess.Popen | None = None
        self._log = None

    def __enter__(self):
        self._log = tempfile.TemporaryFile(mode="w+")
        self.proc = subprocess.Popen(self.cmd, stdout=self._log, stderr=subprocess.STDOUT, start_new_session=True,
                                     preexec_fn=die_with_parent, env=self.env, cwd=self.cwd)
        try:
            self._wait_healthy()
        except BaseException:
            self.close()
            raise
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def close(self) -> None:
        """Stop the server (SIGTERM to its process group, SIGKILL after :attr:`stop_timeout` s); idempotent."""
        if self.proc is not None and self.proc.poll() is None:
            try:
                os.killpg(self.proc.pid, signal.SIGTERM)
                self.proc.wait(timeout=self.stop_timeout)
            except subprocess.TimeoutExpired:
                os.killpg(self.proc.pid, signal.SIGKILL)
                self.proc.wait()
            except ProcessLookupError:
                pass
        if self._log is not None:
            self._log.close()
            self._log = None

    def log_lines(self) -> list[str]:
        """The server's log so far, non-empty lines."""
        if self._log is None:
            return []
        self._log.flush()
        self._log.seek(0)
        return [ln.rstrip() for ln in self._log.read().splitlines() if ln.strip()]

    def log_tail(self, n: int = 8) -> str:
        """The last ``n`` lines of the server's log, joined by `` | `` (a subclass picks its error lines first)."""
        return " | ".join(self.log_lines()[-n:])

    def _wait_healthy(self) -> None:
        deadline = time.monotonic() + self.startup_timeout
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise SpeculatorsError(f"{self.name} exited with status {self.proc.returncode} at start "
                                       f"({' '.join(self.cmd)}): {self.log_tail()}")
            try:
                with urllib.request.urlopen(self.url + "/health", timeout=2) as r:
                    if r.status == 200:
                        return
            except (urllib.error.URLError, ConnectionError, TimeoutError):
                pass
            time.sleep(0.2)
        raise SpeculatorsError(f"{self.name} was not healthy within {self.startup_timeout:.0f} s: {self.log_tail()}")


__all__ = ["ServerProcess", "die_with_parent", "free_port"]
