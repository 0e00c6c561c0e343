"""Atomic file writes (temp file, fsync, rename) that also report what they wrote (size, SHA-256).

A name written by `atomic_write` holds either its complete old content or its complete new one,
whatever happens to the process; the returned `FileRecord` goes into the save's manifest, so a
reader can tell a file that is not the one its save wrote (see smp/checkpoint/manifest.py).
"""

from __future__ import annotations

import contextlib
import hashlib
import os
import secrets
from collections.abc import Callable
from dataclasses import dataclass
from typing import IO

__all__ = ["TEMP_SUFFIX", "FileRecord", "atomic_write", "atomic_write_text", "fsync_dir", "makedirs", "sha256_file"]

# Suffix of the temp files of atomic writes; a killed write leaves ``.<name>.<pid>.<hex>.smp-tmp``.
TEMP_SUFFIX = ".smp-tmp"
_CHUNK = 1 << 20


@dataclass(frozen=True)
class FileRecord:
    """What one write put into a file: its size in bytes and the SHA-256 of its content (hex)."""

    size: int
    sha256: str


class _HashingWriter:
    """A binary file wrapper that hashes and counts every byte written through it."""

    def __init__(self, f: IO[bytes]) -> None:
        self._f = f
        self._hash = hashlib.sha256()
        self.size = 0

    def write(self, data: bytes | bytearray | memoryview) -> int:
        self._hash.update(data)
        self.size += memoryview(data).nbytes
        return self._f.write(data)

    def flush(self) -> None:
        self._f.flush()

    def fileno(self) -> int:
        return self._f.fileno()

    def record(self) -> FileRecord:
        return FileRecord(self.size, self._hash.hexdigest())


def fsync_dir(dirpath: str) -> None:
    """Make a rename or a new entry in ``dirpath`` durable (a no-op where directories cannot be opened)."""
    try:
        fd = os.open(dirpath, os.O_RDONLY)
    except OSError:
        return
    try:
        with contextlib.suppress(OSError):
            os.fsync(fd)
    finally:
        os.close(fd)


def makedirs(directory: str) -> None:
    """``os.makedirs`` that also makes the new directory entries durable (fsync of each new one's parent)."""
    directory = os.path.abspath(directory)
    created: list[str] = []
    d = directory
    while not os.path.isdir(d):
        created.append(d)
        parent = os.path.dirname(d)
        if parent == d:
            break
        d = parent
    if not created:
        return
    os.makedirs(directory, exist_ok=True)
    for d in reversed(created):
        fsync_dir(os.path.dirname(d))


def atomic_write(path: str | os.PathLike[str], write: Callable[[IO[bytes]], object]) -> FileRecord:
    """Call ``write(file)`` into a temp file next to ``path``, fsync it, rename it over ``path``.

    ``write`` gets a write-only binary file object (``write``/``flush``/``fileno``); everything it writes is
    hashed on the way, so the returned record costs no second read.

    Example:
        >>> import tempfile
        >>> p = os.path.join(tempfile.mkdtemp(), "newest")
        >>> atomic_write(p, lambda f: f.write(b"step_1\\n")).size
        7
    """
    path = os.fspath(path)
    directory = os.path.dirname(os.path.abspath(path))
    # Same directory, so os.replace is a rename within one file system; the name is cut so that a long
    # file name still leaves room for the suffix.
    tmp = os.path.join(directory, f".{os.path.basename(path)[:120]}.{os.getpid()}.{secrets.token_hex(4)}{TEMP_SUFFIX}")
    # os.open with mode 0o666 gives the permissions a plain open() would (umask applies).
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL | getattr(os, "O_BINARY", 0), 0o666)
    try:
        with os.fdopen(fd, "wb") as f:
            hashing = _HashingWriter(f)
            write(hashing)  # type: ignore[arg-type]  # the file protocol write() needs
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        with contextlib.suppress(OSError):
            os.unlink(tmp)
        raise
    fsync_dir(directory)
    return hashing.record()


def atomic_write_text(text: str, path: str | os.PathLike[str]) -> FileRecord:
    """Write ``text`` (UTF-8) to ``path`` with the same guarantee as `atomic_write`.

    Example:
        >>> import tempfile
        >>> p = os.path.join(tempfile.mkdtemp(), "newest")
        >>> _ = atomic_write_text("step_1\\n", p)
        >>> open(p).read()
        'step_1\\n'
    """
    data = text.encode("utf-8")
    return atomic_write(path, lambda f: f.write(data))


def sha256_file(path: str) -> FileRecord:
    """The `FileRecord` of a file on disk (read in 1 MiB chunks)."""
    h = hashlib.sha256()
    size = 0
    with open(path, "rb") as f:
        while chunk := f.read(_CHUNK):
            h.update(chunk)
            size += len(chunk)
    return FileRecord(size, h.hexdigest())
