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

from .comm import DDPNotEnabledError
from .launch import LaunchError
from .model import (
    BwdExecutionNotInStepFnError,
    FwdExecutionNotInStepFnError,
    ModelNotPartitionedError,
    MultipleDistributedModelError,
)
from .optimizer import DistributedOptimizerError
from .recompute import DistributedModelNotWrappedError
from .step import StepFunctionCalledError

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
