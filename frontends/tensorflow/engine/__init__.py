"""smp.tensorflow.engine."""

__all__: list[str] = []
