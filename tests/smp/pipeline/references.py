"""Independent re-implementations of published schedule loops, to compare the builders against.

Written from Megatron-LM's ``forward_backward_pipelining_without_interleaving`` and from
torch.distributed.pipelining's ``_get_1f1b_rank_ops`` / ``_get_warmup_ops`` (schedules.py, torch
2.13), with the display-only idle slots (``None``) left out. Orders are lists of text tokens.
"""

from __future__ import annotations

from collections import defaultdict


def megatron_1f1b(p: int, m: int) -> list[list[str]]:
    """Megatron 1F1B: warm-up min(p - r - 1, m) forwards, then F/B pairs, then the remaining Bs."""
    out = []
    for r in range(p):
        warmup = min(p - r - 1, m)
        order = [f"{r}F{i}" for i in range(warmup)]
        for i in range(m - warmup):
            order += [f"{r}F{warmup + i}", f"{r}B{i}"]
        order += [f"{r}B{i}" for i in range(m - warmup, m)]
        out.append(order)
    return out


def torch_interleaved(p: int, v: int, m: int, *, zero_bubble: bool = False) -> list[list[str]]:
    """torch ScheduleInterleaved1F1B (or ScheduleInterleavedZeroBubble) on the looped placement.

    Requires ``m % max(1, m // p) == 0`` (torch raises otherwise).
    """
    rounds = max(1, m // p)
    per_round = m // rounds
    assert m % rounds == 0
    out = []
    for r in range(p):
        factor = 1 if zero_bubble else 2
        warmup = min((v - 1) * per_round + factor * (p - 1 - r), m * v)
        total = m * v

        def fwd_stage(op: int, r: int = r) -> int:
            return ((op // per_round) % v) * p + r

        def bwd_stage(op: int, r: int = r, warmup: int = warmup) -> int:
            return (v - 1 - ((op - warmup) // per_round) % v) * p + r

        f_mb: dict[int, int] = defaultdict(int)
        b_mb: dict[int, int] = defaultdict(int)
        w_mb: dict[int, int] = defaultdict(int)
        order: list[str] = []
        backward_ops: list[int] = []
        weights_done = 0
        back = "I" if zero_bubble else "B"
        for op in range(total + warmup):
            if op < total:
                s = fwd_stage(op)
                order.append(f"{s}F{f_mb[s]}")
                f_mb[s] += 1
            if op >= warmup:
                s = bwd_stage(op)
                order.append(f"{s}{back}{b_mb[s]}")
                b_mb[s] += 1
                backward_ops.append(op)
                if zero_bubble and op - warmup >= r:
                    s = bwd_stage(backward_ops[weights_done])
                    order.append(f"{s}W{w_mb[s]}")
                    w_mb[s] += 1
                    weights_done += 1
        while zero_bubble and weights_done < len(backward_ops):
            s = bwd_stage(backward_ops[weights_done])
            order.append(f"{s}W{w_mb[s]}")
            w_mb[s] += 1
            weights_done += 1
        out.append(order)
    return out
