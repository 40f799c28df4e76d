"""PURE: the cluster's memory pressure from its nodes' levels.

The cluster is as pressed as its worst node (exo's rule): one node at hard pressure makes
the cluster hard, and the guard of that node acts on that node's models only.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass

from elbowroom.memory.types import Pressure

__all__ = ["ClusterPressure", "cluster_pressure"]


@dataclass(frozen=True, slots=True)
class ClusterPressure:
    level: Pressure
    worst: tuple[str, ...]  # the nodes at that level (all of them when NORMAL)
    levels: Mapping[str, Pressure]

    def to_dict(self) -> dict[str, object]:
        return {
            "level": self.level.label,
            "worst": list(self.worst),
            "nodes": {node: level.label for node, level in self.levels.items()},
        }


def cluster_pressure(levels: Mapping[str, Pressure]) -> ClusterPressure:
    """The maximum of the nodes' levels, and which nodes are there. No node: NORMAL."""
    level = max(levels.values(), default=Pressure.NORMAL)
    worst = tuple(sorted(n for n, lv in levels.items() if lv is level))
    return ClusterPressure(level, worst, dict(levels))
