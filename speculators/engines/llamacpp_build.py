"""llama.cpp for this project: its source from a pinned PyPI sdist, ``llama-server`` built once and cached.

Debian has no llama.cpp package and the llama-cpp-python wheel's Python API has no draft models, but its sdist
(MIT) carries the whole llama.cpp source under ``vendor/llama.cpp/``: ``tools/server`` (``llama-server``, whose
``--spec-type draft-eagle3`` / ``draft-dflash`` / ``draft-dspark`` / ``ngram-*`` serve speculative decoding),
``convert_hf_to_gguf.py`` and its ``gguf-py``. This module

1. downloads that sdist (``pip download --no-binary``, pinned at :data:`LLAMA_CPP_PYTHON_VERSION`) and keeps
   only ``vendor/llama.cpp`` in ``<cache>/llama.cpp/src-<version>/llama.cpp`` (:func:`fetch_source`);
2. builds the :data:`TOOLS` (``llama-server``; ``llama-quantize``, which makes the target quantizations the engine
   eval serves; ``llama-bench``, which times the target's forwards) with CMake (Release, static libraries,
   ``GGML_NATIVE=ON``: the binaries are tuned to this CPU, hence the cache key) into
   ``<cache>/llama.cpp/build-<version>-<key>/`` (:func:`build`). Both steps fill a temporary sibling and rename it into place when complete, so an
   interrupted download or build leaves nothing that looks ready.

Where a build comes from, first match wins (:func:`find_llama_cpp`): ``$SPECULATORS_LLAMA_CPP`` (a build
directory holding ``bin/llama-server``, with the source next to it as ``<dir>/../src-<version>`` or named by
``$SPECULATORS_LLAMA_CPP_SOURCE``), then the cache. ``python -m speculators.engines.llamacpp_build`` (``make
llama-cpp``) builds it; offline or without cmake / a C++ compiler it prints why and exits 0 (the engine tests
then skip saying so), except under ``CI=true``, where it exits 1.
"""

from __future__ import annotations

import dataclasses
import hashlib
import os
import shutil
import subprocess
import sys
import tarfile
import tempfile
from pathlib import Path

from ..errors import SpeculatorsError
from ..utils import cache_root, install_step_exit

#: The llama-cpp-python sdist whose ``vendor/llama.cpp`` is built (its llama.cpp serves EAGLE-3, DFlash, DSpark).
LLAMA_CPP_PYTHON_VERSION = "0.3.36"
#: Environment variable naming a ready build directory (``bin/llama-server`` inside).
ENV_VAR = "SPECULATORS_LLAMA_CPP"
#: Environment variable naming the llama.cpp source directory of that build (``convert_hf_to_gguf.py`` inside).
SOURCE_ENV_VAR = "SPECULATORS_LLAMA_CPP_SOURCE"
# CPU flags that change what GGML_NATIVE compiles (a binary built with one set may not run with another)
_ISA_FLAGS = ("sse3", "ssse3", "avx", "avx2", "f16c", "fma", "bmi2", "avx512f", "avx512bw", "avx512vl", "avx512_vnni",
              "avx512_bf16", "avx_vnni", "amx_tile", "amx_int8", "amx_bf16", "asimd", "sve", "i8mm")
#: the llama.cpp targets built (their set is part of the build's cache key: a build missing one is not reused)
TOOLS = ("llama-server", "llama-quantize", "llama-bench")
_CMAKE_OPTIONS = ("-DCMAKE_BUILD_TYPE=Release", "-DBUILD_SHARED_LIBS=OFF", "-DGGML_NATIVE=ON", "-DLLAMA_CURL=OFF",
                  "-DLLAMA_BUILD_TESTS=OFF", "-DLLAMA_BUILD_EXAMPLES=OFF", "-DLLAMA_OPENSSL=OFF")


class LlamaCppUnavailable(SpeculatorsError):
    """llama.cpp cannot be had here (offline, no cmake / compiler, a failed build). Its message starts with
    ``llama.cpp unavailable:`` and says why."""

    def __init__(self, why: str):
        super().__init__(f"llama.cpp unavailable: {why}")
        self.why = why


@dataclasses.dataclass(frozen=True)
class LlamaCpp:
    """A built llama.cpp: ``server`` is the ``llama-server`` binary, ``source`` the llama.cpp source directory
    (``convert_hf_to_gguf.py`` and ``gguf-py`` inside), ``version`` the llama-cpp-python sdist it came from."""

    server: Path
    source: Path
    version: str

    def tool(self, name: str) -> Path:
        """The path of another binary of this build (``llama-quantize``, ``llama-bench``: :data:`TOOLS`).

        Raises:
            LlamaCppUnavailable: the build has no such binary (an older build: run ``make llama-cpp``).
        """
        path = self.server.parent / name
        if not path.exists():
            raise LlamaCppUnavailable(f"this llama.cpp build ({self.server.parent}) has no {name} (build it with "
                                      f"`make llama-cpp`, which builds {', '.join(TOOLS)})")
        return path

    @property
    def converter(self) -> Path:
        """``convert_hf_to_gguf.py`` of this source."""
        return self.source / "convert_hf_to_gguf.py"

    @property
    def gguf_py(self) -> Path:
        """The ``gguf-py`` package directory this source's converter imports (put first on ``PYTHONPATH``)."""
        return self.source / "gguf-py"


