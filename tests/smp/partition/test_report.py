"""Partition reports: table, per-rank totals, imbalance, data form; the core stays framework-free."""

from __future__ import annotations

import doctest
import importlib
import json
import pkgutil
import subprocess
import sys

import pytest

import smp.partition
from smp.partition import ModuleNode, ModuleTree, PartitionReport, RankSummary, ReportRow, partition_tree


def _model(layers: int = 6) -> ModuleTree:
    return ModuleTree([
        ModuleNode("", ("embed", "layers", "head")),
        ModuleNode("embed", param_bytes=4000, param_count=1000, compute=1.0, activation_bytes=100),
        ModuleNode("layers", tuple(f"layers.{i}" for i in range(layers))),
        *[ModuleNode(f"layers.{i}", param_bytes=400, param_count=100, compute=4.0, activation_bytes=100)
          for i in range(layers)],
        ModuleNode("head", param_bytes=4000, param_count=1000, compute=2.0, activation_bytes=50),
    ])


def test_report_numbers_match_the_partition() -> None:
    part = partition_tree(_model(), 2, memory_weight=0.2, in_flight=[2, 1], memory_cap_bytes=1e6)
    report = part.report()
    assert sum(r.params for r in report.ranks) == 2600
    assert [r.in_flight for r in report.ranks] == [2, 1]
    assert sum(r.cost for r in report.ranks) == pytest.approx(1.0)
    assert sum(r.cost for r in report.rows) == pytest.approx(1.0)
    for summary, totals, mem in zip(report.ranks, part.rank_totals(), part.memory_bytes(), strict=True):
        assert summary.params == totals.param_count and summary.memory_bytes == mem
    costs = [r.cost for r in report.ranks]
    assert report.imbalance == pytest.approx(max(costs) / (sum(costs) / 2))
    assert report.fits is True
    data = json.loads(json.dumps(report.to_dict()))
    assert data["chain"] == list(part.chain()) and len(data["ranks"]) == 2
    assert data["imbalance"] == pytest.approx(report.imbalance)


def test_render_collapses_numbered_siblings_and_shows_verdict() -> None:
    part = partition_tree(_model(8), 2, memory_weight=0.0, memory_cap_bytes=32 * 1024)
    text = str(part.report())
    assert "layers.0-" in text and "chain (ranks a microbatch visits): 0 -> 1" in text
    assert "memory cap 32.00 KiB: fits" in text
    full = part.report().render(collapse=False)
    assert "layers.7 " in full or "layers.7\n" in full or " layers.7" in full
    assert "imbalance (max/mean): cost" in text


def test_does_not_fit_verdict() -> None:
    rows = (ReportRow("a", 0, 1, 4, 1.0, 16.0, 0.5), ReportRow("b", 1, 1, 4, 1.0, 16.0, 0.5))
    ranks = (RankSummary(0, 1, 4, 1.0, 200.0, 0.5, 2), RankSummary(1, 1, 4, 1.0, 16.0, 0.5))
    report = PartitionReport("t", rows, ranks, (0, 1), memory_cap_bytes=100.0)
    assert report.fits is False
    assert "DOES NOT FIT (largest rank 0: 200 B)" in str(report)
    assert report.memory_imbalance == pytest.approx(200 / 108)


def test_module_doctests() -> None:
    failures = 0
    for info in pkgutil.iter_modules(smp.partition.__path__, "smp.partition."):
        module = importlib.import_module(info.name)
        result = doctest.testmod(module, optionflags=doctest.ELLIPSIS)
        failures += result.failed
    assert failures == 0


def test_core_imports_no_framework() -> None:
    code = "import smp.partition, sys; bad = [m for m in ('torch', 'tensorflow') if m in sys.modules]; print(bad)"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "[]"


def test_public_api_snapshot() -> None:
    assert sorted(smp.partition.__all__) == [
        "CostModel", "MemoryBudget", "ModuleNode", "ModuleTree", "OpEdge", "OpGraph", "OpGroup", "OpNode",
        "OpPartition", "PartitionReport", "PartitionScopes", "PartitionSettings", "RankSummary", "ReportRow",
        "Segment", "Totals", "TreePartition", "WorkItem", "chain_bottleneck", "check_shared_groups",
        "exclusive_compute", "format_bytes", "format_count", "in_flight_by_rank", "memory_weight_for",
        "min_bottleneck", "parse_size", "part_costs", "partition_chain", "partition_op_graph", "partition_tree",
        "split_under",
    ]
