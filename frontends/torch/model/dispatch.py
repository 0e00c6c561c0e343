"""Remote dispatch: after partitioning, a call to a module owned by another pipeline rank becomes
a request to that rank's engine.

Every module's ``forward`` is wrapped once. Outside a pipelined step (no engine task: tracing,
evaluation at pp == 1, a user calling a submodule directly) the wrapper calls the original. Inside
one, a module owned here runs here, a module owned elsewhere is sent to its owner, and an
``nn.Sequential`` whose children sit on several ranks sends one request per run of same-rank
children instead of one per child.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from torch import nn

from ..engine.engine import Engine, current_task
from ..engine.refs import followed
from ..engine.wire import Transport

__all__ = ["Dispatch"]


class Dispatch:
    """The module calls of one partitioned model: where each runs, and the engine that runs them."""

    def __init__(self, root: nn.Module, owner: dict[str, int], pp_rank: int) -> None:
        self.owner = owner
        self.pp_rank = pp_rank
        self.modules = dict(root.named_modules())
        self.engine: Engine | None = None
        self._orig_forward: dict[str, Callable[..., Any]] = {}
        self._groups: dict[str, list[tuple[int, int, int]]] = {}

    def start(self, group: Any, pp_ranks: list[int], rank: int, timeout_s: float, strict_order: bool) -> Engine:
        """Build the engine over the pipeline group and wrap every module's forward."""
        self.engine = Engine(Transport(group, pp_ranks, rank), pp_ranks, self.pp_rank, self.run_local, timeout_s)
        self.engine.strict_order = strict_order
        for path, m in self.modules.items():
            self._wrap(path, m)
        return self.engine

    def _wrap(self, path: str, m: nn.Module) -> None:
        orig = m.forward
        self._orig_forward[path] = orig
        owner = self.owner[path]
        is_seq = isinstance(m, nn.Sequential)
        # No parameters or buffers (dropout, an activation): its code is glue, and on references it
        # follows them as a torch op does (engine/refs.py), e.g. GPT-NeoX's post_mlp_dropout on the
        # output of an MLP on the next rank.
        stateless = next(m.parameters(), None) is None and next(m.buffers(), None) is None
        # Note [a split module's own code]: a module with no state of its own whose children sit on
        # several ranks (a decoder layer cut between its attention and its MLP) is glue between
        # those calls, like the step body between layers: entering it does not end a peer's open
        # run. Its first child owned here (or a fetch) takes this rank's baton, so the way back of
        # a V (attention on rank 1, MLP on rank 0) crosses once.
        prefix = f"{path}." if path else ""
        glue = (next(m.parameters(recurse=False), None) is None and next(m.buffers(recurse=False), None) is None
                and any(self.owner.get(prefix + name, owner) != owner for name, _ in m.named_children()))

        def forward(*args: Any, **kwargs: Any) -> Any:
            task = current_task()
            if task is None:
                return orig(*args, **kwargs)
            assert self.engine is not None
            if owner != self.pp_rank:
                return self.engine.remote_forward(owner, path, None, args, kwargs)
            if (not task.holding or task.run_with is not None) and not glue \
                    and not (stateless and followed(args, kwargs) is not None):
                self.engine.settle(task)  # this rank works now: close a peer's open run, take our baton
            if is_seq and len(args) == 1 and not kwargs:
                return self._run_sequential(path, m, args[0])
            return orig(*args, **kwargs)

        m.forward = forward  # type: ignore[method-assign]

    def _sequence_groups(self, path: str, seq: nn.Module) -> list[tuple[int, int, int]]:
        """(owner, start, stop) runs of an nn.Sequential's children; fixed after partitioning, so cached."""
        cached = self._groups.get(path)
        if cached is not None:
            return cached
        owners = [self.owner[f"{path}.{name}" if path else name] for name in seq._modules]
        groups: list[tuple[int, int, int]] = []
        for i, o in enumerate(owners):
            if groups and groups[-1][0] == o:
                groups[-1] = (o, groups[-1][1], i + 1)
            else:
                groups.append((o, i, i + 1))
        self._groups[path] = groups
        return groups

    def _run_sequential(self, path: str, seq: nn.Module, x: Any) -> Any:
        """nn.Sequential with children on several ranks: one request per run of same-rank children."""
        children = list(seq._modules.values())
        for owner, start, stop in self._sequence_groups(path, seq):
            if owner == self.pp_rank:
                for child in children[start:stop]:
                    x = child(x)
            else:
                assert self.engine is not None
                x = self.engine.remote_forward(owner, path, (start, stop), (x,), {})
        return x

    def run_local(self, path: str, span: tuple[int, int] | None, args: tuple[Any, ...],
                  kwargs: dict[str, Any]) -> Any:
        """Run a request from another rank: module ``path`` (or children ``span`` of a Sequential)."""
        module = self.modules[path]
        if span is not None:
            x = args[0]
            for child in list(module._modules.values())[span[0]:span[1]]:
                x = child(x)
            return x
        if isinstance(module, nn.Sequential) and len(args) == 1 and not kwargs:
            return self._run_sequential(path, module, args[0])
        return self._orig_forward[path](*args, **kwargs)
