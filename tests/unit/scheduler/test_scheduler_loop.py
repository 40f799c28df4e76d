"""Scheduler (loop.py) over a fake machine: loads, eviction, refusals, queues, keep-alive,
crashes. The runner processes and the model layer are the faked edges; the scheduler is
real. The fake machine's limit is 800 MiB (see scheduler_fakes.harness); loads are admitted
up to its load ceiling of 680 MiB (0.85 × 800), below the soft threshold (0.90)."""

from __future__ import annotations

import asyncio
import contextlib

import pytest
from scheduler_fakes import Harness, harness, request, run, spec, until

from elbowroom.engines.options import LlamaOptions
from elbowroom.errors import (
    EngineError,
    InsufficientMemory,
    MemoryPressure,
    ModelNotFound,
    QueueFull,
    RunnerBackoff,
    RunnerCrashed,
    Unavailable,
    Unprocessable,
)
from elbowroom.models.spec import ModelKind
from elbowroom.scheduler import loop
from elbowroom.units import MiB

LIMIT = 800 * MiB
CEILING = int(LIMIT * 0.85)  # 680 MiB exactly: the load ceiling, where admission stops

A, B, C = spec("a", size_mib=300), spec("b", size_mib=300), spec("c", size_mib=300)
BIG = spec("big", size_mib=550)
HUGE = spec("huge", size_mib=900)
LLM = spec("llm", ModelKind.LLM, size_mib=100)


async def hold_request(h: Harness, model_id: str) -> tuple[asyncio.Task[str], asyncio.Event]:
    """Start a request on ``model_id`` that stays in flight until the event is set."""
    gate = h.machine.holds[model_id] = asyncio.Event()
    task = asyncio.create_task(request(h, model_id))
    await until(lambda: any(r.spec.id == model_id and r.in_request for r in h.runners))
    return task, gate


# --- loading


def test_loads_lazily_on_first_use_and_reuses_the_runner() -> None:
    async def scenario() -> None:
        h = harness(A)
        assert h.sched.ps() == []
        async with h.sched.use("a") as runner:
            (row,) = h.sched.ps()
            assert row["id"] == "a" and row["state"] == "ready" and row["busy"] == 1
            assert row["anonymous"] == 300 * MiB and row["predicted"] == 300 * MiB
            assert row["pid"] == runner.pid
        assert await request(h, "a") == "ok"
        (row,) = h.sched.ps()
        assert row["busy"] == 0 and row["expires_at"] is not None and row["last_used"]
        assert h.machine.starts == ["a"]
        assert h.sched.counters["loads"] == 1

    run(scenario())


def test_unknown_model_is_404() -> None:
    async def scenario() -> None:
        h = harness(A)
        with pytest.raises(ModelNotFound) as err:
            async with h.sched.use("nope"):
                pass
        assert err.value.status == 404

    run(scenario())


def test_runner_start_options_carry_the_settings() -> None:
    async def scenario() -> None:
        h = harness(LLM, ctx=2048, kv_type="q8_0", slots=2, threads=3, kv_ram_max=64 * MiB,
                    mlock=True, kv_disk_max=7 * MiB, kv_block_tokens=32)  # fmt: skip
        await request(h, "llm")
        opts = h.runner("llm").options
        assert isinstance(opts, LlamaOptions)
        assert opts.n_ctx == 2048 and opts.kv_type == "q8_0" and opts.slots == 2
        assert opts.threads == 3 and opts.cache_ram_bytes == 64 * MiB
        assert opts.kv_cache_dir == "/nonexistent/elbowroom-test/kv"
        assert opts.mlock is True and opts.kv_disk_max == 7 * MiB and opts.kv_block_tokens == 32

    run(scenario())


