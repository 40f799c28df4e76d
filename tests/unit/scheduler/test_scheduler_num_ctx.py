"""Ollama's num_ctx above the loaded context: ``Scheduler.fit_context`` reloads the model at
the asked context when the budget allows (after its requests in flight), refuses with the
507 when it does not, and changes nothing for a context the model already has. Over the
fake machine of scheduler_fakes (800 MiB limit, 680 MiB load ceiling; the fake LLM holds
100 MiB + 64 KiB of f16 KV per token and slot, trained on 8192 tokens)."""

from __future__ import annotations

import asyncio

import pytest
from scheduler_fakes import Harness, harness, request, run, spec, until

from elbowroom.engines.options import LlamaOptions
from elbowroom.errors import InsufficientMemory
from elbowroom.models.spec import ModelKind

LLM = spec("llm", ModelKind.LLM, size_mib=100)


def n_ctx(h: Harness) -> int:
    opts = h.runner("llm").options
    assert isinstance(opts, LlamaOptions)
    return opts.n_ctx


def test_a_smaller_num_ctx_changes_nothing_and_a_larger_one_reloads() -> None:
    async def scenario() -> None:
        h = harness(LLM, ctx=2048)
        await request(h, "llm")
        row = await h.sched.fit_context("llm", 1024)
        assert row["n_ctx"] == 2048 and h.machine.starts == ["llm"]
        row = await h.sched.fit_context("llm", 4096)
        assert row["n_ctx"] == 4096 and n_ctx(h) == 4096
        assert h.machine.starts == ["llm", "llm"]
        assert [r["n_ctx"] for r in h.sched.ps()] == [4096]
        # Asked again (Ollama clients send num_ctx on every request): no further reload.
        await h.sched.fit_context("llm", 4096)
        assert h.machine.starts == ["llm", "llm"]

    run(scenario())


def test_the_reload_waits_for_requests_in_flight_and_never_cuts_them() -> None:
    async def scenario() -> None:
        h = harness(LLM, ctx=2048)
        gate = h.machine.holds["llm"] = asyncio.Event()
        held = asyncio.create_task(request(h, "llm"))
        await until(lambda: any(r.in_request for r in h.runners))
        first = h.runner("llm")
        fit = asyncio.create_task(h.sched.fit_context("llm", 4096))
        await until(lambda: h.sched.residency.loaded["llm"].unload_when_idle == "reload")
        assert not fit.done() and h.machine.starts == ["llm"]
        gate.set()
        assert await held == "ok"  # the request in flight finished on the old runner
        row = await fit
        assert row["n_ctx"] == 4096 and h.runner("llm") is not first

    run(scenario())


def test_capped_at_the_trained_context() -> None:
    async def scenario() -> None:
        h = harness(LLM, ctx=1024)
        row = await h.sched.fit_context("llm", 100_000)
        assert row["n_ctx"] == 8192 and n_ctx(h) == 8192

    run(scenario())


def test_a_context_that_cannot_fit_is_a_507_and_the_model_stays_as_it_was() -> None:
    async def scenario() -> None:
        # Two slots: 8192 tokens is 100 MiB + 1 GiB of KV, above the 680 MiB ceiling.
        h = harness(LLM, ctx=1024, slots=2)
        await request(h, "llm")
        with pytest.raises(InsufficientMemory) as err:
            await h.sched.fit_context("llm", 8192)
        assert err.value.status == 507 and err.value.details["model"] == "llm"
        assert h.machine.starts == ["llm"] and [r["n_ctx"] for r in h.sched.ps()] == [1024]
        assert await request(h, "llm") == "ok"

    run(scenario())


def test_not_loaded_too_big_is_a_507_and_the_next_load_is_sized_as_usual() -> None:
    async def scenario() -> None:
        h = harness(LLM, ctx=1024, slots=2)
        with pytest.raises(InsufficientMemory):
            await h.sched.fit_context("llm", 8192)
        assert h.sched.residency.ctx_wanted == {}
        await request(h, "llm")
        assert n_ctx(h) == 1024

    run(scenario())


def test_the_asked_context_lasts_until_the_model_is_unloaded() -> None:
    async def scenario() -> None:
        h = harness(LLM, ctx=1024)
        await h.sched.fit_context("llm", 2048)
        await request(h, "llm")
        assert n_ctx(h) == 2048 and h.machine.starts == ["llm"]
        await h.sched.unload("llm")
        await request(h, "llm")
        assert n_ctx(h) == 1024

    run(scenario())
