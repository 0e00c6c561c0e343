"""smp.tensorflow.checkpointing."""

__all__: list[str] = []
