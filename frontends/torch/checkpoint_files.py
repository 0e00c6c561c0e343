"""The file layer of SMP v1 checkpoints: atomic writes, partial-file names, the save_checkpoint layout.

Pure file and format logic; `smp.save` / `smp.load` / `smp.save_checkpoint` /
`smp.resume_from_checkpoint` decide which ranks call what (reference sections 3.12 and 11.2) and
call this module. Nothing here communicates.

``smp.save(obj, f, partial=True)`` names (`partial_name`, `find_partial`)::

    f"{f}_{pp_rank}_{tp_rank}.pt"               SMP >= 1.6
    f"{f}_{pp_rank}_{tp_rank}_{rdp_rank}.pt"    v3=True (sharded optimizer state)
    f"{f}_{mp_rank}"                            before 1.6 (no TP, so mp_rank == pp_rank)
    f"{f}_{pp_rank}_{tp_rank}"                  before 1.10, read with back_compat=True

``save_checkpoint(path, tag)`` layout::

    path/
      newest                       the partial tags, oldest first, one per line
      <tag>_partial/
        model_<rankinfo>.pt        one per (pp, tp) -- rankinfo "0_1" -- or (pp, tp, rdp): "0_1_2"
        optimizer_<rankinfo>.pt
        fp16_states_<rankinfo>.pt  when fp16 master states are given
        user_content.pt            written once (rank 0)
        smp_config.pt              the config dict plus "smp_version", written once (rank 0)
      <tag>                        full model (partial=False)
      user_content_<tag>           full user content (partial=False)

Note [checkpoint commit order]: every file is written by `atomic_save` (temp file in the same
directory, flush, fsync, ``os.replace``, fsync of the directory), so a file name either holds a
complete old version or a complete new one. A partial save of tag N goes in three phases::

    rank 0      prepare_partial_checkpoint(path, N)      mkdir; if N is listed in newest, unlist it
    -- barrier --
    every rank  write_partial_checkpoint(path, N, ...)   rank files; rank 0 also the shared files
    -- barrier --
    rank 0      update_newest(path, N, keep, expected_rankinfos=[...])
                  checks that every expected file of N exists, rewrites newest (N appended)
                  atomically, and only then deletes the _partial dirs of tags beyond ``keep``

``newest`` changes only in the last phase, after every file of N is durable, so a process killed at
any earlier point leaves ``newest`` naming N-1, whose files were not touched. A kill during
pruning leaves extra old directories, never a missing one that ``newest`` names. Re-saving a tag
that already exists unlists it first, so its files are never half-rewritten while listed.
"""

from __future__ import annotations

import contextlib
import logging
import os
import re
import secrets
import shutil
from collections.abc import Callable, Mapping, Sequence
from typing import IO, Any

import torch

from smp import __version__ as _smp_version
from smp.errors import SMPCheckpointError

__all__ = [
    "NEWEST", "atomic_save", "atomic_write_text", "check_tag", "detect_rankinfo", "find_partial", "full_model_path",
    "full_user_content_path", "partial_candidates", "partial_dir", "partial_name",
    "prepare_partial_checkpoint", "rank_info", "read_full_checkpoint", "read_newest",
    "read_partial_checkpoint", "update_newest", "write_full_checkpoint", "write_partial_checkpoint",
]

logger = logging.getLogger("smp.checkpoint")

NEWEST = "newest"
TEMP_SUFFIX = ".smp-tmp"
USER_CONTENT = "user_content.pt"
SMP_CONFIG = "smp_config.pt"
_RANKINFO = re.compile(r"^\d+_\d+(_\d+)?$")


# ----------------------------------------------------------------------------------------------
# Atomic writes


def _fsync_dir(dirpath: str) -> None:
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


def _atomic_write(path: str | os.PathLike[str], write: Callable[[IO[bytes]], None]) -> None:
    path = os.fspath(path)
    directory = os.path.dirname(os.path.abspath(path))
    # Same directory, so os.replace is a rename within one file system; the name is cut so that a long
    # file name still leaves room for the suffix.
    tmp = os.path.join(directory, f".{os.path.basename(path)[:120]}.{os.getpid()}.{secrets.token_hex(4)}{TEMP_SUFFIX}")
    # os.open with mode 0o666 gives the permissions a plain open() would (umask applies).
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL | getattr(os, "O_BINARY", 0), 0o666)
    try:
        with os.fdopen(fd, "wb") as f:
            write(f)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        with contextlib.suppress(OSError):
            os.unlink(tmp)
        raise
    _fsync_dir(directory)


