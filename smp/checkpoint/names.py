"""File names of SMP v1 checkpoints: ``smp.save(partial=True)`` files and ``save_checkpoint`` rank infos.

``smp.save(obj, f, partial=True)`` names (`partial_name`, `find_partial`)::

    f"{f}_{pp_rank}_{tp_rank}.pt"               SMP >= 1.6
    f"{f}_{pp_rank}_{tp_rank}_{rdp_rank}.pt"    v3=True (sharded optimizer state)
    f"{f}_{mp_rank}"                            before 1.6 (no TP, so mp_rank == pp_rank)
    f"{f}_{pp_rank}_{tp_rank}"                  before 1.10, read with back_compat=True

Framework-free: ``smp.save``/``smp.load`` (frontends/torch/checkpointing/saving.py) and `smp.checkpoint.layout` use them.
"""

from __future__ import annotations

import os

from smp.errors import SMPCheckpointError

__all__ = ["find_partial", "partial_candidates", "partial_name", "rank_info"]



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
        >>> open(partial_name(f, 0, 1), "wb").close()
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


def rank_info(pp_rank: int, tp_rank: int, rdp_rank: int | None = None) -> str:
    """The ``<rankinfo>`` of file names in a ``_partial`` directory.

    Example:
        >>> rank_info(1, 0), rank_info(1, 0, 2)
        ('1_0', '1_0_2')
    """
    return f"{pp_rank}_{tp_rank}" if rdp_rank is None else f"{pp_rank}_{tp_rank}_{rdp_rank}"
