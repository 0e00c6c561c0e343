"""``smp plan --hf-config``: partition and schedule a Hugging Face causal LM without weights.

The model is built on the meta device from its config (no download, no memory), traced once on
meta tensors for its execution order and output shapes, and lowered to the core's module tree
with per-module costs estimated from the architecture (see `estimate_tree`). The core partitions
it (`smp.partition.partition_tree`), the scheduler builds and simulates the plan
(`smp.pipeline`), and the command prints the partition table, the plan, the bubble and each
rank's memory (weights + grads + optimizer state + in-flight activations) against
``--device-memory``.

Cost model (one tensor-parallel rank's share; T = micro_batch_size x seq_len tokens, t = --tp):

- compute = forward FLOPs: ``nn.Linear`` 2*T*in*out (divided by t when the model's TP plan shards
  it), attention core 2*b*s*min(s, window)*heads*head_dim / t (causal), experts 2*T*k*(params per
  expert) / t, other modules with parameters 2*T*params. Backward = 2 x forward, of which the
  weight gradient is half.
- activations kept per microbatch, in 2-byte elements per token: a decoder layer
  ``4h + (2*h_q + 2*kv)/t + c*I*k/t`` (c = 4 for gated MLPs, 2 otherwise; k = experts per token);
  1 x h (with ``--recompute``: the layer input only, plus one layer's worth while recomputing);
  the embedding output h, the final norm 2h, the LM head's logits (2 + 4 bytes) * vocab / t.
- parameters sharded by the TP plan (and the embedding and LM head, vocabulary-parallel) are
  divided by t.
- time = FLOPs / (--tflops); a pipeline message carries the boundary activation split over the t
  TP ranks (each sends 1/t on its own link of --link-gbps), plus 10 us latency.
- memory per rank = parameters x (2 bf16 weights + 2 grads + --optimizer-bytes) + the simulated
  peak of in-flight activations (+ one layer's activations with --recompute).
"""

from __future__ import annotations

import argparse
import copy
import fnmatch
import json
import math
import os
import sys
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import nn

from smp.errors import PartitionMemoryError, SMPError
from smp.partition import ModuleNode, ModuleTree, PartitionReport, TreePartition, format_bytes, partition_tree
from smp.partition import parse_size as parse_bytes
from smp.partition.cost import memory_weight_for
from smp.pipeline.grid import format_grid

__all__ = ["PlanResult", "estimate_tree", "load_config", "main", "plan_hf_model"]

_COLWISE = ("colwise", "packed_colwise", "colwise_rep", "colwise_gather_output", "local_colwise")

def parse_size(text: str) -> int:
    """``--device-memory`` as bytes (`smp.partition.parse_size`); an unreadable size is an `SMPError`."""
    size = parse_bytes(text)
    if size is None:
        raise SMPError(f"--device-memory={text!r}: expected a size such as 80GiB, 80GB or 85899345920")
    return size


def load_config(spec: str) -> Any:
    """A transformers config from a JSON file path or inline JSON text (never from the hub)."""
    from huggingface_hub.errors import StrictDataclassError
    from transformers import AutoConfig

    if spec.lstrip().startswith("{"):
        data = json.loads(spec)
    elif os.path.isfile(spec):
        with open(spec, encoding="utf-8") as f:
            data = json.load(f)
    else:
        raise SMPError(
            f"--hf-config={spec!r} is neither a JSON file nor inline JSON. smp plan never downloads: save the "
            "model's config.json locally and pass its path"
        )
    if "model_type" not in data:
        raise SMPError(f"--hf-config: the config has no 'model_type' (keys: {sorted(data)[:8]} ...)")
    try:
        return AutoConfig.for_model(**{k: v for k, v in data.items() if not k.startswith("_")})
    except (StrictDataclassError, TypeError, ValueError) as err:  # e.g. "num_key_value_heads": null
        raise SMPError(f"--hf-config: transformers rejects the config: {err}. Fix: correct that field, or remove it "
                       "to take the model's default") from err


def _trace(model: nn.Module, batch: int, seq: int) -> tuple[list[str], dict[str, int]]:
    """Execution order (first call of each module) and output element counts, on meta tensors."""
    order: list[str] = []
    outputs: dict[str, int] = {}
    handles = []
    for name, module in model.named_modules():
        def pre(mod: nn.Module, args: Any, name: str = name) -> None:
            if name not in outputs:
                order.append(name)
                outputs[name] = 0

        def post(mod: nn.Module, args: Any, out: Any, name: str = name) -> None:
            first = out[0] if isinstance(out, tuple) and out else getattr(out, "logits", out)
            if isinstance(first, torch.Tensor) and outputs.get(name, 0) == 0:
                outputs[name] = first.numel()

        handles += [module.register_forward_pre_hook(pre), module.register_forward_hook(post)]
    try:
        with torch.no_grad():
            model(input_ids=torch.zeros(batch, seq, dtype=torch.long, device="meta"))
    finally:
        for h in handles:
            h.remove()
    return order, outputs


