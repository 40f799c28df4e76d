"""Hard pressure aborts a long prefill between its prompt batches, before any token: the
engine asks llama.cpp for a progress chunk per 512-token batch (``return_progress``) and
ends the task from that callback (real SmolLM2-135M, in-process)."""

from __future__ import annotations

import threading
from collections.abc import Iterator
from typing import Any

import pytest
import xllamacpp  # noqa: F401  (a hard dependency: a broken install fails, never skips)
from bundled_models import bundled_spec

from elbowroom.engines.llama import N_BATCH, LlamaEngine
from elbowroom.engines.options import LlamaOptions
from elbowroom.engines.requests import TextRequest
from elbowroom.errors import MemoryPressure

pytestmark = pytest.mark.slow


class TurnsHard:
    """Normal for the first ``calls`` polls (the check before a request starts), hard after:
    memory turns hard once the prefill is under way."""

    def __init__(self) -> None:
        self.calls = 0
        self.after: int | None = None  # None: never hard
        self.lock = threading.Lock()

    def __call__(self) -> int:
        with self.lock:
            self.calls += 1
            return 2 if self.after is not None and self.calls > self.after else 0


@pytest.fixture(scope="module")
def level() -> TurnsHard:
    return TurnsHard()


@pytest.fixture(scope="module")
def engine(level: TurnsHard) -> Iterator[LlamaEngine]:
    eng = LlamaEngine(level)
    eng.load(
        bundled_spec("smollm2-135m"),
        LlamaOptions(n_ctx=2048, slots=1, cache_ram_bytes=0, threads=2),
    )
    yield eng
    eng.close()


def long_prompt() -> str:
    """~1,800 tokens: four prompt batches."""
    return "Repeat after me: " + ", ".join(str(n) for n in range(1000, 1290))


def test_hard_pressure_mid_prefill_aborts_before_the_first_token(
    engine: LlamaEngine, level: TurnsHard
) -> None:
    deltas: list[Any] = []
    request = TextRequest(kind="completion", prompt=long_prompt(), max_tokens=8, temperature=0)
    level.calls, level.after = 0, 1  # the start check passes; the first batch's poll is hard
    with pytest.raises(MemoryPressure) as info:
        engine.run("completion", request, deltas.append, lambda: False)
    assert info.value.status == 503 and info.value.code == "memory_pressure"
    assert deltas == []  # no token: it ended inside the prefill
    assert level.calls == 2  # the start check and one batch's progress: the first batch
    # The slot is free again: the next request (normal pressure) runs to its end.
    level.after = None
    out = engine.run(
        "completion",
        TextRequest(kind="completion", prompt="1, 2, 3,", max_tokens=3, temperature=0),
        lambda _: None,
        lambda: False,
    )
    assert out["usage"]["completion_tokens"] == 3
    assert N_BATCH == 512
