"""Pipeline plans as data: build, validate, simulate, lower and draw pipeline schedules.

Framework-free (never imports torch or tensorflow). See docs/pipeline.md.

Example:
    >>> from smp.pipeline import build_plan, simulate
    >>> result = simulate(build_plan("1f1b", num_ranks=4, num_microbatches=8))
    >>> result.bubble_fraction, result.peak_in_flight
    (0.375, [4, 3, 2, 1])
"""

from smp.pipeline.actions import Action, ActionKind
from smp.pipeline.chains import linear_chain, looped_chain, parse_chain, vee_chain
from smp.pipeline.costs import Costs
from smp.pipeline.grid import format_grid, parse_grid
from smp.pipeline.lowering import lower
from smp.pipeline.plan import Plan
from smp.pipeline.registry import SCHEDULES, Schedule, build_plan
from smp.pipeline.render_ascii import render_ascii
from smp.pipeline.render_svg import render_svg
from smp.pipeline.render_trace import render_chrome_trace
from smp.pipeline.simulate import SimResult, simulate
from smp.pipeline.timeline import Timeline, TimelineEvent
from smp.pipeline.validate import PlanProblem, check_plan, validate_plan

__all__ = [
    "Action",
    "ActionKind",
    "Costs",
    "Plan",
    "PlanProblem",
    "SCHEDULES",
    "Schedule",
    "SimResult",
    "Timeline",
    "TimelineEvent",
    "build_plan",
    "check_plan",
    "format_grid",
    "linear_chain",
    "looped_chain",
    "lower",
    "parse_chain",
    "parse_grid",
    "render_ascii",
    "render_chrome_trace",
    "render_svg",
    "simulate",
    "validate_plan",
    "vee_chain",
]
