"""Small helpers shared across the package: cache locations, hashing, atomic writes."""

from __future__ import annotations

import contextlib
import hashlib
import errno
import json
import os
import shutil
import stat
import tempfile
from pathlib import Path
from typing import Any, Iterator


def cache_root() -> Path:
    """Root of on-disk caches (converted targets, regenerations, features).

    ``$SPECULATORS_CACHE`` if set, else ``~/.cache/speculators``.
    """
    root = os.environ.get("SPECULATORS_CACHE")
    return Path(root).expanduser() if root else Path.home() / ".cache" / "speculators"


def install_step_exit(describe, unavailable: type[Exception]) -> int:
    """The exit status of an optional install step (``make reference``, ``make llama-cpp``): run ``describe()``
    (it installs and returns one line saying what is ready), print that line and return 0; when it raises
    ``unavailable`` (offline, no compiler), print the error on stderr and return 0 so that the tests run and
    report their skips, except under ``CI=true`` (also ``1`` / ``yes``), where the step is required: 1."""
    import sys

    try:
        print(describe())
        return 0
    except unavailable as e:
        print(str(e), file=sys.stderr)
        return 1 if os.environ.get("CI", "").lower() in ("1", "true", "yes") else 0


def stable_hash(obj: Any, n: int = 16) -> str:
    """Short sha256 hex digest of a JSON-serialisable object (keys sorted): used as a cache key."""
    blob = json.dumps(obj, sort_keys=True, default=str).encode()
    return hashlib.sha256(blob).hexdigest()[:n]


def current_umask() -> int:
    """The process umask (e.g. ``0o022``), read without changing it where possible.

    Linux exposes it in ``/proc/self/status`` (``Umask:`` line, kernel >= 4.7); elsewhere it is read
    with ``os.umask(0)`` and restored at once (a brief window in which another thread's new files would
    get mode 0666/0777 -- the only portable way).
    """
    try:
        with open("/proc/self/status") as f:
            for line in f:
                if line.startswith("Umask:"):
                    return int(line.split()[1], 8)
    except (OSError, ValueError, IndexError):
        pass
    mask = os.umask(0)
    os.umask(mask)
    return mask


def _plain_dir_mode() -> int:
    """Permission bits ``mkdir`` gives a new directory under the current umask (``0o755`` at ``0o022``)."""
    return 0o777 & ~current_umask()


def _plain_file_mode() -> int:
    """Permission bits ``open(..., "w")`` gives a new file under the current umask (``0o644`` at ``0o022``)."""
    return 0o666 & ~current_umask()


def restore_plain_modes(path: str | Path) -> None:
    """Give ``path`` (a file or directory, recursively) the modes a plain ``open``/``mkdir`` would.

    Only entries left private by a temp-file writer are changed: files of mode exactly ``0o600``
    (Python's ``mkstemp``, safetensors >= 0.8's ``save_file``, which writes through Rust's
    ``tempfile::NamedTempFile`` and renames) become ``0o666 & ~umask``,
    directories of mode exactly ``0o700`` (``mkdtemp``) become ``0o777 & ~umask``. Other modes (set
    on purpose) are kept; symlinks are not followed.
    """
    path = Path(path)
    fmode, dmode = _plain_file_mode(), _plain_dir_mode()
    entries = [path]
    if path.is_dir() and not path.is_symlink():
        entries += [Path(root) / n for root, dirs, files in os.walk(path) for n in dirs + files]
    for p in entries:
        st = os.lstat(p)
        m = stat.S_IMODE(st.st_mode)
        if stat.S_ISREG(st.st_mode) and m == 0o600 and fmode != m:
            os.chmod(p, fmode)
        elif stat.S_ISDIR(st.st_mode) and m == 0o700 and dmode != m:
            os.chmod(p, dmode)


