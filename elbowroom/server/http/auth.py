"""Bearer API keys, admin rights, and the rule that a server reachable from the network needs a key.

Keys (docs/security.md): ``api_key`` and ``api_keys`` are inference keys, one per client if
you like; ``admin_key`` opens everything. When any key is set, every path but ``/health``
and the dashboard's static page (``/``, ``/ui``: it holds no data, its requests carry the
key the user types) needs one, so ``/metrics``, ``/openapi.json`` and unknown paths leak
nothing; the admin paths (``/api/*`` except Ollama's API, ``/metrics``, ``/openapi.json``,
``/docs``) need the admin key when one is set (without one, any key is an admin key, as
with a single ``api_key``). Errors on Ollama's paths are in Ollama's shape.

A pure ASGI middleware rather than a route dependency: it also covers routes added by other
modules and unknown paths, so nothing leaks without the key. It also names the client
(``key-1``, ``key-2``, ``admin``; never the key itself) for the scheduler's per-key queue
share, when there is more than one key to tell clients apart by.
"""

from __future__ import annotations

import hmac
import ipaddress
from dataclasses import dataclass

from starlette.types import ASGIApp, Receive, Scope, Send

from elbowroom.config import Settings
from elbowroom.errors import Forbidden, Unauthorized
from elbowroom.scheduler.clients import current_client
from elbowroom.server.http.asgi import header, send_error
from elbowroom.server.http.ollama_paths import is_ollama_path

OPEN_PATHS = frozenset({"/health", "/", "/ui"})
OPEN_PREFIXES = ("/ui/",)  # the dashboard's static files
ADMIN_PREFIXES = ("/api", "/metrics", "/openapi.json", "/docs", "/redoc")
CLIENT_SCOPE_KEY = "elbowroom.client"
# False when the request came with an inference key while an admin key is set: routes open
# to both (Ollama's /api/ps) leave out what only an admin should see (runner pids).
ADMIN_SCOPE_KEY = "elbowroom.admin"


@dataclass(frozen=True, slots=True)
class Keys:
    """Named keys: ``(name, key bytes)``; admin is None when no admin key is set."""

    inference: tuple[tuple[str, bytes], ...]
    admin: bytes | None

    @classmethod
    def from_settings(cls, settings: Settings) -> Keys:
        raw = [k for k in (settings.api_key, *settings.api_keys) if k]
        unique = list(dict.fromkeys(raw))
        named = tuple((f"key-{i}", k.encode()) for i, k in enumerate(unique, 1))
        admin = settings.admin_key.encode() if settings.admin_key else None
        return cls(named, admin)

    @property
    def any(self) -> bool:
        return bool(self.inference) or self.admin is not None

    @property
    def clients(self) -> int:
        return len(self.inference) + (self.admin is not None)

    def identify(self, token: bytes) -> str | None:
        """The name of the key ``token`` is, comparing against every key in constant time."""
        found = None
        if self.admin is not None and hmac.compare_digest(token, self.admin):
            found = "admin"
        for name, key in self.inference:
            if hmac.compare_digest(token, key) and found is None:
                found = name
        return found


# Ollama's routes that change the models the server has (docs/pull.md): admin, not inference.
ADMIN_OLLAMA_PATHS = frozenset({"/api/pull", "/api/delete"})


def admin_path(path: str) -> bool:
    """Routes that run or reveal the server itself; Ollama's /api routes are inference,
    except those that fetch or delete models."""
    if path in ADMIN_OLLAMA_PATHS:
        return True
    if is_ollama_path(path):
        return False
    return any(path == p or path.startswith(p + "/") for p in ADMIN_PREFIXES)


class ApiKeyMiddleware:
    def __init__(self, app: ASGIApp, keys: Keys) -> None:
        self.app = app
        self.keys = keys
        # One key (or none) cannot tell clients apart: no per-key share then.
        self._name_clients = keys.clients > 1

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        path = scope.get("path", "")
        if scope["type"] != "http" or path in OPEN_PATHS or path.startswith(OPEN_PREFIXES):
            await self.app(scope, receive, send)
            return
        who = self._who(header(scope, b"authorization"))
        if who is None:
            problem = (
                "Incorrect API key provided"
                if header(scope, b"authorization")
                else "Missing API key: send it as 'Authorization: Bearer <key>'"
            )
            await send_error(
                scope,
                send,
                Unauthorized(problem, code="invalid_api_key"),
                [(b"www-authenticate", b"Bearer")],
            )
            return
        if who != "admin" and self.keys.admin is not None and admin_path(path):
            await send_error(
                scope,
                send,
                Forbidden(
                    f"{path} is an admin route: send the admin key (admin_key), "
                    "not an inference key",
                    code="admin_key_required",
                ),
            )
            return
        scope[ADMIN_SCOPE_KEY] = who == "admin" or self.keys.admin is None
        if not self._name_clients:
            await self.app(scope, receive, send)
            return
        scope[CLIENT_SCOPE_KEY] = who
        token = current_client.set(who)
        try:
            await self.app(scope, receive, send)
        finally:
            current_client.reset(token)

    def _who(self, value: bytes | None) -> str | None:
        if not value:
            return None
        scheme, _, token = value.partition(b" ")
        if scheme.lower() != b"bearer":
            return None
        return self.keys.identify(token.strip())


def is_loopback(host: str) -> bool:
    """True when only this machine can reach ``host`` (127.0.0.0/8, ::1, localhost)."""
    if host.lower() == "localhost":
        return True
    try:
        return ipaddress.ip_address(host.strip("[]")).is_loopback
    except ValueError:
        return False  # a hostname may resolve anywhere: treat it as reachable


def check_exposure(host: str, api_key: str | bool | None) -> str | None:
    """Why the server must not start on ``host`` without a key, or None when it may.
    ``api_key``: the key, or whether any key (inference or admin) is set."""
    if api_key or is_loopback(host):
        return None
    return (
        f"refusing to listen on {host} without an API key: anyone who can reach this "
        "machine could use it. Set --api-key (or ELBOWROOM_API_KEY), or bind to 127.0.0.1."
    )
