"""Loads planned elsewhere (``Scheduler.host``) and requests that never load (``hold``):
how a cluster node's scheduler holds its share of a split model (elbowroom.cluster.share).
The scheduler is real; runners, machine and model layer are the fakes of scheduler_fakes."""

from __future__ import annotations

import dataclasses

import pytest
from scheduler_fakes import harness, request, run, spec, until

from elbowroom.errors import InsufficientMemory, Unavailable
from elbowroom.models.spec import Footprint, ModelKind
from elbowroom.scheduler.policy import LoadRequest
from elbowroom.scheduler.sizing import Plan
from elbowroom.units import MiB

A, B = spec("a", size_mib=200), spec("b", size_mib=200)
# A share's spec as the cluster makes it: no GGUF of its own (the plan sizes it), the
# estimator's guess (its size_bytes, 10 MiB) deliberately far from the plan's bytes.
SHARE = dataclasses.replace(spec("m~share", ModelKind.LLM, size_mib=10), gguf=None)


def share_plan(mib: int) -> Plan:
    """``mib`` predicted; all but 1 MiB of it (the idle RPC server at start, what the fake
    runner holds) arrives once the split's engine loads: the working part."""
    need = mib * MiB
    fp = Footprint(weights=need // 2, file_backed=0, anonymous=need, working=need - MiB)
    return Plan(LoadRequest(SHARE.id, need), fp, n_ctx=512, kv_type="f16", slots=1)


def test_host_reserves_the_plans_bytes_and_evicts_idle_models_by_lru() -> None:
    async def scenario() -> None:
        h = harness(A, B, SHARE, actual={SHARE.id: 1})
        await request(h, "a")
        h.clock.now += 10
        await request(h, "b")  # a is now the least recently used
        # 680 MiB ceiling: 400 held, a 400 MiB share needs one of them gone: a (LRU)
        row = await h.sched.host(SHARE.id, share_plan(400))
        assert h.loaded() == ["b", SHARE.id]
        assert row["predicted"] == 400 * MiB
        (share,) = [r for r in h.sched.ps() if r["id"] == SHARE.id]
        # measured after start (1 MiB), held at the plan's bytes until it grows past them
        assert share["anonymous"] == MiB and share["bytes"] == 400 * MiB
        assert h.measured.records == {
            k: v for k, v in h.measured.records.items() if k[0] != SHARE.id
        }, "a share is not a whole model: never remembered as a measurement"
        assert h.sched.counters["evictions_load"] == 1

    run(scenario())


def test_host_refuses_with_507_when_the_share_cannot_fit() -> None:
    async def scenario() -> None:
        h = harness(SHARE)
        with pytest.raises(InsufficientMemory) as err:
            await h.sched.host(SHARE.id, share_plan(700))
        assert err.value.status == 507 and h.loaded() == []

    run(scenario())


def test_hold_never_loads_but_keeps_busy_last_used_and_keep_alive() -> None:
    async def scenario() -> None:
        h = harness(SHARE)
        with pytest.raises(Unavailable):
            async with h.sched.hold(SHARE.id):
                pass
        assert h.loaded() == [] and h.machine.starts == []
        await h.sched.host(SHARE.id, share_plan(100))
        h.clock.now += 50
        async with h.sched.hold(SHARE.id, keep_alive=5.0) as runner:
            assert runner is h.runner(SHARE.id)
            (row,) = h.sched.ps()
            assert row["busy"] == 1 and [r.model for r in h.sched.inflight()] == [SHARE.id]
            # busy: an unload waits for the request (as the guard's unload of a busy model)
            result = await h.sched.unload(SHARE.id, reason="pressure")
            assert result["status"] == "unloading_when_idle"
        await until(lambda: h.loaded() == [])
        assert h.sched.counters["evictions_pressure"] == 1

    run(scenario())


def test_a_held_share_is_used_by_the_lru_order() -> None:
    """A share used recently is not the one evicted: its last use comes from hold."""

    async def scenario() -> None:
        h = harness(A, SHARE, B, actual={SHARE.id: 1})
        await h.sched.host(SHARE.id, share_plan(300))
        h.clock.now += 10
        await request(h, "a")
        h.clock.now += 10
        async with h.sched.hold(SHARE.id):
            pass
        h.clock.now += 10
        await request(h, "b")  # 300 + 200 + 200 > 680: the LRU (a) goes, not the share
        assert h.loaded() == ["b", SHARE.id]

    run(scenario())
