"""The scheduler: the single owner of which models are loaded, and why.

Its capabilities live in their own modules; this class wires them together and is the one
surface the server, the CLI and the pressure guard use:

- ``lanes.Lanes``: queues, concurrency slots, crash backoff and Retry-After per model;
- ``residency.Residency``: the loaded records, making room (size, place, decide, evict,
  settle, refuse), starting and stopping runners, crashes, keep-alive, and the memory
  picture its decisions read from the monitor;
- ``report``: the JSON views (``ps``, ``memory_report``);
- the pure rules: ``policy`` (decide, refuse, expiry), ``sizing`` / ``offload_plan`` /
  ``planner`` (what a load costs and where it goes).

Everything runs on one asyncio event loop, so the state needs no locks (residency.py says
which calls come from other threads).
"""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import logging
import time
from collections.abc import AsyncIterator, Callable
from typing import Any

from elbowroom.config import Settings
from elbowroom.errors import InsufficientMemory, RunnerCrashed, Unavailable
from elbowroom.memory.heap import trim
from elbowroom.memory.monitor import Monitor
from elbowroom.memory.types import Probe
from elbowroom.models.estimate import context_cap
from elbowroom.runtime.protocol import Runner, RunnerFactory
from elbowroom.scheduler import policy, report
from elbowroom.scheduler.events import EventLog
from elbowroom.scheduler.inputs import Estimator, Measurements, ModelCatalog, default_estimator
from elbowroom.scheduler.lanes import Lanes
from elbowroom.scheduler.records import InFlightRequest, Lane, Loaded, Phase
from elbowroom.scheduler.residency import Residency, no_server_bytes
from elbowroom.scheduler.settle import Sleep
from elbowroom.scheduler.sizing import Plan, has_context

log = logging.getLogger("elbowroom.scheduler")

_TICK = 1.0  # seconds between keep-alive checks: expiry is reported to the second anyway


