"""smp.tensorflow.partitioning."""

__all__: list[str] = []
