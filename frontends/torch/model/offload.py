"""Activation offloading: the inputs a checkpointed call keeps for its recomputation wait in host memory.

With ``offload_activations: True``, each checkpointed call (``smp.set_activation_checkpointing``,
``smp.checkpoint``, ``checkpoint_sequential``) copies the inputs it keeps for its recomputation to
pinned host memory during forward, and backward brings them back to the device ahead of use: at most
``activation_loading_horizon`` calls' inputs wait on the device at once (SMP v1's per-layer prefetch).

How the inputs are caught. ``torch.utils.checkpoint`` (non-reentrant, as smp uses it) saves the
call's tensor arguments before it pushes its own saved-tensor hooks, and the tensors the call's
forward saves go to those inner hooks (the innermost hooks win). So default ``saved_tensors_hooks``
pushed around the ``checkpoint(...)`` call see the call's tensor arguments and nothing else (checked
on the installed torch by tests/torch/model/test_offload.py), and their unpack runs when backward
recomputes the call. Keyword arguments reach ``checkpoint`` positionally (recompute.py): it would keep
keyword values in a closure that no hook sees. Torch's checkpoint stays as it is (its RNG, autocast
and early-stop handling); an ``autograd.Function`` of our own would have to redo all of that. A saved
tensor holds what its pack hook returned, so a record lives exactly as long as the graph that needs it:
it is freed after its backward, or with a graph that never runs backward (an evaluation forward),
with no bookkeeping here. Under ``torch.no_grad`` nothing is checkpointed, so nothing is offloaded.

Which tensors move: arguments that require grad (the activations). Masks, ids and position tensors
stay where they are: every layer gets the same one from a caller that keeps it alive, so a copy per
layer would move data without freeing any.

Prefetch, a worked example (horizon 2, one microbatch whose forward made calls c0..c4)::

    backward reaches   loads                        waiting on the device afterwards
    c4                 c4 (on demand), c3, c2       c3 c2
    c3                 c1                           c2 c1
    c2                 c0                           c1 c0
    c1, c0             -                            c0, then none

"Waiting" counts calls loaded ahead and not yet taken by backward; the call backward is taking is
in use, not waiting, so offloading keeps at most horizon + 1 calls' inputs on the device.

Microbatches. Records are grouped by the engine task (the microbatch) whose forward made them, and
a call's backward prefetches only earlier calls of its own microbatch: 1F1B runs later
microbatches' forwards between one microbatch's forward and backward, and an interleaved chain
visits a rank several times per microbatch, so forward order across microbatches says nothing
about backward order. The horizon is one budget per rank: a record loaded ahead is never dropped
to make room (another microbatch's backward then loads on demand), and one whose graph is freed
unused gives its place back.

Devices. `CudaTarget` copies on two side streams per device (to host, to device) into pinned host
buffers: the copy to host waits for the stream that produced the tensor, a load waits for the copy
to host (an event), and the stream that uses a loaded input waits for the load (an event).
``record_stream`` keeps the caching allocator from reusing memory a side stream still reads or
writes. A rank without CUDA has nothing to offload (its activations live in host memory already):
smp says so once, at the first checkpointed call, and makes no copies. `LoopbackTarget` copies CPU
tensors into separate host storage and back, so the queue, prefetch and horizon logic run for real
on a CPU (the tests install it with `use_target`).
"""

from __future__ import annotations

import itertools
import logging
import threading
import weakref
from collections.abc import Iterator
from contextlib import AbstractContextManager, contextmanager, nullcontext
from dataclasses import dataclass
from functools import partial
from typing import Any, Protocol

import torch

import smp.state as smp_state
from smp.errors import SMPError

from ..engine.local import current_task
from ..runtime.process_state import torch_state

__all__: list[str] = []

logger = logging.getLogger("smp")

NOTHING_TO_DO = ("offload_activations: this rank has no CUDA device, so the inputs that checkpointed modules "
                 "keep already live in host memory; there is nothing to offload and no copies are made")


@dataclass
class Copy:
    """A copy started by a target: the destination tensor and the target's completion marker."""

    tensor: torch.Tensor
    done: Any = None