def build_options(lc: LlamaCpp) -> dict[str, str]:
    """The ggml options the build was configured with (``GGML_*`` entries of its ``CMakeCache.txt``: e.g.
    ``GGML_OPENMP`` ``ON``, which makes its CPU threads wait in OpenMP's barriers, where ``--poll`` has no effect);
    empty when the build directory has no cache (a build from elsewhere)."""
    try:
        text = (lc.server.parent.parent / "CMakeCache.txt").read_text(errors="replace")
    except OSError:
        return {}
    out = {}
    for line in text.splitlines():
        name, _, value = line.partition("=")
        if name.startswith("GGML_") and ":" in name:
            out[name.split(":", 1)[0]] = value
    return out


def cpu_flags() -> set[str]:
    """The ISA flags of this CPU that :data:`_ISA_FLAGS` names (from ``/proc/cpuinfo``; empty elsewhere)."""
    try:
        text = Path("/proc/cpuinfo").read_text()
    except OSError:
        return set()
    for line in text.splitlines():
        if line.startswith(("flags", "Features")):
            return set(line.split(":", 1)[1].split()) & set(_ISA_FLAGS)
    return set()


def repack_broken() -> bool:
    """Whether this CPU needs llama.cpp's weight repack off (``--no-repack`` / ``--repack 0``): on AMX Xeons this
    llama.cpp's AMX repacked matmul segfaults at warm-up, so its tools serve the weights as stored there."""
    return bool({"amx_int8", "amx_tile"} & cpu_flags())


def cpu_key() -> str:
    """8 hex digits naming this CPU's ISA flags (:func:`cpu_flags`) and the :data:`TOOLS` built: the build cache
    key."""
    return hashlib.sha256((" ".join(sorted(cpu_flags())) + "|" + " ".join(TOOLS)).encode()).hexdigest()[:8]


def source_dir(version: str = LLAMA_CPP_PYTHON_VERSION) -> Path:
    """``<cache>/llama.cpp/src-<version>/llama.cpp``: where :func:`fetch_source` puts the source."""
    return cache_root() / "llama.cpp" / f"src-{version}" / "llama.cpp"


def build_dir(version: str = LLAMA_CPP_PYTHON_VERSION) -> Path:
    """``<cache>/llama.cpp/build-<version>-<key>`` (:func:`cpu_key`): where :func:`build` puts the build."""
    return cache_root() / "llama.cpp" / f"build-{version}-{cpu_key()}"


def _atomic_dir(dest: Path):
    """A temporary sibling of ``dest`` (created; the caller fills it, then ``os.replace``-s it into place)."""
    dest.parent.mkdir(parents=True, exist_ok=True)
    for stale in dest.parent.glob(f".{dest.name}.tmp-*"):  # left by a killed run
        shutil.rmtree(stale, ignore_errors=True)
    return Path(tempfile.mkdtemp(prefix=f".{dest.name}.tmp-", dir=dest.parent))


def _run(cmd: list[str], what: str, cwd: Path | None = None, log=print) -> None:
    log(f"llama.cpp: {what}")
    try:
        r = subprocess.run(cmd, cwd=cwd, capture_output=True, text=True)
    except OSError as e:
        raise LlamaCppUnavailable(f"{what}: cannot run {cmd[0]} ({e})") from None
    if r.returncode != 0:
        tail = (r.stderr.strip() or r.stdout.strip() or "(no output)").splitlines()[-5:]
        raise LlamaCppUnavailable(f"{what} failed (exit {r.returncode}): " + " | ".join(tail))


def fetch_source(version: str = LLAMA_CPP_PYTHON_VERSION, log=print) -> Path:
    """The llama.cpp source of llama-cpp-python ``version``'s sdist, downloaded once (:func:`source_dir`).

    Raises:
        LlamaCppUnavailable: pip cannot download the sdist (offline) or it has no ``vendor/llama.cpp``.
    """
    dest = source_dir(version)
    if (dest / "convert_hf_to_gguf.py").exists() and (dest / "CMakeLists.txt").exists():
        return dest
    tmp = _atomic_dir(dest.parent)
    try:
        _run([sys.executable, "-m", "pip", "download", "--quiet", "--no-deps", "--no-binary", ":all:",
              f"llama-cpp-python=={version}", "-d", str(tmp)], f"download llama-cpp-python=={version} (sdist)", log=log)
        sdist = next(tmp.glob("llama_cpp_python-*.tar.gz"), None)
        if sdist is None:
            raise LlamaCppUnavailable(f"pip downloaded no llama_cpp_python-{version}.tar.gz")
        prefix = f"{sdist.name[:-len('.tar.gz')]}/vendor/llama.cpp/"
        with tarfile.open(sdist) as tar:
            members = [m for m in tar.getmembers() if m.name.startswith(prefix) and (m.isfile() or m.isdir())]
            if not members:
                raise LlamaCppUnavailable(f"{sdist.name} has no vendor/llama.cpp")
            for m in members:
                m.name = "llama.cpp/" + m.name[len(prefix):]
            tar.extractall(tmp, members=members, filter="data")
        sdist.unlink()
        if dest.parent.exists():
            shutil.rmtree(dest.parent)
        os.replace(tmp, dest.parent)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    return dest


