"""Partitioning: which pipeline rank owns what, for both frontends, without importing either.

Neutral graphs (`ModuleTree` of `ModuleNode`s for PyTorch, `OpGraph` of `OpNode`s for TensorFlow),
manual placement bookkeeping (`PartitionScopes`), exact automatic partitioning
(`partition_chain`, `partition_tree`, `partition_op_graph`) and reports (`PartitionReport`).
See docs/partition.md.
"""

from smp.partition.chain import chain_bottleneck, min_bottleneck, part_costs, partition_chain, split_under
from smp.partition.cost import CostModel, MemoryBudget, in_flight_by_rank, memory_weight_for
from smp.partition.graph import ModuleNode, ModuleTree, Totals, exclusive_compute
from smp.partition.items import WorkItem
from smp.partition.opgraph import OpEdge, OpGraph, OpNode
from smp.partition.opresult import OpGroup, OpPartition
from smp.partition.ops import partition_op_graph
from smp.partition.report import (
    PartitionReport,
    RankSummary,
    ReportRow,
    format_bytes,
    format_count,
    parse_size,
)
from smp.partition.result import Segment, TreePartition, check_shared_groups
from smp.partition.scopes import PartitionScopes, PartitionSettings
from smp.partition.tree import partition_tree

__all__ = [
    "CostModel",
    "MemoryBudget",
    "ModuleNode",
    "ModuleTree",
    "OpEdge",
    "OpGraph",
    "OpGroup",
    "OpNode",
    "OpPartition",
    "PartitionReport",
    "PartitionScopes",
    "PartitionSettings",
    "RankSummary",
    "ReportRow",
    "Segment",
    "Totals",
    "TreePartition",
    "WorkItem",
    "chain_bottleneck",
    "check_shared_groups",
    "exclusive_compute",
    "format_bytes",
    "format_count",
    "in_flight_by_rank",
    "memory_weight_for",
    "min_bottleneck",
    "parse_size",
    "part_costs",
    "partition_chain",
    "partition_op_graph",
    "partition_tree",
    "split_under",
]