def atomic_save(obj: Any, path: str | os.PathLike[str], **torch_save_kwargs: Any) -> None:
    """``torch.save(obj, path)`` that never leaves ``path`` half-written.

    Writes a temp file in the same directory, flushes and fsyncs it, renames it over ``path``
    (``os.replace``, atomic on POSIX and Windows) and fsyncs the directory. An exception or a killed
    process at any point leaves the previous file at ``path`` intact (a kill may leave a
    ``.<name>.<pid>.<hex>.smp-tmp`` file behind; `prepare_partial_checkpoint` removes those).

    Args:
        obj: anything ``torch.save`` accepts.
        path: the destination; its directory must exist.
        **torch_save_kwargs: passed to ``torch.save`` (``pickle_module``, ``pickle_protocol``).

    Example:
        >>> import tempfile
        >>> p = os.path.join(tempfile.mkdtemp(), "model.pt")
        >>> atomic_save({"w": torch.ones(2)}, p)
        >>> torch.load(p)["w"].tolist()
        [1.0, 1.0]
    """
    _atomic_write(path, lambda f: torch.save(obj, f, **torch_save_kwargs))


def atomic_write_text(text: str, path: str | os.PathLike[str]) -> None:
    """Write ``text`` (UTF-8) to ``path`` with the same guarantee as `atomic_save`.

    Example:
        >>> import tempfile
        >>> p = os.path.join(tempfile.mkdtemp(), "newest")
        >>> atomic_write_text("step_1\\n", p)
        >>> open(p).read()
        'step_1\\n'
    """
    data = text.encode("utf-8")

    def write(f: IO[bytes]) -> None:
        f.write(data)

    _atomic_write(path, write)


def _load(path: str, what: str, map_location: Any, weights_only: bool) -> Any:
    if not os.path.isfile(path):
        raise SMPCheckpointError(f"cannot read the {what}: {path} does not exist")
    return torch.load(path, map_location=map_location, weights_only=weights_only)


# ----------------------------------------------------------------------------------------------
# smp.save / smp.load names


def partial_name(f: str, pp_rank: int, tp_rank: int, rdp_rank: int | None = None) -> str:
    """The file ``smp.save(obj, f, partial=True)`` writes on a rank (``v3`` when ``rdp_rank`` is given).

    Example:
        >>> partial_name("ckpt/model", 1, 0), partial_name("ckpt/model", 1, 0, 3)
        ('ckpt/model_1_0.pt', 'ckpt/model_1_0_3.pt')
    """
    if rdp_rank is None:
        return f"{f}_{pp_rank}_{tp_rank}.pt"
    return f"{f}_{pp_rank}_{tp_rank}_{rdp_rank}.pt"


def partial_candidates(f: str, pp_rank: int, tp_rank: int, rdp_rank: int | None = None, *,
                       mp_rank: int | None = None, back_compat: bool = False) -> list[str]:
    """The names `find_partial` tries, in order.

    Current names first: 3-part (when ``rdp_rank`` is given), 2-part, then the pre-1.6 1-part
    ``f"{f}_{mp_rank}"``. Those older jobs had no tensor parallelism, so ``mp_rank`` defaults to
    ``pp_rank`` when ``tp_rank == 0``; with ``tp_rank > 0`` the 1-part name is tried only for an
    explicit ``mp_rank``.

    ``back_compat=True`` reads files saved before SMP 1.10, which appended the rank suffix without
    adding ``.pt`` (users passed ``f="name.pt"`` and got ``name.pt_<pp>_<tp>``): those names are
    tried first, then the current ones.

    Example:
        >>> partial_candidates("m", 1, 0, 2)
        ['m_1_0_2.pt', 'm_1_0.pt', 'm_1']
        >>> partial_candidates("m.pt", 1, 0, back_compat=True)
        ['m.pt_1_0', 'm.pt_1', 'm.pt_1_0.pt']
    """
    if mp_rank is None and tp_rank == 0:
        mp_rank = pp_rank
    one_part = [f"{f}_{mp_rank}"] if mp_rank is not None else []
    current = ([partial_name(f, pp_rank, tp_rank, rdp_rank)] if rdp_rank is not None else [])
    current.append(partial_name(f, pp_rank, tp_rank))
    if not back_compat:
        return current + one_part
    legacy = ([f"{f}_{pp_rank}_{tp_rank}_{rdp_rank}"] if rdp_rank is not None else [])
    legacy.append(f"{f}_{pp_rank}_{tp_rank}")
    names = legacy + one_part + current
    return list(dict.fromkeys(names))


