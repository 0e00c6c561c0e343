"""Step time of smp tensor parallelism against transformers' own (``tp_plan="auto"``), tp=2 on CPU.

Both run the same small Llama, loaded from one checkpoint, on the same two gloo ranks in the same
launch, step after step in turn (forward + backward + SGD step), so they see the same machine load.
smp converts the model with ``smp.torch.transform(model, process_group=WORLD)`` (vocabulary-sharded
logits, parallel cross entropy); transformers shards it with DTensor at ``from_pretrained``.

Run::

    .venv/bin/torchrun --nproc-per-node 2 benchmarks/bench_tp_vs_hf.py [--steps 20] [--hidden 256]

(started without torchrun, the script relaunches itself under it). Rank 0 prints the median step
time of each, the ratio smp/HF, and the loss of each at every step: both start from the same
weights and must compute the same loss (checked; the script exits non-zero otherwise).
If transformers' tensor parallelism cannot run here, the script prints the error and why.
"""

from __future__ import annotations

import argparse
import os
import statistics
import subprocess
import sys
import tempfile
import time
import traceback
from typing import Any

import torch
import torch.distributed as dist


def _args() -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--steps", type=int, default=20, help="timed steps of each (after 3 warm-up steps)")
    p.add_argument("--hidden", type=int, default=256)
    p.add_argument("--layers", type=int, default=4)
    p.add_argument("--batch", type=int, default=4)
    p.add_argument("--seq", type=int, default=128)
    p.add_argument("--threads", type=int, default=1, help="torch threads per rank")
    return p.parse_args()


def _config(a: argparse.Namespace) -> Any:
    import transformers

    return transformers.LlamaConfig(vocab_size=2048, hidden_size=a.hidden, intermediate_size=2 * a.hidden,
                                    num_hidden_layers=a.layers, num_attention_heads=8, num_key_value_heads=4,
                                    max_position_embeddings=a.seq, use_cache=False, tie_word_embeddings=False)


def _load_smp(path: str) -> Any:
    import transformers
    from smp.torch.tp import transform

    model = transformers.AutoModelForCausalLM.from_pretrained(path, attn_implementation="eager", dtype=torch.float32)
    return transform(model, process_group=dist.group.WORLD)


def _load_hf(path: str) -> Any:
    import transformers

    cfg = transformers.DistributedConfig(tp_plan="auto", tp_size=dist.get_world_size())
    return transformers.AutoModelForCausalLM.from_pretrained(path, attn_implementation="eager", dtype=torch.float32,
                                                             distributed_config=cfg)


def _stepper(model: Any, ids: torch.Tensor) -> Any:
    opt = torch.optim.SGD(model.parameters(), lr=0.1)

    def step() -> float:
        opt.zero_grad()
        loss = model(input_ids=ids, labels=ids).loss
        loss.backward()
        opt.step()
        return float(loss.detach().float())

    return step


def _local_mib(model: Any) -> float:
    """Bytes of this rank's parameters (a DTensor counts its local shard), in MiB."""
    total = 0
    for p in model.parameters():
        t = p.to_local() if hasattr(p, "to_local") else p
        total += t.numel() * t.element_size()
    return total / 2**20


def _timed(step: Any) -> tuple[float, float]:
    dist.barrier()
    t0 = time.perf_counter()
    loss = step()
    dist.barrier()
    return time.perf_counter() - t0, loss


