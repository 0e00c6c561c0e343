"""The codec: how a frontend turns one object into a checkpoint file and back, and the checked read.

A frontend implements `Codec` with its framework's serialisation (``smp.torch``: ``torch.save`` /
``torch.load``) and passes it to the save_checkpoint layout (`smp.checkpoint.layout`), which decides
every file name, the write order and the checks, the same for every frontend.
"""

from __future__ import annotations

import os
import pickle
from typing import Any, Protocol

from smp.checkpoint.atomic import FileRecord, atomic_write
from smp.checkpoint.manifest import MANIFEST, Manifest, verify_file
from smp.errors import SMPCheckpointError

__all__ = ["Codec", "PickleCodec", "load_file"]


class Codec(Protocol):
    """A frontend's serialisation of checkpoint files.

    ``save`` must write through `smp.checkpoint.atomic_write` (or a function built on it): the file
    then holds its old or its new content whatever happens to the process, and the `FileRecord` it
    returns goes into the save's manifest.

    Example (`PickleCodec`, the core's own plain-Python codec):
        >>> import os, tempfile
        >>> p = os.path.join(tempfile.mkdtemp(), "model_0_0.pt")
        >>> PickleCodec().save({"w": [1.0]}, p).size > 0
        True
        >>> load_file(PickleCodec(), p, "model state", "save it again")
        {'w': [1.0]}
    """

    #: The serialisation's name; errors say ``<name>.save`` / ``<name>.load`` (``"torch"``).
    name: str

    def save(self, obj: Any, path: str) -> FileRecord:
        """Write ``obj`` to ``path`` atomically and return what was written."""
        ...

    def load(self, path: str, **kwargs: Any) -> Any:
        """Read the object in ``path``; ``kwargs`` are the frontend's options (``map_location``)."""
        ...


class PickleCodec:
    """`pickle` through `atomic_write`: a `Codec` with no framework (the core's tests and doctests)."""

    name = "pickle"

    def save(self, obj: Any, path: str) -> FileRecord:
        return atomic_write(path, lambda f: pickle.dump(obj, f))

    def load(self, path: str, **kwargs: Any) -> Any:
        with open(path, "rb") as f:
            return pickle.load(f)


def load_file(codec: Codec, path: str, what: str, fix: str, manifest: Manifest | None = None,
              **load_kwargs: Any) -> Any:
    """``codec.load(path)`` whose every failure is an `SMPCheckpointError` naming the file, what is
    wrong and ``fix`` (the caller's advice: which other checkpoint to use).

    With a ``manifest`` the file is first checked against it (size, then SHA-256), so a truncated or
    replaced file is refused before unpickling, and an unpickling error of an intact file says so.
    """
    if not os.path.isfile(path):
        raise SMPCheckpointError(f"cannot read the {what}: {path} does not exist. Fix: {fix}")
    if manifest is not None:
        try:
            verify_file(path, manifest)
        except SMPCheckpointError as e:
            raise SMPCheckpointError(f"cannot read the {what}: {e}. Fix: {fix}") from None
    try:
        return codec.load(path, **load_kwargs)
    except Exception as e:  # noqa: BLE001 - every reader failure becomes one clear error
        why = (f"it is the file its save wrote (checked against {MANIFEST}), but {codec.name}.load fails: "
               f"the saved objects need code this process lacks (import the classes they use)"
               if manifest is not None else
               f"the file is damaged (truncated, overwritten or not written by {codec.name}.save), or the saved "
               "objects need code this process lacks")
        raise SMPCheckpointError(f"cannot read the {what} {path}: {type(e).__name__}: {e}. {why}. Fix: {fix}") from e
