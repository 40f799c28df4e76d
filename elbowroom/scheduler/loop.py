"""The scheduler: the single owner of which models are loaded, and why.

Everything runs on one asyncio event loop, so the state needs no locks: a decision and the
bookkeeping that applies it happen with no ``await`` in between (a model chosen for
eviction is marked STOPPING before anything else can run). The rules themselves are the
pure functions of ``policy``; this module observes (probe, runners), asks and applies.

Loads happen one at a time machine-wide (``_load_lock``): two loads sized against the same
free memory would both fit on paper and not in RAM. After an eviction the next decision
waits until the freed memory actually shows up in the probe.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import itertools
import logging
import math
import threading
import time
from collections.abc import AsyncIterator, Awaitable, Callable
from typing import Any

from elbowroom.config import Settings
from elbowroom.errors import (
    EngineError,
    InsufficientMemory,
    MemoryPressure,
    QueueFull,
    RunnerBackoff,
    RunnerCrashed,
)
from elbowroom.memory import budget
from elbowroom.memory.pools import Pool, memory_pools, pool_to_dict
from elbowroom.memory.types import Pressure, Probe, Snapshot
from elbowroom.models.spec import Holding, ModelKind, ModelSpec
from elbowroom.runtime.protocol import Runner, RunnerFactory
from elbowroom.scheduler import offload_plan, policy
from elbowroom.scheduler.clients import current_client, queue_cap
from elbowroom.scheduler.events import EventLog
from elbowroom.scheduler.inputs import Estimator, Measurements, ModelCatalog, default_estimator
from elbowroom.scheduler.records import InFlightRequest, Lane, Loaded, Phase
from elbowroom.scheduler.report import describe, plain
from elbowroom.scheduler.sizing import Plan, plan_load, start_options
from elbowroom.units import format_size

log = logging.getLogger("elbowroom.scheduler")

_POLL = 0.05  # seconds between probe readings while waiting for memory or busy models
_TICK = 1.0  # seconds between keep-alive checks: expiry is reported to the second anyway
# Freed memory "shows up" when this share of the evicted anonymous bytes is available
# again: other processes allocate meanwhile, and file-backed pages stay in the page cache.
_SETTLE_FRACTION = 0.9

Sleep = Callable[[float], Awaitable[None]]


class Scheduler:
    def __init__(
        self,
        settings: Settings,
        catalog: ModelCatalog,
        *,
        probe: Probe,
        runner_factory: RunnerFactory,
        measured: Measurements | None = None,
        clock: Callable[[], float] = time.monotonic,
        own_usage: Callable[[], int] | None = None,
        sleep: Sleep = asyncio.sleep,
        estimator: Estimator | None = None,
        events: EventLog | None = None,
        server_usage: Callable[[], int] | None = None,
    ) -> None:
        """``catalog``, ``measured`` and ``estimator`` default to / are the model layer's
        Catalog, MeasuredStore and ``models.estimate``; ``probe``, ``runner_factory``,
        ``clock``, ``sleep`` (waits while polling for memory) and ``own_usage`` (bytes our
        runners hold; default: the sum of their ``measure()``) are the seams tests swap.
        ``server_usage``: the server process's own anonymous bytes; they count as ours, in
        the default ``own_usage`` and against the load ceiling."""
        self.settings = settings
        self._catalog = catalog
        self._probe = probe
        self._factory = runner_factory
        self._measured = measured
        self._clock = clock
        self._own_usage = own_usage if own_usage is not None else self._runners_usage
        self._sleep = sleep
        self._server_usage = server_usage if server_usage is not None else _none
        self._last_server = 0  # the server bytes the last load decision left out
        self._estimate = estimator if estimator is not None else default_estimator()
        self._budget = budget.BudgetConfig.from_settings(settings)
        # What happened, for the dashboard's timeline (loads, unloads, evictions, crashes).
        self.events = events if events is not None else EventLog()
        self._lanes: dict[str, Lane] = {}
        self._loaded: dict[str, Loaded] = {}
        self._pins: set[str] = set(settings.pin)
        self._load_lock = asyncio.Lock()
        self._tasks: set[asyncio.Task[Any]] = set()
        self._ticker: asyncio.Task[None] | None = None
        self._loop: asyncio.AbstractEventLoop | None = None
        self._loop_thread: int | None = None
        self.loads_paused = False  # set by the pressure guard (pause_loads)
        self._inflight: dict[str, InFlightRequest] = {}
        self._request_ids = itertools.count(1)
        self._last_limit = 0  # the limit's value at the last observation, for state()
        self._last_rule = ("host", "")  # which reserve rule that limit came from, and why
        self._pools: tuple[Pool, ...] = ()  # host + GPU pools at the last observation
        # Read by the metrics module; plain ints so reading needs no lock.
        self.counters: dict[str, int] = {
            "loads": 0,
            "load_failures": 0,
            "unloads": 0,
            "evictions_load": 0,
            "evictions_keep_alive": 0,
            "evictions_pressure": 0,
            "crashes": 0,
            "restarts": 0,
            "refusals_503": 0,
            "refusals_507": 0,
        }

    # ------------------------------------------------------------------ lifecycle

    async def start(self) -> None:
        """Preload ``settings.preload`` (failures are logged, not raised) and start the
        keep-alive ticker."""
        self._bind_loop()
        for model_id in self.settings.preload:
            try:
                await self.load(model_id)
            except Exception as exc:
                log.error("preload of %s failed: %s", model_id, exc)
        self._ticker = asyncio.create_task(self._run_ticker(), name="scheduler-ticker")

    async def close(self) -> None:
        """Stop every runner (each gets ``settings.stop_grace``)."""
        if self._ticker is not None:
            self._ticker.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._ticker
        loads = [lane.load_task for lane in self._lanes.values() if lane.load_task is not None]
        for task in loads:
            task.cancel()
        await asyncio.gather(*loads, return_exceptions=True)
        stops = [self._begin_stop(rec, "close") for rec in list(self._loaded.values())]
        await asyncio.gather(*stops, return_exceptions=True)
        for task in list(self._tasks):
            task.cancel()
        await asyncio.gather(*self._tasks, return_exceptions=True)

    # ------------------------------------------------------------------ requests

    @contextlib.asynccontextmanager
    async def use(self, model_id: str, *, keep_alive: float | None = None) -> AsyncIterator[Runner]:
        """Run one request on ``model_id``'s runner, loading it first if needed.

        ``keep_alive`` (seconds) overrides how long the model stays loaded once idle:
        0 unloads it right after, negative or infinite keeps it until evicted."""
        spec = self._catalog.get(model_id)
        self._bind_loop()
        lane = self._lane(spec.id)
        if lane.slots.locked() and lane.waiting >= self.settings.queue_size:
            self.counters["refusals_503"] += 1
            retry = lane.mean_seconds * (lane.waiting + 1) / lane.width
            log.warning("queue of %s is full (%d waiting)", spec.id, lane.waiting)
            raise QueueFull(
                f"model {spec.id!r} has {lane.waiting} requests waiting "
                f"(queue_size {self.settings.queue_size}); retry later",
                retry_after=min(60.0, max(1.0, retry)),
            )
        client = current_client.get()  # set by the server only when keys tell clients apart
        if client is not None and lane.slots.locked():
            self._check_client_share(spec.id, lane, client)
        lane.waiting += 1
        if client is not None:
            lane.waiting_by[client] = lane.waiting_by.get(client, 0) + 1
        try:
            await lane.slots.acquire()
        finally:
            lane.waiting -= 1
            if client is not None:
                left = lane.waiting_by.pop(client) - 1
                if left:
                    lane.waiting_by[client] = left
        lane.claims += 1
        claimed = True
        try:
            rec = await self._ensure_loaded(spec, lane)
            lane.claims -= 1
            claimed = False
            rec.busy += 1
            started = self._clock()
            ticket = InFlightRequest(
                f"{spec.id}#{next(self._request_ids)}", spec.id, spec.kind, started
            )
            self._inflight[ticket.request_id] = ticket
            crashed = True  # until the body returns or raises something else
            try:
                yield rec.runner
                crashed = False
            except RunnerCrashed:
                raise
            except BaseException:
                crashed = False
                raise
            finally:
                rec.busy -= 1
                del self._inflight[ticket.request_id]
                self._finish(rec, lane, keep_alive, started, crashed)
        finally:
            if claimed:
                lane.claims -= 1
            lane.slots.release()

    def _check_client_share(self, model_id: str, lane: Lane, client: str) -> None:
        cap = queue_cap(self.settings.queue_size, self.settings.queue_share)
        if lane.waiting_by.get(client, 0) >= cap:
            self.counters["refusals_503"] += 1
            raise QueueFull(
                f"this API key ({client}) already has {cap} requests waiting for model "
                f"{model_id!r}; one key may hold at most {cap} of its {self.settings.queue_size} "
                "queue places (queue_share); retry when one finishes",
                retry_after=min(60.0, max(1.0, lane.mean_seconds)),
            )

    def _finish(
        self, rec: Loaded, lane: Lane, keep_alive: float | None, started: float, crashed: bool
    ) -> None:
        now = self._clock()
        lane.note_duration(now - started)
        if self._loaded.get(rec.spec.id) is not rec:
            return  # crashed or unloaded meanwhile
        rec.last_used = now
        rec.last_used_wall = time.time()
        if not crashed:
            lane.crash_streak = 0
        keep = keep_alive if keep_alive is not None else self._default_keep_alive(rec.spec)
        rec.expires_at = self._expiry(rec, keep, now)
        wanted = rec.busy > 0 or lane.claims > 0 or lane.waiting > 0
        if not wanted and rec.unload_when_idle is not None:
            self._spawn(self._begin_stop(rec, rec.unload_when_idle))
        elif not wanted and not rec.pinned and keep == 0:
            self._spawn(self._begin_stop(rec, "keep_alive"))

    def _expiry(self, rec: Loaded, keep: float, now: float) -> float | None:
        if rec.pinned or keep < 0 or math.isinf(keep):
            return None
        return now + keep

    def _default_keep_alive(self, spec: ModelSpec) -> float:
        if spec.holding is Holding.RESIDENT:
            return self.settings.resident_idle
        return self.settings.keep_alive

    # ------------------------------------------------------------------ loading

    async def _ensure_loaded(self, spec: ModelSpec, lane: Lane) -> Loaded:
        while True:
            rec = self._loaded.get(spec.id)
            if rec is not None and rec.phase is Phase.READY:
                return rec
            if rec is not None and rec.phase is Phase.STOPPING:
                await rec.stopped.wait()
                continue
            if lane.load_task is None:
                self._check_backoff(spec.id, lane)
                task = asyncio.create_task(self._load(spec, lane), name=f"load-{spec.id}")
                task.add_done_callback(_retrieve)
                lane.load_task = task
            # Shielded: a client that gives up must not abort a load others wait for.
            await asyncio.shield(lane.load_task)

    def _check_backoff(self, model_id: str, lane: Lane) -> None:
        remaining = lane.backoff_until - self._clock()
        if remaining > 0:
            self.counters["refusals_503"] += 1
            raise RunnerBackoff(
                f"model {model_id!r} failed {lane.crash_streak} times in a row "
                f"(last: {lane.last_cause}); the next restart is in {remaining:.0f} s",
                retry_after=remaining,
            )

    async def _load(self, spec: ModelSpec, lane: Lane) -> Loaded:
        try:
            async with self._load_lock:
                plan = await self._make_room(spec)
                return await self._start_runner(spec, lane, plan)
        finally:
            lane.load_task = None

    async def _make_room(self, spec: ModelSpec) -> Plan:
        """Evict or wait until ``spec`` fits; raise InsufficientMemory when it never will."""
        wait_deadline: float | None = None
        await self._wait_unpaused(spec.id)
        while True:
            await self._drain_stops()
            snap, limit = self._observe()
            # Loads are admitted up to the load ceiling, below the soft threshold: a load that
            # filled the budget would put the guard straight into a pressure episode (unloads,
            # then aborts at hard) as soon as caches and contexts grow a little.
            # The server process's own bytes (request bodies, Python) fill the same budget.
            self._last_server = self._server_usage()
            state = self._state(limit.ceiling - self._last_server)
            plan = plan_load(spec, self.settings, state, self._estimate, self._measured)
            plan = offload_plan.place_on_gpus(plan, spec, self.settings, state, self._pools)
            decision = policy.decide(state, plan.request)
            if isinstance(decision, policy.Admit):
                return plan
            if isinstance(decision, policy.Refuse):
                raise self._refusal(decision)
            if isinstance(decision, policy.Evict):
                await self._evict(decision, snap, for_model=spec.id)
                continue
            now = self._clock()
            if wait_deadline is None:
                wait_deadline = now + self.settings.load_timeout
                log.info("load of %s waits for busy model(s) %s", spec.id, decision.busy)
            if now >= wait_deadline:
                raise self._refusal(policy.refuse(state, plan.request))
            await self._sleep(_POLL)

    async def _wait_unpaused(self, model_id: str) -> None:
        if not self.loads_paused:
            return
        log.info("load of %s waits: loads are paused under memory pressure", model_id)
        deadline = self._clock() + self.settings.load_timeout
        while self.loads_paused:
            if self._clock() >= deadline:
                self.counters["refusals_503"] += 1
                raise MemoryPressure(
                    f"cannot load {model_id!r} now: loads are paused under memory pressure",
                    retry_after=10.0,
                )
            await self._sleep(_POLL)

    async def _start_runner(self, spec: ModelSpec, lane: Lane, plan: Plan) -> Loaded:
        runner = self._factory(spec, self._on_exit)
        rec = Loaded(
            spec=spec,
            runner=runner,
            predicted=plan.request.needed,
            reserved=plan.footprint.working + plan.cache_grant,
            n_ctx=plan.n_ctx,
            kv_type=plan.kv_type,
            slots=plan.slots,
            pinned=spec.id in self._pins,
            placement=plan.placement,
        )
        self._loaded[spec.id] = rec  # its predicted bytes are now a reservation
        try:
            info = await runner.start(start_options(self.settings, plan))
        except BaseException as exc:
            self._forget(rec)
            self.counters["load_failures"] += 1
            if isinstance(exc, RunnerCrashed | EngineError):
                lane.note_crash(self._clock(), str(exc), *self._backoff_range())
            log.error("load of %s failed: %s", spec.id, exc)
            self.events.add("load_failed", spec.id, f"load of {spec.id} failed: {exc}")
            if isinstance(exc, asyncio.CancelledError):
                with contextlib.suppress(Exception):
                    await runner.stop(self.settings.stop_grace)
            raise
        now = self._clock()
        rec.ready = info
        rec.phase = Phase.READY
        rec.last_used, rec.last_used_wall = now, time.time()
        rec.expires_at = self._expiry(rec, self._default_keep_alive(spec), now)
        self.counters["loads"] += 1
        if lane.crash_streak > 0:
            lane.restarts += 1
            self.counters["restarts"] += 1
        if self._measured is not None:
            self._measured.record(spec, plan.n_ctx, plan.slots, plan.kv_type, info.measured)
        self.events.add(
            "load",
            spec.id,
            f"loaded {spec.id} in {info.load_seconds:.1f} s "
            f"({format_size(info.measured.resident)})",
            bytes=info.measured.resident,
        )
        log.info(
            "loaded %s (pid %s) in %.2f s: predicted %s, measured %s "
            "(anonymous %s, file-backed %s), n_ctx %s",
            spec.id,
            info.pid,
            info.load_seconds,
            format_size(plan.footprint.total),
            format_size(info.measured.resident),
            format_size(info.measured.anonymous),
            format_size(info.measured.file_backed),
            plan.n_ctx or "-",
        )
        return rec

    def _refusal(self, refusal: policy.Refuse) -> InsufficientMemory:
        self.counters["refusals_507"] += 1
        log.warning(
            "refused %s: needs %s, available %s, evictable %s, limit %s, committed %s",
            refusal.model,
            format_size(refusal.needed),
            format_size(refusal.available),
            format_size(refusal.evictable),
            format_size(refusal.limit),
            format_size(refusal.committed),
        )
        server = self._last_server
        message = refusal.message()
        if server:
            # The policy saw the ceiling less the server's own bytes: report the ceiling
            # itself, and what the server holds of it.
            refusal = dataclasses.replace(refusal, limit=refusal.limit + server)
            bare = dataclasses.replace(refusal, suggestions=()).message()
            message = f"{bare} (the server process itself holds {format_size(server)} of it)"
            if refusal.suggestions:
                message += ": " + "; or ".join(s.message for s in refusal.suggestions)
        details = refusal.details()
        details["memory_limit"] = self._last_limit
        details["memory_rule"], details["memory_rule_why"] = self._last_rule
        details["server_usage"] = server
        return InsufficientMemory(message, code="insufficient_memory", details=details)

    # ------------------------------------------------------------------ unloading

    async def _evict(self, decision: policy.Evict, before: Snapshot, *, for_model: str) -> None:
        expected = 0
        stops = []
        for model_id in decision.ids:
            rec = self._loaded[model_id]
            mem = rec.measure() or (rec.ready.measured if rec.ready else None)
            expected += mem.anonymous if mem is not None else 0
            log.info(
                "evicting %s (%s, last used %.0f s ago) to load %s",
                model_id,
                format_size(rec.held_bytes()),
                self._clock() - rec.last_used,
                for_model,
            )
            stops.append(self._begin_stop(rec, "load"))
        gpu_expected = offload_plan.gpu_usage(
            [self._model_pools(self._loaded[i]) for i in decision.ids if i in self._loaded]
        )
        await asyncio.gather(*stops)
        await self._settle(before.available, expected)
        await self._settle_gpus(before, gpu_expected)

    async def _settle(self, before_available: int, expected: int) -> None:
        """Wait until ``expected`` freed bytes show up as available (or the deadline)."""
        target = before_available + int(expected * _SETTLE_FRACTION)
        deadline = self._clock() + self.settings.unload_settle_timeout
        while True:
            available = self._probe().available
            if available >= target:
                return
            if self._clock() >= deadline:
                log.warning(
                    "freed memory did not show up within %.1f s (available %s, expected %s)",
                    self.settings.unload_settle_timeout,
                    format_size(available),
                    format_size(target),
                )
                return
            await self._sleep(_POLL)

    async def _settle_gpus(self, before: Snapshot, expected: dict[int, int]) -> None:
        """Wait until the evicted runners' VRAM is free again in NVML (or the deadline): a
        load sized on VRAM the driver has not handed back yet would be placed short."""
        free0 = {g.index: g.free for g in before.gpus}
        want = {i: free0[i] + int(b * _SETTLE_FRACTION) for i, b in expected.items() if i in free0}
        deadline = self._clock() + self.settings.unload_settle_timeout
        while want:
            free = {g.index: g.free for g in self._probe().gpus}
            if all(free.get(i, 0) >= target for i, target in want.items()):
                return
            if self._clock() >= deadline:
                log.warning("freed VRAM did not show up within the settle timeout: %s", free)
                return
            await self._sleep(_POLL)

    def _begin_stop(self, rec: Loaded, reason: str) -> asyncio.Task[None]:
        """Mark ``rec`` STOPPING now (no await: nothing can pick it meanwhile) and stop it
        in a task; idempotent."""
        if rec.stop_task is None:
            self._remember_use(rec)
            freed = rec.held_bytes()
            rec.phase = Phase.STOPPING
            rec.stop_task = asyncio.create_task(self._stop(rec, reason, freed))
            rec.stop_task.add_done_callback(_retrieve)
        return rec.stop_task

    def _remember_use(self, rec: Loaded) -> None:
        """Record what the runner holds after serving: resident engines grow well past their
        just-loaded size on the first request (whisper: ~93 -> ~217 MiB), and the store keeps
        the larger value, so the next prediction for this model is what it really used.
        An LLM is not recorded here: what it grew into is its prompt cache, a grant, not its
        own footprint (recorded at load; docs/models.md)."""
        if self._measured is None or rec.ready is None or rec.spec.gguf is not None:
            return
        mem = rec.measure()
        if mem is not None and mem.resident > 0:
            self._measured.record(rec.spec, rec.n_ctx, rec.slots, rec.kv_type, mem)

    async def _stop(self, rec: Loaded, reason: str, freed: int) -> None:
        try:
            await rec.runner.stop(self.settings.stop_grace)
        except Exception as exc:
            log.error("stopping %s failed: %s", rec.spec.id, exc)
        finally:
            self._forget(rec)
            self.counters["unloads"] += 1
            key = f"evictions_{reason}"
            if key in self.counters:
                self.counters[key] += 1
            log.info("unloaded %s (%s): freed %s", rec.spec.id, reason, format_size(freed))
            self.events.add(
                "evict" if reason in ("load", "pressure") else "unload",
                rec.spec.id,
                f"unloaded {rec.spec.id} ({reason}): freed {format_size(freed)}",
                reason=reason,
                freed=freed,
            )

    async def _drain_stops(self) -> None:
        stops = [r.stop_task for r in self._loaded.values() if r.stop_task is not None]
        await asyncio.gather(*stops, return_exceptions=True)

    def _forget(self, rec: Loaded) -> None:
        if self._loaded.get(rec.spec.id) is rec:
            del self._loaded[rec.spec.id]
        rec.stopped.set()

    def _on_exit(self, runner: Runner, cause: str) -> None:
        """The runner's process exited on its own (crash, OOM kill, kill -9)."""
        loop = self._loop
        if loop is not None and threading.get_ident() != self._loop_thread:
            loop.call_soon_threadsafe(self._on_exit, runner, cause)
            return
        rec = self._loaded.get(runner.spec.id)
        # A stop we asked for, or a load that failed (start() raises), is handled there.
        if rec is None or rec.runner is not runner or rec.phase is not Phase.READY:
            return
        self._forget(rec)
        lane = self._lane(rec.spec.id)
        lane.note_crash(self._clock(), cause, *self._backoff_range())
        self.counters["crashes"] += 1
        self.events.add("crash", rec.spec.id, f"runner of {rec.spec.id} exited: {cause}")
        log.warning(
            "runner of %s (pid %s) exited: %s; %d in flight fail; restart %s",
            rec.spec.id,
            rec.ready.pid if rec.ready is not None else "?",
            cause,
            rec.busy,
            "on next request"
            if lane.backoff_until <= self._clock()
            else f"in {lane.backoff_until - self._clock():.0f} s",
        )

    def _backoff_range(self) -> tuple[float, float]:
        return self.settings.crash_backoff_initial, self.settings.crash_backoff_max

    # ------------------------------------------------------------------ admin API

    async def load(self, model_id: str, *, pin: bool | None = None) -> dict[str, Any]:
        """Load ``model_id`` now (no-op if loaded). ``pin`` True pins it (never evicted nor
        expired), False unpins it, None keeps its pin state (``settings.pin``)."""
        spec = self._catalog.get(model_id)
        self._bind_loop()
        if pin is True:
            self._pins.add(spec.id)
        elif pin is False:
            self._pins.discard(spec.id)
        rec = await self._ensure_loaded(spec, self._lane(spec.id))
        rec.pinned = spec.id in self._pins
        if rec.busy == 0:
            rec.expires_at = self._expiry(rec, self._default_keep_alive(spec), self._clock())
        return describe(rec, self._lanes.get(spec.id), self._clock())

    async def unload(self, model_id: str, *, reason: str = "explicit") -> dict[str, Any]:
        """Unload ``model_id`` now, or as soon as its requests in flight finish.
        ``reason`` ("explicit", "pressure") goes to the log and the eviction counters."""
        spec = self._catalog.get(model_id)
        lane = self._lanes.get(spec.id)
        if lane is not None and lane.load_task is not None:
            with contextlib.suppress(Exception):
                await asyncio.shield(lane.load_task)
        rec = self._loaded.get(spec.id)
        if rec is None:
            return {"id": spec.id, "status": "not_loaded", "freed": 0}
        if rec.busy > 0:
            rec.unload_when_idle = reason
            return {"id": spec.id, "status": "unloading_when_idle", "busy": rec.busy, "freed": 0}
        freed = rec.held_bytes()
        await self._begin_stop(rec, reason)
        return {"id": spec.id, "status": "unloaded", "freed": freed}

    async def tick(self) -> list[str]:
        """Unload the models whose keep-alive ran out; the ticker calls this every second."""
        ids = policy.expired(self._state(0), self._clock())
        await asyncio.gather(*(self._begin_stop(self._loaded[i], "keep_alive") for i in ids))
        return ids

    async def relieve_pressure(self, level: Pressure) -> list[str]:
        """Unload idle models per ``policy.relieve`` (for the pressure guard)."""
        snap, limit = self._observe()
        excess = self._own_usage() - int(limit.soft)
        ids = policy.relieve(self._state(limit.value), level, excess)
        if ids:
            log.warning(
                "%s memory pressure (available %s): unloading %s",
                level.label,
                format_size(snap.available),
                ", ".join(ids),
            )
        await asyncio.gather(*(self._begin_stop(self._loaded[i], "pressure") for i in ids))
        return ids

    def ps(self) -> list[dict[str, Any]]:
        now = self._clock()
        return [describe(rec, self._lanes.get(i), now) for i, rec in self._loaded.items()]

    def memory_report(self) -> dict[str, Any]:
        snap, limit = self._observe()
        own = self._own_usage()
        assessment = budget.assess(snap, own, limit, self._budget)
        committed = sum(rec.held_bytes() for rec in self._loaded.values())
        server = self._server_usage()
        return {
            "snapshot": plain(snap),
            "limit": budget.limit_to_dict(limit),
            "thresholds": {"soft": limit.soft, "hard": limit.hard},
            "pressure": assessment.level.label,
            "pressure_reasons": list(assessment.reasons),
            "own_usage": own,
            "committed": committed,
            "ceiling": limit.ceiling,
            "server_usage": server,
            "available": max(0, limit.ceiling - committed - server),
            "reservations": [
                {"id": rec.spec.id, "bytes": rec.predicted}
                for rec in self._loaded.values()
                if rec.phase is Phase.LOADING
            ],
            "loads_paused": self.loads_paused,
            "pools": [pool_to_dict(p) for p in self._pools],
        }

    def state(self) -> policy.State:
        """Loaded, loading and stopping models as the policy sees them (for the pressure
        guard); ``limit`` is the value at the scheduler's last memory observation."""
        return self._state(self._last_limit)

    def runner(self, model_id: str) -> Runner | None:
        """The runner of a ready model, else None."""
        rec = self._loaded.get(model_id)
        return rec.runner if rec is not None and rec.phase is Phase.READY else None

    def inflight(self) -> list[InFlightRequest]:
        """Requests running now, oldest first."""
        return sorted(self._inflight.values(), key=lambda r: r.started_at)

    def preview(self, model_id: str) -> tuple[policy.Decision, policy.LoadRequest]:
        """What a load of ``model_id`` would meet here now, without acting on it: the
        cluster (elbowroom.cluster) compares its nodes' answers to place a model."""
        spec = self._catalog.get(model_id)
        _, limit = self._observe()
        state = self._state(limit.ceiling - self._server_usage())
        plan = plan_load(spec, self.settings, state, self._estimate, self._measured)
        plan = offload_plan.place_on_gpus(plan, spec, self.settings, state, self._pools)
        return policy.decide(state, plan.request), plan.request

    def pause_loads(self, paused: bool) -> None:
        """The pressure guard pauses new loads under soft pressure; a load waits for the
        resume up to ``settings.load_timeout``, then fails with 503 MemoryPressure."""
        if paused != self.loads_paused:
            log.warning("loads %s", "paused (memory pressure)" if paused else "resumed")
        self.loads_paused = paused

    # ------------------------------------------------------------------ helpers

    def _observe(self) -> tuple[Snapshot, budget.Limit]:
        snap = self._probe()
        gpu_ours = offload_plan.gpu_usage([self._model_pools(r) for r in self._loaded.values()])
        self._pools = memory_pools(
            snap,
            self._own_usage(),
            gpu_ours,
            self._budget,
            gpu_reserve_bytes=self.settings.gpu_reserve,
            gpu_override=self.settings.override_gpu_memory,
        )
        # The host (or unified) pool's limit is budget.memory_limit's, plus the Metal wired
        # limit as a candidate on Apple Silicon.
        limit = self._pools[0].limit
        self._last_limit = limit.value
        self._last_rule = (limit.rule, limit.rule_why)
        return snap, limit

    def _model_pools(self, rec: Loaded) -> dict[str, int]:
        """Bytes ``rec`` holds per GPU pool: predicted while loading, then rescaled to what
        NVML measures for its process."""
        mem = rec.measure() if rec.phase is Phase.READY else None
        return offload_plan.model_pools(rec.placement, mem.gpu if mem is not None else None)

    def _state(self, limit: int) -> policy.State:
        models = []
        for rec in self._loaded.values():
            lane = self._lanes.get(rec.spec.id)
            claims = lane.claims if lane is not None else 0
            models.append(
                policy.ModelState(
                    id=rec.spec.id,
                    kind=rec.spec.kind,
                    holding=rec.spec.holding,
                    bytes=rec.held_bytes(),
                    pinned=rec.pinned,
                    busy=rec.busy + claims,
                    last_used=rec.last_used,
                    expires_at=rec.expires_at,
                    # Stopping models still hold their bytes and cannot be chosen again.
                    loading=rec.phase is not Phase.READY,
                    pools=self._model_pools(rec),
                )
            )
        gpu_limits = {p.name: p.ceiling for p in self._pools if p.kind == "gpu"}
        return policy.State(tuple(models), limit, gpu_limits)

    def _runners_usage(self) -> int:
        total = self._server_usage()
        for rec in self._loaded.values():
            mem = rec.measure()
            total += mem.resident if mem is not None else 0
        return total

    def _lane(self, model_id: str) -> Lane:
        lane = self._lanes.get(model_id)
        if lane is None:
            # An LLM serves ``slots`` requests at once (the engine batches them); the other
            # engines one at a time. Requests beyond that wait here, in the bounded queue.
            spec = self._catalog.get(model_id)
            width = self.settings.slots_for(model_id) if spec.kind is ModelKind.LLM else 1
            lane = self._lanes[model_id] = Lane(asyncio.Semaphore(width), width=width)
        return lane

    def _bind_loop(self) -> None:
        if self._loop is None:
            self._loop = asyncio.get_running_loop()
            self._loop_thread = threading.get_ident()

    def _spawn(self, awaitable: Awaitable[Any]) -> None:
        task = asyncio.ensure_future(awaitable)
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)

    async def _run_ticker(self) -> None:
        while True:
            await asyncio.sleep(_TICK)
            try:
                await self.tick()
            except Exception:
                log.exception("keep-alive tick failed")


def _none() -> int:
    return 0


def _retrieve(task: asyncio.Task[Any]) -> None:
    """Mark a background task's exception as seen: its awaiters (if any) got it already."""
    if not task.cancelled():
        task.exception()
