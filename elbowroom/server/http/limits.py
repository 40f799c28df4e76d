"""The body gate: limits that act before any work (docs/security.md).

For every POST/PUT/PATCH with a body, except the multipart upload routes (uploads.py has
its own streaming limits):

1. The body must be JSON (``application/json`` or ``*/*+json``): 415 otherwise. A web
   page can send ``text/plain`` and form bodies to any site without asking; JSON it cannot.
   Ollama's routes read any body as JSON, as Ollama does (``curl -d``); web pages are kept
   off them by the Origin check.
2. ``Content-Length`` above ``max_body`` is 413 before a byte is read; a chunked body is
   counted as it arrives and refused the moment it passes the limit.
3. Bodies above ``SMALL_BODY`` share ``max_body_inflight`` bytes: past that, 503 +
   Retry-After instead of one more large buffer in the server process.
4. The body is scanned and parsed within ``max_json_values`` / ``max_json_depth`` (in a
   worker thread when large, so other clients are answered meanwhile), then checked:
   ``max_chars``, ``max_messages``, ``max_stop`` / ``max_stop_chars``.
5. A chat or completion prompt that cannot fit the model's largest possible context is
   refused with 400 ``context_length_exceeded`` by a lower bound on its tokens (characters
   ÷ the most characters any token of the vocabulary spells), before it is tokenized.

The route then gets the same bytes (FastAPI parses them again; only bodies that passed,
so bounded ones).
"""

from __future__ import annotations

import asyncio
import logging
from concurrent.futures import ThreadPoolExecutor

from starlette.types import ASGIApp, Message, Receive, Scope, Send

from elbowroom.config import Settings
from elbowroom.errors import (
    ContextOverflow,
    ElbowroomError,
    ModelNotFound,
    PayloadTooLarge,
    RequestTimeout,
    Unavailable,
    UnsupportedMediaType,
)
from elbowroom.models.spec import GGUFInfo, ModelKind, ModelSpec
from elbowroom.server.http.asgi import header, send_error
from elbowroom.server.http.jsonscan import (
    CHAT_PATHS,
    COMPLETION_PATHS,
    Inspected,
    Limits,
    inspect,
    min_tokens,
)
from elbowroom.server.http.ollama_paths import is_ollama_path, strip_tag
from elbowroom.server.http.parsed_json import PARSED_JSON
from elbowroom.units import format_size

log = logging.getLogger("elbowroom.server")

UPLOAD_PATHS = frozenset({"/v1/audio/transcriptions", "/v1/audio/translations"})
BODY_METHODS = frozenset({"POST", "PUT", "PATCH"})
TEXT_PATHS = CHAT_PATHS | COMPLETION_PATHS
# Bodies up to this size are parsed on the event loop and not counted in flight: their
# cost is that of any request.
SMALL_BODY = 256 * 1024
# Tokenizers that spell text exactly as their vocabulary does (llama.cpp's SPM and BPE):
# a token covers at most its own length in characters. Others normalize (lower-casing,
# accent stripping, NFKC) and may fold a few characters into one: allow 4 for each.
_EXACT_TOKENIZERS = frozenset({"llama", "gpt2"})
_NORMALIZING_FACTOR = 4


def limits_of(settings: Settings) -> Limits:
    return Limits(
        max_values=settings.max_json_values,
        max_depth=settings.max_json_depth,
        max_chars=settings.max_chars,
        max_messages=settings.max_messages,
        max_stop=settings.max_stop,
        max_stop_chars=settings.max_stop_chars,
        max_schema_bytes=settings.max_schema_bytes,
        max_schema_members=settings.max_schema_members,
        max_schema_repeat=settings.max_schema_repeat,
        max_int_digits=settings.max_int_digits,
    )


class InFlight:
    """Bytes of large request bodies held now, against ``max_body_inflight``."""

    def __init__(self, cap: int) -> None:
        self.cap = cap
        self.held = 0

    def take(self, n: int) -> bool:
        if self.held + n > self.cap:
            return False
        self.held += n
        return True

    def give(self, n: int) -> None:
        self.held -= n