def find_partial(f: str, pp_rank: int, tp_rank: int, rdp_rank: int | None = None, *,
                 mp_rank: int | None = None, back_compat: bool = False) -> str:
    """The partial file of this rank that exists on disk (``smp.load(f, partial=True)``).

    Tries `partial_candidates` in order and returns the first that is a file.

    Raises:
        SMPCheckpointError: none exists; the message lists every name looked for.

    Example:
        >>> import tempfile
        >>> f = os.path.join(tempfile.mkdtemp(), "model")
        >>> atomic_save({}, partial_name(f, 0, 1))
        >>> find_partial(f, 0, 1, rdp_rank=2) == partial_name(f, 0, 1)
        True
    """
    candidates = partial_candidates(f, pp_rank, tp_rank, rdp_rank, mp_rank=mp_rank, back_compat=back_compat)
    for name in candidates:
        if os.path.isfile(name):
            return name
    hint = "" if back_compat else "; files saved before SMP 1.10 need back_compat=True"
    raise SMPCheckpointError(
        f"no partial checkpoint for pp_rank={pp_rank}, tp_rank={tp_rank}, rdp_rank={rdp_rank} from f={f!r}: "
        f"looked for {candidates}. Fix: pass the same f as smp.save(..., partial=True) and load with the same "
        f"pipeline/tensor parallel degrees{hint}")


# ----------------------------------------------------------------------------------------------
# save_checkpoint layout


def rank_info(pp_rank: int, tp_rank: int, rdp_rank: int | None = None) -> str:
    """The ``<rankinfo>`` of file names in a ``_partial`` directory.

    Example:
        >>> rank_info(1, 0), rank_info(1, 0, 2)
        ('1_0', '1_0_2')
    """
    return f"{pp_rank}_{tp_rank}" if rdp_rank is None else f"{pp_rank}_{tp_rank}_{rdp_rank}"


def check_tag(tag: object) -> str:
    """Return ``tag`` if it can name a checkpoint (a non-empty str usable as one file name and as one
    line of ``newest``); else raise `SMPCheckpointError` naming it."""
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


def _makedirs(directory: str) -> None:
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
        _fsync_dir(os.path.dirname(d))


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


def prepare_partial_checkpoint(path: str | os.PathLike[str], tag: str) -> str:
    """Phase 1 of a partial save (rank 0, before a barrier): create ``path/<tag>_partial``.

    If ``tag`` is already listed in ``newest`` (the same tag saved again), it is unlisted first, so
    that its files can be rewritten without ``newest`` naming a half-rewritten checkpoint (see Note
    [checkpoint commit order]). Temp files left in the directory by a killed save are removed.

    Returns:
        The ``_partial`` directory.
    """
    path = os.fspath(path)
    directory = partial_dir(path, tag)
    _makedirs(directory)
    tags = read_newest(path)
    if tag in tags:
        logger.info("checkpoint tag %r exists in %s; unlisting it from %s while it is rewritten",
                    tag, path, NEWEST)
        _write_newest(path, [t for t in tags if t != tag])
    for name in os.listdir(directory):
        if name.startswith(".") and name.endswith(TEMP_SUFFIX):
            with contextlib.suppress(OSError):
                os.unlink(os.path.join(directory, name))
    return directory


