"""The rules between configuration keys (reference sections 1.2, 1.3 and 12), as a registry.

Each rule is a small function of the resolved values. The runner (`apply_rules`) hands it a view
that records which keys it reads; a rule that read a key which already failed validation (or whose
default was derived from one) has its problems dropped, because they would be computed from a
stand-in value, not the user's: ``pipeline_parallel_degree: "2"`` at world size 4 must report the
type error only, not "pp 1 x tp 1 x rdp 4 needs ddp". Recording reads, rather than declaring each
rule's inputs by hand, keeps the inputs exact as rules change.

Example:
    >>> from smp.config import resolve
    >>> from smp.errors import SMPConfigError
    >>> try:
    ...     resolve({"pipeline_parallel_degree": "2"}, world_size=4, environ={})
    ... except SMPConfigError as err:
    ...     print([p.key for p in err.problems])
    ['pipeline_parallel_degree']
"""

from __future__ import annotations

from collections.abc import Callable, Iterator, MutableMapping
from dataclasses import dataclass, field
from typing import Any

from smp.config.schema import V2_ONLY_KEYS
from smp.errors import ConfigProblem

__all__ = ["RULES", "Reads", "RuleContext", "apply_rules"]


class Reads(MutableMapping[str, Any]):
    """A view of the resolved values that records every key read through it (writes pass through)."""

    def __init__(self, values: MutableMapping[str, Any]) -> None:
        self._values = values
        self.read: set[str] = set()

    def __getitem__(self, name: str) -> Any:
        self.read.add(name)
        return self._values[name]

    def __setitem__(self, name: str, value: Any) -> None:
        self._values[name] = value

    def __delitem__(self, name: str) -> None:
        del self._values[name]

    def __iter__(self) -> Iterator[str]:
        return iter(self._values)

    def __len__(self) -> int:
        return len(self._values)


@dataclass
class RuleContext:
    """What a rule may use besides the values: the keys the user gave, the launch facts, the outputs."""

    given: frozenset[str]
    world_size: int | None
    framework: str
    problems: list[ConfigProblem] = field(default_factory=list)
    notes: list[str] = field(default_factory=list)


Rule = Callable[[MutableMapping[str, Any], RuleContext], None]


def _v2_keys_turn_on_ddp(cfg: MutableMapping[str, Any], ctx: RuleContext) -> None:
    v2_keys = sorted(ctx.given & V2_ONLY_KEYS)
    if v2_keys and "ddp" not in ctx.given and ctx.framework == "torch":
        # SMP v2 always shards data parallelism (FSDP); there is no ddp key to turn it on.
        cfg["ddp"] = True
        ctx.notes.append(f"SMP v2 keys ({', '.join(v2_keys)}) given: data parallelism is on (ddp: True), as in SMP v2")


def _world_size_fits_degrees(cfg: MutableMapping[str, Any], ctx: RuleContext) -> None:
    if ctx.world_size is None:
        return
    world, pp, tp = ctx.world_size, cfg["pipeline_parallel_degree"], cfg["tensor_parallel_degree"]
    if pp * tp > world or world % (pp * tp):
        ctx.problems.append(ConfigProblem(
            "pipeline_parallel_degree", pp,
            f"world size {world} must be a multiple of pipeline_parallel_degree x tensor_parallel_degree "
            f"= {pp} x {tp} = {pp * tp}",
            f"launch a multiple of {pp * tp} processes, or change the degrees so that pp x tp divides {world}"))
    elif world // (pp * tp) > 1 and not (cfg["ddp"] or cfg["horovod"]):
        dp_key = "horovod" if ctx.framework == "tensorflow" else "ddp"
        ctx.problems.append(ConfigProblem(
            dp_key, cfg[dp_key],
            f"world size {world} = pp {pp} x tp {tp} x rdp {world // (pp * tp)}: more than one "
            "model replica needs data parallelism", f"set {dp_key}: True (or launch {pp * tp} processes)"))


def _tensor_parallelism_needs_ddp(cfg: MutableMapping[str, Any], ctx: RuleContext) -> None:
    tp = cfg["tensor_parallel_degree"]
    if tp > 1 and ctx.framework == "torch" and not cfg["ddp"]:
        ctx.problems.append(ConfigProblem("tensor_parallel_degree", tp, "tensor parallelism requires ddp (as in SMP v1)",
                                          "set ddp: True"))
    if tp > 1 and ctx.framework == "tensorflow":
        ctx.problems.append(ConfigProblem("tensor_parallel_degree", tp,
                                          "the TensorFlow frontend has no tensor parallelism",
                                          "set tensor_parallel_degree: 1"))


