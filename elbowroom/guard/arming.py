"""Where to arm the kernel's usage thresholds: PURE. The cgroup usage at which the guard's
picture of one sample would turn soft, and hard, if everything but our runners grew.

The guard's levels are not fractions of the cgroup limit: they compare our runners' bytes
with a limit that follows what is available (``budget.memory_limit``), and what is
available with floors (``budget.assess``). So the cgroup usage where a level starts moves
with our own usage and the limit. After each sample the guard asks, for the sample's
snapshot with ``d`` more bytes held by others (available ``d`` lower, cgroup usage ``d``
higher), for the smallest ``d`` at which ``assess`` says soft, and hard (a bisection over
the real functions, so the points cannot drift from the levels), and re-arms the cgroup v1
thresholds at ``usage + d`` (``watch.PressureWatch.arm``). PSI is left out of the
what-if (it has its own trigger); the trend's soft (``trend.py``) is not a byte level.

The trend is what a fast neighbour trips first (others growing 300 MiB/s reach the
projection's soft a second before they reach the byte levels), and it needs a sample to
see the growth. So a third threshold sits a step above the sample's usage
(``growth_point``): usage growing that much wakes a sample at once, the trend sees the
growth in it (``trend.MIN_GROWTH``), and the notification's own sample pauses loads and
unloads. Every sample re-arms it a step above its usage, so a burst wakes a sample every
step (at most a tenth of a core: ``watch.COST_SHARE``).
"""

from __future__ import annotations

from dataclasses import replace

from elbowroom.memory.budget import BudgetConfig, assess
from elbowroom.memory.pools import host_pool
from elbowroom.memory.types import Pressure, Snapshot

__all__ = ["arm_points", "growth_point", "level_if_others_grow"]

RESOLUTION = 1024 * 1024  # a point closer than this to the true one is close enough
# The growth threshold's step above the sample's usage: at least trend.MIN_GROWTH (so the
# sample it wakes counts the growth) plus room for our own jitter; 2.5 % of the limit in
# a large cgroup (~0.1 s of a 320 MiB/s neighbour in the chaos run's 1.2 GiB).
GROWTH_STEP = 32 * 1024 * 1024
GROWTH_FRACTION = 0.025


def level_if_others_grow(snap: Snapshot, own: int, grow: int, cfg: BudgetConfig) -> Pressure:
    """The byte level of ``snap`` had others held ``grow`` more bytes (PSI left out)."""
    grown = replace(
        snap,
        available=max(0, snap.available - grow),
        host_available=max(0, snap.host_available - grow),
        used=snap.used + grow,
        cgroup_usage=None if snap.cgroup_usage is None else snap.cgroup_usage + grow,
        psi=None,
        os_pressure=None,
    )
    limit = host_pool(grown, own, cfg).limit
    return assess(grown, own, limit, cfg).level


def _smallest(snap: Snapshot, own: int, cfg: BudgetConfig, level: Pressure) -> int | None:
    """The smallest growth that reaches ``level`` (None: none up to all that is available;
    0: the sample is there already)."""
    hi = snap.available
    if level_if_others_grow(snap, own, 0, cfg) >= level:
        return 0
    if level_if_others_grow(snap, own, hi, cfg) < level:
        return None
    lo = 0  # below lo: under level; at hi: at or over it
    while hi - lo > RESOLUTION:
        mid = (lo + hi) // 2
        if level_if_others_grow(snap, own, mid, cfg) >= level:
            hi = mid
        else:
            lo = mid
    return hi


def growth_point(snap: Snapshot) -> int | None:
    """The cgroup usage a step above this sample's (``GROWTH_STEP``, or ``GROWTH_FRACTION``
    of the limit when larger); None outside a limited v1 cgroup or past its limit."""
    if snap.cgroup_version != 1 or snap.cgroup_usage is None or snap.cgroup_limit is None:
        return None
    at = snap.cgroup_usage + max(GROWTH_STEP, int(snap.cgroup_limit * GROWTH_FRACTION))
    return at if at < snap.cgroup_limit else None


def arm_points(snap: Snapshot, own: int, cfg: BudgetConfig) -> tuple[int, ...]:
    """The cgroup usages (bytes, ascending) at which this sample would turn soft and hard,
    for the levels it is not at yet, and the growth point a step above its usage; () outside
    a limited cgroup v1. A usage threshold fires on every crossing, both ways, so a level
    already reached gets no point (the fixed fractions and the fast samples follow it
    down)."""
    if snap.cgroup_version != 1 or snap.cgroup_usage is None or snap.cgroup_limit is None:
        return ()
    growth = growth_point(snap)
    points = [] if growth is None else [growth]
    for level in (Pressure.SOFT, Pressure.HARD):
        d = _smallest(snap, own, cfg, level)
        if d is not None and d > 0:
            at = snap.cgroup_usage + d
            if at < snap.cgroup_limit:
                points.append(at)
    return tuple(sorted(set(points)))
