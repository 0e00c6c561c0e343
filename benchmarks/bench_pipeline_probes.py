"""bench_pipeline's diagnostic modes: paired A/B launches, where each rank's CPU goes, and what a
backward split in two parts costs (``--model paired|threads|split`` of ``bench_pipeline.py``, whose
docstring describes them; they print tables and write no record)."""

from __future__ import annotations

import os
import statistics
import sys
import time
from typing import Any

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import torch  # noqa: E402
from bench_pipeline import _HEAP_ENV, MODELS, M, _data, ours, theirs  # noqa: E402

from examples.gpt_model import lm_loss  # noqa: E402
from tests.helpers.spawn import run_ranks  # noqa: E402


def paired(name: str, rows: list[str], rounds: int, steps: int, warmup: int) -> None:
    """Launch ``rows`` one after the other, ``rounds`` times over, and print each launch's median step.

    A row is ``SIDE:SCHEDULE`` plus flags: SIDE is ``torch`` (hand-written stages), ``manual``,
    ``auto`` or ``paths=a,b,...`` (smp with those modules on rank 1); ``+heap`` gives torch smp's
    glibc heap settings and ``+bind`` smp's core binding; ``+keep`` leaves smp glibc's heap thresholds
    (``SMP_MALLOC_THRESHOLDS=keep``), ``+unbound`` the CPU mask (``SMP_CPU_AFFINITY=keep``), ``+once``
    keeps smp's plan from the recording step, and ``+key=value`` sets that smp config key
    (``+memory_weight=0``). Alternating launches compare rows under the same minute of a machine
    whose speed drifts by 5-10 % between launches.
    """
    base = {"OMP_NUM_THREADS": "1"}
    times: dict[str, list[float]] = {row: [] for row in rows}
    where: dict[str, str] = {}
    for _ in range(rounds):
        for row in rows:
            spec, *flags = row.split("+")
            side, _, schedule = spec.rpartition(":")
            env = {**base, **(_HEAP_ENV if "heap" in flags else {}),
                   **({"SMP_MALLOC_THRESHOLDS": "keep"} if "keep" in flags else {}),
                   **({"SMP_CPU_AFFINITY": "keep"} if "unbound" in flags else {})}
            if side == "torch":
                fn, args, kwargs = theirs, (name, schedule, steps, warmup), {"bind": "bind" in flags}
            else:
                cut = "paths:" + side.partition("=")[2] if side.startswith("paths=") else side
                config = {k: _value(v) for k, _, v in (f.partition("=") for f in flags if "=" in f)}
                fn, args, kwargs = ours, (name, schedule, cut, steps, warmup), {"remeasure": "once" not in flags,
                                                                               "config": config}
            out = run_ranks(fn, 2, args=args, kwargs=kwargs, env=env, timeout=900)
            times[row].append(statistics.median(max(ts) for ts in zip(*(o["times"] for o in out))))
            where[row] = out[0].get("rank1", MODELS[name][4])
    print(f"\npaired launches, model {name}, {rounds} rounds (median step of each launch, in launch order)\n")
    print("| row | ms/step per round | on rank 1 |")
    print("|---|---|---|")
    for row in rows:
        print(f"| {row} | {' / '.join(f'{t * 1e3:.0f}' for t in times[row])} | {where[row]} |", flush=True)


def _value(text: str) -> Any:
    """A config value of a ``+key=value`` row flag: an int, a float, a bool or the string."""
    for parse in (int, float):
        try:
            return parse(text)
        except ValueError:
            pass
    return {"true": True, "false": False}.get(text.lower(), text)


def threads(name: str, steps: int, warmup: int) -> None:
    """Where each rank's CPU goes, torch 1F1B against smp 1f1b with the same hand cut."""
    print(f"\nwhere the CPU goes, model {name}, hand cut, 1F1B, per step after {warmup} warm-up steps "
          f"(median step time; the rest are means over {steps} steps)\n")
    print("| engine | rank | ms/step | CPU ms/step, all threads | model's threads | gloo's I/O thread | the rest "
          "| involuntary switches | page faults | sends (message parts) | KB sent |")
    print("|---|---|---|---|---|---|---|---|---|---|---|")
    env = {"OMP_NUM_THREADS": "1"}
    for label, fn, args in (("torch.distributed.pipelining", theirs, (name, "1f1b", steps, warmup, True)),
                            ("smp (manual)", ours, (name, "1f1b", "manual", steps, warmup, True))):
        out = run_ranks(fn, 2, args=args, env=env, timeout=900)
        t = statistics.median(max(ts) for ts in zip(*(o["times"] for o in out)))
        for rank, o in enumerate(out):
            p = o["probe"]
            rest = max(0.0, p["cpu"] - p["compute"] - p["io"])  # clock granularity: never below 0
            print(f"| {label} | {rank} | {t * 1e3:.0f} | {p['cpu'] * 1e3:.0f} | {p['compute'] * 1e3:.0f} "
                  f"| {p['io'] * 1e3:.0f} | {rest * 1e3:.0f} "
                  f"| {p['nivcsw']:.0f} | {p['minflt']:.0f} | {p['sends']:.0f} | {p['kb']:.0f} |", flush=True)


def split_cost(name: str, steps: int, warmup: int) -> None:
    """One process, one thread: one backward of torch's stage 1 against the same backward in two
    parts (input pass, then weight pass), as smp's zero-bubble W actions run it (engine/split.py)."""
    from smp.torch.engine.split import backward_input

    build, _, stage_of, _, _ = MODELS[name]
    torch.set_num_threads(1)
    torch.manual_seed(0)
    model = build()
    first, second = stage_of(model, 0), stage_of(model, 1)
    whole: list[float] = []
    parts: tuple[list[float], list[float]] = ([], [])
    for step, (x, y) in enumerate(_data(steps + warmup)):
        for xm, ym in zip(x.chunk(M), y.chunk(M)):
            with torch.no_grad():
                h = first(xm)
            for split in (False, True):
                hin = h.clone().requires_grad_()
                loss = lm_loss(second(hin), ym) / M
                start = time.perf_counter()
                if not split:
                    loss.backward()
                    if step >= warmup:
                        whole.append(time.perf_counter() - start)
                    continue
                got = backward_input([loss], [torch.ones_like(loss)], [hin])
                assert got is not None, "this stage's graph does not split"
                mid = time.perf_counter()
                got[1].run()
                if step >= warmup:
                    parts[0].append(mid - start)
                    parts[1].append(time.perf_counter() - mid)
    w, i, wt = (statistics.median(v) * 1e3 for v in (whole, *parts))
    print(f"\nbackward of one microbatch through torch's stage 1 of {name} (one process, one thread, median): "
          f"whole {w:.1f} ms; split: input pass {i:.1f} + weight pass {wt:.1f} = {i + wt:.1f} ms "
          f"({(i + wt) / w:.2f}x)")
