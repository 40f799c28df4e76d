"""A node agent's reading: its runners are measured at the moment of the snapshot.

The head takes ``snapshot − runners − agent`` as the memory other processes hold. A runner
that loads grows hundreds of MiB/s; measured after the snapshot (the agent used to await
the probe in a thread, then measure), it made others' memory dip and jump back, a trend
the pressure guard answered by unloading an idle model (a CI failure of
tests/e2e/test_cluster_six.py). The probe is faked at the edge: it sees the runner's bytes
at its own instant, and the load goes on right after it.
"""

from __future__ import annotations

import asyncio
from typing import Any

from elbowroom.cluster.agent import NodeAgent
from elbowroom.config import Settings
from elbowroom.memory.types import ProcessMemory, Snapshot
from elbowroom.units import GiB, MiB


class LoadingRunner:
    """A supervisor's measure() of a runner that is loading its weights."""

    def __init__(self) -> None:
        self.file_backed = 100 * MiB

    def measure(self) -> ProcessMemory:
        return ProcessMemory(anonymous=20 * MiB, file_backed=self.file_backed)


def test_runners_are_measured_with_the_snapshot() -> None:
    runner = LoadingRunner()
    seen: list[int] = []

    def probe() -> Snapshot:
        ours = runner.measure().resident  # the tree as the probe walks it
        seen.append(ours)
        runner.file_backed += 60 * MiB  # the load goes on after the snapshot
        avail = 8 * GiB - ours
        return Snapshot("linux", 8 * GiB, avail, ours, 8 * GiB, avail)

    agent = NodeAgent(Settings())
    agent._probe = probe
    agent._runners["k1"] = runner  # type: ignore[assignment]
    reading: dict[str, Any] = asyncio.run(agent.poll())
    assert reading["snapshot"].available == 8 * GiB - seen[0]
    assert reading["runners"]["k1"].resident == seen[0] == 120 * MiB
