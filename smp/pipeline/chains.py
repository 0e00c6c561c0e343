"""Chains: the sequence of pipeline ranks one microbatch visits during its forward pass.

Segment ``s`` of the chain runs on rank ``chain[s]``; the forward visits segments in order and the
backward in reverse. Typical chains, for 4 ranks::

    linear      0 1 2 3             plain pipeline
    looped      0 1 2 3 0 1 2 3     2 virtual stages per rank (Megatron interleaving)
    vee         0 1 2 3 3 2 1 0     zero-bubble V placement (segments 3 and 4 share rank 3)
    tied        0 1 2 3 0           embedding and tied LM head on rank 0 (an SMP v1 model)

A rank may appear any number of times, consecutively or not; a rank may also be absent (it then
idles, which the simulator reports).
"""

from __future__ import annotations

from collections.abc import Sequence

from smp.errors import ScheduleError

__all__ = ["linear_chain", "looped_chain", "vee_chain", "parse_chain", "check_chain", "segments_by_rank"]


def linear_chain(num_ranks: int) -> tuple[int, ...]:
    """``0, 1, ..., num_ranks - 1``."""
    return tuple(range(num_ranks))


def looped_chain(num_ranks: int, virtual_stages: int) -> tuple[int, ...]:
    """The linear chain repeated ``virtual_stages`` times: ``0 1 2 0 1 2`` for 3 ranks, 2 stages."""
    return tuple(range(num_ranks)) * virtual_stages


def vee_chain(num_ranks: int, legs: int = 2) -> tuple[int, ...]:
    """A zig-zag of ``legs`` legs: ``0 1 2 2 1 0`` for 3 ranks, 2 legs (the ZB-V placement)."""
    down = tuple(range(num_ranks))
    return tuple(r for leg in range(legs) for r in (down if leg % 2 == 0 else down[::-1]))


def parse_chain(text: str) -> tuple[int, ...]:
    """Read ``"0,1,0"`` (commas and/or spaces, optional ``->``) into a chain.

    Example:
        >>> parse_chain("0 -> 1 -> 0")
        (0, 1, 0)
    """
    cleaned = text.replace("->", ",").replace(" ", ",")
    parts = [p for p in cleaned.split(",") if p]
    try:
        return tuple(int(p) for p in parts)
    except ValueError:
        raise ScheduleError(
            f"chain={text!r}: expected rank numbers separated by commas, e.g. '0,1,0'"
        ) from None


def check_chain(chain: Sequence[int], num_ranks: int) -> list[str]:
    """Return the problems of ``chain`` for ``num_ranks`` ranks (empty when it is usable)."""
    problems: list[str] = []
    if len(chain) == 0:
        problems.append("chain is empty: it must list at least one rank, e.g. '0,1'")
    bad = sorted({r for r in chain if not 0 <= r < num_ranks})
    if bad:
        problems.append(
            f"chain {','.join(map(str, chain))} names rank(s) {bad} outside 0..{num_ranks - 1}; "
            f"use ranks below the pipeline degree {num_ranks}"
        )
    return problems


def segments_by_rank(chain: Sequence[int], num_ranks: int) -> list[list[int]]:
    """For each rank, the segments it runs, in chain order."""
    out: list[list[int]] = [[] for _ in range(num_ranks)]
    for seg, rank in enumerate(chain):
        out[rank].append(seg)
    return out