class BodyGate:
    def __init__(self, app: ASGIApp, settings: Settings) -> None:
        self.app = app
        self.settings = settings
        self.limits = limits_of(settings)
        self.inflight = InFlight(settings.max_body_inflight)
        # One large body inspected at a time (``_inspect``); the others wait in its queue.
        self.inspector = ThreadPoolExecutor(1, thread_name_prefix="body-inspect")

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        path = scope.get("path", "")
        if (
            scope["type"] != "http"
            or scope.get("method") not in BODY_METHODS
            or path in UPLOAD_PATHS
        ):
            await self.app(scope, receive, send)
            return
        declared = _content_length(scope)
        if declared == 0:
            await self.app(scope, receive, send)  # no body: the route says what it misses
            return
        held = 0
        try:
            # Ollama reads any body as JSON (its docs use plain `curl -d`): so do its routes.
            json_only = not is_ollama_path(path)
            if declared is not None:
                if json_only:
                    _check_media_type(header(scope, b"content-type"))
                if declared > self.settings.max_body:  # every route, Ollama's too
                    raise self._too_large(declared)
                if declared > SMALL_BODY and self.inflight.held + declared > self.inflight.cap:
                    self._take(declared)  # refused now, not after the client sent it
            # No Content-Length: chunked, HTTP/2, or no body at all; counted as it comes.
            body, held = await self._read(receive, declared)
            if body is None:
                return  # the client went away
            if not body:
                await self.app(scope, _replay(body, receive), send)
                return
            if declared is None and json_only:
                _check_media_type(header(scope, b"content-type"))
            checked = await self._inspect(body, path)
            self._check_context(scope, path, checked)
            scope[PARSED_JSON] = checked.value  # the route's JSON: parsed once (parsed_json.py)
        except ElbowroomError as err:
            self.inflight.give(held)
            await send_error(scope, send, err)
            return
        try:
            await self.app(scope, _replay(body, receive), send)
        finally:
            self.inflight.give(held)

    async def _read(self, receive: Receive, declared: int | None) -> tuple[bytearray | None, int]:
        """The whole body, or None on disconnect; the bytes taken from ``inflight``. A
        bytearray, never copied: scan, parse and route all read it as it is.

        Bytes are taken from ``inflight`` as they arrive (with a margin), never for what a
        ``Content-Length`` only promises: a connection that declares 32 MiB and sends
        nothing holds nothing. Each wait for more of the body ends after ``body_timeout``
        with a 408, and what the body held is given back."""
        held = 0
        buf = bytearray()
        try:
            while True:
                try:
                    message = await asyncio.wait_for(receive(), self.settings.body_timeout)
                except TimeoutError:
                    raise RequestTimeout(
                        f"The request body stopped arriving: nothing for "
                        f"{self.settings.body_timeout:g} s after {len(buf)} bytes "
                        "(body_timeout)",
                        code="body_timeout",
                    ) from None
                if message["type"] == "http.disconnect":
                    self.inflight.give(held)
                    return None, 0
                buf += message.get("body", b"")
                if len(buf) > self.settings.max_body:
                    raise self._too_large(len(buf))
                if len(buf) > max(held, SMALL_BODY):
                    # hold what arrived, plus a margin for the next chunks
                    want = len(buf) + SMALL_BODY
                    if declared is not None:
                        want = min(want, max(declared, len(buf)))
                    held += self._take(want - held)
                if not message.get("more_body", False):
                    return buf, held
        except BaseException:
            self.inflight.give(held)
            raise

    def _take(self, n: int) -> int:
        if not self.inflight.take(n):
            raise Unavailable(
                f"the server holds {format_size(self.inflight.held)} of large request bodies "
                f"already (max_body_inflight {format_size(self.inflight.cap)}); retry shortly",
                retry_after=2.0,
                code="too_many_large_requests",
            )
        return n

    async def _inspect(self, body: bytearray, path: str) -> Inspected:
        if len(body) <= SMALL_BODY:
            return inspect(body, path, self.limits)
        # The scan is a Python loop (it lets other threads run between matches) and the
        # parse of a body within the limits is bounded: neither stalls other clients. One
        # body at a time: each C call (a piece's translate or decode, the text's join) holds
        # the interpreter lock, and four bodies at once added their holds up (/health up to
        # ~300 ms); the lock runs one thread's Python at a time anyway, so nothing is lost.
        loop = asyncio.get_running_loop()
        return await loop.run_in_executor(self.inspector, inspect, body, path, self.limits)

    def _too_large(self, size: int) -> PayloadTooLarge:
        return PayloadTooLarge(
            f"The request body is {format_size(size)}; at most "
            f"{format_size(self.settings.max_body)} is accepted (max_body)",
            code="request_too_large",
        )

    def _check_context(self, scope: Scope, path: str, checked: Inspected) -> None:
        if path not in TEXT_PATHS or not checked.prompt_chars:
            return
        body = checked.value
        services = getattr(scope.get("app"), "state", None)
        services = getattr(services, "services", None)
        if services is None or not isinstance(body, dict):
            return
        model = body.get("model") or self.settings.default_model
        if isinstance(model, str) and is_ollama_path(path):
            model = strip_tag(model)  # Ollama's tag; the catalog has no tags
        try:
            spec = services.catalog.get(model) if isinstance(model, str) else None
        except ModelNotFound:
            return  # the route answers 404
        check_prompt_fits(spec, self.settings, checked.prompt_chars, path)