class Target(Protocol):
    """Where offloaded inputs go and how they come back (`CudaTarget`, `LoopbackTarget`)."""

    def moves(self, tensor: torch.Tensor) -> bool:
        """Whether ``tensor`` lives where this target offloads from."""
        ...

    def to_host(self, tensor: torch.Tensor) -> Copy:
        """Start copying ``tensor`` (still written by the current stream) to host memory."""
        ...

    def to_device(self, host: Copy, device: torch.device) -> Copy:
        """Start copying ``host`` (possibly still in flight) back to ``device``."""
        ...

    def finished(self, copy: Copy) -> bool:
        """Whether ``copy`` has completed (without waiting)."""
        ...

    def use(self, copy: Copy) -> torch.Tensor:
        """The loaded tensor, made safe to use on the current stream."""
        ...


class CudaTarget:
    """Pinned host buffers and two side streams per CUDA device; events order the three streams."""

    def __init__(self) -> None:
        self._streams: dict[torch.device, tuple[torch.cuda.Stream, torch.cuda.Stream]] = {}

    def _side(self, device: torch.device) -> tuple[torch.cuda.Stream, torch.cuda.Stream]:
        pair = self._streams.get(device)
        if pair is None:
            pair = self._streams[device] = (torch.cuda.Stream(device=device), torch.cuda.Stream(device=device))
        return pair

    def moves(self, tensor: torch.Tensor) -> bool:
        return tensor.is_cuda

    def to_host(self, tensor: torch.Tensor) -> Copy:
        out_stream, _ = self._side(tensor.device)
        out_stream.wait_stream(torch.cuda.current_stream(tensor.device))  # the producer's work comes first
        with torch.cuda.stream(out_stream):
            host = torch.empty_like(tensor, device="cpu", pin_memory=True)
            host.copy_(tensor, non_blocking=True)
            done = torch.cuda.Event()
            done.record(out_stream)
        tensor.record_stream(out_stream)  # its memory is not reused before the copy has read it
        return Copy(host, done)

    def to_device(self, host: Copy, device: torch.device) -> Copy:
        _, in_stream = self._side(device)
        in_stream.wait_event(host.done)
        with torch.cuda.stream(in_stream):
            loaded = torch.empty_like(host.tensor, device=device)
            loaded.copy_(host.tensor, non_blocking=True)
            done = torch.cuda.Event()
            done.record(in_stream)
        return Copy(loaded, done)

    def finished(self, copy: Copy) -> bool:
        return bool(copy.done.query())

    def use(self, copy: Copy) -> torch.Tensor:
        stream = torch.cuda.current_stream(copy.tensor.device)
        stream.wait_event(copy.done)
        copy.tensor.record_stream(stream)  # allocated on the load stream, freed after this stream's use
        return copy.tensor


class LoopbackTarget:
    """Offloads CPU tensors into separate host storage and loads them into new storage again.

    The copies are real and synchronous, so everything but the streams runs as on a GPU. It counts
    what it did and tracks which of its loads' storage is still alive (waiting, or in use by the
    recomputation and the backward after it): a measure from outside of what offloading keeps "on
    the device", taken at each load.
    """

    def __init__(self) -> None:
        from torch.multiprocessing.reductions import StorageWeakRef

        self._weak = StorageWeakRef
        self.to_host_copies = 0
        self.to_device_copies = 0
        self.peak_alive = 0
        self._loaded: list[Any] = []

    def moves(self, tensor: torch.Tensor) -> bool:
        return tensor.device.type == "cpu"

    def to_host(self, tensor: torch.Tensor) -> Copy:
        self.to_host_copies += 1
        return Copy(torch.empty_like(tensor).copy_(tensor))

    def to_device(self, host: Copy, device: torch.device) -> Copy:
        self.to_device_copies += 1
        loaded = torch.empty_like(host.tensor, device=device).copy_(host.tensor)
        self._loaded = [r for r in self._loaded if not r.expired()] + [self._weak(loaded.untyped_storage())]
        self.peak_alive = max(self.peak_alive, len(self._loaded))
        return Copy(loaded)

    def alive(self) -> int:
        """Loads whose storage is still alive."""
        return sum(not r.expired() for r in self._loaded)

    def finished(self, copy: Copy) -> bool:
        return True

    def use(self, copy: Copy) -> torch.Tensor:
        return copy.tensor


