"""Residency: which models are loaded, and making room for the next one.

The one owner of the ``Loaded`` records: starting a runner (one load at a time machine-wide,
``_load_lock``: two loads sized against the same free memory would both fit on paper and
not in RAM), making room for it (size, place, ask ``policy.decide``, evict, wait for busy
models or refuse with a 507; a load that waits, for busy models or for loads paused under
pressure, waits without the lock, so it never holds up a load that fits now), stopping
runners (eviction, keep-alive, explicit unload, pressure), noticing runners that died, and
the memory picture its decisions use: a fresh sample from the monitor under the load lock,
and ``own_usage()`` (the one definition of our bytes) for the monitor in turn. After an
eviction the next decision waits until the freed memory actually shows up in the probe.

Everything runs on one asyncio event loop, so the records need no locks: a decision and
the bookkeeping that applies it happen with no ``await`` in between (a model chosen for
eviction is marked STOPPING before anything else can run). Only ``on_exit`` (runner
threads) and ``own_usage``/``gpu_usage`` (the monitor's thread) are called from elsewhere.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import math
import threading
import time
from collections.abc import Awaitable, Callable, Iterator
from dataclasses import dataclass
from typing import Any

from elbowroom.config import Settings
from elbowroom.errors import (
    EngineError,
    InsufficientMemory,
    MemoryPressure,
    RunnerCrashed,
    Unavailable,
    Unprocessable,
)
from elbowroom.memory.monitor import Monitor, Sample
from elbowroom.memory.types import Probe, ProcessMemory, Snapshot
from elbowroom.models.spec import Holding, ModelSpec
from elbowroom.models.template_check import TemplateChecker, TemplateUnsafe
from elbowroom.runtime.protocol import Runner, RunnerFactory
from elbowroom.runtime.supervisor import OOM_KILLED
from elbowroom.scheduler import offload_plan, policy, vision_gate
from elbowroom.scheduler.events import EventLog
from elbowroom.scheduler.inputs import Estimator, Measurements
from elbowroom.scheduler.lanes import Lanes
from elbowroom.scheduler.planner import budget_state, plan_and_decide
from elbowroom.scheduler.records import Lane, Loaded, Phase
from elbowroom.scheduler.refusal import insufficient_memory
from elbowroom.scheduler.settle import POLL, Settle, Sleep
from elbowroom.scheduler.sizing import Plan, start_options
from elbowroom.units import format_size

# Retry-After (s) of a load refused because loads stayed paused: a pressure episode (a
# neighbour's burst, an unload settling) is seconds long.
PAUSED_RETRY_AFTER = 5.0
PAUSED_FIT_CHECK = 1.0  # seconds between a paused load's checks that it could fit at all

__all__ = ["Residency"]

log = logging.getLogger("elbowroom.scheduler")


@dataclass(slots=True)
class _Room:
    """One load's progress across its tries: the vision gate checked, the busy-wait's end."""

    gated: bool = False
    wait_deadline: float | None = None
    busy: frozenset[str] = frozenset()  # the busy models it waits for (drained meanwhile)


class Residency:
    def __init__(
        self,
        settings: Settings,
        lanes: Lanes,
        *,
        probe: Probe,
        runner_factory: RunnerFactory,
        measured: Measurements | None,
        clock: Callable[[], float],
        sleep: Sleep,
        estimator: Estimator,
        events: EventLog,
        counters: dict[str, int],
        server_usage: Callable[[], int],
        when_idle: Callable[[], object] | None = None,
    ) -> None:
        self.settings = settings
        self._lanes = lanes
        self._probe = probe
        self._factory = runner_factory
        self._templates: TemplateChecker | None = None  # made on the first check
        self._stopped_loads: dict[str, str] = {}  # model id -> why its load was stopped
        self._measured = measured
        self._clock = clock
        self._sleep = sleep
        self._estimate = estimator
        self.events = events
        self.counters = counters
        # The server process's own anonymous bytes: ours, and against the load ceiling.
        self.server_usage = server_usage
        # Run (in a worker thread) each time the last runner has gone: the server gives
        # its free heap back then (memory.heap.trim, ``trim_when_idle``).
        self._when_idle = when_idle
        self.last_server = 0  # the server bytes the last decision left out
        self._last: Sample | None = None  # the memory picture at the last decision
        self.monitor = Monitor.from_settings(
            settings, probe, own_usage=self.own_usage, own_gpu=self.gpu_usage, clock=clock
        )
        self.loaded: dict[str, Loaded] = {}
        self.pins: set[str] = set(settings.pin)
        # Loads planned elsewhere (``Scheduler.host``: a cluster node's share of a split
        # model): sized by their plan, not by the estimate, and never recorded as measured.
        self.planned: dict[str, Plan] = {}
        # The context a request asked a model to be loaded with (Ollama's num_ctx,
        # ``Scheduler.fit_context``): it sizes the model's loads until the model is unloaded.
        self.ctx_wanted: dict[str, int] = {}
        # Whether loads are paused under memory pressure: the pressure guard's answer, read
        # each time (``Scheduler.follow_pause``; the guard owns it, nothing here copies it).
        self.paused_by: Callable[[], bool] = _never
        # A decision's one reading of each runner (``one_reading``), per thread: the
        # monitor's sampling thread measures on its own.
        self._reading = threading.local()
        # Loads waiting for busy models -> those models: no new request starts on them
        # until the load is done, so a model in steady use cannot starve the load.
        self._waits_for: dict[str, frozenset[str]] = {}
        self._load_lock = asyncio.Lock()
        self._tasks: set[asyncio.Task[Any]] = set()
        self._loop: asyncio.AbstractEventLoop | None = None
        self._loop_thread: int | None = None

    @property
    def loads_paused(self) -> bool:
        """Whether the pressure guard pauses new loads now (``paused_by``)."""
        return self.paused_by()

    def bind_loop(self) -> None:
        if self._loop is None:
            self._loop = asyncio.get_running_loop()
            self._loop_thread = threading.get_ident()

    async def close(self) -> None:
        """Cancel loads in progress, stop every runner and the stops started on release."""
        loads = [lane.load_task for lane in self._lanes if lane.load_task is not None]
        for task in loads:
            task.cancel()
        await asyncio.gather(*loads, return_exceptions=True)
        stops = [self.begin_stop(rec, "close") for rec in list(self.loaded.values())]
        await asyncio.gather(*stops, return_exceptions=True)
        for task in list(self._tasks):
            task.cancel()
        await asyncio.gather(*self._tasks, return_exceptions=True)

    # ------------------------------------------------------------------ keep-alive

    def release(
        self, rec: Loaded, lane: Lane, keep_alive: float | None, started: float, crashed: bool
    ) -> None:
        """A request on ``rec`` ended: note its time, reset the crash streak unless it
        crashed, set the keep-alive expiry, and stop the runner when nothing wants it and an
        unload was asked for meanwhile or ``keep_alive`` is 0."""
        now = self._clock()
        lane.note_duration(now - started)
        if self.loaded.get(rec.spec.id) is not rec:
            return  # crashed or unloaded meanwhile
        rec.last_used = now
        rec.last_used_wall = time.time()
        if not crashed:
            lane.crash_streak = 0
        keep = keep_alive if keep_alive is not None else self.default_keep_alive(rec.spec)
        rec.expires_at = self.expiry(rec, keep, now)
        wanted = rec.busy > 0 or lane.claims > 0 or lane.waiting > 0
        if not wanted and rec.unload_when_idle is not None:
            self._spawn(self.begin_stop(rec, rec.unload_when_idle))
        elif not wanted and not rec.pinned and keep == 0:
            self._spawn(self.begin_stop(rec, "keep_alive"))

    def expiry(self, rec: Loaded, keep: float, now: float) -> float | None:
        if rec.pinned or keep < 0 or math.isinf(keep):
            return None
        return now + keep

    def default_keep_alive(self, spec: ModelSpec) -> float:
        if spec.holding is Holding.RESIDENT:
            return self.settings.resident_idle
        return self.settings.keep_alive

    # ------------------------------------------------------------------ loading

    async def ensure_loaded(self, spec: ModelSpec, lane: Lane) -> Loaded:
        while True:
            rec = self.loaded.get(spec.id)
            if rec is not None and rec.phase is Phase.READY:
                return rec
            if rec is not None and rec.phase is Phase.STOPPING:
                await rec.stopped.wait()
                continue
            if lane.load_task is None:
                self._lanes.check_backoff(spec.id, lane)
                task = asyncio.create_task(self._load(spec, lane), name=f"load-{spec.id}")
                task.add_done_callback(retrieve)
                lane.load_task = task
            # Shielded: a client that gives up must not abort a load others wait for.
            await asyncio.shield(lane.load_task)

    async def _load(self, spec: ModelSpec, lane: Lane) -> Loaded:
        """Load ``spec``: one load at a time makes room and starts its runner, but a load
        that has to wait (loads paused under pressure, busy models in the way) waits
        *without* the load lock, so it never holds up a load that fits now."""
        room = _Room()
        try:
            await self._check_template(spec)
            while True:
                await self._wait_unpaused(spec)
                async with self._load_lock:
                    if self.loads_paused:  # paused while this load queued for the lock
                        continue
                    plan = await self._make_room(spec, room)
                    if plan is not None:
                        return await self._start_runner(spec, lane, plan)
                self._waits_for[spec.id] = room.busy
                await self._sleep(POLL)  # waiting for busy models, the lock released
        finally:
            self._waits_for.pop(spec.id, None)
            lane.load_task = None

    async def _check_template(self, spec: ModelSpec) -> None:
        """Render the GGUF's chat template in a bounded child process first (once per file
        version): a template that loops, recurses or grows without end is a 422, and no
        runner starts (models/template_check.py)."""
        s = self.settings
        if not s.chat_template_check or spec.gguf is None or not spec.gguf.has_chat_template:
            return
        if self._templates is None:
            self._templates = TemplateChecker(
                s.chat_template_check_seconds, s.chat_template_check_memory
            )
        try:
            await asyncio.to_thread(self._templates.check, spec.path, spec.id)
        except TemplateUnsafe as exc:
            self.counters["load_failures"] += 1
            log.error("load of %s refused: %s", spec.id, exc)
            self.events.add("load_failed", spec.id, f"load of {spec.id} refused: {exc}")
            raise

    def draining(self, model_id: str) -> bool:
        """Whether a load waits for ``model_id`` to go idle (new requests on it wait)."""
        return any(model_id in busy for busy in self._waits_for.values())

    async def wait_drained(self, model_id: str) -> None:
        """Before a request starts on a loaded model: wait while a load waits for that model
        to go idle. The wait ends when the load does (loaded, or refused at
        ``load_timeout``); the request then finds its model loaded or loads it again."""
        while self.draining(model_id):
            rec = self.loaded.get(model_id)
            if rec is None or rec.phase is not Phase.READY:
                return  # evicted meanwhile: ensure_loaded loads it again
            await self._sleep(POLL)

    async def _make_room(self, spec: ModelSpec, room: _Room | None = None) -> Plan | None:
        """Evict until ``spec`` fits and return its plan; None when it has to wait for busy
        models (the caller sleeps without the load lock and asks again); raise
        InsufficientMemory when it never will or the wait passed ``load_timeout``."""
        room = room if room is not None else _Room()
        while True:
            await self.drain_stops()
            sample, state, plan, decision = self.consider(spec)
            if not room.gated:  # the vision gate: 507 for a vision model above it, else a warning
                room.gated = True
                try:
                    vision_gate.check(spec, plan, self.settings, sample.limit.value)
                except InsufficientMemory:
                    self.counters["refusals_507"] += 1
                    raise
            if isinstance(decision, policy.Admit):
                return plan
            if isinstance(decision, policy.Refuse):
                raise self._refusal(decision)
            if isinstance(decision, policy.Evict):
                snap = sample.snapshot
                freed = await self._evict(decision, snap, for_model=spec.id)
                if spec.vision:
                    await self._settle().vision(
                        spec.id,
                        plan.request.needed,
                        snap.available,
                        freed,
                        self.settings.vision_settle_factor,
                    )
                continue
            now = self._clock()
            room.busy = frozenset(decision.busy)
            if room.wait_deadline is None:
                room.wait_deadline = now + self.settings.load_timeout
                log.info("load of %s waits for busy model(s) %s", spec.id, decision.busy)
            if now >= room.wait_deadline:
                raise self._refusal(policy.refuse(state, plan.request))
            return None

    def consider(self, spec: ModelSpec) -> tuple[Sample, policy.State, Plan, policy.Decision]:
        """A fresh memory picture and what a load of ``spec`` would meet in it now: the
        plan and the policy's decision, with nothing acted on."""
        with self.one_reading():
            sample = self.observe()
            state = self.state()
        planned = self.planned.get(spec.id)
        if planned is not None:
            return sample, state, planned, policy.decide(state, planned.request)
        plan, decision = plan_and_decide(
            spec,
            self.settings,
            state,
            sample.pools,
            self._estimate,
            self._measured,
            sample.limit.value,
            self.ctx_wanted.get(spec.id),
        )
        return sample, state, plan, decision

    async def _wait_unpaused(self, spec: ModelSpec) -> None:
        """Wait while loads are paused under memory pressure, at most ``load_pause_wait``
        seconds, then 503 with a Retry-After: a client retries a little later instead of
        holding its request open through the whole episode. A load that could not fit now
        even with every idle model evicted (the memory is others', not ours to give) is the
        507 it would be without the guard, at once: the pause would only make its client
        wait 15 s for the same answer (the fast chaos run: clients held on such loads while
        a neighbour held the cgroup, their requests for loaded models never sent)."""
        if not self.loads_paused:
            return
        model_id = spec.id
        log.info("load of %s waits: loads are paused under memory pressure", model_id)
        now = self._clock()
        deadline = now + self.settings.load_pause_wait
        fit_check = now
        while self.loads_paused:
            if self._clock() >= fit_check:
                fit_check = self._clock() + PAUSED_FIT_CHECK
                decision = self.consider(spec)[3]
                if isinstance(decision, policy.Refuse):
                    log.info("load of %s cannot fit while paused: refused now", model_id)
                    raise self._refusal(decision)
            if self._clock() >= deadline:
                self.counters["refusals_503"] += 1
                raise MemoryPressure(
                    f"cannot load {model_id!r} now: loads are paused under memory pressure",
                    retry_after=PAUSED_RETRY_AFTER,
                )
            await self._sleep(POLL)

    async def _start_runner(self, spec: ModelSpec, lane: Lane, plan: Plan) -> Loaded:
        runner = self._factory(spec, self.on_exit)
        rec = Loaded(
            spec=spec,
            runner=runner,
            predicted=plan.request.needed,
            reserved=plan.footprint.working + plan.cache_grant,
            n_ctx=plan.n_ctx,
            kv_type=plan.kv_type,
            slots=plan.slots,
            pinned=spec.id in self.pins,
            placement=plan.placement,
        )
        self.loaded[spec.id] = rec  # its predicted bytes are now a reservation
        try:
            info = await runner.start(start_options(self.settings, spec, plan))
        except BaseException as exc:
            self.forget(rec)
            self.counters["load_failures"] += 1
            stopped = self._stopped_loads.pop(spec.id, None)
            # A load that hung until load_timeout (a chat template that loops while the
            # model loads) backs off like a crash: not a new runner for every request.
            # A load the guard stopped does not: the model is not at fault.
            if stopped is None and (
                isinstance(exc, RunnerCrashed | EngineError | Unprocessable)
                or (isinstance(exc, Unavailable) and exc.code == "load_timeout")
            ):
                self._lanes.note_crash(lane, str(exc))
            log.error("load of %s failed: %s", spec.id, stopped or exc)
            self.events.add("load_failed", spec.id, f"load of {spec.id} failed: {stopped or exc}")
            if isinstance(exc, asyncio.CancelledError):
                with contextlib.suppress(Exception):
                    await runner.stop(self.settings.stop_grace)
            elif stopped is not None:
                self.counters["refusals_503"] += 1
                raise MemoryPressure(
                    f"the load of {spec.id!r} was stopped: {stopped}; retry when memory "
                    "is free again",
                    retry_after=10.0,
                    code="load_stopped",
                ) from exc
            raise
        now = self._clock()
        rec.ready = info
        rec.phase = Phase.READY
        rec.last_used, rec.last_used_wall = now, time.time()
        rec.expires_at = self.expiry(rec, self.default_keep_alive(spec), now)
        self.counters["loads"] += 1
        if lane.crash_streak > 0:
            lane.restarts += 1
            self.counters["restarts"] += 1
        if self._measured is not None and spec.id not in self.planned:
            # A file write and fsync: off the event loop, where every stream waits on it.
            await asyncio.to_thread(
                self._measured.record, spec, plan.n_ctx, plan.slots, plan.kv_type, info.measured
            )
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

    async def stop_load(self, model_id: str, cause: str) -> Loaded | None:
        """Kill the runner of ``model_id``'s load in progress (the pressure guard at hard:
        a loading runner that grows past every budget). The requests waiting on the load
        get a 503 with Retry-After naming ``cause``; it does not count toward the crash
        backoff. Returns the record whose load was stopped, None when none was loading."""
        rec = self.loaded.get(model_id)
        if rec is None or rec.phase is not Phase.LOADING:
            return None
        self._stopped_loads[model_id] = cause
        log.warning("stopping the load of %s (pid %s): %s", model_id, rec.runner.pid, cause)
        # No grace: a runner that is loading reads no stop message (SIGTERM, then SIGKILL).
        await rec.runner.stop(0.0)
        return rec

    def refusal(self, refusal: policy.Refuse) -> InsufficientMemory:
        """The 507 for ``refusal``, counted."""
        return self._refusal(refusal)

    def _refusal(self, refusal: policy.Refuse) -> InsufficientMemory:
        self.counters["refusals_507"] += 1
        limit = self._last.limit if self._last is not None else None
        return insufficient_memory(refusal, self.last_server, limit)

    # ------------------------------------------------------------------ unloading

    async def _evict(self, decision: policy.Evict, before: Snapshot, *, for_model: str) -> int:
        """Stop ``decision.ids`` and wait for their memory; returns the anonymous bytes
        expected back."""
        expected = 0
        stops = []
        for model_id in decision.ids:
            rec = self.loaded[model_id]
            now = rec.measure()
            mem = now or (rec.ready.measured if rec.ready else None)
            expected += mem.anonymous if mem is not None else 0
            log.info(
                "evicting %s (%s, last used %.0f s ago) to load %s",
                model_id,
                format_size(rec.held_bytes(now)),
                self._clock() - rec.last_used,
                for_model,
            )
            stops.append(self.begin_stop(rec, "load"))
        gpu_expected = offload_plan.gpu_usage(
            [self._model_pools(self.loaded[i]) for i in decision.ids if i in self.loaded]
        )
        await asyncio.gather(*stops)
        waiter = self._settle()
        await waiter.host(before.available, expected)
        await waiter.gpus(before, gpu_expected)
        return expected

    def _settle(self) -> Settle:
        return Settle(self._probe, self._clock, self._sleep, self.settings.unload_settle_timeout)

    def begin_stop(self, rec: Loaded, reason: str) -> asyncio.Task[None]:
        """Mark ``rec`` STOPPING now (no await: nothing can pick it meanwhile) and stop it
        in a task; idempotent."""
        if rec.stop_task is None:
            self._remember_use(rec)
            freed, gpu = self._held(rec)
            rec.phase = Phase.STOPPING
            rec.stop_task = asyncio.create_task(self._stop(rec, reason, freed, gpu))
            rec.stop_task.add_done_callback(retrieve)
        return rec.stop_task

    def _remember_use(self, rec: Loaded) -> None:
        """Record what the runner holds after serving: resident engines grow well past their
        just-loaded size on the first request (whisper: ~93 -> ~217 MiB), and the store keeps
        the larger value, so the next prediction for this model is what it really used.
        An LLM is not recorded here: what it grew into is its prompt cache, a grant, not its
        own footprint (recorded at load; docs/models.md)."""
        if (
            self._measured is None
            or rec.ready is None
            or rec.spec.gguf is not None
            or rec.spec.mlx is not None
        ):
            return
        if rec.spec.id in self.planned:
            return
        mem = rec.measure()
        if mem is not None and mem.resident > 0:
            self._measured.record(rec.spec, rec.n_ctx, rec.slots, rec.kv_type, mem)

    async def _stop(self, rec: Loaded, reason: str, freed: int, gpu: dict[str, int]) -> None:
        try:
            await rec.runner.stop(self.settings.stop_grace)
        except Exception as exc:
            log.error("stopping %s failed: %s", rec.spec.id, exc)
        finally:
            self.forget(rec)
            self.counters["unloads"] += 1
            key = f"evictions_{reason}"
            if key in self.counters:
                self.counters[key] += 1
            # Host bytes, then each GPU pool's own: a GPU model's VRAM is not host memory.
            what = ", ".join(
                [f"{format_size(freed)} host"]
                + [f"{format_size(b)} {pool}" for pool, b in sorted(gpu.items()) if b > 0]
            )
            log.info("unloaded %s (%s): freed %s", rec.spec.id, reason, what)
            self.events.add(
                "evict" if reason in ("load", "pressure") else "unload",
                rec.spec.id,
                f"unloaded {rec.spec.id} ({reason}): freed {what}",
                reason=reason,
                freed=freed,
                **({"freed_pools": gpu} if gpu else {}),
            )

    async def drain_stops(self) -> None:
        stops = [r.stop_task for r in self.loaded.values() if r.stop_task is not None]
        await asyncio.gather(*stops, return_exceptions=True)

    def forget(self, rec: Loaded) -> None:
        if self.loaded.get(rec.spec.id) is rec:
            del self.loaded[rec.spec.id]
            self.ctx_wanted.pop(rec.spec.id, None)  # the next load is sized afresh
            if not self.loaded:
                self._went_idle()
        rec.stopped.set()

    def _went_idle(self) -> None:
        if self._when_idle is None:
            return
        try:
            asyncio.get_running_loop()
        except RuntimeError:  # called outside the loop (no server running)
            self._when_idle()
            return
        self._spawn(asyncio.to_thread(self._when_idle))

    def on_exit(self, runner: Runner, cause: str) -> None:
        """The runner's process exited on its own (crash, OOM kill, kill -9)."""
        loop = self._loop
        if loop is not None and threading.get_ident() != self._loop_thread:
            loop.call_soon_threadsafe(self.on_exit, runner, cause)
            return
        rec = self.loaded.get(runner.spec.id)
        # A stop we asked for, or a load that failed (start() raises), is handled there.
        if rec is None or rec.runner is not runner or rec.phase is not Phase.READY:
            return
        self.forget(rec)
        lane = self._lanes.lane(rec.spec.id)
        self._lanes.note_crash(lane, cause)
        self.counters["crashes"] += 1
        oom = cause.startswith(OOM_KILLED)
        if oom:
            self.counters["oom_kills"] += 1
            lane.oom_kills += 1
        self.events.add(
            "oom_kill" if oom else "crash", rec.spec.id, f"runner of {rec.spec.id} exited: {cause}"
        )
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

    # ------------------------------------------------------------------ memory picture

    def observe(self) -> Sample:
        """A fresh memory picture from the monitor; the policy's limits follow it."""
        self.last_server = self.server_usage()
        self._last = self.monitor.read()
        return self._last

    @contextlib.contextmanager
    def one_reading(self) -> Iterator[None]:
        """Within it each runner's /proc tree and NVML are read at most once: a decision's
        sample (``own_usage``, ``gpu_usage``) and its ``state`` see the same bytes, and the
        reading is not repeated three times."""
        outer = getattr(self._reading, "memo", None)
        if outer is None:
            self._reading.memo = {}
        try:
            yield
        finally:
            if outer is None:
                self._reading.memo = None

    def _measure(self, rec: Loaded) -> ProcessMemory | None:
        memo: dict[int, ProcessMemory | None] | None = getattr(self._reading, "memo", None)
        if memo is None:
            return rec.measure()
        if id(rec) not in memo:
            memo[id(rec)] = rec.measure()
        return memo[id(rec)]

    def own_usage(self) -> int:
        """Bytes that are ours: what our runners hold now plus the server process's own
        anonymous bytes. The one definition; the monitor samples it (from its thread, so
        the records are copied before they are read)."""
        total = self.server_usage()
        for rec in list(self.loaded.values()):
            mem = self._measure(rec)
            total += mem.resident if mem is not None else 0
        return total

    def gpu_usage(self) -> dict[int, int]:
        """Our bytes per GPU index (for the monitor's GPU pools)."""
        return offload_plan.gpu_usage([self._model_pools(r) for r in list(self.loaded.values())])

    def _model_pools(self, rec: Loaded, now: ProcessMemory | None = None) -> dict[str, int]:
        """Bytes ``rec`` holds per GPU pool: predicted while loading, then rescaled to what
        NVML measures for its process. ``now``: a measurement the caller already took."""
        mem = None
        if rec.phase is Phase.READY:
            mem = now if now is not None else self._measure(rec)
        return offload_plan.model_pools(rec.placement, mem.gpu if mem is not None else None)

    def _held(self, rec: Loaded) -> tuple[int, dict[str, int]]:
        """``rec``'s committed host bytes and its bytes per GPU pool, from one measurement
        (each reads the runner's /proc tree and NVML)."""
        loaded = rec.phase is not Phase.LOADING and rec.ready is not None
        now = self._measure(rec) if loaded else None
        return rec.held_bytes(now), self._model_pools(rec, now)

    def state(self) -> policy.State:
        """The policy's picture. ``State.limit`` is always the load ceiling of the last
        observation less the server process's own bytes: loads are admitted up to the
        ceiling, below the soft threshold (a load that filled the budget would start a
        pressure episode as soon as caches and contexts grow a little), and the server's
        bytes (request bodies, Python) fill the same budget. 0 before any observation."""
        models = []
        for rec in self.loaded.values():
            claims = self._lanes.claims(rec.spec.id)
            held, pools = self._held(rec)
            models.append(
                policy.ModelState(
                    id=rec.spec.id,
                    kind=rec.spec.kind,
                    holding=rec.spec.holding,
                    bytes=held,
                    pinned=rec.pinned,
                    busy=rec.busy + claims,
                    last_used=rec.last_used,
                    expires_at=rec.expires_at,
                    # Stopping models still hold their bytes and cannot be chosen again.
                    loading=rec.phase is not Phase.READY,
                    pools=pools,
                )
            )
        last = self._last
        if last is None:
            return policy.State(tuple(models), 0)
        return budget_state(models, last.limit.ceiling, last.pools, self.last_server)

    def _spawn(self, awaitable: Awaitable[Any]) -> None:
        task = asyncio.ensure_future(awaitable)
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)


def no_server_bytes() -> int:
    return 0


def _never() -> bool:
    return False  # no pressure guard: loads are never paused


def retrieve(task: asyncio.Task[Any]) -> None:
    """Mark a background task's exception as seen: its awaiters (if any) got it already."""
    if not task.cancelled():
        task.exception()
