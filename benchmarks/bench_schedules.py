"""Simulated bubble of smp's schedules next to the formula and to torch.distributed.pipelining's plans.

For p in {2, 4, 8, 16} and m in {p, 2p, 4p, 8p}, every schedule is simulated under the same unit
costs: one rank's whole share takes F = 1, B = 2 (split: I = 1, W = 1); with two segments per
rank each segment takes half. torch's plans come from its own generator
(``torch.distributed.pipelining._schedule_visualizer.get_schedule_ops``, which instantiates the
schedule classes and reads their ``pipeline_order``), are converted into smp plans (idle slots
and REDUCE_GRAD dropped, DualPipeV's OVERLAP_F_B expanded into its two parts, run one after the
other), validated by smp's validator, and simulated by smp's simulator. A torch plan the
validator rejects is marked ``invalid`` and listed under the table.

Run (about a minute on 2 CPU cores)::

    .venv/bin/python benchmarks/bench_schedules.py [--quick]

This script may import torch; the library it measures (smp.pipeline) never does.
"""

from __future__ import annotations

import argparse
import os
import sys
import time
from typing import Any

from torch.distributed.pipelining._schedule_visualizer import get_schedule_ops

from smp.pipeline import Action, Costs, Plan, build_plan, check_plan, simulate
from smp.pipeline.chains import looped_chain, vee_chain

UNIT = Costs(forward=1.0, backward=2.0, backward_weight=1.0, activation_bytes=1.0)
HALF = Costs(forward=0.5, backward=1.0, backward_weight=0.5, activation_bytes=0.5)


def torch_plan(name: str, p: int, m: int, stages_per_rank: int | None, chain: tuple[int, ...]) -> Plan:
    """torch's pipeline_order for (p, m) as an smp Plan (compute actions only)."""
    ops = get_schedule_ops(name, p, m, stages_per_rank)
    actions: dict[int, list[Action]] = {}
    for rank, row in enumerate(ops):
        acts: list[Action] = []
        for op in row:
            if op is None:
                continue
            parts = list(op.sub_actions or ()) or [op]
            for part in parts:
                kind = part.computation_type.value
                if kind in ("F", "B", "I", "W"):
                    acts.append(Action.parse(f"{part.stage_index}{kind}{part.microbatch_index}"))
        actions[rank] = acts
    return Plan(f"torch {name}", p, m, chain, m, actions)


def measured(plan: Plan, costs: Costs) -> tuple[str, str]:
    """(bubble cell, problem) for a plan: the simulated bubble, or 'invalid' and why."""
    problems = check_plan(plan)
    if problems:
        return "invalid", problems[0].message
    return f"{simulate(plan, costs, validate=False).bubble_fraction:.3f}", ""


