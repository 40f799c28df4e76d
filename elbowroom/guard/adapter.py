"""The guard's view of the real scheduler (``guard.Target``), through its public hooks.

The scheduler stays the single owner of its state: the adapter only reads its picture
(``state()``, ``inflight()``) and asks it to act (``unload``, a runner's ``set_pressure``,
``residency.stop_load`` for a load in progress); it points the scheduler at the guard's
answer to whether loads are paused (``follow_pause``). It remembers the
level each runner object was last told, so a runner that restarts (a new object) starts
from normal and is told the current level again.
"""

from __future__ import annotations

import asyncio
import logging
import math
import time
import weakref
from collections.abc import Callable, Mapping

from elbowroom.guard.ladder import InFlight, LoadedModel
from elbowroom.memory.types import Pressure
from elbowroom.models.spec import ModelKind
from elbowroom.runtime.protocol import Runner
from elbowroom.scheduler.loop import Scheduler
from elbowroom.scheduler.records import Phase

# An evicted model's aborted generations end within 16 tokens; a non-LLM request runs to
# its end. Past this the guard stops counting its bytes as being freed.
EVICT_TIMEOUT = 30.0

log = logging.getLogger("elbowroom.guard")


class SchedulerTarget:
    def __init__(self, scheduler: Scheduler) -> None:
        self._scheduler = scheduler
        self._levels: weakref.WeakKeyDictionary[Runner, Pressure] = weakref.WeakKeyDictionary()
        self._adj: weakref.WeakKeyDictionary[Runner, int] = weakref.WeakKeyDictionary()

    def models(self) -> list[LoadedModel]:
        out = []
        for m in self._scheduler.state().models:
            runner = self._scheduler.runner(m.id)
            if m.loading:
                loading = self._loading(m.id, m.pools)
                if loading is not None:
                    out.append(loading)
                continue  # stopping: neither unloadable nor told levels
            if runner is None:
                continue
            out.append(
                LoadedModel(
                    id=m.id,
                    bytes=m.bytes,
                    last_used=m.last_used,
                    busy=m.busy,
                    pinned=m.pinned,
                    llm=m.kind is ModelKind.LLM,
                    runner_level=self._levels.get(runner, Pressure.NORMAL),
                    pools=tuple(sorted((p, b) for p, b in m.pools.items() if b > 0)),
                )
            )
        return out

    def _loading(self, model_id: str, pools: Mapping[str, int]) -> LoadedModel | None:
        """A load in progress, as the guard sees it: its runner's measured bytes (a crafted
        model can grow far past its prediction while it loads), idle and *pinned* (never
        one of the idle models the ladder unloads); the ladder stops it at soft unless the
        idle unloads cover the excess, and at hard. Never told levels (``llm`` False): a
        loading runner does not read them."""
        rec = self._scheduler.residency.loaded.get(model_id)
        if rec is None or rec.phase is not Phase.LOADING:
            return None
        try:
            measured = rec.runner.measure().resident
        except Exception:  # the runner's /proc entry vanished: it is gone already
            return None
        return LoadedModel(
            id=model_id,
            bytes=measured,
            last_used=-math.inf,  # the first pinned model to go
            pinned=True,
            loading=True,
            pools=tuple(sorted((p, b) for p, b in pools.items() if b > 0)),
        )

    def inflight(self) -> list[InFlight]:
        """Requests running now; ``bytes`` is left 0 for the guard to fill from models()
        (one measurement of the runners per sample, not two)."""
        return [
            InFlight(
                request_id=r.request_id,
                model=r.model,
                started_at=r.started_at,
                bytes=0,
                abortable=r.kind is ModelKind.LLM,
            )
            for r in self._scheduler.inflight()
        ]

    def set_pressure(self, model: str, level: Pressure) -> None:
        runner = self._scheduler.runner(model)
        if runner is not None:
            runner.set_pressure(int(level))
            self._levels[runner] = level

    def set_oom_score_adj(self, model: str, adj: int) -> None:
        """Write the runner process's ``oom_score_adj`` (raising needs no privilege; a value
        below where it started is refused by the kernel and left as it is)."""
        runner = self._scheduler.runner(model)
        pid = runner.pid if runner is not None else None
        if runner is None or not pid or self._adj.get(runner) == adj:
            return
        try:
            with open(f"/proc/{pid}/oom_score_adj", "w") as f:
                f.write(str(adj))
        except OSError as exc:  # exited meanwhile, or a value we may not set
            log.debug("oom_score_adj %d for %s (pid %s) not set: %s", adj, model, pid, exc)
            return
        self._adj[runner] = adj
        log.debug("runner %s (pid %s): oom_score_adj %d", model, pid, adj)

    def follow_pause(self, paused: Callable[[], bool]) -> None:
        self._scheduler.follow_pause(paused)

    async def unload(self, model: str, *, timeout: float = EVICT_TIMEOUT) -> None:
        """Returns once the model is gone: a busy model (evicted at hard) stops when its
        aborted requests have ended, and until then its bytes are still being freed."""
        stopped = await self._scheduler.residency.stop_load(
            model, "memory pressure rose while it loaded"
        )
        if stopped is not None:  # a load in progress: its runner is killed
            deadline = time.monotonic() + timeout
            while (
                self._scheduler.residency.loaded.get(model) is stopped
                and time.monotonic() < deadline
            ):
                await asyncio.sleep(0.05)
            return
        runner = self._scheduler.runner(model)
        result = await self._scheduler.unload(model, reason="pressure")
        if result.get("status") != "unloading_when_idle" or runner is None:
            return
        deadline = time.monotonic() + timeout
        while self._scheduler.runner(model) is runner and time.monotonic() < deadline:
            await asyncio.sleep(0.05)  # polls the scheduler's state; it has no event for this