def test_small_llms_prompt_cache_grants_follow_their_kv_so_two_fit_side_by_side() -> None:
    """Issue 24's arena: a fixed 512 MiB prompt-cache grant each made two small LLMs evict
    each other on every switch in a container that held both. The grant is at most
    ``kv_ram_kv_factor`` (1) x the model's KV cache: 64 KiB x 512 tokens = 32 MiB here."""

    async def scenario() -> None:
        small = spec("small", ModelKind.LLM, size_mib=200)
        other = spec("other", ModelKind.LLM, size_mib=200)
        h = harness(small, other, ctx=512)  # 232 MiB each + grants, 680 MiB ceiling
        await request(h, "small")
        await request(h, "other")
        assert h.loaded() == ["other", "small"]
        assert h.sched.counters["evictions_load"] == 0
        for m in ("small", "other"):
            opts = h.runner(m).options
            assert isinstance(opts, LlamaOptions) and opts.cache_ram_bytes == 32 * MiB
        # kv_ram_kv_factor 0 turns the cap off: the first takes all the room it leaves
        # (kv_ram_max 512 MiB shrunk to 448) and the second evicts it
        h = harness(small, other, ctx=512, kv_ram_kv_factor=0)
        await request(h, "small")
        await request(h, "other")
        assert h.loaded() == ["other"] and h.sched.counters["evictions_load"] == 1
        opts = h.runner("small").options
        assert isinstance(opts, LlamaOptions) and opts.cache_ram_bytes == 448 * MiB

    run(scenario())


def test_llm_context_is_sized_from_the_budget() -> None:
    async def scenario() -> None:
        # 680 MiB ceiling, 300 MiB held by a busy model: 380 MiB budget; 100 MiB weights
        # leave 280 MiB of f16 KV at 64 KiB/token = 4480 tokens, down to a multiple of 256:
        # 4352 (sized against the 800 MiB limit it would have been 6400).
        h = harness(A, LLM)
        task, gate = await hold_request(h, "a")
        await request(h, "llm")
        opts = h.runner("llm").options
        assert isinstance(opts, LlamaOptions) and opts.n_ctx == 4352
        gate.set()
        await task

    run(scenario())


def test_measured_footprint_is_recorded_and_predicts_the_next_load() -> None:
    async def scenario() -> None:
        h = harness(A, actual={"a": 200})  # the estimate says 300 MiB, it really takes 200
        await request(h, "a")
        assert h.measured.records[("a", 0, 1, "f16")].anonymous == 200 * MiB
        await h.sched.unload("a")
        await request(h, "a")
        (row,) = h.sched.ps()
        assert row["predicted"] == 200 * MiB

    run(scenario())


def test_memory_grown_while_serving_is_recorded_at_unload() -> None:
    async def scenario() -> None:
        h = harness(A, actual={"a": 200})
        await request(h, "a")
        h.runner("a").nbytes = 260 * MiB  # it grew while serving (resident engines do)
        await h.sched.unload("a")
        assert h.measured.records[("a", 0, 1, "f16")].anonymous == 260 * MiB
        await request(h, "a")
        (row,) = h.sched.ps()
        assert row["predicted"] == 260 * MiB  # the next prediction is what it really used

    run(scenario())


def test_an_llm_is_remembered_at_load_not_at_unload() -> None:
    async def scenario() -> None:
        h = harness(LLM, actual={"llm": 150}, ctx=512)
        await request(h, "llm")
        key = ("llm", 512, 1, "f16")
        assert h.measured.records[key].anonymous == 150 * MiB
        # What an LLM grows into while serving is its prompt cache (a grant), not its own
        # footprint: remembering it would inflate every later prediction.
        h.runner("llm").nbytes = 600 * MiB
        await h.sched.unload("llm")
        assert h.measured.records[key].anonymous == 150 * MiB

    run(scenario())


# --- eviction


def test_evicts_the_least_recently_used_idle_model() -> None:
    async def scenario() -> None:
        h = harness(A, B, C)
        await request(h, "a")
        h.clock.now += 10
        await request(h, "b")
        h.clock.now += 10
        await request(h, "a")  # a is now the most recently used
        h.clock.now += 10
        await request(h, "c")  # 900 > 680: one must go, and it is b
        assert h.loaded() == ["a", "c"]
        assert h.runner("b").stops == 1
        assert h.sched.counters["evictions_load"] == 1

    run(scenario())


