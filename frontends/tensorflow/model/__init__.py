"""smp.tensorflow.model: ``DistributedModel``, ``smp.partition`` and ``register_post_partition_hook``."""

from ..partitioning.scopes import partition
from .hooks import register_post_partition_hook
from .model import DistributedModel

__all__ = ["DistributedModel", "partition", "register_post_partition_hook"]