@dataclass
class OffloadStats:
    """What an `Offloader` did since it was made (one per ``smp.init``)."""

    records: int = 0  # checkpointed calls whose inputs went to host memory
    tensors: int = 0
    bytes: int = 0
    prefetched: int = 0  # records loaded ahead of backward, within the horizon
    on_demand: int = 0  # records loaded when backward needed them
    peak_waiting: int = 0  # most records loaded ahead and not yet taken, at once


_NO_TASK = object()  # the group of records made outside a pipelined step (pp == 1)


class _Record:
    """One checkpointed call's offloaded inputs."""

    __slots__ = ("__weakref__", "devices", "error", "host", "loaded", "open", "seq", "sources", "task", "uses")

    def __init__(self, seq: int, task: Any) -> None:
        self.seq = seq
        self.task = None if task is None else weakref.ref(task)
        self.host: list[Copy] = []
        self.devices: list[torch.device] = []
        self.loaded: list[Copy | None] | None = None  # on the device for backward to take
        self.sources: list[tuple[torch.Tensor, int]] = []  # the originals, until their copies finished
        self.uses = 0
        self.error: str | None = None
        self.open = True  # its call is still running: its originals stay to check their versions at the end

    def group(self) -> Any:
        """The microbatch task that made it (None once that task is gone)."""
        return _NO_TASK if self.task is None else self.task()

    @property
    def waiting(self) -> bool:
        return self.loaded is not None and all(c is not None for c in self.loaded)


class Offloader:
    """The offload queue of one rank: records of checkpointed calls, loads and the horizon."""

    def __init__(self, horizon: int, target: Target | None) -> None:
        self.horizon = horizon
        self.target = target
        self.stats = OffloadStats()
        self._lock = threading.RLock()  # microbatch threads and autograd's device threads
        self._records: list[weakref.ref[_Record]] = []
        self._unsettled: list[weakref.ref[_Record]] = []
        self._seq = itertools.count()
        self._local = threading.local()
        self._told = False

    def tell_nothing_to_do(self) -> None:
        if not self._told:
            self._told = True
            logger.info(NOTHING_TO_DO)

    @contextmanager
    def call(self) -> Iterator[None]:
        """Offload the inputs that the one checkpointed call made inside keeps for its recomputation."""
        # A call nested in another offloaded call is covered by the outer one's recomputation, and a
        # call during backward is a recomputation: its inputs are needed right away.
        if getattr(self._local, "depth", 0) or _in_backward():
            yield
            return
        record = _Record(next(self._seq), current_task())
        self._local.depth = 1
        try:
            with torch.autograd.graph.saved_tensors_hooks(partial(self._pack, record), self._unpack):
                yield
        finally:
            self._local.depth = 0
            with self._lock:
                record.open = False
                self._settle()

    def live(self) -> int:
        """Records whose graph still needs them."""
        with self._lock:
            return len(self._alive())

    def tracked(self) -> int:
        """Records the queue refers to (weakly), freed ones not yet pruned: bounded by one step's records."""
        with self._lock:
            return len(self._records)

    def waiting(self) -> int:
        """Records loaded ahead of backward and not yet taken."""
        with self._lock:
            return sum(r.waiting for r in self._alive())

    # --- hooks ---------------------------------------------------------------------------------

    def _pack(self, record: _Record, tensor: torch.Tensor) -> Any:
        target = self.target
        if target is None or not (tensor.requires_grad and tensor.layout == torch.strided and tensor.numel() > 0
                                  and target.moves(tensor)):
            return tensor
        source = tensor.detach()  # shares the version counter, so a later in-place change shows
        with self._lock:
            if not record.host:
                self._records = [r for r in self._records if r() is not None]
                self._records.append(weakref.ref(record))
                self._unsettled.append(weakref.ref(record))
                self.stats.records += 1
            record.host.append(target.to_host(source))
            record.devices.append(tensor.device)
            record.sources.append((source, source._version))
            self.stats.tensors += 1
            self.stats.bytes += tensor.numel() * tensor.element_size()
            self._settle()  # frees the originals of earlier calls whose copies finished
            return (record, len(record.host) - 1)

    def _unpack(self, packed: Any) -> torch.Tensor:
        if isinstance(packed, torch.Tensor):
            return packed
        assert self.target is not None  # only a target's pack makes records
        record, index = packed
        with self._lock:
            self._settle()
            if record.error is not None:
                raise SMPError(record.error)
            if record.loaded is None or record.loaded[index] is None:
                self._load(record)  # not loaded ahead (or taken already: a second backward)
                self.stats.on_demand += 1
            loaded = record.loaded
            assert loaded is not None
            first = record.waiting
            copy = loaded[index]
            assert copy is not None
            loaded[index] = None
            if all(c is None for c in loaded):
                record.loaded = None
            if first:
                record.uses += 1
                self._prefetch(record)
        return self.target.use(copy)

    # --- the queue (callers hold the lock) ------------------------------------------------------

    def _alive(self) -> list[_Record]:
        return [r for r in (ref() for ref in self._records) if r is not None]

    def _load(self, record: _Record) -> None:
        assert self.target is not None
        record.loaded = [self.target.to_device(h, d) for h, d in zip(record.host, record.devices)]

    def _prefetch(self, taken: _Record) -> None:
        """Load the calls that backward needs next in ``taken``'s microbatch, up to the horizon."""
        group = taken.group()
        alive = self._alive()
        room = self.horizon - sum(r.waiting for r in alive)
        if group is None or room <= 0:
            return
        # Earlier in forward = later in backward; `uses` tells apart the calls this backward has taken.
        nxt = sorted((r for r in alive if r.loaded is None and r.seq < taken.seq and r.uses < taken.uses
                      and r.error is None and r.group() is group), key=lambda r: -r.seq)
        for record in nxt[:room]:
            self._load(record)
            self.stats.prefetched += 1
        self.stats.peak_waiting = max(self.stats.peak_waiting, sum(r.waiting for r in alive))

    def _settle(self) -> None:
        """Check that no original changed in place since it was saved; drop those whose copies finished.

        A change before the copy read the tensor would be offloaded (a race on CUDA); so a record
        keeps its originals, and checks them, until its call returned and its copies finished. A
        change after that is harmless: backward recomputes from the copy, the value the call saw.
        """
        target = self.target
        keep = []
        for ref in self._unsettled:
            record = ref()
            if record is None:
                continue
            for source, version in record.sources:
                if source._version != version:
                    record.error = (
                        f"offload_activations: an input of a checkpointed module (shape {tuple(source.shape)}), "
                        "kept for its recomputation in backward, was changed in place after it was passed to the module; "
                        "recomputing from it would give wrong gradients. Fix: do not modify a checkpointed module's "
                        "inputs in place (clone them first), or set \"offload_activations\": False")
            if record.open or target is None or not all(target.finished(c) for c in record.host):
                keep.append(ref)
            else:
                record.sources.clear()
        self._unsettled = keep