def main() -> int:
    a = _args()
    if "RANK" not in os.environ:  # relaunch under torchrun
        cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "2", __file__, *sys.argv[1:]]
        return subprocess.call(cmd)
    torch.set_num_threads(a.threads)
    dist.init_process_group("gloo")
    rank = dist.get_rank()
    say = print if rank == 0 else (lambda *_, **__: None)
    import transformers

    path = os.path.join(tempfile.gettempdir(), f"smp-bench-tp-vs-hf-{os.environ.get('TORCHELASTIC_RUN_ID', 'x')}")
    if rank == 0:
        torch.manual_seed(0)
        transformers.LlamaForCausalLM(_config(a)).save_pretrained(path)
    dist.barrier()
    g = torch.Generator().manual_seed(1)
    ids = torch.randint(0, 2048, (a.batch, a.seq), generator=g)
    say(f"Llama hidden={a.hidden} layers={a.layers} heads=8/kv4 vocab=2048 batch={a.batch}x{a.seq}, "
        f"tp={dist.get_world_size()} gloo, {a.threads} thread(s)/rank, torch {torch.__version__}, "
        f"transformers {transformers.__version__}")
    smp_model = _load_smp(path)
    smp_step = _stepper(smp_model, ids)
    try:
        hf_model = _load_hf(path)
        mib = {"smp": _local_mib(smp_model), "hf": _local_mib(hf_model),
               "unsharded": sum(p.numel() * 4 for p in hf_model.parameters()) / 2**20}
        say(f"parameters per rank: smp {mib['smp']:.2f} MiB, HF {mib['hf']:.2f} MiB "
            f"(unsharded {mib['unsharded']:.2f} MiB)")
        hf_step = _stepper(hf_model, ids)
        hf_step_loss = hf_step  # first call is part of the check below
        first_hf = hf_step_loss()
    except Exception as e:  # noqa: BLE001 - report exactly why transformers' TP does not run
        say("transformers tp_plan='auto' FAILED on CPU/gloo:")
        say("".join(traceback.format_exception_only(type(e), e)).strip())
        if rank == 0:
            traceback.print_exc()
        first_smp = smp_step()
        say(f"smp alone: first loss {first_smp:.6f}")
        dist.destroy_process_group()
        return 2
    first_smp = smp_step()
    times: dict[str, list[float]] = {"smp": [], "hf": []}
    losses: dict[str, list[float]] = {"smp": [first_smp], "hf": [first_hf]}
    for i in range(2 + a.steps):
        for name, step in (("smp", smp_step), ("hf", hf_step)) if i % 2 == 0 else (("hf", hf_step), ("smp", smp_step)):
            dt, loss = _timed(step)
            losses[name].append(loss)
            if i >= 2:  # warm-up: the first 3 steps of each
                times[name].append(dt)
    sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
    from records import Table, write_record

    loss_table = Table("loss at each step (the first 5 and the last), smp against HF",
                       ["step", "smp loss", "HF loss", "|diff|"])
    ok = True
    say(f"\n{'step':>4}  {'smp loss':>12}  {'HF loss':>12}  {'|diff|':>9}")
    for i, (ls, lh) in enumerate(zip(losses["smp"], losses["hf"])):
        diff = abs(ls - lh)
        ok &= diff <= 1e-4 * max(1.0, abs(lh))
        if i < 5 or i == len(losses["smp"]) - 1:
            loss_table.add(i, f"{ls:.6f}", f"{lh:.6f}", f"{diff:.2e}")
            say(f"{i:>4}  {ls:>12.6f}  {lh:>12.6f}  {diff:>9.2e}")
    med = {k: statistics.median(v) * 1e3 for k, v in times.items()}
    spread = {k: (min(v) * 1e3, max(v) * 1e3) for k, v in times.items()}
    time_table = Table(f"step time, tp={dist.get_world_size()}, {a.steps} timed steps each",
                       ["", "median ms", "min ms", "max ms"])
    say(f"\n{'':<22}{'median ms':>10}{'min ms':>9}{'max ms':>9}")
    for key, label in (("smp", "smp tp=2 (transform)"), ("hf", "HF tp_plan=auto")):
        time_table.add(label, f"{med[key]:.1f}", f"{spread[key][0]:.1f}", f"{spread[key][1]:.1f}")
        say(f"{label:<22}{med[key]:>10.1f}{spread[key][0]:>9.1f}{spread[key][1]:>9.1f}")
    say(f"ratio smp/HF (median step time): {med['smp'] / med['hf']:.2f}  over {a.steps} timed steps each")
    say(f"same loss at every step (rel 1e-4): {'yes' if ok else 'NO'}")
    if rank == 0 and ok:  # a run whose losses differ is a failure, not a result
        paired = sorted(s / h for s, h in zip(times["smp"], times["hf"]))  # step i of each ran back to back
        q1, _, q3 = statistics.quantiles(paired, n=4, method="inclusive") if len(paired) > 1 else paired * 3
        rows = [{"engine": key, "median_ms": med[key], "min_ms": spread[key][0], "max_ms": spread[key][1],
                 "step_ms": [t * 1e3 for t in times[key]], "losses": losses[key], "params_mib_per_rank": mib[key]}
                for key in ("smp", "hf")]
        headline = [{"what": f"Llama step time, smp tp={dist.get_world_size()} (transform) / transformers "
                             f"tp_plan='auto', {dist.get_world_size()} CPU ranks (gloo)",
                     "value": f"{med['smp'] / med['hf']:.2f}x ({q1:.2f}-{q3:.2f} interquartile per-step ratio, "
                              f"{a.steps} steps)"}]
        path = write_record("bench_tp_vs_hf", rows,
                            settings={**vars(a), "world_size": dist.get_world_size(), "vocab": 2048, "heads": 8,
                                      "kv_heads": 4, "intermediate": 2 * a.hidden, "warmup": 3,
                                      "unsharded_mib": mib["unsharded"]},
                            tables=[loss_table, time_table], headline=headline)
        say(f"\nrecord: {os.path.relpath(path)}")
    dist.destroy_process_group()
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
