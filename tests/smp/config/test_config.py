"""Configuration: the bad-config corpus, the valid SMP v1/v2 examples, sources and precedence."""

from __future__ import annotations

import json
from typing import Any

import pytest

from smp.config import KEYS, PIPELINE_NAMES, resolve
from smp.config.docs import markdown_table
from smp.errors import SMPConfigError

# (config, world_size, the key the error must name). Types, ranges, unknown keys, world sizes, pairs.
BAD: list[tuple[dict[str, Any], int | None, str]] = [
    ({"pipeline_parallel_degree": 0}, None, "pipeline_parallel_degree"),
    ({"pipeline_parallel_degree": "2"}, None, "pipeline_parallel_degree"),
    ({"pipeline_parallel_degree": 2.0}, None, "pipeline_parallel_degree"),
    ({"pipeline_parallel_degree": True}, None, "pipeline_parallel_degree"),
    ({"partitions": -1}, None, "pipeline_parallel_degree"),
    ({"partitions": 2, "pipeline_parallel_degree": 4}, None, "pipeline_parallel_degree"),
    ({"microbatches": 0}, None, "microbatches"),
    ({"microbatches": 4.5}, None, "microbatches"),
    ({"microbatches": None}, None, "microbatches"),
    ({"tensor_parallel_degree": 0}, None, "tensor_parallel_degree"),
    ({"tensor_parallel_degree": 2}, 2, "tensor_parallel_degree"),  # TP needs ddp
    ({"pipeline": "interleave"}, None, "pipeline"),
    ({"pipeline": "GPipe"}, None, "pipeline"),
    ({"pipeline": 1}, None, "pipeline"),
    ({"optimize": "fast"}, None, "optimize"),
    ({"placement_strategy": "DPX"}, None, "placement_strategy"),
    ({"placement_strategy": "clustered"}, None, "placement_strategy"),
    ({"auto_partition": 1}, None, "auto_partition"),
    ({"auto_partition": "False"}, None, "auto_partition"),
    ({"auto_partition": False}, None, "default_partition"),
    ({"pipeline_parallel_degree": 2, "default_partition": 2}, 2, "default_partition"),
    ({"default_partition": -1}, None, "default_partition"),
    ({"ddp": 1}, None, "ddp"),
    ({"ddp": True, "horovod": True}, None, "horovod"),
    ({"ddp_port": 29500}, None, "ddp_port"),
    ({"ddp": True, "ddp_port": -5}, None, "ddp_port"),
    ({"ddp_dist_backend": "mpi"}, None, "ddp_dist_backend"),
    ({"ddp_dist_backend": "nccl"}, None, "ddp_dist_backend"),
    ({"memory_weight": 1.5}, None, "memory_weight"),
    ({"memory_weight": -0.1}, None, "memory_weight"),
    ({"memory_weight": "0.5"}, None, "memory_weight"),
    ({"microbatches": 4, "active_microbatches": 5}, None, "active_microbatches"),
    ({"active_microbatches": 0}, None, "active_microbatches"),
    ({"fp16": True, "bf16": True}, None, "bf16"),
    ({"bf16": True, "fp16_params": True}, None, "bf16"),
    ({"prescaled_batch": True, "optimize": "memory"}, None, "prescaled_batch"),
    ({"activation_loading_horizon": 0}, None, "activation_loading_horizon"),
    ({"microbatchs": 4}, None, "microbatchs"),
    ({"pipline": "simple"}, None, "pipline"),
    ({"tensor_parallelism_degree": 2}, None, "tensor_parallelism_degree"),
    ({"pipeline_parallel_degree": 2}, 3, "pipeline_parallel_degree"),
    ({"pipeline_parallel_degree": 4}, 2, "pipeline_parallel_degree"),
    ({"pipeline_parallel_degree": 2, "tensor_parallel_degree": 2, "ddp": True}, 6, "pipeline_parallel_degree"),
    ({"pipeline_parallel_degree": 2}, 4, "ddp"),  # two replicas without data parallelism
    ({"sharded_data_parallel_degree": 3, "ddp": True}, 4, "sharded_data_parallel_degree"),
    ({"herring": True, "ddp": True}, None, "herring"),
    ({"_fp32_grad_accumulation": True}, None, "_fp32_grad_accumulation"),
    ({"virtual_stages": 2, "pipeline": "interleaved"}, None, "virtual_stages"),
    ({"pipeline": "zb_v"}, None, "virtual_stages"),
    ({"comm_timeout": 0}, None, "comm_timeout"),
    ({"tensor_parallel_seed": -1}, None, "tensor_parallel_seed"),
    ({"random_seed": "7"}, None, "random_seed"),
]


