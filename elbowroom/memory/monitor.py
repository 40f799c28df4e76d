"""The background sampler: probe → budget → pressure level, every ``interval`` seconds.

One daemon thread takes a Sample, keeps the last ``history_seconds`` of them in a ring
buffer and hands each to ``on_sample`` (the scheduler's hook). A failing probe or callback
is logged and the next tick tries again: the monitor must outlive a bad reading.
"""

from __future__ import annotations

import logging
import math
import threading
import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from elbowroom.memory.budget import BudgetConfig, Limit, assess, limit_to_dict, memory_limit
from elbowroom.memory.probe import snapshot_to_dict
from elbowroom.memory.types import Pressure, Probe, Snapshot

__all__ = ["Monitor", "Sample"]

log = logging.getLogger(__name__)


@dataclass(frozen=True, slots=True)
class Sample:
    at: float  # the monitor's clock (monotonic): for intervals and ordering
    wall: float  # time.time(): for people and dashboards
    snapshot: Snapshot
    own_usage: int
    limit: Limit
    level: Pressure
    reasons: tuple[str, ...] = ()  # the signals that raised the level above normal

    def to_dict(self) -> dict[str, Any]:
        return {
            "at": self.at,
            "wall": self.wall,
            "snapshot": snapshot_to_dict(self.snapshot),
            "own_usage": self.own_usage,
            "limit": limit_to_dict(self.limit),
            "level": self.level.label,
            "reasons": list(self.reasons),
        }


class Monitor:
    def __init__(
        self,
        probe: Probe,
        *,
        own_usage: Callable[[], int],
        cfg: BudgetConfig,
        interval: float = 1.0,
        history_seconds: float = 600.0,
        clock: Callable[[], float] = time.monotonic,
        wall_clock: Callable[[], float] = time.time,
        on_sample: Callable[[Sample], None] | None = None,
    ) -> None:
        if interval <= 0 or history_seconds < 0:
            raise ValueError("interval must be > 0 and history_seconds >= 0")
        self._probe = probe
        self._own_usage = own_usage
        self._cfg = cfg
        self._interval = interval
        self._clock = clock
        self._wall = wall_clock
        self._on_sample = on_sample
        self._history: deque[Sample] = deque(maxlen=max(1, math.ceil(history_seconds / interval)))
        self._lock = threading.Lock()
        self._stopping = threading.Event()
        self._thread: threading.Thread | None = None

    @property
    def interval(self) -> float:
        return self._interval

    @property
    def latest(self) -> Sample | None:
        with self._lock:
            return self._history[-1] if self._history else None

    def history(self) -> list[Sample]:
        """Samples oldest first (a copy)."""
        with self._lock:
            return list(self._history)

    def sample_now(self, record: bool = True) -> Sample:
        """Take one sample synchronously; errors from the probe propagate. ``record=False``
        (the pressure watch's fast samples) hands it on without keeping it in the history,
        whose length is counted in ``interval``s."""
        snap = self._probe()
        own = self._own_usage()
        limit = memory_limit(snap, own, self._cfg)
        verdict = assess(snap, own, limit, self._cfg)
        sample = Sample(
            at=self._clock(),
            wall=self._wall(),
            snapshot=snap,
            own_usage=own,
            limit=limit,
            level=verdict.level,
            reasons=verdict.reasons,
        )
        if record:
            with self._lock:
                self._history.append(sample)
        if self._on_sample is not None:
            self._on_sample(sample)
        return sample

    @property
    def running(self) -> bool:
        return self._thread is not None and self._thread.is_alive()

    def start(self) -> None:
        if self.running:
            return
        self._stopping.clear()
        self._thread = threading.Thread(
            target=self._run, name="elbowroom-memory-monitor", daemon=True
        )
        self._thread.start()

    def stop(self) -> None:
        self._stopping.set()
        thread, self._thread = self._thread, None
        if thread is not None and thread is not threading.current_thread():
            thread.join()

    def _run(self) -> None:
        while not self._stopping.is_set():
            try:
                self.sample_now()
            except Exception:
                log.exception("memory sample failed; trying again in %.1f s", self._interval)
            self._stopping.wait(self._interval)
