"""What each rank ran, per step, in order: ``(microbatch, "F" | "B", stage)`` actions, recorded at run time.

The engine puts a tiny stateful marker before each stage's forward and on the gradient path into
each stage's outputs; the step's flush closes the step. A later test compares these lists with
the shared scheduler's plan (``smp.pipeline``); this round the engine runs in lockstep order
(each microbatch's forward, then its backward), which the lists show.

Example (pp=2, 2 microbatches, rank 0 owning stages 0 and 2):
    >>> model.step_actions[-1]
    [(0, 'F', 0), (0, 'F', 2), (0, 'B', 2), (0, 'B', 0), (1, 'F', 0), (1, 'F', 2), (1, 'B', 2), (1, 'B', 0)]
"""

from __future__ import annotations

from collections import deque
from collections.abc import Sequence

import numpy as np
import tensorflow as tf

__all__ = ["ActionLog"]

Action = tuple[int, str, int]


class ActionLog:
    """The recorded actions of the last ``keep`` steps (``steps``) and of the step running now."""

    def __init__(self, keep: int = 16) -> None:
        self.steps: deque[list[Action]] = deque(maxlen=keep)
        self.current: list[Action] = []

    def end_step(self) -> None:
        """Close the running step (the flush at the step's end calls this)."""
        if self.current:
            self.steps.append(self.current)
        self.current = []

    def mark(self, microbatch: int, kind: str, stage: int) -> tf.Tensor:
        """A stateful op that records ``(microbatch, kind, stage)`` when it runs."""

        def record() -> np.int32:
            self.current.append((microbatch, kind, stage))
            return np.int32(0)

        return tf.numpy_function(record, [], tf.int32, stateful=True, name=f"smp_mark_{kind}")

    def on_backward(self, microbatch: int, stage: int, tensors: Sequence[tf.Tensor]) -> list[tf.Tensor]:
        """``tensors`` unchanged; their gradients pass a "B" marker first."""
        float_pos = [i for i, t in enumerate(tensors) if t.dtype.is_floating]
        if not float_pos:
            return list(tensors)

        @tf.custom_gradient
        def marked(*xs: tf.Tensor) -> tuple[list[tf.Tensor], object]:
            def grad(*ups: tf.Tensor | None) -> list[tf.Tensor | None]:
                token = self.mark(microbatch, "B", stage)
                with tf.control_dependencies([token]):
                    return [None if u is None else tf.identity(u) for u in ups]

            return [tf.identity(x) for x in xs], grad

        out = list(tensors)
        for i, t in zip(float_pos, marked(*[tensors[i] for i in float_pos])):
            out[i] = t
        return out