def test_evicts_by_bytes_across_models_until_it_fits() -> None:
    async def scenario() -> None:
        h = harness(
            spec("s1", size_mib=250), spec("s2", size_mib=250), spec("s3", size_mib=100), BIG
        )
        for model_id in ("s1", "s2", "s3"):  # 600 MiB, s1 least recently used
            await request(h, model_id)
            h.clock.now += 1
        assert h.sched.counters["evictions_load"] == 0
        await request(h, "big")  # 550 with 80 free under 680 needs 470: s1 + s2, not s3
        assert h.loaded() == ["big", "s3"]
        assert h.sched.counters["evictions_load"] == 2

    run(scenario())


def test_a_busy_model_is_not_evicted_the_load_waits_for_it() -> None:
    async def scenario() -> None:
        h = harness(A, BIG)
        task, gate = await hold_request(h, "a")
        load = asyncio.create_task(request(h, "big"))  # 300 + 550 > 680
        await until(lambda: h.clock.now > 1001)  # the load is polling, a still runs
        assert h.loaded() == ["a"] and h.runner("a").stops == 0
        gate.set()
        assert await task == "ok"
        assert await load == "ok"
        assert h.loaded() == ["big"]

    run(scenario())


def test_waiting_for_busy_models_ends_in_507_at_load_timeout() -> None:
    async def scenario() -> None:
        h = harness(A, BIG, load_timeout=2.0)
        task, gate = await hold_request(h, "a")
        with pytest.raises(InsufficientMemory) as err:
            await request(h, "big")
        actions = [s["action"] for s in err.value.details["suggestions"]]
        assert actions == ["stop_busy"]
        gate.set()
        await task

    run(scenario())


def test_a_load_waiting_for_busy_models_does_not_hold_up_a_load_that_fits() -> None:
    async def scenario() -> None:
        small = spec("small", size_mib=100)
        h = harness(A, BIG, small)
        task, gate = await hold_request(h, "a")
        load = asyncio.create_task(request(h, "big"))  # 300 + 550 > 680: waits for a
        await until(lambda: h.clock.now > 1001)  # the big load is polling
        assert await request(h, "small") == "ok"  # 300 + 100 fits: loads beside busy a
        assert not load.done() and h.loaded() == ["a", "small"]
        gate.set()
        assert await task == "ok"
        assert await load == "ok"
        assert h.loaded() == ["big"]

    run(scenario())


def test_a_model_in_steady_use_does_not_starve_a_load_waiting_for_it() -> None:
    async def scenario() -> None:
        first, second = spec("l1", ModelKind.LLM, 300), spec("l2", ModelKind.LLM, 550)
        h = harness(first, second, slots=2)  # two requests can run on l1 at once
        task, gate = await hold_request(h, "l1")
        load = asyncio.create_task(request(h, "l2"))  # waits for l1 to go idle
        await until(lambda: h.clock.now > 1001)
        more = asyncio.create_task(request(h, "l1"))  # would keep l1 busy for ever
        await until(lambda: h.clock.now > 1003)
        (row,) = h.sched.ps()
        assert row["id"] == "l1" and row["busy"] == 1  # the new request waits its turn
        gate.set()
        assert await task == "ok"
        assert await load == "ok"  # l2 went first
        assert await more == "ok"  # then l1 again
        assert h.machine.starts == ["l1", "l2", "l1"]

    run(scenario())


def test_pinned_model_is_not_evicted_and_the_refusal_names_it() -> None:
    async def scenario() -> None:
        h = harness(A, BIG)
        row = await h.sched.load("a", pin=True)
        assert row["pinned"] is True and row["expires_at"] is None
        with pytest.raises(InsufficientMemory) as err:
            await request(h, "big")
        (suggestion,) = err.value.details["suggestions"]
        assert suggestion["action"] == "unload_pinned" and suggestion["value"] == "a"
        assert h.loaded() == ["a"]
        await h.sched.load("a", pin=False)
        await request(h, "big")
        assert h.loaded() == ["big"]

    run(scenario())


