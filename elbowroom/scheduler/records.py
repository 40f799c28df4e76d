"""The scheduler's mutable per-model bookkeeping: ``lanes.Lanes`` owns the lanes,
``residency.Residency`` the loaded records; ``loop.Scheduler`` touches both for a request.

A ``Lane`` exists for every model that was ever requested (its queue, concurrency slots and
crash history outlive any one runner); a ``Loaded`` record exists while a runner holds the
model (loading, ready or stopping).
"""

from __future__ import annotations

import asyncio
import enum
from dataclasses import dataclass, field

from elbowroom.memory.types import ProcessMemory
from elbowroom.models.spec import ModelKind, ModelSpec
from elbowroom.runtime.protocol import ReadyInfo, Runner
from elbowroom.scheduler.placement import Placement


class Phase(enum.StrEnum):
    LOADING = "loading"
    READY = "ready"
    STOPPING = "stopping"


def backoff_delay(streak: int, initial: float, maximum: float) -> float:
    """Seconds to wait before restarting after ``streak`` consecutive crashes.

    The first crash restarts at once (a one-off OOM kill should not cost a client 10 s);
    from the second on the delay is ``initial``, doubling, capped at ``maximum``."""
    if streak < 2:
        return 0.0
    return float(min(maximum, initial * 2 ** (streak - 2)))


@dataclass(frozen=True, slots=True)
class InFlightRequest:
    """One request running on a runner (for the pressure guard's abort choice)."""

    request_id: str
    model: str
    kind: ModelKind
    started_at: float  # clock seconds


@dataclass(slots=True)
class Lane:
    """Queue, concurrency and crash history of one model id."""

    slots: asyncio.Semaphore  # one per request the model serves at once
    width: int = 1  # the semaphore's size: the LLM's slots, 1 for other engines
    waiting: int = 0  # requests waiting for a free slot (bounded by queue_size)
    claims: int = 0  # requests holding a slot that do not run on a runner yet
    crash_streak: int = 0  # consecutive crashes or failed loads; reset by a served request
    backoff_until: float = 0.0  # clock seconds
    last_cause: str | None = None
    restarts: int = 0  # loads that followed a crash
    oom_kills: int = 0  # its runners the kernel's OOM killer took
    load_task: asyncio.Task[Loaded] | None = None
    mean_seconds: float = 1.0  # moving average of request durations, for Retry-After
    waiting_by: dict[str, int] = field(default_factory=dict)  # waiting requests per client

    def note_crash(self, now: float, cause: str, initial: float, maximum: float) -> None:
        self.crash_streak += 1
        self.last_cause = cause
        self.backoff_until = now + backoff_delay(self.crash_streak, initial, maximum)

    def note_duration(self, seconds: float) -> None:
        # Exponential moving average: recent requests say more about the next wait.
        self.mean_seconds = 0.8 * self.mean_seconds + 0.2 * max(0.0, seconds)


@dataclass(slots=True)
class Loaded:
    """One runner and what the scheduler knows about it."""

    spec: ModelSpec
    runner: Runner
    predicted: int  # predicted bytes (the reservation while loading)
    n_ctx: int
    kv_type: str
    slots: int
    pinned: bool
    # Bytes a ready model may still grow into beyond its at-load measurement: the working
    # memory of serving and the prompt-cache grant (both budgeted, neither there at load).
    reserved: int = 0
    phase: Phase = Phase.LOADING
    busy: int = 0
    last_used: float = 0.0  # clock seconds
    last_used_wall: float | None = None  # time.time() of last_used, for people
    expires_at: float | None = None  # clock seconds; None: never
    ready: ReadyInfo | None = None
    unload_when_idle: str | None = None  # reason of an unload asked while requests ran
    placement: Placement | None = None  # where its layers are (GPU offload)
    stop_task: asyncio.Task[None] | None = None
    stopped: asyncio.Event = field(default_factory=asyncio.Event)

    def measure(self) -> ProcessMemory | None:
        """The runner's bytes now; None when they cannot be read (process just died)."""
        try:
            return self.runner.measure()
        except Exception:  # a vanished /proc entry must not break a decision
            return None

    def held_bytes(self, now: ProcessMemory | None = None) -> int:
        """Bytes to count as committed: the prediction while loading; else the larger of now
        and right after load (mmap pages the OS dropped come back when the model runs).
        ``now``: a measurement the caller already took (None: one is taken here)."""
        if self.phase is Phase.LOADING or self.ready is None:
            return self.predicted
        if now is None:
            now = self.measure()
        live = now.resident if now is not None else 0
        return max(live, self.ready.measured.resident + self.reserved)
