"""A small bounded log of what happened to models and requests, for the dashboard.

The scheduler records loads, unloads, evictions and crashes; the server records the 503
and 507 answers it sent. Entries carry wall-clock time (people read them on a timeline)
and a sequence number, so a reader that polls can ask only for what is new.

Bounded by count (``maxlen``): the dashboard shows ten minutes, and a server that loads
and unloads all day must not grow a list forever.
"""

from __future__ import annotations

import itertools
import threading
import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

# The kinds the dashboard marks on its timeline; others are listed but not marked.
KINDS = (
    "load",  # a runner became ready
    "load_failed",  # a load raised (crash during start, engine error)
    "unload",  # explicit, keep-alive expiry or shutdown
    "evict",  # unloaded to make room for a load, or by the pressure guard
    "crash",  # a runner exited on its own
    "refused_507",  # a load that cannot fit
    "refused_503",  # queue full, memory pressure, crash backoff
    "abort",  # the pressure guard aborted a generation
)


@dataclass(frozen=True, slots=True)
class Event:
    seq: int
    wall: float  # time.time()
    kind: str
    model: str | None
    message: str
    detail: dict[str, Any] = field(default_factory=dict)

    def to_dict(self) -> dict[str, Any]:
        return {
            "seq": self.seq,
            "wall": self.wall,
            "kind": self.kind,
            "model": self.model,
            "message": self.message,
            **({"detail": self.detail} if self.detail else {}),
        }


class EventLog:
    """Append from any thread; read a copy. ``wall_clock`` is the seam tests swap."""

    def __init__(self, maxlen: int = 500, wall_clock: Callable[[], float] = time.time) -> None:
        if maxlen < 1:
            raise ValueError("maxlen must be >= 1")
        self._events: deque[Event] = deque(maxlen=maxlen)
        self._seq = itertools.count(1)
        self._wall = wall_clock
        self._lock = threading.Lock()

    def add(self, kind: str, model: str | None, message: str, **detail: Any) -> Event:
        with self._lock:
            event = Event(next(self._seq), self._wall(), kind, model, message, dict(detail))
            self._events.append(event)
        return event

    def since(self, seq: int = 0) -> list[Event]:
        """Events with a sequence number above ``seq``, oldest first."""
        with self._lock:
            return [e for e in self._events if e.seq > seq]

    def recent(self, seconds: float) -> list[Event]:
        """Events of the last ``seconds``, oldest first."""
        cutoff = self._wall() - seconds
        with self._lock:
            return [e for e in self._events if e.wall >= cutoff]
