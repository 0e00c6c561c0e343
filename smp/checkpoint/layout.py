"""The save_checkpoint layout of SMP v1 checkpoints: file names, ``newest``, the staged partial save, reading back.

Framework-free: a frontend passes its serialisation in as a `Codec` (smp/checkpoint/codec.py;
``smp.torch.checkpointing.files`` binds ``torch.save``/``torch.load``). ``smp.save_checkpoint`` /
``smp.resume_from_checkpoint`` decide which ranks call what (reference sections 3.12 and 11.2) and
call this module. Nothing here communicates. ``smp.save(obj, f, partial=True)`` file names and rank
infos: `smp.checkpoint.names`.

``save_checkpoint(path, tag)`` layout::

    path/
      newest                       the partial tags, oldest first, one per line
      <tag>_partial/
        model_<rankinfo>.pt        one per (pp, tp) -- rankinfo "0_1" -- or (pp, tp, rdp): "0_1_2"
        optimizer_<rankinfo>.pt
        fp16_states_<rankinfo>.pt  when fp16 master states are given
        user_content.pt            written once (rank 0)
        smp_config.pt              the config dict plus "smp_version", written once (rank 0)
        smp_manifest.json          the save's id and every file's size and SHA-256 (smp only; SMP v1
                                   readers ignore it, and checkpoints without one load unchecked)
      <tag>                        full model (partial=False)
      user_content_<tag>           full user content (partial=False)

Note [checkpoint commit order]: every file is written atomically (the codec's ``save`` goes through
`atomic_write`: temp file in the same directory, flush, fsync, ``os.replace``, fsync of the
directory), and a partial save never writes into a ``<tag>_partial`` directory that exists: it is
staged in a directory of its own and swapped in whole (smp/checkpoint/manifest.py, Note [save
directory commit]). A partial save of tag N::

    rank 0      save_id = prepare_partial_checkpoint(path, N)
                  cleans what interrupted saves left; creates .N_partial.<save_id>.smp-staging/
    -- every rank gets save_id (a collective) --
    every rank  write_partial_checkpoint(codec, path, N, ..., save_id=save_id) -> FileRecords
                  rank files; rank 0 also the shared files; all into the staging directory
    -- rank 0 gets every rank's records (a collective) --
    rank 0      commit_partial_checkpoint(path, N, save_id, records, keep, expected_rankinfos=[...])
                  checks every expected file, writes the manifest, swaps the staging directory in as
                  N_partial, rewrites newest (N last) atomically, then deletes the replaced N_partial
                  and the _partial dirs of tags beyond ``keep``

A process killed at any point before the swap leaves every committed checkpoint, N included when
it is saved again, exactly as it was, and ``newest`` unchanged. A kill during pruning leaves extra
old directories, never a missing one that ``newest`` names. A resume checks each file it reads
against the manifest, so a file that is not the one its save wrote is refused by name.

Example (one rank, with a plain-Python codec; ``smp.torch`` passes ``torch.save``/``torch.load``):
    >>> import os, tempfile
    >>> from smp.checkpoint.codec import PickleCodec
    >>> d = tempfile.mkdtemp()
    >>> sid = prepare_partial_checkpoint(d, "step_1")
    >>> rec = write_partial_checkpoint(PickleCodec(), d, "step_1", rank_info(0, 0), {"w": [1.0]}, {},
    ...                                {"epoch": 1}, {"microbatches": 2}, write_shared=True, save_id=sid)
    >>> commit_partial_checkpoint(d, "step_1", sid, rec, expected_rankinfos=["0_0"])
    ['step_1']
    >>> sorted(os.listdir(d))
    ['newest', 'step_1_partial']
    >>> read_partial_checkpoint(PickleCodec(), d, None, detect_rankinfo(d, None, 0, 0))["user_content"]
    {'epoch': 1}
"""

from __future__ import annotations

import logging
import os
import re
import shutil
from collections.abc import Mapping, Sequence
from typing import Any

from smp import __version__ as _smp_version
from smp.checkpoint.atomic import FileRecord, atomic_write_text, makedirs
from smp.checkpoint.codec import Codec, load_file
from smp.checkpoint.manifest import (
    MANIFEST,
    Manifest,
    clean_leftovers,
    commit_directory,
    committed_directory,
    new_save_id,
    read_manifest,
    staging_directory,
    write_manifest,
)
from smp.checkpoint.names import rank_info
from smp.errors import SMPCheckpointError

