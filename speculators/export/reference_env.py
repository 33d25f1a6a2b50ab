"""The reference implementation's own virtual environment (vllm-project/speculators, pinned).

vLLM's team keeps vllm-project/speculators in step with vLLM's loaders, so the parity gate
(:mod:`.parity`) loads our exported checkpoints with it. It cannot share our environment: the package is
also called ``speculators`` and pins its own transformers / torch companions. It runs in a separate
venv, only through :mod:`.reference_worker` (a script run by path with that venv's python).

Where the interpreter comes from, first match wins (:func:`find_reference_python`):

1. an explicit path (``speculators check --reference-python``);
2. ``$SPECULATORS_REFERENCE_PYTHON``;
3. ``.venv-reference/`` in the current directory (``make reference`` builds it there);
4. the cache, ``<cache_root>/reference/speculators-<version>/`` (:func:`speculators.utils.cache_root`).

:func:`ensure_reference_python` builds the cached one when none is found: a temporary sibling directory
is filled with ``python -m venv`` + pip and renamed into place only when the reference imports, so a
killed or offline build leaves nothing half-made. The install recipe (measured to work on CPU
machines): our torch version, the reference with ``--no-deps`` (it pins torchaudio/torchvision, which
the model code does not import), then the libraries its model code does import.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

from ..errors import SpeculatorsError
from ..utils import cache_root, install_step_exit

#: The reference implementation the gate compares against (PyPI ``speculators``, vllm-project).
REFERENCE_VERSION = "0.9.0"
#: transformers the reference pins (``transformers<=5.19``).
REFERENCE_TRANSFORMERS = "5.19.0"
#: Packages the reference's model code imports, installed beside it (no torchaudio/torchvision).
REFERENCE_DEPENDENCIES = (
    f"transformers=={REFERENCE_TRANSFORMERS}", "safetensors", "pydantic", "pydantic-settings", "loguru",
    "numpy<=2.5.4", "rich", "typer", "tqdm", "huggingface-hub", "openai", "psutil", "datasets>=4,<=5.1.0",
    "aiohttp", "httpx", "click", "protobuf", "hs-connectors==0.9.0",
)
#: Environment variable naming a ready interpreter of the reference venv.
ENV_VAR = "SPECULATORS_REFERENCE_PYTHON"
#: Project-local venv built by ``make reference``.
LOCAL_VENV = ".venv-reference"


class ReferenceUnavailable(SpeculatorsError):
    """The reference implementation cannot be had here (not installed and not installable, e.g. offline).

    Its message starts with ``reference implementation unavailable:`` and says why.
    """

    def __init__(self, why: str):
        super().__init__(f"reference implementation unavailable: {why}")
        self.why = why


def cached_venv_dir() -> Path:
    """``<cache_root>/reference/speculators-<REFERENCE_VERSION>/``: where :func:`ensure_reference_python`
    builds the venv."""
    return cache_root() / "reference" / f"speculators-{REFERENCE_VERSION}"


def _python_in(venv: Path) -> Path:
    return venv / "bin" / "python"


_PROBED: dict[str, str] = {}


def probe(python: str | Path) -> str:
    """The reference version importable by ``python`` (runs it once per process and interpreter: the
    imports take seconds).

    Raises:
        ReferenceUnavailable: the interpreter is missing, or cannot import the reference at
            :data:`REFERENCE_VERSION`.
    """
    python = Path(os.path.abspath(python))
    if not python.exists():
        raise ReferenceUnavailable(f"{python} does not exist")
    if str(python) in _PROBED:
        return _PROBED[str(python)]
    code = ("import speculators.version as v, speculators.models, torch, transformers;"
            "print(v.version)")
    try:
        r = subprocess.run([str(python), "-c", code], capture_output=True, text=True, timeout=300,
                           cwd=tempfile.gettempdir(), env=_clean_env())
    except (OSError, subprocess.TimeoutExpired) as e:
        raise ReferenceUnavailable(f"{python} could not run: {e}") from e
    if r.returncode != 0:
        last = (r.stderr.strip().splitlines() or ["(no output)"])[-1]
        raise ReferenceUnavailable(f"{python} cannot import vllm-project/speculators: {last}")
    version = r.stdout.strip().splitlines()[-1]
    if version != REFERENCE_VERSION:
        raise ReferenceUnavailable(f"{python} has speculators {version}, the gate follows {REFERENCE_VERSION}")
    _PROBED[str(python)] = version
    return version


def _clean_env() -> dict[str, str]:
    """Our environment without what would make the reference import OUR package (PYTHONPATH) or our venv."""
    env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "PYTHONHOME", "VIRTUAL_ENV")}
    env.setdefault("HF_HUB_OFFLINE", "1")
    return env


def find_reference_python(explicit: str | Path | None = None) -> Path | None:
    """The first ready reference interpreter (module docstring, order 1-4), or None when there is none.

    An explicit path or ``$SPECULATORS_REFERENCE_PYTHON`` is returned as given (checked later by
    :func:`probe`); the local and cached venvs count only when their interpreter exists.
    """
    # absolute, not resolved: a venv's python is a symlink whose target would lose the venv
    if explicit:
        return Path(os.path.abspath(explicit))
    if os.environ.get(ENV_VAR):
        return Path(os.path.abspath(os.environ[ENV_VAR]))
    for venv in (Path.cwd() / LOCAL_VENV, cached_venv_dir()):
        if _python_in(venv).exists() and (venv / ".complete").exists():
            return _python_in(venv)
    return None


def build_reference_venv(dest: str | Path, torch_spec: str | None = None, log=print) -> Path:
    """Create the reference venv at ``dest`` atomically and return its python.

    ``python -m venv`` + pip into a temporary sibling, check that the reference imports, write the
    ``.complete`` marker, rename into place. An existing complete venv at ``dest`` is kept.

    Args:
        dest: the venv directory.
        torch_spec: the torch requirement (default: ours, ``torch==<our version>`` without a local tag,
            so pip takes the same build wherever ours came from).
        log: called with one line per step.
    Raises:
        ReferenceUnavailable: any step fails (no network, no wheel); its message has pip's last line.
    """
    dest = Path(dest).resolve()
    if _python_in(dest).exists() and (dest / ".complete").exists():
        return _python_in(dest)
    if torch_spec is None:
        import torch

        torch_spec = f"torch=={torch.__version__.split('+')[0]}"
    dest.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{dest.name}.tmp-", dir=dest.parent))
    try:
        steps = [
            [sys.executable, "-m", "venv", str(tmp)],
            [str(_python_in(tmp)), "-m", "pip", "install", "--quiet", torch_spec],
            [str(_python_in(tmp)), "-m", "pip", "install", "--quiet", "--no-deps",
             f"speculators=={REFERENCE_VERSION}"],
            [str(_python_in(tmp)), "-m", "pip", "install", "--quiet", *REFERENCE_DEPENDENCIES],
        ]
        for cmd in steps:
            log(f"reference venv: {' '.join(cmd[2:] if cmd[1] == '-m' else cmd)}")
            r = subprocess.run(cmd, capture_output=True, text=True, env=_clean_env())
            if r.returncode != 0:
                last = (r.stderr.strip().splitlines() or r.stdout.strip().splitlines() or ["(no output)"])[-1]
                raise ReferenceUnavailable(f"`{' '.join(cmd[2:])}` failed: {last}")
        # venv scripts hold absolute paths: the renamed venv's python is a symlink, which still works
        probe(_python_in(tmp))
        (tmp / ".complete").write_text(REFERENCE_VERSION + "\n")
        if dest.exists():
            shutil.rmtree(dest)
        os.replace(tmp, dest)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    return _python_in(dest)


def ensure_reference_python(explicit: str | Path | None = None, build: bool = True, log=print,
                            check: bool = True) -> Path:
    """A working reference interpreter: found (:func:`find_reference_python`) or, with ``build``, built
    into :func:`cached_venv_dir`; with ``check``, checked with :func:`probe` (else only that it exists:
    the worker reports its version itself).

    Raises:
        ReferenceUnavailable: none found and ``build`` is False, the build failed (offline machine), or
            the found interpreter cannot import the reference.
    """
    python = find_reference_python(explicit)
    if python is None:
        if not build:
            raise ReferenceUnavailable(f"no reference venv (set ${ENV_VAR}, run `make reference`, or let the "
                                       f"gate build {cached_venv_dir()})")
        python = build_reference_venv(cached_venv_dir(), log=log)
    if check:
        probe(python)
    elif not Path(python).exists():
        raise ReferenceUnavailable(f"{python} does not exist")
    return python


__all__ = ["ENV_VAR", "LOCAL_VENV", "REFERENCE_VERSION", "ReferenceUnavailable", "build_reference_venv",
           "cached_venv_dir", "ensure_reference_python", "find_reference_python", "probe"]


def main(argv: list[str] | None = None) -> int:
    """``python -m speculators.export.reference_env [DIR]`` (``make reference``): build the reference venv at
    ``DIR`` (default: the cache). Offline it prints why and exits 0, so that the tests run and report the
    skip, except under ``CI=true``, where an unavailable reference is an error (exit 1)."""
    args = sys.argv[1:] if argv is None else argv
    dest = Path(args[0]) if args else cached_venv_dir()

    def describe() -> str:
        python = build_reference_venv(dest)
        return f"reference implementation: vllm-project/speculators {probe(python)} at {python}"

    return install_step_exit(describe, ReferenceUnavailable)


if __name__ == "__main__":
    sys.exit(main())
