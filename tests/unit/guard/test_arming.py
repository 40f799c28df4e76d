"""Where the kernel's usage thresholds are armed: the cgroup usage at which the guard's own
levels (budget.assess over the limit that follows what is available) turn soft and hard."""

from __future__ import annotations

import dataclasses

from elbowroom.guard.arming import (
    GROWTH_STEP,
    RESOLUTION,
    arm_points,
    growth_point,
    level_if_others_grow,
)
from elbowroom.memory.budget import BudgetConfig
from elbowroom.memory.types import Pressure, Snapshot

MiB = 1024**2
GiB = 1024 * MiB
CFG = BudgetConfig()


def in_cgroup(limit: int, usage: int, inactive: int = 0) -> Snapshot:
    """As the probe makes it inside a v1 memory cgroup: available is the limit less what is
    used net of inactive page cache."""
    available = limit - (usage - inactive)
    base = Snapshot("linux", limit, available, limit - available, 24 * GiB, 20 * GiB)
    return dataclasses.replace(base, cgroup_version=1, cgroup_limit=limit, cgroup_usage=usage)


def test_points_are_where_the_levels_start() -> None:
    snap = in_cgroup(1280 * MiB, 500 * MiB)
    own = 300 * MiB
    points = arm_points(snap, own, CFG)
    assert snap.cgroup_usage is not None
    assert growth_point(snap) == snap.cgroup_usage + GROWTH_STEP in points
    soft, hard = (p for p in points if p != growth_point(snap))
    assert snap.cgroup_usage < soft < hard < 1280 * MiB
    d_soft, d_hard = soft - snap.cgroup_usage, hard - snap.cgroup_usage
    # at each point the level is there; a resolution below it, it is not yet
    assert level_if_others_grow(snap, own, d_soft, CFG) == Pressure.SOFT
    assert level_if_others_grow(snap, own, d_soft - RESOLUTION - 1, CFG) == Pressure.NORMAL
    assert level_if_others_grow(snap, own, d_hard, CFG) == Pressure.HARD
    assert level_if_others_grow(snap, own, d_hard - RESOLUTION - 1, CFG) == Pressure.SOFT


def test_points_move_with_our_usage() -> None:
    """The budget moves: with most of the cgroup ours, the same neighbour growth reaches
    soft sooner (our bytes against a limit that shrinks with what is available reach its
    soft threshold before available reaches the container's floor)."""
    snap = in_cgroup(1280 * MiB, 1150 * MiB)
    growth = growth_point(snap)
    light = [p for p in arm_points(snap, 100 * MiB, CFG) if p != growth]
    heavy = [p for p in arm_points(snap, 1000 * MiB, CFG) if p != growth]
    assert heavy[0] < light[0] - 8 * MiB


def test_a_level_already_reached_gets_no_point() -> None:
    snap = in_cgroup(1280 * MiB, 1200 * MiB)  # 80 MiB left: past the 7.5 % soft floor
    assert level_if_others_grow(snap, 100 * MiB, 0, CFG) == Pressure.SOFT
    points = [p for p in arm_points(snap, 100 * MiB, CFG) if p != growth_point(snap)]
    assert len(points) == 1 and 1200 * MiB < points[0] < 1280 * MiB


def test_no_points_outside_a_v1_cgroup() -> None:
    host = Snapshot("linux", 24 * GiB, 20 * GiB, 4 * GiB, 24 * GiB, 20 * GiB)
    assert arm_points(host, GiB, CFG) == ()
    v2 = dataclasses.replace(in_cgroup(GiB, 300 * MiB), cgroup_version=2)
    assert arm_points(v2, 100 * MiB, CFG) == ()


def test_a_growth_point_a_step_above_usage_follows_every_sample() -> None:
    """The trend (others growing fast) is what a fast neighbour trips first, a second before
    the byte levels: a threshold a step above the sample's usage wakes a sample as soon as
    usage grows that much, wherever the levels are; it moves with each sample's usage."""
    for usage in (300 * MiB, 700 * MiB):
        snap = in_cgroup(1280 * MiB, usage)
        assert usage + GROWTH_STEP in arm_points(snap, 100 * MiB, CFG)
        assert min(arm_points(snap, 100 * MiB, CFG)) == usage + GROWTH_STEP
    # a large cgroup: 2.5 % of its limit; past the limit: none
    big = in_cgroup(8 * GiB, 2 * GiB)
    assert growth_point(big) == 2 * GiB + int(8 * GiB * 0.025)
    assert growth_point(in_cgroup(1280 * MiB, 1260 * MiB)) is None
    host = Snapshot("linux", 24 * GiB, 20 * GiB, 4 * GiB, 24 * GiB, 20 * GiB)
    assert growth_point(host) is None
