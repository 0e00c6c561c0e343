"""References to values that live on another pipeline rank (SMP v1's ``fast_mode``, generalised).

A module called on another rank keeps its outputs there; the caller gets a `RemoteTensor` for
each: a `torch.Tensor` with the real shape, dtype and strides but no storage. Passed on to a
module on the rank that holds it, it travels as a reference (a few bytes); anything else that
touches it (any torch op, ``.item()``, ``bool``, printing, a module on another rank, returning it
from the step) first fetches the value, once, and from then on the reference stands for the
fetched tensor. Metadata (``shape``, ``size()``, ``dtype``, ``device``, ``requires_grad``,
``dim()``, ...) is answered locally, so code that only looks at shapes does not move data.
"""

from __future__ import annotations

import functools
import pickle
import weakref
from typing import Any

import torch

from smp.errors import SMPError

from .local import current_task
from .wire import map_structure, walk

__all__ = ["RemoteTensor", "followed", "resolve"]

_T = torch.Tensor
# Answered from the reference's own metadata, without fetching the value.
_METADATA = {
    _T.shape.__get__, _T.size, _T.dim, _T.ndim.__get__, _T.dtype.__get__, _T.device.__get__,  # type: ignore[attr-defined]
    _T.requires_grad.__get__, _T.__len__, _T.numel, _T.nelement, _T.element_size, _T.__hash__,  # type: ignore[attr-defined]
    _T.is_floating_point, _T.is_complex, _T.stride, _T.is_contiguous, _T.layout.__get__,  # type: ignore[attr-defined]
    _T.is_cuda.__get__, _T.is_sparse.__get__, _T.is_quantized.__get__, _T.is_meta.__get__,  # type: ignore[attr-defined]
}

# Never run where the value lives: they return Python objects that stand for the tensor itself
# (iterators, storages), or are about identity and copying.
_LOCAL_ONLY = {_T.__iter__, _T.__reduce_ex__, _T.__deepcopy__, _T.__setstate__, _T.data_ptr, _T.untyped_storage,
               _T.storage, _T.numpy, _T.__array__, _T.tolist, _T.item, _T.__bool__, _T.__float__, _T.__int__,
               _T.__index__, _T.__repr__, _T.__format__, _T.backward, _T.register_hook, _T.retain_grad}
_INPLACE_DUNDERS = {"__setitem__", "__iadd__", "__isub__", "__imul__", "__itruediv__", "__ifloordiv__", "__imod__",
                    "__ipow__", "__iand__", "__ior__", "__ixor__", "__ilshift__", "__irshift__", "__imatmul__"}
# What an augmented assignment (`x += y`, `x &= y`, ...) reaches __torch_function__ as.
_AUGMENTED = {"add_", "sub_", "mul_", "div_", "floor_divide_", "remainder_", "pow_", "__iand__", "__ior__", "__ixor__",
              "__ilshift__", "__irshift__"}
_REMOTE_OK: dict[Any, bool] = {}
_PLAIN = (int, float, bool, str, type(None), slice, type(Ellipsis), torch.dtype, torch.device, torch.memory_format,
          torch.layout)


def _runs_remotely(func: Any) -> bool:
    """Whether ``func`` may run on the rank that holds its tensor arguments: a picklable torch
    function or tensor method that returns new values (not in place, not a Python view of the
    tensor itself; no user autograd Function or collective, which belong to the caller's rank)."""
    ok = _REMOTE_OK.get(func)
    if ok is None:
        name = getattr(func, "__name__", "")
        module = getattr(func, "__module__", None) or ""
        torch_api = (getattr(torch.Tensor, name, None) is func or getattr(torch._C.TensorBase, name, None) is func
                     or (module.startswith("torch") and not module.startswith(("torch.distributed", "torch.autograd"))))
        ok = (torch_api and func not in _LOCAL_ONLY and name not in _INPLACE_DUNDERS
              and not (name.endswith("_") and not name.startswith("__")))
        if ok:
            try:
                ok = pickle.loads(pickle.dumps(func)) is func
            except Exception:  # noqa: BLE001 - not picklable: it runs here
                ok = False
        _REMOTE_OK[func] = ok
    return ok