__all__ = [
    "NEWEST", "SMP_CONFIG", "USER_CONTENT", "check_tag", "commit_partial_checkpoint", "detect_rankinfo",
    "full_model_path", "full_user_content_path", "optimizer_shards", "partial_dir", "prepare_partial_checkpoint",
    "read_full_checkpoint", "read_newest", "read_optimizer_shards", "read_partial_checkpoint", "resolve_tag",
    "write_full_checkpoint",
    "write_partial_checkpoint",
]

logger = logging.getLogger("smp.checkpoint")

NEWEST = "newest"
USER_CONTENT = "user_content.pt"
SMP_CONFIG = "smp_config.pt"
_RANKINFO = re.compile(r"^\d+_\d+(_\d+)?$")


# ----------------------------------------------------------------------------------------------
# Names


def check_tag(tag: object) -> str:
    """Return ``tag`` if it can name a checkpoint (a non-empty str usable as one file name and as one
    line of ``newest``); else raise `SMPCheckpointError` naming it.

    Example:
        >>> check_tag("step_3")
        'step_3'
    """
    if not isinstance(tag, str):
        raise SMPCheckpointError(f"checkpoint tag={tag!r} is a {type(tag).__name__}; it must be a str. "
                                 f"Fix: e.g. tag=f'step_{{step}}'")
    bad = (not tag or tag in (".", "..", NEWEST) or tag != tag.strip() or "\n" in tag or "\r" in tag
           or "/" in tag or (os.sep != "/" and os.sep in tag) or tag.startswith("."))
    if bad:
        raise SMPCheckpointError(
            f"checkpoint tag={tag!r} cannot be used: a tag names files in the checkpoint directory and one "
            f"line of its 'newest' file, so it must be non-empty, not {NEWEST!r}, not start with '.', and "
            f"contain no path separator, newline or surrounding whitespace. Fix: e.g. tag=f'step_{{step}}'")
    return tag


def _check_rankinfo(rankinfo: str) -> str:
    if not isinstance(rankinfo, str) or not _RANKINFO.match(rankinfo):
        raise SMPCheckpointError(f"rankinfo={rankinfo!r}: must be '<pp>_<tp>' or '<pp>_<tp>_<rdp>' "
                                 f"(digits). Fix: build it with rank_info(pp_rank, tp_rank[, rdp_rank])")
    return rankinfo


def partial_dir(path: str | os.PathLike[str], tag: str) -> str:
    """``path/<tag>_partial``."""
    return os.path.join(os.fspath(path), f"{check_tag(tag)}_partial")


def full_model_path(path: str | os.PathLike[str], tag: str) -> str:
    """``path/<tag>``: the full model of a ``partial=False`` checkpoint."""
    return os.path.join(os.fspath(path), check_tag(tag))


def full_user_content_path(path: str | os.PathLike[str], tag: str) -> str:
    """``path/user_content_<tag>``: the user content of a ``partial=False`` checkpoint."""
    return os.path.join(os.fspath(path), f"user_content_{check_tag(tag)}")


# ----------------------------------------------------------------------------------------------
# newest


def read_newest(path: str | os.PathLike[str]) -> list[str]:
    """The tags listed in ``path/newest``, oldest first; [] when the file does not exist."""
    newest = os.path.join(os.fspath(path), NEWEST)
    try:
        with open(newest, encoding="utf-8") as f:
            return [line.strip() for line in f if line.strip()]
    except FileNotFoundError:
        return []


def _write_newest(path: str, tags: Sequence[str]) -> None:
    atomic_write_text("".join(f"{t}\n" for t in tags), os.path.join(path, NEWEST))


def resolve_tag(path: str | os.PathLike[str], tag: str | None) -> str:
    """The tag a resume reads: ``tag`` itself (checked), or with None the last line of ``newest``.

    Raises:
        SMPCheckpointError: ``tag`` is None and ``newest`` is missing or empty.
    """
    path = os.fspath(path)
    if tag is not None:
        return check_tag(tag)
    tags = read_newest(path)
    if not tags:
        newest = os.path.join(path, NEWEST)
        state = "is empty" if os.path.isfile(newest) else "does not exist"
        raise SMPCheckpointError(f"no checkpoint to resume in {path}: {newest} {state}. Fix: pass the "
                                 f"directory given to smp.save_checkpoint, or tag='<tag>' explicitly")
    return tags[-1]


