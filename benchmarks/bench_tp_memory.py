"""Per-rank parameter memory of `smp.torch.transform` at tp = 1, 2, 4 for GPT-NeoX, Llama, Mistral, Mixtral.

For each tp, ``tp`` real ranks (spawned processes, gloo, one process group) build each model on
the meta device (no weights are allocated; shapes and dtypes are what count) and convert it with
``transform(model, process_group=WORLD)``. Each rank reports the bytes of its parameters:

* sharded: the TP shards (attention and MLP projections, vocabulary-split embeddings and LM head,
  Mixtral's experts);
* replicated: everything else (norms, router, biases of row-parallel layers), identical on every rank.

The script asserts that on every rank the sharded part is exactly 1/tp of the same parameters in the
unconverted model (and every sharded parameter is exactly 1/tp of its full tensor), and that the
replicated part equals its unconverted size.

Run::

    .venv/bin/python benchmarks/bench_tp_memory.py [--hidden 512] [--layers 4]
"""

from __future__ import annotations

import argparse
import multiprocessing as mp
import os
import sys
import tempfile
import time
from typing import Any

KINDS = ["gpt_neox", "llama", "mistral", "mixtral"]
MiB = 1024 * 1024


def _config(kind: str, hidden: int, layers: int) -> Any:
    import transformers

    common = {"vocab_size": 32768, "hidden_size": hidden, "intermediate_size": 4 * hidden,
              "num_hidden_layers": layers, "num_attention_heads": 8, "max_position_embeddings": 512,
              "use_cache": False, "tie_word_embeddings": False}
    if kind == "gpt_neox":
        return transformers.GPTNeoXConfig(**common)
    if kind == "llama":
        return transformers.LlamaConfig(num_key_value_heads=4, **common)
    if kind == "mistral":
        return transformers.MistralConfig(num_key_value_heads=4, **common)
    return transformers.MixtralConfig(num_key_value_heads=4, num_local_experts=8, num_experts_per_tok=2,
                                      **{**common, "intermediate_size": 2 * hidden})


def _measure(kind: str, hidden: int, layers: int, group: Any, tp: int) -> dict[str, int]:
    import torch
    import transformers
    from smp.torch.nn import is_tp_sharded
    from smp.torch.tp import transform

    with torch.device("meta"):
        model = transformers.AutoModelForCausalLM.from_config(_config(kind, hidden, layers))
    dense = {n: p.numel() * p.element_size() for n, p in model.named_parameters()}
    transform(model, process_group=group)
    sharded = replicated = dense_of_sharded = 0
    for name, p in model.named_parameters():
        size = p.numel() * p.element_size()
        if is_tp_sharded(p):
            assert size * tp == dense[name], f"{kind} {name}: {size} B is not 1/{tp} of {dense[name]} B"
            sharded += size
            dense_of_sharded += dense[name]
        else:
            assert size == dense[name], f"{kind} {name}: replicated but {size} B != {dense[name]} B"
            replicated += size
    assert sharded * tp == dense_of_sharded, f"{kind}: sharded part is not exactly 1/{tp}"
    return {"sharded": sharded, "replicated": replicated, "dense": sum(dense.values()),
            "dense_sharded": dense_of_sharded}


def _rank(rank: int, tp: int, init_file: str, hidden: int, layers: int, out: Any) -> None:
    os.environ["OMP_NUM_THREADS"] = "1"
    import torch.distributed as dist

    try:
        group = None
        if tp > 1:
            dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank, world_size=tp)
            group = dist.group.WORLD
        result = {kind: _measure(kind, hidden, layers, group, tp) for kind in KINDS}
        out.put((rank, "ok", result))
    except BaseException as e:  # noqa: BLE001 - reported by the parent
        out.put((rank, "error", f"{type(e).__name__}: {e}"))
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()


def _run(tp: int, hidden: int, layers: int) -> list[dict[str, dict[str, int]]]:
    ctx = mp.get_context("spawn")
    out = ctx.Queue()
    with tempfile.TemporaryDirectory() as tmp:
        procs = [ctx.Process(target=_rank, args=(r, tp, os.path.join(tmp, "init"), hidden, layers, out))
                 for r in range(tp)]
        for p in procs:
            p.start()
        got = {}
        for _ in procs:
            rank, status, value = out.get(timeout=300)
            if status != "ok":
                raise RuntimeError(f"tp={tp} rank {rank}: {value}")
            got[rank] = value
        for p in procs:
            p.join()
    return [got[r] for r in range(tp)]


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--hidden", type=int, default=512)
    p.add_argument("--layers", type=int, default=4)
    p.add_argument("--tp", type=int, nargs="+", default=[1, 2, 4])
    a = p.parse_args()
    t0 = time.perf_counter()
    runs = {tp: _run(tp, a.hidden, a.layers) for tp in a.tp}
    print(f"Per-rank parameter memory after smp.torch.transform (fp32; hidden={a.hidden}, layers={a.layers}, "
          "vocab=32768, heads=8, kv heads=4, Mixtral 8 experts); real gloo ranks, models on the meta device\n")
    print(f"{'model':<9}{'tp':>3}{'sharded MiB':>13}{'replicated MiB':>16}{'total MiB':>11}{'of dense':>10}"
          f"{'sharded x tp / dense sharded':>30}")
    sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
    from records import Table, write_record

    table = Table(f"Per-rank parameter memory after smp.torch.transform (fp32; hidden {a.hidden}, {a.layers} layers, "
                  "vocabulary 32768)", ["model", "tp", "sharded MiB", "replicated MiB", "total MiB", "of dense",
                                        "sharded x tp / dense sharded"])
    rows, shares = [], []
    for kind in KINDS:
        for tp, ranks in runs.items():
            r = ranks[0][kind]
            # Every rank holds the same number of bytes (shards are equal, the rest is replicated).
            assert all(x[kind] == r for x in ranks), f"{kind} tp={tp}: ranks differ"
            total = r["sharded"] + r["replicated"]
            exact = r["sharded"] * tp / r["dense_sharded"]
            assert exact == 1.0
            print(f"{kind:<9}{tp:>3}{r['sharded'] / MiB:>13.2f}{r['replicated'] / MiB:>16.3f}{total / MiB:>11.2f}"
                  f"{total / r['dense']:>10.1%}{exact:>30.6f}")
            table.add(kind, tp, f"{r['sharded'] / MiB:.2f}", f"{r['replicated'] / MiB:.3f}", f"{total / MiB:.2f}",
                      f"{total / r['dense']:.1%}", f"{exact:.6f}")
            rows.append({"model": kind, "tp": tp, **r})
            if tp > 1:
                shares.append(f"{kind} tp {tp}: {total / r['dense']:.1%}")
    print("\nchecked on every rank: each sharded parameter is exactly 1/tp of its full tensor, the sharded part "
          "is exactly 1/tp of the dense model's same parameters, replicated parameters keep their full size"
          f"  ({time.perf_counter() - t0:.1f} s)")
    write_record("bench_tp_memory", rows, settings={"hidden": a.hidden, "layers": a.layers, "tp": a.tp},
                 tables=[table], headline=[{"what": "tensor parallelism: parameter bytes per rank / dense model "
                                                    "(HF Llama, tp 2 / tp 4)",
                                            "value": " / ".join(x.split(": ")[1] for x in shares
                                                                if x.startswith("llama"))}])
    return 0


if __name__ == "__main__":
    sys.exit(main())
