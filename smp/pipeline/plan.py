"""Plan: a pipeline schedule as data, one ordered action list per rank.

A plan is what the executor walks: rank ``r`` runs ``plan.actions[r]`` from first to last. A
compute-only plan holds F/B (or F/I/W) actions; `smp.pipeline.lowering.lower` adds the sends and
receives they imply, in an order that cannot deadlock under blocking point-to-point communication.

The plan is data and imports none of its passes (STYLE.md habit 18): validation, lowering,
simulation and the text grid are free functions over it (`validate_plan`, `lower`, `simulate`,
`format_grid` / `parse_grid`).

Its text form is a grid, one row per time step and one column per rank, that
`smp.pipeline.grid.parse_grid` reads back exactly (idle cells are ``.``)::

    plan 1f1b ranks=2 microbatches=2 active=2 chain=0,1
    step rank0 rank1
    0    0F0   .
    1    0F1   1F0
    2    .     1B0
    3    0B0   1F1
    4    .     1B1
    5    0B1   .
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field

from smp.pipeline.actions import BACKWARD_INPUT, BACKWARD_WEIGHT, COMM_KINDS, Action

__all__ = ["Plan"]


@dataclass(frozen=True)
class Plan:
    """A static pipeline schedule.

    Attributes:
        name: the schedule that built it (a `SCHEDULES` key) or any label.
        num_ranks: pipeline ranks (pp_size).
        num_microbatches: microbatches per step.
        chain: segment -> rank; the forward of a microbatch visits segments 0..len(chain)-1.
        active_microbatches: the most microbatches the plan keeps in flight (the validator checks
            that no rank holds more).
        actions: per rank, the actions in execution order (every rank has a key).
        forward_only: an evaluation plan: forwards only.

    Example:
        >>> from smp.pipeline import build_plan, format_grid, parse_grid
        >>> plan = build_plan("gpipe", num_ranks=2, num_microbatches=2)
        >>> [str(a) for a in plan.actions[1]]
        ['1F0', '1F1', '1B0', '1B1']
        >>> parse_grid(format_grid(plan)) == plan
        True
    """

    name: str
    num_ranks: int
    num_microbatches: int
    chain: tuple[int, ...]
    active_microbatches: int
    actions: dict[int, list[Action]] = field(default_factory=dict)
    forward_only: bool = False

    def __post_init__(self) -> None:
        object.__setattr__(self, "chain", tuple(int(r) for r in self.chain))
        full = {r: list(self.actions.get(r, [])) for r in range(self.num_ranks)}
        full.update({r: list(a) for r, a in self.actions.items() if r not in full})
        object.__setattr__(self, "actions", full)

    # -- shape ------------------------------------------------------------------------------------

    @property
    def num_segments(self) -> int:
        """Length of the chain."""
        return len(self.chain)

    @property
    def leader(self) -> int:
        """The rank that runs segment 0 (and so admits every microbatch)."""
        return self.chain[0]

    @property
    def is_lowered(self) -> bool:
        """True when the plan lists its sends and receives."""
        return any(a.kind in COMM_KINDS for acts in self.actions.values() for a in acts)

    @property
    def split_backward(self) -> bool:
        """True when backwards are split into I and W (zero-bubble plans)."""
        return any(
            a.kind in (BACKWARD_INPUT, BACKWARD_WEIGHT) for acts in self.actions.values() for a in acts
        )

    def segments_of(self, rank: int) -> list[int]:
        """The segments rank ``rank`` runs, in chain order."""
        return [s for s, r in enumerate(self.chain) if r == rank]

    def rank_lists(self) -> list[list[Action]]:
        """The action lists indexed by rank (0..num_ranks-1)."""
        return [self.actions[r] for r in range(self.num_ranks)]

    # -- transformations --------------------------------------------------------------------------

    def compute_only(self) -> Plan:
        """This plan without its sends and receives."""
        return self.with_actions({r: [a for a in acts if a.is_compute] for r, acts in self.actions.items()})

    def with_actions(self, actions: Mapping[int, Sequence[Action]], name: str | None = None) -> Plan:
        """A copy with other action lists (and optionally another name)."""
        return Plan(
            name=self.name if name is None else name,
            num_ranks=self.num_ranks,
            num_microbatches=self.num_microbatches,
            chain=self.chain,
            active_microbatches=self.active_microbatches,
            actions={r: list(a) for r, a in actions.items()},
            forward_only=self.forward_only,
        )

    # -- text -------------------------------------------------------------------------------------

    def orders(self) -> str:
        """One line per rank listing its compute actions, e.g. ``rank 1: F0 F1 B0 F2 B1 B2``.

        The segment is shown (``2F0``) only on ranks that run more than one segment.
        """
        lines = []
        for r in range(self.num_ranks):
            multi = len(self.segments_of(r)) > 1
            words = [
                str(a) if multi else f"{a.kind.value}{a.microbatch}" for a in self.actions[r] if a.is_compute
            ]
            lines.append(f"rank {r}: " + " ".join(words))
        return "\n".join(lines)
