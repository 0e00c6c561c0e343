"""smp.tensorflow.model."""

__all__: list[str] = []
