"""PURE: which node of the cluster a model is loaded on.

Each node's own scheduler already answers "can this load fit here, and what would it
evict?" with ``policy.decide`` over that node's live budget. Placement compares those
answers across nodes:

    1. nodes where it fits now (Admit): best fit, the node left with the least room, so
       large holes stay free for large models;
    2. else nodes where it fits after evicting idle models (Evict): one least-recently-
       used order over the whole cluster. Each node's own decision evicts the shortest
       prefix of its LRU order that makes room; walking every node's idle models from the
       least recently used on, the first node whose prefix is complete is the one whose
       most recently used victim is the oldest, so that node is chosen (then the fewest
       bytes evicted): no model is evicted while an older idle one elsewhere would do;
    3. else nodes where it fits once busy models go idle (Wait): the one with fewest busy;
    4. else nowhere: a refusal that names every node's numbers (HTTP 507).

Nodes under hard memory pressure, and nodes that are gone, are skipped: the guard is
relieving them. Ties go to the lower pressure, then the node name (deterministic).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from elbowroom.memory.types import Pressure
from elbowroom.scheduler.policy import Admit, Decision, Evict, Refuse, Wait
from elbowroom.units import format_size

__all__ = ["ClusterRefusal", "NodeOption", "choose"]


@dataclass(frozen=True, slots=True)
class NodeOption:
    """One node's answer for one load."""

    node: str  # Ray node id (hex)
    name: str  # what people see: the node's address or host name
    decision: Decision
    needed: int  # predicted host bytes of the model on this node
    available: int  # load ceiling minus what is committed there, now
    limit: int  # the node's load ceiling
    pressure: Pressure = Pressure.NORMAL
    alive: bool = True
    # Evict: the last use (scheduler clock, shared by every node's scheduler on the head)
    # of the most recently used model it would evict.
    evicts_used: float | None = None


@dataclass(frozen=True, slots=True)
class ClusterRefusal:
    """The model fits on no node: the numbers of each."""

    model: str
    options: tuple[NodeOption, ...]

    def message(self) -> str:
        if not self.options:
            return f"model {self.model!r} cannot be placed: the cluster has no live node"
        parts = [_node_line(o) for o in self.options]
        return (
            f"model {self.model!r} fits on no node of the cluster: "
            + "; ".join(parts)
            + ". Add a node with more memory, unload pinned models, or set a smaller --ctx."
        )

    def details(self) -> dict[str, Any]:
        return {
            "model": self.model,
            "nodes": [
                {
                    "node": o.node,
                    "name": o.name,
                    "alive": o.alive,
                    "pressure": o.pressure.label,
                    "needed": o.needed,
                    "available": o.available,
                    "ceiling": o.limit,  # the node's load ceiling
                    "limit": o.limit,  # the same number, under its old name (kept for clients)
                    "evictable": o.decision.evictable if isinstance(o.decision, Refuse) else None,
                    "refusal": o.decision.details() if isinstance(o.decision, Refuse) else None,
                }
                for o in self.options
            ],
        }


def _node_line(o: NodeOption) -> str:
    if not o.alive:
        return f"{o.name}: gone"
    if o.pressure is Pressure.HARD:
        return f"{o.name}: under hard memory pressure"
    if isinstance(o.decision, Refuse):
        d = o.decision
        # The node's own ceiling (the refusal's is less what elbowroom's agent holds there).
        room = d.available + d.evictable
        if room >= d.limit:
            return (
                f"{o.name}: needs {format_size(d.needed)}, more than its whole "
                f"{format_size(o.limit)} load ceiling"
            )
        return (
            f"{o.name}: needs {format_size(d.needed)}, only {format_size(room)} of its "
            f"{format_size(o.limit)} load ceiling can be made free"
        )
    return f"{o.name}: {format_size(o.available)} free under its {format_size(o.limit)} ceiling"


def choose(model: str, options: Sequence[NodeOption]) -> NodeOption | ClusterRefusal:
    """The node to load ``model`` on, or the refusal naming every node's numbers."""
    usable = [o for o in options if o.alive and o.pressure is not Pressure.HARD]

    def tie(o: NodeOption) -> tuple[int, str, str]:
        return (int(o.pressure), o.name, o.node)

    admit = [o for o in usable if isinstance(o.decision, Admit)]
    if admit:
        return min(admit, key=lambda o: (o.available - o.needed, *tie(o)))
    evict = [o for o in usable if isinstance(o.decision, Evict)]
    if evict:
        return min(evict, key=lambda o: (o.evicts_used or 0.0, _freed(o.decision), *tie(o)))
    wait = [o for o in usable if isinstance(o.decision, Wait)]
    if wait:
        return min(wait, key=lambda o: (_busy(o.decision), *tie(o)))
    return ClusterRefusal(model, tuple(sorted(options, key=tie)))


def _freed(d: Decision) -> int:
    return d.freed if isinstance(d, Evict) else 0


def _busy(d: Decision) -> int:
    return len(d.busy) if isinstance(d, Wait) else 0
