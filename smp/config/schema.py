"""The configuration schema: every SMP v1 key (plus the SMP v2 and smp keys) with type, default and rule.

Each key is declared once here, with its documentation, so the README table is generated from the
same data that validation uses (`smp config --markdown`).

Defaults that depend on other keys (``active_microbatches`` = pp + 2 clipped to ``microbatches``,
``memory_weight`` = 0.2 under ``optimize="speed"`` else 0.8) are callables of the resolved values.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any

# The pipeline schedule names the scheduler registry provides (smp/pipeline); a test checks the two agree.
PIPELINE_NAMES = ("simple", "interleaved", "gpipe", "1f1b", "interleaved_1f1b", "zb_h1", "zb_v", "_only_forward")
PLACEMENT_NAMES = ("cluster", "spread", "DPT", "DTP", "PDT", "PTD", "TDP", "TPD")

Default = Callable[[Mapping[str, Any]], Any]


@dataclass(frozen=True)
class Key:
    """One configuration key.

    Attributes:
        name: the key as users write it.
        types: accepted Python types, compared exactly (``type(v) in types``): 1 is not a bool.
        default: a value, or a callable of the already-resolved keys.
        doc: one line for the README table.
        options: allowed values, if the key is an enumeration.
        low, high: inclusive bounds for numbers.
        nullable: ``None`` is accepted (meaning "not set").
        since: the SMP version (or "smp") that introduced it.
        status: "supported", "accepted" (accepted for compatibility, no effect: logged once),
            "unsupported" (only the default is accepted) or "internal" (SMP v1 internal key, accepted).
        alias: other names that mean this key.
    """

    name: str
    types: tuple[type, ...]
    default: Any
    doc: str
    options: tuple[Any, ...] | None = None
    low: float | None = None
    high: float | None = None
    nullable: bool = False
    since: str = "1.0"
    status: str = "supported"
    alias: tuple[str, ...] = field(default_factory=tuple)

    def default_for(self, resolved: Mapping[str, Any]) -> Any:
        return self.default(resolved) if callable(self.default) else self.default


def _active_microbatches_default(cfg: Mapping[str, Any]) -> int:
    return max(1, min(int(cfg["pipeline_parallel_degree"]) + 2, int(cfg["microbatches"])))


def _memory_weight_default(cfg: Mapping[str, Any]) -> float:
    # Reference section 12, conflict 2: follow the documented rule (0.2 for speed, 0.8 for memory).
    return 0.2 if cfg["optimize"] == "speed" else 0.8


_INT = (int,)
_BOOL = (bool,)
_FLOAT = (float, int)
_STR = (str,)

# Order matters: a key's callable default may read only keys declared above it.
KEYS: tuple[Key, ...] = (
    # --- parallel degrees -------------------------------------------------------------------
    Key("pipeline_parallel_degree", _INT, 1, "Number of pipeline stages (partitions).", low=1,
        alias=("partitions",), since="1.6 (`partitions` before)"),
    Key("tensor_parallel_degree", _INT, 1, "Size of the tensor-parallel group; >1 requires `ddp`.", low=1,
        since="1.6"),
    Key("microbatches", _INT, 1, "Microbatches each `smp.step` batch is split into.", low=1),
    Key("pipeline", _STR, "interleaved",
        "Pipeline schedule: SMP v1 `simple`/`interleaved`, or `gpipe`, `1f1b`, `interleaved_1f1b`, `zb_h1`, `zb_v`.",
        options=PIPELINE_NAMES),
    Key("virtual_stages", _INT, 1, "Model chunks per pipeline rank (for `interleaved_1f1b`, `zb_v`).", low=1,
        since="smp"),
    Key("optimize", _STR, "speed", "`speed` or `memory`: tilts auto-partitioning and TP layers; `memory` also "
        "returns large freed CPU blocks to the system (torch, docs/memory.md).",
        options=("speed", "memory")),
    Key("placement_strategy", _STR, "cluster",
        "Rank layout: `cluster` (=DPT), `spread` (=TPD) or any order of D, P, T (rightmost varies fastest).",
        options=PLACEMENT_NAMES, since="1.0 (letters 1.6)"),
    Key("auto_partition", _BOOL, True, "Partition the model automatically on the first step."),
    Key("default_partition", _INT, None, "Partition of modules not placed explicitly; needed when "
        "`auto_partition` is False.", low=0, nullable=True),
    Key("active_microbatches", _INT, _active_microbatches_default,
        "Most microbatches in flight at once (default pp+2, capped at `microbatches`).", low=1, since="1.3"),
    Key("memory_weight", _FLOAT, _memory_weight_default,
        "Weight of memory against compute balance in auto-partitioning (default 0.2 for `speed`, 0.8 "
        "for `memory`).", low=0.0, high=1.0),
    Key("contiguous", _BOOL, True, "TF auto-partition: each partition is a connected subgraph."),
    # --- data parallelism -------------------------------------------------------------------
    Key("ddp", _BOOL, False, "Data parallelism over the DP groups (required when world > pp x tp)."),
    Key("ddp_port", _INT, None, "Port for DDP rendezvous; needs `ddp`.", low=0, nullable=True),
    Key("ddp_dist_backend", _STR, "auto", "`auto` (gloo on CPU, NCCL on GPU), `nccl` or `gloo`; needs `ddp` "
        "when not `auto`.", options=("auto", "nccl", "gloo"), since="1.13"),
    Key("horovod", _BOOL, False, "Data parallelism through Horovod (TF); falls back to the built-in "
        "allreduce when Horovod does not import."),
    Key("prescaled_batch", _BOOL, False, "Every TP rank receives the same batch (shard data by rdp_rank); "
        "requires `optimize: speed`.", since="1.6"),
    Key("sharded_data_parallel_degree", _INT, 1, "Sharded data parallelism (MiCS); accepted, must divide the "
        "DP degree; smp replicates instead (same numbers, more memory).", low=1, since="1.11", status="accepted"),
    Key("sdp_reduce_bucket_size", _INT, 500_000_000, "SDP gradient bucket size (elements).", low=1,
        since="1.11", status="accepted"),
    Key("sdp_param_persistence_threshold", _INT, 1_000_000, "SDP: smaller params are replicated.", low=0,
        since="1.11", status="accepted"),
    Key("sdp_max_live_parameters", _INT, 1_000_000_000, "SDP: cap on gathered parameters.", low=1,
        since="1.11", status="accepted"),
    Key("sdp_hierarchical_allgather", _BOOL, True, "SDP: intra-node allgather first.", since="1.11",
        status="accepted"),
    Key("sdp_gradient_clipping", _FLOAT, 1.0, "SDP: L2 clip inside `optimizer.step()`.", low=0.0,
        since="1.11", status="accepted"),
    # --- memory features ----------------------------------------------------------------------
    Key("offload_activations", _BOOL, False, "With activation checkpointing: the inputs each checkpointed "
        "module keeps for its recomputation are copied to pinned host memory during forward (asynchronously, on a "
        "side stream) and loaded back to the device ahead of backward, per microbatch. Only inputs that require "
        "grad move (masks and ids stay). On CPU ranks there is nothing to offload (logged once).", since="1.6"),
    Key("activation_loading_horizon", _INT, 4, "With `offload_activations`: the most checkpointed calls' inputs "
        "loaded back ahead of backward and waiting on the device at once, per rank (the call backward is using is "
        "not counted). Smaller saves device memory; larger hides more copy time.", low=1, since="1.6"),
    Key("shard_optimizer_state", _BOOL, False, "ZeRO-1: each parameter's optimizer state (and fp32 master "
        "under fp16/bf16) lives on one rank of its RDP group, which steps it and broadcasts the result; "
        "per-rank state ~1/rdp. Save partial (`save_checkpoint`, or `smp.save(..., v3=True)` on every rank).",
        since="1.6"),
    Key("skip_tracing", _BOOL, False, "Skip the first-step trace; auto-partition uses module counts.",
        since="1.6"),
    Key("delayed_parameter_initialization", _BOOL, False, "Create parameters on the meta device and "
        "materialise them after partitioning.", since="1.10"),
    # --- precision ---------------------------------------------------------------------------
    Key("fp16", _BOOL, False, "FP16 training: `smp.DistributedModel` casts the model to float16 (floating "
        "inputs in, float32 outputs out), `smp.DistributedOptimizer` steps fp32 master weights and scales the "
        "loss (`static_loss_scale`, or `dynamic_loss_scale` with `dynamic_loss_args`); a step whose gradients "
        "hold an inf/NaN on any rank is skipped on every rank.", since="1.10"),
    Key("bf16", _BOOL, False, "BF16 training: the model in bfloat16, fp32 master weights in the optimizer, "
        "no loss scaling (as in SMP v1); excludes `fp16` and `fp16_params`.", since="1.11"),
    Key("fp16_params", _BOOL, False, "Deprecated: use `fp16` (same effect).", since="1.6"),
    # --- seeds and misc ---------------------------------------------------------------------
    Key("tensor_parallel_seed", _INT, 0, "Seed of random ops inside TP modules.", low=0, since="1.6"),
    Key("random_seed", _INT, None, "SMP v2: base seed, offset by tp_rank inside TP regions.", nullable=True,
        since="v2"),
    Key("deterministic_server", _BOOL, False, "Same request order on all DP ranks (smp is always "
        "deterministic).", since="1.3", status="accepted"),
    Key("comm_timeout", _FLOAT, 300.0, "Seconds any wait on another rank may take before it fails "
        "with an error naming the peers.", low=0.001, since="smp"),
    Key("memory_per_rank", (int, str), None, "Memory a rank may use for the model (bytes, or a size such as "
        "`\"12GiB\"`): the partition's per-rank estimate (weights, gradients, optimizer state, in-flight "
        "activations; TensorFlow: weights, gradients, Adam's slots) must fit, else a clear error at partitioning, "
        "on every rank, before the first step; torch's automatic partitioner looks for a split that fits.", nullable=True, since="smp"),
    # --- SMP v2 keys ------------------------------------------------------------------------
    Key("hybrid_shard_degree", _INT, 0, "SMP v2 FSDP hybrid sharding (accepted; smp replicates instead).",
        low=0, since="v2", status="accepted"),
    Key("sm_activation_offloading", _BOOL, True, "SMP v2 activation offloading (accepted; no effect).",
        since="v2", status="accepted"),
    Key("fsdp_cache_flush_warnings", _BOOL, True, "SMP v2 FSDP allocator warnings (accepted; no effect).",
        since="v2", status="accepted"),
    Key("allow_empty_shards", _BOOL, False, "SMP v2 uneven shards (accepted; no effect).", since="v2",
        status="accepted"),
    Key("context_parallel_degree", _INT, 1, "SMP v2 context parallelism (accepted; not implemented, the "
        "full sequence runs on every rank).", low=1, since="v2", status="accepted"),
    Key("expert_parallel_degree", _INT, 1, "SMP v2 expert parallelism (accepted; not implemented, experts "
        "are sharded by TP instead).", low=1, since="v2", status="accepted"),
    Key("fast_mode", _BOOL, True, "A module's outputs stay on the pipeline rank that computed them until "
        "something reads them (the caller holds references; SMP v1 fast_mode, generalised). False ships every "
        "output back to the caller after each cross-rank call."),
    # --- SMP v1 internal keys, accepted so existing scripts run --------------------------------
    Key("static_mode", _BOOL, False, "SMP v1 internal.", status="internal"),
    Key("_shard_offloaded_activations", _BOOL, True, "SMP v1 internal.", status="internal"),
    Key("task_level_activation_loading_horizon", _INT, 4, "SMP v1 internal.", low=0, status="internal"),
    Key("herring", _BOOL, False, "SMP v1 internal; requires `ddp` and `horovod` off.", status="internal"),
    Key("_match_weights", _BOOL, False, "SMP v1 internal.", status="internal"),
    Key("_fp32_grad_accumulation", _BOOL, False, "SMP v1 internal; requires `fp16` or `fp16_params`.",
        status="internal"),
    Key("checkpoint_attentions", _BOOL, False, "SMP v1 internal; forced off when pp > 1.", status="internal"),
    Key("_sharded_data_parallelism_config", _STR, None, "SMP v1 internal.", nullable=True, status="internal"),
    Key("load_partition", _BOOL, False, "TF: load the partition from `partition_file`.", status="internal"),
    Key("partition_file", _STR, None, "TF: partition file to save or load.", nullable=True, status="internal"),
)

# Keys only SMP v2 has: a config that uses one is a v2 config, where data parallelism is implicit.
V2_ONLY_KEYS = frozenset(k.name for k in KEYS if k.since == "v2")

KEYS_BY_NAME: dict[str, Key] = {k.name: k for k in KEYS}
ALIASES: dict[str, str] = {a: k.name for k in KEYS for a in k.alias}
