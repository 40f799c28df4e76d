"""The guard sees a load in progress (issues 28 and 23): a loading runner's measured bytes
count, and at soft (unless idle unloads cover the excess) or hard the load is stopped: the
requests waiting on it get a 503 with Retry-After naming the cause, and the model is not
put in backoff."""

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


def test_a_loading_runner_is_counted_and_stopped_under_pressure() -> None:
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

        # Soft with an idle model whose unload covers the excess: the load goes on.
        reading = ladder.Reading(usage=760 * MiB, limit=800 * MiB, soft=720 * MiB, hard=760 * MiB)
        soft = ladder.Reading(usage=730 * MiB, limit=800 * MiB, soft=720 * MiB, hard=760 * MiB)
        idle = ladder.LoadedModel("idle", 20 * MiB, last_used=1.0)
        covered = ladder.plan(
            Pressure.SOFT,
            Pressure.NORMAL,
            [],
            [*seen.values(), idle],
            reading=soft,
            gate=ladder.Gate(),
        )
        assert [a.model for a in covered if isinstance(a, ladder.Unload)] == ["idle"]
        # Soft with nothing idle to cover it, soft from the trend (no byte excess), and
        # hard: the load is stopped.
        trend = ladder.Reading(usage=600 * MiB, limit=800 * MiB, soft=720 * MiB, hard=760 * MiB)
        for level, r in ((Pressure.SOFT, soft), (Pressure.SOFT, trend), (Pressure.HARD, reading)):
            actions = ladder.plan(
                level,
                Pressure.NORMAL,
                [],
                list(seen.values()),
                reading=r,
                gate=ladder.Gate(loads_paused=True),
            )
            stops = [a for a in actions if isinstance(a, ladder.Unload)]
            assert [(a.model, a.loading) for a in stops] == [("big", True)], (level, r)
            assert stops[0].message().startswith("stopping the load of big (700.0 MiB so far)")

        await target.unload("big")
        with pytest.raises(MemoryPressure) as err:
            await first
        assert err.value.status == 503 and err.value.code == "load_stopped"
        assert "memory pressure rose while it loaded" in str(err.value)
        assert "big" not in res.loaded
        lane = h.sched.lanes.get("big")
        assert lane is not None and lane.crash_streak == 0  # no backoff: the model is fine

        h.machine.start_gate.set()  # the next request loads it again
        assert await request(h, "big") == "ok"

    run(scenario())
