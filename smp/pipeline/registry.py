"""The schedule registry (keyed by the config value ``pipeline``) and `build_plan`.

=====================  =========  ====================================================================
name                   kind       what it does
=====================  =========  ====================================================================
``interleaved``        dynamic    SMP v1 default: ready backward first, lowest microbatch first,
                                  admission capped at ``active_microbatches`` (default pp + 2)
``simple``             dynamic    SMP v1: windows of ``active_microbatches``, forwards then backwards
``gpipe``              dynamic    fill and drain: all forwards, then all backwards
``1f1b``               static     PipeDream-Flush: warm-up min(p - r, m), then one F / one B
``interleaved_1f1b``   static     Megatron-LM interleaving over ``virtual_stages`` segments per rank
``zb_h1``              static     zero bubble H1: 1F1B memory, I/W split, bubble (p-1)/(3m)
``zb_v``               static     zero bubble V: 2 segments per rank in a V, I/W split
``_only_forward``      dynamic    forwards only (evaluation steps)
=====================  =========  ====================================================================

*Dynamic* rules are simulated with the costs given to `build_plan` (default: one time unit per
action); *static* ones give the same order whatever the costs.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass

from smp.errors import ScheduleError
from smp.pipeline.actions import Action
from smp.pipeline.chains import check_chain, looped_chain, vee_chain
from smp.pipeline.costs import Costs
from smp.pipeline.grid import format_grid
from smp.pipeline.plan import Plan
from smp.pipeline.schedules.one_f_one_b import build_1f1b, build_interleaved_1f1b
from smp.pipeline.schedules.request import BuildRequest
from smp.pipeline.schedules.smp_v1 import build_gpipe, build_interleaved, build_only_forward, build_simple
from smp.pipeline.schedules.zero_bubble import build_zb_h1, build_zb_v
from smp.pipeline.validate import peak_held, validate_plan

__all__ = ["Schedule", "SCHEDULES", "build_plan", "default_chain"]


@dataclass(frozen=True)
class Schedule:
    """One registry entry: a builder plus what `build_plan` needs to know about it.

    Attributes:
        name: the registry key.
        build: per-rank action lists for a checked `BuildRequest`.
        summary: one line for help texts.
        dynamic: simulated with the given costs (else the order ignores costs).
        smp_default_cap: default ``active_microbatches`` is SMP v1's ``pp + 2`` (else uncapped).
        forward_only: builds forward-only plans.
        vee: the default chain is the V (two segments per rank), not ``virtual_stages`` loops.
    """

    name: str
    build: Callable[[BuildRequest], list[list[Action]]]
    summary: str
    dynamic: bool
    smp_default_cap: bool = False
    forward_only: bool = False
    vee: bool = False

    def __call__(self, request: BuildRequest) -> list[list[Action]]:
        return self.build(request)


SCHEDULES: dict[str, Schedule] = {
    s.name: s
    for s in (
        Schedule("simple", build_simple, "SMP v1: windows of active_microbatches, forwards then backwards", True, smp_default_cap=True),
        Schedule("interleaved", build_interleaved, "SMP v1 default: ready backward first, capped admission", True, smp_default_cap=True),
        Schedule("gpipe", build_gpipe, "GPipe fill-drain: all forwards then all backwards", True),
        Schedule("1f1b", build_1f1b, "PipeDream-Flush 1F1B: warm-up min(p-r, m), then one F / one B", False),
        Schedule("interleaved_1f1b", build_interleaved_1f1b, "Megatron interleaved 1F1B over virtual stages", False),
        Schedule("zb_h1", build_zb_h1, "zero bubble H1: I/W split at 1F1B memory", False),
        Schedule("zb_v", build_zb_v, "zero bubble V: two segments per rank in a V, I/W split", False, vee=True),
        Schedule("_only_forward", build_only_forward, "forwards only, for evaluation steps", True, smp_default_cap=True, forward_only=True),
    )
}


def default_chain(name: str, num_ranks: int, virtual_stages: int = 1) -> tuple[int, ...]:
    """The ranks of schedule ``name``'s chain parts when the model's placement does not give them:
    the V ``0 .. p-1, p-1 .. 0`` for ``zb_v``, else ``0 .. p-1`` looped ``virtual_stages`` times
    (what `build_plan` plans on, and what automatic partitioning places the model on).

    Example:
        >>> default_chain("zb_v", 2), default_chain("interleaved_1f1b", 2, 2)
        ((0, 1, 1, 0), (0, 1, 0, 1))
    """
    schedule = SCHEDULES.get(name)
    return vee_chain(num_ranks, 2) if schedule is not None and schedule.vee else looped_chain(num_ranks, virtual_stages)


def build_plan(
    name: str,
    num_ranks: int,
    num_microbatches: int,
    *,
    chain: Sequence[int] | None = None,
    active_microbatches: int | None = None,
    virtual_stages: int = 1,
    costs: Costs | None = None,
) -> Plan:
    """Build, validate and return the plan of schedule ``name``.

    Args:
        name: a `SCHEDULES` key (the config value ``pipeline``).
        num_ranks: pipeline ranks (pp_size).
        num_microbatches: microbatches per step.
        chain: ranks one microbatch visits in its forward; default ``0..p-1`` repeated
            ``virtual_stages`` times (``zb_v``: the V ``0..p-1, p-1..0``).
        active_microbatches: in-flight cap. Default: ``min(p + 2, m)`` for SMP v1's ``simple``,
            ``interleaved`` and ``_only_forward``; none for the others. Values above ``m`` are
            clipped to ``m`` (as SMP v1 does).
        virtual_stages: segments per rank of the default chain (ignored when ``chain`` is given).
        costs: segment costs the dynamic rules are simulated with (default: one unit per action,
            under which ``interleaved`` reproduces SMP v1's documented order).

    Returns:
        A validated compute-only `Plan` (``lower(plan)`` adds the messages).

    Raises:
        ScheduleError: an unknown name (listing the valid ones), bad inputs (all listed), or a cap
            the schedule cannot honour.

    Example:
        >>> plan = build_plan("1f1b", num_ranks=2, num_microbatches=3)
        >>> print(plan.orders())
        rank 0: F0 F1 B0 F2 B1 B2
        rank 1: F0 B0 F1 B1 F2 B2
    """
    schedule = SCHEDULES.get(name)
    if schedule is None:
        raise ScheduleError(
            f"pipeline={name!r} is not a schedule; valid names: {', '.join(SCHEDULES)}"
        )
    problems: list[str] = []
    if not isinstance(num_ranks, int) or num_ranks < 1:
        problems.append(f"num_ranks={num_ranks!r}: must be an integer >= 1")
    if not isinstance(num_microbatches, int) or num_microbatches < 1:
        problems.append(f"num_microbatches={num_microbatches!r}: must be an integer >= 1")
    if active_microbatches is not None and (not isinstance(active_microbatches, int) or active_microbatches < 1):
        problems.append(f"active_microbatches={active_microbatches!r}: must be an integer >= 1 (or None)")
    if not isinstance(virtual_stages, int) or virtual_stages < 1:
        problems.append(f"virtual_stages={virtual_stages!r}: must be an integer >= 1")
    elif schedule.vee and chain is None and virtual_stages not in (1, 2):
        problems.append(f"virtual_stages={virtual_stages}: zb_v runs exactly 2 segments per rank; use 1 or 2")
    if problems:
        raise ScheduleError(f"cannot build {name!r}:\n" + "\n".join(f"  - {p}" for p in problems))
    if chain is None:
        path = default_chain(name, num_ranks, virtual_stages)
    else:
        path = tuple(int(r) for r in chain)
    chain_problems = check_chain(path, num_ranks)
    if chain_problems:
        raise ScheduleError(f"cannot build {name!r}:\n" + "\n".join(f"  - {p}" for p in chain_problems))
    default_cap = min(num_ranks + 2, num_microbatches) if schedule.smp_default_cap else num_microbatches
    cap = default_cap if active_microbatches is None else min(active_microbatches, num_microbatches)
    request = BuildRequest(
        name=name,
        num_ranks=num_ranks,
        num_microbatches=num_microbatches,
        chain=path,
        active_microbatches=cap,
        capped=active_microbatches is not None or schedule.smp_default_cap,
        costs=None if costs is None else costs.resolve(len(path)),
    )
    lists = schedule(request)
    held = peak_held(lists)
    plan = Plan(
        name=name,
        num_ranks=num_ranks,
        num_microbatches=num_microbatches,
        chain=path,
        active_microbatches=cap if request.capped else held,
        actions={r: acts for r, acts in enumerate(lists)},
        forward_only=schedule.forward_only,
    )
    if request.capped and held > cap:
        raise ScheduleError(
            f"{name!r} needs {held} microbatches in flight on some rank here but active_microbatches={cap}; "
            "raise active_microbatches, or use 'interleaved' or 'simple', which honour any cap\n\n"
            + format_grid(plan)
        )
    validate_plan(plan)
    return plan

