"""What every router shares: the app's services, error responses and ``keep_alive`` parsing.

Every router (OpenAI, Ollama, audio, embeddings, admin, dashboard) reads the services with
``get_services(request)`` and parses ``keep_alive`` with ``parse_keep_alive(value)``, so they
all look and fail alike; ``error_response(err)`` is the one error shape.
"""

from __future__ import annotations

import math
import re
from contextlib import AbstractAsyncContextManager
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Protocol, runtime_checkable

from fastapi import Request
from fastapi.responses import JSONResponse

from elbowroom.config import Settings
from elbowroom.errors import BadRequest, ElbowroomError, Unavailable
from elbowroom.models.spec import ModelSpec

if TYPE_CHECKING:
    from elbowroom.guard.guard import PressureGuard
    from elbowroom.memory.monitor import Monitor
    from elbowroom.runtime.protocol import Runner
    from elbowroom.scheduler.events import EventLog


class CatalogService(Protocol):
    """What the routes ask of the catalog (``elbowroom.models.catalog.Catalog``)."""

    def get(self, model_id: str) -> ModelSpec:
        """The spec of ``model_id``; raises errors.ModelNotFound."""
        ...

    def list(self) -> list[ModelSpec]: ...


class SchedulerService(Protocol):
    """What the server asks of the scheduler (``elbowroom.scheduler.loop.Scheduler``);
    route tests pass fakes with just these."""

    @property
    def events(self) -> EventLog: ...

    def use(
        self, model_id: str, *, keep_alive: float | None = None
    ) -> AbstractAsyncContextManager[Runner]: ...

    async def load(self, model_id: str, *, pin: bool | None = None) -> dict[str, Any]: ...

    async def unload(self, model_id: str, *, reason: str = "explicit") -> dict[str, Any]: ...

    def ps(self) -> list[dict[str, Any]]: ...

    def memory_report(self) -> dict[str, Any]: ...

    def runner(self, model_id: str) -> Runner | None: ...

    async def close(self) -> None: ...


@runtime_checkable
class ContextFitter(Protocol):
    """A scheduler that reloads a model with a larger context (Ollama's ``num_ctx``)."""

    async def fit_context(self, model_id: str, n_ctx: int) -> dict[str, Any]: ...


@dataclass(slots=True)
class Services:
    """What the app serves with; built in the lifespan (or injected by tests)."""

    settings: Settings
    catalog: CatalogService
    scheduler: SchedulerService
    monitor: Monitor | None = None
    guard: PressureGuard | None = None


def get_services(request: Request) -> Services:
    services: Services | None = getattr(request.app.state, "services", None)
    if services is None:  # only between process start and the end of the lifespan startup
        raise Unavailable("the server is still starting; retry in a moment", retry_after=1.0)
    return services


def error_response(err: ElbowroomError) -> JSONResponse:
    """The one shape every HTTP error takes: OpenAI's ``{"error": {...}}``."""
    return JSONResponse(err.to_openai(), status_code=err.status, headers=err.headers())


_DURATION_RE = re.compile(r"(-?[0-9]+(?:\.[0-9]+)?)(ms|s|m|h)")
_UNIT_SECONDS = {"ms": 0.001, "s": 1.0, "m": 60.0, "h": 3600.0}


def parse_keep_alive(value: Any) -> float | None:
    """Ollama-style ``keep_alive``: seconds (number or numeric string) or a duration such as
    "5m", "1h30m", "90s"; 0 unloads right after the request; negative keeps it forever
    (``math.inf``). None means "use the server default". Anything else is a 400."""
    if value is None:
        return None
    if isinstance(value, bool):  # bool is an int subclass: reject it explicitly
        raise _bad_keep_alive(value)
    if isinstance(value, int | float):
        try:
            seconds = float(value)
        except OverflowError:  # an int beyond a float (10**400): no duration
            raise _bad_keep_alive(value) from None
    elif isinstance(value, str):
        text = value.strip().lower()
        try:
            seconds = float(text)
        except ValueError:
            parts = _DURATION_RE.findall(text)
            if not parts or "".join(n + u for n, u in parts) != text:
                raise _bad_keep_alive(value) from None
            seconds = sum(float(n) * _UNIT_SECONDS[u] for n, u in parts)
    else:
        raise _bad_keep_alive(value)
    if math.isnan(seconds):
        raise _bad_keep_alive(value)
    return math.inf if seconds < 0 else seconds


def _bad_keep_alive(value: Any) -> BadRequest:
    return BadRequest(
        f"keep_alive {value!r} is not a duration: use seconds (300), a duration "
        '("5m", "1h30m"), 0 to unload after the request or -1 to keep the model loaded',
        param="keep_alive",
    )
