"""The main demo: train a small GPT pipelined over CPU ranks with an SMP v1-style script.

    torchrun --nproc-per-node 2 examples/train_gpt.py --steps 60 --out demo-output

The model is ``GPT`` from ``gpt_model.py``, written the way users write one: an ``nn.Module`` whose
blocks are an ``nn.ModuleList`` run by a ``for`` loop. The text is the source of a few Python
standard-library modules (it ships with Python: nothing is downloaded), read as bytes. The model
is partitioned automatically on the first step (the cut falls between blocks); rank 0
shows a progress bar, then writes the measured timeline of the last step (SVG + Chrome trace), the
planned one for comparison, and the loss curve.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from typing import Any

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import smp.torch as smp  # was: import smdistributed.modelparallel.torch as smp  # noqa: E402

from examples.gpt_model import GPT, lm_loss  # noqa: E402

CORPUS = ["argparse.py", "dataclasses.py", "textwrap.py", "collections/__init__.py", "json/encoder.py",
          "functools.py", "string.py", "shutil.py"]


def corpus() -> torch.Tensor:
    root = os.path.dirname(os.__file__)
    data = b"".join(open(os.path.join(root, name), "rb").read() for name in CORPUS)
    return torch.tensor(list(data), dtype=torch.long)


def batches(data: torch.Tensor, steps: int, batch: int, seq: int, seed: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
    g = torch.Generator().manual_seed(seed)
    out = []
    for _ in range(steps):
        starts = torch.randint(0, len(data) - seq - 1, (batch,), generator=g)
        window = torch.stack([data[s:s + seq + 1] for s in starts.tolist()])
        out.append((window[:, :-1], window[:, 1:]))
    return out


def bar(done: int, total: int, loss: float, tps: float, width: int = 30) -> str:
    filled = int(width * done / total)
    return f"\r[{'#' * filled}{'.' * (width - filled)}] step {done}/{total}  loss {loss:.3f}  {tps:,.0f} tokens/s"


def loss_svg(losses: list[float], path: str) -> None:
    w, h, pad = 640, 320, 40
    lo, hi = min(losses), max(losses)
    pts = " ".join(f"{pad + (w - 2 * pad) * i / max(1, len(losses) - 1):.1f},"
                   f"{h - pad - (h - 2 * pad) * (v - lo) / max(1e-9, hi - lo):.1f}" for i, v in enumerate(losses))
    svg = (f'<svg xmlns="http://www.w3.org/2000/svg" width="{w}" height="{h}" font-family="sans-serif" '
           f'font-size="12"><rect width="{w}" height="{h}" fill="white"/>'
           f'<text x="{pad}" y="20">training loss per step ({len(losses)} steps)</text>'
           f'<line x1="{pad}" y1="{h - pad}" x2="{w - pad}" y2="{h - pad}" stroke="#888"/>'
           f'<line x1="{pad}" y1="{pad}" x2="{pad}" y2="{h - pad}" stroke="#888"/>'
           f'<text x="4" y="{pad + 4}">{hi:.2f}</text><text x="4" y="{h - pad}">{lo:.2f}</text>'
           f'<polyline fill="none" stroke="#1f77b4" stroke-width="2" points="{pts}"/></svg>')
    with open(path, "w", encoding="utf-8") as f:
        f.write(svg)


def sparkline(values: list[float], width: int = 60) -> str:
    ticks = "▁▂▃▄▅▆▇█"
    step = max(1, len(values) // width)
    picked = values[::step]
    lo, hi = min(picked), max(picked)
    return "".join(ticks[int((v - lo) / max(1e-9, hi - lo) * (len(ticks) - 1))] for v in picked)


def main() -> None:
    parser = argparse.ArgumentParser(description="Train a small GPT pipelined across CPU ranks with smp.")
    parser.add_argument("--steps", type=int, default=60)
    parser.add_argument("--microbatches", type=int, default=8)
    parser.add_argument("--microbatch-size", type=int, default=4)
    parser.add_argument("--seq", type=int, default=64)
    parser.add_argument("--layers", type=int, default=6)
    parser.add_argument("--width", type=int, default=128)
    parser.add_argument("--pipeline", default="1f1b")
    parser.add_argument("--out", default="demo-output")
    args = parser.parse_args()
    torch.set_num_threads(1)

    smp.init({"pipeline_parallel_degree": int(os.environ.get("WORLD_SIZE", "1")), "microbatches": args.microbatches,
              "pipeline": args.pipeline, "auto_partition": True})
    torch.manual_seed(0)
    model = smp.DistributedModel(GPT(vocab=256, width=args.width, layers=args.layers, heads=4, seq=args.seq))
    optimizer = smp.DistributedOptimizer(torch.optim.Adam(model.parameters(), lr=3e-3))

    @smp.step
    def train_step(model: Any, ids: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        loss = lm_loss(model(ids), targets)
        model.backward(loss)
        return loss

    data = batches(corpus(), args.steps, args.microbatches * args.microbatch_size, args.seq, seed=smp.dp_rank())
    tokens = args.microbatches * args.microbatch_size * args.seq
    losses: list[float] = []
    start = time.perf_counter()
    for i, (ids, targets) in enumerate(data):
        optimizer.zero_grad()
        loss = train_step(model, ids, targets).reduce_mean()
        optimizer.step()
        losses.append(loss.item())
        if smp.rank() == 0:
            tps = tokens * (i + 1) / (time.perf_counter() - start)
            print(bar(i + 1, args.steps, losses[-1], tps), end="", flush=True)
    timeline = model.step_timeline(title=f"measured step {args.steps}: {args.pipeline}, "
                                         f"{args.microbatches} microbatches, {smp.pp_size()} ranks")
    if smp.rank() != 0:
        return
    from smp.pipeline import build_plan, render_ascii, render_chrome_trace, render_svg, simulate

    os.makedirs(args.out, exist_ok=True)
    with open(os.path.join(args.out, "timeline.svg"), "w", encoding="utf-8") as f:
        f.write(render_svg(timeline))
    with open(os.path.join(args.out, "timeline.trace.json"), "w", encoding="utf-8") as f:
        f.write(render_chrome_trace(timeline))
    loss_svg(losses, os.path.join(args.out, "loss.svg"))
    chain = model.plans and next(iter(model.plans.values())).chain
    plan = build_plan(args.pipeline, smp.pp_size(), args.microbatches, chain=chain or None)
    sim = simulate(plan)
    with open(os.path.join(args.out, "plan.svg"), "w", encoding="utf-8") as f:
        f.write(render_svg(sim.timeline, title=f"planned: {args.pipeline}, chain {chain}",
                           subtitle=f"bubble fraction {sim.bubble_fraction:.3f} (unit costs)"))
    with open(os.path.join(args.out, "losses.json"), "w", encoding="utf-8") as f:
        json.dump(losses, f)
    busy = [sum(e.duration for e in lane) for lane in timeline.by_rank()]
    print(f"\n\nloss {losses[0]:.3f} -> {losses[-1]:.3f}   {sparkline(losses)}")
    print(f"\nmeasured timeline of the last step ({timeline.makespan:.0f} ms; busy per rank "
          f"{', '.join(f'{b / timeline.makespan:.0%}' for b in busy)}):")
    print(render_ascii(timeline, max_width=110))
    print(f"\nwrote {args.out}/timeline.svg, timeline.trace.json (open in Perfetto), plan.svg, loss.svg")


if __name__ == "__main__":
    main()