def build(version: str = LLAMA_CPP_PYTHON_VERSION, jobs: int | None = None, log=print) -> LlamaCpp:
    """Build the :data:`TOOLS` from :func:`fetch_source` once (:func:`build_dir`) and return the build.

    CMake options: :data:`_CMAKE_OPTIONS` (Release, static, ``GGML_NATIVE=ON``, no curl / tests / examples);
    ``jobs`` parallel compile jobs (default: all cores). Many minutes on two cores; a complete build is kept.

    Raises:
        LlamaCppUnavailable: no cmake or C++ compiler, the download failed, or the build failed (its last lines).
    """
    dest = build_dir(version)
    server = dest / "bin" / "llama-server"
    source = fetch_source(version, log=log)
    if all((dest / "bin" / t).exists() for t in TOOLS):
        return LlamaCpp(server, source, version)
    for tool in ("cmake", "c++"):
        if shutil.which(tool) is None:
            raise LlamaCppUnavailable(f"`{tool}` is not on PATH (install cmake and g++: apt install cmake g++)")
    tmp = _atomic_dir(dest)
    try:
        _run(["cmake", "-S", str(source), "-B", str(tmp), *_CMAKE_OPTIONS], "cmake configure", log=log)
        _run(["cmake", "--build", str(tmp), "--target", *TOOLS, "-j", str(jobs or os.cpu_count() or 1)],
             f"build {', '.join(TOOLS)} (many minutes on two cores)", log=log)
        missing = [t for t in TOOLS if not (tmp / "bin" / t).exists()]
        if missing:
            raise LlamaCppUnavailable(f"the build wrote no bin/{missing[0]} under {tmp}")
        os.replace(tmp, dest)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    return LlamaCpp(server, source, version)


def find_llama_cpp() -> LlamaCpp | None:
    """A ready build (module docstring: ``$SPECULATORS_LLAMA_CPP``, then the cache), or None.

    Raises:
        LlamaCppUnavailable: ``$SPECULATORS_LLAMA_CPP`` is set but holds no ``bin/llama-server``, or its source
            is not found.
    """
    explicit = os.environ.get(ENV_VAR)
    if explicit:
        server = Path(explicit).expanduser().resolve() / "bin" / "llama-server"
        if not server.exists():
            raise LlamaCppUnavailable(f"${ENV_VAR}={explicit} holds no bin/llama-server")
        src = os.environ.get(SOURCE_ENV_VAR)
        source = Path(src).expanduser().resolve() if src else source_dir()
        if not (source / "convert_hf_to_gguf.py").exists():
            raise LlamaCppUnavailable(f"no llama.cpp source with convert_hf_to_gguf.py at {source} "
                                      f"(set ${SOURCE_ENV_VAR})")
        return LlamaCpp(server, source, LLAMA_CPP_PYTHON_VERSION)
    server = build_dir() / "bin" / "llama-server"
    source = source_dir()
    if all((server.parent / t).exists() for t in TOOLS) and (source / "convert_hf_to_gguf.py").exists():
        return LlamaCpp(server, source, LLAMA_CPP_PYTHON_VERSION)
    return None


def require_llama_cpp() -> LlamaCpp:
    """:func:`find_llama_cpp`, or an error that says how to build it.

    Raises:
        LlamaCppUnavailable: no build found.
    """
    found = find_llama_cpp()
    if found is None:
        raise LlamaCppUnavailable(f"no llama-server built (run `make llama-cpp`, or set ${ENV_VAR} to a build "
                                  f"directory with bin/llama-server); expected {build_dir() / 'bin' / 'llama-server'}")
    return found


__all__ = ["ENV_VAR", "LLAMA_CPP_PYTHON_VERSION", "LlamaCpp", "LlamaCppUnavailable", "SOURCE_ENV_VAR", "TOOLS", "build", "build_options",
           "repack_broken",
           "build_dir", "cpu_flags", "cpu_key", "fetch_source", "find_llama_cpp", "require_llama_cpp", "source_dir"]


def main(argv: list[str] | None = None) -> int:
    """``python -m speculators.engines.llamacpp_build`` (``make llama-cpp``): fetch and build llama.cpp once.
    Unavailable (offline, no compiler) it prints why and exits 0, except under ``CI=true`` (exit 1)."""
    del argv

    def describe() -> str:
        lc = build()
        return f"llama.cpp: llama-server of llama-cpp-python {lc.version} at {lc.server}"

    return install_step_exit(describe, LlamaCppUnavailable)


if __name__ == "__main__":
    sys.exit(main())
