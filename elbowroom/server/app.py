"""The app factory: routes, error handlers, auth, and the services' lifetime.

``create_app(settings)`` builds the real services (catalog, probe, monitor, scheduler) in the
lifespan and closes them on shutdown, which stops every runner process. Tests that isolate
the HTTP layer pass ready ``services`` instead; the app then neither starts nor closes them.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import AsyncIterator, Awaitable, Callable
from contextlib import asynccontextmanager
from typing import Any

from fastapi import FastAPI

from elbowroom import __version__
from elbowroom.config import Settings
from elbowroom.errors import ElbowroomError
from elbowroom.memory.process import ServerBytes
from elbowroom.memory.types import Probe
from elbowroom.server import admin_routes
from elbowroom.server.dashboard import routes as dashboard_routes
from elbowroom.server.deps import Services
from elbowroom.server.errors import install_error_handlers
from elbowroom.server.http import metrics
from elbowroom.server.http.admission import AdmissionMiddleware
from elbowroom.server.http.auth import ApiKeyMiddleware, Keys
from elbowroom.server.http.limits import BodyGate
from elbowroom.server.http.metrics import MetricsMiddleware
from elbowroom.server.http.origin import OriginMiddleware, OriginPolicy
from elbowroom.server.ollama import pull_routes
from elbowroom.server.ollama import routes as ollama_routes
from elbowroom.server.openai import audio_routes, embeddings_routes, responses_routes
from elbowroom.server.openai import routes as openai_routes

log = logging.getLogger("elbowroom.server")

OnReady = Callable[[Services], Awaitable[None] | None]


def create_app(
    settings: Settings,
    *,
    services: Services | None = None,
    on_ready: OnReady | None = None,
    probe: Probe | None = None,
) -> FastAPI:
    """``probe`` replaces the platform's memory probe (tests run a fake machine with it)."""

    @asynccontextmanager
    async def lifespan(app: FastAPI) -> AsyncIterator[None]:
        if services is not None:
            yield
            return
        built = await start_services(settings, probe=probe)
        app.state.services = built
        try:
            if on_ready is not None:
                result = on_ready(built)
                if result is not None:
                    await result
            yield
        finally:
            await stop_services(built)

    app = FastAPI(
        title="elbowroom",
        version=__version__,
        lifespan=lifespan,
        docs_url=None,
        redoc_url=None,
    )
    if services is not None:
        app.state.services = services
    install_error_handlers(app)
    # Starlette runs the middleware added last first: Host/Origin (a foreign web page gets
    # nothing, not even a 401), the API key (nothing unauthenticated gets further, not
    # even into metrics labels), metrics (which so also counts the refusals after it), the
    # guard's admission gate (503 under hard memory pressure, before the body is read),
    # then the body gate (content type, sizes, bounded parsing; docs/security.md).
    app.add_middleware(BodyGate, settings=settings)
    app.add_middleware(AdmissionMiddleware, guard=lambda: _guard_of(app))
    # Outside the guard's gate, so its 503s are on the dashboard's timeline too.
    app.add_middleware(dashboard_routes.RefusalEvents, events=lambda: _events_of(app))
    app.add_middleware(MetricsMiddleware)
    keys = Keys.from_settings(settings)
    if keys.any:
        app.add_middleware(ApiKeyMiddleware, keys=keys)
    app.add_middleware(OriginMiddleware, policy=OriginPolicy.from_settings(settings))

    @app.get("/health", include_in_schema=False)
    async def health() -> dict[str, str]:
        return {"status": "ok"}

    app.include_router(openai_routes.router)
    app.include_router(admin_routes.router)
    app.include_router(ollama_routes.router)
    app.include_router(dashboard_routes.router)
    app.include_router(audio_routes.router)
    app.include_router(embeddings_routes.router)
    app.include_router(metrics.router)
    app.include_router(pull_routes.router)  # /api/pull, /api/delete (docs/pull.md)
    app.include_router(responses_routes.router)
    return app