@pytest.mark.parametrize("config,world,key", BAD, ids=[f"{i}-{k}" for i, (_, _, k) in enumerate(BAD)])
def test_bad_config_is_rejected_naming_its_key(config: dict[str, Any], world: int | None, key: str) -> None:
    with pytest.raises(SMPConfigError) as info:
        resolve(config, world_size=world, environ={})
    assert isinstance(info.value, ValueError)
    assert key in [p.key for p in info.value.problems], str(info.value)
    for problem in info.value.problems:
        assert problem.rule and problem.fix
        assert problem.key in str(info.value)


def test_corpus_size() -> None:
    assert len(BAD) >= 30


def test_every_problem_is_reported_at_once() -> None:
    with pytest.raises(SMPConfigError) as info:
        resolve({"microbatches": 0, "pipeline": "x", "ddp": "yes", "unknown_key": 1}, environ={})
    assert {p.key for p in info.value.problems} == {"microbatches", "pipeline", "ddp", "unknown_key"}


def test_did_you_mean() -> None:
    with pytest.raises(SMPConfigError, match="did you mean 'microbatches'"):
        resolve({"microbatchs": 4}, environ={})
    with pytest.raises(SMPConfigError, match="did you mean 'interleaved'"):
        resolve({"pipeline": "interleave"}, environ={})


# Reference 11.4: the documented launcher dicts, with a world size each fits.
VALID = [
    ({"partitions": 2, "microbatches": 4, "placement_strategy": "spread", "pipeline": "interleaved",
      "optimize": "speed", "horovod": True}, 4, "tensorflow"),
    ({"pipeline_parallel_degree": 2, "microbatches": 4, "placement_strategy": "spread", "pipeline": "interleaved",
      "optimize": "speed", "ddp": True}, 8, "torch"),
    ({"pipeline_parallel_degree": 1, "placement_strategy": "cluster", "tensor_parallel_degree": 4, "ddp": True},
     4, "torch"),
    ({"microbatches": 4, "pipeline_parallel_degree": 2, "tensor_parallel_degree": 2, "placement_strategy": "cluster",
      "ddp": True, "shard_optimizer_state": True, "offload_activations": True, "activation_loading_horizon": 4,
      "fp16": True}, 8, "torch"),
    ({"ddp": True, "sharded_data_parallel_degree": 2, "sdp_reduce_bucket_size": int(5e8),
      "sdp_param_persistence_threshold": int(1e6), "sdp_max_live_parameters": int(1e9),
      "sdp_hierarchical_allgather": True, "sdp_gradient_clipping": 1.0, "bf16": True, "ddp_dist_backend": "auto"},
     8, "torch"),
    ({"tensor_parallel_degree": 4, "hybrid_shard_degree": 8, "sm_activation_offloading": True,
      "activation_loading_horizon": 2, "context_parallel_degree": 2, "expert_parallel_degree": 1, "random_seed": 0},
     16, "torch"),
]


@pytest.mark.parametrize("config,world,framework", VALID)
def test_documented_configs_are_accepted(config: dict[str, Any], world: int, framework: str) -> None:
    cfg = resolve(config, world_size=world, framework=framework, environ={})
    for key, value in config.items():
        assert cfg[key] == value


def test_defaults_and_derived_values() -> None:
    cfg = resolve({"pipeline_parallel_degree": 2, "microbatches": 8}, environ={})
    assert cfg.active_microbatches == 4  # pp + 2
    assert resolve({"pipeline_parallel_degree": 4, "microbatches": 3}, environ={}).active_microbatches == 3  # capped
    assert cfg.pipeline == "interleaved" and cfg.optimize == "speed" and cfg.placement_strategy == "cluster"
    assert cfg.memory_weight == 0.2
    assert resolve({"optimize": "memory"}, environ={}).memory_weight == 0.8
    assert cfg.partitions == 2  # alias readable


