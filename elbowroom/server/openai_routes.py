"""OpenAI text routes: /v1/models, /v1/chat/completions, /v1/completions."""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import AsyncIterator
from typing import Any

from fastapi import APIRouter, Request
from fastapi.responses import JSONResponse, Response

from elbowroom.errors import BadRequest, ElbowroomError, ModelNotFound
from elbowroom.models.spec import ModelKind, ModelSpec
from elbowroom.models.vision import capabilities
from elbowroom.server.deps import get_services, parse_keep_alive
from elbowroom.server.direct import open_direct
from elbowroom.server.errors import public_error
from elbowroom.server.images import check_chat_images
from elbowroom.server.metrics import record_model, record_tokens
from elbowroom.server.model_calls import alias_target
from elbowroom.server.parsed_json import ParsedJSONRoute
from elbowroom.server.schemas import ChatCompletionRequest, CompletionRequest, refuse_absurd
from elbowroom.server.shapes import Envelope, Logprobs
from elbowroom.server.sse import (
    DONE,
    Generation,
    ManagedStream,
    abandon,
    gone_response,
    hold_runner,
    sse,
    start_generation,
)
from elbowroom.server.text_calls import engine_request, whole_answer

log = logging.getLogger("elbowroom.server")

router = APIRouter(prefix="/v1", route_class=ParsedJSONRoute)


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
        "capabilities": capabilities(spec),
    }


@router.get("/models")
async def list_models(request: Request) -> dict[str, Any]:
    catalog = get_services(request).catalog
    return {"object": "list", "data": [model_card(spec) for spec in catalog.list()]}


# ":path" so that ids with slashes (e.g. "../../etc/passwd") reach the catalog and get its
# model_not_found 404 instead of an unknown-route 404.
@router.get("/models/{model_id:path}")
async def get_model(request: Request, model_id: str) -> dict[str, Any]:
    catalog = get_services(request).catalog
    try:
        return model_card(catalog.get(model_id))
    except ModelNotFound:
        target = alias_target(catalog, model_id)  # whisper-1, tts-1, text-embedding-3-small
        if target is None:
            raise
        return {**model_card(target), "id": model_id, "root": target.id}


@router.post("/chat/completions")
async def chat_completions(request: Request, body: ChatCompletionRequest) -> Response:
    await check_chat_images(get_services(request), body)  # vision: before any engine work
    return await _generate(request, body)


@router.post("/completions")
async def completions(request: Request, body: CompletionRequest) -> Response:
    return await _generate(request, body)


async def _generate(request: Request, body: ChatCompletionRequest | CompletionRequest) -> Response:
    services = get_services(request)
    settings = services.settings
    spec = _text_model(services.catalog, body.model or settings.default_model)
    record_model(request, spec)
    _check_for_model(spec, body)
    refuse_absurd(*body.requested_max_tokens(), settings.max_tokens_cap)
    text = engine_request(body, settings)
    keep_alive = parse_keep_alive(body.keep_alive)
    envelope = Envelope.new(text.kind, spec.id, int(time.time()))
    top = body.top_count()
    view = Logprobs(text.kind, top) if top is not None else None

    runner, stack = await hold_runner(services.scheduler, spec.id, keep_alive)
    if settings.direct_streams:
        try:
            direct = await open_direct(runner, stack, spec.id, text, body.include_usage())
        except BaseException as exc:
            await abandon(stack, exc)
            raise
        if direct is not None and text.stream:
            return ManagedStream(direct, release=direct.release)
        if direct is not None:
            answer = await whole_answer(
                request, direct.answer(), direct.release, f"a request on {spec.id}"
            )
            return gone_response() if answer is None else JSONResponse(answer)
    generation = await start_generation(runner, stack, text)
    if text.stream:
        return ManagedStream(
            _stream(generation, envelope, body.include_usage(), view), release=generation.release
        )
    done = await whole_answer(
        request, _collect(generation), generation.release, f"{envelope.id} on {spec.id}"
    )
    if done is None:
        return gone_response()
    record_tokens(spec.id, done.get("usage"))
    return JSONResponse(
        envelope.response(
            str(done.get("text", "")),
            done.get("finish_reason"),
            done.get("usage", {}),
            tool_calls=done.get("tool_calls") or None,
            logprobs=view.render(done.get("logprobs") or []) if view is not None else None,
            reasoning=done.get("reasoning") or None,
        )
    )


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