# --- refusal


def test_507_body_has_the_numbers() -> None:
    async def scenario() -> None:
        h = harness(A, HUGE)
        await request(h, "a")
        with pytest.raises(InsufficientMemory) as err:
            await request(h, "huge")
        assert err.value.status == 507
        body = err.value.to_openai()["error"]
        assert body["type"] == "insufficient_memory" and body["code"] == "insufficient_memory"
        assert body["model"] == "huge"
        assert body["needed"] == 900 * MiB
        assert body["limit"] == CEILING  # what admission is measured against
        assert body["memory_limit"] == LIMIT
        assert body["memory_rule"] == "host" and "OS reserve" in body["memory_rule_why"]
        assert body["committed"] == 300 * MiB
        assert body["available"] == 380 * MiB  # 680 - 300
        assert body["evictable"] == 300 * MiB
        assert body["shortfall"] == 220 * MiB  # 900 - 380 - 300
        assert "680.0 MiB load ceiling" in body["message"]
        assert body["loaded"][0]["id"] == "a"
        assert body["suggestions"][0]["action"] == "free_memory"
        assert "huge" in body["message"]
        assert h.loaded() == ["a"]  # nothing was evicted for a load that cannot happen
        assert h.sched.counters["refusals_507"] == 1

    run(scenario())


M4 = spec("m4", size_mib=400)  # beside A: 700 MiB, under the 800 MiB limit, over 680


def test_a_load_over_the_soft_threshold_evicts_even_under_the_limit() -> None:
    async def scenario() -> None:
        h = harness(A, M4)
        await request(h, "a")
        await request(h, "m4")
        assert h.loaded() == ["m4"] and h.runner("a").stops == 1
        assert h.sched.counters["evictions_load"] == 1

    run(scenario())


def test_a_load_over_the_soft_threshold_is_507_when_nothing_is_evictable() -> None:
    async def scenario() -> None:
        h = harness(A, M4, pin=("a",))
        await request(h, "a")
        with pytest.raises(InsufficientMemory) as err:
            await request(h, "m4")
        body = err.value.to_openai()["error"]
        assert body["limit"] == CEILING and body["memory_limit"] == LIMIT
        assert body["needed"] == 400 * MiB and body["committed"] == 300 * MiB
        assert body["available"] == 380 * MiB and body["evictable"] == 0
        assert body["shortfall"] == 20 * MiB
        assert [s["action"] for s in body["suggestions"]] == ["unload_pinned"]
        assert h.loaded() == ["a"] and h.runner("a").stops == 0

    run(scenario())


def test_load_fraction_moves_the_load_ceiling() -> None:
    async def scenario() -> None:
        # ceiling 720 MiB: 700 fits beside A
        h = harness(A, M4, load_fraction=0.9, soft_fraction=0.93)
        await request(h, "a")
        await request(h, "m4")
        assert h.loaded() == ["a", "m4"] and h.sched.counters["evictions_load"] == 0

    run(scenario())


def test_llm_refusal_suggests_ctx_and_q8_kv() -> None:
    async def scenario() -> None:
        # ctx 8192 f16: 100 MiB + 512 MiB KV = 612 MiB; a pinned 300 MiB model leaves 380
        # under the 680 MiB ceiling.
        h = harness(A, LLM, ctx=8192, pin=("a",))
        await request(h, "a")
        with pytest.raises(InsufficientMemory) as err:
            await request(h, "llm")
        by_action = {s["action"]: s["value"] for s in err.value.details["suggestions"]}
        assert by_action["ctx"] == 4352  # (380 - 100) MiB / 64 KiB = 4480, down to 256s
        assert by_action["kv_type"] == "q8_0"  # 100 + 8192 * 34 KiB = 372 MiB <= 380
        assert by_action["unload_pinned"] == "a"

    run(scenario())


