"""`smp.DistributedModel`, split by job, and what builds a model for it.

- `model`: the class (construction, local views, hooks, forward/backward, the step and checkpoint
  interfaces of `interface`); the partition it applies is decided in `smp.torch.partitioning.decide`;
- `dispatch`: module calls sent to the rank that owns the module, through the engine;
- `data_parallel`: broadcast from DP rank 0, microbatch averaging, bucketed gradient allreduce;
- `state_dict`: local and full state dicts, ``cpu()``, ``save_pretrained`` (one full-state gather);
- `delayed`: ``smp.delay_param_initialization`` (meta parameters, materialised after partitioning);
- `creation`: ``smp.model_creation`` (tensor parallelism, delayed init and dtype in one context);
- `recompute`: ``smp.set_activation_checkpointing``;
- `offload`: ``offload_activations`` (checkpointed calls' inputs in host memory, prefetched for backward).
"""

from .model import DistributedModel

__all__ = ["DistributedModel"]
