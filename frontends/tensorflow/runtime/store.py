"""The job's key-value store for the failure protocol, as files in a job directory every rank sees.

smp's failure record and heartbeats (`smp.runtime.failure`, `smp.runtime.liveness`) need a store
with ``set`` / ``get`` / ``check`` / ``compare_set``. torch has its TCPStore; TensorFlow has none,
and ``import smp.tensorflow`` must not import torch. Why files rather than MPI messages: a store
that lives in no rank's process survives any rank (a SIGKILLed rank 0 does not take the failure
record with it), it needs no service thread making MPI calls next to the training threads, and a
rank that already exited leaves its last word (``exited``, a traceback) readable. The cost is one
small file write per heartbeat (0.5 s) and one ``stat`` per failure check (every 50 ms of a wait).

Layout: one file per key (the key %-quoted: ``hb/3`` is ``hb%2F3``) in a directory made by rank 0
under ``$SMP_JOB_DIR`` (default: the system temporary directory) and named to the others over MPI
(``runtime.init.open_job_store``). A write goes to a temporary name and is renamed over the key, so a reader sees
the old value or the new one, never half of one; ``compare_set`` holds an ``flock`` on the
directory's lock file. No ``fsync``: the store outlives processes, not machine crashes.

Multi-node: the directory must be on a filesystem every host mounts (NFS, Lustre, EFS): set
``SMP_JOB_DIR`` there. ``runtime.init.open_job_store`` checks that every rank sees rank 0's directory and fails on
every rank with that instruction when one does not.

Clean-up: each rank, on leaving (``smp.reset()`` or the end of its script), marks itself exited;
the last one out (every rank exited or its process gone) removes the directory. A job that ends
with a killed rank on another host leaves the directory (a few KB) behind.
"""

from __future__ import annotations

import fcntl
import os
import shutil
import threading
import time
from urllib.parse import quote

__all__ = ["JOB_DIR_ENV", "FileStore"]

JOB_DIR_ENV = "SMP_JOB_DIR"
_POLL_S = 0.01


class FileStore:
    """A key-value store in ``directory``, safe across the processes and threads of one job.

    Args:
        directory: an existing directory, the same for every rank of the job.
        timeout_s: how long `get` waits for a key that does not exist yet.

    Example:
        >>> import tempfile
        >>> s = FileStore(tempfile.mkdtemp())
        >>> s.set("hb/0", "1\\t"); s.get("hb/0"), s.check(["hb/0", "hb/1"])
        (b'1\\t', False)
        >>> s.compare_set("failure", "", "0 failed 0\\nboom"), s.compare_set("failure", "", "1 failed 1\\n...")
        (b'0 failed 0\\nboom', b'0 failed 0\\nboom')
    """

    def __init__(self, directory: str, timeout_s: float = 30.0) -> None:
        self.directory = directory
        self.timeout_s = timeout_s
        self._lock_path = os.path.join(directory, ".lock")

    def _path(self, key: str) -> str:
        return os.path.join(self.directory, quote(key, safe=""))

    def set(self, key: str, value: str | bytes) -> None:
        data = value.encode("utf-8") if isinstance(value, str) else bytes(value)
        path = self._path(key)
        tmp = f"{path}.{os.getpid()}.{threading.get_ident()}.tmp"
        with open(tmp, "wb") as f:
            f.write(data)
        os.replace(tmp, path)

    def get(self, key: str) -> bytes:
        """The value of ``key``, waiting up to ``timeout_s`` for it to be set (as torch's stores do)."""
        path = self._path(key)
        deadline = time.monotonic() + self.timeout_s
        while True:
            try:
                with open(path, "rb") as f:
                    return f.read()
            except FileNotFoundError:
                if not os.path.isdir(self.directory):
                    raise FileNotFoundError(f"the job store directory {self.directory} is gone") from None
                if time.monotonic() > deadline:
                    raise TimeoutError(f"key {key!r} not set in the job store {self.directory} "
                                       f"within {self.timeout_s:g} s") from None
                time.sleep(_POLL_S)

    def check(self, keys: list[str]) -> bool:
        return all(os.path.exists(self._path(k)) for k in keys)

    def compare_set(self, key: str, expected: str, desired: str) -> bytes:
        """Set ``key`` to ``desired`` if its value is ``expected`` ("" also matches an unset key).

        Returns the value stored afterwards (``desired`` when it was set), like torch's stores.
        """
        with open(self._lock_path, "a+b") as lock:
            fcntl.flock(lock, fcntl.LOCK_EX)
            try:
                path = self._path(key)
                try:
                    with open(path, "rb") as f:
                        current: bytes | None = f.read()
                except FileNotFoundError:
                    current = None
                if (current is None and expected == "") or current == expected.encode("utf-8"):
                    self.set(key, desired)
                    return desired.encode("utf-8")
                return current if current is not None else b""
            finally:
                fcntl.flock(lock, fcntl.LOCK_UN)

    def remove_directory(self) -> None:
        shutil.rmtree(self.directory, ignore_errors=True)
