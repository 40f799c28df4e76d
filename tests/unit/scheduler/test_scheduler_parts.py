"""The scheduler's parts on their own: residency (one reading of each runner per decision),
lanes (queue, per-key share, crash backoff), the planner's budget picture and the 507 a
refusal becomes. The parts are real; only the machine, runners, clock and catalog are the
fakes of scheduler_fakes (the edges)."""

from __future__ import annotations

import asyncio
from collections import Counter
from typing import Any

import pytest
from scheduler_fakes import FakeCatalog, FakeClock, harness, request, run, spec, until

from elbowroom.config import Settings
from elbowroom.errors import QueueFull, RunnerBackoff
from elbowroom.memory.budget import Limit
from elbowroom.memory.pools import Pool
from elbowroom.memory.types import ProcessMemory
from elbowroom.models.spec import Holding, ModelKind
from elbowroom.scheduler.clients import current_client
from elbowroom.scheduler.lanes import Lanes
from elbowroom.scheduler.planner import budget_state
from elbowroom.scheduler.policy import ModelState, Refuse, Suggestion
from elbowroom.scheduler.refusal import insufficient_memory
from elbowroom.units import MiB

# ---- residency ------------------------------------------------------------------------------


def test_a_decision_reads_each_runner_once() -> None:
    """A load decision used to read every runner's /proc tree three times (the monitor's
    own_usage, its GPU usage and the policy's state): one reading now serves all three, and
    the sample and the state see the same bytes."""
    h = harness(spec("a"), spec("b"), spec("c"))

    async def main() -> None:
        await request(h, "a")
        await request(h, "b")
        reads: Counter[str] = Counter()
        for runner in h.runners:
            measure = runner.measure

            def counted(measure: Any = measure, model: str = runner.spec.id) -> ProcessMemory:
                reads[model] += 1
                return measure()  # type: ignore[no-any-return]

            runner.measure = counted  # type: ignore[method-assign]
        sample, state, _, _ = h.sched.residency.consider(spec("c"))
        assert reads == {"a": 1, "b": 1}
        held = sum(m.bytes for m in state.models)
        assert sample.own_usage == held  # one reading: the sample and the state agree
        reads.clear()
        h.sched.residency.own_usage()  # outside a decision: a fresh reading each time
        h.sched.residency.own_usage()
        assert reads == {"a": 2, "b": 2}

    run(main())


# ---- lanes ----------------------------------------------------------------------------------


def _lanes(**settings: Any) -> tuple[Lanes, Counter[str], FakeClock]:
    counters: Counter[str] = Counter()
    clock = FakeClock()
    catalog = FakeCatalog(spec("emb"), spec("llm", ModelKind.LLM))
    lanes = Lanes(Settings(**settings), catalog, clock, counters)
    return lanes, counters, clock


def test_an_llm_lane_is_as_wide_as_its_slots_and_other_engines_one() -> None:
    async def main() -> None:
        lanes, _, _ = _lanes(slots=3, model_slots=("emb=4",))
        assert lanes.lane("llm").width == 3
        assert lanes.lane("emb").width == 1  # model_slots are an LLM's sequences only

    run(main())


def test_a_full_queue_is_a_503_with_a_retry_after_from_the_mean_request_time() -> None:
    async def main() -> None:
        lanes, counters, _ = _lanes(queue_size=2)
        release = asyncio.Event()

        async def hold() -> None:
            async with lanes.slot("emb"):
                await release.wait()

        tasks = [asyncio.create_task(hold()) for _ in range(3)]  # one runs, two wait
        await until(lambda: lanes.lane("emb").waiting == 2)
        lanes.lane("emb").mean_seconds = 4.0
        with pytest.raises(QueueFull) as err:
            async with lanes.slot("emb"):
                pass
        assert err.value.retry_after == pytest.approx(4.0 * 3)  # 2 waiting + this one
        assert counters["refusals_503"] == 1
        release.set()
        await asyncio.gather(*tasks)
        assert lanes.lane("emb").waiting == 0 and not lanes.lane("emb").slots.locked()

    run(main())


