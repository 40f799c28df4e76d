"""OpenAI text routes: /v1/models, /v1/chat/completions, /v1/completions."""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import AsyncIterator
from typing import Any

from fastapi import APIRouter, Request
from fastapi.responses import JSONResponse, Response

from elbowroom.errors import BadRequest, ElbowroomError
from elbowroom.models.spec import ModelKind, ModelSpec
from elbowroom.server.deps import get_services, parse_keep_alive
from elbowroom.server.errors import public_error
from elbowroom.server.metrics import record_tokens
from elbowroom.server.schemas import ChatCompletionRequest, CompletionRequest
from elbowroom.server.shapes import Envelope, Kind
from elbowroom.server.sse import DONE, Generation, ManagedStream, open_generation, sse

log = logging.getLogger("elbowroom.server")

router = APIRouter(prefix="/v1")

# Above this a max_tokens is a client bug, not a wish: 400 instead of clamping.
ABSURD_MAX_TOKENS = 1 << 20


def model_card(spec: ModelSpec) -> dict[str, Any]:
    try:
        created = int(spec.path.stat().st_mtime)
    except OSError:
        created = 0
    return {
        "id": spec.id,
        "object": "model",
        "created": created,
        "owned_by": "elbowroom",
        "kind": str(spec.kind),
        "engine": spec.engine,
    }


@router.get("/models")
async def list_models(request: Request) -> dict[str, Any]:
    catalog = get_services(request).catalog
    return {"object": "list", "data": [model_card(spec) for spec in catalog.list()]}


# ":path" so that ids with slashes (e.g. "../../etc/passwd") reach the catalog and get its
# model_not_found 404 instead of an unknown-route 404.
@router.get("/models/{model_id:path}")
async def get_model(request: Request, model_id: str) -> dict[str, Any]:
    return model_card(get_services(request).catalog.get(model_id))


@router.post("/chat/completions")
async def chat_completions(request: Request, body: ChatCompletionRequest) -> Response:
    messages = [m.to_engine() for m in body.messages]
    return await _generate(request, body, "chat", {"messages": messages})


@router.post("/completions")
async def completions(request: Request, body: CompletionRequest) -> Response:
    return await _generate(request, body, "completion", {"prompt": body.prompt_text()})


async def _generate(
    request: Request,
    body: ChatCompletionRequest | CompletionRequest,
    kind: Kind,
    inputs: dict[str, Any],
) -> Response:
    services = get_services(request)
    settings = services.settings
    spec = _text_model(services.catalog, body.model or settings.default_model)
    max_tokens, param = body.requested_max_tokens()
    if max_tokens is not None and max_tokens > ABSURD_MAX_TOKENS:
        raise BadRequest(
            f"{param}={max_tokens} is absurd: no context holds more than {ABSURD_MAX_TOKENS} "
            f"tokens; this server generates at most {settings.max_tokens_cap} per request "
            "(max_tokens_cap)",
            param=param,
            code="invalid_value",
        )
    if max_tokens is not None:
        # Clients often ask for far more than they need (16384 is a common default): the
        # hard cap applies, as the context's room does in the engine; the reply then ends
        # with finish_reason "length".
        max_tokens = min(max_tokens, settings.max_tokens_cap)
    keep_alive = parse_keep_alive(body.keep_alive)
    payload = {**inputs, **body.sampling(max_tokens)}
    envelope = Envelope.new(kind, spec.id, int(time.time()))

    generation = await open_generation(services.scheduler, spec.id, keep_alive, kind, payload)
    if body.stream:
        return ManagedStream(_stream(generation, envelope, body.include_usage()))
    try:
        done = await _collect(generation)
    except BaseException as exc:
        await generation.release(exc)
        raise
    await generation.release()
    record_tokens(spec.id, done.get("usage"))
    text = str(done.get("text", ""))
    return JSONResponse(envelope.response(text, done.get("finish_reason"), done.get("usage", {})))


def _text_model(catalog: Any, model_id: str) -> ModelSpec:
    spec: ModelSpec = catalog.get(model_id)
    if spec.kind != ModelKind.LLM:
        raise BadRequest(
            f"The model {spec.id!r} is a {spec.kind} model ({spec.engine}); text completions "
            "need an llm model. GET /v1/models lists each model's kind.",
            param="model",
            code="model_not_supported",
        )
    return spec


async def _collect(generation: Generation) -> dict[str, Any]:
    pieces: list[str] = []
    async for item in generation.events():
        if item.get("type") == "done":
            done = dict(item)
            done.setdefault("text", "".join(pieces))
            return done
        pieces.append(str(item.get("text", "")))
    raise ElbowroomError("the runner ended the request without a result")


async def _stream(
    generation: Generation, envelope: Envelope, include_usage: bool
) -> AsyncIterator[bytes]:
    failure: BaseException | None = None
    try:
        if envelope.kind == "chat":
            yield sse(envelope.chunk("", first=True, include_usage=include_usage))
        async for item in generation.events():
            if item.get("type") == "done":
                record_tokens(envelope.model, item.get("usage"))
                finish = item.get("finish_reason")
                yield sse(envelope.chunk(None, finish, include_usage=include_usage))
                if include_usage:
                    yield sse(envelope.usage_chunk(item.get("usage", {})))
                yield DONE
                return
            text = str(item.get("text", ""))
            if text:
                yield sse(envelope.chunk(text, include_usage=include_usage))
        raise ElbowroomError("the runner ended the stream without a result")
    except ElbowroomError as err:
        # Headers are gone already: the error becomes the stream's last event.
        failure = err
        yield sse(public_error(err, f"stream {envelope.id}").to_openai())
    except (GeneratorExit, asyncio.CancelledError):
        # The client went away: closing the runner's iterator (in release) cancels the work.
        log.info("client went away mid-stream: cancelling %s on %s", envelope.id, envelope.model)
        raise
    except Exception as err:
        failure = err
        yield sse(public_error(err, f"stream {envelope.id}").to_openai())
    finally:
        # A disconnect (GeneratorExit / cancellation) is a normal release for the scheduler.
        await generation.release(failure)
