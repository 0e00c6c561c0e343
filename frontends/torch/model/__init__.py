"""`smp.DistributedModel`, split by job.

- `model`: the class (construction, local views, hooks, forward/backward, the step and checkpoint
  interfaces of `interface`);
- `decide`: which pipeline rank owns each module (saved, automatic or manual);
- `dispatch`: module calls sent to the rank that owns the module, through the engine;
- `data_parallel`: broadcast from DP rank 0, microbatch averaging, bucketed gradient allreduce;
- `state_dict`: local and full state dicts, ``cpu()``, ``save_pretrained`` (one full-state gather).
"""

from .model import DistributedModel

__all__ = ["DistributedModel"]
