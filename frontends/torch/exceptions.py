"""SMP v1 exception names for PyTorch users (``smp.torch.exceptions``), on smp's one hierarchy."""

from smp.errors import (
    CommTimeoutError,
    InvalidCommGroupError,
    NotInitializedError,
    PartitionError,
    RemoteRankError,
    SMPCheckpointError,
    SMPConfigError,
    SMPError,
    SMPInvalidArgumentError,
    SMPValidationError,
    StepOutputError,
    TensorSplitError,
)

from .errors import (
    BwdExecutionNotInStepFnError,
    DDPNotEnabledError,
    DistributedModelNotWrappedError,
    DistributedOptimizerError,
    FwdExecutionNotInStepFnError,
    LaunchError,
    ModelNotPartitionedError,
    MultipleDistributedModelError,
    StepFunctionCalledError,
)

__all__ = [
    "BwdExecutionNotInStepFnError",
    "DistributedModelNotWrappedError",
    "DistributedOptimizerError",
    "FwdExecutionNotInStepFnError",
    "ModelNotPartitionedError",
    "MultipleDistributedModelError",
    "SMPCheckpointError",
    "StepFunctionCalledError",
    "StepOutputError",
    "TensorSplitError",
    "CommTimeoutError",
    "DDPNotEnabledError",
    "InvalidCommGroupError",
    "LaunchError",
    "NotInitializedError",
    "PartitionError",
    "RemoteRankError",
    "SMPConfigError",
    "SMPError",
    "SMPInvalidArgumentError",
    "SMPValidationError",
]
