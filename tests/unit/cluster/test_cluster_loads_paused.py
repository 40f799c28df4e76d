"""On a cluster, "loads are paused" has one answer: /api/memory (the router's report) and
/api/guard (the cluster guard) used to disagree (``any`` of the nodes' schedulers vs
``all`` of their guards), and the router kept a ``loads_paused`` field nothing set."""

from __future__ import annotations

import asyncio
from types import SimpleNamespace
from typing import Any

import pytest

from elbowroom.cluster.router import ClusterScheduler, NodeEntry
from elbowroom.cluster.views import ClusterGuard
from elbowroom.config import Settings
from elbowroom.scheduler.events import EventLog


def _router(*nodes: tuple[str, bool, bool]) -> ClusterScheduler:
    """Nodes as (name, alive, loads paused by that node's guard)."""
    router = ClusterScheduler(Settings(), None, events=EventLog())
    for name, alive, paused in nodes:
        node = SimpleNamespace(id=name, name=name, alive=alive)
        scheduler: Any = SimpleNamespace(loads_paused=paused)
        guard = SimpleNamespace(loads_paused=paused)
        router.nodes[name] = NodeEntry(node=node, scheduler=scheduler, guard=guard)
    return router


@pytest.mark.parametrize(
    ("nodes", "paused"),
    [
        ((("a", True, True), ("b", True, False)), False),  # b still takes the next load
        ((("a", True, True), ("b", True, True)), True),
        ((("a", True, True), ("b", False, False)), True),  # a gone node takes nothing
        ((), False),
    ],
)
def test_memory_and_guard_give_the_same_answer(
    nodes: tuple[tuple[str, bool, bool], ...], paused: bool
) -> None:
    async def main() -> None:  # the router's lock wants a running loop on 3.11
        router = _router(*nodes)
        assert router.loads_paused is paused
        assert ClusterGuard(router).loads_paused is paused

    asyncio.run(main())
