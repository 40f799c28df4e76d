"""The pressure guard: turns each memory sample into the ladder's actions and applies them.

The monitor calls ``on_sample`` from its own thread; the guard hops to the asyncio loop
(``call_soon_threadsafe``) and a single worker task applies the latest sample (older ones
are skipped: acting on a stale reading is worse than waiting for the next). The guard
owns three pieces of state the server consults: whether new requests are admitted (503
``memory_pressure`` + Retry-After while hard), which generations it is aborting, and the
pressure level each LLM runner was last told.

Disabled (``memory_guard = false``, ``serve --no-memory-guard``), it still records the
latest sample for /metrics but never acts and always admits.
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import logging
import math
import threading
import time
from collections import Counter, deque
from collections.abc import Callable
from dataclasses import dataclass, replace
from typing import Any, Protocol

from elbowroom.errors import MemoryPressure
from elbowroom.guard.arming import arm_points, growth_point
from elbowroom.guard.gpu import gpu_readings
from elbowroom.guard.ladder import (
    Abort,
    Action,
    CloseAdmission,
    Gate,
    InFlight,
    LoadedModel,
    OpenAdmission,
    PauseLoads,
    PoolReading,
    Reading,
    ResumeLoads,
    SetPressure,
    Unload,
    next_gate,
    plan,
)
from elbowroom.guard.oomorder import kill_order
from elbowroom.guard.trend import Point, projected
from elbowroom.guard.watch import PressureWatch, open_sources, v1_cgroup
from elbowroom.memory.budget import BudgetConfig
from elbowroom.memory.monitor import Sample
from elbowroom.memory.types import Pressure
from elbowroom.units import format_size

log = logging.getLogger("elbowroom.guard")

# Actions that relieve memory (or stop it growing): what "the guard reacted" means for the
# reaction time. Resuming, re-opening and lowering a runner's level are not reactions.
_RELIEF = (PauseLoads, CloseAdmission, Unload, Abort)
REACTIONS_KEPT = 1000  # reaction times kept for /api/guard's percentiles
LINGER = 2.0  # a relief action this soon after a notification is reported against it
# Soft by trend holds this long after the trend last said so: a burst measured at 423 MiB/s
# read as normal 55 ms later (a pair too close to count, the window's rate just under the
# line) and loads resumed and paused three times in 0.6 s of one burst (chaos, load 16).
TREND_HOLD = 1.0
# The trend starts afresh this long after one of our own models started or finished
# loading or went away: for a moment after such a change the sample's picture of "others"
# (everything but our runners and server) is not theirs — a runner's pages move between
# the page-cache lists and its own measurement, the cgroup's statistics lag its usage —
# and it read as a neighbour growing 2.1 GiB/s in a cgroup that held nothing else, which
# unloaded the model that had just loaded (tests/e2e/test_pressure_events.py). The byte
# levels and PSI still act meanwhile; only the projection waits.
TREND_SETTLE = 1.0


def own_oom_score_adj(path: str = "/proc/self/oom_score_adj") -> int:
    """This process's ``oom_score_adj`` (0 where it cannot be read): the kill order's base."""
    try:
        with open(path) as f:
            return int(f.read().strip())
    except (OSError, ValueError):
        return 0


def _percentile(sorted_values: list[float], q: float) -> float:
    """Nearest rank."""
    return sorted_values[max(0, math.ceil(q * len(sorted_values)) - 1)]


class Target(Protocol):
    """What the guard needs from the scheduler (``guard.adapter.SchedulerTarget``)."""

    def models(self) -> list[LoadedModel]:
        """Loaded (ready) models; ``runner_level`` is the level its runner was last told."""
        ...

    def inflight(self) -> list[InFlight]: ...

    def set_pressure(self, model: str, level: Pressure) -> None: ...

    def follow_pause(self, paused: Callable[[], bool]) -> None:
        """Read whether loads are paused from ``paused`` (the guard's ``loads_paused``, their
        one owner), each time a load asks."""
        ...

    async def unload(self, model: str) -> None:
        """Unload now (or as soon as its requests in flight end), counted as pressure."""
        ...


@dataclass(frozen=True, slots=True)
class GuardEvent:
    """One applied action, for the log, /api/guard and the chaos timeline."""

    at: float  # the monitor's clock
    wall: float
    kind: str  # "pause_loads" | "resume_loads" | "set_pressure" | "unload" | "abort" | ...
    level: str
    usage: int
    limit: int
    message: str
    model: str | None = None
    # seconds from the kernel's notification (the watch's wake-up) to this action, for the
    # first relief action a notification led to; None for every other action
    reaction: float | None = None
    # for a relief action a later sample took (not the notification's own): seconds since
    # the last notification, when that was within LINGER s; None otherwise
    after_notification: float | None = None

    def to_dict(self) -> dict[str, Any]:
        return {
            "at": self.at,
            "wall": self.wall,
            "kind": self.kind,
            "level": self.level,
            "usage": self.usage,
            "limit": self.limit,
            "model": self.model,
            "message": self.message,
            "reaction": self.reaction,
            "after_notification": self.after_notification,
        }


_KINDS: dict[type, str] = {
    PauseLoads: "pause_loads",
    ResumeLoads: "resume_loads",
    SetPressure: "set_pressure",
    Unload: "unload",
    Abort: "abort",
    CloseAdmission: "close_admission",
    OpenAdmission: "open_admission",
}


def reading_of(sample: Sample, freeing: int = 0) -> Reading:
    """Our runners' bytes against the sample's limit (which follows what is available, so a
    neighbour filling the machine or the cgroup lowers the thresholds under us), net of
    ``freeing``: bytes of unloads the sample still counted."""
    lim = sample.limit
    usage = max(0, sample.own_usage - freeing)
    return Reading(usage=usage, limit=lim.value, soft=lim.soft, hard=lim.hard, freeing=freeing)


@dataclass(slots=True)
class _Unloading:
    """An unload the guard started: its bytes count as freed from the start, and keep being
    subtracted from samples measured before the runner was gone."""

    bytes: int
    task: asyncio.Task[None]
    done_at: float | None = None  # time.monotonic() when the unload completed


class PressureGuard:
    def __init__(
        self,
        target: Target,
        *,
        enabled: bool = True,
        retry_after: float = 5.0,
        events: int = 1000,
        budget: BudgetConfig | None = None,
        horizon: float = 0.0,
    ) -> None:
        self._target = target
        # GPU pools' levels need the budget's safety margin; None: GPUs are not watched
        self._budget = budget
        self._horizon = horizon  # trend.projected: 0 = off (the server passes its knob)
        self._points: deque[Point] = deque(maxlen=64)
        self._fleet: frozenset[tuple[str, bool]] | None = None  # our models, (id, loading)
        self._settle_until = -math.inf  # no trend points before this (TREND_SETTLE)
        self._trend_soft: tuple[float, str | None] | None = None  # (at, why): the last soft
        self._level_now = Pressure.NORMAL  # the highest pool's level at the last sample
        self._gpu_levels: dict[str, str] = {}  # GPU pool -> level label at the last sample
        self.enabled = enabled
        self._retry_after = retry_after
        self._gate = Gate()
        # Whether loads are paused is the gate's (``loads_paused``): the scheduler reads it
        # from here each time a load asks, and keeps no copy of its own.
        target.follow_pause(lambda: self.loads_paused)
        self._prev = Pressure.NORMAL
        self._aborting: dict[str, str] = {}  # request id -> model, until the request ends
        self._unloading: dict[str, _Unloading] = {}
        self._events: deque[GuardEvent] = deque(maxlen=events)
        self.counters: Counter[tuple[str, str]] = Counter()  # (kind, reason) -> count
        self.latest: Sample | None = None
        self._loop: asyncio.AbstractEventLoop | None = None
        self._pending: Sample | None = None
        self._wake = asyncio.Event()
        self._worker: asyncio.Task[None] | None = None
        self.watch: PressureWatch | None = None
        # The kernel's notification not yet answered (time.monotonic()), and the reaction
        # times: notification -> first relief action applied, seconds
        self._event_lock = threading.Lock()
        self._event_at: float | None = None
        self._last_event = -math.inf  # the latest notification, answered or not
        self.reactions: deque[float] = deque(maxlen=REACTIONS_KEPT)
        self.reactions_total = 0
        self.reaction_sum = 0.0
        # The kill order: the server's own oom_score_adj is the base its runners go above
        self._oom_base = own_oom_score_adj()
        self._oom_order: dict[str, int] = {}
        self._oom_warned = False
        self._growth: int | None = None  # the growth threshold armed last (arming.py)

    # --- lifetime --------------------------------------------------------------------

    async def start(self) -> None:
        """Bind to the running loop and start the worker that applies samples."""
        self._loop = asyncio.get_running_loop()
        if self._worker is None:
            self._worker = asyncio.create_task(self._run(), name="elbowroom-pressure-guard")

    def watch_with(
        self, sample: Callable[[bool], object], fast_interval: float = 0.1
    ) -> PressureWatch:
        """Start the pressure watch (``watch.py``): kernel events and fast sampling under
        pressure call ``sample`` (the monitor's ``sample_now``), whose samples come back
        through ``on_sample``."""
        if self.watch is None:
            self.watch = PressureWatch(
                sample,
                self._level,
                open_sources(),
                fast_interval=max(0.02, fast_interval),
                on_event=self.note_event,
                cgroup_v1=v1_cgroup(),
                prime=True,  # a first sample: the thresholds are armed from the start
            )
            self.watch.start()
        return self.watch

    def note_event(self, at: float) -> None:
        """The watch's thread: the kernel said memory is getting short at ``at``
        (time.monotonic()); the first relief action after it is timed from there."""
        with self._event_lock:
            self._last_event = at
            if self._event_at is None:
                self._event_at = at

    def _level(self) -> Pressure:
        """The highest pool's level at the last applied sample (host and GPUs), or the
        latest sample's host level when that is higher (it has not been applied yet)."""
        sample = self.latest
        return max(self._level_now, sample.level if sample is not None else Pressure.NORMAL)

    async def close(self) -> None:
        watch, self.watch = self.watch, None
        if watch is not None:
            await asyncio.to_thread(watch.stop)
        worker, self._worker = self._worker, None
        if worker is not None:
            worker.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await worker
        self._loop = None
        for pending in list(self._unloading.values()):
            pending.task.cancel()
        self._unloading.clear()

    # --- the monitor side (any thread) -----------------------------------------------

    def on_sample(self, sample: Sample) -> None:
        """The monitor's callback: runs in the monitor's thread, so only hand over."""
        loop = self._loop
        if loop is None or loop.is_closed():
            self.latest = sample
            return
        with contextlib.suppress(RuntimeError):  # the loop closed in between: shutting down
            loop.call_soon_threadsafe(self._offer, sample)

    def _offer(self, sample: Sample) -> None:
        if self.watch is not None and sample.level > self._level():
            self.watch.nudge()  # fast samples from now on, not from the next kernel event
        self.latest = sample
        self._pending = sample
        self._wake.set()

    async def _run(self) -> None:
        while True:
            await self._wake.wait()
            self._wake.clear()
            sample, self._pending = self._pending, None
            if sample is None:
                continue
            try:
                await self.apply(sample)
            except Exception:
                log.exception("pressure guard: applying a sample failed; next sample retries")

    # --- the asyncio side -------------------------------------------------------------

    async def apply(self, sample: Sample) -> list[Action]:
        """Plan and apply one sample; returns what was done (tests call this directly)."""
        self.latest = sample
        if not self.enabled:
            return []
        reading = reading_of(sample, self._freeing(sample))
        models = self._target.models()
        inflight = self._inflight({m.id: m.bytes for m in models})
        unloading = frozenset(m for m, p in self._unloading.items() if not p.task.done())
        gpus = self._gpu_readings(sample, models, unloading)
        level, why = self._projected(sample, frozenset((m.id, m.loading) for m in models))
        actions = plan(
            level,
            self._prev,
            inflight,
            models,
            reading=reading,
            gate=self._gate,
            retry_after=self._retry_after,
            unloading=unloading,
            gpus=gpus,
            why=why,
        )
        self._level_now = max([level, *(g.level for g in gpus)])
        self._gpu_levels = {g.name: g.level.label for g in gpus}
        self._gate = next_gate(self._gate, self._level_now, actions)
        self._prev = level
        event_at = self._take_event(sample)
        for action in actions:
            reaction = after = None
            if isinstance(action, _RELIEF):
                now = time.monotonic()
                if event_at is not None:
                    reaction = now - event_at
                    self._record_reaction(reaction)
                    event_at = None
                elif now - self._last_event < LINGER:
                    after = now - self._last_event
            self._apply(action, sample, reading, reaction, after)
        self._order_kills(models)
        self._arm(sample)
        return actions

    def _take_event(self, sample: Sample) -> float | None:
        """The pending notification this sample answers: one the sample was measured after
        (a sample taken before it cannot have seen the crossing)."""
        with self._event_lock:
            at = self._event_at
            taken = sample.snapshot.taken_at
            if at is None or (taken and taken < at):
                return None
            self._event_at = None
            return at

    def _record_reaction(self, seconds: float) -> None:
        self.reactions.append(seconds)
        self.reactions_total += 1
        self.reaction_sum += seconds

    def _arm(self, sample: Sample) -> None:
        """Re-arm the kernel's usage thresholds where this sample would turn soft and hard."""
        if self.watch is None or self._budget is None:
            return
        snap = sample.snapshot
        if snap.cgroup_version != 1:
            return
        self._growth = growth_point(snap)
        self.watch.arm(arm_points(snap, sample.own_usage, self._budget))

    def _order_kills(self, models: list[LoadedModel]) -> None:
        """Each runner's oom_score_adj follows the eviction order (``oomorder``)."""
        write = getattr(self._target, "set_oom_score_adj", None)
        if write is None:
            return
        order = kill_order(models, self._oom_base)
        if order and self._oom_base >= 999 and not self._oom_warned:
            self._oom_warned = True
            log.warning(
                "pressure guard: the server runs at oom_score_adj %d: no room above it to "
                "order its runners for the OOM killer (it picks the largest)",
                self._oom_base,
            )
        # Written every sample: the target skips a runner that already has its value, and
        # one it could not write yet (a runner still loading) is written once it can be.
        for model, adj in order.items():
            write(model, adj)
        self._oom_order = order

    def _projected(
        self, sample: Sample, fleet: frozenset[tuple[str, bool]] = frozenset()
    ) -> tuple[Pressure, str | None]:
        """The sample's host level, raised to soft when others' memory grows fast enough to
        exhaust what is available within the horizon (``trend.projected``). ``fleet``: our
        models and whether each is loading; a change starts the trend afresh after
        TREND_SETTLE seconds."""
        if self._fleet is not None and fleet != self._fleet:
            self._settle_until = sample.at + TREND_SETTLE
        self._fleet = fleet
        if sample.at < self._settle_until:
            self._points.clear()
            return sample.level, "; ".join(sample.reasons) or None
        snap = sample.snapshot
        # Not clamped at 0: only its changes count, and in a cgroup it starts below 0 (our
        # runners' mapped weights are in our usage but their page cache may be charged to
        # the cgroup that first read the file), so a clamp hid a neighbour's first 100-200
        # MiB of growth from the rate.
        others = snap.total - snap.available - sample.own_usage
        self._points.append(Point(sample.at, others, snap.available, sample.own_usage))
        level, why = projected(self._points, self._horizon)
        if level >= Pressure.SOFT:
            self._trend_soft = (sample.at, why)
        elif self._trend_soft is not None and sample.at - self._trend_soft[0] < TREND_HOLD:
            level, why = Pressure.SOFT, f"{self._trend_soft[1]} (held {TREND_HOLD:g} s)"
        if level > sample.level:
            return level, why
        # The signals that set the sample's level (PSI, the machine's available memory,
        # our usage), for the log: a level not from our usage says which one moved it.
        return sample.level, "; ".join(sample.reasons) or None

    def _gpu_readings(
        self, sample: Sample, models: list[LoadedModel], unloading: frozenset[str]
    ) -> list[PoolReading]:
        if self._budget is None or len(sample.pools) < 2:
            return []
        going: Counter[str] = Counter()
        for m in models:
            if m.id in unloading:
                for pool, n in m.pools:
                    going[pool] += n
        return gpu_readings(sample.pools, self._budget, going)

    def _inflight(self, sizes: dict[str, int]) -> list[InFlight]:
        """In-flight requests with their runner's bytes (``sizes``, when the target left them
        0) and whether the guard is aborting them; forgets aborts that have landed."""
        current = self._target.inflight()
        live = {i.request_id for i in current}
        for rid in [r for r in self._aborting if r not in live]:
            log.info("pressure guard: aborted generation %s has ended", rid)
            del self._aborting[rid]
        return [
            replace(
                i,
                bytes=i.bytes or sizes.get(i.model, 0),
                aborting=i.request_id in self._aborting,
            )
            for i in current
        ]

    def _freeing(self, sample: Sample) -> int:
        """Bytes of our unloads that ``sample`` still counts. A sample is handed over after it
        was measured, so an unload that completed meanwhile is still in its numbers: only a
        snapshot taken after the completion shows the memory back (``Snapshot.taken_at`` is
        time.monotonic(); a probe that leaves it 0 gets no such correction)."""
        taken = sample.snapshot.taken_at
        for model, pending in list(self._unloading.items()):
            done = pending.done_at
            if done is not None and (taken == 0.0 or taken > done):
                del self._unloading[model]
        return sum(p.bytes for p in self._unloading.values())

    def _apply(
        self,
        action: Action,
        sample: Sample,
        reading: Reading,
        reaction: float | None = None,
        after: float | None = None,
    ) -> None:
        kind = _KINDS[type(action)]
        model: str | None = None
        level = self._level_now.label  # the sample's, raised by the trend or a GPU pool
        reason = level
        if isinstance(action, SetPressure):
            model = action.model
            reason = action.level.label
            self._target.set_pressure(action.model, action.level)
        elif isinstance(action, Unload):
            model = action.model
            reason = action.cause or reason
            pending = _Unloading(action.bytes, asyncio.create_task(self._unload(action.model)))
            pending.task.add_done_callback(functools.partial(_mark_done, pending))
            self._unloading[action.model] = pending
        elif isinstance(action, Abort):
            model = action.model
            reason = action.reason
            self._aborting[action.request_id] = action.model
        self.counters[(kind, reason)] += 1
        message = action.message()
        pool = getattr(action, "pool", "host")
        log.log(
            logging.INFO
            if isinstance(action, ResumeLoads | OpenAdmission | SetPressure)
            else logging.WARNING,
            "pressure guard: %s (level %s, %s)",
            message,
            level,
            # a GPU pool's numbers are in the message; the host limit would mislead there
            f"limit {format_size(reading.limit)}" if pool == "host" else f"{pool} pool",
        )
        self._events.append(
            GuardEvent(
                sample.at,
                sample.wall,
                kind,
                level,
                reading.usage,
                reading.limit,
                message,
                model,
                reaction,
                after,
            )
        )

    async def _unload(self, model: str) -> None:
        try:
            await self._target.unload(model)
        except Exception as exc:  # the model may have been unloaded or crashed meanwhile
            log.info("pressure guard: unloading %s did not complete: %s", model, exc)

    # --- what the server consults ------------------------------------------------------

    def admission_open(self) -> bool:
        return not self.enabled or self._gate.admission_open

    @property
    def retry_after(self) -> float:
        return self._retry_after

    @property
    def loads_paused(self) -> bool:
        return self.enabled and self._gate.loads_paused

    def check_admission(self) -> None:
        """Raise the 503 a request gets while the guard refuses new work."""
        if self.admission_open():
            return
        sample = self.latest
        numbers = ""
        details: dict[str, Any] = {}
        if sample is not None:
            r = reading_of(sample)
            numbers = (
                f": our models hold {format_size(r.usage)} against a hard threshold of "
                f"{format_size(r.hard)}"
            )
            details = {"usage": r.usage, "hard_threshold": r.hard, "limit": r.limit}
        raise MemoryPressure(
            f"The server is under hard memory pressure and refuses new requests until "
            f"memory is back under the soft threshold{numbers}. Retry after "
            f"{math.ceil(self._retry_after)} s.",
            retry_after=self._retry_after,
            code="memory_pressure",
            details=details,
        )

    def reaction_stats(self) -> dict[str, Any]:
        """Kernel notification -> first relief action: count and percentiles (ms) of the
        last ``REACTIONS_KEPT``, totals since start."""
        kept = sorted(self.reactions)
        ms = (lambda q: round(_percentile(kept, q) * 1000, 2)) if kept else (lambda q: None)
        return {
            "count": self.reactions_total,
            "sum_s": self.reaction_sum,
            "p50_ms": ms(0.5),
            "p99_ms": ms(0.99),
            "max_ms": round(kept[-1] * 1000, 2) if kept else None,
        }

    def aborting(self) -> dict[str, str]:
        return dict(self._aborting)

    def events(self) -> list[GuardEvent]:
        return list(self._events)

    def state(self) -> dict[str, Any]:
        """JSON-ready: for /api/guard and the metrics collector."""
        sample = self.latest
        return {
            "enabled": self.enabled,
            "level": (self._level().label if sample is not None else None),
            "sample_at": (sample.at if sample is not None else None),
            "admission_open": self.admission_open(),
            "loads_paused": self.loads_paused,
            "retry_after": self._retry_after,
            "aborting": self.aborting(),
            "unloading": sorted(self._unloading),
            "aborts_this_episode": self._gate.aborts,
            "gpu_levels": dict(self._gpu_levels),
            "watch": (
                {
                    "sources": self.watch.sources,
                    "wakeups": self.watch.wakeups,
                    "fast_samples": self.watch.fast_samples,
                    "armed": self.watch.armed,
                    "growth_point": self._growth,
                    "rearms": self.watch.rearms,
                }
                if self.watch is not None
                else None
            ),
            "reaction": self.reaction_stats(),
            "oom_order": dict(self._oom_order) if self.enabled else {},
            "oom_base": self._oom_base,
            "counters": [
                {"action": k, "reason": r, "count": n}
                for (k, r), n in sorted(self.counters.items())
            ],
            "at": time.time(),
        }


def _mark_done(pending: _Unloading, _task: asyncio.Task[None]) -> None:
    pending.done_at = time.monotonic()
