"""Actions: one step of a pipeline plan (a forward, a backward, or one message of one microbatch).

An action names *what* runs (its kind), *for which microbatch*, and *which segment* of the chain it
belongs to. A segment is a position in the chain (see `smp.pipeline.plan`): segment ``s`` runs on
rank ``chain[s]``. Communication actions also name the peer rank.

The text form follows torch.distributed.pipelining's action IR, so compute-only grids can be read
by either library: ``{segment}{KIND}{microbatch}``, e.g. ``2F0`` is the forward of microbatch 0 in
segment 2. Messages add the peer: ``1SEND_F3>2`` (segment 1 sends microbatch 3's activation to rank
2), ``2RECV_F3<1`` (segment 2 receives it from rank 1).

Which segment a message carries (the torch convention): a send names the segment that produced the
data, a receive names the segment that consumes it. ``SEND_F(m, s)`` matches ``RECV_F(m, s + 1)``
and ``SEND_B(m, s)`` matches ``RECV_B(m, s - 1)``.
"""

from __future__ import annotations

import re
from collections.abc import Sequence
from dataclasses import dataclass
from enum import Enum

from smp.errors import ScheduleError

__all__ = [
    "ActionKind",
    "Action",
    "FORWARD",
    "BACKWARD",
    "BACKWARD_INPUT",
    "BACKWARD_WEIGHT",
    "SEND_F",
    "RECV_F",
    "SEND_B",
    "RECV_B",
    "COMPUTE_KINDS",
    "COMM_KINDS",
    "last_forward",
]


class ActionKind(str, Enum):
    """What an action does. The value is its spelling in the text form."""

    FORWARD = "F"
    BACKWARD = "B"  # full backward: input gradient and weight gradient together
    BACKWARD_INPUT = "I"  # zero-bubble split: input gradient only (on the critical path)
    BACKWARD_WEIGHT = "W"  # zero-bubble split: weight gradient only (deferrable)
    SEND_F = "SEND_F"
    RECV_F = "RECV_F"
    SEND_B = "SEND_B"
    RECV_B = "RECV_B"

    def __str__(self) -> str:
        return self.value

    @property
    def is_compute(self) -> bool:
        """True for F, B, I and W."""
        return self in COMPUTE_KINDS

    @property
    def is_backward(self) -> bool:
        """True for B, I and W."""
        return self in (ActionKind.BACKWARD, ActionKind.BACKWARD_INPUT, ActionKind.BACKWARD_WEIGHT)


FORWARD = ActionKind.FORWARD
BACKWARD = ActionKind.BACKWARD
BACKWARD_INPUT = ActionKind.BACKWARD_INPUT
BACKWARD_WEIGHT = ActionKind.BACKWARD_WEIGHT
SEND_F = ActionKind.SEND_F
RECV_F = ActionKind.RECV_F
SEND_B = ActionKind.SEND_B
RECV_B = ActionKind.RECV_B
COMPUTE_KINDS = frozenset({FORWARD, BACKWARD, BACKWARD_INPUT, BACKWARD_WEIGHT})
COMM_KINDS = frozenset({SEND_F, RECV_F, SEND_B, RECV_B})

# Longest alternatives first so "SEND_F" is not read as "S...".
_TOKEN = re.compile(r"^(\d+)(SEND_F|RECV_F|SEND_B|RECV_B|F|B|I|W)(\d+)(?:([<>])(\d+))?$")


@dataclass(frozen=True, slots=True)
class Action:
    """One entry of a rank's action list.

    Attributes:
        kind: what runs.
        microbatch: the microbatch index, ``0 <= microbatch < num_microbatches``.
        segment: the chain position the action belongs to (for messages: see the module docstring).
        peer: for messages, the other rank; ``None`` for compute actions.

    Example:
        >>> a = Action(ActionKind.FORWARD, microbatch=3, segment=1)
        >>> str(a)
        '1F3'
        >>> Action.parse("1SEND_F3>2")
        Action(kind=<ActionKind.SEND_F: 'SEND_F'>, microbatch=3, segment=1, peer=2)
    """

    kind: ActionKind
    microbatch: int
    segment: int
    peer: int | None = None

    def __str__(self) -> str:
        text = f"{self.segment}{self.kind.value}{self.microbatch}"
        if self.peer is not None:
            arrow = ">" if self.kind in (SEND_F, SEND_B) else "<"
            text += f"{arrow}{self.peer}"
        return text

    @property
    def is_compute(self) -> bool:
        """True for F, B, I and W."""
        return self.kind in COMPUTE_KINDS

    @property
    def is_comm(self) -> bool:
        """True for SEND_F, RECV_F, SEND_B and RECV_B."""
        return self.kind in COMM_KINDS

    @classmethod
    def parse(cls, token: str) -> Action:
        """Read one action from its text form (see the module docstring).

        Raises:
            ScheduleError: the token is not an action, or a message has no peer / a compute
                action has one.
        """
        match = _TOKEN.match(token.strip())
        if match is None:
            raise ScheduleError(
                f"cannot read action {token!r}: expected {{segment}}{{KIND}}{{microbatch}} such as '2F0' "
                "or '1SEND_F3>2', with KIND one of F, B, I, W, SEND_F, RECV_F, SEND_B, RECV_B"
            )
        segment, kind_text, microbatch, arrow, peer = match.groups()
        kind = ActionKind(kind_text)
        if kind in COMM_KINDS:
            expected = ">" if kind in (SEND_F, SEND_B) else "<"
            if arrow != expected or peer is None:
                raise ScheduleError(
                    f"cannot read action {token!r}: a {kind.value} names its peer rank as "
                    f"'{expected}PEER', e.g. '{segment}{kind.value}{microbatch}{expected}0'"
                )
            return cls(kind, int(microbatch), int(segment), int(peer))
        if arrow is not None:
            raise ScheduleError(f"cannot read action {token!r}: compute actions have no peer rank")
        return cls(kind, int(microbatch), int(segment))


def last_forward(actions: Sequence[Action]) -> int:
    """The index of the last forward in one rank's ``actions`` (-1: none); what follows is its cool-down."""
    return max((i for i, a in enumerate(actions) if a.kind is FORWARD), default=-1)