def _guard_of(app: FastAPI) -> Any:
    services: Services | None = getattr(app.state, "services", None)
    return services.guard if services is not None else None


def _events_of(app: FastAPI) -> Any:
    services: Services | None = getattr(app.state, "services", None)
    return getattr(services.scheduler, "events", None) if services is not None else None


async def start_services(settings: Settings, *, probe: Probe | None = None) -> Services:
    """Discover models, start the memory monitor, the pressure guard and the scheduler, and
    load what ``preload`` / ``pin`` ask for. Unknown ids there stop the start (a typo should
    not go unnoticed); a model that cannot be loaded is logged and served later on demand."""
    from elbowroom.guard.adapter import SchedulerTarget
    from elbowroom.guard.guard import PressureGuard
    from elbowroom.memory.probe import default_probe
    from elbowroom.models.catalog import discover
    from elbowroom.runtime.supervisor import supervisor_factory
    from elbowroom.scheduler.loop import Scheduler

    catalog = discover(settings)
    for model_id in (*settings.preload, *settings.pin):
        catalog.get(model_id)  # ModelNotFound names the id
    if settings.cluster:  # docs/cluster.md; Ray is imported only here
        from elbowroom.cluster.connect import start_cluster

        router, monitor, guard = await start_cluster(settings, catalog, _measured_store(settings))
        services = Services(settings, catalog, router, monitor=monitor, guard=guard)
        try:
            await load_pinned(router.load, settings.pin)
        except BaseException:
            await stop_services(services)  # the router's close ends the cluster's services
            raise
        return services
    # The pressure watch listens to this machine's kernel: not for an injected probe.
    default_probe_used = probe is None
    if probe is None:
        probe = default_probe(settings)
    # The scheduler builds the memory monitor (its own usage is the scheduler's runners
    # plus this process's bytes); the server runs its thread and the guard listens to it.
    scheduler = Scheduler(
        settings,
        catalog,
        probe=probe,
        runner_factory=supervisor_factory(settings),
        measured=_measured_store(settings),
        server_usage=SERVER_BYTES,
    )
    monitor = scheduler.monitor
    guard = PressureGuard(
        SchedulerTarget(scheduler),
        enabled=settings.memory_guard,
        budget=monitor.cfg,
        horizon=settings.pressure_horizon,
    )
    monitor.subscribe(guard.on_sample)
    services = Services(settings, catalog, scheduler, monitor=monitor, guard=guard)
    try:
        await guard.start()
        monitor.start()
        if settings.memory_guard and settings.pressure_events and default_probe_used:
            guard.watch_with(monitor.sample_now, settings.pressure_fast_interval)
        await scheduler.start()  # loads settings.preload
        await load_pinned(scheduler.load, settings.pin)
    except BaseException:
        await stop_services(services)
        raise
    return services


async def load_pinned(load: Callable[..., Awaitable[Any]], pins: tuple[str, ...]) -> None:
    """Load and pin each of ``pins`` with ``load`` (a scheduler's, or the cluster router's);
    one that cannot load is logged and the server starts without it."""
    for model_id in pins:
        try:
            await load(model_id, pin=True)
        except ElbowroomError as exc:
            log.error("cannot load pinned model %s: %s", model_id, exc.message)


async def stop_services(services: Services) -> None:
    """Stop sampling, then the guard, then every runner (the scheduler's close)."""
    if services.monitor is not None:
        await asyncio.to_thread(services.monitor.stop)
    if services.guard is not None:
        await services.guard.close()
    await services.scheduler.close()


# This process's own bytes: the scheduler counts them as ours (so the monitor does too).
SERVER_BYTES = ServerBytes()


def _measured_store(settings: Settings) -> Any:
    from elbowroom.models.measured import MeasuredStore

    return MeasuredStore(settings.measurements_path)
