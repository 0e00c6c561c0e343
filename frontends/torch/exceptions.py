"""SMP v1 exception names for PyTorch users (``smp.torch.exceptions``), on smp's one hierarchy."""

from smp.errors import (
    CommTimeoutError,
    InvalidCommGroupError,
    NotInitializedError,
    PartitionError,
    RemoteRankError,
    SMPConfigError,
    SMPError,
    SMPInvalidArgumentError,
    SMPValidationError,
)

from .comm import DDPNotEnabledError
from .launch import LaunchError

__all__ = [
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
