"""The torch frontend's process state: one object that ``smp.reset()`` drops, and what a reset keeps.

What a script sets up in this process for its next model lives in `TorchState`: checkpoint state
that ``resume_from_checkpoint`` read before the model existed, the open ``smp.partition`` /
``delay_param_initialization`` / ``tensor_parallelism`` contexts, ``set_partition`` calls, the TP
RNG tracker, the activation offloader, and the class patches the open contexts installed. It hangs
on the core state (``smp.state.current().frontend``), so ``smp.reset()`` (`smp.state.reset`) drops
all of it at once, and closes it: closing undoes the patches of contexts a script left open. A
context that is left after a reset pops its own (old, detached) state and touches nothing of the new
one.

What outlives a reset on purpose is `KEPT`, each field with its reason. Read-only caches stay in
their modules (the Transformer Engine import in ``nn/te_backend.py``, log-once sets): they hold
what the process is, not what a script set.
"""

from __future__ import annotations

import threading
import weakref
from dataclasses import dataclass, field
from typing import Any

from torch import nn
from torch.utils.weak import WeakIdKeyDictionary

import smp.state as smp_state
from smp.errors import SMPError

__all__ = ["KEPT", "Kept", "TorchState", "torch_state"]

_MISSING = object()


@dataclass
class _Patch:
    """One attribute a context replaced: ``target.name`` was ``original`` (or absent: `_MISSING`)."""

    owner: str
    target: Any
    name: str
    original: Any

    def undo(self) -> None:
        if self.original is _MISSING:
            if self.name in vars(self.target):
                delattr(self.target, self.name)
        else:
            setattr(self.target, self.name, self.original)


@dataclass(eq=False)
class TorchState:
    """Everything a script set in this process for the next model; fresh after every ``smp.reset()``.

    Attributes:
        pending: what ``resume_from_checkpoint`` read before the model or optimizer existed, by
            key (``"partition"``, ``"model"``, ``"optimizer"``); the model and optimizer take it
            with ``saving.take_pending(key)``.
        partition_stack: indices of the open ``smp.partition`` blocks, innermost last.
        created: module -> index of the innermost ``smp.partition`` block it was created in.
        assigned: ``smp.set_partition`` calls, in call order: (module, index, recurse).
        delayed_contexts: the open ``delay_param_initialization`` contexts: (enabled, memo of real
            parameter -> its meta copy, so a parameter registered twice stays one parameter).
        tp_contexts: the open ``tensor_parallelism`` contexts: (enabled, overrides).
        rng_tracker: the TP-region `RNGStatesTracker`, made by ``nn/rng.py`` on first use (typed
            ``Any`` because this leaf module imports no other frontend module).
        offloader: the activation `Offloader` (``model/offload.py``), made at the first checkpointed
            call when ``offload_activations`` is on (``Any``, as ``rng_tracker``).
    """

    pending: dict[str, Any] = field(default_factory=dict)
    partition_stack: list[int] = field(default_factory=list)
    created: weakref.WeakKeyDictionary[nn.Module, int] = field(default_factory=weakref.WeakKeyDictionary)
    assigned: list[tuple[weakref.ref[nn.Module], int, bool]] = field(default_factory=list)
    delayed_contexts: list[tuple[bool, WeakIdKeyDictionary]] = field(default_factory=list)
    tp_contexts: list[tuple[bool, dict[str, Any]]] = field(default_factory=list)
    rng_tracker: Any = None
    offloader: Any = None
    lock: threading.Lock = field(default_factory=threading.Lock, repr=False)
    _patches: list[_Patch] = field(default_factory=list, repr=False)

    def patch(self, owner: str, target: Any, name: str, value: Any) -> None:
        """Set ``target.name = value`` until ``unpatch(owner)`` or `close` puts the original back."""
        self._patches.append(_Patch(owner, target, name, vars(target).get(name, _MISSING)))
        setattr(target, name, value)

    def unpatch(self, owner: str) -> None:
        """Undo what ``owner`` patched, newest first; a no-op once `close` undid it."""
        mine = [p for p in self._patches if p.owner == owner]
        self._patches = [p for p in self._patches if p.owner != owner]
        for p in reversed(mine):
            p.undo()

    def close(self) -> None:
        """Undo every patch still in place (contexts a script left open); `smp.state.reset` calls it."""
        patches, self._patches = self._patches, []
        for p in reversed(patches):
            p.undo()


_CREATE = threading.Lock()  # the first use may come from several threads (microbatch tasks)


def torch_state() -> TorchState:
    """This process's `TorchState` (``smp.state.current().frontend``), made on first use."""
    st = smp_state.current()
    ts = st.frontend
    if isinstance(ts, TorchState):
        return ts
    with _CREATE:
        if st.frontend is None:
            st.frontend = TorchState()
        ts = st.frontend
    if not isinstance(ts, TorchState):
        raise SMPError(f"smp.state holds the state of another frontend ({type(ts).__name__}); one process "
                       "runs one frontend. Fix: call smp.reset() before switching frameworks")
    return ts


@dataclass
class Kept:
    """What this process keeps across ``smp.reset()`` on purpose.

    Attributes:
        first_store: the rendezvous store of the first ``init``; every later init rendezvouses
            through it under a prefix of its own, and holding it keeps rank 0's TCPStore server
            alive between a reset and the next init (Note [re-init] in runtime/init.py).
        inits: how many inits created a default group (the prefix of the next one; Note [re-init]).
        exit_hook: whether the atexit hook that tears the groups down is registered; atexit
            registers per process, and the hook does nothing while smp is not initialised.
    """

    first_store: Any = None
    inits: int = 0
    exit_hook: bool = False


KEPT = Kept()
