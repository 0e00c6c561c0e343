"""smp against torch.distributed.pipelining on Hugging Face Llamas of several shapes, called as users call them.

Each shape is an unmodified ``LlamaForCausalLM`` built from config and trained the Hugging Face way:
``model(input_ids=ids, labels=ids).loss`` (the model's own loss), ``model.backward(loss)`` and
``optimizer.step()`` (AdamW) inside the timed step. On 2 CPU ranks (gloo, one thread each), in
**one launch per shape**, the rows take turns round after round (paired rounds, so a machine whose
speed drifts between minutes drifts for every row alike):

- ``torch 1F1B`` / ``torch GPipe``: torch.distributed.pipelining on the hand cut (first half of the
  decoder layers with the embedding | second half with the norm, head and loss), AdamW over the
  stage's parameters stepped in the timed step;
- ``smp defaults``: ``{"pipeline_parallel_degree": 2, "microbatches": m}`` and nothing else;
- ``smp best``: automatic partitioning with ``pipeline: "zb_v"``, ``virtual_stages: 2``,
  ``memory_weight: 0``.

Both sides run with smp's CPU settings (glibc heap thresholds, each rank bound to its own core),
set once at the start of the launch. Per shape the table gives the single-process step (same
optimizer), the compute per microbatch per stage (single / m / 2), and per row the median over
rounds of each round's median step (the slower rank's), the spread (min-max of the round medians)
and the ratio to torch 1F1B of the same round (median and range over rounds). A second table shows
where smp's step goes: each hand-cut stage's forward and backward timed alone in one process (times
the microbatches), beside each smp rank's measured timeline of its last step (busy time of its
forward, backward and weight actions, its idle time between them, the rest of the step, and the
optimizer). ``--smp-row pipeline=1f1b`` adds an smp row with those config keys (printed, not recorded);
``--kernels`` instead times the matrix multiplications of torch 1F1B's and smp's ranks (printed).

    .venv/bin/python benchmarks/bench_sweep.py [--shapes all|NAME,...] [--rounds 5] [--steps 4] [--warmup 2]
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
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import torch  # noqa: E402
from bench_pipeline import _LlamaLayers as _Stage  # noqa: E402 - the hand cut's stages, as bench_pipeline's
from bench_pipeline_probes import _value  # noqa: E402 - a config value from the command line
from records import Table, write_record  # noqa: E402
from torch import nn  # noqa: E402

from tests.helpers.spawn import run_ranks  # noqa: E402

# name -> (layers, hidden, mlp, heads, kv heads, seq, microbatches, rows per microbatch)
SHAPES: dict[str, tuple[int, int, int, int, int, int, int, int]] = {
    "h128-mha-s512-m4": (8, 128, 512, 4, 4, 512, 4, 2),
    "h256-gqa-s128-m8": (8, 256, 688, 8, 4, 128, 8, 2),  # the shape of the issue that found the gap
    "h512-gqa-s64-m16": (8, 512, 1376, 8, 2, 64, 16, 1),
    "h1024-mha-s128-m4": (4, 1024, 4096, 16, 16, 128, 4, 1),
    "h256-gqa-s16-m64": (8, 256, 688, 8, 4, 16, 64, 1),  # many small microbatches: per-action costs
}
VOCAB = 4096
ROWS = ("torch 1F1B", "torch GPipe", "smp defaults", "smp best")
BEST = {"pipeline": "zb_v", "virtual_stages": 2, "memory_weight": 0.0}


def _llama(shape: str) -> Any:
    import transformers

    layers, hidden, mlp, heads, kv, seq, _, _ = SHAPES[shape]
    cfg = transformers.LlamaConfig(vocab_size=VOCAB, hidden_size=hidden, intermediate_size=mlp,
                                   num_hidden_layers=layers, num_attention_heads=heads, num_key_value_heads=kv,
                                   max_position_embeddings=seq, use_cache=False)
    torch.manual_seed(0)
    return transformers.AutoModelForCausalLM.from_config(cfg, attn_implementation="sdpa")


def _batches(shape: str, count: int) -> list[torch.Tensor]:
    *_, seq, m, rows = SHAPES[shape]
    g = torch.Generator().manual_seed(0)
    return [torch.randint(0, VOCAB, (m * rows, seq), generator=g) for _ in range(count)]


def _hf_loss(logits: torch.Tensor, ids: torch.Tensor) -> torch.Tensor:
    """What ``LlamaForCausalLM`` computes from ``labels=ids``: next-token cross-entropy."""
    return nn.functional.cross_entropy(logits[:, :-1].reshape(-1, logits.shape[-1]).float(), ids[:, 1:].reshape(-1))


def single(shape: str, steps: int, warmup: int) -> float:
    """One process, one thread: the median step (forward, backward, AdamW) over the whole batch."""
    torch.set_num_threads(1)
    model = _llama(shape)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4)
    *_, m, rows = SHAPES[shape]
    times = []
    for ids in _batches(shape, steps + warmup):
        start = time.perf_counter()
        opt.zero_grad()
        for mb in ids.chunk(m):
            (model(input_ids=mb, labels=mb).loss / m).backward()
        opt.step()
        times.append(time.perf_counter() - start)
    return statistics.median(times[warmup:])


def stage_compute(shape: str, steps: int, warmup: int) -> list[tuple[float, float]]:
    """One process, one thread: (forward, backward) seconds of one microbatch through each stage of the
    hand cut (the last with the loss), the median over the microbatches of ``steps`` steps."""
    torch.set_num_threads(1)
    hf = _llama(shape)
    stages = (_Stage(hf, True), _Stage(hf, False))
    *_, m, _ = SHAPES[shape]
    got: list[list[float]] = [[], [], [], []]
    for step, ids in enumerate(_batches(shape, steps + warmup)):
        for mb in ids.chunk(m):
            t0 = time.perf_counter()
            h = stages[0](mb)
            t1 = time.perf_counter()
            hin = h.detach().requires_grad_()
            loss = _hf_loss(stages[1](hin), mb) / m
            t2 = time.perf_counter()
            loss.backward()
            t3 = time.perf_counter()
            h.backward(hin.grad)
            t4 = time.perf_counter()
            if step >= warmup:
                for i, t in enumerate((t1 - t0, t4 - t3, t2 - t1, t3 - t2)):
                    got[i].append(t)
    med = [statistics.median(v) for v in got]
    return [(med[0], med[1]), (med[2], med[3])]


_PROFILED: dict[str, float] = {}  # the last profiled step's figures (``--kernels``), read right after its row


def _profiled(on: bool) -> Any:
    """With ``on``: a profiler over every thread of this rank whose figures land in `_PROFILED`."""
    import contextlib

    from torch.profiler import ProfilerActivity, profile

    if not on:
        return contextlib.nullcontext()

    @contextlib.contextmanager
    def run() -> Any:
        config = torch._C._profiler._ExperimentalConfig(profile_all_threads=True)  # smp's microbatch threads
        start = time.perf_counter()
        with profile(activities=[ProfilerActivity.CPU], experimental_config=config) as prof:
            yield
        wall = time.perf_counter() - start
        ops = prof.key_averages()
        mm = [e for e in ops if e.key == "aten::mm"]
        _PROFILED.clear()
        _PROFILED.update({"mm_ms": sum(e.self_cpu_time_total for e in mm) / 1e3, "mm_calls": sum(e.count for e in mm),
                         "ops_ms": sum(e.self_cpu_time_total for e in ops) / 1e3, "wall_ms": wall * 1e3})

    return run()


def _torch_row(shape: str, schedule: str, batches: list[torch.Tensor], profile_last: bool = False) -> list[float]:
    import torch.distributed as dist
    from torch.distributed.pipelining import PipelineStage, Schedule1F1B, ScheduleGPipe

    rank = dist.get_rank()
    part = _Stage(_llama(shape), rank == 0)
    opt = torch.optim.AdamW(part.parameters(), lr=1e-4)
    stage = PipelineStage(part, rank, 2, torch.device("cpu"))
    m = SHAPES[shape][6]
    sched = (Schedule1F1B if schedule == "1f1b" else ScheduleGPipe)(stage, n_microbatches=m, loss_fn=_hf_loss)
    times = []
    for ids in batches:
        dist.barrier()
        start = time.perf_counter()
        opt.zero_grad()
        with _profiled(profile_last and ids is batches[-1]):
            if rank == 0:
                sched.step(ids)
            else:
                sched.step(target=ids, losses=[])
        opt.step()
        times.append(time.perf_counter() - start)
    return times


def _smp_row(shape: str, extra: dict[str, Any], batches: list[torch.Tensor], profile_last: bool = False
             ) -> tuple[list[float], str, dict[str, float]]:
    import smp.torch as smp

    smp.init({"pipeline_parallel_degree": 2, "microbatches": SHAPES[shape][6], **extra})
    model = smp.DistributedModel(_llama(shape))
    opt = smp.DistributedOptimizer(torch.optim.AdamW(model.parameters(), lr=1e-4))

    @smp.step
    def train_step(model: Any, ids: torch.Tensor) -> torch.Tensor:
        loss = model(input_ids=ids, labels=ids).loss
        model.backward(loss)
        return loss

    times, optimizer = [], []
    for ids in batches:
        smp.barrier()
        start = time.perf_counter()
        opt.zero_grad()
        with _profiled(profile_last and ids is batches[-1]):
            train_step(model, ids)
        stepped = time.perf_counter()
        opt.step()
        times.append(time.perf_counter() - start)
        optimizer.append(time.perf_counter() - stepped)
    from smp.state import current

    # Where this rank's last step went: its actions' busy time by kind (F, B, W), the idle time
    # between its first and last action, and the rest of the step (before, after, the optimizer).
    done = [e for e in model.last_timeline if e.end]
    breakdown = {kind: sum(e.end - e.start for e in done if e.kind == kind) for kind in ("F", "B", "W")}
    span = max(e.end for e in done) - min(e.start for e in done) if done else 0.0
    breakdown |= {"idle": span - sum(breakdown.values()), "optimizer": optimizer[-1],
                  "outside": times[-1] - span - optimizer[-1], "step": times[-1]}
    # smp's own CPU in that step (the engine's counts, wire.Costs): messages, calls made, requests served.
    costs = model.engine.costs
    breakdown |= {"messages": costs.send_s + costs.receive_s, "calls": costs.call_s, "served": costs.serve_s,
                  "n_messages": costs.sent + costs.received, "n_calls": costs.calls, "n_served": costs.served}

    plan = next(iter(model.plans.values())) if model.plans else None
    decided = (plan.schedule if plan is not None else "") or current().cfg.pipeline
    rank1 = _compact(model.partition_assignment)
    smp.reset()
    return times, f"{decided} chain {len(plan.chain) if plan else 0}; rank 1: {rank1}", breakdown


def _compact(assignment: dict[str, int]) -> str:
    """What rank 1 holds: its whole decoder layers as a range, the parts of a layer cut inside it
    (``4.mlp``), and the other top modules.

    Example:
        >>> _compact({"model.layers.4.self_attn": 0, "model.layers.4.mlp": 1, "model.layers.5.mlp": 1,
        ...           "model.layers.5.self_attn": 1, "lm_head": 1, "model": 0})
        'layers 4.mlp, 5, lm_head'
    """
    parts: dict[int, dict[str, int]] = {}
    for path, rank in assignment.items():
        bits = path.split(".")
        if path.startswith("model.layers.") and len(bits) == 4:
            parts.setdefault(int(bits[2]), {})[bits[3]] = rank
    layers: list[str] = []  # in layer order: a run of whole layers as "5-7", a layer cut inside as "4.mlp"
    run: list[int] = []

    def close_run() -> None:
        if run:
            layers.append(f"{run[0]}-{run[-1]}" if len(run) > 1 else str(run[0]))
            run.clear()

    for i in sorted(parts):
        if all(r == 1 for r in parts[i].values()):
            if run and i != run[-1] + 1:
                close_run()
            run.append(i)
        else:
            close_run()
            layers += [f"{i}.{name}" for name, r in parts[i].items() if r == 1 and "norm" not in name]
    close_run()
    others = sorted(p for p, r in assignment.items() if r == 1 and p.count(".") <= 1 and not p.startswith("model.layers")
                    and p != "model")
    return ", ".join((["layers " + ", ".join(layers)] if layers else []) + others)


def launch(shape: str, rounds: int, steps: int, warmup: int,
           extra: dict[str, dict[str, Any]] | None = None, kernels: bool = False) -> dict[str, Any]:
    """One rank of the paired launch: every row, round after round; the slower rank's steps come back.

    ``extra``: more smp rows, by name, with the config keys each sets over the defaults. ``kernels``:
    only torch 1F1B and smp's defaults, each round's last step profiled (``--kernels``)."""
    import torch.distributed as dist
    from smp.torch.runtime import affinity
    from smp.torch.runtime.heap import keep_freed_memory, share_heap

    torch.set_num_threads(1)
    share_heap()
    keep_freed_memory()
    dist.init_process_group("gloo", init_method="file://" + os.environ["SMP_RENDEZVOUS_FILE"],
                            rank=int(os.environ["RANK"]), world_size=2)
    affinity.bind(dist.get_rank(), 2)  # smp.init leaves an existing binding as it is
    extra = extra or {}
    order = ["torch 1F1B", "smp defaults"] if kernels else [*ROWS, *extra]
    contention = _contention(shape, steps, warmup) if kernels else {}
    out: dict[str, Any] = {row: [] for row in order} | {"kernels": {row: [] for row in order}}
    notes: dict[str, str] = {}
    for _ in range(rounds):
        for row in order:
            batches = _batches(shape, steps + warmup)
            if row.startswith("torch"):
                times = _torch_row(shape, "1f1b" if "1F1B" in row else "gpipe", batches, kernels)
            else:
                times, notes[row], mine = _smp_row(shape, BEST if row == "smp best" else extra.get(row, {}), batches,
                                                   kernels)
            if kernels:
                per_rank: list[Any] = [None, None]
                dist.all_gather_object(per_rank, dict(_PROFILED))
                out["kernels"][row].append(per_rank)
            if row == "smp defaults":
                ranks: list[Any] = [None, None]
                dist.all_gather_object(ranks, mine)
                out["breakdown"] = ranks
            slower = torch.tensor(times[warmup:])
            dist.all_reduce(slower, op=dist.ReduceOp.MAX)
            out[row].append(statistics.median(slower.tolist()))
    out["notes"] = notes
    out["contention"] = contention
    return out


def _contention(shape: str, steps: int, warmup: int) -> dict[str, list[float]]:
    """Each rank's hand-cut stage (forward and backward of every microbatch, no communication) timed
    while the other rank waits, then while the other runs its own stage on the other core."""
    import torch.distributed as dist

    rank = dist.get_rank()
    part = _Stage(_llama(shape), rank == 0)
    *_, seq, m, rows = SHAPES[shape]
    hidden = SHAPES[shape][1]
    microbatches = _batches(shape, 1)[0].chunk(m)
    h = torch.randn(rows, seq, hidden)

    def stage() -> float:
        start = time.perf_counter()
        for ids in microbatches:
            if rank == 0:
                part(ids).sum().backward()
            else:
                _hf_loss(part(h.requires_grad_()), ids).backward()
        return time.perf_counter() - start

    out: dict[str, list[float]] = {"alone": [], "together": []}
    for step in range(steps + warmup):
        for turn in (0, 1):  # each rank alone, the other waiting in the barrier
            dist.barrier()
            took = stage() if rank == turn else 0.0
            dist.barrier()
            if rank == turn and step >= warmup:
                out["alone"].append(took)
        dist.barrier()
        took = stage()
        if step >= warmup:
            out["together"].append(took)
    return out


def _per_item(count: int, seconds: float) -> str:
    """``count`` items costing ``seconds`` in all: '640 x 62 us = 40 ms'."""
    return f"{count} x {seconds / count * 1e6:.0f} us = {seconds * 1e3:.0f} ms" if count else "0"


def _spread(values: list[float]) -> str:
    return f"{min(values):.2f}-{max(values):.2f}"


def kernels(shape: str, rounds: int, steps: int, warmup: int) -> None:
    """Print each rank's matmul time in one step of torch 1F1B and of smp's defaults, paired rounds.

    Where smp's cut is the hand cut (h512: equal ``aten::mm`` counts, shown), each rank runs the same
    calls in both, and the difference in their time is how fast the same kernels run in each engine;
    where the counts differ, the cuts do and the times are not comparable."""
    both = run_ranks(launch, 2, args=(shape, rounds, steps, warmup, None, True), timeout=3600,
                     env={"OMP_NUM_THREADS": "1"})
    print(f"\n{shape}: each rank's hand-cut stage (F + B of {SHAPES[shape][6]} microbatches, no communication), "
          "median ms: alone (the other rank waiting) / while the other rank runs its stage: " + "; ".join(
              f"rank {r}: {statistics.median(o['contention']['alone']) * 1e3:.0f} / "
              f"{statistics.median(o['contention']['together']) * 1e3:.0f}" for r, o in enumerate(both)))
    got = both[0]["kernels"]
    print(f"\n{shape}: aten::mm self time in one step, ms (calls), all threads of each rank; {rounds} paired rounds; "
          "'both busy' is the least time both ranks computed at once (the self time of all ops of each rank, "
          "summed, less the step)\n")
    print("| round | torch rank 0 | smp rank 0 | smp / torch | torch rank 1 | smp rank 1 | smp / torch "
          "| all ops, smp / torch (rank 0, rank 1) | both busy, torch / smp |")
    print("|---|---|---|---|---|---|---|---|---|")
    ratios: list[list[float]] = [[], []]
    all_ops: list[list[float]] = [[], []]

    def both_busy(ranks: list[dict[str, float]]) -> float:
        return ranks[0]["ops_ms"] + ranks[1]["ops_ms"] - max(r["wall_ms"] for r in ranks)

    for i, (theirs, ours) in enumerate(zip(got["torch 1F1B"], got["smp defaults"])):
        cells = []
        for r in (0, 1):
            ratios[r].append(ours[r]["mm_ms"] / theirs[r]["mm_ms"])
            all_ops[r].append(ours[r]["ops_ms"] / theirs[r]["ops_ms"])
            cells += [f"{theirs[r]['mm_ms']:.0f} ({theirs[r]['mm_calls']})", f"{ours[r]['mm_ms']:.0f} ({ours[r]['mm_calls']})",
                      f"{ratios[r][-1]:.2f}"]
        cells.append(f"{all_ops[0][-1]:.2f}, {all_ops[1][-1]:.2f}")
        cells.append(f"{both_busy(theirs):.0f} / {both_busy(ours):.0f}")
        print(f"| {i + 1} | " + " | ".join(cells) + " |", flush=True)
    print("| median | | | " + f"{statistics.median(ratios[0]):.2f} ({_spread(ratios[0])})"
          + " | | | " + f"{statistics.median(ratios[1]):.2f} ({_spread(ratios[1])}) | "
          + ", ".join(f"{statistics.median(a):.2f} ({_spread(a)})" for a in all_ops) + " | |")


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--shapes", default="all", help="all, or names of SHAPES separated by commas")
    p.add_argument("--rounds", type=int, default=5)
    p.add_argument("--steps", type=int, default=4)
    p.add_argument("--warmup", type=int, default=2)
    p.add_argument("--smp-row", action="append", default=[], metavar="KEY=VALUE,...",
                   help="an extra smp row with these config keys (e.g. pipeline=1f1b); printed, not recorded")
    p.add_argument("--kernels", action="store_true",
                   help="only: the matmul time of torch 1F1B's and smp's ranks, per round (profiled; not recorded)")
    args = p.parse_args()
    extra = {f"smp {spec}": {k: _value(v) for k, _, v in (kv.partition("=") for kv in spec.split(","))}
             for spec in args.smp_row}
    shapes = list(SHAPES) if args.shapes == "all" else args.shapes.split(",")
    table = Table(f"Hugging Face Llama shapes, 2 ranks, {args.rounds} paired rounds (ratios to torch 1F1B of the "
                  "same round: median and range)",
                  ["shape", "1 process ms", "ms per microbatch per stage", *[f"{r} ms" for r in ROWS],
                   "smp defaults / 1F1B", "smp best / 1F1B", "torch GPipe / 1F1B", "smp's decisions"])
    where = Table("Where smp's step goes (defaults, the last step of the last round; ms per step): each stage's "
                  "compute alone, in one process, times the microbatches, then per rank of smp the busy time of "
                  "its forward / backward / weight actions, the idle time between its first and last action, "
                  "and the rest of the step besides the optimizer; the last column is the busier rank's busy time "
                  "and optimizer over torch 1F1B's median step: no schedule steps faster than that rank computes, "
                  "at the speed its kernels run in the pipeline; the last two, smp's own CPU time on each rank in that "
                  "step, within its actions: messages sent and received, calls made to modules on the other rank, "
                  "requests of the other rank served (less the modules' own compute), each as count x microseconds "
                  "per item = ms",
                  ["shape", "stage compute alone (F + B, rank 0 / rank 1)", "smp rank 0: F / B / W, idle, rest",
                   "smp rank 1: F / B / W, idle, rest", "optimizer (rank 0 / 1)", "step",
                   "busier rank's compute / torch 1F1B", "smp's own work, rank 0: messages; calls; served",
                   "smp's own work, rank 1: messages; calls; served"])
    if args.kernels:
        for shape in shapes:
            kernels(shape, args.rounds, args.steps, args.warmup)
        return
    print(table.markdown(), flush=True)
    rows = []
    for shape in shapes:
        one = single(shape, args.steps, args.warmup)
        alone = stage_compute(shape, args.steps, args.warmup)
        per_mb = one / SHAPES[shape][6] / 2
        got = run_ranks(launch, 2, args=(shape, args.rounds, args.steps, args.warmup, extra), timeout=3600,
                        env={"OMP_NUM_THREADS": "1"})[0]
        for row in extra:  # exploratory rows: printed beside the table, not in the record
            share = [t / b for t, b in zip(got[row], got["torch 1F1B"])]
            print(f"  {shape} {row}: {statistics.median(got[row]) * 1e3:.0f} ms, / 1F1B {statistics.median(share):.2f} "
                  f"({_spread(share)}); {got['notes'][row]}", flush=True)
            del got["notes"][row]
        ratio = {r: [t / b for t, b in zip(got[r], got["torch 1F1B"])] for r in ROWS}
        cells = [f"{statistics.median(got[r]) * 1e3:.0f} ({_spread([t * 1e3 for t in got[r]])})" for r in ROWS]
        ratios = [f"{statistics.median(ratio[r]):.2f} ({_spread(ratio[r])})"
                  for r in ("smp defaults", "smp best", "torch GPipe")]
        notes = "; ".join(f"{k}: {v}" for k, v in got["notes"].items())
        table.add(shape, f"{one * 1e3:.0f}", f"{per_mb * 1e3:.1f}", *cells, *ratios, notes)
        print("| " + " | ".join(table.rows[-1]) + " |", flush=True)
        m = SHAPES[shape][6]
        parts = got["breakdown"]
        where.add(shape, " / ".join(f"{f * m * 1e3:.0f} + {b * m * 1e3:.0f}" for f, b in alone),
                  *[f"{p['F'] * 1e3:.0f} / {p['B'] * 1e3:.0f} / {p['W'] * 1e3:.0f}, {p['idle'] * 1e3:.0f}, "
                    f"{p['outside'] * 1e3:.0f}" for p in parts],
                  " / ".join(f"{p['optimizer'] * 1e3:.0f}" for p in parts), f"{max(p['step'] for p in parts) * 1e3:.0f}",
                  f"{max(p['F'] + p['B'] + p['W'] + p['optimizer'] for p in parts) / statistics.median(got['torch 1F1B']):.2f}",
                  *["; ".join(_per_item(p[f"n_{k}"], p[k]) for k in ("messages", "calls", "served")) for p in parts])
        rows.append({"shape": shape, "dims": SHAPES[shape], "single_ms": one * 1e3, "per_microbatch_stage_ms":
                     per_mb * 1e3, **{f"{r} ms": [t * 1e3 for t in got[r]] for r in ROWS},
                     **{f"{r} / 1F1B": ratio[r] for r in ROWS}, "notes": got["notes"],
                     "stage_compute_ms": [[x * 1e3 for x in fb] for fb in alone],
                     "smp_defaults_breakdown_ms": [{k: v if k.startswith("n_") else v * 1e3 for k, v in p.items()}
                                                   for p in parts]})
    headline = []
    for row in ("smp defaults", "smp best"):
        per_shape = [f"{statistics.median(r[f'{row} / 1F1B']):.2f} ({_spread(r[f'{row} / 1F1B'])})" for r in rows]
        if per_shape:
            headline.append({"what": f"HF Llama step time, {row} / torch 1F1B, per shape ({', '.join(shapes)}; labels=, "
                                     f"AdamW in the step; median and range over {args.rounds} paired rounds)",
                             "value": " / ".join(per_shape)})
    print(f"\n{where.markdown()}", flush=True)
    if extra:
        return  # a record holds the standard rows only
    write_record("bench_sweep", rows, {"shapes": shapes, "rounds": args.rounds, "steps": args.steps,
                                       "warmup": args.warmup, "vocab": VOCAB, "best": BEST},
                 tables=[table, where], headline=headline)


if __name__ == "__main__":
    main()