@dataclass(frozen=True)
class Shape:
    """What the estimator needs from a config."""

    hidden: int
    heads: int
    head_dim: int
    kv_heads: int
    intermediate: int
    layers: int
    vocab: int
    experts_per_token: int
    gated: bool
    window: int | None

    @staticmethod
    def of(cfg: Any) -> Shape:
        heads = cfg.num_attention_heads
        head_dim = getattr(cfg, "head_dim", None) or cfg.hidden_size // heads
        return Shape(cfg.hidden_size, heads, head_dim, getattr(cfg, "num_key_value_heads", None) or heads,
                     cfg.intermediate_size, cfg.num_hidden_layers, cfg.vocab_size,
                     getattr(cfg, "num_experts_per_tok", 1) or 1, getattr(cfg, "hidden_act", "") != "gelu_fast"
                     and cfg.model_type != "gpt_neox", getattr(cfg, "sliding_window", None))


def _sharded(path: str, plan: dict[str, str]) -> str | None:
    for pattern, style in plan.items():
        if fnmatch.fnmatchcase(path, pattern):
            return style
    return None


def estimate_tree(model: nn.Module, cfg: Any, *, batch: int, seq: int, tp: int = 1, dtype_bytes: int = 2,
                  recompute: bool = False, split_layers: bool = False) -> tuple[ModuleTree, dict[str, float]]:
    """Lower ``model`` (built on meta) to a `ModuleTree` of one TP rank's share with estimated costs.

    Decoder layers are atomic (their forward adds residuals between children, so a cut inside one
    costs round trips) unless ``split_layers``.

    Returns the tree and a few totals (``params``: unsharded parameter count, ``flops``: forward
    FLOPs of one microbatch on one TP rank, ``recompute_bytes``: one layer's activations).
    """
    shape = Shape.of(cfg)
    tokens = batch * seq
    tp_plan: dict[str, str] = dict(getattr(model, "_tp_plan", None) or {})
    order, outputs = _trace(model, batch, seq)
    modules = dict(model.named_modules())
    # A container never called itself (a ModuleList is iterated) runs where its first child runs;
    # a module never reached at all goes last, in registration order.
    rank_in_order: dict[str, float] = {name: float(i) for i, name in enumerate(order)}
    for name in reversed(list(modules)):
        if name not in rank_in_order:
            kids = [rank_in_order.get(f"{name}.{c}" if name else c, math.inf) for c, _ in modules[name].named_children()]
            rank_in_order[name] = min(kids, default=math.inf)
    late = [name for name in modules if rank_in_order[name] == math.inf]
    for k, name in enumerate(late):
        rank_in_order[name] = len(order) + k
    layer_list = next((name for name, m in modules.items() if isinstance(m, nn.ModuleList) and len(m) == shape.layers),
                      None)
    owners: dict[int, list[str]] = {}  # parameter id -> full names, in module order (ties: > 1)
    for name, module in modules.items():
        for pname, p in module.named_parameters(recurse=False):
            owners.setdefault(id(p), []).append(f"{name}.{pname}" if name else pname)
    nodes = []
    flops_total = 0.0
    hq = shape.heads * shape.head_dim
    kv = shape.kv_heads * shape.head_dim
    mlp = (4 if shape.gated else 2) * shape.intermediate * shape.experts_per_token
    layer_elems = 4 * shape.hidden + (2 * hq + 2 * kv) / tp + mlp / tp
    for name, module in modules.items():
        children = sorted((f"{name}.{c}" if name else c for c, _ in module.named_children()),
                          key=lambda c: rank_in_order[c])
        groups: set[str] = set()
        count = 0
        for pname, p in module.named_parameters(recurse=False):
            full = f"{name}.{pname}" if name else pname
            names = owners[id(p)]
            if len(names) > 1:
                groups.add(f"tied:{names[0]}")
            if names[0] != full:  # a tied parameter counts once, on its first owner
                continue
            style = _sharded(full, tp_plan) or _sharded(name, tp_plan)
            count += math.ceil(p.numel() / tp) if style else p.numel()
        style = _sharded(name, tp_plan)
        div = tp if style else 1
        flops = 0.0
        if isinstance(module, nn.Linear):
            flops = 2.0 * tokens * module.in_features * module.out_features / div
        elif isinstance(module, nn.Embedding):
            flops = 0.0
        elif "Attention" in type(module).__name__:
            span = min(seq, shape.window or seq)
            flops = 2.0 * batch * seq * span * hq / tp
        elif any(p.dim() == 3 for p in module.parameters(recurse=False)):  # fused experts (E, ., .)
            per_expert = sum(p.numel() for p in module.parameters(recurse=False)) / max(1, _experts(module))
            flops = 2.0 * tokens * shape.experts_per_token * per_expert / tp
        elif count:
            flops = 2.0 * tokens * count if "Norm" not in type(module).__name__ else 8.0 * tokens * shape.hidden
        flops_total += flops
        out_elems = outputs.get(name, 0)
        out_bytes = int(out_elems * dtype_bytes / (tp if style in _COLWISE else 1))
        parent = name.rsplit(".", 1)[0] if "." in name else ("" if name else None)
        if layer_list is not None and parent == layer_list:
            act = tokens * dtype_bytes * (shape.hidden if recompute else layer_elems)
        elif layer_list is not None and name.startswith(layer_list + "."):
            act = 0.0  # inside a decoder layer: counted on the layer
        elif isinstance(module, nn.Embedding):
            act = tokens * dtype_bytes * shape.hidden
        elif module is _output_head(model):
            act = tokens * (dtype_bytes + 4) * shape.vocab / tp
        elif "Norm" in type(module).__name__:
            act = 2.0 * tokens * dtype_bytes * shape.hidden
        else:
            act = 0.0
        nodes.append(ModuleNode(name, tuple(children), param_bytes=count * dtype_bytes, param_count=count,
                                activation_bytes=int(act), compute=flops, shared_groups=frozenset(groups),
                                output_bytes=out_bytes, atomic=parent == layer_list and not split_layers))
    totals = {
        "params": float(sum(p.numel() for p in model.parameters())),
        "flops": flops_total,
        "recompute_bytes": tokens * dtype_bytes * layer_elems if recompute else 0.0,
    }
    return ModuleTree(nodes), totals


