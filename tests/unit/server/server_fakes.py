"""Stand-ins for the scheduler and catalog: the edge the HTTP-layer tests isolate.

(A uniquely named module, not conftest.py: every conftest is imported as "conftest".)

The runner answers ``open`` as a runner whose engine has no socket of its own does (MLX):
a ticket, then the engine's OpenAI-shaped SSE events over the runner (engines/base.py),
and records whether its request iterator was closed, which is how the server cancels
generation. The events are llama.cpp's shapes (engines/events.py).
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from bundled_models import SMOLLM2_INFO

from elbowroom.config import Settings
from elbowroom.engines.events import DONE, event
from elbowroom.engines.requests import Payload, TextRequest, TextTicket
from elbowroom.errors import ElbowroomError, ModelNotFound
from elbowroom.models.spec import Holding, ModelKind, ModelSpec
from elbowroom.server.deps import Services

# The real model's GGUF facts: the routes check logit_bias ids against its vocabulary.
SMOL_GGUF = SMOLLM2_INFO


def spec(model_id: str, kind: ModelKind = ModelKind.LLM, engine: str = "llama") -> ModelSpec:
    return ModelSpec(
        id=model_id,
        kind=kind,
        engine=engine,
        path=Path("/nonexistent") / model_id,
        size_bytes=1000,
        holding=Holding.MMAP if kind == ModelKind.LLM else Holding.RESIDENT,
        source="bundled",
        gguf=SMOL_GGUF if kind == ModelKind.LLM else None,
    )


class FakeCatalog:
    def __init__(self, *specs: ModelSpec) -> None:
        self._specs = {s.id: s for s in specs}

    def list(self) -> list[ModelSpec]:
        return list(self._specs.values())

    def get(self, model_id: str) -> ModelSpec:
        try:
            return self._specs[model_id]
        except KeyError:
            raise ModelNotFound(model_id) from None


@dataclass
class Script:
    """What the next request does: pieces of text, then done; or an error after N pieces.
    ``done_extra``: tool calls the engine sends whole after the text (a native call in one
    event) and logprob entries, one per piece (left over ones ride on the finish event)."""

    pieces: tuple[str, ...] = ("Hel", "lo", "!")
    emulated: bool = False  # the ticket says the tool calls are emulated (JSON text)
    block: int = 1  # the ticket's cache block
    finish_reason: str = "stop"
    error_after: int | None = None
    error: BaseException | None = None
    hang_after_first: bool = False  # wait forever after the first piece (until cancelled)
    deltas: tuple[dict[str, Any], ...] = ()  # more deltas after the pieces (tool calls, ...)
    done_extra: dict[str, Any] = field(default_factory=dict)  # merged into the result
    usage: dict[str, int] = field(
        default_factory=lambda: {"prompt_tokens": 7, "completion_tokens": 3, "cached_tokens": 2}
    )


class FakeRunner:
    def __init__(self, scheduler: FakeScheduler) -> None:
        self.scheduler = scheduler

    async def stats(self) -> dict[str, Any]:
        return {"kv_cache": {"entries_ram": 1}}

    async def request(self, kind: str, payload: Payload) -> AsyncIterator[dict[str, Any]]:
        s = self.scheduler
        s.requests.append((kind, payload))
        assert kind == "open" and isinstance(payload, TextRequest)
        script = s.script
        chat = payload.kind == "chat"
        try:
            ticket = TextTicket(
                ticket=1, socket=None, block_tokens=script.block, emulated_tools=script.emulated
            )
            yield {"type": "ticket", "ticket": ticket}
            # llama.cpp's first chat event, the role, comes with the first piece.
            role = {"choices": [{"index": 0, "delta": {"role": "assistant"}}]} if chat else None
            streamed_lp = any("logprobs" in d for d in script.deltas)
            entries = [] if streamed_lp else list(script.done_extra.get("logprobs") or ())
            for i, piece in enumerate(script.pieces):
                if script.error_after == i and script.error is not None:
                    raise script.error
                lp = [entries.pop(0)] if entries else None
                yield _events(_chunk(chat, text=piece, logprobs=lp), role)
                role = None
                if script.hang_after_first:
                    await asyncio.Event().wait()
            if script.error_after == len(script.pieces) and script.error is not None:
                raise script.error
            for delta in script.deltas:
                calls = delta.get("tool_calls")
                yield _events(_chunk(chat, calls=calls, logprobs=delta.get("logprobs")), role)
                role = None
            calls = script.done_extra.get("tool_calls")
            if calls and not any("tool_calls" in d for d in script.deltas):
                whole = [{"index": i, **c} for i, c in enumerate(calls)]
                yield _events(_chunk(chat, calls=whole), role)
                role = None
            u = script.usage
            usage = {
                "prompt_tokens": u["prompt_tokens"],
                "completion_tokens": u["completion_tokens"],
                "total_tokens": u["prompt_tokens"] + u["completion_tokens"],
                "prompt_tokens_details": {"cached_tokens": u["cached_tokens"]},
            }
            finish = _chunk(chat, finish=script.finish_reason, logprobs=entries or None)
            head = b"" if role is None else event(role)
            tail = event(finish) + event({"choices": [], "usage": usage}) + DONE
            yield {"type": "events", "data": head + tail}
            yield {"type": "done"}
        finally:
            s.closed += 1


def _chunk(
    chat: bool,
    *,
    text: str | None = None,
    calls: list[dict[str, Any]] | None = None,
    logprobs: list[dict[str, Any]] | None = None,
    finish: str | None = None,
) -> dict[str, Any]:
    choice: dict[str, Any] = {"index": 0, "finish_reason": finish}
    if chat:
        delta: dict[str, Any] = {} if text is None else {"content": text}
        if calls:
            delta["tool_calls"] = calls
        choice["delta"] = delta
    else:
        choice["text"] = text or ""
    if logprobs:
        choice["logprobs"] = {"content": logprobs}
    return {"choices": [choice], "model": "/models/engine-file.gguf"}


def _events(chunk: dict[str, Any], first: dict[str, Any] | None = None) -> dict[str, Any]:
    return {"type": "events", "data": (b"" if first is None else event(first)) + event(chunk)}


class FakeScheduler:
    def __init__(self) -> None:
        self.script = Script()
        self.use_error: ElbowroomError | None = None
        self.requests: list[tuple[str, Any]] = []  # (op, the payload: a TextRequest for text)
        self.uses: list[tuple[str, float | None]] = []
        self.released: list[BaseException | None] = []
        self.closed = 0
        self.loaded: dict[str, bool] = {}

    @asynccontextmanager
    async def use(self, model_id: str, keep_alive: float | None = None) -> AsyncIterator[Any]:
        self.uses.append((model_id, keep_alive))
        if self.use_error is not None:
            raise self.use_error
        try:
            yield FakeRunner(self)
        except BaseException as exc:
            self.released.append(exc)
            raise
        else:
            self.released.append(None)

    async def load(self, model_id: str, pin: bool | None = None) -> dict[str, Any]:
        self.loaded[model_id] = bool(pin if pin is not None else self.loaded.get(model_id))
        return next(row for row in self.ps() if row["id"] == model_id)

    async def unload(self, model_id: str) -> dict[str, Any]:
        held = self.loaded.pop(model_id, None)
        status = "not_loaded" if held is None else "unloaded"
        return {"id": model_id, "status": status, "freed": 0 if held is None else 10}

    def ps(self) -> list[dict[str, Any]]:
        return [{"id": m, "pid": 1234, "pinned": p, "bytes": 10} for m, p in self.loaded.items()]

    def runner(self, model_id: str) -> FakeRunner | None:
        return FakeRunner(self) if model_id in self.loaded else None

    def memory_report(self) -> dict[str, Any]:
        return {
            "limit": {"value": 1000, "winner": {}},
            "committed": 10 * len(self.loaded),
            "available": 1000 - 10 * len(self.loaded),
            "pressure": "normal",
        }


@dataclass
class FakeSample:
    available: int

    def to_dict(self) -> dict[str, Any]:
        return {"available": self.available}


class FakeMonitor:
    latest = None  # no sample yet

    def history(self) -> list[FakeSample]:
        return [FakeSample(5)]


def services(settings: Settings | None = None) -> tuple[Services, FakeScheduler]:
    scheduler = FakeScheduler()
    catalog = FakeCatalog(spec("smollm2-135m"), spec("whisper-tiny.en", ModelKind.ASR, "whisper"))
    return (
        Services(
            settings=settings or Settings(),
            catalog=catalog,
            scheduler=scheduler,
            monitor=FakeMonitor(),
        ),
        scheduler,
    )


@dataclass
class Harness:
    client: Any  # starlette TestClient (an httpx.Client)
    scheduler: FakeScheduler


def http_scope(path: str, headers: list[tuple[bytes, bytes]], **extra: Any) -> dict[str, Any]:
    """The ASGI scope uvicorn hands the app for a POST to ``path`` on localhost, for tests that
    drive the app with their own ``receive`` (a client that stalls or leaves); ``extra`` keys
    are added to it (``app``)."""
    return {
        "type": "http",
        "asgi": {"version": "3.0", "spec_version": "2.3"},
        "http_version": "1.1",
        "method": "POST",
        "scheme": "http",
        "path": path,
        "raw_path": path.encode(),
        "root_path": "",
        "query_string": b"",
        "headers": headers,
        "client": ("127.0.0.1", 1),
        "server": ("127.0.0.1", 80),
        **extra,
    }