def test_simple_with_fewer_active_runs_interleaved_and_says_so() -> None:
    cfg = resolve({"pipeline_parallel_degree": 2, "microbatches": 8, "pipeline": "simple"}, environ={})
    assert cfg.pipeline == "interleaved"
    assert any("runs as 'interleaved'" in n for n in cfg.notes)
    cfg = resolve({"pipeline_parallel_degree": 2, "microbatches": 4, "pipeline": "simple"}, environ={})
    assert cfg.pipeline == "simple" and not cfg.notes


def test_env_overrides_dict_key_by_key(tmp_path: Any) -> None:
    env = {"SM_HP_MP_PARAMETERS": json.dumps({"partitions": 4, "ddp": True})}
    cfg = resolve({"pipeline_parallel_degree": 2, "microbatches": 8}, environ=env)
    assert cfg.pipeline_parallel_degree == 4 and cfg.ddp and cfg.microbatches == 8
    assert any("overrides" in n for n in cfg.notes)
    path = tmp_path / "smp.json"
    path.write_text(json.dumps({"microbatches": 2, "pipeline": "simple"}))
    cfg = resolve(str(path), environ=env)
    assert (cfg.microbatches, cfg.pipeline_parallel_degree, cfg.pipeline) == (2, 4, "simple")


def test_bad_sources() -> None:
    with pytest.raises(SMPConfigError, match="SM_HP_MP_PARAMETERS"):
        resolve({}, environ={"SM_HP_MP_PARAMETERS": "{not json"})
    with pytest.raises(SMPConfigError, match="does not exist"):
        resolve("/nonexistent/smp.json", environ={})
    with pytest.raises(SMPConfigError, match="JSON object"):
        resolve([("microbatches", 2)], environ={})  # type: ignore[arg-type]


def test_accepted_only_keys_are_logged() -> None:
    cfg = resolve({"sdp_hierarchical_allgather": False, "shard_optimizer_state": True}, environ={})
    assert any("sdp_hierarchical_allgather" in n for n in cfg.notes)
    assert not any("shard_optimizer_state" in n for n in cfg.notes)  # it takes effect


def test_config_is_read_only() -> None:
    cfg = resolve({}, environ={})
    with pytest.raises(AttributeError):
        cfg.microbatches = 3  # type: ignore[misc]
    with pytest.raises(AttributeError, match="did you mean"):
        cfg.microbatchs  # noqa: B018


def test_markdown_table_lists_every_public_key() -> None:
    table = markdown_table()
    for key in KEYS:
        if key.status != "internal":
            assert f"`{key.name}`" in table
    assert "`partitions`" in table


def test_schedule_names_match_the_scheduler_registry() -> None:
    from smp.pipeline import SCHEDULES

    assert set(SCHEDULES) == set(PIPELINE_NAMES)


def test_pipeline_section_caps_only_smp_v1_schedules_by_default() -> None:
    base = {"pipeline_parallel_degree": 4, "microbatches": 16}
    assert resolve({**base, "pipeline": "interleaved"}, environ={}).pipeline_section().active_microbatches == 6
    assert resolve({**base, "pipeline": "interleaved_1f1b"}, environ={}).pipeline_section().active_microbatches is None
    given = resolve({**base, "pipeline": "1f1b", "active_microbatches": 5}, environ={})
    assert given.pipeline_section().active_microbatches == 5