def _experts(module: nn.Module) -> int:
    return int(getattr(module, "num_experts", 0) or next(p.shape[0] for p in module.parameters(recurse=False)))


def _output_head(model: nn.Module) -> nn.Module | None:
    get = getattr(model, "get_output_embeddings", None)
    return get() if callable(get) else None


@dataclass
class PlanResult:
    """Everything `main` prints, as data (tests and ``--json`` read it)."""

    model: str
    params: int
    partition: TreePartition
    report: PartitionReport
    plan: Any
    sim: Any
    memory: list[dict[str, int]]
    device_memory: int | None
    seconds: float
    notes: list[str] = field(default_factory=list)

    @property
    def fits(self) -> bool | None:
        if self.device_memory is None:
            return None
        return all(m["total_bytes"] <= self.device_memory for m in self.memory)

    def to_dict(self) -> dict[str, object]:
        return {
            "model": self.model,
            "params": self.params,
            "chain": list(self.partition.chain()),
            "ranks": [{"rank": r, **m} for r, m in enumerate(self.memory)],
            "imbalance": self.report.imbalance,
            "param_imbalance": self.report.param_imbalance,
            "compute_imbalance": self.report.compute_imbalance,
            "bubble_fraction": self.sim.bubble_fraction,
            "makespan_s": self.sim.makespan,
            "device_memory_bytes": self.device_memory,
            "fits": self.fits,
            "plan_seconds": self.seconds,
            "notes": self.notes,
            "partition": self.report.to_dict(),
        }


