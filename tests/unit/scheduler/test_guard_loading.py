"""The guard sees a load in progress (issue 28): a loading runner's measured bytes count,
and at hard, with no idle model left to unload, the load is stopped: the requests waiting
on it get a 503 with Retry-After naming the cause, and the model is not put in backoff."""

from __future__ import annotations

import asyncio
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).parents[1] / "scheduler"))

from scheduler_fakes import MiB, harness, request, run, spec, until

from elbowroom.errors import MemoryPressure
from elbowroom.guard import ladder
from elbowroom.guard.adapter import SchedulerTarget
from elbowroom.memory.types import Pressure
from elbowroom.scheduler.records import Phase


def test_a_loading_runner_is_counted_and_stopped_at_hard() -> None:
    async def scenario() -> None:
        h = harness(spec("big", 100))
        h.machine.start_gate = asyncio.Event()
        target = SchedulerTarget(h.sched)
        first = asyncio.create_task(request(h, "big"))
        res = h.sched.residency
        await until(lambda: "big" in res.loaded and h.runners != [])
        assert res.loaded["big"].phase is Phase.LOADING
        h.runner("big").loading_bytes = 700 * MiB  # far past its prediction

        seen = {m.id: m for m in target.models()}
        assert seen["big"].bytes == 700 * MiB
        assert seen["big"].pinned and seen["big"].busy == 0 and not seen["big"].llm

        # Soft: a load in progress is left alone. Hard with nothing idle: it goes.
        reading = ladder.Reading(usage=760 * MiB, limit=800 * MiB, soft=720 * MiB, hard=760 * MiB)
        soft = ladder.Reading(usage=730 * MiB, limit=800 * MiB, soft=720 * MiB, hard=760 * MiB)
        calm = ladder.plan(
            Pressure.SOFT,
            Pressure.NORMAL,
            [],
            list(seen.values()),
            reading=soft,
            gate=ladder.Gate(),
        )
        assert not any(isinstance(a, ladder.Unload) for a in calm)
        actions = ladder.plan(
            Pressure.HARD,
            Pressure.SOFT,
            [],
            list(seen.values()),
            reading=reading,
            gate=ladder.Gate(loads_paused=True),
        )
        assert [a.model for a in actions if isinstance(a, ladder.Unload)] == ["big"]

        await target.unload("big")
        with pytest.raises(MemoryPressure) as err:
            await first
        assert err.value.status == 503 and err.value.code == "load_stopped"
        assert "hard threshold while it loaded" in str(err.value)
        assert "big" not in res.loaded
        lane = h.sched.lanes.get("big")
        assert lane is not None and lane.crash_streak == 0  # no backoff: the model is fine

        h.machine.start_gate.set()  # the next request loads it again
        assert await request(h, "big") == "ok"

    run(scenario())