def _in_backward() -> bool:
    graph_task = getattr(torch._C, "_current_graph_task_id", None)
    return graph_task is not None and graph_task() != -1


_MAKE = threading.Lock()  # microbatch threads may reach their first checkpointed call together


def offloader() -> Offloader | None:
    """This process's `Offloader` when ``offload_activations`` is on and there is something to move."""
    cfg = smp_state.current().cfg
    if cfg is None or not cfg.offload_activations:
        return None
    ts = torch_state()
    made = ts.offloader
    if made is None:
        with _MAKE:
            if ts.offloader is None:
                ts.offloader = Offloader(int(cfg.activation_loading_horizon),
                                         CudaTarget() if torch.cuda.is_available() else None)
            made = ts.offloader
    assert isinstance(made, Offloader)
    if made.target is None:
        made.tell_nothing_to_do()
        return None
    return made


def saved_inputs() -> AbstractContextManager[None]:
    """Around one ``torch.utils.checkpoint`` call: offload what it keeps, when configured."""
    made = offloader()
    return nullcontext() if made is None else made.call()


@contextmanager
def use_target(target: Target, horizon: int | None = None) -> Iterator[Offloader]:
    """Offload through ``target`` until the block ends (tests: `LoopbackTarget` on a CPU).

    Needs ``smp.init`` first; ``offload_activations`` must still be on for anything to move.
    ``horizon`` defaults to the config's ``activation_loading_horizon``.
    """
    cfg = smp_state.current().cfg
    if cfg is None:
        raise SMPError("offload.use_target needs smp.init(...) first (it reads activation_loading_horizon)")
    ts = torch_state()
    previous = ts.offloader
    made = Offloader(int(cfg.activation_loading_horizon) if horizon is None else horizon, target)
    ts.offloader = made
    try:
        yield made
    finally:
        ts.offloader = previous
