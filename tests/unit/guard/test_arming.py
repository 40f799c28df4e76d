"""Where the kernel's usage thresholds are armed: the cgroup usage at which the guard's own
levels (budget.assess over the limit that follows what is available) turn soft and hard."""

from __future__ import annotations

import dataclasses

from elbowroom.guard.arming import RESOLUTION, arm_points, level_if_others_grow
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
    soft, hard = arm_points(snap, own, CFG)
    assert snap.cgroup_usage is not None
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
    light = arm_points(snap, 100 * MiB, CFG)
    heavy = arm_points(snap, 1000 * MiB, CFG)
    assert heavy[0] < light[0] - 8 * MiB


def test_a_level_already_reached_gets_no_point() -> None:
    snap = in_cgroup(1280 * MiB, 1200 * MiB)  # 80 MiB left: past the 7.5 % soft floor
    assert level_if_others_grow(snap, 100 * MiB, 0, CFG) == Pressure.SOFT
    points = arm_points(snap, 100 * MiB, CFG)
    assert len(points) == 1 and 1200 * MiB < points[0] < 1280 * MiB


def test_no_points_outside_a_v1_cgroup() -> None:
    host = Snapshot("linux", 24 * GiB, 20 * GiB, 4 * GiB, 24 * GiB, 20 * GiB)
    assert arm_points(host, GiB, CFG) == ()
    v2 = dataclasses.replace(in_cgroup(GiB, 300 * MiB), cgroup_version=2)
    assert arm_points(v2, 100 * MiB, CFG) == ()
