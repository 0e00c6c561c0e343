"""What each rank ran, per step, in order: ``(microbatch, "F" | "B", stage)`` actions, recorded at run time.

The engine puts a tiny marker before each stage's forward and on the gradient path into each
stage's outputs; the step's flush closes the step. Lockstep (the default) shows each microbatch's
forward, then its backward; with overlap (`engine.schedule`) the lists follow the shared
scheduler's plan, and each action also has its start and end time, which `step_timeline` turns
into an ``smp.pipeline.Timeline`` for the same renderers as torch (``render_svg``,
``render_ascii``, ``render_chrome_trace``).

Example (pp=2, 2 microbatches, lockstep, rank 0 owning stages 0 and 2):
    >>> model.step_actions[-1]
    [(0, 'F', 0), (0, 'F', 2), (0, 'B', 2), (0, 'B', 0), (1, 'F', 0), (1, 'F', 2), (1, 'B', 2), (1, 'B', 0)]
"""

from __future__ import annotations

import threading
import time
from collections import deque
from collections.abc import Sequence
from typing import Any

import numpy as np
import tensorflow as tf

__all__ = ["ActionLog", "step_timeline"]

Action = tuple[int, str, int]
Timed = tuple[int, str, int, float, float]


class ActionLog:
    """The recorded actions of the last ``keep`` steps (``steps``, ``timed``) and of the step running now.

    Markers run on TensorFlow's executor threads (several at once with overlap), hence the lock.
    """

    def __init__(self, keep: int = 16) -> None:
        self.steps: deque[list[Action]] = deque(maxlen=keep)
        self.timed: deque[list[Timed]] = deque(maxlen=keep)
        self.current: list[Action] = []
        self._open: list[list[Any]] = []
        self._lock = threading.Lock()

    def started(self, microbatch: int, kind: str, stage: int) -> None:
        """Action ``(microbatch, kind, stage)`` starts now."""
        with self._lock:
            self.current.append((microbatch, kind, stage))
            self._open.append([microbatch, kind, stage, time.time(), None])

    def ended(self, microbatch: int, kind: str, stage: int) -> None:
        """The last started ``(microbatch, kind, stage)`` ends now."""
        with self._lock:
            for rec in reversed(self._open):
                if rec[:3] == [microbatch, kind, stage] and rec[4] is None:
                    rec[4] = time.time()
                    break

    def end_step(self) -> None:
        """Close the running step (the flush at the step's end calls this).

        An action with no recorded end (lockstep markers record starts only) ends where the next
        one starts, the last one at the flush.
        """
        with self._lock:
            stop = time.time()
            if self.current:
                self.steps.append(self.current)
                timed: list[Timed] = []
                for i, (m, k, s, start, end) in enumerate(self._open):
                    if end is None:
                        end = self._open[i + 1][3] if i + 1 < len(self._open) else stop
                    timed.append((m, k, s, start, max(end, start)))
                self.timed.append(timed)
            self.current = []
            self._open = []

    def mark(self, microbatch: int, kind: str, stage: int, gate: Any = None,
             probe: tf.Tensor | None = None) -> tf.Tensor:
        """An op that records ``(microbatch, kind, stage)`` when it runs; returns its int32 token.

        Without ``gate``: a stateful op (it runs in program order). With a `schedule.StepGate`
        and a non-constant ``probe`` tensor: the gate's stateless marker, which also waits for the
        baton.
        """
        if gate is not None and probe is not None:
            return gate.mark(microbatch, kind, stage, probe)

        def record() -> np.int32:
            self.started(microbatch, kind, stage)
            return np.int32(0)

        return tf.numpy_function(record, [], tf.int32, stateful=True, name=f"smp_mark_{kind}")

    def on_backward(self, microbatch: int, stage: int, tensors: Sequence[tf.Tensor],
                    gate: Any = None) -> list[tf.Tensor]:
        """``tensors`` unchanged; their gradients pass a "B" marker first (the gate's, with overlap)."""
        float_pos = [i for i, t in enumerate(tensors) if t.dtype.is_floating]
        if not float_pos:
            return list(tensors)

        @tf.custom_gradient
        def marked(*xs: tf.Tensor) -> tuple[list[tf.Tensor], object]:
            def grad(*ups: tf.Tensor | None) -> list[tf.Tensor | None]:
                probe = next((u for u in ups if u is not None), None)
                token = self.mark(microbatch, "B", stage, gate, probe)
                with tf.control_dependencies([token]):
                    out = [None if u is None else tf.identity(u) for u in ups]
                if gate is not None and probe is not None:
                    gate.note_backward(token, [u for u in out if u is not None])
                return out

            return [tf.identity(x) for x in xs], grad

        out = list(tensors)
        for i, t in zip(float_pos, marked(*[tensors[i] for i in float_pos])):
            out[i] = t
        return out


def step_timeline(log: ActionLog, pp_rank: int, num_ranks: int, title: str = "measured step") -> Any:
    """The last step's measured timeline over the pipeline group (a collective over the PP group).

    An ``smp.pipeline.Timeline`` in milliseconds, one lane per pp_rank, segment = stage, drawn by
    ``smp.pipeline.render_svg`` / ``render_ascii`` like a planned one. Clocks are the hosts' wall
    clocks.

    Example (every pp rank)::

        svg = smp.pipeline.render_svg(model.step_timeline())
    """
    from smp.pipeline import Timeline

    from ..runtime.comm import PP_GROUP, allgather

    last = log.timed[-1] if log.timed else []
    mine = [(pp_rank, k, m, s, a, b) for m, k, s, a, b in last]
    events = [e for part in allgather(mine, PP_GROUP) for e in part]
    origin = min((e[4] for e in events), default=0.0)
    records = [(r, k, m, s, (a - origin) * 1e3, (b - origin) * 1e3) for r, k, m, s, a, b in events]
    return Timeline.from_records(records, num_ranks=num_ranks, unit="ms", title=title)
