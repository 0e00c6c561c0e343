"""Snapshot of the public API: growth of `smp.torch.__all__` or of the config keys is a deliberate diff."""

from __future__ import annotations

import smp.torch

from smp.config import ALIASES, KEYS

TORCH_ALL = {
    "CommGroup", "DP_GROUP", "DistributedModel", "DistributedOptimizer", "MP_GROUP", "PP_GROUP", "RDP_GROUP",
    "RankType", "StepOutput", "TP_GROUP", "WORLD", "allgather", "amp", "barrier", "broadcast", "checkpoint",
    "dp_barrier", "dp_rank", "dp_size", "exceptions", "gather", "get_dp_group", "get_dp_process_group",
    "get_mp_group", "get_mp_process_group", "get_pp_group", "get_pp_process_group", "get_rdp_group",
    "get_rdp_process_group", "get_tp_group", "get_tp_process_group", "get_world_process_group", "init",
    "is_initialized", "is_tracing", "load", "local_rank", "local_size", "mp_barrier", "mp_rank", "mp_size",
    "num_microbatches", "partition", "pp_barrier", "pp_rank", "pp_size", "rank", "rdp_barrier", "rdp_rank",
    "rdp_size", "recv_from", "reset", "resume_from_checkpoint", "save", "save_checkpoint", "send",
    "set_activation_checkpointing", "set_partition", "shutdown", "size", "state", "step", "tp_barrier", "tp_rank",
    "tp_size", "nn", "set_tensor_parallelism", "tensor_parallelism", "tp_register", "tp_register_with_module",
    "transform", "delay_param_initialization", "model_creation", "optimizers", "utils",
}

CONFIG_KEYS = {
    "pipeline_parallel_degree", "tensor_parallel_degree", "microbatches", "pipeline", "virtual_stages", "optimize",
    "placement_strategy", "auto_partition", "default_partition", "active_microbatches", "memory_weight",
    "contiguous", "ddp", "ddp_port", "ddp_dist_backend", "horovod", "prescaled_batch",
    "sharded_data_parallel_degree", "sdp_reduce_bucket_size", "sdp_param_persistence_threshold",
    "sdp_max_live_parameters", "sdp_hierarchical_allgather", "sdp_gradient_clipping", "offload_activations",
    "activation_loading_horizon", "shard_optimizer_state", "skip_tracing", "delayed_parameter_initialization",
    "fp16", "bf16", "fp16_params", "tensor_parallel_seed", "random_seed", "deterministic_server", "comm_timeout", "memory_per_rank",
    "hybrid_shard_degree", "sm_activation_offloading", "fsdp_cache_flush_warnings", "allow_empty_shards",
    "context_parallel_degree", "expert_parallel_degree", "fast_mode", "static_mode", "_shard_offloaded_activations",
    "task_level_activation_loading_horizon", "herring", "_match_weights", "_fp32_grad_accumulation",
    "checkpoint_attentions", "_sharded_data_parallelism_config", "load_partition", "partition_file",
}


def test_torch_all_snapshot() -> None:
    assert set(smp.torch.__all__) == TORCH_ALL
    for name in smp.torch.__all__:
        assert hasattr(smp.torch, name), name


def test_config_keys_snapshot() -> None:
    assert {k.name for k in KEYS} == CONFIG_KEYS
    assert ALIASES == {"partitions": "pipeline_parallel_degree"}
