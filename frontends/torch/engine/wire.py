"""Messages between pipeline ranks: a kind, a picklable skeleton, and the tensors sent raw.

A message is at most two gloo sends. It starts with one frame of at most `FRAME` bytes: a header
(int64 x 6: kind, skeleton bytes, tensor count, microbatch, which tensors are in the frame,
payload bytes), the pickled skeleton (the structure with every tensor replaced by a `Slot`) and
the bytes of each tensor that still fits. What does not fit follows as one payload: the skeleton,
then the remaining tensors back to back (a lone tensor is sent and received in place). Requests,
replies and the activations and gradients of a usual model fit the frame: one send each.
Sends are what costs on a busy rank (each wakes the peer's gloo I/O thread beside its compute:
`benchmarks/bench_pipeline.py --model threads`), so a message never costs more than two.
One receiver thread per rank takes messages from its pipeline peers (on the engine's own process
group and tag) into one reused `FRAME`-sized buffer and queues them; senders hold the transport's
lock so the parts of two messages never interleave.
"""

from __future__ import annotations

import math
import pickle
import queue
import struct
import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.distributed as dist

from smp import structure

from ..runtime.failure import wait

# Message kinds: forward request/reply, backward request/reply, error, done (the leader's results for
# the followers), stop (end of a rank's sending), dynamic (a peer fell back to the dynamic rule), end
# of a task (local only), fetch request/reply, end of an open run, end of a microbatch, several
# forward requests sent without waiting, in one message.
(FWD_REQ, FWD_REP, BWD_REQ, BWD_REP, ERROR, DONE, STOP, DYNAMIC, TASK_END, FETCH, FETCH_REP, END_RUN,
 MB_END, FWD_BATCH) = range(1, 15)
REPLIES = (FWD_REP, BWD_REP, FETCH_REP)

TAG = 0x51D
_HEAD = "<6q"  # kind, skeleton bytes, tensor count, microbatch, in-frame tensor mask, payload bytes
FRAME = 4 << 20  # bytes: one gloo message carries a message of at most this size whole
_HEAD_BYTES = struct.calcsize(_HEAD)
_MASK_BITS = 63
ABANDON_S = 3.0  # after a failed step, the longest wait for the peers' last message (`Transport.abandon`)


@dataclass(frozen=True)
class Slot:
    """Stands for the i-th tensor of a message inside its skeleton."""

    index: int
    requires_grad: bool


@dataclass(frozen=True)
class Ref:
    """A value the receiver itself holds (a module output it produced earlier in this microbatch)."""

    key: int


@dataclass(frozen=True)
class Cached:
    """A tensor the sender sent to this receiver earlier in this microbatch (unchanged since)."""

    leaf: tuple[int, int, int]


@dataclass(frozen=True)
class Out:
    """A module output in a reply: kept by the sender under ``key`` (``index``: its place among the
    call's output tensors); ``data`` is the index of its value among the message's tensors, or -1
    when only the metadata travels."""

    key: int
    index: int
    shape: tuple[int, ...]
    stride: tuple[int, ...]
    dtype: torch.dtype
    requires_grad: bool
    data: int = -1


def map_structure(obj: Any, leaf: Callable[[Any], Any]) -> Any:
    """Apply ``leaf`` to every tensor, `Slot` and other leaf of ``obj`` (the core's container rules, smp.structure)."""
    return structure.map_structure(obj, leaf, is_leaf=_is_leaf)


def walk(obj: Any) -> list[Any]:
    """Every leaf of ``obj`` (tensors included), in order."""
    return structure.leaves(obj, is_leaf=_is_leaf)


def _is_leaf(x: object) -> bool:
    return isinstance(x, (Slot, Ref, Cached, Out, torch.Tensor))


