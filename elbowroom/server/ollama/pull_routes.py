"""Ollama's ``/api/pull`` and ``/api/delete``: models from the Hugging Face Hub (docs/pull.md).

``POST /api/pull {"model": "hf.co/USER/REPO[:QUANT]"}`` runs `elbowroom pull` in the server:
the same choice, the same fit check before the first byte of weights, the same download.
With ``stream`` (the default) it answers Ollama's progress objects, one JSON object a line
(``pulling manifest``, ``downloading FILE`` with ``digest``/``total``/``completed``,
``verifying sha256 digest``, ``writing manifest``, ``success``); with ``stream: false`` one
``{"status": "success"}``. Whatever fails before the download (unknown repo or quant, a
model that can never fit here, no disk space) is an HTTP error in Ollama's shape with its
status (404, 400, 507...); a failure during the download is an ``{"error": ...}`` line, as
Ollama sends it. A client that goes away stops the download; the partial file is kept and
the next pull resumes it. The new model is in the catalog when ``success`` is sent.

``DELETE /api/delete {"model": ID}`` unloads the model if it is loaded and deletes it; only
models elbowroom pulled can be deleted.

Both change what the server serves: admin operations (the admin key when one is set:
server/http/auth.py), and never for a web page of another origin, even one ``allowed_origins``
lists (a page may use models, not fetch or delete them).
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import threading
from collections.abc import AsyncIterator, Callable, Coroutine
from typing import Any

from fastapi import APIRouter, Request
from fastapi.responses import JSONResponse, Response, StreamingResponse
from pydantic import BaseModel, ConfigDict
from starlette.exceptions import HTTPException

from elbowroom.errors import BadRequest, ElbowroomError, Forbidden
from elbowroom.server.deps import Services, get_services
from elbowroom.server.http.ollama_paths import error_body
from elbowroom.server.http.origin import _same_origin
from elbowroom.server.ollama.routes import OllamaRoute, ollama_error

log = logging.getLogger("elbowroom.server")


class _Route(OllamaRoute):
    """Ollama's error shape also for a body FastAPI cannot decode at all (bytes that are not
    UTF-8: its HTTPException, which the app would answer in OpenAI's shape)."""

    def get_route_handler(self) -> Callable[[Request], Coroutine[Any, Any, Response]]:
        handler = super().get_route_handler()

        async def route(request: Request) -> Response:
            try:
                return await handler(request)
            except HTTPException as exc:
                if exc.status_code != 400:
                    raise
                return ollama_error(BadRequest(f"{exc.detail}: send a JSON object"))

        return route


router = APIRouter(prefix="/api", route_class=_Route)


class PullBody(BaseModel):
    model_config = ConfigDict(extra="forbid")
    model: str | None = None
    name: str | None = None  # Ollama's older field
    insecure: bool | None = None  # Ollama's registry option: no meaning for the Hub
    stream: bool = True
    # elbowroom's: as `elbowroom pull --force / --file / --revision`
    force: bool = False
    file: str | None = None
    revision: str | None = None


class DeleteBody(BaseModel):
    model_config = ConfigDict(extra="forbid")
    model: str | None = None
    name: str | None = None


def _name(body: PullBody | DeleteBody) -> str:
    name = body.model or body.name
    if not name:
        raise BadRequest("model is required", param="model")
    return name


def _same_origin_only(request: Request) -> None:
    origin = request.headers.get("origin")
    host = request.headers.get("host")
    if origin is not None and (host is None or not _same_origin(origin, host)):
        raise Forbidden(
            f"{request.url.path} changes the models this server has: web pages of another "
            f"origin ({origin}) may not use it, even when allowed_origins lists them",
            code="origin_not_allowed",
        )


def _refresh_catalog(services: Services) -> None:
    from elbowroom.models.catalog import Catalog, discover

    catalog = services.catalog
    if isinstance(catalog, Catalog):
        catalog.refresh_from(discover(services.settings))