def check_prompt_fits(spec: ModelSpec | None, settings: Settings, chars: int, path: str) -> None:
    """Refuse a prompt whose token lower bound exceeds the largest context ``spec`` can get."""
    if spec is None or spec.kind != ModelKind.LLM or spec.gguf is None:
        return
    per_token = chars_per_token(spec.gguf)
    if per_token is None:
        return
    ceiling, why = context_ceiling(spec.gguf, settings)
    tokens = min_tokens(chars, per_token)
    if tokens <= ceiling:
        return
    param = "messages" if path in CHAT_PATHS else "prompt"
    raise ContextOverflow(
        f"The prompt has {chars} characters, so at least {tokens} tokens for {spec.id} "
        f"(no token of its vocabulary spells more than {per_token} characters), but its "
        f"context holds at most {ceiling} tokens ({why}). Shorten the prompt.",
        param=param,
    )


def chars_per_token(info: GGUFInfo) -> int | None:
    if not info.max_token_bytes:
        return None
    factor = 1 if info.tokenizer_model in _EXACT_TOKENIZERS else _NORMALIZING_FACTOR
    return info.max_token_bytes * factor


def context_ceiling(info: GGUFInfo, settings: Settings) -> tuple[int, str]:
    """The largest context a load can give this model, and why (sizing.plan_load's rules)."""
    if settings.ctx is not None:
        return settings.ctx, "ctx"
    if info.trained_ctx and info.trained_ctx < settings.max_ctx:
        return info.trained_ctx, "the model's trained context"
    return settings.max_ctx, "max_ctx"


def _content_length(scope: Scope) -> int | None:
    raw = header(scope, b"content-length")
    if raw is None:
        return None
    try:
        return int(raw)
    except ValueError:
        return None  # the HTTP server refuses such a request before we see it


def _check_media_type(value: bytes | None) -> None:
    media = (value or b"").split(b";", 1)[0].strip().lower()
    if media == b"application/json" or (
        media.startswith(b"application/") and media.endswith(b"+json")
    ):
        return
    shown = media.decode("latin-1") if media else "none"
    raise UnsupportedMediaType(
        f"The request body must be JSON sent with 'Content-Type: application/json' (got "
        f"{shown}); with curl use --json or -H 'Content-Type: application/json'",
        code="unsupported_media_type",
    )


def _replay(body: bytes | bytearray, receive: Receive) -> Receive:
    """The body in one message, then the client's own messages (for disconnects)."""
    sent = False

    async def replay() -> Message:
        nonlocal sent
        if not sent:
            sent = True
            return {"type": "http.request", "body": body, "more_body": False}
        return await receive()

    return replay