def _updates_reference(func: Any, args: Any) -> bool:
    """Whether ``func`` is an augmented assignment to a reference (``x += y`` reaches here as
    ``add_``; ``x.add_(y)`` alike), which then runs on the rank that keeps the value (with every other reference there,
    `followed`); not when it would make the value require a gradient it did not.

    Note [in-place on a reference]: that rank changes its value in place, as one process would:
    every reference to it reads the new value, and autograd records the change where the value
    lives. Fetched instead, the value and its microbatch came back to this rank: Falcon's
    ``mlp_output += attention_output`` on a layer cut between its norms and its attention and MLP
    made the chain 0 -> 1 -> 0 -> 1 within that layer, and SMP v1's dynamic order for the step."""
    if not (args and isinstance(args[0], RemoteTensor) and getattr(func, "__name__", "") in _AUGMENTED
            and getattr(torch._C.TensorBase, func.__name__, None) is func):
        return False
    return args[0].requires_grad or not any(isinstance(a, torch.Tensor) and a.requires_grad for a in args[1:])


def _owner_of(args: Any, kwargs: Any) -> RemoteTensor | None:
    """The one reference an op should follow (its value stays where it is), or None to fetch instead.

    An op follows its tensor arguments when they are unread references held by one rank and at
    least as large as the other tensors it would have to send there."""
    refs: list[RemoteTensor] = []
    local = 0
    for x in walk((args, kwargs)):
        if isinstance(x, RemoteTensor):
            if x.value is not None:
                return None
            refs.append(x)
        elif isinstance(x, torch.nn.Parameter):
            return None  # a parameter of this rank is used here
        elif isinstance(x, torch.Tensor):
            local += x.numel() * x.element_size()
        elif not isinstance(x, _PLAIN):
            return None  # an argument that belongs to this process (a process group, a module, a callable)
    if not refs or any(r.owner != refs[0].owner for r in refs):
        return None
    remote = sum(r.numel() * r.element_size() for r in refs)
    return refs[0] if remote >= local else None


def followed(args: Any, kwargs: Any) -> RemoteTensor | None:
    """The reference whose rank code on ``args``/``kwargs`` runs on (`_owner_of`), when its
    microbatch is between actions here; None when this rank must do the work itself."""
    ref = _owner_of(args, kwargs)
    return ref if ref is not None and ref.between_actions() else None


def on_owner(func: Any, *args: Any, **kwargs: Any) -> Any:
    """``func(*args, **kwargs)`` on the rank that keeps its tensor arguments, when they are
    references its microbatch is between actions on (`followed`); else here.

    For smp's own functions over a TP group (cutting the head's outputs to each rank's samples,
    gathering vocabulary slices, the vocabulary-parallel loss), which user autograd Functions do
    not get (`_runs_remotely`): on the owner they use that rank's TP group, whose ranks run the
    same microbatch's call in the same order, and the values stay there. Run here, the logits of
    every microbatch would come back through the pipeline, and the microbatch with them (a Hugging
    Face Llama at pp 2, tp 2: chain 0 -> 1 -> 0 and SMP v1's dynamic order instead of the plan).
    ``func`` must be a module-level function (it is pickled by name) that uses smp's TP group.
    """
    ref = followed(args, kwargs)
    return func(*args, **kwargs) if ref is None else _run_at(ref, func, args, kwargs)


def _run_at(ref: RemoteTensor, func: Any, args: Any, kwargs: Any) -> Any:
    """``func(*args, **kwargs)`` run by ``ref``'s owner, in its microbatch's task there."""
    name = f"<{getattr(func, '__name__', func)}>"
    return ref._engine.remote_forward(ref.owner, name, None, args, kwargs, func=func)


def _reached_autograd(path: str, owner: int, grad: torch.Tensor) -> None:
    raise SMPError(
        f"a gradient reached the reference to an output of module {path!r} (kept on pp_rank {owner}) directly: an "
        "operation bypassed torch's Python layer, so smp could not fetch the value first. Fix: read the tensor "
        "before that operation (for example `t = t + 0`), and report the operation to smp")


