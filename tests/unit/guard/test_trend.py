"""The trend: soft before the floor when what others hold grows fast (pure), and the
guard acting on it with a sample sequence like the chaos benchmark's neighbour."""

from __future__ import annotations

import asyncio
import math
from collections.abc import Callable

import pytest

from elbowroom.guard.guard import PressureGuard
from elbowroom.guard.ladder import LoadedModel
from elbowroom.guard.trend import Point, projected
from elbowroom.memory.budget import Candidate, Limit
from elbowroom.memory.monitor import Sample
from elbowroom.memory.types import Pressure, Snapshot

MiB = 1024**2
pytestmark = pytest.mark.anyio


def test_soft_when_others_grow_fast_enough_to_exhaust_available_within_the_horizon() -> None:
    # others +100 MiB/s; 150 MiB available lasts 1.5 s: within a 2 s horizon
    pts = [Point(0.0, 500 * MiB, 350 * MiB), Point(1.0, 550 * MiB, 250 * MiB)]
    pts.append(Point(1.5, 650 * MiB, 150 * MiB))
    level, why = projected(pts, horizon=2.0)
    # the steepest rate in the window: +200 MiB/s over the last 0.5 s
    assert level is Pressure.SOFT and why is not None and "200.0 MiB/s" in why and "0.8 s" in why
    # the same growth with 400 MiB available (4 s) is not soft yet
    far = [Point(0.0, 500 * MiB, 600 * MiB), Point(1.0, 600 * MiB, 400 * MiB)]
    assert projected(far, horizon=2.0) == (Pressure.NORMAL, None)
    # shrinking or flat: normal; off: normal; too short a span to be a rate: normal
    flat = [Point(0.0, 600 * MiB, 50 * MiB), Point(1.0, 590 * MiB, 60 * MiB)]
    assert projected(flat, horizon=2.0) == (Pressure.NORMAL, None)
    assert projected(pts, horizon=0.0) == (Pressure.NORMAL, None)
    assert projected(pts[-1:], horizon=2.0) == (Pressure.NORMAL, None)
    close = [Point(1.4, 600 * MiB, 200 * MiB), Point(1.5, 610 * MiB, 150 * MiB)]
    assert projected(close, horizon=2.0) == (Pressure.NORMAL, None)
    # only the last 1.5 s count: an old low point does not make today's rate
    old = [Point(-10.0, 0, 900 * MiB), Point(0.0, 650 * MiB, 150 * MiB)]
    old.append(Point(1.0, 650 * MiB, 150 * MiB))
    assert projected(old, horizon=2.0) == (Pressure.NORMAL, None)


def test_the_onset_of_a_burst_is_not_diluted_by_the_window() -> None:
    # The fast chaos neighbour: flat, then +320 MiB/s for 0.3 s, 400 MiB available. Over
    # the 1.3 s window that is 74 MiB/s (5.4 s left: normal); the burst itself leaves
    # 1.25 s. The old rate (oldest point to newest) saw it a second later.
    pts = [Point(t, 500 * MiB, 496 * MiB) for t in (0.0, 0.5, 1.0)]
    pts.append(Point(1.3, 596 * MiB, 400 * MiB))
    level, why = projected(pts, horizon=2.0)
    assert level is Pressure.SOFT and why is not None and "320.0 MiB/s" in why


def test_our_own_runner_exiting_is_not_others_growing() -> None:
    # A chaos sample read available before an evicted LLM's runner exited and our bytes
    # after: others "grew" 750 MiB in 0.1 s (a 1.9 GiB/s neighbour) and loads paused.
    pts = [Point(1.0, 500 * MiB, 400 * MiB, 800 * MiB), Point(1.1, 1250 * MiB, 400 * MiB, 50 * MiB)]
    assert projected(pts, horizon=2.0) == (Pressure.NORMAL, None)
    # a neighbour growing 300 MiB beyond what we gave back is still growth
    grown = [pts[0], Point(1.2, 1550 * MiB, 100 * MiB, 50 * MiB)]
    assert projected(grown, horizon=2.0)[0] is Pressure.SOFT


def test_a_short_pair_counts_when_it_grew_more_than_noise() -> None:
    # A kernel notification a step above the last sample's usage wakes a sample 0.1 s
    # after it: 40 MiB in 0.1 s is no jitter, and the notification's own sample must act.
    pts = [Point(1.0, 500 * MiB, 340 * MiB), Point(1.1, 540 * MiB, 300 * MiB)]
    assert projected(pts, horizon=2.0)[0] is Pressure.SOFT
    # a few MiB in 0.1 s is noise: no rate from so short a pair
    jitter = [Point(1.0, 500 * MiB, 40 * MiB), Point(1.1, 506 * MiB, 34 * MiB)]
    assert projected(jitter, horizon=2.0) == (Pressure.NORMAL, None)


def sample(at: float, others_mib: int, own_mib: int, total_mib: int = 1280) -> Sample:
    avail = (total_mib - others_mib - own_mib) * MiB
    limit = Limit(
        value=(avail + own_mib * MiB),
        winner="available",
        candidates=(Candidate("available", avail + own_mib * MiB, "test"),),
        soft=int((avail + own_mib * MiB) * 0.9),
        hard=int((avail + own_mib * MiB) * 0.95),
    )
    snap = Snapshot(
        "linux", total_mib * MiB, avail, total_mib * MiB - avail, total_mib * MiB, avail
    )
    return Sample(at, 1_700_000_000.0 + at, snap, own_mib * MiB, limit, Pressure.NORMAL)


