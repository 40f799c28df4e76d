"""A whole text answer from an in-process engine, read the way the server's relay reads it:
``open``, the engine's own events from its socket, then ``close`` with the timings."""

from __future__ import annotations

import json
from typing import Any

from elbowroom.engines.llama import translate_error
from elbowroom.engines.llama_control import _UnixConnection
from elbowroom.engines.requests import CloseTicket, TextRequest, TextTicket
from elbowroom.server.stream.relay import Answer


def engine_answer(engine: Any, request: TextRequest) -> dict[str, Any]:
    ticket = engine.run("open", request, lambda _d: None, lambda: False)["ticket"]
    assert isinstance(ticket, TextTicket) and ticket.socket is not None
    answer = Answer("test", chat_events=request.kind == "chat" and not ticket.transcript, block=1)
    conn = _UnixConnection(ticket.socket, 600)
    try:
        headers = {"Authorization": f"Bearer {ticket.key}", "Content-Type": "application/json"}
        conn.request("POST", ticket.path, body=json.dumps(ticket.body), headers=headers)
        response = conn.getresponse()
        if response.status != 200:
            err = json.loads(response.read()).get("error") or {}
            raise translate_error({"code": response.status, **err})
        for line in response:
            if line.startswith(b"data: ") and line.strip() != b"data: [DONE]":
                answer.take(json.loads(line[6:]))
    finally:
        conn.close()
        closing = CloseTicket(ticket.ticket, answer.timings or None)
        engine.run("close", closing, lambda _d: None, lambda: False)
    return answer.result(emulated=ticket.emulated_tools)
