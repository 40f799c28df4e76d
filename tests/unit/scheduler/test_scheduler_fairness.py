"""Per-client fairness: one API key cannot fill a model's whole queue; the server's own bytes
count against the load ceiling."""

from __future__ import annotations

import asyncio
from collections.abc import Coroutine
from typing import Any

import pytest
from scheduler_fakes import harness, request, run, spec, until

from elbowroom.errors import InsufficientMemory, QueueFull
from elbowroom.scheduler.clients import current_client, queue_cap
from elbowroom.units import MiB

A = spec("a", size_mib=300)


def as_client(name: str | None, coro: Coroutine[Any, Any, str]) -> asyncio.Task[str]:
    """A task that runs ``coro`` as client ``name`` (tasks copy the context they start in)."""
    token = current_client.set(name)
    try:
        return asyncio.create_task(coro)
    finally:
        current_client.reset(token)


def test_queue_cap() -> None:
    assert queue_cap(16, 0.5) == 8
    assert queue_cap(1, 0.5) == 1  # every client may wait for at least one place
    assert queue_cap(5, 1.0) == 5


def test_one_key_holds_at_most_its_share_of_the_queue() -> None:
    async def scenario() -> None:
        h = harness(A, queue_size=4)  # queue_share 0.5: two places per key
        gate = h.machine.holds["a"] = asyncio.Event()
        running = as_client("key-1", request(h, "a"))
        await until(lambda: h.runner("a").in_request == 1 if h.runners else False)
        mine = [as_client("key-1", request(h, "a")) for _ in range(2)]
        await until(lambda: h.sched.ps()[0]["waiting"] == 2)
        with pytest.raises(QueueFull) as err:
            await as_client("key-1", request(h, "a"))
        assert "key-1" in err.value.message and "queue_share" in err.value.message
        assert err.value.status == 503 and "Retry-After" in err.value.headers()
        # Another key still gets the rest of the queue; then the queue itself is full.
        theirs = [as_client("key-2", request(h, "a")) for _ in range(2)]
        await until(lambda: h.sched.ps()[0]["waiting"] == 4)
        with pytest.raises(QueueFull):
            await as_client("key-3", request(h, "a"))
        gate.set()
        assert await asyncio.gather(running, *mine, *theirs) == ["ok"] * 5
        lane = h.sched.lanes.lane("a")
        assert lane.waiting == 0 and lane.waiting_by == {}

    run(scenario())


def test_without_named_clients_the_whole_queue_is_shared() -> None:
    async def scenario() -> None:
        h = harness(A, queue_size=3)
        gate = h.machine.holds["a"] = asyncio.Event()
        running = as_client(None, request(h, "a"))
        await until(lambda: bool(h.runners) and h.runner("a").in_request == 1)
        waiting = [as_client(None, request(h, "a")) for _ in range(3)]
        await until(lambda: h.sched.ps()[0]["waiting"] == 3)
        gate.set()
        assert await asyncio.gather(running, *waiting) == ["ok"] * 4

    run(scenario())


def test_the_server_s_own_bytes_count_against_the_load_ceiling() -> None:
    async def scenario() -> None:
        # 680 MiB ceiling: a 300 MiB model fits beside 300 MiB of server, not beside 400.
        h = harness(A)
        h.sched.residency.server_usage = lambda: 300 * MiB
        assert await request(h, "a") == "ok"
        report = h.sched.memory_report()
        assert report["server_usage"] == 300 * MiB
        assert report["available"] == report["ceiling"] - report["committed"] - 300 * MiB
        await h.sched.unload("a")
        h.sched.residency.server_usage = lambda: 400 * MiB
        with pytest.raises(InsufficientMemory) as err:
            await request(h, "a")
        details = err.value.details
        assert details["server_usage"] == 400 * MiB
        assert details["limit"] == int(800 * MiB * 0.85)  # the ceiling itself, not less
        assert "the server process itself holds 400.0 MiB" in err.value.message

    run(scenario())
