"""SMP v1 checkpoint API: ``smp.save``/``smp.load`` and ``smp.save_checkpoint``/``smp.resume_from_checkpoint``.

The file layout and the crash-safe write order live in smp/checkpoint/layout.py (Note [checkpoint
commit order]); this module decides which rank writes what. ``save_checkpoint`` is a collective
over the world in three phases (rank 0 stages a new save id, every rank with ``rdp_rank() == 0``
writes its model and optimizer part, rank 0 checks and commits), and ``resume_from_checkpoint``
reads on every rank. After each phase the ranks agree on the outcome (`_agree`): if one rank
cannot write or read a file, every rank raises an `SMPCheckpointError` that names that rank and
the file, at once, instead of waiting in the next collective.
"""

from __future__ import annotations

import os
import pickle
from collections.abc import Callable
from typing import Any

import smp
import smp.state as smp_state
from smp.checkpoint.names import find_partial, partial_name, rank_info
from smp.errors import SMPCheckpointError

from ..optimizer_shard import merge_shards
from ..runtime.comm import WORLD, allgather, pp_rank, rank, rdp_rank, rdp_size, tp_rank
from ..runtime.process_state import torch_state
from . import files


def take_pending(key: str, default: Any = None) -> Any:
    """Take what ``resume_from_checkpoint`` read for ``key`` before its owner existed (None: nothing).

    Keys: ``"partition"`` (module path -> pp_rank) and ``"model"`` (state dict, strict) for the
    `DistributedModel`, ``"optimizer"`` (state dict) for the `DistributedOptimizer`. Taking removes
    it; it lives in `TorchState`, so ``smp.reset()`` drops what nobody took.
    """
    return torch_state().pending.pop(key, default)


# Key of the partition decision (module path -> pp_rank) inside a partial checkpoint's smp_config.pt.
PARTITION_KEY = "_smp_partition"


def _agree(what: str, run: bool, fn: Callable[[], Any],
           share: Callable[[Any], Any] = lambda value: None) -> tuple[Any, list[Any]]:
    """Run ``fn`` here (if ``run``), then agree over the world on whether every rank succeeded.

    Returns ``(fn's value, [share(value) of each rank, by rank])``. If any rank failed, every rank
    raises: the failing rank its own error, the others an `SMPCheckpointError` naming the failing
    ranks and their errors, so nobody waits for a rank that has given up.
    """
    value, error = None, None
    if run:
        try:
            value = fn()
        except Exception as e:  # noqa: BLE001 - handed to every rank below
            error = e
    try:
        outcomes = allgather((f"{type(error).__name__}: {error}" if error is not None else None,
                              share(value) if error is None and run else None), WORLD)
    except Exception:
        if error is not None:
            raise error from None  # this rank's own failure says more than the peers' absence
        raise
    if error is not None:
        raise error
    failed = [(r, msg) for r, (msg, _) in enumerate(outcomes) if msg is not None]
    if failed:
        detail = "".join(f"\n  rank {r}: {msg}" for r, msg in failed)
        raise SMPCheckpointError(f"{what} failed on rank(s) {[r for r, _ in failed]}:{detail}")
    return value, [shared for _, shared in outcomes]


def _shard_of(optimizer: Any) -> Any:
    """The optimizer's `OptimizerShard` (``shard_optimizer_state``, after partitioning), or None."""
    get = getattr(optimizer, "state_shard", None)
    return get() if callable(get) else None


def _sharded_now(st: Any) -> bool:
    return bool(st.cfg is not None and st.cfg.shard_optimizer_state and rdp_size() > 1)


def _note_save_state(e: BaseException, path: str, tag: str) -> None:
    """Add to a failing save's error what ``newest`` lists now (read from disk, so it is the truth)."""
    try:
        listed = files.read_newest(path)
    except OSError:
        return
    e.add_note(f"smp.save_checkpoint({path!r}, tag={tag!r}) did not finish on rank {rank()}; {path}/"
               f"{files.NEWEST} lists {listed}, and a save that fails never modifies a committed checkpoint")


