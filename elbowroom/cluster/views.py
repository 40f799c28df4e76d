"""The cluster seen through the single-machine ``guard`` and ``monitor`` interfaces.

The server's admission gate, dashboard and metrics read one guard and one monitor; in a
cluster each node has its own. ``ClusterGuard`` closes the gate only when every live node
refuses (a node under hard pressure refuses its own models' requests in the router);
``ClusterMonitor`` shows the worst node, since the cluster is as pressed as that node.
"""

from __future__ import annotations

from collections import Counter
from typing import Any

from elbowroom.cluster.router import ClusterScheduler, NodeEntry
from elbowroom.memory.types import Pressure


def _worst(router: ClusterScheduler) -> NodeEntry | None:
    live = [e for e in router.live() if e.monitor is not None]
    if not live:
        return None
    return max(live, key=lambda e: (int(e.level()), e.node.name))


class ClusterMonitor:
    def __init__(self, router: ClusterScheduler) -> None:
        self._router = router

    @property
    def latest(self) -> Any:
        worst = _worst(self._router)
        return worst.monitor.latest if worst is not None else None

    def history(self) -> list[Any]:
        worst = _worst(self._router)
        return worst.monitor.history() if worst is not None else []

    def sample_now(self) -> Any:
        worst = _worst(self._router)
        return worst.monitor.sample_now() if worst is not None else None

    def stop(self) -> None:
        """Each node's monitor is stopped by the cluster's close."""


class ClusterGuard:
    def __init__(self, router: ClusterScheduler) -> None:
        self._router = router
        self.counters: Counter[tuple[str, str]] = Counter()

    def _guards(self) -> list[Any]:
        return [e.guard for e in self._router.live() if e.guard is not None]

    @property
    def latest(self) -> Any:
        worst = _worst(self._router)
        return worst.guard.latest if worst is not None and worst.guard is not None else None

    @property
    def loads_paused(self) -> bool:
        return self._router.loads_paused  # the router's answer (docs/cluster.md)

    def admission_open(self) -> bool:
        guards = self._guards()
        return not guards or any(g.admission_open() for g in guards)

    def check_admission(self) -> None:
        if not self.admission_open():
            self._guards()[0].check_admission()

    def aborting(self) -> dict[str, str]:
        out: dict[str, str] = {}
        for g in self._guards():
            out.update(g.aborting())
        return out

    def events(self) -> list[Any]:
        merged = [ev for g in self._guards() for ev in g.events()]
        return sorted(merged, key=lambda ev: ev.wall)

    def state(self) -> dict[str, Any]:
        levels = [e.level() for e in self._router.live()]
        per_node = {e.node.name: e.guard.state() for e in self._router.live() if e.guard}
        counters: Counter[tuple[str, str]] = Counter(self.counters)
        for g in self._guards():
            counters.update(g.counters)
        return {
            "enabled": any(s["enabled"] for s in per_node.values()),
            "level": max(levels, default=Pressure.NORMAL).label,
            "admission_open": self.admission_open(),
            "loads_paused": self.loads_paused,
            "aborting": self.aborting(),
            "counters": [
                {"action": k, "reason": r, "count": n} for (k, r), n in sorted(counters.items())
            ],
            "nodes": per_node,
        }

    async def close(self) -> None:
        """Each node's guard is closed by the cluster's close."""
