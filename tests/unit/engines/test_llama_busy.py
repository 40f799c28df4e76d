"""A request the client left stays busy until the engine's loop lets go of it."""

from __future__ import annotations

import threading
import time
from typing import Any

import pytest

from elbowroom.engines.llama import LlamaEngine
from elbowroom.engines.llama_control import EngineControl
from elbowroom.engines.requests import CloseTicket

DEADLINE = 30.0


def wait_until(condition: Any, what: str) -> None:
    deadline = time.monotonic() + DEADLINE
    while not condition():
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out waiting for {what}")
        time.sleep(0.01)


class Pool:
    def release(self, slot: int) -> None: ...

    def erase(self, slot: int) -> None: ...

    def observe_prefill(self, timings: dict[str, Any]) -> None: ...

    def stats(self) -> dict[str, Any]:
        return {}


class HeldLoop:
    """The engine control, with the engine's loop held (a grammar being set up) until
    ``go`` is set."""

    def __init__(self) -> None:
        self.asked: list[int] = []
        self.go = threading.Event()

    def wait_slot_idle(self, slot: int) -> None:
        self.asked.append(slot)
        assert self.go.wait(DEADLINE)

    def cleanup(self) -> None: ...


def engine_with_tickets(control: HeldLoop) -> LlamaEngine:
    engine = LlamaEngine()
    engine._server = object()
    engine._slot_pool = Pool()  # type: ignore[assignment]
    engine._control = control  # type: ignore[assignment]
    engine._tickets = {1: (0, False), 2: (1, False)}
    engine._active = 2
    return engine


def busy(engine: LlamaEngine) -> int:
    return int(engine.stats()["slots_busy"])


def test_a_direct_stream_its_client_left_is_busy_until_the_engine_lets_go() -> None:
    """The engine set up a request's grammar on its loop after the client had left: the
    direct stream's close gave the slot back at once, so /api/elbowroom/ps and the
    dashboard said idle while the engine still worked. The close still answers at once
    (the scheduler's claim goes, so an unload can end a stuck engine)."""
    control = HeldLoop()
    engine = engine_with_tickets(control)
    closed = engine.run("close", CloseTicket(1, None), lambda _: None, lambda: False)
    assert closed == {"closed": True}
    wait_until(lambda: control.asked == [0], "the engine's loop to be asked")
    assert busy(engine) == 2
    control.go.set()
    wait_until(lambda: busy(engine) == 1, "the slot to be given back")


def test_a_finished_stream_gives_its_slot_back_at_once() -> None:
    control = HeldLoop()
    engine = engine_with_tickets(control)
    timings = {"prompt_n": 3, "prompt_ms": 1.0}
    assert engine.run("close", CloseTicket(2, timings), lambda _: None, lambda: False) == {
        "closed": True
    }
    assert control.asked == [] and busy(engine) == 1


def test_wait_slot_idle_asks_again_while_the_slot_processes(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    answers: list[Any] = [
        TimeoutError("the loop is held"),
        [{"id": 0, "is_processing": False}, {"id": 1, "is_processing": True}],
        [{"id": 1, "is_processing": True}],
        [{"id": 1, "is_processing": False}],
        AssertionError("asked once too often"),
    ]

    def request(self: EngineControl, method: str, path: str, body: Any = None) -> Any:
        assert (method, path) == ("GET", "/slots")
        answer = answers.pop(0)
        if isinstance(answer, BaseException):
            raise answer
        return answer

    monkeypatch.setattr(EngineControl, "request", request)
    control = EngineControl()
    try:
        control.wait_slot_idle(1, poll=0)
        assert len(answers) == 1
        answers[:] = [FileNotFoundError("engine gone")]
        control.wait_slot_idle(1, poll=0)  # an engine that is gone holds nothing
        assert answers == []
    finally:
        control.cleanup()
