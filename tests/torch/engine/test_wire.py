"""The pipeline transport on a real gloo pair: every message arrives whole and costs at most two sends.

One 2-rank launch: rank 0 sends rank 1 a set of messages chosen at the frame's edges (nothing; a
scalar; tensors that fit the frame, an activation-sized one included; more tensors than the
frame's mask has bits; a skeleton larger than the frame; a tensor larger than the frame, alone,
first and last; empty, 0-d, non-contiguous, bool, integer, half and complex tensors), and rank 1
checks kind, microbatch, body
and every tensor's shape, dtype and bytes. The sends posted per message are
counted: the engine's cost on a busy rank is its number of sends (benchmarks/bench_pipeline.py
--model threads).
"""

from __future__ import annotations

import os
from typing import Any

import torch

from tests.helpers.spawn import run_ranks


def _messages() -> list[tuple[int, Any, list[torch.Tensor]]]:
    """(kind, body, tensors); kinds above the engine's own, so none reads as the receiver's STOP."""
    from smp.torch.engine import wire

    g = torch.Generator().manual_seed(0)

    def r(*shape: int) -> torch.Tensor:
        return torch.randn(*shape, generator=g)

    big = r(2, 128, 256)  # an activation: fits the frame
    huge = r(wire.FRAME // 4 + 1000)  # does not
    return [
        (101, None, []),
        (102, {"id": (0, 1)}, [torch.tensor(3.5)]),
        (103, ("fits", [1, 2]), [r(4, 4), torch.arange(10), torch.ones(3, dtype=torch.bool)]),
        (104, {"one": "large"}, [big]),
        (105, {"large": "first"}, [big, r(1, 128, 64), r(1, 128, 64), torch.arange(128).unsqueeze(0)]),
        (106, "many", [torch.full((2,), float(i)) for i in range(70)] + [r(3000)]),
        (107, [f"{i:07d}" * 100 for i in range(wire.FRAME // 700 + 100)], [r(5), r(3000)]),  # a skeleton larger than the frame
        (108, ["y" * 40] * 400, [r(7)]),  # pickled once: fits
        (109, "odd", [torch.empty(0, 3), r(6, 4).t(), torch.tensor(True), r(3, 3).half(),
                    torch.randn(4, dtype=torch.complex64, generator=g), torch.tensor([1, -2], dtype=torch.int8), r(2000)]),
        (110, "empty only", [torch.empty(0), torch.empty(0, 2, dtype=torch.int64)]),
        (111, {"one": "huge"}, [huge]),
        (112, {"huge": "first"}, [huge, r(1, 128, 64), torch.arange(128).unsqueeze(0)]),
        (113, "huge last", [r(1, 128, 64), huge]),
    ]


def _run() -> Any:
    import torch.distributed as dist
    import torch.distributed.distributed_c10d as c10d
    from smp.torch.engine import wire

    dist.init_process_group("gloo", init_method="file://" + os.environ["SMP_RENDEZVOUS_FILE"],
                            rank=int(os.environ["RANK"]), world_size=2)
    rank = dist.get_rank()
    transport = wire.Transport(dist.new_group([0, 1]), [0, 1], rank)
    messages = _messages()
    if rank == 0:
        isend = c10d.isend
        sends: list[int] = []

        def counted(*args: Any, **kwargs: Any) -> Any:
            sends[-1] += 1
            return isend(*args, **kwargs)

        transport.start(wire.STOP)
        wire.dist.isend = counted  # type: ignore[attr-defined]
        for kind, body, tensors in messages:
            sends.append(0)
            transport.send(1, kind, kind * 10, body, tensors)
        wire.dist.isend = isend  # type: ignore[attr-defined]
        transport.stop(wire.STOP, 30)
        return sends
    transport.start(wire.STOP)
    got = [transport.inbox.get(timeout=30) for _ in messages]
    transport.stop(wire.STOP, 30)
    problems = []
    for (kind, body, tensors), msg in zip(messages, got):
        assert not isinstance(msg, BaseException), msg
        if (msg.kind, msg.microbatch, msg.body, msg.src) != (kind, kind * 10, body, 0):
            problems.append(f"message {kind}: header or body differs")
        if len(msg.tensors) != len(tensors):
            problems.append(f"message {kind}: {len(msg.tensors)} tensors, sent {len(tensors)}")
            continue
        for i, (a, b) in enumerate(zip(tensors, msg.tensors)):
            if a.shape != b.shape or a.dtype != b.dtype or not torch.equal(a, b):
                problems.append(f"message {kind} tensor {i}: {tuple(b.shape)} {b.dtype}, sent {tuple(a.shape)} {a.dtype}")
    return problems


def test_every_message_arrives_whole_in_at_most_two_sends() -> None:
    sends, problems = run_ranks(_run, 2, timeout=120)
    assert problems == []
    kinds = [kind for kind, _, _ in _messages()]
    assert max(sends) <= 2, dict(zip(kinds, sends))
    by_kind = dict(zip(kinds, sends))
    # Whatever fits the frame travels in it alone (an activation included); more tensors than the
    # mask has bits, a tensor larger than the frame or a larger skeleton take a second send.
    assert [k for k in kinds if by_kind[k] == 2] == [106, 107, 111, 112, 113], by_kind
