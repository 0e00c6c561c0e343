"""The partition report: which module (or layer) went to which rank, per-rank totals and imbalance.

Shown on rank 0 at partition time (``str(report)``) and available as data (``report.to_dict()``).
The same report serves module trees (PyTorch) and op graphs (TensorFlow).
"""

from __future__ import annotations

import re
from collections.abc import Sequence
from dataclasses import asdict, dataclass, field

__all__ = ["PartitionReport", "RankSummary", "ReportRow", "format_bytes", "format_count", "memory_fixes",
           "parse_size"]


@dataclass(frozen=True)
class ReportRow:
    """One module (or layer, or op group) and where it went.

    ``memory_bytes`` is for one microbatch (parameter bytes with their optimizer allowance plus
    activations); ``cost`` is the normalised balancing cost (the whole model sums to 1).
    """

    name: str
    rank: int
    params: int
    param_bytes: int
    compute: float
    memory_bytes: float
    cost: float


@dataclass(frozen=True)
class RankSummary:
    """Totals of one rank. ``memory_bytes`` is the peak, with the schedule's in-flight microbatches."""

    rank: int
    params: int
    param_bytes: int
    compute: float
    memory_bytes: float
    cost: float
    in_flight: int = 1


def format_count(n: float) -> str:
    """A parameter count for humans.

    Example:
        >>> format_count(6_738_415_616), format_count(12_345), format_count(7)
        ('6.74B', '12.3K', '7')
    """
    for unit, size in (("T", 1e12), ("B", 1e9), ("M", 1e6), ("K", 1e3)):
        if abs(n) >= size:
            return f"{n / size:.3g}{unit}"
    return f"{n:.0f}"


def format_bytes(n: float) -> str:
    """Bytes in binary units.

    Example:
        >>> format_bytes(80 * 2**30), format_bytes(1536), format_bytes(12)
        ('80.00 GiB', '1.50 KiB', '12 B')
    """
    for unit, size in (("TiB", 2**40), ("GiB", 2**30), ("MiB", 2**20), ("KiB", 2**10)):
        if abs(n) >= size:
            return f"{n / size:.2f} {unit}"
    return f"{n:.0f} B"


_SIZE = re.compile(r"^\s*([0-9.]+)\s*([KMGT]?i?B?)?\s*$", re.IGNORECASE)
_UNITS = {"": 1, "b": 1, "kb": 10**3, "mb": 10**6, "gb": 10**9, "tb": 10**12,
          "kib": 2**10, "mib": 2**20, "gib": 2**30, "tib": 2**40, "k": 2**10, "m": 2**20, "g": 2**30, "t": 2**40}


def parse_size(text: str) -> int | None:
    """``"80GiB"`` -> bytes (``GB`` is 10^9, ``GiB`` and a bare ``G`` are 2^30); None when unreadable.

    Example:
        >>> parse_size("80GiB"), parse_size("1.5 GB"), parse_size("512"), parse_size("lots")
        (85899345920, 1500000000, 512, None)
    """
    m = _SIZE.match(text)
    unit = (m.group(2) or "").lower() if m else None
    if m is None or unit not in _UNITS:
        return None
    return int(float(m.group(1)) * _UNITS[unit])


def memory_fixes(key: str = "memory_per_rank") -> str:
    """What a user can change when a rank's memory estimate exceeds ``key``."""
    return ("Fix: more partitions (pipeline_parallel_degree), optimize: 'memory' (balances memory instead of "
            "compute), delayed_parameter_initialization with smp.model_creation / smp.delay_param_initialization "
            "(no rank builds what it does not own), activation checkpointing (smp.set_activation_checkpointing) or "
            f"fewer microbatches in flight (active_microbatches), or a larger {key}")


def _imbalance(values: Sequence[float]) -> float:
    mean = sum(values) / len(values) if values else 0.0
    return max(values) / mean if mean > 0 else 1.0


_INDEXED = re.compile(r"^(.*\.)(\d+)$")