def same(ours: Plan, theirs: Plan) -> bool:
    return all([str(a) for a in ours.actions[r]] == [str(a) for a in theirs.actions[r]] for r in range(ours.num_ranks))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="p in {2, 4} only")
    args = parser.parse_args()
    sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
    started = time.perf_counter()
    ranks = (2, 4) if args.quick else (2, 4, 8, 16)
    header = [
        "p", "m", "(p-1)/m", "gpipe", "torch GPipe", "1f1b", "torch 1F1B", "smp interleaved",
        "(p-1)/2m", "interleaved_1f1b v=2", "torch Interleaved1F1B",
        "(p-1)/3m", "zb_h1", "zb_h1 v=2", "torch InterleavedZB",
        "zb_v", "torch ZBV", "torch DualPipeV",
    ]
    rows: list[list[str]] = []
    notes: dict[str, str] = {}
    identical = {"interleaved_1f1b = torch Interleaved1F1B": 0, "zb_h1 v=2 = torch InterleavedZB": 0, "zb_v = torch ZBV": 0}
    total = 0

    def torch_cell(
        name: str, p: int, m: int, per_rank: int | None, chain: tuple[int, ...], costs: Costs
    ) -> tuple[str, Plan | None]:
        label = name
        try:
            plan = torch_plan(name, p, m, per_rank, chain)
        except (ValueError, AssertionError, RuntimeError) as err:
            notes.setdefault(label, f"torch refuses: {err}")
            return "refused", None
        cell, problem = measured(plan, costs)
        if problem:
            notes.setdefault(label, f"e.g. p={plan.num_ranks} m={plan.num_microbatches}: {problem}")
        return cell, plan

    for p in ranks:
        for m in (p, 2 * p, 4 * p, 8 * p):
            total += 1
            loop2, vee = looped_chain(p, 2), vee_chain(p)
            ours = {
                "gpipe": simulate(build_plan("gpipe", p, m), UNIT).bubble_fraction,
                "1f1b": simulate(build_plan("1f1b", p, m), UNIT).bubble_fraction,
                "interleaved": simulate(build_plan("interleaved", p, m, costs=UNIT), UNIT).bubble_fraction,
            }
            inter = build_plan("interleaved_1f1b", p, m, virtual_stages=2)
            zbh1 = build_plan("zb_h1", p, m)
            zbh1_v2 = build_plan("zb_h1", p, m, virtual_stages=2)
            zbv = build_plan("zb_v", p, m)
            linear = tuple(range(p))
            t_gpipe, _ = torch_cell("GPipe", p, m, None, linear, UNIT)
            t_1f1b, _ = torch_cell("1F1B", p, m, None, linear, UNIT)
            t_inter, t_inter_plan = torch_cell("Interleaved1F1B", p, m, 2, loop2, HALF)
            t_zb, t_zb_plan = torch_cell("InterleavedZeroBubble", p, m, 2, loop2, HALF)
            t_zbv, t_zbv_plan = torch_cell("ZBVZeroBubble", p, m, 2, vee, HALF)
            t_dual, _ = torch_cell("DualPipeV", p, m, 2, vee, HALF)
            for key, mine, theirs in (
                ("interleaved_1f1b = torch Interleaved1F1B", inter, t_inter_plan),
                ("zb_h1 v=2 = torch InterleavedZB", zbh1_v2, t_zb_plan),
                ("zb_v = torch ZBV", zbv, t_zbv_plan),
            ):
                identical[key] += theirs is not None and same(mine, theirs)
            rows.append([
                str(p), str(m), f"{(p - 1) / m:.3f}",
                f"{ours['gpipe']:.3f}", t_gpipe, f"{ours['1f1b']:.3f}", t_1f1b, f"{ours['interleaved']:.3f}",
                f"{(p - 1) / (2 * m):.3f}", f"{simulate(inter, HALF).bubble_fraction:.3f}", t_inter,
                f"{(p - 1) / (3 * m):.3f}", f"{simulate(zbh1, UNIT).bubble_fraction:.3f}",
                f"{simulate(zbh1_v2, HALF).bubble_fraction:.3f}", t_zb,
                f"{simulate(zbv, HALF).bubble_fraction:.3f}", t_zbv, t_dual,
            ])
    print("| " + " | ".join(header) + " |")
    print("|" + "|".join("---:" for _ in header) + "|")
    for row in rows:
        print("| " + " | ".join(row) + " |")
    print()
    for key, count in identical.items():
        print(f"- same per-rank order: {key} in {count}/{total} configurations")
    for label, note in notes.items():
        print(f"- torch {label}: {note}")
    print()
    peaks = memory_table(ranks)
    print(f"\n({time.perf_counter() - started:.1f} s)")
    from records import Table, write_record

    bubbles = Table("Bubble fraction, simulated (smp's plans beside torch.distributed.pipelining's)", header)
    for row in rows:
        bubbles.add(*row)
    facts = Table("Per-rank order and torch's plans", ["check", "result"])
    for key, count in identical.items():
        facts.add(f"same per-rank order: {key}", f"{count}/{total} configurations")
    for label, note in notes.items():
        facts.add(f"torch {label}", note)
    write_record("bench_schedules", [dict(zip(header, row)) for row in rows], settings={"ranks": list(ranks)},
                 tables=[bubbles, facts, peaks],
                 headline=[{"what": "schedules: smp's interleaved_1f1b / zb_h1 / zb_v order equals torch's "
                                    "Interleaved1F1B / InterleavedZB / ZBV",
                            "value": " / ".join(f"{c}/{total}" for c in identical.values())}])


def memory_table(ranks: tuple[int, ...]) -> Any:
    """Peak activations (most on any rank, in units of one microbatch through a rank's share)."""
    cases = [
        ("gpipe", {}, UNIT, ("GPipe", None, False)),
        ("1f1b", {}, UNIT, ("1F1B", None, False)),
        ("interleaved", {}, UNIT, None),
        ("interleaved_1f1b", {"virtual_stages": 2}, HALF, ("Interleaved1F1B", 2, False)),
        ("zb_h1", {}, UNIT, None),
        ("zb_h1", {"virtual_stages": 2}, HALF, ("InterleavedZeroBubble", 2, False)),
        ("zb_v", {}, HALF, ("ZBVZeroBubble", 2, True)),
    ]
    from records import Table

    names = [f"{n}{' v=2' if kw else ''}" for n, kw, _, _ in cases]
    table = Table("Peak activations, in microbatches through a rank's share (ours / torch's plan, where torch "
                  "has the schedule)", ["p", "m", *names])
    print("| p | m | " + " | ".join(names) + " |")
    print("|" + "|".join("---:" for _ in range(len(cases) + 2)) + "|")
    for p in ranks:
        m = 4 * p
        cells = []
        for name, kwargs, costs, theirs in cases:
            ours = max(simulate(build_plan(name, p, m, **kwargs), costs).peak_activation_bytes)  # type: ignore[arg-type]
            cell = f"{ours:g}"
            if theirs is not None:
                torch_name, per_rank, v_shape = theirs
                chain = vee_chain(p) if v_shape else (looped_chain(p, 2) if per_rank else tuple(range(p)))
                plan = torch_plan(torch_name, p, m, per_rank, chain)
                cell += " / " + (f"{max(simulate(plan, costs, validate=False).peak_activation_bytes):g}" if not check_plan(plan) else "invalid")
            cells.append(cell)
        print(f"| {p} | {m} | " + " | ".join(cells) + " |")
        table.add(p, m, *cells)
    print("\n(ours / torch's plan, where torch has the schedule)")
    return table


if __name__ == "__main__":
    main()