def test_auto_context_below_min_ctx_is_refused() -> None:
    async def scenario() -> None:
        # 670 MiB of weights leave 10 MiB under the 680 MiB ceiling: 160 tokens < 512.
        h = harness(spec("fat", ModelKind.LLM, size_mib=670), min_ctx=512)
        with pytest.raises(InsufficientMemory) as err:
            await request(h, "fat")
        assert err.value.details["needed"] == 670 * MiB + 512 * 64 * 1024

    run(scenario())


def test_a_failed_load_is_reported_and_leaves_nothing_behind() -> None:
    async def scenario() -> None:
        h = harness(A)
        h.machine.fail_starts["a"] = EngineError("bad weights")
        with pytest.raises(EngineError):
            await request(h, "a")
        assert h.sched.ps() == [] and h.sched.counters["load_failures"] == 1
        assert h.sched.memory_report()["reservations"] == []

    run(scenario())


# --- memory after unload


def test_waits_for_evicted_memory_to_show_up_before_loading() -> None:
    async def scenario() -> None:
        h = harness(A, BIG)
        await request(h, "a")
        h.machine.lag = 5  # the next readings still show a's 300 MiB as used
        await request(h, "big")
        assert h.machine.starts == ["a", "big"]
        assert h.machine.pending_at_start[-1] == 0  # big started once a's memory was back

    run(scenario())


def test_memory_that_never_shows_up_ends_the_wait_at_the_deadline() -> None:
    async def scenario() -> None:
        h = harness(BIG, spec("b6", size_mib=600), unload_settle_timeout=2.0)
        await request(h, "big")
        h.machine.lag = 10**9
        before = h.clock.now
        with pytest.raises(InsufficientMemory) as err:
            await request(h, "b6")  # the limit shrank to the 450 MiB really available
        assert h.clock.now - before >= 2.0
        assert err.value.details["memory_limit"] == 450 * MiB
        assert err.value.details["limit"] == int(450 * MiB * 0.85)  # its load ceiling

    run(scenario())


def test_the_server_heap_is_trimmed_each_time_the_last_runner_stops() -> None:
    async def scenario() -> None:
        idle: list[list[str]] = []
        h = harness(A, B, when_idle=lambda: idle.append(h.loaded()))
        await request(h, "a")
        await request(h, "b")
        await h.sched.unload("a")  # b is still loaded: no trim (it would record ["b"])
        await h.sched.unload("b")
        await until(lambda: idle == [[]])  # once, with nothing loaded
        await request(h, "a")
        h.runner("a").crash("exit code 1")  # a runner that dies counts as gone too
        await until(lambda: idle == [[], []])

    run(scenario())


def test_trim_when_idle_off_leaves_the_heap_alone(monkeypatch: pytest.MonkeyPatch) -> None:
    calls: list[int] = []
    monkeypatch.setattr(loop, "trim", lambda: calls.append(1))

    async def scenario() -> None:
        for setting in (False, True):  # off first: a trim from it would make calls [1, 1]
            h = harness(A, trim_when_idle=setting)
            await request(h, "a")
            await h.sched.unload("a")
        await until(lambda: calls == [1])  # only the server with the knob on

    run(scenario())


# --- one load at a time, queues, concurrency


def test_one_load_at_a_time() -> None:
    async def scenario() -> None:
        h = harness(A, B)
        h.machine.start_gate = asyncio.Event()
        first = asyncio.create_task(request(h, "a"))
        second = asyncio.create_task(request(h, "b"))
        await until(lambda: h.machine.loading == 1)
        report = h.sched.memory_report()
        assert [r["bytes"] for r in report["reservations"]] == [300 * MiB]
        h.machine.start_gate.set()
        assert await first == "ok" and await second == "ok"
        assert h.machine.max_loading == 1
        assert h.loaded() == ["a", "b"]

    run(scenario())


