"""The text grid of a plan: one row per time step, one column per rank; it parses back exactly.

Each action takes one time step and starts as soon as its rank is free and its inputs exist (the
dependency walk with unit durations), so the grid reads like torch.distributed.pipelining's
``_format_pipeline_order``. Only the order within a column matters to `parse_grid`; the rows are
for the eye. A cell marked ``!`` is one the validator complains about; the notes follow the grid.
An invalid order is still drawn: when every rank is blocked, the earliest free rank's next action
is placed anyway.
"""

from __future__ import annotations

import re
from collections.abc import Mapping

from smp.errors import ScheduleError
from smp.pipeline.actions import Action
from smp.pipeline.plan import Plan
from smp.pipeline.walk import walk

__all__ = ["format_grid", "parse_grid", "header"]

_HEADER = re.compile(r"^plan\s+(\S+)((?:\s+\S+)*)\s*$")


def header(plan: Plan) -> str:
    """The first line of the grid: name and shape."""
    chain = ",".join(str(r) for r in plan.chain)
    text = (
        f"plan {plan.name} ranks={plan.num_ranks} microbatches={plan.num_microbatches} "
        f"active={plan.active_microbatches} chain={chain}"
    )
    return text + (" forward_only" if plan.forward_only else "")


def format_grid(plan: Plan, marks: Mapping[tuple[int, int], str] | None = None) -> str:
    """Render ``plan`` as a grid (see the module docstring)."""
    marks = marks or {}
    lists = plan.rank_lists()
    placed = walk(lists, plan.chain, force=True)
    rows: dict[int, dict[int, str]] = {}
    for rank, acts in enumerate(lists):
        for i, action in enumerate(acts):
            token = str(action) + ("!" if (rank, i) in marks else "")
            rows.setdefault(int(placed.start[rank][i]), {})[rank] = token
    names = [f"rank{r}" for r in range(plan.num_ranks)]
    width = max([len(n) for n in names] + [len(t) for row in rows.values() for t in row.values()])
    step_width = max(4, len(str(max(rows, default=0))))
    lines = [header(plan), "step".ljust(step_width) + " " + " ".join(n.ljust(width) for n in names).rstrip()]
    for step in sorted(rows):
        cells = [rows[step].get(r, ".").ljust(width) for r in range(plan.num_ranks)]
        lines.append(str(step).ljust(step_width) + " " + " ".join(cells).rstrip())
    if marks:
        lines.append("")
        for (rank, i), note in sorted(marks.items()):
            where = str(lists[rank][i]) if 0 <= rank < len(lists) and 0 <= i < len(lists[rank]) else "?"
            lines.append(f"! rank {rank}, action #{i} ({where}): {note}")
    return "\n".join(lines)


def parse_grid(text: str) -> Plan:
    """Read a plan from the grid `format_grid` writes.

    Raises:
        ScheduleError: naming the line number and what was expected.
    """
    lines = text.splitlines()
    idx = 0
    while idx < len(lines) and not lines[idx].strip():
        idx += 1
    if idx == len(lines):
        raise ScheduleError("cannot read plan: the text is empty")
    match = _HEADER.match(lines[idx].strip())
    if match is None:
        raise ScheduleError(
            f"cannot read plan, line {idx + 1}: expected 'plan NAME ranks=R microbatches=M active=A "
            f"chain=0,1,...', got {lines[idx]!r}"
        )
    name = match.group(1)
    fields: dict[str, str] = {}
    flags: set[str] = set()
    for word in match.group(2).split():
        key, eq, value = word.partition("=")
        if eq:
            fields[key] = value
        else:
            flags.add(key)
    missing = [k for k in ("ranks", "microbatches", "active", "chain") if k not in fields]
    unknown = sorted(set(fields) - {"ranks", "microbatches", "active", "chain"}) + sorted(flags - {"forward_only"})
    if missing or unknown:
        raise ScheduleError(
            f"cannot read plan, line {idx + 1}: missing {missing} / unknown {unknown} in the header; "
            "expected ranks=, microbatches=, active=, chain= and optionally forward_only"
        )
    try:
        num_ranks = int(fields["ranks"])
        num_microbatches = int(fields["microbatches"])
        active = int(fields["active"])
        chain = tuple(int(r) for r in fields["chain"].split(",") if r)
    except ValueError:
        raise ScheduleError(f"cannot read plan, line {idx + 1}: header values must be integers") from None
    idx += 1
    if idx >= len(lines) or not lines[idx].split() or lines[idx].split()[0] != "step":
        raise ScheduleError(f"cannot read plan, line {idx + 1}: expected the column header 'step rank0 ...'")
    columns = lines[idx].split()[1:]
    if columns != [f"rank{r}" for r in range(num_ranks)]:
        raise ScheduleError(
            f"cannot read plan, line {idx + 1}: expected columns rank0..rank{num_ranks - 1}, got {columns}"
        )
    actions: dict[int, list[Action]] = {r: [] for r in range(num_ranks)}
    for lineno in range(idx + 1, len(lines)):
        cells = lines[lineno].split()
        if not cells:
            break  # notes of a marked grid follow a blank line
        if not cells[0].isdigit() or len(cells) > num_ranks + 1:
            raise ScheduleError(
                f"cannot read plan, line {lineno + 1}: expected a step number and up to {num_ranks} cells, "
                f"got {lines[lineno]!r}"
            )
        for rank, cell in enumerate(cells[1:]):
            if cell != ".":
                try:
                    actions[rank].append(Action.parse(cell.rstrip("!")))
                except ScheduleError as err:
                    raise ScheduleError(f"cannot read plan, line {lineno + 1}, rank {rank}: {err}") from None
    return Plan(
        name=name,
        num_ranks=num_ranks,
        num_microbatches=num_microbatches,
        chain=chain,
        active_microbatches=active,
        actions=actions,
        forward_only="forward_only" in flags,
    )
