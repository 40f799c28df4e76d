"""The vision gate and settle in the scheduler's load path, over the fake machine (limit
800 MiB, load ceiling 680 MiB; scheduler_fakes.harness). Vision models are fake LLMs with a
projector; the fake estimate is weights + 64 KiB of KV per token."""

from __future__ import annotations

import dataclasses
import logging
from pathlib import Path

import pytest
from scheduler_fakes import harness, request, run, spec

from elbowroom.errors import InsufficientMemory
from elbowroom.memory.types import Snapshot
from elbowroom.models.spec import ModelKind, ModelSpec, Projector
from elbowroom.units import MiB

LIMIT = 800 * MiB
PROJ = Projector(Path("/fake/mmproj.gguf"), "gemma3", 448, 14, 192, 384, 2, 4, 2, 4 * MiB, 256)


def seeing(model_id: str, size_mib: int) -> ModelSpec:
    return dataclasses.replace(spec(model_id, ModelKind.LLM, size_mib), projector=PROJ)


def test_vision_model_above_the_gate_is_507_and_a_text_model_only_warned(
    caplog: pytest.LogCaptureFixture,
) -> None:
    # 300 MiB + 1024 tokens x 64 KiB = 364 MiB... x 4 slots: 556 MiB; the gate is 560 MiB.
    vision, text = seeing("v", 300), spec("t", ModelKind.LLM, 300)

    async def scenario() -> None:
        h = harness(vision, text, ctx=1024, slots=5)  # 300 + 320 = 620 MiB: above 560
        with pytest.raises(InsufficientMemory) as info:
            await request(h, "v")
        err = info.value
        assert err.code == "vision_gate" and err.details["needed"] == 620 * MiB
        assert err.details["pool_limit"] == LIMIT and err.details["vision_gate"] == 0.70
        assert h.machine.starts == [] and h.sched.counters["refusals_507"] == 1
        with caplog.at_level(logging.WARNING):
            await request(h, "t")  # the same bytes as text: loaded (under the ceiling)
        assert h.machine.starts == ["t"]
        assert "t needs 620.0 MiB, 78% of the 800.0 MiB memory limit" in caplog.text

    run(scenario())


def test_vision_context_is_auto_sized_inside_the_gate() -> None:
    vision, text = seeing("v", 100), spec("t", ModelKind.LLM, 100)

    async def scenario() -> None:
        h = harness(vision, text)
        await request(h, "t")
        # Text: the whole trained context (100 + 512 MiB under the 680 MiB ceiling).
        assert h.sched.ps()[0]["n_ctx"] == 8192
        await request(h, "v")  # t is evicted to make room
        (row,) = h.sched.ps()
        # Vision: as large as fits 70 % of the limit (560 MiB): 7168 tokens, 548 MiB.
        assert row["id"] == "v" and row["n_ctx"] == 7168 and row["predicted"] <= 0.70 * LIMIT

    run(scenario())


def test_switching_to_a_vision_model_waits_for_the_larger_margin(
    caplog: pytest.LogCaptureFixture,
) -> None:
    async def scenario() -> None:
        h = harness(unload_settle_timeout=5.0)
        start, plain = h.clock.now, h.sched.residency._probe

        def probe() -> Snapshot:
            # Freed memory comes back in steps: 300, then 550, then 600 MiB available.
            waited = h.clock.now - start
            h.machine.other = (700 if waited < 1 else 450 if waited < 2 else 400) * MiB
            return plain()

        h.sched.residency._probe = probe
        factor = h.sched.settings.vision_settle_factor  # 1.5
        # 1.5 x 400 MiB = 600 MiB; the eviction could give back 300 + 500.
        await h.sched.residency._settle().vision("v", 400 * MiB, 300 * MiB, 500 * MiB, factor)
        assert 2.0 <= h.clock.now - start < 2.2
        h.sched.residency._probe = plain
        # Never enough: the wait ends at the deadline with a warning, and the load goes on.
        h.machine.other = 900 * MiB
        start = h.clock.now
        with caplog.at_level(logging.WARNING):
            await h.sched.residency._settle().vision("v", 400 * MiB, 100 * MiB, 500 * MiB, factor)
        assert h.clock.now - start >= 5.0
        assert "the vision settle waits for" in caplog.text

    run(scenario())