def test_queue_full_is_503_with_retry_after() -> None:
    async def scenario() -> None:
        h = harness(A, queue_size=1)
        running, gate = await hold_request(h, "a")
        waiting = asyncio.create_task(request(h, "a"))
        await until(lambda: h.sched.ps()[0]["waiting"] == 1)
        with pytest.raises(QueueFull) as err:
            await request(h, "a")
        assert err.value.status == 503 and err.value.retry_after >= 1
        assert "Retry-After" in err.value.headers()
        assert h.sched.counters["refusals_503"] == 1
        gate.set()
        assert await running == "ok" and await waiting == "ok"

    run(scenario())


def test_an_llm_serves_as_many_requests_as_its_slots_and_queues_the_rest() -> None:
    async def scenario() -> None:
        h = harness(LLM, slots=2)
        await request(h, "llm")
        gate = h.machine.holds["llm"] = asyncio.Event()
        tasks = [asyncio.create_task(request(h, "llm")) for _ in range(3)]
        # A granted slot enters the runner's request on the task's next turn: wait for both.
        await until(lambda: h.sched.ps()[0]["waiting"] == 1 and h.runner("llm").in_request == 2)
        assert h.sched.ps()[0]["busy"] == 2
        gate.set()
        assert await asyncio.gather(*tasks) == ["ok"] * 3

    run(scenario())


def test_per_model_slots_override_the_default_and_other_engines_take_one() -> None:
    async def scenario() -> None:
        h = harness(LLM, A, slots=4, model_slots=("llm=3",))
        await request(h, "llm")
        await request(h, "a")
        gates = {m: h.machine.holds.setdefault(m, asyncio.Event()) for m in ("llm", "a")}
        tasks = [asyncio.create_task(request(h, m)) for m in ("llm",) * 4 + ("a",) * 2]
        # A granted slot enters the runner's request on the task's next turn: wait for the
        # queue and the requests in flight together, then check nothing more was let through.
        await until(
            lambda: (
                sum(row["waiting"] for row in h.sched.ps()) == 2
                and h.runner("llm").in_request == 3
                and h.runner("a").in_request == 1
            )
        )
        busy = {row["id"]: row["busy"] for row in h.sched.ps()}
        assert busy == {"llm": 3, "a": 1}
        for gate in gates.values():
            gate.set()
        assert await asyncio.gather(*tasks) == ["ok"] * 6

    run(scenario())


def test_a_client_that_gives_up_frees_its_queue_place_and_not_the_load() -> None:
    async def scenario() -> None:
        h = harness(A)
        h.machine.start_gate = asyncio.Event()
        first = asyncio.create_task(request(h, "a"))
        await until(lambda: h.machine.loading == 1)
        first.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await first
        second = asyncio.create_task(request(h, "a"))
        h.machine.start_gate.set()
        assert await second == "ok"
        assert h.machine.starts == ["a"]  # the load went on and served the second client

    run(scenario())


# --- keep-alive


def test_keep_alive_expiry_with_the_clock() -> None:
    async def scenario() -> None:
        h = harness(A, LLM, keep_alive=60, resident_idle=30, ctx=512)
        await request(h, "a")
        await request(h, "llm")
        h.clock.now += 29
        assert await h.sched.tick() == []
        h.clock.now += 2  # resident engine: resident_idle
        assert await h.sched.tick() == ["a"]
        h.clock.now += 30  # mmap engine: keep_alive
        assert await h.sched.tick() == ["llm"]
        assert h.sched.ps() == []
        assert h.sched.counters["evictions_keep_alive"] == 2

    run(scenario())


def test_keep_alive_override_zero_unloads_right_after() -> None:
    async def scenario() -> None:
        h = harness(A)
        await request(h, "a", keep_alive=0)
        await until(lambda: h.sched.ps() == [])
        assert h.runner("a").stops == 1

    run(scenario())


