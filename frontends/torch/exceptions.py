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
    DDPNotEnabledError,
    DistributedModelNotWrappedError,
    DistributedOptimizerError,
    LaunchError,
    StepFunctionCalledError,
)

# The four DistributedModel errors still live in model.py (being split into rooms); they move to
# `.errors` with that split.
from .model import (
    BwdExecutionNotInStepFnError,
    FwdExecutionNotInStepFnError,
    ModelNotPartitionedError,
    MultipleDistributedModelError,
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