# Content parts a model could only read with an ear or an eye elbowroom does not have yet.
_UNREADABLE_PARTS = {
    "image_url": "has no vision: image_url content parts need a vision model (an LLM with "
    "its mmproj projector beside it; docs/models.md#vision). GET /v1/models shows which "
    "models have vision. Send the text only, or choose a vision model.",
    "input_audio": "cannot hear: transcribe the audio first (POST /v1/audio/transcriptions) "
    "and send the text.",
    "file": "cannot read file parts: send the file's text as a text part.",
}


def _check_for_model(spec: ModelSpec, body: ChatCompletionRequest | CompletionRequest) -> None:
    """What only the model can decide: which content parts it reads, which token ids its
    vocabulary has (the engine silently ignores a logit_bias id it does not know)."""
    if isinstance(body, ChatCompletionRequest):
        for i, msg in enumerate(body.messages):
            for j, part in enumerate(msg.content if isinstance(msg.content, list) else ()):
                if part.type in _UNREADABLE_PARTS and not (
                    part.type == "image_url" and spec.vision
                ):
                    raise BadRequest(
                        f"The model {spec.id!r} {_UNREADABLE_PARTS[part.type]}",
                        param=f"messages[{i}].content[{j}].type",
                        code="model_not_supported",
                    )
    n_vocab = spec.gguf.n_vocab if spec.gguf is not None else None
    unknown = [t for t in body.token_ids() if n_vocab is not None and t >= n_vocab]
    if unknown:
        raise BadRequest(
            f"logit_bias names token id {unknown[0]}, which is not in the vocabulary of "
            f"{spec.id!r} (ids 0..{(n_vocab or 1) - 1})",
            param="logit_bias",
            code="invalid_value",
        )


async def _collect(generation: Generation) -> dict[str, Any]:
    pieces: list[str] = []
    async for item in generation.events():
        if item.get("type") == "done":
            done = dict(item)
            done.setdefault("text", "".join(pieces))
            return done
        pieces.append(str(item.get("text", "")))
    raise ElbowroomError("the runner ended the request without a result")


def _late_chunk(
    envelope: Envelope,
    done: dict[str, Any],
    view: Logprobs | None,
    streamed_logprobs: int,
    streamed_calls: bool,
    include_usage: bool,
) -> dict[str, Any] | None:
    """What the engine reported only with its result (emulated tool calls are parsed from
    the whole reply), as one chunk before the last, so a stream adds up to the whole answer."""
    entries = list(done.get("logprobs") or ())[streamed_logprobs:] if view is not None else []
    calls = None if streamed_calls else done.get("tool_calls")
    if not entries and not calls:
        return None
    return envelope.chunk(
        None,
        include_usage=include_usage,
        tool_calls=[{"index": i, **c} for i, c in enumerate(calls)] if calls else None,
        logprobs=view.render(entries) if view is not None and entries else None,
    )


async def _stream(
    generation: Generation, envelope: Envelope, include_usage: bool, view: Logprobs | None
) -> AsyncIterator[bytes]:
    failure: BaseException | None = None
    streamed_logprobs = 0
    streamed_calls = False
    try:
        if envelope.kind == "chat":
            yield sse(envelope.chunk("", first=True, include_usage=include_usage))
        async for item in generation.events():
            if item.get("type") == "done":
                record_tokens(envelope.model, item.get("usage"))
                late = _late_chunk(
                    envelope, item, view, streamed_logprobs, streamed_calls, include_usage
                )
                if late is not None:
                    yield sse(late)
                finish = item.get("finish_reason")
                yield sse(envelope.chunk(None, finish, include_usage=include_usage))
                if include_usage:
                    yield sse(envelope.usage_chunk(item.get("usage", {})))
                yield DONE
                return
            text = str(item.get("text") or "")
            calls = item.get("tool_calls") or None
            entries = item.get("logprobs") or None
            reasoning = item.get("reasoning") or None
            if not (text or calls or reasoning or (entries and view is not None)):
                continue
            streamed_calls = streamed_calls or bool(calls)
            streamed_logprobs += len(entries or ())
            yield sse(
                envelope.chunk(
                    text if text or envelope.kind == "completion" else None,
                    include_usage=include_usage,
                    tool_calls=calls,
                    logprobs=view.render(entries) if view is not None and entries else None,
                    reasoning=reasoning,
                )
            )
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