def test_negative_keep_alive_never_expires() -> None:
    async def scenario() -> None:
        h = harness(A)
        await request(h, "a", keep_alive=-1)
        assert h.sched.ps()[0]["expires_at"] is None
        h.clock.now += 10**7
        assert await h.sched.tick() == []
        assert h.loaded() == ["a"]

    run(scenario())


def test_busy_models_do_not_expire() -> None:
    async def scenario() -> None:
        h = harness(A, resident_idle=5)
        await request(h, "a")
        task, gate = await hold_request(h, "a")
        h.clock.now += 100
        assert await h.sched.tick() == []
        gate.set()
        await task

    run(scenario())


def test_start_preloads_and_close_stops_every_runner() -> None:
    async def scenario() -> None:
        h = harness(A, B, preload=("a", "b", "missing"))
        await h.sched.start()  # a preload that fails is logged, not raised
        assert h.loaded() == ["a", "b"]
        await h.sched.close()
        assert h.sched.ps() == []
        assert [r.stops for r in h.runners] == [1, 1]

    run(scenario())


# --- crashes


def test_crash_fails_requests_in_flight_and_the_next_use_restarts() -> None:
    async def scenario() -> None:
        h = harness(A)
        task, gate = await hold_request(h, "a")
        h.runner("a").crash("exit code 1")
        with pytest.raises(RunnerCrashed):
            await task
        gate.set()
        assert h.sched.ps() == [] and h.sched.counters["crashes"] == 1
        assert await request(h, "a") == "ok"  # first crash: restart at once
        assert len(h.runners) == 2
        assert h.sched.ps()[0]["restarts"] == 1

    run(scenario())


def test_repeated_crashes_back_off_doubling() -> None:
    async def scenario() -> None:
        h = harness(A, crash_backoff_initial=10, crash_backoff_max=15)
        await request(h, "a")
        h.runner("a").crash()
        await h.sched.load("a")  # first crash: no backoff
        h.runner("a").crash()  # second in a row: 10 s
        with pytest.raises(RunnerBackoff) as err:
            await request(h, "a")
        assert err.value.retry_after == pytest.approx(10)
        assert "SIGKILL" in err.value.message
        h.clock.now += 10
        await h.sched.load("a")
        h.runner("a").crash()  # third: 20 s, capped at 15
        with pytest.raises(RunnerBackoff) as err:
            await request(h, "a")
        assert err.value.retry_after == pytest.approx(15)
        h.clock.now += 15
        assert await request(h, "a") == "ok"  # a served request resets the streak
        h.runner("a").crash()
        assert await request(h, "a") == "ok"

    run(scenario())


def test_failed_loads_count_toward_backoff() -> None:
    async def scenario() -> None:
        h = harness(A, crash_backoff_initial=10)
        h.machine.fail_starts["a"] = RunnerCrashed("exit code 3")
        for _ in range(2):
            with pytest.raises(RunnerCrashed):
                await request(h, "a")
        with pytest.raises(RunnerBackoff) as err:
            await request(h, "a")
        assert "exit code 3" in err.value.message

    run(scenario())


@pytest.mark.parametrize(
    "failure",
    [
        Unavailable("did not load (load_timeout)", code="load_timeout"),
        Unprocessable("the model file lists no tensors", code="model_has_no_tensors"),
    ],
)
def test_loads_that_time_out_or_cannot_load_count_toward_backoff(failure: Exception) -> None:
    """A chat template that loops while the model loads: each request started a runner
    that spun until load_timeout (180 s of a core each); a GGUF without tensors started a
    runner per request too."""

    async def scenario() -> None:
        h = harness(A, crash_backoff_initial=10)
        h.machine.fail_starts["a"] = failure
        for _ in range(2):
            with pytest.raises(type(failure)):
                await request(h, "a")
        with pytest.raises(RunnerBackoff):
            await request(h, "a")

    run(scenario())


# --- admin: unload, pressure, report


