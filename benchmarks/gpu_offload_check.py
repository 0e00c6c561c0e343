"""GPU check of ``offload_activations``: same numbers as plain checkpointing, less memory (one CUDA device).

A small transformer as users write it (embeddings, a ``ModuleList`` of pre-norm blocks called in a
loop with a causal mask by keyword, an LM head), every block checkpointed with
``smp.set_activation_checkpointing``, trained for a few steps through ``@smp.step`` in one process
(pp = 1), twice: ``offload_activations`` off, then on (``activation_loading_horizon`` from
``--horizon``). Deterministic algorithms are on, so the two runs must agree exactly.

Checks, each a row of the table printed at the end (exit status 1 on any FAIL):

* losses and every parameter gradient of every step bit-identical between the two runs;
* the offloader really ran on CUDA: a ``CudaTarget``, one record per block and microbatch, none
  left after the steps, at most ``--horizon`` records waiting on the device;
* memory: with offload, less CUDA memory is allocated at the end of the forward (the checkpointed
  blocks' inputs wait in pinned host memory) and the step's peak is lower.

Also printed: peak CUDA memory and seconds per step of each run, and the offloader's counters.

Run on a CUDA machine::

    python benchmarks/gpu_offload_check.py [--layers 24] [--batch 16] [--seq 512] [--hidden 512]

``SMP_CHECK_DEVICE=cpu`` runs the same code on the CPU with ``LoopbackTarget`` (copies into
separate host storage) and no memory rows: a dry run of this script's own logic on a machine without
a GPU; it checks nothing about CUDA.
"""

from __future__ import annotations

import argparse
import math
import os
import sys
import time
from typing import Any

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
MiB = 1024 * 1024


def _parse(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0] if __doc__ else None)
    p.add_argument("--layers", type=int, default=24, help="transformer blocks, each checkpointed (24)")
    p.add_argument("--batch", type=int, default=16, help="sequences per step (16)")
    p.add_argument("--seq", type=int, default=512, help="sequence length (512)")
    p.add_argument("--hidden", type=int, default=512, help="model width (512)")
    p.add_argument("--heads", type=int, default=8, help="attention heads (8)")
    p.add_argument("--vocab", type=int, default=1024, help="vocabulary size (1024)")
    p.add_argument("--dropout", type=float, default=0.1, help="dropout in the blocks (0.1; RNG restored on recompute)")
    p.add_argument("--microbatches", type=int, default=2, help="smp microbatches per step (2)")
    p.add_argument("--horizon", type=int, default=2, help="activation_loading_horizon (2)")
    p.add_argument("--steps", type=int, default=3, help="training steps per run (3)")
    return p.parse_args(argv)


