"""Rank arithmetic: pp x tp x rdp coordinates from placement strings, and group rank lists."""

from smp.topology.rankmap import PLACEMENT_ALIASES, Coord, GroupKind, RankMap, normalize_placement

__all__ = ["PLACEMENT_ALIASES", "Coord", "GroupKind", "RankMap", "normalize_placement"]