# Valid configs (at their world size) where a stand-in default for any one key would trip a
# cross-key rule: pp 1 at world 2 needs ddp, default pipeline 'interleaved' refuses virtual
# stages, default virtual_stages 1 fails zb_v, default microbatches 1 is below active_microbatches...
TRIPWIRES: list[tuple[dict[str, Any], int | None]] = [
    ({"pipeline_parallel_degree": 2, "microbatches": 4, "active_microbatches": 3, "default_partition": 1}, 2),
    ({"tensor_parallel_degree": 2, "ddp": True}, 2),
    ({"pipeline_parallel_degree": 2, "pipeline": "1f1b", "virtual_stages": 2}, 2),
    ({"pipeline": "zb_v", "virtual_stages": 2}, None),
    ({"auto_partition": False, "default_partition": 0}, None),
    ({"ddp": True, "ddp_port": 29500, "ddp_dist_backend": "gloo"}, None),
    ({"fp16": True, "_fp32_grad_accumulation": True}, None),
    ({"partitions": 2, "microbatches": 2, "sharded_data_parallel_degree": 2, "ddp": True}, 8),
    *[(config, world) for config, world, framework in VALID if framework == "torch"],
]


def _wrong_type(value: Any) -> Any:
    """A value of another JSON type that a user could plausibly write: 2 -> "2", True -> "True", "x" -> 1."""
    return 1 if isinstance(value, str) else str(value)


def _problem_keys(config: dict[str, Any], world: int | None) -> list[str]:
    with pytest.raises(SMPConfigError) as info:
        resolve(config, world_size=world, environ={})
    return [p.key for p in info.value.problems]


@pytest.mark.parametrize("config,world", TRIPWIRES)
def test_a_bad_typed_key_reports_only_itself(config: dict[str, Any], world: int | None) -> None:
    resolve(config, world_size=world, environ={})  # valid as given
    for name, value in config.items():
        canonical = "pipeline_parallel_degree" if name == "partitions" else name
        assert _problem_keys({**config, name: _wrong_type(value)}, world) == [canonical], name


@pytest.mark.parametrize("config,world", TRIPWIRES)
def test_several_bad_typed_keys_report_only_themselves(config: dict[str, Any], world: int | None) -> None:
    names = list(config)
    canonical = ["pipeline_parallel_degree" if n == "partitions" else n for n in names]
    for i in range(len(names)):
        for j in range(i + 1, len(names)):
            bad = {**config, names[i]: _wrong_type(config[names[i]]), names[j]: _wrong_type(config[names[j]])}
            assert sorted(_problem_keys(bad, world)) == sorted([canonical[i], canonical[j]]), (names[i], names[j])
    every = {name: _wrong_type(value) for name, value in config.items()}
    assert sorted(_problem_keys(every, world)) == sorted(canonical)


def test_the_issue_example_reports_the_type_error_only() -> None:
    # Before: also "ddp=False: world size 4 = pp 1 x tp 1 x rdp 4 ... needs data parallelism".
    with pytest.raises(SMPConfigError) as info:
        resolve({"pipeline_parallel_degree": "2"}, world_size=4, environ={})
    assert [str(p) for p in info.value.problems] == [
        "pipeline_parallel_degree='2': must be of type int, got str. Fix: write e.g. pipeline_parallel_degree: 2"]


def test_a_key_given_twice_is_not_used_by_rules() -> None:
    # partitions=2 vs pipeline_parallel_degree=4 is the problem; "default_partition 3 >= 2" is not.
    keys = _problem_keys({"partitions": 2, "pipeline_parallel_degree": 4, "default_partition": 3}, None)
    assert keys == ["pipeline_parallel_degree"]


def test_a_default_derived_from_a_bad_key_is_not_offered_as_the_fix() -> None:
    with pytest.raises(SMPConfigError) as info:
        resolve({"pipeline_parallel_degree": "4", "microbatches": 8, "active_microbatches": 2.5}, environ={})
    fix = {p.key: p.fix for p in info.value.problems}
    assert fix["pipeline_parallel_degree"] == "write e.g. pipeline_parallel_degree: 4"
    # pp + 2 from the stand-in pp=1 would say 3, a number the user's config does not imply.
    assert fix["active_microbatches"] == "write e.g. active_microbatches: 1"


def test_rules_still_fire_on_valid_values_next_to_a_bad_key() -> None:
    # A rule that reads only valid keys reports as before, whatever else failed.
    keys = _problem_keys({"microbatches": "4", "fp16": True, "bf16": True, "tensor_parallel_degree": 2}, 2)
    assert sorted(keys) == ["bf16", "microbatches", "tensor_parallel_degree"]
