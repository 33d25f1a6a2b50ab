"""Small helpers shared across the package: cache locations, hashing, atomic writes."""

from __future__ import annotations

import contextlib
import hashlib
import json
import os
import shutil
import tempfile
from pathlib import Path
from typing import Any, Iterator


def cache_root() -> Path:
    """Root of on-disk caches (converted targets, regenerations, features).

    ``$SPECULATORS_CACHE`` if set, else ``~/.cache/speculators``.
    """
    root = os.environ.get("SPECULATORS_CACHE")
    return Path(root).expanduser() if root else Path.home() / ".cache" / "speculators"


def stable_hash(obj: Any, n: int = 16) -> str:
    """Short sha256 hex digest of a JSON-serialisable object (keys sorted): used as a cache key."""
    blob = json.dumps(obj, sort_keys=True, default=str).encode()
    return hashlib.sha256(blob).hexdigest()[:n]


@contextlib.contextmanager
def atomic_dir(final: str | Path, overwrite: bool = False) -> Iterator[Path]:
    """Write a directory atomically: yield a temporary sibling, rename it to ``final`` on success.

    On an exception the temporary directory is removed and ``final`` is left as it was, so a reader
    never sees a half-written directory. With ``overwrite`` an existing ``final`` is replaced (it is
    moved aside first and deleted only after the rename succeeded).

    Raises:
        FileExistsError: ``final`` exists and ``overwrite`` is False.
    """
    final = Path(final)
    final.parent.mkdir(parents=True, exist_ok=True)
    if final.exists() and not overwrite:
        raise FileExistsError(str(final))
    tmp = Path(tempfile.mkdtemp(prefix=f".{final.name}.tmp-", dir=final.parent))
    try:
        yield tmp
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    old = None
    if final.exists():
        old = final.parent / f".{final.name}.old-{os.getpid()}"
        os.replace(final, old)
    os.replace(tmp, final)
    if old is not None:
        shutil.rmtree(old, ignore_errors=True)


def atomic_write_text(path: str | Path, text: str) -> None:
    """Write a text file through a temporary name and ``os.replace`` (never half-written)."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.", dir=path.parent)
    with os.fdopen(fd, "w") as f:
        f.write(text)
    os.replace(tmp, path)