def write_partial_checkpoint(
    path: str | os.PathLike[str],
    tag: str,
    rankinfo: str,
    model_state: Any,
    optimizer_state: Any,
    user_content: Any,
    config: Mapping[str, Any] | None,
    write_shared: bool,
    *,
    fp16_states: Any = None,
    optimizer_rankinfo: str | None = None,
    smp_version: str | None = None,
) -> str:
    """Phase 2 of a partial save (every writing rank): this rank's files, and the shared ones on rank 0.

    Writes ``model_<rankinfo>.pt`` (unless ``model_state`` is None), ``optimizer_<rankinfo>.pt``
    (unless ``optimizer_state`` is None) and ``fp16_states_<rankinfo>.pt`` (when given). With
    ``write_shared`` it also writes ``user_content.pt`` and ``smp_config.pt``
    (``{**config, "smp_version": ...}``). Does not touch ``newest``: call `update_newest` after every
    rank has written (Note [checkpoint commit order]).

    Args:
        path: the checkpoint directory.
        tag: the checkpoint's tag (same on every rank).
        rankinfo: ``rank_info(pp_rank, tp_rank[, rdp_rank])``.
        model_state: this rank's local model state dict, or None to write no model file.
        optimizer_state: this rank's local optimizer state dict, or None.
        user_content: anything picklable; written only with ``write_shared``.
        config: the smp configuration as a dict; written only with ``write_shared``.
        write_shared: True on exactly one rank (rank 0).
        fp16_states: FP16 master states of this rank, or None.
        optimizer_rankinfo: the optimizer file's rankinfo when it differs from the model's
            (sharded optimizer state: ``"<pp>_<tp>_<rdp>"`` next to ``"<pp>_<tp>"`` model files).
        smp_version: recorded in ``smp_config.pt``; defaults to ``smp.__version__``.

    Returns:
        The ``_partial`` directory.

    Example:
        >>> import tempfile
        >>> d = tempfile.mkdtemp()
        >>> _ = prepare_partial_checkpoint(d, "step_1")
        >>> _ = write_partial_checkpoint(d, "step_1", rank_info(0, 0), {"w": torch.ones(1)}, {},
        ...                              {"epoch": 1}, {"microbatches": 2}, write_shared=True)
        >>> update_newest(d, "step_1", keep=None, expected_rankinfos=["0_0"])
        ['step_1']
        >>> read_partial_checkpoint(d, None, "0_0")["user_content"]
        {'epoch': 1}
    """
    directory = partial_dir(path, tag)
    _check_rankinfo(rankinfo)
    opt_info = _check_rankinfo(optimizer_rankinfo) if optimizer_rankinfo is not None else rankinfo
    _makedirs(directory)
    if model_state is not None:
        atomic_save(model_state, os.path.join(directory, f"model_{rankinfo}.pt"))
    if optimizer_state is not None:
        atomic_save(optimizer_state, os.path.join(directory, f"optimizer_{opt_info}.pt"))
    if fp16_states is not None:
        atomic_save(fp16_states, os.path.join(directory, f"fp16_states_{rankinfo}.pt"))
    if write_shared:
        if config is not None and not isinstance(config, Mapping):
            raise SMPCheckpointError(f"config={type(config).__name__}: must be a dict of smp config keys. "
                                     f"Fix: pass the resolved configuration as a dict")
        cfg = dict(config or {})
        cfg["smp_version"] = smp_version if smp_version is not None else _smp_version
        atomic_save(user_content, os.path.join(directory, USER_CONTENT))
        atomic_save(cfg, os.path.join(directory, SMP_CONFIG))
    return directory


def update_newest(
    path: str | os.PathLike[str],
    tag: str,
    keep: int | None = None,
    *,
    expected_rankinfos: Sequence[str] | None = None,
) -> list[str]:
    """Phase 3 of a partial save (rank 0, after every rank wrote): commit ``tag`` in ``newest``.

    Checks that the shared files (and, when ``expected_rankinfos`` is given, ``model_<r>.pt`` for
    each) exist, then rewrites ``newest`` atomically with ``tag`` last, and only then deletes the
    ``_partial`` directories of the tags beyond the newest ``keep`` (``num_kept_partial_checkpoints``;
    None or <= 0 keeps all). A failure to delete an old directory is logged, not raised: the save
    itself succeeded.

    Returns:
        The tags now listed in ``newest``, oldest first.

    Raises:
        SMPCheckpointError: a file of ``tag`` is missing; ``newest`` is left unchanged.
    """
    path = os.fspath(path)
    directory = partial_dir(path, tag)
    expected = [os.path.join(directory, USER_CONTENT), os.path.join(directory, SMP_CONFIG)]
    expected += [os.path.join(directory, f"model_{_check_rankinfo(r)}.pt") for r in expected_rankinfos or ()]
    missing = [p for p in expected if not os.path.isfile(p)]
    if missing:
        raise SMPCheckpointError(
            f"checkpoint {tag!r} in {path} is incomplete, so {NEWEST} still names the previous one: missing "
            f"{missing}. Fix: make sure every rank called write_partial_checkpoint (rank 0 with "
            f"write_shared=True) and returned before update_newest")
    tags = [t for t in read_newest(path) if t != tag] + [tag]
    pruned: list[str] = []
    if keep is not None and keep > 0 and len(tags) > keep:
        pruned, tags = tags[:-keep], tags[-keep:]
    _write_newest(path, tags)
    for old in pruned:
        old_dir = partial_dir(path, old)
        try:
            shutil.rmtree(old_dir)
        except FileNotFoundError:
            pass
        except OSError as e:
            logger.warning("could not delete old partial checkpoint %s (num_kept_partial_checkpoints=%s): %s",
                           old_dir, keep, e)
    return tags


