"""smp's pipeline engine against torch.distributed.pipelining on the same models, 2 CPU ranks (gloo).

Three models of the same size (8 layers, width 256, seq 128, vocab 4096), each written as users
write them; one step = 8 microbatches of 2 sequences, the same data on every side:

- ``sequential``: the GPT of ``examples/gpt_model.py`` as ``nn.Sequential`` (``gpt()``);
- ``modulelist``: the same GPT written the usual way (``GPT``: ``ModuleList`` and a ``for`` loop);
- ``hf-llama``: an unmodified Hugging Face ``LlamaForCausalLM`` built from config (SDPA attention,
  4 heads, MLP width 1024), loss = cross-entropy of the logits against the next tokens.

torch.distributed.pipelining (1F1B, GPipe) runs hand-written stage modules over the same layers
(first half of the layers + embedding | second half + head); both run a second time with the CPU
settings ``smp.init`` makes (glibc's mmap and trim thresholds, through glibc's environment
variables, and each rank bound to its own core, through smp's function), and "best torch" is the
best of the four; smp runs the SMP v1 script shape
(``smp.DistributedModel(model)``, the loss computed in the step body on pp_rank 0,
``model.backward(loss)``) with the same cut through ``smp.set_partition`` and also with ``auto_partition``
(SMP v1's default), which under ``zb_v`` places the model in a V (first and last layers on rank 0,
the middle on rank 1: chain 0 -> 1 -> 0), once more with ``memory_weight: 0`` (balance compute
only, where SMP v1's default 0.2 also balances memory). One thread per rank, one launch per side and
schedule; printed per model: the single-process time, the 1F1B limit
``single / p * (m + p - 1) / m``, the floor of the hand cut (each torch stage's forward + backward
of one microbatch timed alone in one process: no 2-stage schedule that keeps backward whole can
finish a step in less than ``m * max + min``), and per row the median step time after warm-up,
what runs on rank 1 and, for smp, the microbatch chain recorded on the first step.

``--model latency`` prints the engine's own cost per cross-rank call (a tiny tensor), which
``all`` prints first; ``--model split`` what a backward split in two parts costs against one
(the zero-bubble W actions, one process, the Llama's stage 1); ``--model threads`` shows where each rank's CPU goes on the Llama hand cut,
torch 1F1B against smp 1f1b: the CPU of all threads, of the threads that run the model and of
gloo's TCP I/O thread, involuntary context switches, page faults, and the sends and bytes each
rank posts per step.

``--model paired --on MODEL --row ROW --row ROW ... [--rounds 3]`` launches the rows one after the
other, round after round, for A/B comparisons on a machine whose speed drifts between launches
(rows: ``torch:1f1b``, ``auto:zb_v``, ``paths=blocks.2,blocks.3:zb_v`` (those modules on rank 1),
with ``+heap`` / ``+bind`` / ``+keep`` / ``+unbound`` / ``+once`` / ``+key=value`` flags; see `paired`).

    .venv/bin/python benchmarks/bench_pipeline.py [--model all|latency|threads|split|paired|sequential|modulelist|hf-llama]
        [--steps 8] [--warmup 2] [--on MODEL --row ROW ... --rounds N]
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time
from collections.abc import Callable
from typing import Any

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)

import torch  # noqa: E402
from smp.torch.runtime import affinity  # noqa: E402
from smp.torch.runtime.heap import MMAP_THRESHOLD, TRIM_THRESHOLD  # noqa: E402
from torch import nn  # noqa: E402

from examples.gpt_model import GPT, gpt, lm_loss  # noqa: E402
from smp.runtime.launch import detect  # noqa: E402
from tests.helpers.spawn import run_ranks  # noqa: E402

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from records import Table, write_record  # noqa: E402

M, MB, SEQ, VOCAB, LAYERS, WIDTH = 8, 2, 128, 4096, 8, 256
CUT = LAYERS // 2  # the first layer on rank 1
# smp's CPU heap settings as glibc's environment variables, for the torch launches
_HEAP_ENV = {"MALLOC_MMAP_THRESHOLD_": str(MMAP_THRESHOLD), "MALLOC_TRIM_THRESHOLD_": str(TRIM_THRESHOLD)}


def _data(steps: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
    g = torch.Generator().manual_seed(0)
    out = []
    for _ in range(steps):
        ids = torch.randint(0, VOCAB, (M * MB, SEQ + 1), generator=g)
        out.append((ids[:, :-1], ids[:, 1:]))
    return out


# --- the models, and torch's hand-written stages over their layers -------------------------------------


def _llama() -> nn.Module:
    import transformers

    cfg = transformers.LlamaConfig(vocab_size=VOCAB, hidden_size=WIDTH, intermediate_size=4 * WIDTH,
                                   num_hidden_layers=LAYERS, num_attention_heads=4, num_key_value_heads=4,
                                   max_position_embeddings=SEQ, use_cache=False)
    return transformers.AutoModelForCausalLM.from_config(cfg, attn_implementation="sdpa")


class _GPTFirst(nn.Module):
    def __init__(self, model: GPT) -> None:
        super().__init__()
        self.embed, self.blocks = model.embed, model.blocks[:CUT]

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        x = self.embed(ids)
        for b in self.blocks:
            x = b(x)
        return x


class _GPTSecond(nn.Module):
    def __init__(self, model: GPT) -> None:
        super().__init__()
        self.blocks, self.head = model.blocks[CUT:], model.head

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for b in self.blocks:
            x = b(x)
        return self.head(x)


class _LlamaLayers(nn.Module):
    """Half of the decoder layers as ``LlamaModel.forward`` calls them; rotary embeddings recomputed from positions.

    ``attention_mask=None`` with SDPA and no padding makes attention causal through ``is_causal``,
    which is what ``LlamaModel`` itself does for unpadded input.
    """

    def __init__(self, hf: Any, first: bool) -> None:
        super().__init__()
        body, cut = hf.model, len(hf.model.layers) // 2
        self.rotary = body.rotary_emb
        self.layers = body.layers[:cut] if first else body.layers[cut:]
        self.embed = body.embed_tokens if first else None
        self.norm = None if first else body.norm
        self.lm_head = None if first else hf.lm_head

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.embed(x) if self.embed is not None else x
        pos = torch.arange(h.shape[1], device=h.device).unsqueeze(0)
        pe = self.rotary(h, position_ids=pos)
        for layer in self.layers:
            h = layer(h, attention_mask=None, position_embeddings=pe, position_ids=pos)
        if self.norm is None:
            return h
        return self.lm_head(self.norm(h))


def _stage_sequential(model: nn.Sequential, rank: int) -> nn.Module:
    return nn.Sequential(*list(model)[:CUT + 1]) if rank == 0 else nn.Sequential(*list(model)[CUT + 1:])


def _cut_sequential(model: nn.Sequential) -> list[nn.Module]:
    return list(model)[CUT + 1:]


def _cut_modulelist(model: GPT) -> list[nn.Module]:
    return [*model.blocks[CUT:], model.head]


def _cut_llama(hf: Any) -> list[nn.Module]:
    return [*hf.model.layers[CUT:], hf.model.norm, hf.lm_head]


# name -> (build, logits(model, ids), torch stage for a rank, modules smp's manual cut puts on rank 1,
#          what torch's stage 1 holds)
MODELS: dict[str, tuple[Callable[[], nn.Module], Callable[[Any, torch.Tensor], torch.Tensor],
                        Callable[[Any, int], nn.Module], Callable[[Any], list[nn.Module]], str]] = {
    "sequential": (gpt, lambda m, x: m(x), _stage_sequential, _cut_sequential, "5-9"),
    "modulelist": (GPT, lambda m, x: m(x), lambda m, r: _GPTFirst(m) if r == 0 else _GPTSecond(m),
                   _cut_modulelist, "blocks.4-7, head"),
    "hf-llama": (_llama, lambda m, x: m(input_ids=x).logits, lambda m, r: _LlamaLayers(m, r == 0),
                 _cut_llama, "model.layers.4-7, model.norm, lm_head"),
}
SMP_CUTS = {"sequential": ("manual", "auto"), "modulelist": ("manual", "auto"), "hf-llama": ("manual", "auto")}


# --- where a rank's CPU goes (``--model threads``) -------------------------------------------------------


class _Probe:
    """Per step: the process's CPU (every thread, ended ones included), the CPU of gloo's TCP I/O
    thread and of the threads that run the model, involuntary context switches, minor page faults (fresh memory the kernel zeroes), and
    the point-to-point sends and bytes this rank posts.

    Per-thread CPU is the kernel's per-thread clock (``clock_gettime`` on the thread's CPU clock id,
    nanoseconds); sends are counted by wrapping ``torch.distributed.isend`` and ``send``, the calls
    both engines post every message part through (torch's P2P ops and smp's transport).
    """

    def __init__(self) -> None:
        import resource

        import torch.distributed as dist
        import torch.distributed.distributed_c10d as c10d

        self._resource = resource
        self.sends = self.bytes = 0
        for name in ("isend", "send"):
            counted = self._counting(getattr(c10d, name))
            setattr(dist, name, counted)  # one object under both names: P2POp checks `op is isend`
            setattr(c10d, name, counted)
        self.total = dict.fromkeys(("cpu", "io", "compute", "nivcsw", "minflt", "sends", "kb"), 0.0)
        self.steps = 0

    def _counting(self, fn: Callable[..., Any]) -> Callable[..., Any]:
        if getattr(fn, "_probe", False):
            return fn

        def counted(tensor: torch.Tensor, *args: Any, **kwargs: Any) -> Any:
            self.sends += 1
            self.bytes += tensor.numel() * tensor.element_size()
            return fn(tensor, *args, **kwargs)

        counted._probe = True  # type: ignore[attr-defined]
        return counted

    @staticmethod
    def _thread_cpu() -> tuple[float, float]:
        """Seconds of CPU of gloo's TCP loop (threads named ``gloo*``) and of the threads that run
        the model (torch: the main thread; smp: its microbatch workers ``smp-mb*``)."""
        import threading

        compute_ids = {t.native_id for t in threading.enumerate()
                       if t.name.startswith("smp-mb")} or {threading.main_thread().native_id}
        io = compute = 0.0
        for tid in os.listdir("/proc/self/task"):
            try:
                with open(f"/proc/self/task/{tid}/comm") as f:
                    gloo = f.read().startswith("gloo")
                if gloo or int(tid) in compute_ids:
                    cpu = time.clock_gettime((~int(tid) << 3) | 6)  # the thread's CPU clock (CPUCLOCK_SCHED)
                    io, compute = (io + cpu, compute) if gloo else (io, compute + cpu)
            except OSError:
                continue
        return io, compute

    def _now(self) -> dict[str, float]:
        r = self._resource.getrusage(self._resource.RUSAGE_SELF)
        io, compute = self._thread_cpu()
        return {"cpu": r.ru_utime + r.ru_stime, "io": io, "compute": compute, "nivcsw": r.ru_nivcsw,
                "minflt": r.ru_minflt, "sends": self.sends, "kb": self.bytes / 1024}

    def start(self) -> None:
        self._at = self._now()

    def stop(self) -> None:
        now = self._now()
        for k in self.total:
            self.total[k] += now[k] - self._at[k]
        self.steps += 1

    def per_step(self) -> dict[str, float]:
        return {k: v / max(self.steps, 1) for k, v in self.total.items()}


# --- one process, torch, smp ---------------------------------------------------------------------------


def single(name: str, steps: int, warmup: int) -> list[float]:
    build, logits, *_ = MODELS[name]
    torch.set_num_threads(1)
    torch.manual_seed(0)
    model = build()
    times = []
    for x, y in _data(steps + warmup):
        start = time.perf_counter()
        model.zero_grad()
        for xm, ym in zip(x.chunk(M), y.chunk(M)):
            (lm_loss(logits(model, xm), ym) / M).backward()
        times.append(time.perf_counter() - start)
    return times[warmup:]


def stage_times(name: str, steps: int, warmup: int) -> tuple[float, float]:
    """Seconds of forward + backward of one microbatch through each of torch's two stages, in one
    process (median): what the cut asks of each rank with no pipeline around it."""
    build, _, stage_of, _, _ = MODELS[name]
    torch.set_num_threads(1)
    torch.manual_seed(0)
    model = build()
    first, second = stage_of(model, 0), stage_of(model, 1)
    times: tuple[list[float], list[float]] = ([], [])
    for step, (x, y) in enumerate(_data(steps + warmup)):
        for xm, ym in zip(x.chunk(M), y.chunk(M)):
            start = time.perf_counter()
            h = first(xm)
            h.backward(torch.ones_like(h))
            mid = time.perf_counter()
            h = h.detach().requires_grad_()
            (lm_loss(second(h), ym) / M).backward()
            if step >= warmup:
                times[0].append(mid - start)
                times[1].append(time.perf_counter() - mid)
    return statistics.median(times[0]), statistics.median(times[1])


def theirs(name: str, schedule: str, steps: int, warmup: int, probe: bool = False,
           bind: bool = False) -> dict[str, Any]:
    """torch.distributed.pipelining on the hand cut; ``bind`` binds the rank to its cores as ``smp.init``
    does on CPU (frontends/torch/runtime/affinity.py)."""
    import torch.distributed as dist
    from torch.distributed.pipelining import PipelineStage, Schedule1F1B, ScheduleGPipe

    build, _, stage_of, _, _ = MODELS[name]
    torch.set_num_threads(1)
    if bind and affinity.bind_local_rank(detect()) is None:
        raise RuntimeError("smp's core binding did not apply to this torch launch (see affinity.py's conditions)")
    dist.init_process_group("gloo", init_method="file://" + os.environ["SMP_RENDEZVOUS_FILE"],
                            rank=int(os.environ["RANK"]), world_size=2)
    rank = dist.get_rank()
    torch.manual_seed(0)
    part = stage_of(build(), rank)
    stage = PipelineStage(part, rank, 2, torch.device("cpu"))
    cls = {"1f1b": Schedule1F1B, "gpipe": ScheduleGPipe}[schedule]
    sched = cls(stage, n_microbatches=M, loss_fn=lm_loss)
    probes = _Probe() if probe else None
    times = []
    for step, (x, y) in enumerate(_data(steps + warmup)):
        dist.barrier()
        if probes and step >= warmup:
            probes.start()
        start = time.perf_counter()
        part.zero_grad()
        if rank == 0:
            sched.step(x)
        else:
            sched.step(target=y, losses=[])
        times.append(time.perf_counter() - start)
        if probes and step >= warmup:
            probes.stop()
    return {"times": times[warmup:], "probe": probes.per_step() if probes else None}


def _on_rank1(assignment: dict[str, int]) -> str:
    """The outermost modules on rank 1, runs of numbered siblings collapsed: ``model.layers.4-7, lm_head``."""
    tops = [p for p, r in assignment.items() if r == 1 and p and assignment.get(p.rpartition(".")[0], 0) != 1]
    out: list[str] = []
    for path in tops:
        parent, _, leaf = path.rpartition(".")
        prefix = parent + "." if parent else ""
        if leaf.isdigit() and out and out[-1].startswith(prefix):
            last = out[-1][len(prefix):]
            lo, _, hi = last.partition("-")
            if lo.isdigit() and int(hi or lo) + 1 == int(leaf):
                out[-1] = f"{prefix}{lo}-{leaf}"
                continue
        out.append(path)
    return ", ".join(out) or "-"


def ours(name: str, schedule: str, cut: str, steps: int, warmup: int, probe: bool = False,
         remeasure: bool = True, config: dict[str, Any] | None = None) -> dict[str, Any]:
    """smp on ``name``: ``cut`` is "auto", "manual" (the hand cut) or "paths:a,b,..." (those modules
    on rank 1, the rest on rank 0); ``remeasure=False`` keeps the plan built from the recording step
    (Note [costs measured again] in frontends/torch/step.py), for A/B launches."""
    import importlib

    import smp.torch as smp

    build, logits, _, manual, _ = MODELS[name]
    torch.set_num_threads(1)
    if not remeasure:
        importlib.import_module("smp.torch.step")._MEASURE_AGAIN = 0  # planned steps count from 1: never
    cfg: dict[str, Any] = {"pipeline_parallel_degree": 2, "microbatches": M, "pipeline": schedule,
                           "active_microbatches": M if schedule == "simple" else 4,
                           "auto_partition": cut == "auto"}
    if schedule == "zb_v":
        cfg["virtual_stages"] = 2  # the V: two chunks per rank
    if cut != "auto":
        cfg["default_partition"] = 0
    smp.init({**cfg, **(config or {})})
    torch.manual_seed(0)
    net = build()
    model = smp.DistributedModel(net)
    if cut != "auto":
        paths = cut.partition(":")[2].split(",") if cut.startswith("paths:") else None
        for module in manual(net) if paths is None else [net.get_submodule(p) for p in paths]:
            smp.set_partition(module, 1)
    model.register_post_partition_hook(lambda *_: None)

    @smp.step
    def train_step(model: Any, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        loss = lm_loss(logits(model, x), y)
        model.backward(loss)
        return loss

    probes = _Probe() if probe else None
    times = []
    for step, (x, y) in enumerate(_data(steps + warmup)):
        smp.barrier()
        if probes and step >= warmup:
            probes.start()
        start = time.perf_counter()
        model.zero_grad()
        train_step(model, x, y)
        times.append(time.perf_counter() - start)
        if probes and step >= warmup:
            probes.stop()
    chain = next(iter(model.plans.values())).chain if model.plans else []
    return {"times": times[warmup:], "chain": list(chain), "rank1": _on_rank1(model.partition_assignment),
            "probe": probes.per_step() if probes else None}


def _chain(chain: list[int]) -> str:
    return "-".join(map(str, chain)) if len(chain) <= 9 else f"len {len(chain)}"


def bench(name: str, steps: int, warmup: int) -> tuple[Table, list[dict[str, Any]]]:
    """Run and print the table of ``name``; returns it and its measurements (for the record)."""
    env = {"OMP_NUM_THREADS": "1"}
    one = statistics.median(single(name, steps, warmup))
    t0, t1 = stage_times(name, steps, warmup)
    rows = []
    Launch = tuple[str, Callable[..., dict[str, Any]], tuple[Any, ...], dict[str, Any], dict[str, str]]
    launches: list[Launch] = [
        ("torch.distributed.pipelining", theirs, (name, s, steps, warmup), {}, env) for s in ("1f1b", "gpipe")]
    # smp.init on CPU raises glibc's mmap and trim thresholds (frontends/torch/runtime/heap.py) and
    # binds each local rank to its own cores (affinity.py); torch with the same settings (the heap's
    # through glibc's environment variables, the binding through smp's function) counts as torch too.
    launches += [("torch.distributed.pipelining (smp's CPU settings)", theirs, (name, s, steps, warmup),
                  {"bind": True}, {**env, **_HEAP_ENV}) for s in ("1f1b", "gpipe")]
    # zb_v places the model in a V (its own cut: the first and last layers on rank 0), so only
    # automatic partitioning runs it; on the manual 2-stage cut it would be zb_h1 again.
    launches += [(f"smp ({cut})", ours, (name, s, cut, steps, warmup), {}, env)
                 for cut in SMP_CUTS[name] for s in ("1f1b", "zb_h1", "interleaved", "simple")
                 + (("zb_v",) if cut == "auto" else ())]
    # SMP v1's default memory_weight (0.2 under optimize "speed") trades compute balance for memory
    # balance; the V with compute balance alone is what a user who asks for speed only would run.
    launches.append(("smp (auto, memory_weight 0)", ours, (name, "zb_v", "auto", steps, warmup),
                     {"config": {"memory_weight": 0.0}}, env))
    steps_of = []  # per launch: the slower rank's time of each step
    for label, fn, args, kwargs, launch_env in launches:
        out = run_ranks(fn, 2, args=args, kwargs=kwargs, env=launch_env, timeout=900)
        steps_of.append([max(ts) for ts in zip(*(o["times"] for o in out))])
        t = statistics.median(steps_of[-1])
        rank1 = out[0].get("rank1", MODELS[name][4])
        rows.append((label, args[1], t, rank1, _chain(out[0]["chain"]) if "chain" in out[0] else "-"))
    p = 2
    limit = one / p * (M + p - 1) / M
    floor = M * max(t0, t1) + min(t0, t1)
    best_theirs = min(t for label, _, t, _, _ in rows if not label.startswith("smp"))
    print(f"\nmodel {name}")
    print(f"single process, 1 thread, {M} microbatches of {MB}: {one * 1e3:.0f} ms/step")
    print(f"1F1B limit single/p*(m+p-1)/m = {limit * 1e3:.0f} ms")
    print(f"one microbatch through torch's stage 0 / stage 1 alone (forward + backward, one process): "
          f"{t0 * 1e3:.1f} / {t1 * 1e3:.1f} ms; floor of this cut for a 2-stage pipeline that does not split "
          f"backward, m * max + min = {floor * 1e3:.0f} ms\n")
    table = Table(f"model {name}", ["engine", "schedule", "ms/step (median)", "/ best torch", "/ floor of the cut",
                                    "/ 1F1B limit", "speedup vs 1 process", "on rank 1", "chain"])
    print(table.markdown())
    for label, sched, t, rank1, chain in rows:
        table.add(label, sched, f"{t * 1e3:.1f}", f"{t / best_theirs:.4f}", f"{t / floor:.3f}", f"{t / limit:.3f}",
                  f"{one / t:.2f}x", rank1, chain)
        print("| " + " | ".join(table.rows[-1]) + " |", flush=True)
    record = [{"kind": "model", "model": name, "single_ms": one * 1e3, "limit_ms": limit * 1e3,
               "stage_ms": [t0 * 1e3, t1 * 1e3], "floor_ms": floor * 1e3, "best_torch_ms": best_theirs * 1e3}]
    record += [{"kind": "step", "model": name, "engine": label, "schedule": sched, "median_ms": t * 1e3,
                "step_ms": [x * 1e3 for x in times], "on_rank1": rank1, "chain": chain}
               for (label, sched, t, rank1, chain), times in zip(rows, steps_of)]
    return table, record


class _Ping(nn.Module):
    """A loop of calls to a tiny module on rank 1: the engine's own cost per cross-rank call."""

    def __init__(self, calls: int, read: bool) -> None:
        super().__init__()
        self.far = nn.Linear(4, 4)
        self.near = nn.Linear(4, 4)
        self.calls, self.read = calls, read

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for _ in range(self.calls):
            x = self.far(x)
            if self.read:  # a module of the caller's on each output: its value comes back every call
                x = self.near(x)
        return x.sum()