def pack(obj: Any) -> tuple[Any, list[torch.Tensor]]:
    """Split ``obj`` into a skeleton (tensors replaced by Slots) and the list of tensors."""
    tensors: list[torch.Tensor] = []

    def leaf(x: Any) -> Any:
        if isinstance(x, torch.Tensor):
            tensors.append(x)
            return Slot(len(tensors) - 1, x.requires_grad)
        return x

    return map_structure(obj, leaf), tensors


def unpack(skeleton: Any, tensors: list[torch.Tensor]) -> Any:
    return map_structure(skeleton, lambda x: tensors[x.index] if isinstance(x, Slot) else x)


@dataclass
class Costs:
    """smp's own work on this rank during one step, by the CPU time of the threads that did it
    (``Engine.costs``): the price of the engine beside the model's compute."""

    sent: int = 0  # messages posted to other pipeline ranks
    send_s: float = 0.0  # packing and posting them
    received: int = 0
    receive_s: float = 0.0  # receiving and unpacking them (the receiver thread)
    served: int = 0  # requests of other ranks handled here: module calls, backwards, fetches
    serve_s: float = 0.0  # handling them, the replies sent included, less the modules' own compute
    calls: int = 0  # calls this rank made to modules (or torch functions on values) on other ranks
    call_s: float = 0.0  # making them: packing, the requests sent, unpacking replies (not the waits)
    lock: threading.Lock = field(default_factory=threading.Lock, repr=False, compare=False)

    def count(self, served: int = 0, serve_s: float = 0.0, calls: int = 0, call_s: float = 0.0) -> None:
        """Add requests served and calls made (from any microbatch thread: light actions run beside the holder)."""
        with self.lock:
            self.served += served
            self.serve_s += serve_s
            self.calls += calls
            self.call_s += call_s

    def as_dict(self) -> dict[str, float]:
        """The counts, and the times in milliseconds."""
        return {"sent": self.sent, "send_ms": self.send_s * 1e3, "received": self.received,
                "receive_ms": self.receive_s * 1e3, "served": self.served, "serve_ms": self.serve_s * 1e3,
                "calls": self.calls, "call_ms": self.call_s * 1e3}


@dataclass
class Message:
    kind: int
    src: int
    microbatch: int
    body: Any
    tensors: list[torch.Tensor]
    src_pp: int = -1
    ended: Sequence[int] = ()  # microbatches the sender finished before this message (their MB_END)


_DTYPES = [torch.float32, torch.float64, torch.float16, torch.bfloat16, torch.int64, torch.int32, torch.int16,
           torch.int8, torch.uint8, torch.bool, torch.complex64]
_DTYPE_CODE = {d: i for i, d in enumerate(_DTYPES)}