def save(obj: Any, f: str, partial: bool = True, pickle_module: Any = pickle, pickle_protocol: int = 2,
         v3: bool = False, **kwargs: Any) -> None:
    """``torch.save`` for smp: ``partial=True`` writes ``f"{f}_{pp}_{tp}.pt"`` (``_{rdp}`` with v3) on each
    calling rank; ``partial=False`` writes ``f`` on rank 0 only. Writes are atomic; a missing parent
    folder is created."""
    name = partial_name(f, pp_rank(), tp_rank(), rdp_rank() if v3 else None) if partial else f
    if partial or rank() == 0:
        os.makedirs(os.path.dirname(os.path.abspath(name)), exist_ok=True)
        files.atomic_save(obj, name, pickle_module=pickle_module, pickle_protocol=pickle_protocol)


def load(f: str, map_location: Any = None, pickle_module: Any = None, partial: bool = True,
         back_compat: bool = False, **pickle_load_args: Any) -> Any:
    """Load what `save` wrote; with ``partial=True`` this rank's file (3-, 2- or 1-part name).

    Not a collective (a rank may load alone): a file that cannot be read raises an
    `SMPCheckpointError` naming it on this rank, and the other ranks learn of it through the failure
    protocol when they next wait on this one.
    """
    path = find_partial(f, pp_rank(), tp_rank(), rdp_rank(), back_compat=back_compat) if partial else f
    extra = {"pickle_module": pickle_module} if pickle_module is not None else {}
    fix = (f"save it again (smp.save(obj, {f!r}, partial={partial}) on the same ranks), or load another file"
           + ("" if partial else "; a file written with partial=True loads with partial=True"))
    return files.load_file(path, f"file of smp.load({f!r}) on pp_rank {pp_rank()}, tp_rank {tp_rank()}", fix,
                           map_location=map_location or "cpu", weights_only=False, **extra, **pickle_load_args)


def save_checkpoint(path: str, tag: str, partial: bool = True, model: Any = None, optimizer: Any = None,
                    user_content: Any = None, translate_if_full: bool = True,
                    num_kept_partial_checkpoints: int | None = None) -> None:
    """Save model, optimizer and user content under ``path/<tag>_partial`` (or a full model file).

    Call it on every rank with the same ``tag``. Saving a tag that exists replaces it only once the
    new save is complete; a save that fails on any rank leaves every committed checkpoint as it was
    and raises on every rank.
    """
    tag = files.check_tag(tag)
    tags = allgather(tag, WORLD)
    if len(set(tags)) != 1:
        raise SMPCheckpointError(f"save_checkpoint: every rank must pass the same tag, got {sorted(set(tags))}")
    st = smp_state.current()
    model = model if model is not None else st.model
    optimizer = optimizer if optimizer is not None else st.optimizer
    if model is None:
        raise SMPCheckpointError("save_checkpoint needs a DistributedModel (create one, or pass model=)")
    what = f"smp.save_checkpoint({path!r}, tag={tag!r}, partial={partial})"
    try:
        if partial:
            _save_partial(what, path, tag, st, model, optimizer, user_content, num_kept_partial_checkpoints)
        else:
            state = model.state_dict(gather_to_rank0=True) if rdp_rank() == 0 else {}
            _agree(what, rank() == 0, lambda: files.write_full_checkpoint(path, tag, state, user_content))
    except BaseException as e:
        _note_save_state(e, path, tag)
        raise


def _save_partial(what: str, path: str, tag: str, st: Any, model: Any, optimizer: Any, user_content: Any,
                  keep: int | None) -> None:
    """The three phases of Note [checkpoint commit order], each followed by an agreement."""
    _, ids = _agree(what, rank() == 0, lambda: files.prepare_partial_checkpoint(path, tag), share=lambda sid: sid)
    save_id = ids[0]
    # With sharded optimizer state (built at partitioning) every rank writes its shard of the
    # optimizer (``optimizer_<pp>_<tp>_<rdp>.pt``, SMP v1's v3 names); the model still on rdp rank 0.
    sharded = optimizer is not None and _shard_of(optimizer) is not None
    writes_model = rdp_rank() == 0
    info = rank_info(pp_rank(), tp_rank())

    def write() -> Any:
        cfg = st.cfg.as_dict() if st.cfg is not None else None
        if cfg is not None and model.partitioned:
            # The partition decision travels with the checkpoint: a partial checkpoint only loads
            # into the same partition (SMP v1 reloads it and keeps it).
            cfg[PARTITION_KEY] = model.partition_assignment
        optimizer_state = optimizer.local_state_dict(gather_if_shard=False) if optimizer is not None else None
        return files.write_partial_checkpoint(
            path, tag, info, model.local_state_dict() if writes_model else None, optimizer_state, user_content, cfg,
            write_shared=rank() == 0, smp_version=smp.__version__, save_id=save_id,
            optimizer_rankinfo=rank_info(pp_rank(), tp_rank(), rdp_rank()) if sharded else None)

    _, written = _agree(what, writes_model or sharded, write,
                        share=lambda records: (info if writes_model else None, records))

    def commit() -> Any:
        records = {name: rec for part in written if part is not None for name, rec in part[1].items()}
        infos = sorted({part[0] for part in written if part is not None and part[0] is not None})
        return files.commit_partial_checkpoint(path, tag, save_id, records, keep, expected_rankinfos=infos)

    _agree(what, rank() == 0, commit)