class RemoteTensor(torch.Tensor):
    """A module output kept by pipeline rank ``owner`` under ``key`` for one microbatch."""

    _engine: Any  # the Engine (engine.py imports this module)
    _task: weakref.ref[Any]
    owner: int
    key: int
    origin: tuple[Any, int]
    ndeps: int
    path: str
    value: torch.Tensor | None
    version: int

    @staticmethod
    def __new__(cls, shape: tuple[int, ...], stride: tuple[int, ...], dtype: torch.dtype, requires_grad: bool,
                **_: Any) -> RemoteTensor:
        return torch.Tensor._make_wrapper_subclass(  # type: ignore[attr-defined,no-any-return]
            cls, shape, strides=stride, dtype=dtype, device="cpu", requires_grad=requires_grad)

    def __init__(self, shape: tuple[int, ...], stride: tuple[int, ...], dtype: torch.dtype, requires_grad: bool, *,
                 engine: Any, task: Any, owner: int, key: int, origin: tuple[Any, int], ndeps: int,
                 path: str) -> None:
        _patch_function_apply()
        if requires_grad:
            # The hook must not refer to the reference itself: a tensor -> hook -> tensor cycle runs
            # through autograd's C++ storage, which the cyclic GC cannot see (the value would leak).
            with torch._C.DisableTorchFunctionSubclass():
                self.register_hook(functools.partial(_reached_autograd, path, owner))
        self._engine = engine
        self._task = weakref.ref(task)
        self.owner = owner
        self.key = key
        self.origin = origin  # (call key, output index): which call produced it, for learning what is read
        self.ndeps = ndeps  # how many of the caller's tensors sent to ``owner`` it may depend on
        self.path = path
        self.value = None
        self.version = -1

    def get(self) -> torch.Tensor:
        """The value, fetched from its owner the first time (inside the microbatch that made it)."""
        if self.value is None:
            if not self.live():
                raise SMPError(
                    f"an output of module {self.path!r} lives on pp_rank {self.owner} and was first read outside "
                    "the @smp.step call (and microbatch) that produced it. Fix: read it inside the step function, "
                    "or return it from the step (returned values reach every rank)")
            task = self._task()
            assert task is not None
            value = self._engine.fetch(task, self)
            self.value, self.version = value, value._version
        return self.value

    def live(self) -> bool:
        """Whether this thread runs the microbatch that produced it (so its owner can still be asked)."""
        task = current_task()
        return task is not None and task is self._task()

    def between_actions(self) -> bool:
        """Whether an op on this reference should run where the value is: its microbatch is between
        calls to the owner (glue code, the step body), not doing work of its own on this rank."""
        task = self._task()
        return self._engine.keep_remote and self.live() and task is not None and not task.holding

    def unchanged(self) -> bool:
        """Whether the owner's copy is still this value (never fetched, or not modified in place since)."""
        return self.value is None or self.value._version == self.version

    @classmethod
    def __torch_function__(cls, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        kwargs = kwargs or {}
        if func in _METADATA:
            with torch._C.DisableTorchFunctionSubclass():
                return func(*args, **kwargs)
        if "out" not in kwargs and (_runs_remotely(func) or _updates_reference(func, args)):
            ref = followed(args, kwargs)
            if ref is not None:
                return _run_at(ref, func, args, kwargs)
        args, kwargs = resolve((args, kwargs))
        return func(*args, **kwargs)

    @classmethod
    def __torch_dispatch__(cls, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        raise SMPError(f"{func} reached a reference to a value on another pipeline rank below torch's Python "
                       "layer; smp fetches such values for torch functions only. Fix: read the tensor first "
                       "(for example `t = t + 0`) before passing it to this operation")


_patched = False


def _patch_function_apply() -> None:
    """User autograd Functions (`torch.autograd.Function.apply`) do not dispatch ``__torch_function__``
    to tensor subclasses: without this they would run on a reference itself and their gradient
    would stop there. Patched once, when the first reference is made: references are fetched first."""
    global _patched
    if _patched:
        return
    _patched = True
    original = torch.autograd.Function.apply.__func__  # type: ignore[attr-defined]

    def apply(cls: Any, *args: Any, **kwargs: Any) -> Any:
        if any(isinstance(a, RemoteTensor) for a in args) or any(isinstance(a, RemoteTensor) for a in kwargs.values()) \
                or any(isinstance(a, (list, tuple)) and any(isinstance(b, RemoteTensor) for b in a) for a in args):
            args, kwargs = resolve((args, kwargs))
        return original(cls, *args, **kwargs)

    torch.autograd.Function.apply = classmethod(apply)  # type: ignore[assignment,method-assign]


def resolve(obj: Any) -> Any:
    """``obj`` with every `RemoteTensor` replaced by its value (fetched where needed)."""
    return map_structure(obj, lambda x: x.get() if isinstance(x, RemoteTensor) else x)
