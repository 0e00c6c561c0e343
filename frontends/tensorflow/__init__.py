"""smp for TensorFlow / Keras 3: ``import smp.tensorflow as smp`` (was ``import smdistributed.modelparallel.tensorflow as smp``).

Each room exports its public names through its package's ``__all__``; this file only gathers them.
Importing it imports TensorFlow, Keras and mpi4py, never torch.
"""

import smp.state as _state_mod

from .checkpointing import *  # noqa: F403 - CheckpointManager
from .checkpointing import __all__ as _checkpointing_all
from .model import *  # noqa: F403 - DistributedModel, partition, register_post_partition_hook
from .model import __all__ as _model_all
from .runtime import *  # noqa: F403 - init, reset, the rank API, communication primitives
from .runtime import __all__ as _runtime_all
from .step import StepOutput as StepOutput
from .step import step as step

state = _state_mod.current()

__all__ = sorted({*_runtime_all, *_model_all, *_checkpointing_all, "state", "step", "StepOutput"})