def plan_hf_model(
    cfg: Any,
    *,
    pp: int,
    tp: int = 1,
    microbatches: int = 1,
    pipeline: str = "interleaved",
    active_microbatches: int | None = None,
    virtual_stages: int = 1,
    micro_batch_size: int = 1,
    seq_len: int | None = None,
    device_memory: int | None = None,
    optimize: str = "speed",
    memory_weight: float | None = None,
    dtype_bytes: int = 2,
    grad_bytes: int = 2,
    optimizer_bytes: int = 12,
    tflops: float = 400.0,
    link_gbps: float = 200.0,
    recompute: bool = False,
    split_layers: bool = False,
) -> PlanResult:
    """Build ``cfg``'s model on meta, partition it over ``pp`` ranks, build and simulate the plan."""
    from transformers import AutoModelForCausalLM

    from smp.pipeline import Costs, build_plan, simulate
    from smp.pipeline.registry import default_chain

    start = time.perf_counter()
    seq = seq_len or min(int(getattr(cfg, "max_position_embeddings", 4096) or 4096), 4096)
    # Built in bf16 whatever the config's dtype (or its absence: fp32): the costs come from
    # dtype_bytes, not from the built tensors, and the meta kernel of the grouped expert matmul
    # (Mixtral) accepts bf16 inputs only. A copy, because from_config writes the dtype back.
    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(copy.deepcopy(cfg), dtype=torch.bfloat16)
    tree, totals = estimate_tree(model, cfg, batch=micro_batch_size, seq=seq, tp=tp, dtype_bytes=dtype_bytes,
                                 recompute=recompute, split_layers=split_layers)
    weight = memory_weight_for(optimize) if memory_weight is None else memory_weight
    factor = (dtype_bytes + grad_bytes + optimizer_bytes) / dtype_bytes
    stage_ranks = default_chain(pipeline, pp, virtual_stages)
    notes: list[str] = []
    in_flight: list[int] | None = None
    part = partition_tree(tree, pp, memory_weight=weight, stage_ranks=stage_ranks, param_memory_factor=factor,
                          microbatches=microbatches)
    for _ in range(3):  # the in-flight counts depend on the plan, which depends on the partition
        segments = part.segments()
        fwd = [s.totals.compute / (tflops * 1e12) for s in segments]
        costs = Costs(forward=fwd, backward=[2 * f for f in fwd], backward_weight=fwd,
                      activation_bytes=[float(s.totals.activation_bytes) for s in segments],
                      # Each TP rank sends its 1/t slice of the boundary activation on its own link
                      # (Megatron's scatter-gather); the slices travel in parallel.
                      message_bytes=[float(s.output_bytes) / tp for s in segments],
                      latency=10e-6, bandwidth=link_gbps * 1e9 / 8)
        plan = build_plan(pipeline, pp, microbatches, chain=part.chain(), active_microbatches=active_microbatches,
                          costs=costs)
        sim = simulate(plan, costs)
        if device_memory is None or list(sim.peak_in_flight) == in_flight:
            break
        in_flight = list(sim.peak_in_flight)
        try:
            capped = partition_tree(tree, pp, memory_weight=weight, stage_ranks=stage_ranks, param_memory_factor=factor,
                                    memory_cap_bytes=device_memory - totals["recompute_bytes"], in_flight=in_flight,
                                    microbatches=microbatches)
        except PartitionMemoryError:
            notes.append("no partition fits --device-memory with this schedule's in-flight microbatches; "
                         "showing the balanced partition")
            break
        moved = capped.assignment != part.assignment
        part = capped
        if not moved:
            break
        notes.append("the partition moved work between ranks to honour --device-memory")
    memory = []
    for r, t in enumerate(part.rank_totals()):
        acts = int(sim.peak_activation_bytes[r] + (totals["recompute_bytes"] if t.param_count else 0.0))
        weights, grads, opt = (t.param_count * dtype_bytes, t.param_count * grad_bytes, t.param_count * optimizer_bytes)
        memory.append({"params": t.param_count, "weights_bytes": weights, "grads_bytes": grads,
                       "optimizer_bytes": opt, "activation_bytes": acts, "in_flight": int(sim.peak_in_flight[r]),
                       "total_bytes": weights + grads + opt + acts})
    report = part.report(f"Partition of {type(model).__name__} over pp={pp} (one of tp={tp} shards)")
    return PlanResult(type(model).__name__, int(totals["params"]), part, report, plan, sim, memory, device_memory,
                      time.perf_counter() - start, notes)


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="smp plan", description=__doc__.split("\n\n")[0])
    p.add_argument("--hf-config", required=True, help="config.json path or inline JSON (never downloaded)")
    p.add_argument("--pp", type=int, required=True, help="pipeline_parallel_degree")
    p.add_argument("--tp", type=int, default=1, help="tensor_parallel_degree (divides TP-sharded parameters)")
    p.add_argument("--microbatches", type=int, default=1)
    p.add_argument("--pipeline", default="interleaved", help="schedule name (smp.pipeline.SCHEDULES)")
    p.add_argument("--active-microbatches", type=int, default=None)
    p.add_argument("--virtual-stages", type=int, default=1)
    p.add_argument("--micro-batch-size", type=int, default=1, help="sequences per microbatch")
    p.add_argument("--seq-len", type=int, default=None, help="tokens per sequence (default min(max positions, 4096))")
    p.add_argument("--device-memory", default=None, help="memory per device, e.g. 80GiB")
    p.add_argument("--optimize", choices=("speed", "memory"), default="speed")
    p.add_argument("--memory-weight", type=float, default=None)
    p.add_argument("--optimizer-bytes", type=int, default=12, help="optimizer state bytes per parameter (Adam, "
                   "fp32 master: 12)")
    p.add_argument("--tflops", type=float, default=400.0, help="sustained TFLOP/s per device for the time model")
    p.add_argument("--link-gbps", type=float, default=200.0, help="pipeline link bandwidth in Gbit/s")
    p.add_argument("--recompute", action="store_true", help="activation checkpointing of each decoder layer")
    p.add_argument("--split-layers", action="store_true", help="allow cuts inside decoder layers")
    p.add_argument("--grid", action="store_true", help="print the full step x rank grid instead of the orders")
    p.add_argument("--json", action="store_true", help="print the result as JSON")
    return p


