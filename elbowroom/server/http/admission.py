"""The guard's gate in front of the API: 503 ``memory_pressure`` + Retry-After while hard.

An ASGI middleware rather than a check in each route: it covers every route that starts
work (text, audio, embeddings, loads), including ones other modules add later, and answers
before the request body is read. Reads (``GET /v1/models``, ``/api/ps``, ``/metrics``)
and ``unload`` (which frees memory) always pass.
"""

from __future__ import annotations

import json
from collections.abc import Callable

from starlette.types import ASGIApp, Receive, Scope, Send

from elbowroom.errors import MemoryPressure
from elbowroom.guard.guard import PressureGuard
from elbowroom.server.http.ollama_paths import OLLAMA_WORK_PATHS, error_body, is_ollama_path


def starts_work(method: str, path: str) -> bool:
    """Requests the guard refuses while hard: every POST under /v1, and model loads."""
    if method != "POST":
        return False
    if path.startswith("/v1/") or path in OLLAMA_WORK_PATHS:
        return True
    return path.startswith("/api/models/") and path.endswith("/load")


class AdmissionMiddleware:
    def __init__(self, app: ASGIApp, guard: Callable[[], PressureGuard | None]) -> None:
        self.app = app
        self._guard = guard

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        guard = self._guard() if scope["type"] == "http" else None
        if guard is None or not starts_work(scope.get("method", ""), scope.get("path", "")):
            await self.app(scope, receive, send)
            return
        try:
            guard.check_admission()
        except MemoryPressure as err:
            guard.counters[("refuse", "hard")] += 1
            ollama = is_ollama_path(scope.get("path", ""))
            body = json.dumps(error_body(err) if ollama else err.to_openai()).encode()
            headers = [
                (b"content-type", b"application/json"),
                (b"content-length", str(len(body)).encode()),
            ]
            headers += [(k.lower().encode(), v.encode()) for k, v in err.headers().items()]
            await send({"type": "http.response.start", "status": err.status, "headers": headers})
            await send({"type": "http.response.body", "body": body})
            return
        await self.app(scope, receive, send)