def _one_data_parallel_engine(cfg: MutableMapping[str, Any], ctx: RuleContext) -> None:
    if cfg["ddp"] and cfg["horovod"]:
        ctx.problems.append(ConfigProblem("horovod", True, "ddp and horovod cannot both be on", "keep one of them"))


def _one_half_precision(cfg: MutableMapping[str, Any], ctx: RuleContext) -> None:
    if cfg["fp16"] and cfg["bf16"]:
        ctx.problems.append(ConfigProblem("bf16", True, "fp16 and bf16 cannot both be on", "keep one of them"))


def _bf16_without_fp16_params(cfg: MutableMapping[str, Any], ctx: RuleContext) -> None:
    if cfg["bf16"] and cfg["fp16_params"]:
        ctx.problems.append(ConfigProblem("bf16", True, "bf16 requires fp16_params: False", "remove fp16_params"))


def _fp16_params_deprecated(cfg: MutableMapping[str, Any], ctx: RuleContext) -> None:
    if "fp16_params" in ctx.given and cfg["fp16_params"]:
        ctx.notes.append("fp16_params is deprecated; use fp16")


def _default_partition_in_range(cfg: MutableMapping[str, Any], ctx: RuleContext) -> None:
    part = cfg["default_partition"]
    if part is not None and part >= cfg["pipeline_parallel_degree"]:
        pp = cfg["pipeline_parallel_degree"]
        ctx.problems.append(ConfigProblem("default_partition", part, f"must be < pipeline_parallel_degree ({pp})",
                                          f"use a partition index in 0..{pp - 1}"))


def _manual_partition_needs_default(cfg: MutableMapping[str, Any], ctx: RuleContext) -> None:
    if not cfg["auto_partition"] and cfg["default_partition"] is None:
        ctx.problems.append(ConfigProblem("default_partition", None, "auto_partition: False requires default_partition",
                                          "add default_partition: 0 (the partition of modules you do not place)"))


def _active_within_microbatches(cfg: MutableMapping[str, Any], ctx: RuleContext) -> None:
    if "active_microbatches" in ctx.given and cfg["active_microbatches"] > cfg["microbatches"]:
        mb = cfg["microbatches"]
        ctx.problems.append(ConfigProblem("active_microbatches", cfg["active_microbatches"],
                                          f"must be <= microbatches ({mb})", f"use a value in 1..{mb}"))


def _simple_with_fewer_active_is_interleaved(cfg: MutableMapping[str, Any], ctx: RuleContext) -> None:
    if cfg["pipeline"] == "simple" and cfg["active_microbatches"] < cfg["microbatches"]:
        # Reference section 12, conflict 12: SMP v1's code runs `interleaved` in this case.
        ctx.notes.append(f"pipeline 'simple' with active_microbatches={cfg['active_microbatches']} < "
                         f"microbatches={cfg['microbatches']} runs as 'interleaved', as SMP v1 does; set "
                         "active_microbatches to microbatches for GPipe order")
        cfg["pipeline"] = "interleaved"


def _ddp_keys_need_ddp(cfg: MutableMapping[str, Any], ctx: RuleContext) -> None:
    if "ddp_port" in ctx.given and cfg["ddp_port"] is not None and not cfg["ddp"]:
        ctx.problems.append(ConfigProblem("ddp_port", cfg["ddp_port"], "needs ddp: True",
                                          "set ddp: True or remove the key"))
    if "ddp_dist_backend" in ctx.given and cfg["ddp_dist_backend"] != "auto" and not cfg["ddp"]:
        ctx.problems.append(ConfigProblem("ddp_dist_backend", cfg["ddp_dist_backend"], "needs ddp: True",
                                          "set ddp: True or remove the key"))


