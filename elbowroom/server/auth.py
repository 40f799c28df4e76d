"""Bearer API-key check, and the rule that a server reachable from the network needs one.

A pure ASGI middleware rather than a route dependency: it also covers routes added by other
modules and unknown paths under the protected prefixes, so nothing leaks without the key.
"""

from __future__ import annotations

import hmac
import ipaddress
import json

from starlette.types import ASGIApp, Receive, Scope, Send

from elbowroom.errors import Unauthorized
from elbowroom.server.ollama_shapes import error_body, is_ollama_path

PROTECTED_PREFIXES = ("/v1", "/api")


class ApiKeyMiddleware:
    def __init__(self, app: ASGIApp, api_key: str) -> None:
        self.app = app
        self._key = api_key.encode()

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http" or not _protected(scope.get("path", "")):
            await self.app(scope, receive, send)
            return
        problem = self._check(scope)
        if problem is None:
            await self.app(scope, receive, send)
            return
        err = Unauthorized(problem, code="invalid_api_key")
        ollama = is_ollama_path(scope.get("path", ""))
        body = json.dumps(error_body(err) if ollama else err.to_openai()).encode()
        await send(
            {
                "type": "http.response.start",
                "status": err.status,
                "headers": [
                    (b"content-type", b"application/json"),
                    (b"content-length", str(len(body)).encode()),
                    (b"www-authenticate", b"Bearer"),
                ],
            }
        )
        await send({"type": "http.response.body", "body": body})

    def _check(self, scope: Scope) -> str | None:
        header = b""
        for name, value in scope.get("headers", ()):
            if name == b"authorization":
                header = value
                break
        if not header:
            return "Missing API key: send it as 'Authorization: Bearer <key>'"
        scheme, _, token = header.partition(b" ")
        if scheme.lower() != b"bearer" or not hmac.compare_digest(token.strip(), self._key):
            return "Incorrect API key provided"
        return None


def _protected(path: str) -> bool:
    return any(path == p or path.startswith(p + "/") for p in PROTECTED_PREFIXES)


def is_loopback(host: str) -> bool:
    """True when only this machine can reach ``host`` (127.0.0.0/8, ::1, localhost)."""
    if host.lower() == "localhost":
        return True
    try:
        return ipaddress.ip_address(host.strip("[]")).is_loopback
    except ValueError:
        return False  # a hostname may resolve anywhere: treat it as reachable


def check_exposure(host: str, api_key: str | None) -> str | None:
    """Why the server must not start on ``host`` without a key, or None when it may."""
    if api_key or is_loopback(host):
        return None
    return (
        f"refusing to listen on {host} without an API key: anyone who can reach this "
        "machine could use it. Set --api-key (or ELBOWROOM_API_KEY), or bind to 127.0.0.1."
    )
