"""A text answer from an in-process engine, read the way the server's relay reads it:
``open``, the engine's own events from its socket (stopping early closes the connection),
then ``close`` — with the timings for a whole answer, without for one that ended early."""

from __future__ import annotations

import json
from collections.abc import Callable
from typing import Any

from elbowroom.engines.llama import translate_error
from elbowroom.engines.llama_control import _UnixConnection
from elbowroom.engines.requests import CloseTicket, TextRequest, TextTicket
from elbowroom.server.stream.relay import Answer


def no_emit(_item: dict[str, Any]) -> None:
    raise AssertionError("the llama engine emits nothing over the pipe")


def engine_run(
    engine: Any,
    request: TextRequest,
    cancel_after: int | None = None,
    on_piece: Callable[[str], None] | None = None,
) -> tuple[dict[str, Any], list[str]]:
    """The answer and its text deltas; ``cancel_after`` deltas, the reader leaves."""
    ticket = engine.run("open", request, no_emit, lambda: False)["ticket"]
    assert isinstance(ticket, TextTicket) and ticket.socket is not None
    deltas: list[str] = []
    answer = Answer("m", chat_events=request.kind == "chat" and not ticket.transcript, block=1)
    cancelled = False
    timings: dict[str, Any] | None = None  # the last chunk's: an answer that ended whole
    conn = _UnixConnection(ticket.socket, 600)
    try:
        headers = {"Authorization": f"Bearer {ticket.key}", "Content-Type": "application/json"}
        conn.request("POST", ticket.path, body=json.dumps(ticket.body), headers=headers)
        response = conn.getresponse()
        if response.status != 200:
            err = json.loads(response.read()).get("error") or {}
            raise translate_error({"code": response.status, **err})
        for line in response:
            if not line.startswith(b"data: ") or line.strip() == b"data: [DONE]":
                continue
            chunk = json.loads(line[6:])
            if isinstance(chunk.get("timings"), dict):
                timings = chunk["timings"]
            piece = answer.take(chunk)
            if piece.text:
                deltas.append(piece.text)
                if on_piece is not None:
                    on_piece(piece.text)
            if cancel_after is not None and len(deltas) >= cancel_after:
                cancelled = True
                break
    finally:
        conn.close()  # the engine cancels a generation whose reader left
        closing = CloseTicket(ticket.ticket, None if cancelled else timings)
        engine.run("close", closing, no_emit, lambda: False)
    result = answer.result(emulated=ticket.emulated_tools)
    if cancelled:
        result["finish_reason"] = "cancelled"
    return result, deltas


def engine_answer(engine: Any, request: TextRequest) -> dict[str, Any]:
    return engine_run(engine, request)[0]