def _resume_fix(path: str, tag: str | None = None) -> str:
    """The advice of a resume error: the other committed tags, or a fresh start."""
    others = [t for t in read_newest(path) if t != tag]
    if others:
        return (f"resume another checkpoint of {path} (listed in {NEWEST}: {others}) with "
                f"resume_from_checkpoint(path, tag=...), or restore the file from a copy")
    return f"restore the file from a copy, or start without resuming ({path} lists no other checkpoint)"


def _note_unlisted(path: str, tags: Sequence[str]) -> None:
    """Say what the ``_partial`` directories that ``newest`` does not list are (kept: they may be wanted)."""
    try:
        names = sorted(os.listdir(path))
    except FileNotFoundError:
        return
    for n in names:
        if not n.endswith("_partial") or n.startswith(".") or n[: -len("_partial")] in tags:
            continue
        d = os.path.join(path, n)
        if not os.path.isdir(d):
            continue
        if os.path.isfile(os.path.join(d, MANIFEST)):
            what = ("a complete save whose commit to newest did not finish; resume it with "
                    f"tag={n[: -len('_partial')]!r}")
        else:
            what = ("a save by an earlier smp (or SMP v1) that did not finish or was unlisted by hand; it is "
                    "not checked and may be incomplete")
        logger.warning("%s is not listed in %s: %s. Delete it if it is not needed", d, os.path.join(path, NEWEST), what)


# ----------------------------------------------------------------------------------------------
# Partial checkpoints: stage, write, commit (Note [checkpoint commit order])


def prepare_partial_checkpoint(path: str | os.PathLike[str], tag: str) -> str:
    """Phase 1 of a partial save (rank 0, before the other ranks write): stage a new save of ``tag``.

    Cleans up what interrupted saves left in ``path`` (staging directories, temp files; a
    ``<tag>_partial`` moved aside by an interrupted commit is put back), says what unlisted
    ``_partial`` directories are, and creates the staging directory of a new save id. Nothing that
    is committed is touched (Note [checkpoint commit order]), whether or not ``tag`` exists.

    Returns:
        The save id; every writing rank passes it to `write_partial_checkpoint`.
    """
    path = os.fspath(path)
    check_tag(tag)
    makedirs(path)
    clean_leftovers(path)
    _note_unlisted(path, read_newest(path) + [tag])
    save_id = new_save_id()
    makedirs(staging_directory(path, f"{tag}_partial", save_id))
    return save_id


def write_partial_checkpoint(
    codec: Codec,
    path: str | os.PathLike[str],
    tag: str,
    rankinfo: str,
    model_state: Any,
    optimizer_state: Any,
    user_content: Any,
    config: Mapping[str, Any] | None,
    write_shared: bool,
    *,
    save_id: str,
    fp16_states: Any = None,
    optimizer_rankinfo: str | None = None,
    smp_version: str | None = None,
) -> dict[str, FileRecord]:
    """Phase 2 of a partial save (every writing rank): this rank's files, and the shared ones on rank 0.

    Writes ``model_<rankinfo>.pt`` (unless ``model_state`` is None), ``optimizer_<rankinfo>.pt``
    (unless ``optimizer_state`` is None) and ``fp16_states_<rankinfo>.pt`` (when given). With
    ``write_shared`` it also writes ``user_content.pt`` and ``smp_config.pt``
    (``{**config, "smp_version": ...}``). Everything goes into the staging directory of
    ``save_id``; nothing is visible under ``<tag>_partial`` until `commit_partial_checkpoint`.
    Example: the module docstring.

    Args:
        codec: writes each file (``codec.save(obj, file_path)``).
        path: the checkpoint directory.
        tag: the checkpoint's tag (same on every rank).
        rankinfo: ``rank_info(pp_rank, tp_rank[, rdp_rank])``.
        model_state: this rank's local model state dict, or None to write no model file.
        optimizer_state: this rank's local optimizer state dict, or None.
        user_content: anything the codec can save; written only with ``write_shared``.
        config: the smp configuration as a dict; written only with ``write_shared``.
        write_shared: True on exactly one rank (rank 0).
        save_id: what `prepare_partial_checkpoint` returned on rank 0.
        fp16_states: FP16 master states of this rank, or None.
        optimizer_rankinfo: the optimizer file's rankinfo when it differs from the model's
            (sharded optimizer state: ``"<pp>_<tp>_<rdp>"`` next to ``"<pp>_<tp>"`` model files).
        smp_version: recorded in ``smp_config.pt``; defaults to ``smp.__version__``.

    Returns:
        File name -> `FileRecord` of what this rank wrote; rank 0 needs every rank's for the commit.
    """
    path = os.fspath(path)
    _check_rankinfo(rankinfo)
    opt_info = _check_rankinfo(optimizer_rankinfo) if optimizer_rankinfo is not None else rankinfo
    directory = staging_directory(path, f"{check_tag(tag)}_partial", save_id)
    if not os.path.isdir(directory):
        raise SMPCheckpointError(
            f"cannot write checkpoint {tag!r}: its staging directory {directory} does not exist on this rank. Fix: "
            f"rank 0 calls prepare_partial_checkpoint(path, tag) first and every rank passes the save_id it "
            f"returns; every rank must see {path} on one shared file system")
    files: dict[str, Any] = {}
    if model_state is not None:
        files[f"model_{rankinfo}.pt"] = model_state
    if optimizer_state is not None:
        files[f"optimizer_{opt_info}.pt"] = optimizer_state
    if fp16_states is not None:
        files[f"fp16_states_{rankinfo}.pt"] = fp16_states
    if write_shared:
        if config is not None and not isinstance(config, Mapping):
            raise SMPCheckpointError(f"config={type(config).__name__}: must be a dict of smp config keys. "
                                     f"Fix: pass the resolved configuration as a dict")
        cfg = dict(config or {})
        cfg["smp_version"] = smp_version if smp_version is not None else _smp_version
        files[USER_CONTENT] = user_content
        files[SMP_CONFIG] = cfg
    return {name: codec.save(obj, os.path.join(directory, name)) for name, obj in files.items()}