def _collapse(rows: Sequence[ReportRow]) -> list[tuple[str, ReportRow]]:
    """Merge runs of numbered siblings on one rank (``layers.3`` .. ``layers.9``) into one line."""
    out: list[tuple[str, ReportRow]] = []
    run: list[ReportRow] = []

    def flush() -> None:
        if not run:
            return
        first, last = _INDEXED.match(run[0].name), _INDEXED.match(run[-1].name)
        if len(run) == 1 or first is None or last is None:
            out.extend((r.name, r) for r in run)
        else:
            label = f"{first.group(1)}{first.group(2)}-{last.group(2)} ({len(run)})"
            out.append((label, ReportRow(
                label, run[0].rank, sum(r.params for r in run), sum(r.param_bytes for r in run),
                sum(r.compute for r in run), sum(r.memory_bytes for r in run), sum(r.cost for r in run),
            )))
        run.clear()

    for row in rows:
        m = _INDEXED.match(row.name)
        if run and m:
            prev = _INDEXED.match(run[-1].name)
            if (prev is not None and prev.group(1) == m.group(1) and run[-1].rank == row.rank
                    and int(m.group(2)) == int(prev.group(2)) + 1):
                run.append(row)
                continue
        flush()
        if m:
            run.append(row)
        else:
            out.append((row.name, row))
    flush()
    return out


def _table(header: Sequence[str], lines: Sequence[Sequence[str]], right: Sequence[bool]) -> list[str]:
    widths = [max(len(h), *(len(line[i]) for line in lines)) if lines else len(h) for i, h in enumerate(header)]

    def fmt(cells: Sequence[str]) -> str:
        return "  ".join(c.rjust(w) if r else c.ljust(w) for c, w, r in zip(cells, widths, right, strict=True)).rstrip()

    return [fmt(header), fmt(["-" * w for w in widths]), *(fmt(line) for line in lines)]