def _sharded_degree_divides_dp(cfg: MutableMapping[str, Any], ctx: RuleContext) -> None:
    sdp = cfg["sharded_data_parallel_degree"]
    if ctx.world_size is None or sdp <= 1:
        return
    pp, tp = cfg["pipeline_parallel_degree"], cfg["tensor_parallel_degree"]
    if ctx.world_size % (pp * tp) == 0 and (ctx.world_size // pp) % sdp:
        dp = ctx.world_size // pp
        ctx.problems.append(ConfigProblem("sharded_data_parallel_degree", sdp, f"must divide the DP degree ({dp})",
                                          f"use a divisor of {dp}"))


def _prescaled_batch_needs_speed(cfg: MutableMapping[str, Any], ctx: RuleContext) -> None:
    if cfg["prescaled_batch"] and cfg["optimize"] != "speed":
        ctx.problems.append(ConfigProblem("prescaled_batch", True, "requires optimize: 'speed' (as in SMP v1)",
                                          "set optimize: 'speed' or prescaled_batch: False"))


def _herring_alone(cfg: MutableMapping[str, Any], ctx: RuleContext) -> None:
    if cfg["herring"] and (cfg["ddp"] or cfg["horovod"]):
        ctx.problems.append(ConfigProblem("herring", True, "requires ddp and horovod off", "turn herring off"))


def _fp32_accumulation_needs_fp16(cfg: MutableMapping[str, Any], ctx: RuleContext) -> None:
    if cfg["_fp32_grad_accumulation"] and not (cfg["fp16"] or cfg["fp16_params"]):
        ctx.problems.append(ConfigProblem("_fp32_grad_accumulation", True, "requires fp16 or fp16_params",
                                          "turn it off"))


def _no_attention_checkpointing_under_pp(cfg: MutableMapping[str, Any], ctx: RuleContext) -> None:
    if cfg["checkpoint_attentions"] and cfg["pipeline_parallel_degree"] > 1:
        ctx.notes.append("checkpoint_attentions is turned off because pipeline_parallel_degree > 1 (as in SMP v1)")
        cfg["checkpoint_attentions"] = False


def _virtual_stages_fit_the_schedule(cfg: MutableMapping[str, Any], ctx: RuleContext) -> None:
    vs = cfg["virtual_stages"]
    if vs > 1 and cfg["pipeline"] not in ("interleaved_1f1b", "zb_v", "gpipe", "1f1b", "_only_forward"):
        ctx.problems.append(ConfigProblem(
            "virtual_stages", vs, f"pipeline {cfg['pipeline']!r} runs one stage per rank",
            "use pipeline: 'interleaved_1f1b' or 'zb_v' with virtual stages, or virtual_stages: 1"))
    if cfg["pipeline"] == "zb_v" and vs != 2:
        ctx.problems.append(ConfigProblem("virtual_stages", vs, "pipeline 'zb_v' places exactly 2 chunks per rank "
                                          "in a V", "set virtual_stages: 2"))


def _memory_per_rank_is_a_size(cfg: MutableMapping[str, Any], ctx: RuleContext) -> None:
    value = cfg["memory_per_rank"]
    if value is None:
        return
    from smp.partition.report import parse_size

    size = parse_size(value) if isinstance(value, str) else value
    if size is None or size <= 0:
        ctx.problems.append(ConfigProblem("memory_per_rank", value, "must be a positive number of bytes or a size "
                                          "such as '12GiB' or '16GB'", "write e.g. memory_per_rank: '12GiB'"))
        return
    cfg["memory_per_rank"] = int(size)


# Applied in this order: a rule may change a value a later rule reads (ddp turned on by v2 keys,
# 'simple' run as 'interleaved' before the virtual-stage check).
RULES: tuple[Rule, ...] = (
    _v2_keys_turn_on_ddp,
    _world_size_fits_degrees,
    _tensor_parallelism_needs_ddp,
    _one_data_parallel_engine,
    _one_half_precision,
    _bf16_without_fp16_params,
    _fp16_params_deprecated,
    _default_partition_in_range,
    _manual_partition_needs_default,
    _active_within_microbatches,
    _simple_with_fewer_active_is_interleaved,
    _ddp_keys_need_ddp,
    _sharded_degree_divides_dp,
    _prescaled_batch_needs_speed,
    _herring_alone,
    _fp32_accumulation_needs_fp16,
    _no_attention_checkpointing_under_pp,
    _virtual_stages_fit_the_schedule,
    _memory_per_rank_is_a_size,
)


def apply_rules(cfg: MutableMapping[str, Any], ctx: RuleContext, failed: set[str],
                rules: tuple[Rule, ...] = RULES) -> None:
    """Run ``rules`` in order; keep a rule's problems only if it read no key in ``failed``.

    A rule whose problems are dropped still counts as having read its keys: a value it wrote
    (e.g. ``ddp`` turned on) is marked failed too, so later rules do not build on it. Notes from
    such a rule are dropped as well; they would never be printed, since a failed key raises.
    """
    for rule in rules:
        view = Reads(cfg)
        sub = RuleContext(ctx.given, ctx.world_size, ctx.framework)
        before = dict(cfg)
        rule(view, sub)
        if view.read & failed:
            failed.update(k for k in cfg if cfg[k] != before.get(k))
            continue
        ctx.problems.extend(sub.problems)
        ctx.notes.extend(sub.notes)
