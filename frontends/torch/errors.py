"""The PyTorch frontend's own error classes (SMP v1 names), on smp's one hierarchy.

`LaunchError` is the core's (launcher detection lives in `smp.runtime.launch`), re-exported.
A leaf: it imports only `smp.errors`, so any module may import it and `smp.torch.exceptions`
re-exports it without importing the modules that raise these errors.
"""

from smp.errors import LaunchError, SMPError

__all__ = [
    "DDPNotEnabledError",
    "DistributedModelNotWrappedError",
    "DistributedOptimizerError",
    "LaunchError",
    "StepFunctionCalledError",
]


class DDPNotEnabledError(SMPError, RuntimeError):
    """A process-group getter that SMP v1 reserves for ``ddp: True`` was called without it."""


class DistributedModelNotWrappedError(SMPError, RuntimeError):
    """set_activation_checkpointing was called before smp.DistributedModel(...)."""


class DistributedOptimizerError(SMPError, RuntimeError):
    """The optimizer was created before the DistributedModel, or holds foreign parameters."""


class StepFunctionCalledError(SMPError, RuntimeError):
    """An ``@smp.step`` function was called from inside another one."""