@dataclass(frozen=True)
class PartitionReport:
    """A partition as a table and as data.

    Example:
        >>> report = PartitionReport(
        ...     title="demo", chain=(0, 1),
        ...     rows=(ReportRow("a", 0, 10, 40, 1.0, 160.0, 0.5), ReportRow("b", 1, 10, 40, 1.0, 160.0, 0.5)),
        ...     ranks=(RankSummary(0, 10, 40, 1.0, 160.0, 0.5), RankSummary(1, 10, 40, 1.0, 160.0, 0.5)))
        >>> report.imbalance, report.to_dict()["ranks"][1]["params"]
        (1.0, 10)
    """

    title: str
    rows: tuple[ReportRow, ...]
    ranks: tuple[RankSummary, ...]
    chain: tuple[int, ...] = ()
    memory_cap_bytes: float | None = None
    notes: tuple[str, ...] = field(default_factory=tuple)
    param_memory_factor: float = 4.0
    """Bytes held per byte of parameters: weights, gradients and optimizer state (4: fp32 Adam)."""

    @property
    def imbalance(self) -> float:
        """max / mean of the per-rank balancing cost (1.0 is perfect)."""
        return _imbalance([r.cost for r in self.ranks])

    @property
    def compute_imbalance(self) -> float:
        """max / mean of the per-rank compute."""
        return _imbalance([r.compute for r in self.ranks])

    @property
    def memory_imbalance(self) -> float:
        """max / mean of the per-rank peak memory."""
        return _imbalance([r.memory_bytes for r in self.ranks])

    @property
    def param_imbalance(self) -> float:
        """max / mean of the per-rank parameter counts."""
        return _imbalance([float(r.params) for r in self.ranks])

    @property
    def fits(self) -> bool | None:
        """Whether every rank's peak memory is under the cap (None without a cap)."""
        if self.memory_cap_bytes is None:
            return None
        return all(r.memory_bytes <= self.memory_cap_bytes for r in self.ranks)

    def rank_memory(self, rank: int) -> dict[str, float]:
        """``rank``'s estimate in parts: weights, gradients, optimizer state, in-flight activations.

        Example:
            >>> r = PartitionReport("t", (), (RankSummary(0, 10, 40, 1.0, 200.0, 1.0, 2),))
            >>> r.rank_memory(0)
            {'weights': 40.0, 'gradients': 40.0, 'optimizer': 80.0, 'activations': 40.0, 'total': 200.0}
        """
        summary = next(r for r in self.ranks if r.rank == rank)
        weights = float(summary.param_bytes)
        held = self.param_memory_factor * weights
        return {"weights": weights, "gradients": weights, "optimizer": max(0.0, held - 2 * weights),
                "activations": max(0.0, summary.memory_bytes - held), "total": float(summary.memory_bytes)}

    def require_fit(self, key: str = "memory_per_rank") -> None:
        """Raise unless every rank's estimate fits the cap (nothing to check without one).

        Raises:
            PartitionMemoryError: naming each rank over the cap, its estimate in parts, and what to change.
        """
        if self.memory_cap_bytes is None or self.fits:
            return
        from smp.errors import PartitionMemoryError

        over = [r for r in self.ranks if r.memory_bytes > self.memory_cap_bytes]
        lines = []
        for r in over:
            part = self.rank_memory(r.rank)
            lines.append(f"  rank {r.rank}: {format_bytes(part['total'])} = weights {format_bytes(part['weights'])} "
                         f"+ gradients {format_bytes(part['gradients'])} + optimizer state "
                         f"{format_bytes(part['optimizer'])} + activations of {r.in_flight} microbatch(es) in "
                         f"flight {format_bytes(part['activations'])}")
        raise PartitionMemoryError(
            f"{key}={format_bytes(self.memory_cap_bytes)}: the estimate of {len(over)} pipeline rank(s) exceeds it, "
            "before the first step:\n" + "\n".join(lines) + f"\n{memory_fixes(key)}\n\n{self.render()}")

    def to_dict(self) -> dict[str, object]:
        """Plain data (JSON-ready)."""
        return {
            "title": self.title,
            "chain": list(self.chain),
            "rows": [asdict(r) for r in self.rows],
            "ranks": [asdict(r) for r in self.ranks],
            "imbalance": self.imbalance,
            "compute_imbalance": self.compute_imbalance,
            "memory_imbalance": self.memory_imbalance,
            "param_imbalance": self.param_imbalance,
            "memory_cap_bytes": self.memory_cap_bytes,
            "fits": self.fits,
            "notes": list(self.notes),
        }

    def render(self, *, collapse: bool = True) -> str:
        """The table; ``collapse`` merges runs of numbered siblings on one rank into one line."""
        pairs = _collapse(self.rows) if collapse else [(r.name, r) for r in self.rows]
        lines = [
            [label, str(r.rank), format_count(r.params), format_bytes(r.memory_bytes), f"{r.compute:.4g}",
             f"{100 * r.cost:.1f}%"]
            for label, r in pairs
        ]
        out = [self.title, ""]
        out += _table(["module", "rank", "params", "memory/mb", "compute", "cost"], lines,
                      [False, True, True, True, True, True])
        out.append("")
        rank_lines = [
            [str(r.rank), format_count(r.params), format_bytes(r.param_bytes), str(r.in_flight),
             format_bytes(r.memory_bytes), f"{r.compute:.4g}", f"{100 * r.cost:.1f}%"]
            for r in self.ranks
        ]
        out += _table(["rank", "params", "param bytes", "in flight", "peak memory", "compute", "cost"],
                      rank_lines, [True] * 7)
        out.append("")
        out.append(
            f"imbalance (max/mean): cost {self.imbalance:.3f}, compute {self.compute_imbalance:.3f}, "
            f"memory {self.memory_imbalance:.3f}, params {self.param_imbalance:.3f}"
        )
        if self.chain:
            out.append("chain (ranks a microbatch visits): " + " -> ".join(map(str, self.chain)))
        if self.memory_cap_bytes is not None:
            worst = max(self.ranks, key=lambda r: r.memory_bytes)
            verdict = "fits" if self.fits else "DOES NOT FIT"
            out.append(f"memory cap {format_bytes(self.memory_cap_bytes)}: {verdict} "
                       f"(largest rank {worst.rank}: {format_bytes(worst.memory_bytes)})")
        out.extend(self.notes)
        return "\n".join(out)

    def __str__(self) -> str:
        return self.render()