def resume_from_checkpoint(path: str, tag: str | None = None, partial: bool = True, strict: bool = True,
                           load_optimizer: bool = True, load_sharded_optimizer_state: bool = True,
                           translate_function: Any = None) -> Any:
    """Load a checkpoint written by `save_checkpoint`; model and optimizer apply after partitioning.

    Returns the saved user content. ``tag=None`` takes the newest tag.
    """
    st = smp_state.current()
    what = f"smp.resume_from_checkpoint({path!r}, tag={tag!r}, partial={partial})"
    if not partial:
        if tag is None:
            raise SMPCheckpointError("resume_from_checkpoint(partial=False) needs the tag of the full checkpoint")
        full_tag = tag
        got, _ = _agree(what, True, lambda: files.read_full_checkpoint(path, full_tag))
        if st.model is not None:
            st.model.load_state_dict(got["model"], strict=strict)
        return got.get("user_content")

    def read() -> dict[str, Any]:
        info = files.detect_rankinfo(path, tag, pp_rank(), tp_rank())
        shards = files.optimizer_shards(path, tag, pp_rank(), tp_rank()) if load_optimizer else []
        if not shards:
            return files.read_partial_checkpoint(path, tag, info, load_optimizer=load_optimizer)
        # Saved with sharded optimizer state: this rank's own shard when it steps the same one now,
        # else every shard of its (pp, tp) part, joined (any sharding, or none, loads it).
        own = rank_info(pp_rank(), tp_rank(), rdp_rank())
        same = own in shards and _sharded_now(st) and len(shards) == rdp_size()
        got = files.read_partial_checkpoint(path, tag, info, optimizer_rankinfo=own if same else shards[0],
                                            load_optimizer=load_sharded_optimizer_state)
        if load_sharded_optimizer_state and not same:
            got["optimizer"] = merge_shards([got["optimizer"], *files.read_optimizer_shards(path, tag, shards[1:])])
        return got

    got, saves = _agree(what, True, read, share=lambda got: got["save_id"])
    if len(set(saves)) > 1:
        # Each rank's files passed its manifest check, but the ranks read different manifests: the
        # checkpoint was replaced while they read it.
        raise SMPCheckpointError(
            f"{what}: the ranks read files of different saves (save id by rank: {saves}), so {path} changed "
            f"while they read it. Fix: resume again once no save to {path} is running")
    saved_cfg = got.get("config") or {}
    if st.cfg is not None:
        changed = [f"{key} {saved_cfg[key]} -> {getattr(st.cfg, key)}"
                   for key in ("pipeline_parallel_degree", "tensor_parallel_degree")
                   if key in saved_cfg and saved_cfg[key] != getattr(st.cfg, key)]
        if changed:
            raise SMPCheckpointError(
                f"resume_from_checkpoint: the partial checkpoint {path!r} was saved with another layout "
                f"({', '.join(changed)}); a partial checkpoint only loads into the layout it was saved with. Fix: "
                f"resume with the saved degrees, or save a full checkpoint (save_checkpoint(..., partial=False)) "
                f"and load it with resume_from_checkpoint(..., partial=False), which works in any layout")
    saved_partition = saved_cfg.get(PARTITION_KEY)
    if saved_partition is not None:
        if st.model is not None:
            st.model.use_saved_partition(saved_partition)
        else:
            torch_state().pending["partition"] = saved_partition
    if got.get("model") is not None:
        if st.model is not None:
            st.model.load_state_dict(got["model"], strict=strict)
        else:
            torch_state().pending["model"] = (got["model"], strict)
    if load_optimizer and got.get("optimizer") is not None:
        if st.optimizer is not None:
            st.optimizer.load_state_dict(got["optimizer"])
        else:
            torch_state().pending["optimizer"] = got["optimizer"]
    return got.get("user_content")
