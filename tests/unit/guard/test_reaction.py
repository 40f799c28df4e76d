"""The guard's reaction time (the kernel's notification -> the first relief action) and the
kill order it writes to its target; the target is a recording stand-in for the scheduler."""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass, field

import pytest

from elbowroom.guard.guard import PressureGuard, own_oom_score_adj
from elbowroom.guard.ladder import InFlight, LoadedModel
from elbowroom.memory.budget import Candidate, Limit
from elbowroom.memory.monitor import Sample
from elbowroom.memory.types import Pressure, Snapshot

MiB = 1024**2
pytestmark = pytest.mark.anyio


def sample(own_mib: int, level: Pressure, taken_at: float) -> Sample:
    limit = Limit(
        value=1000 * MiB,
        winner="reserve",
        candidates=(Candidate("reserve", 1000 * MiB, "test"),),
        soft=850 * MiB,
        hard=950 * MiB,
    )
    snap = Snapshot(
        "linux", 2000 * MiB, 500 * MiB, 1500 * MiB, 2000 * MiB, 500 * MiB, taken_at=taken_at
    )
    return Sample(taken_at, 1_700_000_000.0, snap, own_mib * MiB, limit, level)


@dataclass
class Recorder:
    loaded: list[LoadedModel] = field(default_factory=list)
    adj: dict[str, int] = field(default_factory=dict)
    writes: int = 0

    def models(self) -> list[LoadedModel]:
        return list(self.loaded)

    def inflight(self) -> list[InFlight]:
        return []

    def set_pressure(self, model: str, level: Pressure) -> None:
        pass

    def follow_pause(self, paused: Callable[[], bool]) -> None:
        pass

    async def unload(self, model: str) -> None:
        self.loaded = [m for m in self.loaded if m.id != model]

    unwritable: set[str] = field(default_factory=set)  # runners the target cannot reach yet

    def set_oom_score_adj(self, model: str, adj: int) -> None:
        if model in self.unwritable:
            return  # as SchedulerTarget does for a runner that is still loading
        self.adj[model] = adj
        self.writes += 1


async def test_a_notification_is_timed_to_the_first_relief_action() -> None:
    guard = PressureGuard(Recorder(loaded=[LoadedModel("a", 100 * MiB, 1.0)]))
    fired = time.monotonic()
    guard.note_event(fired)
    await guard.apply(sample(900, Pressure.SOFT, taken_at=time.monotonic()))
    timed = [e for e in guard.events() if e.reaction is not None]
    assert [e.kind for e in timed] == ["pause_loads"]  # the first relief action, only
    assert 0 <= timed[0].reaction <= time.monotonic() - fired  # type: ignore[operator]
    stats = guard.state()["reaction"]
    assert stats["count"] == 1 and stats["p99_ms"] is not None
    assert timed[0].to_dict()["reaction"] == timed[0].reaction


async def test_a_notification_that_needed_nothing_is_not_timed_later() -> None:
    guard = PressureGuard(Recorder(loaded=[LoadedModel("a", 100 * MiB, 1.0)]))
    guard.note_event(time.monotonic())
    await guard.apply(sample(500, Pressure.NORMAL, taken_at=time.monotonic()))
    # a soft sample much later is the monitor's, not an answer to that notification
    await guard.apply(sample(900, Pressure.SOFT, taken_at=time.monotonic()))
    assert guard.state()["reaction"]["count"] == 0
    assert all(e.reaction is None for e in guard.events())


async def test_a_sample_measured_before_the_notification_does_not_answer_it() -> None:
    guard = PressureGuard(Recorder(loaded=[LoadedModel("a", 100 * MiB, 1.0)]))
    before = time.monotonic()
    guard.note_event(time.monotonic())
    await guard.apply(sample(900, Pressure.SOFT, taken_at=before))
    assert guard.state()["reaction"]["count"] == 0
    await guard.apply(sample(960, Pressure.HARD, taken_at=time.monotonic()))
    assert guard.state()["reaction"]["count"] == 1


async def test_the_kill_order_follows_state_changes() -> None:
    target = Recorder(
        loaded=[LoadedModel("old", 100 * MiB, 1.0), LoadedModel("new", 100 * MiB, 2.0)]
    )
    guard = PressureGuard(target)
    base = own_oom_score_adj()
    await guard.apply(sample(500, Pressure.NORMAL, taken_at=time.monotonic()))
    if base >= 999:
        pytest.skip(f"this test runs at oom_score_adj {base}: no room to order")
    assert target.adj["old"] > target.adj["new"] > base
    await guard.apply(sample(500, Pressure.NORMAL, taken_at=time.monotonic()))
    assert target.adj["old"] > target.adj["new"] > base  # nothing changed: the same order
    target.loaded = [LoadedModel("old", 100 * MiB, 3.0, busy=1), LoadedModel("new", 100 * MiB, 2.0)]
    await guard.apply(sample(500, Pressure.NORMAL, taken_at=time.monotonic()))
    assert target.adj["old"] < target.adj["new"]
    assert guard.state()["oom_order"] == target.adj


async def test_a_disabled_guard_orders_nothing() -> None:
    target = Recorder(loaded=[LoadedModel("a", 100 * MiB, 1.0)])
    guard = PressureGuard(target, enabled=False)
    guard.note_event(time.monotonic())
    await guard.apply(sample(960, Pressure.HARD, taken_at=time.monotonic()))
    assert target.adj == {} and guard.state()["reaction"]["count"] == 0


async def test_a_runner_the_target_could_not_write_yet_gets_its_score_later() -> None:
    """A runner still loading cannot be written; the guard remembered the order anyway and
    never wrote it again, so a preloaded LLM kept oom_score_adj 0 for good (merge of the
    guard's view of loading runners with the kill order)."""
    target = Recorder(
        loaded=[LoadedModel("old", 100 * MiB, 1.0), LoadedModel("new", 100 * MiB, 2.0)],
        unwritable={"old"},
    )
    guard = PressureGuard(target)
    if own_oom_score_adj() >= 999:
        pytest.skip("this test runs at oom_score_adj >= 999: no room to order")
    await guard.apply(sample(500, Pressure.NORMAL, taken_at=time.monotonic()))
    assert "old" not in target.adj
    target.unwritable.clear()  # loaded now
    await guard.apply(sample(500, Pressure.NORMAL, taken_at=time.monotonic()))
    assert target.adj["old"] > target.adj["new"]
