"""Per-save manifests and the commit of a save directory: a save is staged, then swapped in whole.

Note [save directory commit]: a save never writes into the directory it replaces. With final
directory ``D`` (``step_3_partial``) in ``parent``::

    begin     .D.<id>.smp-staging/       new save id; every rank writes its files here
    manifest  .D.<id>.smp-staging/smp_manifest.json   {save id, every file's size and SHA-256}
    commit    D -> .D.<id>.smp-old       (only if D exists: the same tag saved again)
              .D.<id>.smp-staging -> D
    after     the caller lists D (e.g. SMP v1's ``newest``), then .D.<id>.smp-old is deleted

A process killed before the commit leaves ``D`` as it was (plus a staging directory). Killed
between the two renames, ``D`` is missing and ``.D.<id>.smp-old`` holds the previous save intact:
`committed_directory` reads it there and the next save's cleanup (`clean_leftovers`) renames it
back. A reader checks each file against the manifest (`verify_file`), so a file that is not the
one its save wrote (truncated, overwritten, copied in from another save) is refused by name.
"""

from __future__ import annotations

import json
import logging
import os
import re
import secrets
import shutil
from dataclasses import dataclass, field
from typing import Any

from smp.checkpoint.atomic import TEMP_SUFFIX, FileRecord, atomic_write, fsync_dir, sha256_file
from smp.errors import SMPCheckpointError

__all__ = [
    "MANIFEST", "Leftover", "Manifest", "clean_leftovers", "commit_directory", "committed_directory",
    "find_leftovers", "new_save_id", "old_directory", "read_manifest", "staging_directory", "verify_file",
    "write_manifest",
]

logger = logging.getLogger("smp.checkpoint")

MANIFEST = "smp_manifest.json"
FORMAT = "smp-save-manifest/1"
_STAGING, _OLD = ".smp-staging", ".smp-old"
_LEFTOVER = re.compile(r"^\.(?P<name>.+)\.(?P<save_id>[0-9a-f]{16})\.smp-(?P<kind>staging|old)$")


@dataclass(frozen=True)
class Manifest:
    """The record of one save: its id and what it wrote (file name in the directory -> `FileRecord`)."""

    save_id: str
    tag: str
    files: dict[str, FileRecord] = field(default_factory=dict)

    def to_json(self) -> str:
        return json.dumps({"format": FORMAT, "tag": self.tag, "save_id": self.save_id,
                           "files": {n: {"bytes": r.size, "sha256": r.sha256} for n, r in sorted(self.files.items())}},
                          indent=1) + "\n"


@dataclass(frozen=True)
class Leftover:
    """A directory or temp file that an interrupted save left in a checkpoint directory."""

    kind: str  # "staging", "old" or "temp"
    path: str
    final: str  # for "staging"/"old": the directory it was staged for or replaced; else ""


def new_save_id() -> str:
    """A fresh random save id (16 hex digits)."""
    return secrets.token_hex(8)


def staging_directory(parent: str, name: str, save_id: str) -> str:
    """``parent/.<name>.<save_id>.smp-staging``: where save ``save_id`` of directory ``name`` is written."""
    return os.path.join(parent, f".{name}.{save_id}{_STAGING}")


def old_directory(parent: str, name: str, save_id: str) -> str:
    """``parent/.<name>.<save_id>.smp-old``: the previous ``name`` while save ``save_id`` replaces it."""
    return os.path.join(parent, f".{name}.{save_id}{_OLD}")


def write_manifest(directory: str, manifest: Manifest) -> None:
    """Write ``directory/smp_manifest.json`` atomically."""
    data = manifest.to_json().encode("utf-8")
    atomic_write(os.path.join(directory, MANIFEST), lambda f: f.write(data))


def read_manifest(directory: str) -> Manifest | None:
    """The manifest in ``directory``; None when it has none (written by smp before manifests, or SMP v1).

    Raises:
        SMPCheckpointError: the manifest exists but cannot be read; the message names it.
    """
    path = os.path.join(directory, MANIFEST)
    if not os.path.isfile(path):
        return None
    try:
        with open(path, encoding="utf-8") as f:
            raw: Any = json.load(f)
        files = {str(n): FileRecord(int(r["bytes"]), str(r["sha256"])) for n, r in raw["files"].items()}
        return Manifest(save_id=str(raw["save_id"]), tag=str(raw["tag"]), files=files)
    except (OSError, ValueError, KeyError, TypeError, AttributeError) as e:
        raise SMPCheckpointError(
            f"the manifest {path} is damaged ({type(e).__name__}: {e}), so the files next to it cannot be "
            f"checked. Fix: resume another checkpoint, or delete {MANIFEST} to load the files unchecked") from e


