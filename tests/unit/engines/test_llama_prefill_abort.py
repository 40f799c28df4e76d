"""A long prefill can be left between its prompt batches, before any token: the engine asks
llama.cpp for a progress event per 512-token batch (``return_progress``), so a reader that
closes the connection (a client gone, the relay's hard-pressure abort) is noticed there
(real SmolLM2-135M, in-process)."""

from __future__ import annotations

import json
import threading
import time
from collections.abc import Iterator
from typing import Any

import pytest
import xllamacpp  # noqa: F401  (a hard dependency: a broken install fails, never skips)
from bundled_models import bundled_spec

from elbowroom.engines.llama import N_BATCH, LlamaEngine
from elbowroom.engines.llama_control import _UnixConnection
from elbowroom.engines.options import LlamaOptions
from elbowroom.engines.requests import CloseTicket, TextRequest, TextTicket
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


def test_a_long_prefill_reports_each_batch_so_a_reader_can_leave_before_the_first_token(
    engine: LlamaEngine, level: TurnsHard
) -> None:
    """The relay's hard-pressure abort and a client that leaves both close the engine
    connection; the engine notices a closed reader when it writes, and it writes an event
    per prompt batch (``return_progress``), so a long prefill is not run to its end."""
    level.after = None
    request = TextRequest(kind="completion", prompt=long_prompt(), max_tokens=8, temperature=0)
    ticket = engine.run("open", request, _no_emit, lambda: False)["ticket"]
    assert isinstance(ticket, TextTicket) and ticket.body is not None
    assert ticket.body["return_progress"] is True
    conn = _UnixConnection(ticket.socket or "", 600)
    try:
        headers = {"Authorization": f"Bearer {ticket.key}", "Content-Type": "application/json"}
        conn.request("POST", ticket.path, body=json.dumps(ticket.body), headers=headers)
        response = conn.getresponse()
        assert response.status == 200
        first = next(line for line in response if line.startswith(b"data: "))
    finally:
        conn.close()  # leave inside the prefill
        engine.run("close", CloseTicket(ticket.ticket), _no_emit, lambda: False)
    event = json.loads(first[6:])
    assert "prompt_progress" in event and event["choices"][0]["text"] == ""  # no token yet
    progress = event["prompt_progress"]
    assert progress["processed"] < progress["total"]  # the first batch of several
    # The slot is busy until the engine's loop lets go of the task (issue 28), then goes
    # back by itself: the engine left the prefill once it saw its reader closed.
    deadline = time.monotonic() + 120
    while engine.stats()["slots_busy"] != 0:
        assert time.monotonic() < deadline, "the abandoned prefill's slot never went back"
        time.sleep(0.02)
    # Hard pressure refuses a new generation before it starts (the engine's own check).
    level.calls, level.after = 0, 0
    with pytest.raises(MemoryPressure) as info:
        engine.run("open", request, _no_emit, lambda: False)
    assert info.value.status == 503 and info.value.code == "memory_pressure"
    assert N_BATCH == 512


def _no_emit(_item: Any) -> None:
    raise AssertionError("the llama engine emits nothing over the pipe")
