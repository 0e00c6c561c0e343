"""A microbatch's state on one pipeline rank, and the pieces of it both sides of a call use.

The requester side (requester.py: a microbatch's calls into modules another rank owns) and the
owner side (owner.py: running those calls) share the `Task`; the engine (engine.py) runs one per
microbatch and step.
"""

from __future__ import annotations

import queue
from dataclasses import dataclass, field
from typing import Any

import torch

from .refs import RemoteTensor
from .wire import Message, Ref

LeafId = tuple[int, int, int]  # (sender pp_rank, sender's call number, slot): a tensor a rank received


@dataclass
class Task:
    """A microbatch's thread of control on this rank."""

    engine: Any  # the Engine (engine.py) running it
    microbatch: int
    inbox: queue.SimpleQueue[Message] = field(default_factory=queue.SimpleQueue)
    calls: int = 0
    trail: list[int] = field(default_factory=list)
    chain: list[int] | None = None
    result: Any = None
    error: BaseException | None = None
    counts: dict[str, int] = field(default_factory=dict)
    in_light: bool = False
    grad_enabled: bool = True
    backward_called: bool = False
    holding: bool = False  # holds this rank's baton
    run_with: int | None = None  # the peer whose action stays open for this microbatch's next call
    peers: set[int] = field(default_factory=set)  # the pp_ranks this task sent messages to
    # Owner side: requests sent without waiting in progress, per caller pp_rank, and the messages
    # that wait for them (Note [requests that wait for the one before], `Engine._next`).
    handling: dict[int, int] = field(default_factory=dict)
    deferred: list[Any] = field(default_factory=list)
    # Owner side: outputs kept for callers (key -> tensor with its graph), tensors received (by
    # LeafId), and the kept outputs a caller fetched with a gradient to come.
    values: dict[Any, torch.Tensor] = field(default_factory=dict)
    leaves: dict[LeafId, torch.Tensor] = field(default_factory=dict)
    exported: set[Any] = field(default_factory=set)
    # Caller side: calls sent without waiting (Note [calls that do not wait]): id -> owner.
    ahead: dict[Any, int] = field(default_factory=dict)
    # ... and those not sent yet ((owner, body, tensors); one owner, the open run's), with when the
    # first was queued: they leave together in one message (`Requester._flush`).
    outbox: list[tuple[int, dict[str, Any], list[torch.Tensor]]] = field(default_factory=list)
    outbox_since: float = 0.0
    handled_s: float = 0.0  # CPU seconds this task spent handling requests (Engine.costs)
    # Caller side, per destination pp_rank: the gradient-carrying tensors sent (LeafId, tensor), in
    # order, and every tensor sent (id -> (weakref, version, needs grad, LeafId)) so a repeat travels as `Cached`.
    sent: dict[int, list[tuple[LeafId, torch.Tensor]]] = field(default_factory=dict)
    cache: dict[int, dict[int, tuple[Any, int, bool, LeafId]]] = field(default_factory=dict)

    def free(self) -> None:
        """Drop what this microbatch kept for others (its step part is over)."""
        self.values.clear()
        self.leaves.clear()
        self.exported.clear()
        self.sent.clear()
        self.cache.clear()



class Alias(torch.autograd.Function):
    """``x``'s storage as a new non-leaf whose gradient goes to ``x`` as it is now.

    The owner hands a received tensor to the module through one, so a module that changes its
    input in place (``nn.ReLU(inplace=True)``) may, as in one process; the received leaf still
    collects the gradient. The caller keeps one of each tensor it sent before that tensor is
    changed in place, so later fetches still send that tensor's gradient to its old history.
    """

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor) -> torch.Tensor:  # noqa: ARG004
        return x.detach()

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> torch.Tensor:  # noqa: ARG004
        return grad



def ref_or_value(x: Any, peer: int) -> Any:
    """What of ``x`` goes to pp_rank ``peer``: a `Ref` to a value ``peer`` holds (unchanged since it
    made it), else ``x`` itself, a reference owned elsewhere fetched here first."""
    if isinstance(x, RemoteTensor):
        if x.owner == peer and x.unchanged():
            return Ref(x.key)
        return x.get()
    return x