def call_cost(read: bool, calls: int = 200) -> float:
    """Seconds per cross-rank call of a (2, 4) tensor through a 4x4 Linear, forward only."""
    import smp.torch as smp

    torch.set_num_threads(1)
    smp.init({"pipeline_parallel_degree": 2, "microbatches": 1, "default_partition": 0, "auto_partition": False})
    net = _Ping(calls, read)
    model = smp.DistributedModel(net)
    smp.set_partition(net.far, 1)

    @smp.step
    def run(model: Any, x: torch.Tensor) -> torch.Tensor:
        return model(x)

    times = []
    for _ in range(6):
        smp.barrier()
        start = time.perf_counter()
        with torch.no_grad():
            run(model, torch.ones(2, 4))
        times.append(time.perf_counter() - start)
    return min(times[1:]) / calls


def latency() -> tuple[Table, list[dict[str, Any]]]:
    table = Table("engine cost per cross-rank call (2 ranks, idle machine, (2, 4) float tensor, forward only)",
                  ["the caller ...", "us per call"])
    print(f"\n{table.title}\n")
    print(table.markdown())
    rows = []
    for read, what in ((False, "passes each output on to the next call (a reference round trip)"),
                       (True, "gives each output to a module of its own (the value comes back with the reply)")):
        out = run_ranks(call_cost, 2, args=(read,), env={"OMP_NUM_THREADS": "1"}, timeout=300)
        table.add(what, f"{out[0] * 1e6:.0f}")
        print("| " + " | ".join(table.rows[-1]) + " |", flush=True)
        rows.append({"kind": "latency", "read": read, "us_per_call": out[0] * 1e6})
    return table, rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--model", choices=["all", "latency", "threads", "split", "paired", *MODELS], default="all")
    parser.add_argument("--steps", type=int, default=8)
    parser.add_argument("--warmup", type=int, default=2)
    parser.add_argument("--on", choices=list(MODELS), default="modulelist", help="the model of --model paired")
    parser.add_argument("--row", action="append", default=[], help="a row of --model paired (see `paired`)")
    parser.add_argument("--rounds", type=int, default=3, help="rounds of --model paired")
    args = parser.parse_args()
    if args.model in ("paired", "threads", "split"):  # the diagnostic modes (bench_pipeline_probes.py)
        import bench_pipeline_probes as probes

        if args.model == "paired":
            probes.paired(args.on, args.row or ["torch:1f1b", "auto:zb_v"], args.rounds, args.steps, args.warmup)
        elif args.model == "threads":
            probes.threads("hf-llama", args.steps, args.warmup)
        else:
            probes.split_cost("hf-llama", args.steps, args.warmup)
        return
    tables, rows = [], []
    if args.model in ("all", "latency"):
        table, got = latency()
        tables.append(table)
        rows += got
    for name in MODELS if args.model == "all" else [] if args.model == "latency" else [args.model]:
        table, got = bench(name, args.steps, args.warmup)
        tables.append(table)
        rows += got
    if args.model != "all":  # a part of the tables: no record
        return
    # smp's defaults (auto_partition, pipeline "interleaved") against the best of torch's four launches
    headline = []
    for name, what in (("sequential", "GPT as nn.Sequential"), ("modulelist", "GPT with a ModuleList loop"),
                       ("hf-llama", "HF Llama")):
        best = next(r for r in rows if r["kind"] == "model" and r["model"] == name)["best_torch_ms"]
        row = next(r for r in rows if r["kind"] == "step" and r["model"] == name and r["engine"] == "smp (auto)"
                   and r["schedule"] == "interleaved")
        headline.append({"what": f"{what} step time, smp auto partition with SMP v1's default schedule "
                                 "(interleaved) / best torch.distributed.pipelining, 2 CPU ranks",
                         "value": f"{row['median_ms'] / best:.2f}x ({min(row['step_ms']) / best:.2f}-"
                                  f"{max(row['step_ms']) / best:.2f} over smp's {len(row['step_ms'])} steps, "
                                  "one launch each)"})
    path = write_record("bench_pipeline", rows, settings={**vars(args), "microbatches": M, "microbatch_size": MB,
                                                          "seq": SEQ, "vocab": VOCAB, "layers": LAYERS,
                                                          "width": WIDTH, "cut": CUT},
                        tables=tables, headline=headline)
    print(f"\nrecord: {os.path.relpath(path, ROOT)}")


if __name__ == "__main__":
    main()