def _memory_table(result: PlanResult) -> str:
    gib = 2**30
    head = f"{'rank':>4}  {'params':>8}  {'weights':>8}  {'grads':>8}  {'optim':>8}  {'acts':>8}  {'in fl.':>6}  {'total':>8}"
    lines = ["per-rank memory (GiB):", head, "-" * len(head)]
    for r, m in enumerate(result.memory):
        lines.append(f"{r:>4}  {m['params'] / 1e9:>7.2f}B  {m['weights_bytes'] / gib:>8.2f}  {m['grads_bytes'] / gib:>8.2f}  "
                     f"{m['optimizer_bytes'] / gib:>8.2f}  {m['activation_bytes'] / gib:>8.2f}  {int(m['in_flight']):>6}  "
                     f"{m['total_bytes'] / gib:>8.2f}")
    return "\n".join(lines)


def main(argv: Sequence[str] | None = None) -> int:
    """Entry point of ``smp plan --hf-config ...``; returns 0, or 1 when the model does not fit."""
    args = _parser().parse_args(list(sys.argv[1:] if argv is None else argv))
    try:
        cfg = load_config(args.hf_config)
        device = None if args.device_memory is None else parse_size(args.device_memory)
        result = plan_hf_model(
            cfg, pp=args.pp, tp=args.tp, microbatches=args.microbatches, pipeline=args.pipeline,
            active_microbatches=args.active_microbatches, virtual_stages=args.virtual_stages,
            micro_batch_size=args.micro_batch_size, seq_len=args.seq_len, device_memory=device,
            optimize=args.optimize, memory_weight=args.memory_weight, optimizer_bytes=args.optimizer_bytes,
            tflops=args.tflops, link_gbps=args.link_gbps, recompute=args.recompute, split_layers=args.split_layers)
    except SMPError as err:
        print(f"smp plan: {err}", file=sys.stderr)
        return 2
    if args.json:
        print(json.dumps(result.to_dict(), indent=2))
        return 0 if result.fits is not False else 1
    sim = result.sim
    seq = args.seq_len or min(int(getattr(cfg, "max_position_embeddings", 4096) or 4096), 4096)
    print(f"smp plan: {result.model} ({result.params / 1e9:.2f}B parameters), pp={args.pp} tp={args.tp}, "
          f"{args.microbatches} microbatches of {args.micro_batch_size} x {seq} tokens, pipeline {args.pipeline!r}")
    print()
    print(result.report)
    print()
    print(format_grid(result.plan) if args.grid else result.plan.orders())
    print()
    print(f"bubble: {sim.bubble_fraction:.3f} of compute time idle (wall share {100 * sim.wall_share:.1f}%); "
          f"simulated step {sim.makespan:.3f} s at {args.tflops:g} TFLOP/s per device")
    print(_memory_table(result))
    for note in result.notes:
        print(f"note: {note}")
    worst = max(range(len(result.memory)), key=lambda r: result.memory[r]["total_bytes"])
    peak = format_bytes(result.memory[worst]["total_bytes"])
    if result.device_memory is None:
        print(f"largest rank: {worst} with {peak} (pass --device-memory to check a device)")
    elif result.fits:
        print(f"fits: every rank is within {format_bytes(result.device_memory)} (largest: rank {worst}, {peak})")
    else:
        print(f"DOES NOT FIT: rank {worst} needs {peak} > {format_bytes(result.device_memory)}; raise --pp or --tp, "
              "lower --microbatches' in-flight count (--active-microbatches), or use --recompute")
    print(f"planned in {result.seconds:.1f} s")
    return 0 if result.fits is not False else 1


if __name__ == "__main__":
    sys.exit(main())
