"""SMP v1 checkpoint API: ``smp.save``/``smp.load`` and ``smp.save_checkpoint``/``smp.resume_from_checkpoint``.

The file layout and the crash-safe write order live in checkpoint_files.py; this module decides which
rank writes what. ``save_checkpoint`` is a collective over the world: rank 0 prepares the tag,
every rank with ``rdp_rank() == 0`` writes its model and optimizer part, rank 0 commits the tag to
``newest`` only after everyone wrote, so a crash mid-save leaves the previous tag loadable.
"""

from __future__ import annotations

import pickle
from typing import Any

import torch

import smp
import smp.state as smp_state
from smp.errors import SMPCheckpointError

from . import checkpoint_files as files
from .comm import WORLD, allgather, barrier, pp_rank, rank, rdp_rank, tp_rank

# State read by resume_from_checkpoint before the model or optimizer existed; applied when they appear.
pending: dict[str, Any] = {}


# Key of the partition decision (module path -> pp_rank) inside a partial checkpoint's smp_config.pt.
PARTITION_KEY = "_smp_partition"


def save(obj: Any, f: str, partial: bool = True, pickle_module: Any = pickle, pickle_protocol: int = 2,
         v3: bool = False, **kwargs: Any) -> None:
    """``torch.save`` for smp: ``partial=True`` writes ``f"{f}_{pp}_{tp}.pt"`` (``_{rdp}`` with v3) on each
    calling rank; ``partial=False`` writes ``f`` on rank 0 only. Writes are atomic."""
    if partial:
        name = files.partial_name(f, pp_rank(), tp_rank(), rdp_rank() if v3 else None)
        files.atomic_save(obj, name, pickle_module=pickle_module, pickle_protocol=pickle_protocol)
    elif rank() == 0:
        files.atomic_save(obj, f, pickle_module=pickle_module, pickle_protocol=pickle_protocol)


def load(f: str, map_location: Any = None, pickle_module: Any = None, partial: bool = True,
         back_compat: bool = False, **pickle_load_args: Any) -> Any:
    """Load what `save` wrote; with ``partial=True`` this rank's file (3-, 2- or 1-part name)."""
    path = files.find_partial(f, pp_rank(), tp_rank(), rdp_rank(), back_compat=back_compat) if partial else f
    extra = {"pickle_module": pickle_module} if pickle_module is not None else {}
    return torch.load(path, map_location=map_location or "cpu", weights_only=False, **extra, **pickle_load_args)


def save_checkpoint(path: str, tag: str, partial: bool = True, model: Any = None, optimizer: Any = None,
                    user_content: Any = None, translate_if_full: bool = True,
                    num_kept_partial_checkpoints: int | None = None) -> None:
    """Save model, optimizer and user content under ``path/<tag>_partial`` (or a full model file).

    Call it on every rank with the same ``tag``.
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
    if not partial:
        state = model.state_dict(gather_to_rank0=True) if rdp_rank() == 0 else {}
        barrier()
        if rank() == 0:
            files.write_full_checkpoint(path, tag, state, user_content)
        barrier()
        return
    writer = rdp_rank() == 0
    if rank() == 0:
        files.prepare_partial_checkpoint(path, tag)
    barrier()
    info = files.rank_info(pp_rank(), tp_rank())
    model_state = model.local_state_dict() if writer else None
    optimizer_state = optimizer.local_state_dict() if (writer and optimizer is not None) else None
    if writer:
        cfg = st.cfg.as_dict() if st.cfg is not None else None
        if cfg is not None and model.partitioned:
            # The partition decision travels with the checkpoint: a partial checkpoint only loads
            # into the same partition (SMP v1 reloads it and keeps it).
            cfg[PARTITION_KEY] = dict(model._owner)
        files.write_partial_checkpoint(path, tag, info, model_state, optimizer_state, user_content, cfg,
                                       write_shared=rank() == 0, smp_version=smp.__version__)
    infos = allgather(info if writer else None, WORLD)
    if rank() == 0:
        files.update_newest(path, tag, num_kept_partial_checkpoints,
                            expected_rankinfos=sorted({i for i in infos if i is not None}))
    barrier()


def resume_from_checkpoint(path: str, tag: str | None = None, partial: bool = True, strict: bool = True,
                           load_optimizer: bool = True, load_sharded_optimizer_state: bool = True,
                           translate_function: Any = None) -> Any:
    """Load a checkpoint written by `save_checkpoint`; model and optimizer apply after partitioning.

    Returns the saved user content. ``tag=None`` takes the newest tag.
    """
    st = smp_state.current()
    if not partial:
        if tag is None:
            raise SMPCheckpointError("resume_from_checkpoint(partial=False) needs the tag of the full checkpoint")
        got = files.read_full_checkpoint(path, tag)
        if st.model is not None:
            st.model.load_state_dict(got["model"], strict=strict)
        return got.get("user_content")
    info = files.detect_rankinfo(path, tag, pp_rank(), tp_rank())
    got = files.read_partial_checkpoint(path, tag, info, load_optimizer=load_optimizer)
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
            st.model._use_saved_partition(saved_partition)
        else:
            pending["partition"] = saved_partition
    if got.get("model") is not None:
        if st.model is not None:
            st.model.load_state_dict(got["model"], strict=strict)
        else:
            pending["model"] = (got["model"], strict)
    if load_optimizer and got.get("optimizer") is not None:
        if st.optimizer is not None:
            st.optimizer.load_state_dict(got["optimizer"])
        else:
            pending["optimizer"] = got["optimizer"]
    return got.get("user_content")
