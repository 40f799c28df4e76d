"""JSON parsed once: the body gate's parse (server/http/limits.py, off the event loop, with the
integer-digit limit) is the one the route uses.

The gate parses every JSON body in a worker thread before the route sees it; FastAPI then
parsed the same bytes again, on the event loop (32 MB of long integers: a second full parse
holding every other request). The gate leaves its parsed document in the ASGI scope under
``PARSED_JSON``; routes of ``ParsedJSONRoute`` hand it to FastAPI as the request's JSON.
"""

from __future__ import annotations

from collections.abc import Callable, Coroutine
from typing import Any

from fastapi.routing import APIRoute
from starlette.requests import Request
from starlette.responses import Response

PARSED_JSON = "elbowroom.parsed_json"


def reuse_parsed(request: Request) -> Request:
    """``request`` with the gate's parsed body as its JSON (Starlette's Request.json() returns
    ``_json`` when it is set, and parses the body otherwise)."""
    if PARSED_JSON in request.scope and not hasattr(request, "_json"):
        request._json = request.scope[PARSED_JSON]
    return request


class ParsedJSONRoute(APIRoute):
    """An APIRoute whose JSON body is the body gate's parse, not a second one."""

    def get_route_handler(self) -> Callable[[Request], Coroutine[Any, Any, Response]]:
        handler = super().get_route_handler()

        async def parsed_once(request: Request) -> Response:
            return await handler(reuse_parsed(request))

        return parsed_once