async def _in_thread(fn: Callable[..., Any], *args: Any, **kw: Any) -> Any:
    """``fn`` in a daemon thread: a download must not hold the server's exit up (the
    default executor's threads are joined at exit); one cut short resumes next time."""
    loop = asyncio.get_running_loop()
    future: asyncio.Future[Any] = loop.create_future()

    def settle(ok: bool, value: Any) -> None:
        if future.done():
            return
        if ok:
            future.set_result(value)
        else:
            future.set_exception(value)

    def run() -> None:
        try:
            ok, value = True, fn(*args, **kw)
        except BaseException as exc:
            ok, value = False, exc
        with contextlib.suppress(RuntimeError):  # the loop closed: the server is gone
            loop.call_soon_threadsafe(settle, ok, value)

    threading.Thread(target=run, name="elbowroom-pull", daemon=True).start()
    return await future


def _lock(request: Request) -> asyncio.Lock:
    """One pull or delete at a time per server: the catalog changes under them."""
    lock: asyncio.Lock | None = getattr(request.app.state, "pull_lock", None)
    if lock is None:
        lock = request.app.state.pull_lock = asyncio.Lock()
    return lock


@router.post("/pull")
async def pull(request: Request, body: PullBody) -> Response:
    _same_origin_only(request)
    services = get_services(request)
    name = _name(body)
    from elbowroom.pull.puller import Puller

    loop = asyncio.get_running_loop()
    queue: asyncio.Queue[dict[str, Any] | None] = asyncio.Queue()

    def progress(event: dict[str, Any]) -> None:
        if event.get("status") != "success":  # sent once the catalog has the model
            loop.call_soon_threadsafe(queue.put_nowait, event)

    puller = Puller(services.settings, progress=progress)
    lock = _lock(request)
    await lock.acquire()
    try:
        # Before any response: a refusal is an HTTP error with its status.
        plan = await _in_thread(
            puller.plan, name, file=body.file, revision=body.revision, force=body.force
        )
    except BaseException:
        lock.release()
        raise
    # The download runs to its end (or its cancel) whatever the response does; the lock is
    # released when it has, so no other pull writes the same partial file meanwhile.
    task = asyncio.ensure_future(_download(services, puller, plan))

    def finished(t: asyncio.Future[Any]) -> None:
        lock.release()
        queue.put_nowait(None)
        if not t.cancelled():
            t.exception()  # retrieved: the response reports it

    task.add_done_callback(finished)
    if not body.stream:
        try:
            result = await asyncio.shield(task)
        except asyncio.CancelledError:
            puller.cancel.set()
            raise
        return JSONResponse({"status": "success", "model": result.model_id})
    return StreamingResponse(_stream(puller, plan, task, queue), media_type="application/x-ndjson")


async def _download(services: Services, puller: Any, plan: Any) -> Any:
    result = await _in_thread(puller.download, plan)
    _refresh_catalog(services)
    return result


async def _stream(
    puller: Any,
    plan: Any,
    task: asyncio.Future[Any],
    queue: asyncio.Queue[dict[str, Any] | None],
) -> AsyncIterator[bytes]:
    try:
        while True:
            event = await queue.get()
            if event is None:
                break
            yield _line(event)
        try:
            result = task.result()
        except ElbowroomError as err:
            yield _line(error_body(err))
            return
        except Exception as exc:  # a failure we did not foresee still ends the stream
            log.error("pull of %s failed: %s: %s", plan.repo_id, type(exc).__name__, exc)
            yield _line({"error": f"pull failed: {type(exc).__name__}: {exc}"})
            return
        yield _line({"status": "success", "model": result.model_id})
    finally:
        if not task.done():  # the client went away: stop the download, keep the part
            puller.cancel.set()


def _line(obj: dict[str, Any]) -> bytes:
    return json.dumps(obj, separators=(",", ":"), default=str).encode() + b"\n"


@router.delete("/delete")
async def delete(request: Request, body: DeleteBody) -> Response:
    _same_origin_only(request)
    services = get_services(request)
    name = _name(body)
    from elbowroom.pull.puller import check_pulled, pulled_specs, remove

    catalog = services.catalog
    async with _lock(request):
        specs = pulled_specs(services.settings, catalog, name)
        for spec in specs:  # before anything is unloaded: a bundled model is a 400
            check_pulled(services.settings, spec)
        for spec in specs:
            if services.scheduler.runner(spec.id) is not None:
                await services.scheduler.unload(spec.id)
        removed = [await asyncio.to_thread(remove, services.settings, s) for s in specs]
        _refresh_catalog(services)
    return JSONResponse({"status": "success", "deleted": [r.model_id for r in removed]})
