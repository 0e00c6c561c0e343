"""``model.module.module`` under ``ddp: True``: SMP v1's path to the user's model through its DDP wrapper."""

from __future__ import annotations

import copy
import logging
from typing import Any

from torch import nn

from smp.errors import SMPError

__all__ = ["V1DataParallelPath", "V1PathError", "install_v1_ddp_path"]

logger = logging.getLogger("smp")


def install_v1_ddp_path(module: nn.Module) -> None:
    """Give ``module`` SMP v1's ``module`` attribute (see `V1DataParallelPath`), unless it has its own."""
    V1DataParallelPath.install(module)


class V1DataParallelPath:
    """``model.module.module``: SMP v1's path to the user's model under ``ddp: True``.

    SMP v1 wrapped the model in its DDP module, so scripts reached their model as
    ``model.module.module``; smp has no wrapper and ``model.module`` is the model. The model gets
    this object as a plain (unregistered) attribute ``module``: it forwards everything to the
    model, so old scripts run, and logs once what to write instead. State dicts, ``modules()`` and
    ``repr`` never see it; a model that has its own ``module`` attribute is left alone. A third
    level (SMP v1's fp16 wrapper) raises with the fix.
    """

    _warned = False

    def __init__(self, target: nn.Module) -> None:
        object.__setattr__(self, "_target", target)

    @classmethod
    def install(cls, module: nn.Module) -> None:
        if "module" not in module.__dict__ and not hasattr(module, "module"):
            object.__setattr__(module, "module", cls(module))

    def _note(self) -> nn.Module:
        if not V1DataParallelPath._warned:
            V1DataParallelPath._warned = True
            logger.warning("model.module.module is SMP v1's path under ddp (its DDP wrapper sat in between); smp "
                           "has no wrapper, model.module is your model. It works, but write model.module (or "
                           "model.get_module())")
        target: nn.Module = object.__getattribute__(self, "_target")
        return target

    def __getattr__(self, name: str) -> Any:
        if name == "module":
            raise V1PathError("model.module.module.module (SMP v1's DDP and fp16 wrappers): smp wraps neither; "
                               "model.module is your model. Fix: write model.module (or model.get_module())")
        if name.startswith("__"):
            raise AttributeError(name)
        return getattr(self._note(), name)

    def __setattr__(self, name: str, value: Any) -> None:
        setattr(self._note(), name, value)

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        return self._note()(*args, **kwargs)

    def __repr__(self) -> str:
        return "<SMP v1's model.module.module: smp forwards it to model.module, your model>"

    def __deepcopy__(self, memo: dict[int, Any]) -> V1DataParallelPath:
        return V1DataParallelPath(copy.deepcopy(object.__getattribute__(self, "_target"), memo))

    def __reduce__(self) -> Any:
        # A pickled model (torch.save(model.module)) loads without smp: the attribute comes back None.
        return (type(None), ())


class V1PathError(SMPError, AttributeError):
    """A path through a wrapper SMP v1 had and smp does not."""