class Transport:
    """Sends and receives `Message`s among the ranks of one pipeline."""

    def __init__(self, group: Any, peers: list[int], me: int) -> None:
        self.group = group
        self.peers = [p for p in peers if p != me]
        self.me = me
        self.inbox: queue.SimpleQueue[Message | BaseException] = queue.SimpleQueue()
        self._lock = threading.Lock()
        self._pending: list[tuple[Any, torch.Tensor]] = []
        self._thread: threading.Thread | None = None
        self._frame: torch.Tensor | None = None  # the receiver's buffer, reused: messages are copied out of it
        self._abandoned = False  # set by `abandon`: the receiver drops what still arrives
        self.costs = Costs()  # the engine's, renewed each step

    def send(self, dst: int, kind: int, microbatch: int, body: Any, tensors: Sequence[torch.Tensor] = (),
             ended: Sequence[int] = ()) -> None:
        """Post a message to ``dst`` without waiting for it to leave, so compute goes on meanwhile.

        A message is at most two gloo sends: the frame (only the bytes used), then one payload part
        with whatever did not fit (the skeleton, then the remaining tensors back to back; a lone
        tensor is sent as is). Tensors in the frame are copied into it: a copy costs less than the
        second send, which waits for the receiver to post its buffer (gloo's rendezvous).
        Every send costs the peer's gloo I/O thread CPU time beside its compute, so the count matters
        more than the bytes. The parts are posted with ``isend`` in order (one peer's messages arrive
        in the order sent); the handles and tensors are kept until `flush`. The tensors must not be
        changed in place afterwards (the engine sends detached outputs and gradients, which nobody
        touches).
        """
        start = time.thread_time()
        specs = [(tuple(t.shape), _DTYPE_CODE[t.dtype]) for t in tensors]
        raw = pickle.dumps((body, specs, tuple(ended)), protocol=pickle.HIGHEST_PROTOCOL)
        data = [t.detach().reshape(-1).view(torch.uint8) if t.numel() else t.detach().new_empty(0, dtype=torch.uint8)
                for t in tensors]  # reshape copies only a non-contiguous tensor
        at = _HEAD_BYTES
        mask = 0  # bit i: tensor i travels in the frame
        inside: list[torch.Tensor] = []
        rest: list[torch.Tensor] = []
        if at + len(raw) <= FRAME:
            at += len(raw)
            for i, t in enumerate(data):
                n = t.numel()
                if i < _MASK_BITS and at + n <= FRAME:
                    inside.append(t)
                    at += n
                    mask |= 1 << i
                elif n:
                    rest.append(t)
            skeleton_in_frame = True
        else:
            rest = [torch.frombuffer(bytearray(raw), dtype=torch.uint8), *(t for t in data if t.numel())]
            skeleton_in_frame = False
        payload = rest[0] if len(rest) == 1 else torch.cat(rest) if rest else None
        size = 0 if payload is None else payload.numel()
        frame = torch.empty(at, dtype=torch.uint8)
        view = frame.numpy()
        view[:_HEAD_BYTES] = memoryview(struct.pack(_HEAD, kind, len(raw), len(tensors), microbatch, mask, size))
        if skeleton_in_frame:
            view[_HEAD_BYTES:_HEAD_BYTES + len(raw)] = memoryview(raw)
            at = _HEAD_BYTES + len(raw)
            for t in inside:
                frame[at:at + t.numel()].copy_(t)
                at += t.numel()
        parts = [frame] + ([payload] if payload is not None else [])
        with self._lock:
            for t in parts:
                self._pending.append((dist.isend(t, dst, group=self.group, tag=TAG), t))
            self.costs.sent += 1
            self.costs.send_s += time.thread_time() - start

    def flush(self, timeout: float) -> None:
        """Wait until every posted message left."""
        with self._lock:
            pending, self._pending = self._pending, []
        for work, _ in pending:
            wait(work, "pipeline send", "peer", timeout, p2p=True)

    def _receive_one(self) -> Message:
        """The next message from any peer: its frame, then its payload (if any) from the same peer."""
        if self._frame is None:
            self._frame = torch.empty(FRAME, dtype=torch.uint8)
        frame = self._frame
        # One peer: a receive from it is posted before its send arrives, so gloo writes the message
        # straight from the sender's call (a receive from any rank is a rendezvous: the sender's
        # data waits for this side's go-ahead, written later by its I/O thread).
        src = dist.recv(frame, self.peers[0] if len(self.peers) == 1 else None, group=self.group, tag=TAG)
        kind, nbytes, ntensors, microbatch, mask, size = struct.unpack_from(_HEAD, frame[:_HEAD_BYTES].numpy())
        at = _HEAD_BYTES
        payload = torch.empty(0, dtype=torch.uint8)
        off = 0
        lone = -1  # the one tensor the payload holds, received straight into its own memory
        tensors: list[torch.Tensor | None] = []
        if at + nbytes <= FRAME:
            body, specs, ended = pickle.loads(frame[at:at + nbytes].numpy().tobytes())
            at += nbytes
            tensors = [None] * len(specs)
            if size:
                outside = [i for i, (shape, _) in enumerate(specs) if not mask >> i & 1 and math.prod(shape)]
                if len(outside) == 1:
                    lone = outside[0]
                    shape, code = specs[lone]
                    t = torch.empty(shape, dtype=_DTYPES[code])
                    tensors[lone] = t
                    payload = t.reshape(-1).view(torch.uint8)
                else:
                    payload = torch.empty(size, dtype=torch.uint8)
                dist.recv(payload, src, group=self.group, tag=TAG)
        else:
            payload = torch.empty(size, dtype=torch.uint8)
            dist.recv(payload, src, group=self.group, tag=TAG)
            body, specs, ended = pickle.loads(payload[:nbytes].numpy().tobytes())
            off = nbytes
            tensors = [None] * len(specs)
        for i, (shape, code) in enumerate(specs[:ntensors]):
            if i == lone:
                continue
            t = torch.empty(shape, dtype=_DTYPES[code])
            n = t.numel() * t.element_size()
            if n:
                if mask >> i & 1:
                    t.reshape(-1).view(torch.uint8).copy_(frame[at:at + n])
                    at += n
                else:
                    t.reshape(-1).view(torch.uint8).copy_(payload[off:off + n])
                    off += n
            tensors[i] = t
        return Message(kind, src, microbatch, body, tensors, ended=ended)  # type: ignore[arg-type]

    def start(self, stop_kind: int, route: Callable[[Message], bool] | None = None) -> None:
        """Start the receiver (it ends after one ``stop_kind`` message from every peer).

        ``route(msg)``, called on the receiver thread, may deliver a message itself (returning True):
        one thread hand-off less per message than queueing it in `inbox`."""
        if not self.peers:
            return

        self._abandoned = False

        def run() -> None:
            stopped = 0
            try:
                while stopped < len(self.peers):
                    start = time.thread_time()
                    msg = self._receive_one()
                    costs = self.costs
                    costs.received += 1
                    costs.receive_s += time.thread_time() - start
                    if msg.kind == stop_kind:
                        stopped += 1
                        continue
                    if self._abandoned:
                        continue  # the step failed: what still arrives is dropped
                    if route is None or not route(msg):
                        self.inbox.put(msg)
            except BaseException as e:  # noqa: BLE001 - handed to the engine's dispatcher
                self.inbox.put(e)

        self._thread = threading.Thread(target=run, name="smp-pipeline-receiver", daemon=True)
        self._thread.start()

    def stop(self, stop_kind: int, timeout: float) -> None:
        """Tell every peer this rank sends nothing more this step, then wait for our receiver."""
        for p in self.peers:
            self.send(p, stop_kind, -1, None)
        self.flush(timeout)
        if self._thread is not None:
            self._thread.join(timeout)
            if self._thread.is_alive():
                raise TimeoutError("the pipeline receiver did not stop: a peer did not finish the step")
            self._thread = None

    def abandon(self, stop_kind: int, timeout: float) -> None:
        """After a failed step: the same last message as `stop`, then a short wait, never an error.

        Each failing rank ends its sending with ``stop_kind``, so the peers' receivers end instead of
        staying blocked in a receive on a group that `smp.reset` (or the exit) then destroys, which
        aborts the process ("terminate called without an active exception"). A peer that is gone
        fails our receive and our sends at once; one that never reaches its own failure path (stuck
        outside the step) costs ``timeout`` (at most `ABANDON_S`) and leaves our receiver where it is.
        """
        self._abandoned = True
        for p in self.peers:
            try:
                self.send(p, stop_kind, -1, None)
            except Exception:  # noqa: BLE001 - the peer may be gone already
                pass
        deadline = time.monotonic() + min(timeout, ABANDON_S)
        with self._lock:
            pending, self._pending = self._pending, []
        for work, _ in pending:
            while not work.is_completed() and time.monotonic() < deadline:
                time.sleep(0.002)
        if self._thread is not None:
            self._thread.join(max(0.0, deadline - time.monotonic()))
            if not self._thread.is_alive():
                self._thread = None
