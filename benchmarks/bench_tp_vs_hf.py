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
        say(f"parameters per rank: smp {_local_mib(smp_model):.2f} MiB, HF {_local_mib(hf_model):.2f} MiB "
            f"(unsharded {sum(p.numel() * 4 for p in hf_model.parameters()) / 2**20:.2f} MiB)")
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
    ok = True
    say(f"\n{'step':>4}  {'smp loss':>12}  {'HF loss':>12}  {'|diff|':>9}")
    for i, (ls, lh) in enumerate(zip(losses["smp"], losses["hf"])):
        diff = abs(ls - lh)
        ok &= diff <= 1e-4 * max(1.0, abs(lh))
        if i < 5 or i == len(losses["smp"]) - 1:
            say(f"{i:>4}  {ls:>12.6f}  {lh:>12.6f}  {diff:>9.2e}")
    med = {k: statistics.median(v) * 1e3 for k, v in times.items()}
    spread = {k: (min(v) * 1e3, max(v) * 1e3) for k, v in times.items()}
    say(f"\n{'':<22}{'median ms':>10}{'min ms':>9}{'max ms':>9}")
    say(f"{'smp tp=2 (transform)':<22}{med['smp']:>10.1f}{spread['smp'][0]:>9.1f}{spread['smp'][1]:>9.1f}")
    say(f"{'HF tp_plan=auto':<22}{med['hf']:>10.1f}{spread['hf'][0]:>9.1f}{spread['hf'][1]:>9.1f}")
    say(f"ratio smp/HF (median step time): {med['smp'] / med['hf']:.2f}  over {a.steps} timed steps each")
    say(f"same loss at every step (rel 1e-4): {'yes' if ok else 'NO'}")
    dist.destroy_process_group()
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
