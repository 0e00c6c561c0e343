"""smp's pipeline engine against torch.distributed.pipelining on the same GPT, 2 CPU ranks (gloo).

Model: 8 layers, width 256, seq 128, vocab 4096; one step = 8 microbatches of 2 sequences. Both
sides cut the same stages (embedding + blocks 0-3 | blocks 4-7 + head), run with one thread per
rank, and report the median step time after warm-up; one launch per side. Printed: each side's
time, ours/theirs, the single-process time, and the 1F1B limit
``single / p * (m + p - 1) / m``.

    .venv/bin/python benchmarks/bench_pipeline.py [--steps 8] [--warmup 2]
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time
from typing import Any

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)

import torch  # noqa: E402

from examples.gpt_model import gpt, lm_loss  # noqa: E402
from tests.helpers.spawn import run_ranks  # noqa: E402

M, MB, SEQ, VOCAB = 8, 2, 128, 4096


def _data(steps: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
    g = torch.Generator().manual_seed(0)
    out = []
    for _ in range(steps):
        ids = torch.randint(0, VOCAB, (M * MB, SEQ + 1), generator=g)
        out.append((ids[:, :-1], ids[:, 1:]))
    return out


def single(steps: int, warmup: int) -> list[float]:
    torch.set_num_threads(1)
    torch.manual_seed(0)
    model = gpt()
    times = []
    for x, y in _data(steps + warmup):
        start = time.perf_counter()
        model.zero_grad()
        for xm, ym in zip(x.chunk(M), y.chunk(M)):
            (lm_loss(model(xm), ym) / M).backward()
        times.append(time.perf_counter() - start)
    return times[warmup:]


def theirs(schedule: str, steps: int, warmup: int) -> list[float]:
    import torch.distributed as dist
    from torch.distributed.pipelining import PipelineStage, Schedule1F1B, ScheduleGPipe

    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method="file://" + os.environ["SMP_RENDEZVOUS_FILE"],
                            rank=int(os.environ["RANK"]), world_size=2)
    rank = dist.get_rank()
    torch.manual_seed(0)
    model = gpt()
    part = torch.nn.Sequential(*list(model)[:5]) if rank == 0 else torch.nn.Sequential(*list(model)[5:])
    stage = PipelineStage(part, rank, 2, torch.device("cpu"))
    cls = {"1f1b": Schedule1F1B, "gpipe": ScheduleGPipe}[schedule]
    sched = cls(stage, n_microbatches=M, loss_fn=lm_loss)
    times = []
    for x, y in _data(steps + warmup):
        dist.barrier()
        start = time.perf_counter()
        part.zero_grad()
        if rank == 0:
            sched.step(x)
        else:
            sched.step(target=y, losses=[])
        times.append(time.perf_counter() - start)
    return times[warmup:]


def ours(schedule: str, steps: int, warmup: int) -> list[float]:
    import smp.torch as smp

    torch.set_num_threads(1)
    smp.init({"pipeline_parallel_degree": 2, "microbatches": M, "pipeline": schedule,
              "active_microbatches": M if schedule == "simple" else 4, "auto_partition": False,
              "default_partition": 0})
    torch.manual_seed(0)
    net = gpt()
    model = smp.DistributedModel(net)
    for layer in list(net)[5:]:
        smp.set_partition(layer, 1)
    model.register_post_partition_hook(lambda *_: None)

    @smp.step
    def train_step(model: Any, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        loss = lm_loss(model(x), y)
        model.backward(loss)
        return loss

    times = []
    for x, y in _data(steps + warmup):
        smp.barrier()
        start = time.perf_counter()
        model.zero_grad()
        train_step(model, x, y)
        times.append(time.perf_counter() - start)
    return times[warmup:]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--steps", type=int, default=8)
    parser.add_argument("--warmup", type=int, default=2)
    args = parser.parse_args()
    env = {"OMP_NUM_THREADS": "1"}
    one = statistics.median(single(args.steps, args.warmup))
    rows = []
    for label, fn, sched in (("torch.distributed.pipelining", theirs, "1f1b"),
                             ("torch.distributed.pipelining", theirs, "gpipe"),
                             ("smp", ours, "1f1b"), ("smp", ours, "interleaved"), ("smp", ours, "simple")):
        times = run_ranks(fn, 2, args=(sched, args.steps, args.warmup), env=env, timeout=900)
        rows.append((label, sched, statistics.median(max(t) for t in zip(*times))))
    p = 2
    limit = one / p * (M + p - 1) / M
    best_theirs = min(t for label, _, t in rows if label != "smp")
    print(f"single process, 1 thread, {M} microbatches of {MB}: {one * 1e3:.0f} ms/step")
    print(f"1F1B limit single/p*(m+p-1)/m = {limit * 1e3:.0f} ms\n")
    print("| engine | schedule | ms/step (median) | / best torch | / 1F1B limit | speedup vs 1 process |")
    print("|---|---|---|---|---|---|")
    for label, sched, t in rows:
        print(f"| {label} | {sched} | {t * 1e3:.0f} | {t / best_theirs:.3f} | {t / limit:.3f} | {one / t:.2f}x |")


if __name__ == "__main__":
    main()
