"""The torch binding of checkpoint files: `atomic_save`, the torch `Codec`, save_checkpoint's verbs.

The layout itself -- file names, ``newest``, the staged and committed partial save (Note
[checkpoint commit order]), the checks on reading back -- is framework-free in
smp/checkpoint/layout.py. This module passes it ``torch.save``/``torch.load`` and gives the torch
frontend one module to call (`smp.torch.checkpointing.saving` calls ``files.<verb>``): the verbs
that write or read objects are bound to the torch codec here, the others are the core's own.
"""

from __future__ import annotations

import os
from typing import Any

import torch

from smp.checkpoint import FileRecord, Manifest, atomic_write, layout
from smp.checkpoint import load_file as _checked_load
from smp.checkpoint.layout import (
    NEWEST,
    check_tag,
    commit_partial_checkpoint,
    detect_rankinfo,
    optimizer_shards,
    prepare_partial_checkpoint,
    read_newest,
)

__all__ = [
    "CODEC", "NEWEST", "TorchCodec", "atomic_save", "check_tag", "commit_partial_checkpoint", "detect_rankinfo",
    "load_file", "optimizer_shards", "prepare_partial_checkpoint", "read_full_checkpoint", "read_newest",
    "read_optimizer_shards", "read_partial_checkpoint", "write_full_checkpoint", "write_partial_checkpoint",
]


def atomic_save(obj: Any, path: str | os.PathLike[str], **torch_save_kwargs: Any) -> FileRecord:
    """``torch.save(obj, path)`` that never leaves ``path`` half-written; returns what it wrote.

    Writes a temp file in the same directory, flushes and fsyncs it, renames it over ``path``
    (``os.replace``, atomic on POSIX and Windows) and fsyncs the directory. An exception or a killed
    process at any point leaves the previous file at ``path`` intact (a kill may leave a
    ``.<name>.<pid>.<hex>.smp-tmp`` file behind; the next `prepare_partial_checkpoint` removes those).

    Args:
        obj: anything ``torch.save`` accepts.
        path: the destination; its directory must exist.
        **torch_save_kwargs: passed to ``torch.save`` (``pickle_module``, ``pickle_protocol``).

    Returns:
        The file's size and SHA-256 (for a save's manifest).

    Example:
        >>> import tempfile
        >>> p = os.path.join(tempfile.mkdtemp(), "model.pt")
        >>> _ = atomic_save({"w": torch.ones(2)}, p)
        >>> torch.load(p)["w"].tolist()
        [1.0, 1.0]
    """
    return atomic_write(path, lambda f: torch.save(obj, f, **torch_save_kwargs))


class TorchCodec:
    """``torch.save``/``torch.load`` as the core's `Codec`.

    ``save`` looks `atomic_save` up when it runs, so every checkpoint file of this frontend
    (``smp.save`` and ``save_checkpoint`` alike) is written by that one function.
    """

    name = "torch"

    def save(self, obj: Any, path: str) -> FileRecord:
        return atomic_save(obj, path)

    def load(self, path: str, **kwargs: Any) -> Any:
        return torch.load(path, **kwargs)


CODEC = TorchCodec()


def load_file(path: str, what: str, fix: str, manifest: Manifest | None = None, **torch_load_kwargs: Any) -> Any:
    """``torch.load(path)`` whose every failure is an `SMPCheckpointError` naming the file, what is
    wrong and ``fix`` (`smp.checkpoint.load_file` with the torch codec)."""
    return _checked_load(CODEC, path, what, fix, manifest, **torch_load_kwargs)


def write_partial_checkpoint(*args: Any, **kwargs: Any) -> dict[str, FileRecord]:
    """Phase 2 of a partial save in torch files: `smp.checkpoint.layout.write_partial_checkpoint`
    (same arguments) with the torch codec.

    Example:
        >>> import tempfile
        >>> d = tempfile.mkdtemp()
        >>> sid = prepare_partial_checkpoint(d, "step_1")
        >>> rec = write_partial_checkpoint(d, "step_1", "0_0", {"w": torch.ones(1)}, {},
        ...                                {"epoch": 1}, {"microbatches": 2}, write_shared=True, save_id=sid)
        >>> commit_partial_checkpoint(d, "step_1", sid, rec, expected_rankinfos=["0_0"])
        ['step_1']
        >>> read_partial_checkpoint(d, None, "0_0")["model"]["w"].tolist()
        [1.0]
    """
    return layout.write_partial_checkpoint(CODEC, *args, **kwargs)


def read_partial_checkpoint(
    path: str | os.PathLike[str],
    tag: str | None,
    rankinfo: str,
    *,
    optimizer_rankinfo: str | None = None,
    load_optimizer: bool = True,
    map_location: Any = "cpu",
    weights_only: bool = False,
) -> dict[str, Any]:
    """One rank's part of a ``save_checkpoint`` checkpoint (`smp.checkpoint.layout.read_partial_checkpoint`).

    ``map_location`` and ``weights_only`` go to ``torch.load``: tensors land on the CPU by default,
    and ``weights_only=False`` (the default) unpickles arbitrary objects (user content, optimizer
    extras): only read checkpoints you trust.
    """
    return layout.read_partial_checkpoint(
        CODEC, path, tag, rankinfo, optimizer_rankinfo=optimizer_rankinfo, load_optimizer=load_optimizer,
        map_location=map_location, weights_only=weights_only)


def read_optimizer_shards(path: str | os.PathLike[str], tag: str | None, rankinfos: list[str], *,
                          map_location: Any = "cpu", weights_only: bool = False) -> list[Any]:
    """The sharded optimizer files of ``rankinfos`` (`smp.checkpoint.layout.read_optimizer_shards`)."""
    return layout.read_optimizer_shards(CODEC, path, tag, rankinfos, map_location=map_location,
                                        weights_only=weights_only)


def write_full_checkpoint(path: str | os.PathLike[str], tag: str, model_state: Any,
                          user_content: Any = None) -> None:
    """A ``partial=False`` checkpoint in torch files (`smp.checkpoint.layout.write_full_checkpoint`)."""
    layout.write_full_checkpoint(CODEC, path, tag, model_state, user_content)


def read_full_checkpoint(path: str | os.PathLike[str], tag: str, *, map_location: Any = "cpu",
                         weights_only: bool = False) -> dict[str, Any]:
    """Read a ``partial=False`` checkpoint (`smp.checkpoint.layout.read_full_checkpoint`); the keywords go to
    ``torch.load``."""
    return layout.read_full_checkpoint(CODEC, path, tag, map_location=map_location, weights_only=weights_only)
