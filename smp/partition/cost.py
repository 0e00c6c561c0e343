"""The cost model: how sizes and times become one balancing cost, and how much memory a rank needs.

Balancing cost of a set of modules (SMP v1, reference section 3.3)::

    cost = memory_weight * memory / total_memory + (1 - memory_weight) * compute / total_compute
    memory = param_memory_factor * param_bytes + activation_bytes

Both terms are normalised to sum to 1 over the whole model, so ``memory_weight`` is a true
weight whatever the units. When no compute cost is known (no trace, ``skip_tracing``) the compute
term counts modules instead, as SMP v1 did: every module that owns parameters or is a leaf counts 1.

Memory a rank needs, in bytes, when the schedule keeps ``in_flight`` microbatches alive on it::

    rank_bytes = param_memory_factor * param_bytes + in_flight * activation_bytes

``param_memory_factor`` is the bytes held per byte of parameters: weights, gradients and optimizer
state. 4 is fp32 Adam (weights, grads, two moments); SMP v1's cost used 3 (its "optimizer
allowance"); with mixed precision it is about 8-10 per byte of a 16-bit parameter.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from smp.errors import PartitionError

__all__ = ["CostModel", "MemoryBudget", "in_flight_by_rank", "memory_weight_for"]

OPTIMIZE_CHOICES = ("speed", "memory")


def memory_weight_for(optimize: str) -> float:
    """The default ``memory_weight`` for an ``optimize`` value (SMP docs rule, reference section 12).

    Example:
        >>> memory_weight_for("speed"), memory_weight_for("memory")
        (0.2, 0.8)
    """
    if optimize not in OPTIMIZE_CHOICES:
        raise PartitionError(f"optimize={optimize!r} is not one of {OPTIMIZE_CHOICES}")
    return 0.2 if optimize == "speed" else 0.8


@dataclass(frozen=True)
class CostModel:
    """Turns (param bytes, activation bytes, compute) into a normalised balancing cost.

    Example:
        >>> model = CostModel(memory_weight=0.5, total_memory=100.0, total_compute=10.0)
        >>> model.cost(param_bytes=10, activation_bytes=20, compute=5.0)  # 0.5*60/100 + 0.5*5/10
        0.55
    """

    memory_weight: float
    total_memory: float = 1.0
    total_compute: float = 1.0
    param_memory_factor: float = 4.0

    def __post_init__(self) -> None:
        if not 0.0 <= self.memory_weight <= 1.0:
            raise PartitionError(
                f"memory_weight={self.memory_weight!r} must be in [0, 1]; 0 balances compute only, 1 memory only"
            )
        if self.param_memory_factor < 0:
            raise PartitionError(f"param_memory_factor={self.param_memory_factor!r} must be >= 0")

    def memory(self, param_bytes: float, activation_bytes: float) -> float:
        """Bytes for one microbatch: parameters with their optimizer allowance, plus activations."""
        return self.param_memory_factor * param_bytes + activation_bytes

    def cost(self, param_bytes: float, activation_bytes: float, compute: float) -> float:
        """The normalised cost (a whole model sums to 1)."""
        mem = self.memory(param_bytes, activation_bytes) / self.total_memory if self.total_memory > 0 else 0.0
        comp = compute / self.total_compute if self.total_compute > 0 else 0.0
        if self.total_memory <= 0:
            return comp
        if self.total_compute <= 0:
            return mem
        return self.memory_weight * mem + (1.0 - self.memory_weight) * comp


@dataclass(frozen=True)
class MemoryBudget:
    """Per-rank memory: the schedule's in-flight microbatches and an optional cap.

    Attributes:
        in_flight: microbatches whose activations a rank holds at its peak, per rank (1F1B: rank
            r holds min(p - r, m); GPipe: m everywhere). Take it from the scheduler's simulation.
        cap_bytes: device memory available to the model on each rank, or None for no limit.
        param_memory_factor: bytes held per byte of parameters (see the module docstring).

    Example:
        >>> budget = MemoryBudget.build(num_ranks=2, in_flight=[2, 1], cap_bytes=100)
        >>> budget.rank_bytes(0, param_bytes=10, activation_bytes=20), budget.fits(0, 10, 40)
        (80.0, False)
    """

    in_flight: tuple[int, ...]
    cap_bytes: float | None = None
    param_memory_factor: float = 4.0

    @staticmethod
    def build(
        num_ranks: int,
        in_flight: int | Sequence[int] | None = None,
        cap_bytes: float | None = None,
        param_memory_factor: float = 4.0,
    ) -> MemoryBudget:
        """Check and normalise the user-facing arguments (an int applies to every rank)."""
        if in_flight is None:
            counts = (1,) * num_ranks
        elif isinstance(in_flight, int):
            counts = (in_flight,) * num_ranks
        else:
            counts = tuple(int(c) for c in in_flight)
            if len(counts) != num_ranks:
                raise PartitionError(
                    f"in_flight has {len(counts)} entries but there are {num_ranks} ranks; give one count per "
                    "rank (the scheduler's peak_in_flight) or one int for all"
                )
        if any(c < 0 for c in counts):
            raise PartitionError(f"in_flight={list(counts)} must be >= 0 for every rank")
        if cap_bytes is not None and cap_bytes <= 0:
            raise PartitionError(f"memory_cap_bytes={cap_bytes!r} must be > 0 (or None for no limit)")
        return MemoryBudget(counts, None if cap_bytes is None else float(cap_bytes), param_memory_factor)

    def rank_bytes(self, rank: int, param_bytes: float, activation_bytes: float) -> float:
        """Peak bytes on ``rank`` for the given parameter and per-microbatch activation bytes."""
        return self.param_memory_factor * param_bytes + self.in_flight[rank] * activation_bytes

    def fits(self, rank: int, param_bytes: float, activation_bytes: float, share: float = 1.0) -> bool:
        """Whether that fits in ``share`` of the cap (always True without a cap)."""
        if self.cap_bytes is None:
            return True
        return self.rank_bytes(rank, param_bytes, activation_bytes) <= self.cap_bytes * share


def in_flight_by_rank(pipeline: str, num_ranks: int, microbatches: int, active_microbatches: int) -> tuple[int, ...]:
    """Microbatches whose activations each pipeline rank holds at its peak, for a partition's estimate.

    GPipe (and ``simple``, which runs every forward first) keeps all of them; the 1F1B family keeps
    at most what the rank's distance to the end of the pipeline lets in, and never more than
    ``active_microbatches`` (SMP v1's cap). The scheduler's simulation is exact; this is what is
    known before the plan exists.

    Example:
        >>> in_flight_by_rank("interleaved", 4, 8, 6), in_flight_by_rank("gpipe", 2, 8, 8)
        ((4, 3, 2, 1), (8, 8))
    """
    if pipeline in ("gpipe", "simple"):
        return (min(microbatches, active_microbatches),) * num_ranks
    return tuple(max(1, min(num_ranks - r, microbatches, active_microbatches)) for r in range(num_ranks))
