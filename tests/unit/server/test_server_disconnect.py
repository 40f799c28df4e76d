"""A client that leaves mid-stream: the runner's request iterator is closed (which is what
cancels the generation in the worker) and the model is released, at once."""

from __future__ import annotations

import asyncio
import json
from typing import Any

from server_fakes import http_scope, services

from elbowroom.server.app import create_app


def test_disconnect_mid_stream_closes_the_runner_request() -> None:
    svc, scheduler = services()
    scheduler.script.hang_after_first = True
    app = create_app(svc.settings, services=svc)
    body = json.dumps(
        {"model": "smollm2-135m", "messages": [{"role": "user", "content": "x"}], "stream": True}
    ).encode()
    first_token = asyncio.Event()
    sent: list[dict[str, Any]] = []
    pending = [{"type": "http.request", "body": body, "more_body": False}]

    async def receive() -> dict[str, Any]:
        if pending:
            return pending.pop()
        await first_token.wait()  # the client leaves once it has seen a token
        return {"type": "http.disconnect"}

    async def send(message: dict[str, Any]) -> None:
        sent.append(message)
        if b'"content":"Hel"' in message.get("body", b""):
            first_token.set()

    scope = http_scope(
        "/v1/chat/completions", [(b"content-type", b"application/json"), (b"host", b"localhost")]
    )

    async def run() -> None:
        # The runner hangs after its first piece: only the disconnect can end this call.
        await asyncio.wait_for(app(scope, receive, send), timeout=30)

    asyncio.run(run())
    assert sent[0]["status"] == 200
    assert scheduler.closed == 1  # the runner's iterator was closed (generation cancelled)
    assert scheduler.released == [None]  # and the model handed back as a normal release
