"""Where available memory is heading: PURE. Soft pressure *before* the floor is reached.

The levels compare one sample with fixed floors, so a neighbour growing 100 MiB/s in a
small container goes from "normal" to the OOM killer within a second or two: inside that
time an unload (a runner has to exit) or a paused load comes too late. So the guard also
looks at the last second of samples: when the memory *others* hold (everything but our
runners and server: total − available − ours; our own loads are not a threat the guard
should answer by unloading) grows fast enough that available memory runs out within
``horizon`` seconds, the sample counts as soft: loads pause and one idle model goes on
the rising edge, while there is still time for it.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from elbowroom.memory.types import Pressure
from elbowroom.units import format_size

# Samples closer together than this give a rate that is mostly noise.
MIN_SPAN = 0.2
WINDOW = 1.5  # seconds of samples the rate is taken over


@dataclass(frozen=True, slots=True)
class Point:
    at: float  # the monitor's clock, seconds
    others: int  # bytes held by everything but us
    available: int


def projected(points: Sequence[Point], horizon: float) -> tuple[Pressure, str | None]:
    """SOFT (and why) when, at the rate others' memory grew over the last ``WINDOW`` s,
    available memory is gone within ``horizon`` s; else NORMAL. ``points``: oldest first,
    the newest last; ``horizon`` 0 turns the projection off."""
    if horizon <= 0 or len(points) < 2:
        return Pressure.NORMAL, None
    now = points[-1]
    window = [p for p in points if now.at - p.at <= WINDOW]
    first = window[0]
    span = now.at - first.at
    if span < MIN_SPAN:
        return Pressure.NORMAL, None
    rate = (now.others - first.others) / span
    if rate <= 0 or now.available > rate * horizon:
        return Pressure.NORMAL, None
    return Pressure.SOFT, (
        f"memory held by other processes grows {format_size(int(rate))}/s: the "
        f"{format_size(now.available)} available last {now.available / rate:.1f} s "
        f"(< {horizon:g} s)"
    )