@contextlib.contextmanager
def atomic_dir(final: str | Path, overwrite: bool = False) -> Iterator[Path]:
    """Write a directory atomically: yield a temporary sibling, rename it to ``final`` on success.

    On an exception the temporary directory is removed and ``final`` is left as it was, so a reader
    never sees a half-written directory. With ``overwrite`` an existing ``final`` is replaced (it is
    moved aside first and deleted only after the rename succeeded). ``final`` gets the mode a plain
    ``mkdir`` would give under the user's umask (``0o755`` at umask ``0o022``; a replaced directory keeps
    its own mode), not ``mkdtemp``'s
    private ``0o700``, and files or folders inside that a temp-file writer left private (safetensors'
    ``save_file`` makes ``0o600`` files) get plain modes too (see ``restore_plain_modes``), so other
    users (a serving process, teammates) can read what was written.

    Raises:
        FileExistsError: ``final`` exists and ``overwrite`` is False (also when another process put it in place
            while we wrote; with ``overwrite``, when others kept doing so through five attempts).
    """
    final = Path(final)
    final.parent.mkdir(parents=True, exist_ok=True)
    if final.exists() and not overwrite:
        raise FileExistsError(str(final))
    tmp = Path(tempfile.mkdtemp(prefix=f".{final.name}.tmp-", dir=final.parent))
    try:
        yield tmp
        restore_plain_modes(tmp)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    # another process may write the same ``final`` at the same time (two workers filling one cache entry): with
    # ``overwrite`` the last complete writer wins (each attempt moves what is there aside and renames ours in; what
    # was moved aside is deleted only once a complete directory stands at ``final``, and put back otherwise);
    # without it, a ``final`` that appeared meanwhile is left alone and FileExistsError raised
    for attempt in range(5):
        old = None
        try:
            if overwrite and final.exists():
                if final.is_dir():  # a replaced directory keeps its own (possibly chmod-ed) mode, as atomic_write_text does
                    os.chmod(tmp, final.stat().st_mode & 0o7777)
                old = final.parent / f".{final.name}.old-{os.getpid()}-{attempt}"
                os.replace(final, old)
            os.replace(tmp, final)
        except OSError as e:  # ENOENT: another writer moved it aside first; ENOTEMPTY / EEXIST: it put its own in
            if old is not None and not final.exists():
                try:
                    os.replace(old, final)  # ours did not get in: the previous complete directory goes back
                    old = None
                except OSError:
                    pass
            if old is not None and final.exists():
                shutil.rmtree(old, ignore_errors=True)  # another writer's complete directory stands at final
            lost = e.errno in (errno.ENOENT, errno.ENOTEMPTY, errno.EEXIST)
            if overwrite and lost and attempt < 4:
                continue
            shutil.rmtree(tmp, ignore_errors=True)
            if lost and final.exists():
                raise FileExistsError(f"{final}: written by another process meanwhile") from None
            raise
        if old is not None:
            shutil.rmtree(old, ignore_errors=True)
        return


def atomic_write_text(path: str | Path, text: str) -> None:
    """Write a text file through a temporary name and ``os.replace`` (never half-written).

    The file gets the mode a plain ``open(path, "w")`` would leave: an existing file keeps its
    permission bits, a new one gets ``0o666`` less the umask (``0o644`` at ``0o022``), not ``mkstemp``'s
    private ``0o600``. On an error the temporary file is removed and ``path`` is untouched.
    """
    _atomic_write(path, text, "w")


def atomic_write_bytes(path: str | Path, data: bytes) -> None:
    """Write a binary file (e.g. ``safetensors.torch.save``'s bytes) as :func:`atomic_write_text` writes text:
    through a temporary name and ``os.replace``, with the mode a plain ``open(path, "wb")`` would leave."""
    _atomic_write(path, data, "wb")


def _atomic_write(path: str | Path, data: str | bytes, mode_flag: str) -> None:
    """The one crash-safe file write of :func:`atomic_write_text` / :func:`atomic_write_bytes` (``mode_flag``
    ``"w"`` or ``"wb"``)."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    try:
        mode = stat.S_IMODE(os.stat(path).st_mode)
    except FileNotFoundError:
        mode = _plain_file_mode()
    fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.", dir=path.parent)
    try:
        with os.fdopen(fd, mode_flag) as f:
            f.write(data)
        os.chmod(tmp, mode)  # mkstemp creates 0o600 and the mode survives the rename
        os.replace(tmp, path)
    except BaseException:
        with contextlib.suppress(OSError):
            os.unlink(tmp)
        raise


def read_jsonl_records(path: str | Path) -> Iterator[dict]:
    """The JSON objects of an append-only JSONL cache, one per line, in file order; a line that does not
    parse (the torn last line of an interrupted run) or is not an object is skipped. Nothing when the
    file does not exist."""
    path = Path(path)
    if not path.exists():
        return
    for line in path.read_text().splitlines():
        try:
            rec = json.loads(line)
        except json.JSONDecodeError:
            continue
        if isinstance(rec, dict):
            yield rec


def open_jsonl_append(path: str | Path):
    """``path`` opened for appending JSONL records (parent folders created). When an interrupted run left
    a torn last line (no trailing newline), a newline is written first, so the next record starts on a
    line of its own instead of being glued to the torn one and lost on the next read."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    torn = path.exists() and path.stat().st_size > 0 and not path.read_bytes().endswith(b"\n")
    fh = path.open("a")
    if torn:
        fh.write("\n")
    return fh
