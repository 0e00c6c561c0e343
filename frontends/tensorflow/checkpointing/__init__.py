"""smp.tensorflow.checkpointing: ``smp.CheckpointManager`` (manager.py) and the unpartitioned ``save_model`` (saving.py)."""

from .manager import CheckpointManager

__all__ = ["CheckpointManager"]