def _counters() -> dict[str, int]:
    # Read by the metrics module; plain ints so reading needs no lock.
    names = (
        "loads",
        "load_failures",
        "unloads",
        "evictions_load",
        "evictions_keep_alive",
        "evictions_pressure",
        "crashes",
        "restarts",
        "oom_kills",
        "refusals_503",
        "refusals_507",
    )
    return dict.fromkeys(names, 0)


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
        sleep: Sleep = asyncio.sleep,
        estimator: Estimator | None = None,
        events: EventLog | None = None,
        server_usage: Callable[[], int] | None = None,
        when_idle: Callable[[], object] | None = None,
    ) -> None:
        """``catalog``, ``measured`` and ``estimator`` default to / are the model layer's
        Catalog, MeasuredStore and ``models.estimate``; ``probe``, ``runner_factory``,
        ``clock`` and ``sleep`` (waits while polling for memory) are the seams tests swap.
        ``server_usage``: the server process's own anonymous bytes; they count as ours
        (``Residency.own_usage()``) and against the load ceiling. ``when_idle`` runs in a worker
        thread each time the last runner has stopped; by default (``trim_when_idle``) the
        server's free C heap goes back to the OS then (``memory.heap.trim``).

        The scheduler builds the memory ``monitor`` (the one owner of the limit) over
        ``probe`` and its own usage; the server starts its sampling thread."""
        self.settings = settings
        self._catalog = catalog
        self._clock = clock
        self.counters = _counters()
        # What happened, for the dashboard's timeline (loads, unloads, evictions, crashes).
        self.events = events if events is not None else EventLog()
        self.lanes = Lanes(settings, catalog, clock, self.counters)
        self.residency = Residency(
            settings,
            self.lanes,
            probe=probe,
            runner_factory=runner_factory,
            measured=measured,
            clock=clock,
            sleep=sleep,
            estimator=estimator if estimator is not None else default_estimator(),
            events=self.events,
            counters=self.counters,
            server_usage=server_usage if server_usage is not None else no_server_bytes,
            when_idle=when_idle if when_idle is not None or not settings.trim_when_idle else trim,
        )
        self._inflight: dict[str, InFlightRequest] = {}
        self._request_ids = itertools.count(1)
        self._ticker: asyncio.Task[None] | None = None

    @property
    def monitor(self) -> Monitor:
        """The memory monitor: the one owner of the limit (the server runs its thread)."""
        return self.residency.monitor

    @property
    def loads_paused(self) -> bool:
        return self.residency.loads_paused

    # ------------------------------------------------------------------ lifecycle

    async def start(self) -> None:
        """Preload ``settings.preload`` (failures are logged, not raised) and start the
        keep-alive ticker."""
        self.residency.bind_loop()
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
        await self.residency.close()

    # ------------------------------------------------------------------ requests

    @contextlib.asynccontextmanager
    async def use(self, model_id: str, *, keep_alive: float | None = None) -> AsyncIterator[Runner]:
        """Run one request on ``model_id``'s runner, loading it first if needed.

        ``keep_alive`` (seconds) overrides how long the model stays loaded once idle:
        0 unloads it right after, negative or infinite keeps it until evicted."""
        spec = self._catalog.get(model_id)
        self.residency.bind_loop()
        async with self.lanes.slot(spec.id) as lane:
            # A load waiting for this model to go idle goes first (unclaimed meanwhile, so
            # the model can go idle): a model in steady use never starves another's load.
            await self.residency.wait_drained(spec.id)
            lane.claims += 1
            claimed = True
            try:
                rec = await self.residency.ensure_loaded(spec, lane)
                lane.claims -= 1
                claimed = False
                async with self._serving(rec, lane, keep_alive) as runner:
                    yield runner
            finally:
                if claimed:
                    lane.claims -= 1

    @contextlib.asynccontextmanager
    async def hold(
        self, model_id: str, *, keep_alive: float | None = None
    ) -> AsyncIterator[Runner]:
        """Run one request on ``model_id``'s runner when it is loaded, never loading it
        (503 otherwise): a node's share of a model split over a cluster is loaded only with
        its split's plan (``host``), so a request that finds it gone must not start a share
        nobody uses. Busy, in flight, last used and keep-alive are kept as by ``use``."""
        spec = self._catalog.get(model_id)
        async with self.lanes.slot(spec.id) as lane:
            rec = self.residency.loaded.get(spec.id)
            if rec is None or rec.phase is not Phase.READY:
                raise Unavailable(
                    f"{spec.id} is not loaded on this node (it is being unloaded); retry",
                    retry_after=1.0,
                )
            async with self._serving(rec, lane, keep_alive) as runner:
                yield runner

    @contextlib.asynccontextmanager
    async def _serving(
        self, rec: Loaded, lane: Lane, keep_alive: float | None
    ) -> AsyncIterator[Runner]:
        """One request on the loaded ``rec``: busy and in flight while it runs, then
        released (last used, keep-alive, crash streak)."""
        spec = rec.spec
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
            self.residency.release(rec, lane, keep_alive, started, crashed)

    # ------------------------------------------------------------------ admin API

    async def load(self, model_id: str, *, pin: bool | None = None) -> dict[str, Any]:
        """Load ``model_id`` now (no-op if loaded). ``pin`` True pins it (never evicted nor
        expired), False unpins it, None keeps its pin state (``settings.pin``)."""
        spec = self._catalog.get(model_id)
        res = self.residency
        res.bind_loop()
        if pin is True:
            res.pins.add(spec.id)
        elif pin is False:
            res.pins.discard(spec.id)
        rec = await res.ensure_loaded(spec, self.lanes.lane(spec.id))
        rec.pinned = spec.id in res.pins
        if rec.busy == 0:
            rec.expires_at = res.expiry(rec, res.default_keep_alive(spec), self._clock())
        return report.describe(rec, self.lanes.get(spec.id), self._clock())

    async def host(self, model_id: str, plan: Plan, *, pin: bool | None = None) -> dict[str, Any]:
        """Load ``model_id`` with a plan made elsewhere: a node's share of a model split over
        a cluster (elbowroom.cluster.share), whose bytes the cluster's split plan predicts.
        The same budget as any load: its predicted bytes are reserved while it starts, idle
        models are evicted by the same order to make room, a share that cannot fit is a 507;
        once started it is measured, listed, unloaded and aborted like any model. It is
        never recorded in the measured store (it is not a whole model)."""
        self.residency.planned[model_id] = plan
        return await self.load(model_id, pin=pin)

    async def fit_context(self, model_id: str, n_ctx: int) -> dict[str, Any]:
        """Have ``model_id`` loaded with at least ``n_ctx`` tokens of context per slot
        (Ollama's ``num_ctx``), capped at its trained context; its ps row.

        Loaded with that much or more: nothing changes. Loaded with less: if the larger
        context fits the budget once the model's own bytes are freed (idle models may be
        evicted), the model is reloaded at ``n_ctx`` as soon as its requests in flight and
        queued finish (never cut: until then they run on the old runner; the KV disk tier
        saves its slots on the way out); else the 507 with the numbers, the model untouched.
        Not loaded: loaded at ``n_ctx``, the 507 when it cannot fit. The asked context sizes
        the model's loads until it is unloaded. A reload that waits longer than
        ``settings.load_timeout`` for the model's requests is a 503 (retry)."""
        spec = self._catalog.get(model_id)
        res = self.residency
        res.bind_loop()
        cap = context_cap(spec, None)
        want = min(n_ctx, cap) if cap else n_ctx
        if not has_context(spec) or spec.id in res.planned:
            return await self.load(spec.id)  # no context, or a cluster share's (its plan's)
        lane = self.lanes.lane(spec.id)
        while True:
            if lane.load_task is not None:
                with contextlib.suppress(Exception):
                    await asyncio.shield(lane.load_task)
            rec = res.loaded.get(spec.id)
            if rec is None:
                break
            if rec.phase is Phase.READY and rec.n_ctx >= want:
                return report.describe(rec, lane, self._clock())
            if rec.phase is Phase.READY:
                # decide() leaves the model's own bytes out: they go with the old runner.
                res.ctx_wanted[spec.id] = want
                try:
                    _, _, _, decision = res.consider(spec)
                finally:
                    res.ctx_wanted.pop(spec.id, None)
                if isinstance(decision, policy.Refuse):
                    raise res.refusal(decision)
                log.info("reloading %s at n_ctx %d (was %d)", spec.id, want, rec.n_ctx)
                if rec.busy == 0 and lane.claims == 0 and lane.waiting == 0:
                    res.begin_stop(rec, "reload")
                else:
                    rec.unload_when_idle = "reload"
            try:
                await asyncio.wait_for(rec.stopped.wait(), self.settings.load_timeout)
            except TimeoutError:
                raise Unavailable(
                    f"{spec.id} is to be reloaded with a {want}-token context once its "
                    "requests in flight finish, and they have not yet; retry",
                    retry_after=5.0,
                ) from None
        res.ctx_wanted[spec.id] = want
        try:
            await res.ensure_loaded(spec, lane)
        except InsufficientMemory:
            res.ctx_wanted.pop(spec.id, None)
            raise
        return await self.load(spec.id)

    async def unload(self, model_id: str, *, reason: str = "explicit") -> dict[str, Any]:
        """Unload ``model_id`` now, or as soon as its requests in flight finish.
        ``reason`` ("explicit", "pressure") goes to the log and the eviction counters."""
        spec = self._catalog.get(model_id)
        lane = self.lanes.get(spec.id)
        if lane is not None and lane.load_task is not None:
            with contextlib.suppress(Exception):
                await asyncio.shield(lane.load_task)
        rec = self.residency.loaded.get(spec.id)
        if rec is None:
            return {"id": spec.id, "status": "not_loaded", "freed": 0}
        if rec.busy > 0:
            rec.unload_when_idle = reason
            return {"id": spec.id, "status": "unloading_when_idle", "busy": rec.busy, "freed": 0}
        freed = rec.held_bytes()
        await self.residency.begin_stop(rec, reason)
        return {"id": spec.id, "status": "unloaded", "freed": freed}

    async def tick(self) -> list[str]:
        """Unload the models whose keep-alive ran out; the ticker calls this every second."""
        res = self.residency
        ids = policy.expired(res.state(), self._clock())
        await asyncio.gather(*(res.begin_stop(res.loaded[i], "keep_alive") for i in ids))
        return ids

    def ps(self) -> list[dict[str, Any]]:
        now = self._clock()
        loaded = self.residency.loaded
        return [report.describe(rec, self.lanes.get(i), now) for i, rec in loaded.items()]

    def memory_report(self) -> dict[str, Any]:
        res = self.residency
        sample = res.observe()
        return report.memory_report(
            sample, list(res.loaded.values()), res.last_server, res.loads_paused
        )

    def state(self) -> policy.State:
        """Loaded, loading and stopping models as the policy sees them (for the pressure
        guard); its limits are those of the scheduler's last memory observation."""
        return self.residency.state()

    def runner(self, model_id: str) -> Runner | None:
        """The runner of a ready model, else None."""
        rec = self.residency.loaded.get(model_id)
        return rec.runner if rec is not None and rec.phase is Phase.READY else None

    def inflight(self) -> list[InFlightRequest]:
        """Requests running now, oldest first."""
        return sorted(self._inflight.values(), key=lambda r: r.started_at)

    def preview(self, model_id: str) -> tuple[policy.Decision, policy.LoadRequest]:
        """What a load of ``model_id`` would meet here now, without acting on it: the
        cluster (elbowroom.cluster) compares its nodes' answers to place a model."""
        _, _, plan, decision = self.residency.consider(self._catalog.get(model_id))
        return decision, plan.request

    def follow_pause(self, paused: Callable[[], bool]) -> None:
        """Read whether new loads are paused from ``paused``: the pressure guard's answer
        (``PressureGuard.loads_paused``, its one owner), asked each time a load checks. A
        paused load waits for the resume up to ``settings.load_pause_wait``, then fails with
        503 MemoryPressure."""
        self.residency.paused_by = paused

    async def _run_ticker(self) -> None:
        while True:
            await asyncio.sleep(_TICK)
            try:
                await self.tick()
            except Exception:
                log.exception("keep-alive tick failed")