def test_one_key_may_hold_only_its_share_of_the_queue() -> None:
    async def main() -> None:
        lanes, _, _ = _lanes(queue_size=4, queue_share=0.5)
        release = asyncio.Event()

        async def hold(client: str | None) -> None:
            current_client.set(client)
            async with lanes.slot("emb"):
                await release.wait()

        tasks = [asyncio.create_task(hold(None))]  # runs
        tasks += [asyncio.create_task(hold("key-1")) for _ in range(2)]  # its share: 2
        await until(lambda: lanes.lane("emb").waiting_by.get("key-1") == 2)
        current_client.set("key-1")
        with pytest.raises(QueueFull, match="key-1"):
            async with lanes.slot("emb"):
                pass
        tasks.append(asyncio.create_task(hold("key-2")))  # another key still gets a place
        await until(lambda: lanes.lane("emb").waiting == 3)
        release.set()
        await asyncio.gather(*tasks)
        assert lanes.lane("emb").waiting_by == {}

    run(main())


def test_repeated_crashes_back_the_lane_off_longer_each_time_until_it_passes() -> None:
    """The first crash restarts at once (a one-off OOM kill); from the second on the lane
    waits, doubling up to the cap, and the wait is a 503 with what it waits for."""
    lanes, counters, clock = _lanes(crash_backoff_initial=2.0, crash_backoff_max=3.0)

    async def main() -> None:
        lane = lanes.lane("emb")
        lanes.note_crash(lane, "killed by signal SIGKILL")
        lanes.check_backoff("emb", lane)  # the first: no wait
        waits = []
        for streak in (2, 3):
            lanes.note_crash(lane, "killed by signal SIGKILL")
            with pytest.raises(RunnerBackoff, match=f"failed {streak} times.*SIGKILL") as err:
                lanes.check_backoff("emb", lane)
            waits.append(err.value.retry_after)
        assert waits == [pytest.approx(2.0), pytest.approx(3.0)]  # 2, then 4 capped at 3
        clock.now += 3.0
        lanes.check_backoff("emb", lane)  # waited out: no error
        assert counters["refusals_503"] == 2

    run(main())


# ---- planner --------------------------------------------------------------------------------


def _limit(value: int, ceiling: int) -> Limit:
    return Limit(value, "fraction", (), soft=int(value * 0.85), hard=value, ceiling=ceiling)


def _pool(name: str, kind: str, ceiling: int) -> Pool:
    total = 2 * ceiling
    return Pool(name, kind, name, total, total, 0, 0, 0, _limit(total, ceiling))


def test_the_budget_is_the_ceiling_less_the_servers_own_bytes_and_each_gpus_ceiling() -> None:
    models = (ModelState("a", ModelKind.LLM, Holding.MMAP, 100 * MiB),)
    pools = [_pool("host", "host", 800 * MiB), _pool("gpu0", "gpu", 3000 * MiB)]
    state = budget_state(models, 800 * MiB, pools, server=50 * MiB)
    assert state.limit == 750 * MiB
    assert dict(state.pool_limits) == {"gpu0": 3000 * MiB}
    assert state.models == models
    # a server that holds more than the ceiling leaves nothing, never a negative budget
    assert budget_state(models, 800 * MiB, pools, server=900 * MiB).limit == 0


# ---- refusal --------------------------------------------------------------------------------


def _refuse(pool: str = "host", suggestions: tuple[Suggestion, ...] = ()) -> Refuse:
    return Refuse(
        model="big",
        needed=700 * MiB,
        available=200 * MiB,
        limit=750 * MiB,
        committed=550 * MiB,
        evictable=100 * MiB,
        loaded=(),
        suggestions=suggestions,
        pool=pool,
    )


def test_a_host_507_reports_the_ceiling_itself_and_what_the_server_holds_of_it() -> None:
    ctx = Suggestion("ctx", "load it with --ctx 1024", 1024)
    err = insufficient_memory(_refuse(suggestions=(ctx,)), 50 * MiB, _limit(1000 * MiB, 800 * MiB))
    assert err.status == 507
    assert err.details["limit"] == 800 * MiB  # the policy saw 750: the server's 50 added back
    assert err.details["server_usage"] == 50 * MiB
    assert err.details["memory_limit"] == 1000 * MiB
    assert "the server process itself holds 50.0 MiB" in err.message
    assert err.message.endswith("load it with --ctx 1024")


def test_a_gpu_507_speaks_of_that_pool_alone() -> None:
    err = insufficient_memory(_refuse(pool="gpu0"), 50 * MiB, None)
    assert err.details["limit"] == 750 * MiB  # a GPU ceiling never held the server's bytes
    assert "server process" not in err.message and "gpu0" in err.message
    assert err.details["memory_limit"] == 0 and err.details["memory_rule"] == "host"
