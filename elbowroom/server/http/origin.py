"""Which web pages may talk to the server: the Host allow-list, the Origin check, CORS.

A page on any web site can make the browser send "simple" requests (an HTML form post, a
``fetch(..., {mode: "no-cors"})``) to ``http://127.0.0.1:8000``: it cannot read the
answer, but the work happens (a generation, an unload). With DNS rebinding the page's own
name points at 127.0.0.1 and it can read everything. Ollama had both holes
(CVE-2024-28224). The rules here, outermost of all middleware (docs/security.md):

- **Host**: the ``Host`` header must name this server. On a loopback bind only loopback
  names pass (``localhost``, ``*.localhost``, 127.0.0.0/8, ``[::1]``) plus ``allowed_hosts``;
  a rebinding page sends its own name and gets 403. A non-loopback bind needs an API key
  anyway (auth.check_exposure), so it accepts any Host unless ``allowed_hosts`` is set.
- **Origin**: browsers send it on every cross-site POST. No Origin is a non-browser
  client: allowed. The server's own origin and ``allowed_origins`` pass; any other is 403,
  before the body is read. A browser request without Origin whose ``Sec-Fetch-Site`` says
  another site sent it is refused the same way (old or unusual browsers).
- **CORS** headers only when ``allowed_origins`` is set, and only for those origins.
"""

from __future__ import annotations

import ipaddress
from dataclasses import dataclass
from urllib.parse import urlsplit

from starlette.types import ASGIApp, Message, Receive, Scope, Send

from elbowroom.config import Settings
from elbowroom.errors import Forbidden
from elbowroom.server.http.asgi import header, send_error
from elbowroom.server.http.auth import is_loopback

_SAFE_METHODS = frozenset({"GET", "HEAD", "OPTIONS"})
_CROSS_SITE = frozenset({b"cross-site", b"same-site"})
_PREFLIGHT_MAX_AGE = b"600"


def split_host(value: str) -> tuple[str, str]:
    """A Host header as (name, port): lower-case, no brackets or trailing dot; port may be ""."""
    value = value.strip().lower()
    if value.startswith("["):
        name, _, rest = value[1:].partition("]")
        port = rest[1:] if rest.startswith(":") else ""
    elif value.count(":") == 1:
        name, port = value.split(":", 1)
    else:
        name, port = value, ""  # a bare name, or an IPv6 address without brackets
    return name.rstrip("."), port


def host_name(value: str) -> str:
    return split_host(value)[0]


def loopback_name(name: str) -> bool:
    """Names only this machine can answer to: no DNS answer can rebind them."""
    if name == "localhost" or name.endswith(".localhost"):
        return True
    try:
        return ipaddress.ip_address(name).is_loopback
    except ValueError:
        return False


def _origin_key(origin: str) -> tuple[str, str, str] | None:
    """(scheme, host, port) of an Origin value, lower-case; None when it is not a URL."""
    try:
        parts = urlsplit(origin.strip().lower())
        port = parts.port
    except ValueError:
        return None
    if not parts.scheme or not parts.hostname:
        return None
    return parts.scheme, parts.hostname, "" if port is None else str(port)


@dataclass(frozen=True, slots=True)
class OriginPolicy:
    any_host: bool
    hosts: frozenset[str]  # exact names; "*.example.com" entries are kept in suffixes
    host_suffixes: tuple[str, ...]
    any_origin: bool
    origins: frozenset[tuple[str, str, str]]  # (scheme, host, port); port "*" = any
    null_origin: bool  # the literal "null" (sandboxed frames, file://) was allowed
    cors: bool

    @classmethod
    def from_settings(cls, settings: Settings) -> OriginPolicy:
        hosts = [h.strip().lower().rstrip(".") for h in settings.allowed_hosts if h.strip()]
        origins: set[tuple[str, str, str]] = set()
        for raw in settings.allowed_origins:
            text = raw.strip().lower().rstrip("/")
            key = _origin_key(text.replace(":*", "")) if text.endswith(":*") else None
            if key is not None:
                origins.add((key[0], key[1], "*"))
                continue
            key = _origin_key(text)
            if key is not None:
                origins.add(key)
        return cls(
            # Without a list, a loopback bind takes loopback names only; any other bind
            # is behind an API key (check_exposure) and may be reached by any name.
            any_host="*" in hosts or (not hosts and not is_loopback(settings.host)),
            hosts=frozenset(h for h in hosts if not h.startswith("*.")),
            host_suffixes=tuple(h[1:] for h in hosts if h.startswith("*.")),
            any_origin=any(o.strip() == "*" for o in settings.allowed_origins),
            origins=frozenset(origins),
            null_origin=any(o.strip().lower() == "null" for o in settings.allowed_origins),
            cors=bool(settings.allowed_origins),
        )

    def host_allowed(self, host: str | None) -> bool:
        if host is None or self.any_host:
            return True  # no Host at all: HTTP/1.0, not a browser
        name = host_name(host)
        return (
            loopback_name(name)
            or name in self.hosts
            or any(name.endswith(s) for s in self.host_suffixes)
        )

    def listed(self, origin: str) -> bool:
        """``origin`` is in ``allowed_origins`` (not merely same-origin)."""
        if self.any_origin:
            return True
        if origin.strip().lower() == "null":
            return self.null_origin
        key = _origin_key(origin)
        if key is None:
            return False
        return key in self.origins or (key[0], key[1], "*") in self.origins

    def origin_allowed(self, origin: str, host: str | None) -> bool:
        if host is not None and _same_origin(origin, host):
            return True
        return self.listed(origin)


