"""Lanes: the queue, concurrency slots and crash backoff of every model id.

A lane outlives any one runner of its model: it exists from the first request on. A
request takes one of the lane's slots (an LLM's ``slots``, 1 for other engines) before it
may run; beyond that it waits in a bounded queue, and a full queue (or one API key holding
its whole share of it) is a 503 with a Retry-After from the lane's mean request time.
Consecutive crashes or failed loads put the lane in backoff: the next load waits for it.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import AsyncIterator, Callable, Iterator

from elbowroom.config import Settings
from elbowroom.errors import QueueFull, RunnerBackoff
from elbowroom.models.spec import ModelKind
from elbowroom.scheduler.clients import current_client, queue_cap
from elbowroom.scheduler.inputs import ModelCatalog
from elbowroom.scheduler.records import Lane

__all__ = ["Lanes"]

log = logging.getLogger("elbowroom.scheduler")


class Lanes:
    def __init__(
        self,
        settings: Settings,
        catalog: ModelCatalog,
        clock: Callable[[], float],
        counters: dict[str, int],
    ) -> None:
        self._settings = settings
        self._catalog = catalog
        self._clock = clock
        self._counters = counters
        self._lanes: dict[str, Lane] = {}

    def get(self, model_id: str) -> Lane | None:
        return self._lanes.get(model_id)

    def __iter__(self) -> Iterator[Lane]:
        return iter(list(self._lanes.values()))

    def lane(self, model_id: str) -> Lane:
        """``model_id``'s lane, made on first use."""
        lane = self._lanes.get(model_id)
        if lane is None:
            # An LLM serves ``slots`` requests at once (the engine batches them); the other
            # engines one at a time. Requests beyond that wait here, in the bounded queue.
            spec = self._catalog.get(model_id)
            width = self._settings.slots_for(model_id) if spec.kind is ModelKind.LLM else 1
            lane = self._lanes[model_id] = Lane(asyncio.Semaphore(width), width=width)
        return lane

    def claims(self, model_id: str) -> int:
        """Requests holding one of the model's slots that do not run on a runner yet."""
        lane = self._lanes.get(model_id)
        return lane.claims if lane is not None else 0

    @contextlib.asynccontextmanager
    async def slot(self, model_id: str) -> AsyncIterator[Lane]:
        """Hold one of ``model_id``'s slots, waiting in its bounded queue for it; raises
        QueueFull (503) when the queue, or this client's share of it, is full."""
        settings = self._settings
        lane = self.lane(model_id)
        if lane.slots.locked() and lane.waiting >= settings.queue_size:
            self._counters["refusals_503"] += 1
            retry = lane.mean_seconds * (lane.waiting + 1) / lane.width
            log.warning("queue of %s is full (%d waiting)", model_id, lane.waiting)
            raise QueueFull(
                f"model {model_id!r} has {lane.waiting} requests waiting "
                f"(queue_size {settings.queue_size}); retry later",
                retry_after=min(60.0, max(1.0, retry)),
            )
        client = current_client.get()  # set by the server only when keys tell clients apart
        if client is not None and lane.slots.locked():
            self._check_client_share(model_id, lane, client)
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
        try:
            yield lane
        finally:
            lane.slots.release()

    def _check_client_share(self, model_id: str, lane: Lane, client: str) -> None:
        settings = self._settings
        cap = queue_cap(settings.queue_size, settings.queue_share)
        if lane.waiting_by.get(client, 0) >= cap:
            self._counters["refusals_503"] += 1
            raise QueueFull(
                f"this API key ({client}) already has {cap} requests waiting for model "
                f"{model_id!r}; one key may hold at most {cap} of its {settings.queue_size} "
                "queue places (queue_share); retry when one finishes",
                retry_after=min(60.0, max(1.0, lane.mean_seconds)),
            )

    def check_backoff(self, model_id: str, lane: Lane) -> None:
        """Raise RunnerBackoff (503) while the lane waits out a crash backoff."""
        remaining = lane.backoff_until - self._clock()
        if remaining > 0:
            self._counters["refusals_503"] += 1
            raise RunnerBackoff(
                f"model {model_id!r} failed {lane.crash_streak} times in a row "
                f"(last: {lane.last_cause}); the next restart is in {remaining:.0f} s",
                retry_after=remaining,
            )

    def note_crash(self, lane: Lane, cause: str) -> None:
        """A crash or failed load: the streak grows and the next restart backs off."""
        s = self._settings
        lane.note_crash(self._clock(), cause, s.crash_backoff_initial, s.crash_backoff_max)
