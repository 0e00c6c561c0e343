"""The PyTorch frontend's own error classes (SMP v1 names), on smp's one hierarchy.

`LaunchError` is the core's (launcher detection lives in `smp.runtime.launch`), re-exported.
A leaf: it imports only `smp.errors`, so any module may import it and `smp.torch.exceptions`
re-exports it without importing the modules that raise these errors.
"""

from smp.errors import LaunchError, SMPError

__all__ = [
    "BwdExecutionNotInStepFnError",
    "DDPNotEnabledError",
    "DistributedModelNotWrappedError",
    "DistributedOptimizerError",
    "FwdExecutionNotInStepFnError",
    "LaunchError",
    "ModelNotPartitionedError",
    "MultipleDistributedModelError",
    "OptimizerArgumentError",
    "StepFunctionCalledError",
    "UnevenInputsError",
]


class DDPNotEnabledError(SMPError, RuntimeError):
    """A process-group getter that SMP v1 reserves for ``ddp: True`` was called without it."""


class DistributedModelNotWrappedError(SMPError, RuntimeError):
    """set_activation_checkpointing was called before smp.DistributedModel(...)."""


class DistributedOptimizerError(SMPError, RuntimeError):
    """The optimizer was created before the DistributedModel, or holds foreign parameters."""


class StepFunctionCalledError(SMPError, RuntimeError):
    """An ``@smp.step`` function was called from inside another one."""


class FwdExecutionNotInStepFnError(SMPError, RuntimeError):
    """``model(...)`` outside an ``@smp.step`` function with pipeline_parallel_degree > 1."""


class BwdExecutionNotInStepFnError(SMPError, RuntimeError):
    """``model.backward`` outside an ``@smp.step`` function."""


class ModelNotPartitionedError(SMPError, RuntimeError):
    """A local_* method was called before the first step partitioned the model."""


class MultipleDistributedModelError(SMPError, RuntimeError):
    """A second DistributedModel in one process."""


class UnevenInputsError(SMPError, RuntimeError):
    """``model.join(throw_on_early_termination=True)`` saw a replica run out of batches."""


class OptimizerArgumentError(SMPError, ValueError):
    """An apex optimizer argument smp cannot honour, or one outside its range."""
