"""An RNG tracker: dropout inside TP regions differs per tp rank yet is reproducible.

Random ops on *replicated* activations (dropout after a row-parallel layer, on the residual
stream) must draw the same mask on every TP rank, or the replicas drift apart: they use the
default generator, which every TP rank seeds identically. Random ops on *sharded* activations
(attention-probability dropout on this rank's heads, dropout on this rank's MLP slice) must draw
independent masks per shard, as the dense model would for different heads: they run inside
``get_rng_state_tracker().fork()``, which swaps in a generator seeded with
``seed + 2718 + tp_rank`` and swaps the default one back afterwards (Megatron's scheme).

``seed`` is ``random_seed`` when set (SMP v2), else ``tensor_parallel_seed`` (SMP v1).
`seed_tensor_parallel` is called by the TP layers on first use; call it yourself to reseed.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

import torch

from ..runtime.process_state import torch_state

__all__ = ["TP_RNG", "RNGStatesTracker", "get_rng_state_tracker", "seed_tensor_parallel", "tp_rng", "tp_seed_offset"]

TP_RNG = "tensor-parallel-rng"
_TP_OFFSET = 2718


def tp_seed_offset(seed: int, tp_rank: int) -> int:
    """The seed of the TP-region generator on ``tp_rank``.

    Example:
        >>> tp_seed_offset(0, 1)
        2719
    """
    return seed + _TP_OFFSET + tp_rank


class RNGStatesTracker:
    """Named RNG states (CPU, plus the current CUDA device when available) to fork into.

    Example:
        >>> t = RNGStatesTracker()
        >>> t.add("a", 1)
        >>> with t.fork("a"):
        ...     x = torch.rand(1)
        >>> t.reset(); t.add("a", 1)
        >>> with t.fork("a"):
        ...     bool(torch.equal(x, torch.rand(1)))
        True
    """

    def __init__(self) -> None:
        self._states: dict[str, tuple[torch.Tensor, torch.Tensor | None]] = {}
        self._seeds: dict[str, int] = {}

    def reset(self) -> None:
        """Forget every named state."""
        self._states.clear()
        self._seeds.clear()

    def has(self, name: str) -> bool:
        return name in self._states

    def seed_of(self, name: str) -> int:
        return self._seeds[name]

    def add(self, name: str, seed: int) -> None:
        """Create state ``name`` seeded with ``seed``, leaving the default generators untouched."""
        if name in self._states:
            raise ValueError(f"RNG state {name!r} already exists; call reset() first")
        cpu = torch.get_rng_state()
        cuda = torch.cuda.get_rng_state() if torch.cuda.is_available() else None
        try:
            torch.manual_seed(seed)
            self._states[name] = (torch.get_rng_state(),
                                  torch.cuda.get_rng_state() if torch.cuda.is_available() else None)
            self._seeds[name] = seed
        finally:
            torch.set_rng_state(cpu)
            if cuda is not None:
                torch.cuda.set_rng_state(cuda)

    @contextmanager
    def fork(self, name: str = TP_RNG) -> Iterator[None]:
        """Run the block on state ``name``; its advanced state is kept for the next fork."""
        if name not in self._states:
            raise KeyError(f"RNG state {name!r} does not exist; known: {sorted(self._states)}")
        cpu = torch.get_rng_state()
        cuda = torch.cuda.get_rng_state() if torch.cuda.is_available() else None
        mine_cpu, mine_cuda = self._states[name]
        torch.set_rng_state(mine_cpu)
        if mine_cuda is not None:
            torch.cuda.set_rng_state(mine_cuda)
        try:
            yield
        finally:
            self._states[name] = (torch.get_rng_state(),
                                  torch.cuda.get_rng_state() if torch.cuda.is_available() else None)
            torch.set_rng_state(cpu)
            if cuda is not None:
                torch.cuda.set_rng_state(cuda)


def get_rng_state_tracker() -> RNGStatesTracker:
    """The process's tracker (``tsm.state.get_rng_state_tracker()`` in SMP v2).

    It lives in `TorchState`, so ``smp.reset()`` drops it: the next model seeds a fresh one from
    its own config and tp_rank on first use, instead of forking the previous run's generator.
    """
    ts = torch_state()
    tracker = ts.rng_tracker
    if isinstance(tracker, RNGStatesTracker):
        return tracker
    with ts.lock:  # microbatch threads may ask first, together
        if not isinstance(ts.rng_tracker, RNGStatesTracker):
            ts.rng_tracker = RNGStatesTracker()
        made: RNGStatesTracker = ts.rng_tracker
    return made


def _config_seed() -> int:
    import smp.state as smp_state

    cfg = smp_state.current().cfg
    if cfg is None:
        return 0
    random_seed: Any = getattr(cfg, "random_seed", None)
    return int(random_seed) if random_seed is not None else int(getattr(cfg, "tensor_parallel_seed", 0))


def seed_tensor_parallel(seed: int | None = None, tp_rank: int | None = None) -> int:
    """(Re)seed the TP-region generator; returns the seed used.

    Args:
        seed: base seed; default ``random_seed``, else ``tensor_parallel_seed`` from the config.
        tp_rank: default ``smp.torch.tp_rank()`` (0 before init).
    """
    if seed is None:
        seed = _config_seed()
    if tp_rank is None:
        from smp.torch.runtime.init import is_initialized

        if is_initialized():
            from smp.torch.runtime.comm import tp_rank as _tp_rank

            tp_rank = _tp_rank()
        else:
            tp_rank = 0
    value = tp_seed_offset(seed, tp_rank)
    tracker = get_rng_state_tracker()
    tracker.reset()
    tracker.add(TP_RNG, value)
    return value


@contextmanager
def tp_rng() -> Iterator[None]:
    """Fork into the TP-region generator, seeding it from the config on first use."""
    tracker = get_rng_state_tracker()
    if not tracker.has(TP_RNG):
        seed_tensor_parallel()
    with tracker.fork(TP_RNG):
        yield