def commit_partial_checkpoint(
    path: str | os.PathLike[str],
    tag: str,
    save_id: str,
    records: Mapping[str, FileRecord],
    keep: int | None = None,
    *,
    expected_rankinfos: Sequence[str] | None = None,
) -> list[str]:
    """Phase 3 of a partial save (rank 0, after every rank wrote): make save ``save_id`` the checkpoint ``tag``.

    Checks that the shared files (and, when ``expected_rankinfos`` is given, ``model_<r>.pt`` for
    each) were written and are on disk as written, writes the manifest, swaps the staging directory
    in as ``<tag>_partial``, rewrites ``newest`` atomically with ``tag`` last, and only then deletes
    the replaced ``<tag>_partial`` and the ``_partial`` directories of the tags beyond the newest
    ``keep`` (``num_kept_partial_checkpoints``; None or <= 0 keeps all). A failure to delete an old
    directory is logged, not raised: the save itself succeeded.

    Args:
        records: every rank's `write_partial_checkpoint` result, merged.

    Returns:
        The tags now listed in ``newest``, oldest first.

    Raises:
        SMPCheckpointError: a file of the save is missing or differs from its record; nothing committed
            is changed (the staging directory is removed by the next save).
    """
    path = os.fspath(path)
    name = f"{check_tag(tag)}_partial"
    staging = staging_directory(path, name, save_id)
    expected = [USER_CONTENT, SMP_CONFIG] + [f"model_{_check_rankinfo(r)}.pt" for r in expected_rankinfos or ()]
    missing = [n for n in expected if n not in records or not os.path.isfile(os.path.join(staging, n))]
    wrong = [n for n, r in records.items()
             if n not in missing and (not os.path.isfile(os.path.join(staging, n))
                                      or os.path.getsize(os.path.join(staging, n)) != r.size)]
    if missing or wrong:
        raise SMPCheckpointError(
            f"checkpoint {tag!r} in {path} is incomplete, so nothing was committed ({NEWEST} still lists "
            f"{read_newest(path)}): missing {missing}, not as written {wrong} in {staging}. Fix: every rank calls "
            f"write_partial_checkpoint with the same save_id (rank 0 with write_shared=True) on a file system "
            f"every rank shares, before commit_partial_checkpoint")
    write_manifest(staging, Manifest(save_id=save_id, tag=tag, files=dict(records)))
    replaced = commit_directory(path, name, staging, save_id)
    tags = [t for t in read_newest(path) if t != tag] + [tag]
    pruned: list[str] = []
    if keep is not None and keep > 0 and len(tags) > keep:
        pruned, tags = tags[:-keep], tags[-keep:]
    _write_newest(path, tags)
    for old in ([replaced] if replaced else []) + [partial_dir(path, t) for t in pruned]:
        try:
            shutil.rmtree(old)
        except FileNotFoundError:
            pass
        except OSError as e:
            logger.warning("could not delete old partial checkpoint %s (num_kept_partial_checkpoints=%s): %s",
                           old, keep, e)
    return tags