def verify_file(path: str, manifest: Manifest) -> None:
    """Check that ``path`` is the file ``manifest``'s save wrote (its size, then its SHA-256).

    Raises:
        SMPCheckpointError: it is not; the message names the file, the save and what differs (the
            caller adds the fix).
    """
    name = os.path.basename(path)
    expected = manifest.files.get(name)
    if expected is None:
        raise SMPCheckpointError(
            f"{path} is not part of save {manifest.save_id} of {manifest.tag!r}: its {MANIFEST} lists "
            f"{sorted(manifest.files)}, so the file was put there by something else (another save?)")
    size = os.path.getsize(path)
    if size != expected.size:
        what = "truncated" if size < expected.size else "longer than written"
        raise SMPCheckpointError(
            f"{path} is {what}: it has {size} bytes, save {manifest.save_id} of {manifest.tag!r} wrote "
            f"{expected.size} (file changed or cut short after the save)")
    got = sha256_file(path)
    if got.sha256 != expected.sha256:
        raise SMPCheckpointError(
            f"{path} is damaged: its content differs from what save {manifest.save_id} of {manifest.tag!r} "
            f"wrote (SHA-256 {got.sha256[:12]}..., expected {expected.sha256[:12]}...; same size, so it was "
            f"overwritten in place or comes from another save)")


def commit_directory(parent: str, name: str, staging: str, save_id: str) -> str | None:
    """Swap the staged directory in as ``parent/name`` (Note [save directory commit]).

    Returns:
        The path the previous ``name`` was moved to (delete it once the save is listed), or None.
    """
    final = os.path.join(parent, name)
    old = None
    if os.path.lexists(final):
        old = old_directory(parent, name, save_id)
        os.replace(final, old)
    os.replace(staging, final)
    fsync_dir(parent)
    return old


def committed_directory(parent: str, name: str) -> str:
    """``parent/name``, or the previous save of it when a commit was interrupted between its renames.

    Returns ``parent/name`` when neither exists (the caller reports it missing).
    """
    final = os.path.join(parent, name)
    if os.path.isdir(final):
        return final
    olds = [lo.path for lo in find_leftovers(parent) if lo.kind == "old" and lo.final == name]
    if not olds:
        return final
    newest = max(olds, key=os.path.getmtime)
    logger.warning("%s is missing: a save replacing it was interrupted; reading the previous save from %s",
                   final, newest)
    return newest


def find_leftovers(parent: str) -> list[Leftover]:
    """Staging and replaced directories and temp files that interrupted saves left in ``parent``."""
    out: list[Leftover] = []
    try:
        names = sorted(os.listdir(parent))
    except FileNotFoundError:
        return out
    for n in names:
        p = os.path.join(parent, n)
        m = _LEFTOVER.match(n)
        if m is not None and os.path.isdir(p):
            out.append(Leftover(m["kind"], p, m["name"]))
        elif n.startswith(".") and n.endswith(TEMP_SUFFIX):
            out.append(Leftover("temp", p, ""))
    return out


def clean_leftovers(parent: str) -> list[str]:
    """Remove what interrupted saves left in ``parent``; restore a directory an interrupted commit moved.

    Call it only while no save to ``parent`` runs. Returns one line per action (also logged).
    """
    done: list[str] = []
    for lo in find_leftovers(parent):
        final = os.path.join(parent, lo.final) if lo.final else ""
        try:
            if lo.kind == "staging":
                shutil.rmtree(lo.path)
                done.append(f"removed {lo.path}: the files of a save of {lo.final} that did not finish")
            elif lo.kind == "old" and os.path.lexists(final):
                shutil.rmtree(lo.path)
                done.append(f"removed {lo.path}: the previous {lo.final}, replaced by a save that finished")
            elif lo.kind == "old":
                os.replace(lo.path, final)
                fsync_dir(parent)
                done.append(f"restored {final} from {lo.path}: a save replacing it was interrupted")
            else:
                os.unlink(lo.path)
                done.append(f"removed {lo.path}: the temp file of a write that did not finish")
        except OSError as e:
            logger.warning("could not clean up %s (left by an interrupted save): %s", lo.path, e)
    for line in done:
        logger.info("%s", line)
    return done