def _resolve_tag(path: str, tag: str | None) -> str:
    if tag is not None:
        return check_tag(tag)
    tags = read_newest(path)
    if not tags:
        newest = os.path.join(path, NEWEST)
        state = "is empty" if os.path.isfile(newest) else "does not exist"
        raise SMPCheckpointError(f"no checkpoint to resume in {path}: {newest} {state}. Fix: pass the "
                                 f"directory given to smp.save_checkpoint, or tag='<tag>' explicitly")
    return tags[-1]


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
    directory = partial_dir(path, _resolve_tag(path, tag))
    options = ([rank_info(pp_rank, tp_rank, rdp_rank)] if rdp_rank is not None else []) + [rank_info(pp_rank, tp_rank)]
    for r in options:
        if os.path.isfile(os.path.join(directory, f"model_{r}.pt")):
            return r
    raise SMPCheckpointError(
        f"{directory} has no model file for rankinfo {' or '.join(options)}; it has {_rankinfos_in(directory)}. "
        f"Fix: resume with the pipeline/tensor parallel degrees the checkpoint was saved with, or save a full "
        f"checkpoint (partial=False) to change the layout")


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
    """Read one rank's part of a ``save_checkpoint`` checkpoint.

    Args:
        path: the checkpoint directory.
        tag: the tag to read; None reads the last line of ``newest`` (the newest complete save).
        rankinfo: this rank's ``rank_info(...)`` (see `detect_rankinfo`).
        optimizer_rankinfo: the optimizer file's rankinfo when it differs from ``rankinfo``.
        load_optimizer: False skips the optimizer file (``"optimizer"`` is then None).
        map_location: passed to ``torch.load``; tensors land on the CPU by default.
        weights_only: passed to ``torch.load``. False (the default) unpickles arbitrary objects
            (user content, optimizer extras): only read checkpoints you trust.

    Returns:
        ``{"tag", "model", "optimizer", "fp16_states", "user_content", "config"}``; ``fp16_states``
        is None when none was saved, ``config`` is the saved config dict with ``smp_version``.

    Raises:
        SMPCheckpointError: ``newest`` or a needed file is missing; the message names it.
    """
    path = os.fspath(path)
    tag = _resolve_tag(path, tag)
    directory = partial_dir(path, tag)
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
    optimizer = None
    if load_optimizer:
        opt_file = os.path.join(directory, f"optimizer_{opt_info}.pt")
        if not os.path.isfile(opt_file):
            raise SMPCheckpointError(f"checkpoint {tag!r} has no {opt_file}. Fix: resume with "
                                     f"load_optimizer=False if it was saved without an optimizer")
        optimizer = _load(opt_file, "optimizer state", map_location, weights_only)
    fp16_file = os.path.join(directory, f"fp16_states_{rankinfo}.pt")
    return {
        "tag": tag,
        "model": _load(model_file, "model state", map_location, weights_only),
        "optimizer": optimizer,
        "fp16_states": (_load(fp16_file, "fp16 states", map_location, weights_only)
                        if os.path.isfile(fp16_file) else None),
        "user_content": _load(os.path.join(directory, USER_CONTENT), "user content", map_location, weights_only),
        "config": _load(os.path.join(directory, SMP_CONFIG), "smp config", map_location, weights_only),
    }


def write_full_checkpoint(path: str | os.PathLike[str], tag: str, model_state: Any,
                          user_content: Any = None) -> None:
    """Write a ``partial=False`` checkpoint (rank 0 only): ``path/<tag>`` and ``path/user_content_<tag>``.

    Full checkpoints hold the model only (SMP v1 skips the optimizer) and do not appear in
    ``newest``. The user content file is written only when ``user_content`` is not None.
    """
    path = os.fspath(path)
    _makedirs(path)
    if user_content is not None:
        atomic_save(user_content, full_user_content_path(path, tag))
    atomic_save(model_state, full_model_path(path, tag))


def read_full_checkpoint(path: str | os.PathLike[str], tag: str, *, map_location: Any = "cpu",
                         weights_only: bool = False) -> dict[str, Any]:
    """Read a ``partial=False`` checkpoint: ``{"tag", "model", "user_content"}`` (None when not saved).

    Raises:
        SMPCheckpointError: ``path/<tag>`` does not exist.
    """
    path = os.fspath(path)
    model_file = full_model_path(path, tag)
    if not os.path.isfile(model_file):
        hint = (f"; {partial_dir(path, tag)} exists, so resume it with partial=True"
                if os.path.isdir(partial_dir(path, tag)) else "")
        raise SMPCheckpointError(f"full checkpoint {tag!r} not found: {model_file} does not exist{hint}")
    uc_file = full_user_content_path(path, tag)
    return {
        "tag": tag,
        "model": _load(model_file, "full model", map_location, weights_only),
        "user_content": (_load(uc_file, "user content", map_location, weights_only)
                         if os.path.isfile(uc_file) else None),
    }