# ----------------------------------------------------------------------------------------------
# Partial checkpoints: read back


def _committed(path: str, tag: str) -> str:
    """The directory of the committed checkpoint ``tag`` (see `committed_directory`)."""
    return committed_directory(path, f"{check_tag(tag)}_partial")


def _rankinfos_in(directory: str) -> list[str]:
    names = os.listdir(directory) if os.path.isdir(directory) else []
    return sorted(n[len("model_"):-len(".pt")] for n in names if n.startswith("model_") and n.endswith(".pt"))


def detect_rankinfo(path: str | os.PathLike[str], tag: str | None, pp_rank: int, tp_rank: int,
                    rdp_rank: int | None = None) -> str:
    """The rankinfo of this rank's model file in a saved checkpoint: ``pp_tp_rdp`` if that file exists,
    else ``pp_tp`` (``tag`` None reads ``newest``).

    Raises:
        SMPCheckpointError: neither exists; the message lists the rankinfos the checkpoint has.
    """
    path = os.fspath(path)
    directory = _committed(path, resolve_tag(path, tag))
    options = ([rank_info(pp_rank, tp_rank, rdp_rank)] if rdp_rank is not None else []) + [rank_info(pp_rank, tp_rank)]
    for r in options:
        if os.path.isfile(os.path.join(directory, f"model_{r}.pt")):
            return r
    raise SMPCheckpointError(
        f"{directory} has no model file for rankinfo {' or '.join(options)}; it has {_rankinfos_in(directory)}. "
        f"Fix: resume with the pipeline/tensor parallel degrees the checkpoint was saved with, or save a full "
        f"checkpoint (partial=False) to change the layout")


def optimizer_shards(path: str | os.PathLike[str], tag: str | None, pp_rank: int, tp_rank: int) -> list[str]:
    """The rankinfos ``pp_tp_rdp`` of the sharded optimizer files (``shard_optimizer_state``) saved for
    (``pp_rank``, ``tp_rank``), by rdp rank; empty when that part's optimizer state was saved whole."""
    path = os.fspath(path)
    directory = _committed(path, resolve_tag(path, tag))
    pattern = re.compile(rf"optimizer_{pp_rank}_{tp_rank}_(\d+)\.pt")
    found = [m for m in map(pattern.fullmatch, os.listdir(directory) if os.path.isdir(directory) else []) if m]
    return [rank_info(pp_rank, tp_rank, int(m.group(1))) for m in sorted(found, key=lambda m: int(m.group(1)))]


def read_optimizer_shards(codec: Codec, path: str | os.PathLike[str], tag: str | None, rankinfos: Sequence[str],
                          **load_kwargs: Any) -> list[Any]:
    """The optimizer files of ``rankinfos`` (from `optimizer_shards`), each checked against the manifest."""
    path = os.fspath(path)
    tag = resolve_tag(path, tag)
    directory = _committed(path, tag)
    manifest = read_manifest(directory)
    fix = _resume_fix(path, tag)
    return [load_file(codec, os.path.join(directory, f"optimizer_{_check_rankinfo(r)}.pt"),
                      f"optimizer state shard {r} of checkpoint {tag!r}", fix, manifest, **load_kwargs)
            for r in rankinfos]