def _model(args: argparse.Namespace) -> Any:
    import torch
    import torch.nn.functional as F
    from torch import nn

    class Block(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            d = args.hidden
            self.ln1, self.ln2 = nn.LayerNorm(d), nn.LayerNorm(d)
            self.qkv, self.proj = nn.Linear(d, 3 * d), nn.Linear(d, d)
            self.fc1, self.fc2 = nn.Linear(d, 4 * d), nn.Linear(4 * d, d)
            self.drop = nn.Dropout(args.dropout)

        def forward(self, h: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
            b, s, d = h.shape
            q, k, v = self.qkv(self.ln1(h)).view(b, s, 3, args.heads, d // args.heads).permute(2, 0, 3, 1, 4)
            # Attention written out: the fused kernels' backward is not deterministic on every GPU.
            att = (q @ k.transpose(-1, -2)) / math.sqrt(d // args.heads) + mask
            a = (self.drop(att.softmax(-1)) @ v).transpose(1, 2).reshape(b, s, d)
            h = h + self.drop(self.proj(a))
            return h + self.drop(self.fc2(F.gelu(self.fc1(self.ln2(h)))))

    class GPT(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.tok = nn.Embedding(args.vocab, args.hidden)
            self.pos = nn.Embedding(args.seq, args.hidden)
            self.blocks = nn.ModuleList(Block() for _ in range(args.layers))
            self.norm = nn.LayerNorm(args.hidden)
            self.head = nn.Linear(args.hidden, args.vocab, bias=False)
            self.register_buffer("mask", torch.triu(torch.full((args.seq, args.seq), float("-inf")), 1),
                                 persistent=False)

        def forward(self, ids: torch.Tensor) -> torch.Tensor:
            n = ids.shape[1]
            h = self.tok(ids) + self.pos(torch.arange(n, device=ids.device))
            for block in self.blocks:
                h = block(h, mask=self.mask[:n, :n])
            return self.head(self.norm(h))

    return GPT()


def _run(args: argparse.Namespace, offload_on: bool, device: Any) -> dict[str, Any]:
    import contextlib

    import smp.torch as smp
    import torch
    import torch.nn.functional as F
    from smp.torch.model import offload
    from smp.torch.runtime.process_state import torch_state

    cuda = device.type == "cuda"
    smp.init({"microbatches": args.microbatches, "offload_activations": offload_on,
              "activation_loading_horizon": args.horizon})
    torch.manual_seed(0)
    net = _model(args).to(device)
    model = smp.DistributedModel(net)
    for block in net.blocks:
        smp.set_activation_checkpointing(block)
    opt = smp.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.01))
    after_forward: list[int] = []

    @smp.step
    def train_step(model: Any, ids: torch.Tensor) -> torch.Tensor:
        logits = model(ids[:, :-1])
        loss = F.cross_entropy(logits.reshape(-1, args.vocab), ids[:, 1:].reshape(-1))
        if cuda:
            after_forward.append(torch.cuda.memory_allocated(device))
        model.backward(loss)
        return loss

    dry = None if cuda else offload.LoopbackTarget()
    out: dict[str, Any] = {"losses": [], "grads": [], "peak": 0, "seconds": []}
    with offload.use_target(dry) if dry is not None and offload_on else contextlib.nullcontext():
        for step in range(args.steps):
            g = torch.Generator().manual_seed(step)
            ids = torch.randint(0, args.vocab, (args.batch, args.seq + 1), generator=g).to(device)
            opt.zero_grad()
            if cuda:
                torch.cuda.synchronize(device)
                torch.cuda.reset_peak_memory_stats(device)
            started = time.perf_counter()
            loss = train_step(model, ids).reduce_mean()
            if cuda:
                torch.cuda.synchronize(device)
                out["peak"] = max(out["peak"], torch.cuda.max_memory_allocated(device))
            out["seconds"].append(time.perf_counter() - started)
            out["losses"].append(loss.item())
            out["grads"].append({n: p.grad.detach().cpu().clone() for n, p in net.named_parameters()
                                 if p.grad is not None})
            opt.step()
        made = torch_state().offloader
        if offload_on and made is not None:
            out["target"] = type(made.target).__name__
            out["stats"] = made.stats
            out["live"] = made.live()
    out["after_forward"] = max(after_forward) if after_forward else 0
    del model, net, opt
    smp.reset()
    if cuda:
        torch.cuda.empty_cache()
    return out


def main(argv: list[str] | None = None) -> int:
    args = _parse(argv)
    if ROOT not in sys.path:
        sys.path.insert(0, ROOT)
    import torch

    dry_run = os.environ.get("SMP_CHECK_DEVICE") == "cpu"
    if not dry_run and not torch.cuda.is_available():
        print("FAIL: no CUDA device (torch.cuda.is_available() is False). This check needs one GPU; "
              "SMP_CHECK_DEVICE=cpu runs a dry run of the script's logic on the CPU instead.")
        return 1
    os.environ.setdefault("CUBLAS_WORKSPACE_CONFIG", ":4096:8")  # deterministic cuBLAS (before first use)
    torch.use_deterministic_algorithms(True)
    device = torch.device("cpu") if dry_run else torch.device("cuda", 0)
    if device.type == "cuda":
        torch.cuda.set_device(device)
        print(f"device: {torch.cuda.get_device_name(device)}, torch {torch.__version__}, CUDA {torch.version.cuda}")
    else:
        print("SMP_CHECK_DEVICE=cpu: dry run on the CPU through LoopbackTarget; nothing about CUDA is checked")
    print(f"model: {args.layers} blocks, hidden {args.hidden}, batch {args.batch} x seq {args.seq}, "
          f"{args.microbatches} microbatches, horizon {args.horizon}, {args.steps} steps")

    plain = _run(args, False, device)
    moved = _run(args, True, device)

    rows: list[tuple[str, str, str]] = []

    def row(name: str, ok: bool | None, detail: str) -> None:
        rows.append((name, "SKIP" if ok is None else "PASS" if ok else "FAIL", detail))

    same_losses = plain["losses"] == moved["losses"]
    row("losses bit-identical", same_losses, f"{plain['losses']} vs {moved['losses']}")
    worst, name_worst, mismatched = 0.0, "", 0
    for g0, g1 in zip(plain["grads"], moved["grads"]):
        for name, a in g0.items():
            b = g1.get(name)
            if b is None or not torch.equal(a, b):
                mismatched += 1
                diff = float("inf") if b is None else float((a - b).abs().max())
                if diff > worst:
                    worst, name_worst = diff, name
    total = sum(len(g) for g in plain["grads"])
    row("gradients bit-identical", mismatched == 0 and total > 0,
        f"{total - mismatched}/{total} equal" + (f"; worst {name_worst}: max |diff| {worst:.3g}" if mismatched else ""))
    stats = moved.get("stats")
    expected_target = "CudaTarget" if device.type == "cuda" else "LoopbackTarget"
    records = args.steps * args.microbatches * args.layers
    row("offloader ran", stats is not None and moved.get("target") == expected_target and stats.records == records,
        f"target {moved.get('target')}, {getattr(stats, 'records', 0)} records (expected {records})")
    row("nothing left after the steps", moved.get("live") == 0, f"{moved.get('live')} live records")
    row("horizon respected", stats is not None and 0 < stats.peak_waiting <= args.horizon,
        f"peak waiting {getattr(stats, 'peak_waiting', None)} <= {args.horizon}")
    if device.type == "cuda":
        row("less memory after forward", moved["after_forward"] < plain["after_forward"],
            f"{plain['after_forward'] / MiB:.1f} MiB -> {moved['after_forward'] / MiB:.1f} MiB")
        row("lower peak memory", moved["peak"] < plain["peak"],
            f"{plain['peak'] / MiB:.1f} MiB -> {moved['peak'] / MiB:.1f} MiB")
    else:
        row("memory", None, "dry run: no CUDA memory to measure")

    def per_step(r: dict[str, Any]) -> str:
        later = r["seconds"][1:] or r["seconds"]
        return f"{sum(later) / len(later):.3f} s/step"

    print(f"\nplain checkpointing: peak {plain['peak'] / MiB:.1f} MiB, {per_step(plain)}")
    print(f"with offload:        peak {moved['peak'] / MiB:.1f} MiB, {per_step(moved)}")
    print(f"offloader: {stats}\n")
    width = max(len(r[0]) for r in rows)
    for name, verdict, detail in rows:
        print(f"{verdict:4}  {name:<{width}}  {detail}")
    failed = any(v == "FAIL" for _, v, _ in rows)
    print("\nFAIL" if failed else "\nPASS")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
