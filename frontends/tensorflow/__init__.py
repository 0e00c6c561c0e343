"""smp for TensorFlow / Keras 3: ``import smp.tensorflow as smp`` (was ``import smdistributed.modelparallel.tensorflow as smp``).

Each room exports its public names through its package's ``__all__``; this file only gathers them.
The runtime (``init``, the rank API, the communication primitives) is imported at once and needs
only mpi4py; the names that need TensorFlow (``DistributedModel``, ``step``, ``CheckpointManager``,
...) are imported on first use (PEP 562), so a script or test that only uses the rank API does not
pay TensorFlow's import (~5 s and ~540 MB per rank). Nothing here imports torch.
"""

import sys
import types
from importlib import import_module
from typing import Any

import smp.state as _state_mod

from .runtime import *  # noqa: F403 - init, reset, the rank API, communication primitives
from .runtime import __all__ as _runtime_all

# name -> the module (relative to this package) that defines it; imported on first access.
_LAZY = {
    "DistributedModel": ".model", "partition": ".model", "register_post_partition_hook": ".model",
    "CheckpointManager": ".checkpointing",
    "step": ".step", "StepOutput": ".step",
}

state = _state_mod.current()

__all__ = sorted({*_runtime_all, *_LAZY, "state"})


def __getattr__(name: str) -> Any:
    module = _LAZY.get(name)
    if module is None:
        raise AttributeError(f"module 'smp.tensorflow' has no attribute {name!r}")
    value = getattr(import_module(module, __name__), name)
    globals()[name] = value  # later lookups skip this function
    return value


def __dir__() -> list[str]:
    return sorted({*globals(), *_LAZY})


class _Package(types.ModuleType):
    """Keeps ``smp.tensorflow.step`` (the decorator) and ``smp.tensorflow.state`` (smp's state) once
    the submodules of the same names are imported.

    Importing a submodule sets it as an attribute of its package; the first import of
    ``smp.tensorflow.step`` or of ``smp.tensorflow.state`` (the frontend's `TFState` module, by the
    model) would otherwise replace the public object with the module. The modules stay importable
    by their full names (``from smp.tensorflow.step import StepOutput``).
    """

    def __setattr__(self, name: str, value: Any) -> None:
        if (name in _LAZY or name == "state") and isinstance(value, types.ModuleType):
            return
        super().__setattr__(name, value)


sys.modules[__name__].__class__ = _Package
