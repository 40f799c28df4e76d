"""Where available memory is heading: PURE. Soft pressure *before* the floor is reached.

The levels compare one sample with fixed floors, so a neighbour growing 100 MiB/s in a
small container goes from "normal" to the OOM killer within a second or two: inside that
time an unload (a runner has to exit) or a paused load comes too late. So the guard also
looks at the last second of samples: when the memory *others* hold (everything but our
runners and server: total − available − ours; our own loads are not a threat the guard
should answer by unloading) grows fast enough that available memory runs out within
``horizon`` seconds, the sample counts as soft: loads pause and one idle model goes on
the rising edge, while there is still time for it.

The rate is the steepest over the window, from any earlier point to the newest, not only
from the oldest: a burst that began 0.3 s ago is diluted to a fifth of its speed over a
1.5 s window, and was only seen a second or more into it (the fast chaos scenario's
neighbour had grown 300-400 MiB by then). A pair closer than ``MIN_SPAN`` counts when it
grew at least ``MIN_GROWTH``: that much is no measurement noise, and it is what a kernel
notification a step above the last sample's usage reports (``arming.growth_point``), so
the notification's own sample can act.

Our own bytes falling count against others' growth: a sample can read what is available
before one of our runners exited and our bytes after, and the runner's memory then shows
up as others' (a 1.9 GiB/s "neighbour" in a chaos run, the sample an eviction finished
in). A neighbour that really grew meanwhile is seen at the next pair.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from elbowroom.memory.types import Pressure
from elbowroom.units import format_size

# Samples closer together than this give a rate that is mostly noise, unless others grew
# at least MIN_GROWTH between them (a few MiB of jitter is noise; tens of MiB are not).
MIN_SPAN = 0.2
MIN_GROWTH = 24 * 1024 * 1024
WINDOW = 1.5  # seconds of samples the rate is taken over


@dataclass(frozen=True, slots=True)
class Point:
    at: float  # the monitor's clock, seconds
    others: int  # bytes held by everything but us
    available: int
    own: int = 0  # our bytes in the same sample


def projected(points: Sequence[Point], horizon: float) -> tuple[Pressure, str | None]:
    """SOFT (and why) when, at the steepest rate others' memory grew over the last
    ``WINDOW`` s (from an earlier point to the newest), available memory is gone within
    ``horizon`` s; else NORMAL. ``points``: oldest first, the newest last; ``horizon`` 0
    turns the projection off."""
    if horizon <= 0 or len(points) < 2:
        return Pressure.NORMAL, None
    now = points[-1]
    rate = 0.0
    for p in list(points)[:-1]:
        span = now.at - p.at
        grew = now.others - p.others - max(0, p.own - now.own)
        if span <= 0 or span > WINDOW or (span < MIN_SPAN and grew < MIN_GROWTH):
            continue
        rate = max(rate, grew / span)
    if rate <= 0 or now.available > rate * horizon:
        return Pressure.NORMAL, None
    return Pressure.SOFT, (
        f"memory held by other processes grows {format_size(int(rate))}/s: the "
        f"{format_size(now.available)} available last {now.available / rate:.1f} s "
        f"(< {horizon:g} s)"
    )