def _same_origin(origin: str, host: str) -> bool:
    """The page was served by this server: the Origin's host and port are the Host's."""
    key = _origin_key(origin)
    if key is None:
        return False
    scheme, name, port = key
    default = {"http": "80", "https": "443"}.get(scheme, "")
    host_name_, host_port = split_host(host)
    return name.strip("[]") == host_name_ and (port or default) == (host_port or default)


class OriginMiddleware:
    def __init__(self, app: ASGIApp, policy: OriginPolicy) -> None:
        self.app = app
        self.policy = policy

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        raw_host = header(scope, b"host")
        host = raw_host.decode("latin-1") if raw_host is not None else None
        if not self.policy.host_allowed(host):
            await send_error(
                scope,
                send,
                Forbidden(
                    f"Host {host!r} is not allowed: this server answers to its loopback names "
                    "only (a web page may be trying DNS rebinding). If you reach it through "
                    "another name, add that name to allowed_hosts (ELBOWROOM_ALLOWED_HOSTS).",
                    code="host_not_allowed",
                ),
            )
            return
        raw_origin = header(scope, b"origin")
        method = str(scope.get("method", "GET"))
        if raw_origin is None:
            site = header(scope, b"sec-fetch-site")
            if site in _CROSS_SITE and method not in _SAFE_METHODS:
                await send_error(scope, send, _cross_origin(f"a {site.decode()} page"))
                return
            await self.app(scope, receive, send)
            return
        origin = raw_origin.decode("latin-1")
        if not self.policy.origin_allowed(origin, host):
            await send_error(scope, send, _cross_origin(f"origin {origin!r}"))
            return
        if not (self.policy.cors and self.policy.listed(origin)):
            await self.app(scope, receive, send)
            return
        if method == "OPTIONS" and header(scope, b"access-control-request-method") is not None:
            await _preflight(scope, send, raw_origin)
            return
        await self.app(scope, receive, _with_cors(send, raw_origin))


def _cross_origin(who: str) -> Forbidden:
    return Forbidden(
        f"Cross-origin request from {who} refused: web pages may not use this server unless "
        "their origin is listed in allowed_origins (ELBOWROOM_ALLOWED_ORIGINS, e.g. "
        "http://localhost:3000). Programs that are not browsers send no Origin and pass.",
        code="origin_not_allowed",
    )


async def _preflight(scope: Scope, send: Send, origin: bytes) -> None:
    asked = header(scope, b"access-control-request-headers") or b"authorization, content-type"
    headers = [
        (b"access-control-allow-origin", origin),
        (b"access-control-allow-methods", b"GET, POST, OPTIONS"),
        (b"access-control-allow-headers", asked),
        (b"access-control-max-age", _PREFLIGHT_MAX_AGE),
        (b"vary", b"Origin"),
        (b"content-length", b"0"),
    ]
    await send({"type": "http.response.start", "status": 204, "headers": headers})
    await send({"type": "http.response.body", "body": b""})


def _with_cors(send: Send, origin: bytes) -> Send:
    async def wrapped(message: Message) -> None:
        if message["type"] == "http.response.start":
            message = dict(message)
            message["headers"] = [
                *message.get("headers", ()),
                (b"access-control-allow-origin", origin),
                (b"access-control-expose-headers", b"Retry-After"),
                (b"vary", b"Origin"),
            ]
        await send(message)

    return wrapped
