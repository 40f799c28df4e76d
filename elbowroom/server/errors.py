"""Exception handlers: every error leaves the server in OpenAI's error shape.

FastAPI's defaults (422 validation lists, ``{"detail": ...}`` 404s, plain-text 500s) are
replaced so that clients written against OpenAI can show the message and the param.

A 500 never carries the exception's text (paths, library internals, pieces of another
request): the client gets a generic message with an error id, the log gets the details
under the same id (``public_error``).
"""

from __future__ import annotations

import logging
import secrets
from collections.abc import Sequence
from typing import Any

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, Response
from starlette.exceptions import HTTPException as StarletteHTTPException
from starlette.requests import ClientDisconnect

from elbowroom.errors import BadRequest, ElbowroomError
from elbowroom.server.deps import error_response

log = logging.getLogger("elbowroom.server")


def install_error_handlers(app: FastAPI) -> None:
    app.add_exception_handler(ElbowroomError, _on_elbowroom_error)  # type: ignore[arg-type]
    app.add_exception_handler(RequestValidationError, _on_validation_error)  # type: ignore[arg-type]
    app.add_exception_handler(StarletteHTTPException, _on_http_exception)  # type: ignore[arg-type]
    app.add_exception_handler(ClientDisconnect, _on_client_gone)  # type: ignore[arg-type]
    app.add_exception_handler(Exception, _on_unexpected)


async def _on_client_gone(request: Request, exc: ClientDisconnect) -> Response:
    """A client that left mid-upload: nobody reads the answer (nginx's 499); not a 500 in
    the log or in the metrics."""
    return Response(status_code=499)


async def _on_elbowroom_error(request: Request, err: ElbowroomError) -> JSONResponse:
    if err.status == 500:
        return error_response(public_error(err, f"{request.method} {request.url.path}"))
    if err.status > 500:
        log.warning("%s %s -> %d %s", request.method, request.url.path, err.status, err.message)
    return error_response(err)


def public_error(err: BaseException, where: str = "") -> ElbowroomError:
    """What a client may see of an internal error: 503/507 and 4xx errors are written for
    clients and pass unchanged; anything else becomes a generic 500 with an error id, and
    the details go to the log under that id."""
    if isinstance(err, ElbowroomError) and err.status != 500:
        return err
    error_id = secrets.token_hex(6)
    detail = err.message if isinstance(err, ElbowroomError) else repr(err)
    log.error(
        "internal error %s%s: %s",
        error_id,
        f" on {where}" if where else "",
        detail,
        exc_info=err if not isinstance(err, ElbowroomError) else None,
    )
    return ElbowroomError(
        f"The server had an internal error (error id {error_id}); the details are in the "
        "server's log under that id.",
        code="internal_error",
        details={"error_id": error_id},
    )


async def _on_validation_error(request: Request, exc: RequestValidationError) -> JSONResponse:
    return error_response(validation_to_bad_request(exc.errors()))


def validation_to_bad_request(errors: Sequence[Any]) -> BadRequest:
    """Turn pydantic's error list into one 400 that names the first offending param."""
    if not errors:
        return BadRequest("invalid request")
    first = _most_specific(errors)
    kind = first.get("type", "")
    if kind == "json_invalid":
        reason = first.get("ctx", {}).get("error", "")
        return BadRequest(f"The request body is not valid JSON: {reason}".rstrip(": "))
    param = param_name(first.get("loc", ()))
    if kind == "missing" and param is None:
        return BadRequest("The request body is missing: send a JSON object")
    if kind == "model_attributes_type" and param is None:
        if isinstance(first.get("input"), bytes):  # a body FastAPI did not parse as JSON
            return BadRequest(
                "The request body must be a JSON object sent with 'Content-Type: application/json'"
            )
        return BadRequest("The request body must be a JSON object")
    message = str(first.get("msg", "invalid value")).removeprefix("Value error, ")
    if kind == "extra_forbidden":
        return BadRequest(
            f"Unsupported parameter: {param!r} is not a parameter elbowroom accepts here; "
            "remove it (docs/api.md lists every parameter: supported, ignored, refused)",
            param=param,
            code="unsupported_parameter",
        )
    if kind == "missing":
        message = f"Missing required parameter: {param!r}"
    elif param is not None:
        message = f"Invalid value for {param!r}: {message}"
    # Other members of the same union fail on a prefix of this param: not news.
    names = {param_name(e.get("loc", ())) for e in errors}
    others = sorted(n for n in names if n and not (param or "").startswith(n))
    extra = f" (also check: {', '.join(others)})" if others else ""
    return BadRequest(message + extra, param=param, code="invalid_value")


def _most_specific(errors: Sequence[Any]) -> Any:
    """A value that matches no member of a union gets one error per member; the deepest
    one (then one that is not a plain type mismatch) says best what is wrong."""
    return max(
        errors,
        key=lambda e: (
            len(_clean_loc(e.get("loc", ()))),
            not str(e.get("type", "")).endswith("_type"),
        ),
    )


def param_name(loc: Sequence[Any]) -> str | None:
    """("body", "messages", 0, "role") -> "messages[0].role"; None for the body itself."""
    parts = _clean_loc(loc)
    if not parts:
        return None
    out = str(parts[0])
    for p in parts[1:]:
        out += f"[{p}]" if isinstance(p, int) else f".{p}"
    return out


def _clean_loc(loc: Sequence[Any]) -> list[Any]:
    parts = list(loc)
    if parts and parts[0] in ("body", "query", "path", "header"):
        parts = parts[1:]
    # Unions add the member type's name to the location ("str", "list[str]"): drop it.
    return [p for p in parts if not (isinstance(p, str) and ("[" in p or p in _TYPE_TAGS))]


_TYPE_TAGS = frozenset({"str", "int", "float", "bool", "list", "dict", "none", "function-after"})


async def _on_http_exception(request: Request, exc: StarletteHTTPException) -> JSONResponse:
    if exc.status_code == 404:
        err: ElbowroomError = _NotFoundRoute(
            f"Unknown route: {request.method} {request.url.path}. "
            "The API is under /v1 (see GET /v1/models) and /api."
        )
    elif exc.status_code == 405:
        err = _MethodNotAllowed(f"Method {request.method} is not allowed on {request.url.path}")
    else:
        err = BadRequest(str(exc.detail))
        err_status = exc.status_code
        return JSONResponse(err.to_openai(), status_code=err_status, headers=exc.headers)
    return error_response(err)


async def _on_unexpected(request: Request, exc: Exception) -> JSONResponse:
    return error_response(public_error(exc, f"{request.method} {request.url.path}"))


class _NotFoundRoute(ElbowroomError):
    status = 404
    type = "not_found_error"


class _MethodNotAllowed(ElbowroomError):
    status = 405
    type = "invalid_request_error"
