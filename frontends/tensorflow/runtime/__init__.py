"""smp.tensorflow.runtime."""

__all__: list[str] = []
