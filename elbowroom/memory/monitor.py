"""The one owner of the memory picture: probe → pools and limit → pressure level.

A ``Sample`` is everything elbowroom knows about memory at one instant: the snapshot, our
own usage (one definition: what our runners hold plus the server process's anonymous
bytes, supplied by the scheduler), every pool (host or unified first, then each GPU) with
its limit, and the pressure level with its reasons. The limit is computed here and only
here; the BudgetConfig is built once, in ``from_settings``.

``read()`` takes a sample without recording it (the scheduler asks for a fresh one under
its load lock, and for /api/memory); ``sample_now()`` also records it in the ring buffer
of the last ``history_seconds`` and hands it to the subscriber (the pressure guard). One
daemon thread calls ``sample_now()`` every ``interval`` seconds; a failing probe or
callback is logged and the next tick tries again: the monitor must outlive a bad reading.
"""

from __future__ import annotations

import logging
import math
import threading
import time
from collections import deque
from collections.abc import Callable, Mapping
from contextlib import AbstractContextManager, nullcontext
from dataclasses import dataclass
from typing import Any

from elbowroom.config import Settings
from elbowroom.memory.budget import BudgetConfig, Limit, assess, limit_to_dict
from elbowroom.memory.pools import Pool, memory_pools
from elbowroom.memory.probe import snapshot_to_dict
from elbowroom.memory.types import Pressure, Probe, Snapshot

__all__ = ["Monitor", "Sample"]

log = logging.getLogger(__name__)


@dataclass(frozen=True, slots=True)
class Sample:
    at: float  # the monitor's clock (monotonic): for intervals and ordering
    wall: float  # time.time(): for people and dashboards
    snapshot: Snapshot
    own_usage: int  # our runners' resident bytes + the server process's anonymous bytes
    limit: Limit  # the host (or unified) pool's: pools[0].limit
    level: Pressure
    reasons: tuple[str, ...] = ()  # the signals that raised the level above normal
    pools: tuple[Pool, ...] = ()  # host (or unified) first, then one per GPU

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


OwnGpu = Callable[[], Mapping[int, int]]  # our bytes per GPU index


def _no_gpu_bytes() -> Mapping[int, int]:
    return {}


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
        own_gpu: OwnGpu = _no_gpu_bytes,
        gpu_reserve: int | None = None,
        gpu_override: int | None = None,
    ) -> None:
        if interval <= 0 or history_seconds < 0:
            raise ValueError("interval must be > 0 and history_seconds >= 0")
        self._probe = probe
        self._own_usage = own_usage
        self._own_gpu = own_gpu
        self._gpu_reserve = gpu_reserve
        self._gpu_override = gpu_override
        self._cfg = cfg
        self._interval = interval
        self._clock = clock
        self._wall = wall_clock
        self._on_sample = on_sample
        self._history: deque[Sample] = deque(maxlen=max(1, math.ceil(history_seconds / interval)))
        self._lock = threading.Lock()
        self._together: AbstractContextManager[object] = nullcontext()
        self._stopping = threading.Event()
        self._thread: threading.Thread | None = None

    @classmethod
    def from_settings(
        cls,
        settings: Settings,
        probe: Probe,
        *,
        own_usage: Callable[[], int],
        own_gpu: OwnGpu = _no_gpu_bytes,
        interval: float | None = None,
        history_seconds: float | None = None,
        clock: Callable[[], float] = time.monotonic,
    ) -> Monitor:
        """The monitor of a server (or CLI) with these settings: the one BudgetConfig."""
        return cls(
            probe,
            own_usage=own_usage,
            own_gpu=own_gpu,
            cfg=BudgetConfig.from_settings(settings),
            interval=settings.monitor_interval if interval is None else interval,
            history_seconds=(
                settings.monitor_history if history_seconds is None else history_seconds
            ),
            clock=clock,
            gpu_reserve=settings.gpu_reserve,
            gpu_override=settings.override_gpu_memory,
        )

    @property
    def interval(self) -> float:
        return self._interval

    @property
    def cfg(self) -> BudgetConfig:
        return self._cfg

    @property
    def probe(self) -> Probe:
        return self._probe

    def pair(self, together: AbstractContextManager[object]) -> None:
        """Hold ``together`` while the probe and our usage are read: a probe and usage
        that come from one reading replaced by another thread (a cluster node's) must
        describe the same moment, or a loading runner's growth between the two reads
        looks like another process growing."""
        self._together = together

    def subscribe(self, on_sample: Callable[[Sample], None]) -> None:
        """Hand every recorded sample to ``on_sample`` (one subscriber: the pressure guard);
        it runs in the monitor's thread."""
        self._on_sample = on_sample

    @property
    def latest(self) -> Sample | None:
        with self._lock:
            return self._history[-1] if self._history else None

    def history(self) -> list[Sample]:
        """Samples oldest first (a copy)."""
        with self._lock:
            return list(self._history)

    def read(self) -> Sample:
        """A fresh sample, not recorded nor handed on; errors from the probe propagate."""
        with self._together:
            snap = self._probe()
            own = self._own_usage()
            own_gpu = self._own_gpu()
        pools = memory_pools(
            snap,
            own,
            own_gpu,
            self._cfg,
            gpu_reserve_bytes=self._gpu_reserve,
            gpu_override=self._gpu_override,
        )
        # The host (or unified) pool's limit is budget.memory_limit's, plus the Metal wired
        # limit as a candidate on Apple Silicon.
        limit = pools[0].limit
        verdict = assess(snap, own, limit, self._cfg)
        return Sample(
            at=self._clock(),
            wall=self._wall(),
            snapshot=snap,
            own_usage=own,
            limit=limit,
            level=verdict.level,
            reasons=verdict.reasons,
            pools=pools,
        )

    def sample_now(self, record: bool = True) -> Sample:
        """Take one sample synchronously, record it (unless ``record`` is False) and hand it
        to the subscriber; errors from the probe propagate."""
        sample = self.read()
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
