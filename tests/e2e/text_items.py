"""A text request's answer as items, read the way the server's relay reads it: ``open``,
then the engine's own events (from its socket, or relayed by a cluster node's agent).

Yields ``{"type": "delta", "text": ...}`` per piece of text and a last ``{"type": "done",
...}`` with the whole answer (text, finish_reason, usage, timings)."""

from __future__ import annotations

from collections.abc import AsyncIterator
from typing import Any

from elbowroom.engines.requests import TextRequest, TextTicket
from elbowroom.runtime.engine_events import text_events
from elbowroom.server.stream.relay import Answer, parse_events


async def text_items(runner: Any, request: TextRequest) -> AsyncIterator[dict[str, Any]]:
    answer = Answer("test", chat_events=request.kind == "chat", block=1)
    emulated = False
    events = text_events(runner, request)
    try:
        async for event in events:
            if isinstance(event, TextTicket):
                emulated = event.emulated_tools
                answer.chat_events = request.kind == "chat" and not event.transcript
                continue
            for chunk in parse_events(event):
                if chunk is None:
                    continue
                piece = answer.take(chunk)
                if piece.text:
                    yield {"type": "delta", "text": piece.text}
        yield {"type": "done", **answer.result(emulated=emulated)}
    finally:
        await events.aclose()
