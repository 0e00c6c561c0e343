"""Per-rank optimizer-state memory with ``shard_optimizer_state`` (ZeRO-1), unsharded vs sharded, same launch.

An unmodified Hugging Face ``LlamaForCausalLM`` (from a config, fp32 or fp16 with fp32 masters)
trains a few steps with AdamW under each layout, first unsharded, then (``smp.reset()``) sharded.
Each rank reports the bytes of its optimizer state (Adam's ``exp_avg``/``exp_avg_sq``/``step``) and
of its fp32 master weights; the table gives the largest rank's share of the unsharded figure (the
target is 1/rdp: whole parameters are assigned, so a rank may hold up to one parameter more), the
step-time ratio sharded / unsharded, and whether the losses and the weights after the last step are
bit-identical (they must be).

Run::

    .venv/bin/python benchmarks/bench_optimizer_state.py [--layers 4] [--hidden 256] [--steps 3]
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time
from typing import Any

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from tests.helpers.spawn import run_ranks  # noqa: E402

MiB = 1024 * 1024
LAYOUTS = [  # (name, world size, extra config)
    ("pp1 x rdp2", 2, {}),
    ("pp1 x rdp4", 4, {}),
    ("pp2 x rdp2", 4, {"pipeline_parallel_degree": 2}),
    ("tp2 x rdp2", 4, {"tensor_parallel_degree": 2}),
    ("pp1 x rdp2, fp16", 2, {"fp16": True}),
]


def _run(cfg: dict[str, Any], layers: int, hidden: int, steps: int) -> dict[str, Any]:
    import smp.torch as smp
    import torch
    import transformers
    from smp.torch.optimizer_shard import optimizer_state_bytes

    out: dict[str, Any] = {}
    for sharded in (False, True):
        smp.init({"microbatches": 2, "ddp": True, "shard_optimizer_state": sharded, "comm_timeout": 120.0, **cfg})
        torch.manual_seed(0)
        config = transformers.LlamaConfig(vocab_size=4096, hidden_size=hidden, intermediate_size=4 * hidden,
                                          num_hidden_layers=layers, num_attention_heads=8, num_key_value_heads=4,
                                          max_position_embeddings=128, use_cache=False, tie_word_embeddings=False)
        net = transformers.LlamaForCausalLM(config)
        if cfg.get("tensor_parallel_degree", 1) > 1:
            net = smp.transform(net)
        model = smp.DistributedModel(net)
        opt = smp.DistributedOptimizer(torch.optim.AdamW(model.parameters(), lr=1e-3),
                                       **({"static_loss_scale": 256.0} if cfg.get("fp16") else {}))

        @smp.step
        def train_step(model: Any, ids: torch.Tensor) -> torch.Tensor:
            loss = model(input_ids=ids, labels=ids).loss
            model.backward(loss)
            return loss

        losses, times = [], []
        for step in range(steps):
            ids = torch.randint(0, 4096, (4, 64), generator=torch.Generator().manual_seed(step * 100 + smp.dp_rank()))
            start = time.perf_counter()
            opt.zero_grad()
            losses.append(train_step(model, ids).reduce_mean().item())
            opt.step()
            times.append(time.perf_counter() - start)
        out[sharded] = {"bytes": optimizer_state_bytes(opt), "losses": losses,
                        "time": statistics.median(times[1:] or times),
                        "params": {n: p.detach().clone() for n, p in model.local_named_parameters()}}
        smp.reset()
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--hidden", type=int, default=256)
    parser.add_argument("--steps", type=int, default=3)
    args = parser.parse_args()
    sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
    from records import Table, write_record

    table = Table(f"HF LlamaForCausalLM: {args.layers} layers, width {args.hidden}, vocab 4096, AdamW; "
                  f"optimizer state per rank (the largest rank), unsharded -> sharded",
                  ["layout", "state unsharded", "state sharded (share)", "fp32 masters unsharded -> sharded", "1/rdp",
                   "step time sharded / unsharded", "losses and weights identical"])
    print(table.title)
    print(table.markdown())
    rows: list[dict[str, Any]] = []
    for name, world, cfg in LAYOUTS:
        ranks = run_ranks(_run, world, args=(cfg, args.layers, args.hidden, args.steps),
                          env={"OMP_NUM_THREADS": "1"}, timeout=900)
        tp = cfg.get("tensor_parallel_degree", 1)
        rdp = world // (cfg.get("pipeline_parallel_degree", 1) * tp)
        whole = max(r[False]["bytes"]["state"] for r in ranks)
        part = max(r[True]["bytes"]["state"] for r in ranks)
        m_whole = max(r[False]["bytes"]["masters"] for r in ranks)
        m_part = max(r[True]["bytes"]["masters"] for r in ranks)
        same = all(r[True]["losses"] == r[False]["losses"] and all(
            bool((r[True]["params"][n] == v).all()) for n, v in r[False]["params"].items()) for r in ranks)
        ratios = [r[True]["time"] / r[False]["time"] for r in ranks]
        ratio = statistics.median(ratios)
        masters = f"{m_whole / MiB:.2f} -> {m_part / MiB:.2f} MiB" if m_whole else "-"
        table.add(name, f"{whole / MiB:.2f} MiB", f"{part / MiB:.2f} MiB ({part / whole:.3f})", masters,
                  f"{1 / rdp:.3f}", f"{ratio:.2f}", "yes" if same else "NO")
        print("| " + " | ".join(table.rows[-1]) + " |", flush=True)
        rows.append({"layout": name, "world": world, "rdp": rdp, "config": cfg,
                     "state_bytes": {"unsharded": whole, "sharded": part}, "share": part / whole,
                     "masters_bytes": {"unsharded": m_whole, "sharded": m_part}, "target_share": 1 / rdp,
                     "step_time_ratio": ratio, "step_time_ratio_per_rank": ratios,
                     "step_time_s_per_rank": {"unsharded": [r[False]["time"] for r in ranks],
                                              "sharded": [r[True]["time"] for r in ranks]},
                     "identical": same})
    by = {row["layout"]: row for row in rows}
    ratios = [row["step_time_ratio"] for row in rows]
    headline = [{"what": "HF Llama AdamW optimizer state per rank (largest rank), shard_optimizer_state / unsharded, "
                         "pp1 x rdp2 / pp1 x rdp4 (targets 0.500 / 0.250)",
                 "value": f"{by['pp1 x rdp2']['share']:.3f}x / {by['pp1 x rdp4']['share']:.3f}x"},
                {"what": "HF Llama AdamW step time, shard_optimizer_state / unsharded (median of ranks, per layout; "
                         "noisy on 2 cores)",
                 "value": f"{statistics.median(ratios):.2f}x ({min(ratios):.2f}-{max(ratios):.2f}, "
                          f"{len(ratios)} layouts)"}]
    path = write_record("bench_optimizer_state", rows,
                        settings={**vars(args), "vocab": 4096, "heads": 8, "kv_heads": 4, "batch": [4, 64],
                                  "microbatches": 2, "layouts": [[n, w, c] for n, w, c in LAYOUTS]},
                        tables=[table], headline=headline)
    print(f"\nrecord: {os.path.relpath(path)}")


if __name__ == "__main__":
    main()