class Target:
    def __init__(self) -> None:
        self.loaded = [
            LoadedModel("idle-old", 100 * MiB, 1.0),
            LoadedModel("idle-new", 100 * MiB, 2.0),
        ]
        self.calls: list[tuple[object, ...]] = []

    def models(self) -> list[LoadedModel]:
        return list(self.loaded)

    def inflight(self) -> list:  # type: ignore[type-arg]
        return []

    def set_pressure(self, model: str, level: Pressure) -> None:
        self.calls.append(("set_pressure", model, level))

    def follow_pause(self, paused: Callable[[], bool]) -> None:
        self.paused = paused  # the guard's answer, read as the scheduler reads it

    async def unload(self, model: str) -> None:
        self.calls.append(("unload", model))
        self.loaded = [m for m in self.loaded if m.id != model]


async def test_a_fast_neighbour_pauses_loads_and_frees_one_idle_model_before_the_floor() -> None:
    target = Target()
    guard = PressureGuard(target, horizon=2.0)
    # a neighbour growing 128 MiB/s next to our 400 MiB: every sample is "normal" by itself
    # (the last leaves 224 MiB available: 1.75 s at that pace)
    for i, others in enumerate((400, 464, 528, 592, 656)):
        await guard.apply(sample(i * 0.5, others, 400))
    for _ in range(3):  # let the unload task run
        await asyncio.sleep(0)
    assert target.paused()
    assert [c for c in target.calls if c[0] == "unload"] == [("unload", "idle-old")]
    pause = next(e for e in guard.events() if e.kind == "pause_loads")
    assert "grows 128.0 MiB/s" in pause.message
    # it holds (others flat): loads resume once the last 1.5 s show no growth, and nothing
    # more is unloaded meanwhile
    for at in (2.5, 3.0, 3.5):
        await guard.apply(sample(at, 656, 300))
    assert not target.paused() and guard.events()[-1].kind == "resume_loads"
    assert [c for c in target.calls if c[0] == "unload"] == [("unload", "idle-old")]


async def test_soft_by_trend_holds_a_second_instead_of_flapping() -> None:
    # Chaos (load 16): soft by trend at one sample, normal 55 ms later, soft again: loads
    # paused and resumed three times in 0.6 s of one burst, and a load could start between.
    target = Target()
    guard = PressureGuard(target, horizon=2.0)
    for at, others in ((0.0, 400), (0.5, 400), (0.8, 496)):  # +320 MiB/s: 384 MiB left
        await guard.apply(sample(at, others, 400))
    assert target.paused() and [e.kind for e in guard.events()].count("pause_loads") == 1
    await guard.apply(sample(0.855, 497, 400))  # flat for 55 ms: still soft (held)
    await guard.apply(sample(1.5, 497, 400))  # flat since 0.8: still within the hold
    assert target.paused() and "resume_loads" not in [e.kind for e in guard.events()]
    await guard.apply(sample(2.0, 497, 400))  # 1.2 s since the trend last said soft
    assert not target.paused() and guard.events()[-1].kind == "resume_loads"


async def test_others_growth_counts_from_below_zero() -> None:
    # In a cgroup our measured bytes can exceed what is charged to it (a model's page cache
    # charged where the file was first read), so total - available - ours starts below 0.
    # The e2e neighbour grew 110 MiB in 0.3 s there and the guard saw "others" stay at 0.
    target = Target()
    guard = PressureGuard(target, horizon=2.0)
    for i, others in enumerate((-200, -200, -200, -80)):
        await guard.apply(sample(i * 0.3, others, 400, total_mib=900))
    assert target.paused()


async def test_our_own_growth_is_not_a_trend_the_guard_answers() -> None:
    target = Target()
    guard = PressureGuard(target, horizon=2.0)
    # our runners grow 128 MiB/s (a model loading): others flat, nothing happens
    for i, own in enumerate((300, 364, 428, 492)):
        assert await guard.apply(sample(i * 0.5, 300, own)) == []


async def test_the_trend_starts_afresh_after_our_own_model_loads() -> None:
    # The e2e failure: right after our two startup loads, in a cgroup holding nothing else,
    # "others" read as growing 2.1 GiB/s and the guard unloaded the model that had just
    # loaded. For TREND_SETTLE after one of our models starts, finishes loading or goes
    # away, the trend takes no points; the byte levels still act.
    target = Target()
    target.loaded = [LoadedModel("llm", 300 * MiB, -math.inf, pinned=True, loading=True)]
    guard = PressureGuard(target, horizon=2.0)
    await guard.apply(sample(0.0, 100, 300))
    target.loaded = [LoadedModel("llm", 300 * MiB, 1.0)]  # loaded: the fleet changed
    for at, others in ((0.2, 100), (0.4, 300), (0.6, 500)):  # the skewed "growth"
        assert await guard.apply(sample(at, others, 300)) == []
    assert not target.paused()
    # Past the settle time a neighbour's growth is a trend again (+400 MiB/s, 480 left).
    for at, others in ((1.3, 500), (1.5, 580)):
        await guard.apply(sample(at, others, 300))
    assert target.paused()
    # Without the change of fleet the same readings are a trend at once.
    steady = Target()
    steady.loaded = [LoadedModel("llm", 300 * MiB, 1.0)]
    other = PressureGuard(steady, horizon=2.0)
    for at, others in ((0.0, 100), (0.2, 100), (0.4, 300)):
        await other.apply(sample(at, others, 300))
    assert steady.paused()
