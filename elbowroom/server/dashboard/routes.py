"""The dashboard: a static page at /ui that polls /api/elbowroom/dashboard, and the
middleware that puts the 503 and 507 answers the server sends into the event log.

The page is plain HTML, CSS and JavaScript from elbowroom/server/dashboard/static (no build step, no
external request: the Content-Security-Policy allows only this server). It is served
without the API key, because it holds no data; its requests to /api carry the key the
user types in.
"""

from __future__ import annotations

import json
import time
from importlib import resources
from typing import Any

from fastapi import APIRouter, Request
from fastapi.responses import PlainTextResponse, RedirectResponse, Response
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from elbowroom.server import admin_routes
from elbowroom.server.dashboard import state as dashboard_state
from elbowroom.server.deps import get_services

router = APIRouter()

STATIC = {
    "dashboard.js": "text/javascript; charset=utf-8",
    "dashboard.css": "text/css; charset=utf-8",
}
# Only this server: no CDN, no fonts, no beacons.
HEADERS = {
    "Content-Security-Policy": "default-src 'self'; img-src 'self' data:; "
    "style-src 'self'; script-src 'self'; connect-src 'self'",
    "Cache-Control": "no-cache",
    "X-Content-Type-Options": "nosniff",
}


def _static(name: str) -> bytes:
    return resources.files("elbowroom.server.dashboard").joinpath("static", name).read_bytes()


@router.get("/", include_in_schema=False)
async def root(request: Request) -> Response:
    """Browsers go to the dashboard; API clients probing the server get a line of text
    (Ollama clients check that / answers 200)."""
    if "text/html" in request.headers.get("accept", ""):
        return RedirectResponse("/ui", status_code=307)
    return PlainTextResponse("elbowroom is running (OpenAI API under /v1, Ollama API under /api)")


@router.head("/", include_in_schema=False)
async def root_head() -> Response:
    return Response(status_code=200)


@router.get("/ui", include_in_schema=False)
async def page() -> Response:
    html = _static("dashboard.html")
    return Response(html, media_type="text/html; charset=utf-8", headers=HEADERS)


@router.get("/ui/{name}", include_in_schema=False)
async def asset(name: str) -> Response:
    media = STATIC.get(name)
    if media is None:
        return PlainTextResponse("not found", status_code=404)
    return Response(_static(name), media_type=media, headers=HEADERS)


@router.get("/api/elbowroom/dashboard")
async def dashboard(request: Request, since: float = 0.0) -> dict[str, Any]:
    """Everything the dashboard draws; ``since`` (a wall time) returns only newer samples."""
    services = get_services(request)
    scheduler = services.scheduler
    rows = await admin_routes.ps_rows(services)
    monitor = services.monitor
    guard = services.guard
    catalog = [
        {"id": s.id, "kind": str(s.kind), "engine": s.engine, "size": s.size_bytes}
        for s in services.catalog.list()
    ]
    window = dashboard_state.WINDOW_SECONDS
    return dashboard_state.build(
        report=scheduler.memory_report(),
        rows=rows,
        samples=monitor.history() if monitor is not None else [],
        scheduler_events=[e.to_dict() for e in scheduler.events.recent(window)],
        guard_events=[e.to_dict() for e in guard.events()] if guard is not None else [],
        guard_state=guard.state() if guard is not None else None,
        catalog=catalog,
        counters=dict(getattr(scheduler, "counters", {})),
        now_wall=time.time(),
        since=since,
        latest=getattr(monitor, "latest", None),
    )


class RefusalEvents:
    """Records every 503 and 507 response in the scheduler's event log (what the client
    was told, with the model and the numbers of the error body)."""

    def __init__(self, app: ASGIApp, events: Any) -> None:
        self.app = app
        self._events = events  # () -> EventLog | None

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        status = 0
        body = bytearray()

        async def tee(msg: Message) -> None:
            nonlocal status
            if msg["type"] == "http.response.start":
                status = int(msg["status"])
            elif msg["type"] == "http.response.body" and status in (503, 507):
                body.extend(msg.get("body", b"")[: 8192 - len(body)])
            await send(msg)

        try:
            await self.app(scope, receive, tee)
        finally:
            if status in (503, 507):
                self._record(status, scope, bytes(body))

    def _record(self, status: int, scope: Scope, body: bytes) -> None:
        log = self._events()
        if log is None:
            return
        try:
            parsed = json.loads(body)
        except ValueError:
            parsed = {}
        err = parsed.get("error") if isinstance(parsed, dict) else None
        details: dict[str, Any] = {}
        if isinstance(err, dict):  # OpenAI's shape
            message = str(err.get("message", ""))
            details = err
        else:  # Ollama's shape
            message = str(err or "")
            details = parsed if isinstance(parsed, dict) else {}
        model = details.get("model") if isinstance(details.get("model"), str) else None
        numbers = {
            k: details[k]
            for k in ("needed", "available", "limit", "shortfall", "retry_after")
            if isinstance(details.get(k), int | float)
        }
        log.add(
            f"refused_{status}",
            model,
            message or f"{status}",
            path=scope.get("path", ""),
            status=status,
            **numbers,
        )
