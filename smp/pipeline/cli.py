"""`smp plan`: build, validate, simulate and draw a pipeline plan from the command line.

Runs without torch. Example::

    smp plan --pp 4 --microbatches 8 --pipeline 1f1b --json

prints ``{"bubble_fraction": 0.375, ..., "peak_in_flight": [4, 3, 2, 1], ...}``.
"""

from __future__ import annotations

import argparse
import json
import sys
from collections.abc import Sequence
from pathlib import Path

from smp.errors import SMPError
from smp.pipeline.chains import parse_chain
from smp.pipeline.costs import Costs
from smp.pipeline.grid import format_grid
from smp.pipeline.lowering import lower
from smp.pipeline.registry import SCHEDULES, build_plan
from smp.pipeline.render_ascii import render_ascii
from smp.pipeline.render_svg import render_svg
from smp.pipeline.render_trace import render_chrome_trace
from smp.pipeline.simulate import simulate

__all__ = ["main", "parser"]


def parser() -> argparse.ArgumentParser:
    """The argument parser of `smp plan`."""
    schedules = "\n".join(f"  {name:<17} {s.summary}" for name, s in SCHEDULES.items())
    p = argparse.ArgumentParser(
        prog="smp plan",
        description="Build, validate, simulate and draw a pipeline plan (no torch needed).",
        epilog="schedules:\n" + schedules + "\n\nsmp plan --hf-config CONFIG.json --pp N [--tp N] ...: partition a "
               "Hugging Face model from its config alone (needs torch and transformers; "
               "`smp plan --hf-config x --help` lists its options)",
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    p.add_argument("--pp", type=int, required=True, help="pipeline ranks (pipeline_parallel_degree)")
    p.add_argument("--microbatches", type=int, required=True, help="microbatches per step")
    p.add_argument("--pipeline", default="interleaved", metavar="NAME", help="schedule (default: interleaved)")
    p.add_argument("--active-microbatches", type=int, default=None, metavar="A", help="in-flight cap")
    p.add_argument("--virtual-stages", type=int, default=1, metavar="V", help="segments per rank of the default chain")
    p.add_argument("--chain", default=None, help="ranks one microbatch visits, e.g. 0,1,0")
    p.add_argument(
        "--costs",
        default=None,
        metavar="F,B,W",
        help="forward, full backward and its weight part per segment (default 1,2,1); dynamic "
        "schedules are also built with them (default: one unit per action)",
    )
    p.add_argument("--latency", type=float, default=0.0, help="time of one message between ranks (default 0)")
    p.add_argument("--svg", type=Path, default=None, metavar="FILE", help="write an SVG timeline")
    p.add_argument("--trace", type=Path, default=None, metavar="FILE", help="write a Chrome/Perfetto trace")
    p.add_argument("--json", action="store_true", help="print one JSON object instead of text")
    p.add_argument("--lowered", action="store_true", help="show the grid with sends and receives")
    return p


def main(argv: Sequence[str]) -> int:
    """Run `smp plan`; returns the exit status (0 ok, 2 bad input)."""
    try:
        args = parser().parse_args(list(argv))
    except SystemExit as exit_:
        return int(exit_.code or 0)
    try:
        return _run(args)
    except SMPError as err:
        print(f"smp plan: error: {err}", file=sys.stderr)
        return 2


def _run(args: argparse.Namespace) -> int:
    given = Costs.parse(args.costs) if args.costs else None
    if given is not None and args.latency:
        given = Costs(given.forward, given.backward, given.backward_weight, latency=args.latency)
    plan = build_plan(
        args.pipeline,
        args.pp,
        args.microbatches,
        chain=parse_chain(args.chain) if args.chain else None,
        active_microbatches=args.active_microbatches,
        virtual_stages=args.virtual_stages,
        costs=given,
    )
    sim_costs = given or Costs(latency=args.latency)
    result = simulate(plan, sim_costs, validate=False)
    subtitle = (
        f"{plan.num_ranks} ranks, {plan.num_microbatches} microbatches, chain {','.join(map(str, plan.chain))}; "
        f"bubble {result.bubble_fraction:.3f} (wall share {result.wall_share:.3f}), "
        f"peak in flight {result.peak_in_flight}"
    )
    if args.svg:
        args.svg.write_text(render_svg(result.timeline, title=f"smp plan: {plan.name}", subtitle=subtitle))
    if args.trace:
        args.trace.write_text(render_chrome_trace(result.timeline))
    shown = lower(plan, sim_costs) if args.lowered else plan
    if args.json:
        summary: dict[str, object] = {
            "pipeline": plan.name,
            "num_ranks": plan.num_ranks,
            "num_microbatches": plan.num_microbatches,
            "chain": list(plan.chain),
            "active_microbatches": plan.active_microbatches,
            "costs": {"forward": sim_costs.forward, "backward": sim_costs.backward,
                      "backward_weight": sim_costs.backward_weight, "latency": sim_costs.latency},
        }
        summary.update(result.to_dict())
        summary["actions"] = {str(r): [str(a) for a in acts] for r, acts in shown.actions.items()}
        print(json.dumps(summary))
        return 0
    print(format_grid(shown))
    print()
    print(plan.orders())
    print()
    print(render_ascii(result.timeline))
    print()
    print(
        f"bubble_fraction {result.bubble_fraction:.4f} (idle / ideal compute)   "
        f"wall_share {result.wall_share:.4f}   makespan {result.makespan:g}"
    )
    print(f"{'rank':<6}{'busy':>8}{'idle':>8}{'peak_in_flight':>16}{'peak_activation_bytes':>23}")
    for r in range(plan.num_ranks):
        print(
            f"{r:<6}{result.busy[r]:>8g}{result.idle[r]:>8g}{result.peak_in_flight[r]:>16}"
            f"{result.peak_activation_bytes[r]:>23g}"
        )
    for path, what in ((args.svg, "SVG"), (args.trace, "trace")):
        if path:
            print(f"wrote {what} to {path}")
    return 0