def read_partial_checkpoint(
    codec: Codec,
    path: str | os.PathLike[str],
    tag: str | None,
    rankinfo: str,
    *,
    optimizer_rankinfo: str | None = None,
    load_optimizer: bool = True,
    **load_kwargs: Any,
) -> dict[str, Any]:
    """Read one rank's part of a ``save_checkpoint`` checkpoint, each file checked against the manifest.

    Args:
        codec: reads each file (``codec.load(file_path, **load_kwargs)``).
        path: the checkpoint directory.
        tag: the tag to read; None reads the last line of ``newest`` (the newest complete save).
        rankinfo: this rank's ``rank_info(...)`` (see `detect_rankinfo`).
        optimizer_rankinfo: the optimizer file's rankinfo when it differs from ``rankinfo``.
        load_optimizer: False skips the optimizer file (``"optimizer"`` is then None).
        **load_kwargs: passed to ``codec.load`` (torch: ``map_location``, ``weights_only``).

    Returns:
        ``{"tag", "save_id", "model", "optimizer", "fp16_states", "user_content", "config"}``;
        ``save_id`` is None for a checkpoint without a manifest (earlier smp, SMP v1), ``fp16_states``
        None when none was saved, ``config`` the saved config dict with ``smp_version``.

    Raises:
        SMPCheckpointError: ``newest`` or a needed file is missing, or a file is damaged or not from
            the save that wrote the others; the message names the file and what to do.
    """
    path = os.fspath(path)
    tag = resolve_tag(path, tag)
    directory = _committed(path, tag)
    if not os.path.isdir(directory):
        raise SMPCheckpointError(f"checkpoint {tag!r} not found: {directory} does not exist (tags listed in "
                                 f"{os.path.join(path, NEWEST)}: {read_newest(path)})")
    _check_rankinfo(rankinfo)
    opt_info = _check_rankinfo(optimizer_rankinfo) if optimizer_rankinfo is not None else rankinfo
    model_file = os.path.join(directory, f"model_{rankinfo}.pt")
    if not os.path.isfile(model_file):
        raise SMPCheckpointError(
            f"checkpoint {tag!r} has no {model_file}; it has model files for rankinfos "
            f"{_rankinfos_in(directory)}. Fix: a partial checkpoint loads only with the partitioning it was "
            f"saved with (same pipeline/tensor parallel degrees); to change the layout save a full checkpoint")
    manifest = read_manifest(directory)
    fix = _resume_fix(path, tag)

    def load(file: str, what: str) -> Any:
        return load_file(codec, file, f"{what} of checkpoint {tag!r}", fix, manifest, **load_kwargs)

    optimizer = None
    if load_optimizer:
        opt_file = os.path.join(directory, f"optimizer_{opt_info}.pt")
        if not os.path.isfile(opt_file):
            raise SMPCheckpointError(f"checkpoint {tag!r} has no {opt_file}. Fix: resume with "
                                     f"load_optimizer=False if it was saved without an optimizer")
        optimizer = load(opt_file, "optimizer state")
    fp16_file = os.path.join(directory, f"fp16_states_{rankinfo}.pt")
    return {
        "tag": tag,
        "save_id": manifest.save_id if manifest is not None else None,
        "config": load(os.path.join(directory, SMP_CONFIG), "smp config"),
        "model": load(model_file, "model state"),
        "optimizer": optimizer,
        "fp16_states": load(fp16_file, "fp16 states") if os.path.isfile(fp16_file) else None,
        "user_content": load(os.path.join(directory, USER_CONTENT), "user content"),
    }


# ----------------------------------------------------------------------------------------------
# Full checkpoints


def write_full_checkpoint(codec: Codec, path: str | os.PathLike[str], tag: str, model_state: Any,
                          user_content: Any = None) -> None:
    """Write a ``partial=False`` checkpoint (rank 0 only): ``path/<tag>`` and ``path/user_content_<tag>``.

    Full checkpoints hold the model only (SMP v1 skips the optimizer) and do not appear in
    ``newest``. The user content file is written only when ``user_content`` is not None.
    """
    path = os.fspath(path)
    makedirs(path)
    if user_content is not None:
        codec.save(user_content, full_user_content_path(path, tag))
    codec.save(model_state, full_model_path(path, tag))


def read_full_checkpoint(codec: Codec, path: str | os.PathLike[str], tag: str, **load_kwargs: Any) -> dict[str, Any]:
    """Read a ``partial=False`` checkpoint: ``{"tag", "model", "user_content"}`` (None when not saved).

    ``load_kwargs`` go to ``codec.load``.

    Raises:
        SMPCheckpointError: ``path/<tag>`` does not exist or cannot be read; the message names the file.
    """
    path = os.fspath(path)
    model_file = full_model_path(path, tag)
    if not os.path.isfile(model_file):
        hint = (f"; {partial_dir(path, tag)} exists, so resume it with partial=True"
                if os.path.isdir(partial_dir(path, tag)) else "")
        raise SMPCheckpointError(f"full checkpoint {tag!r} not found: {model_file} does not exist{hint}")
    uc_file = full_user_content_path(path, tag)
    fix = f"save the full checkpoint {tag!r} again (smp.save_checkpoint(..., partial=False)), or resume another one"
    return {
        "tag": tag,
        "model": load_file(codec, model_file, f"full model of checkpoint {tag!r}", fix, **load_kwargs),
        "user_content": (load_file(codec, uc_file, f"user content of checkpoint {tag!r}", fix, **load_kwargs)
                         if os.path.isfile(uc_file) else None),
    }