def test_unload_now_or_when_idle() -> None:
    async def scenario() -> None:
        h = harness(A)
        assert (await h.sched.unload("a"))["status"] == "not_loaded"
        task, gate = await hold_request(h, "a")
        assert (await h.sched.unload("a"))["status"] == "unloading_when_idle"
        gate.set()
        await task
        await until(lambda: h.sched.ps() == [])
        await request(h, "a")
        result = await h.sched.unload("a")
        assert result == {"id": "a", "status": "unloaded", "freed": 300 * MiB}

    run(scenario())


def test_paused_loads_wait_then_fail_with_503() -> None:
    async def scenario() -> None:
        # load_pause_wait bounds the wait, not load_timeout: a 503 + Retry-After well
        # before a client's own timeout
        h = harness(A, B, load_pause_wait=1.0)
        await request(h, "a")
        h.pause_loads(True)
        assert await request(h, "a") == "ok"  # loaded models still serve
        start = h.clock.now
        with pytest.raises(MemoryPressure) as err:
            await request(h, "b")
        assert 1.0 <= h.clock.now - start < 2.0
        assert err.value.status == 503 and err.value.retry_after == 5.0
        h.pause_loads(False)
        assert await request(h, "b") == "ok"

    run(scenario())


def test_a_paused_load_that_cannot_fit_is_507_at_once() -> None:
    async def scenario() -> None:
        # Without the guard this load is a 507 at once (nothing evictable makes room); the
        # pause must not turn it into load_pause_wait seconds of waiting for the same answer.
        h = harness(A, M4, pin=("a",), load_pause_wait=1000.0)
        await request(h, "a")
        h.pause_loads(True)
        start = h.clock.now
        with pytest.raises(InsufficientMemory) as err:
            await request(h, "m4")
        assert h.clock.now - start < 2.0 and err.value.status == 507
        assert h.loaded() == ["a"]

    run(scenario())


def test_a_paused_load_resumes_when_the_pause_ends_and_loaded_models_serve_meanwhile() -> None:
    async def scenario() -> None:
        h = harness(A, B, load_pause_wait=1000.0)
        await request(h, "a")
        h.pause_loads(True)
        load = asyncio.create_task(request(h, "b"))
        await until(lambda: h.clock.now > 1001)  # b's load is waiting on the pause
        assert await request(h, "a") == "ok"  # never waits on b's paused load
        assert not load.done() and h.loaded() == ["a"]
        h.pause_loads(False)
        assert await load == "ok"
        assert "b" in h.loaded()

    run(scenario())


def test_guard_view_state_runner_and_inflight() -> None:
    async def scenario() -> None:
        h = harness(A, B)
        await request(h, "b")
        task, gate = await hold_request(h, "a")
        models = {m.id: m for m in h.sched.state().models}
        assert models["a"].busy == 1 and models["b"].busy == 0
        assert models["a"].bytes == 300 * MiB and not models["a"].loading
        # State.limit means one thing everywhere: the load ceiling (less the server's bytes).
        assert h.sched.state().limit == CEILING
        assert h.sched.runner("a") is h.runner("a") and h.sched.runner("c") is None
        (ticket,) = h.sched.inflight()
        assert ticket.model == "a" and ticket.kind is ModelKind.EMBEDDING
        gate.set()
        await task
        assert h.sched.inflight() == []

    run(scenario())


def test_memory_report_shape() -> None:
    async def scenario() -> None:
        h = harness(A)
        await request(h, "a")
        report = h.sched.memory_report()
        assert report["limit"]["value"] == 800 * MiB
        assert report["limit"]["winner"] == "fraction"
        assert report["thresholds"]["soft"] == int(800 * MiB * 0.90)
        assert report["limit"]["rule"] == "host" and report["limit"]["ceiling"] == CEILING
        assert report["committed"] == 300 * MiB and report["ceiling"] == CEILING
        assert report["available"] == CEILING - 300 * MiB
        assert report["pressure"] == "normal"
        assert report["snapshot"]["total"] == 1000 * MiB

    run(scenario())
