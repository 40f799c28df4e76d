"""OpenAI's Responses API on the chat path: ``POST /v1/responses`` (streamed or not),
``GET`` / ``DELETE /v1/responses/{id}``, ``GET /v1/responses/{id}/input_items``.

A request is translated (server/openai/responses_shapes.py) into the chat request the chat route
validates and runs (``openai_routes.chat_completions``): the same model checks, limits,
scheduler, direct streams and errors (a 507 or 503 keeps its status and OpenAI's error
body, before any event is sent). Its answer is translated back. A stored response
(server/openai/responses_store.py) keeps its whole conversation, and ``previous_response_id``
sends that conversation again with the new input: the engine finds its prefix in the
slot that served it, its RAM prompt cache or the KV disk tier (docs/kvcache.md), also
after the model was unloaded or the server restarted, so a continuation prefills only
the new turn.
"""

from __future__ import annotations

import asyncio
import json
import logging
from collections.abc import AsyncIterator, Awaitable, Callable
from typing import Annotated, Any

from fastapi import APIRouter, Query, Request
from fastapi.responses import JSONResponse, Response
from pydantic import ValidationError

from elbowroom.errors import BadRequest, ElbowroomError, PayloadTooLarge, ResponseNotFound
from elbowroom.server.deps import get_services
from elbowroom.server.errors import public_error, validation_to_bad_request
from elbowroom.server.http.auth import Keys
from elbowroom.server.openai import routes as openai_routes
from elbowroom.server.openai.responses_shapes import (
    ResponsesRequest,
    StreamTranslator,
    Turn,
    chat_messages,
    output_messages,
)
from elbowroom.server.openai.responses_store import ResponseStore
from elbowroom.server.openai.schemas import ChatCompletionRequest, refuse_absurd
from elbowroom.server.stream.sse import ManagedStream

log = logging.getLogger("elbowroom.server")

router = APIRouter(prefix="/v1")


@router.post("/responses")
async def create_response(request: Request, body: ResponsesRequest) -> Response:
    services = get_services(request)
    settings = services.settings
    model = services.catalog.get(body.model or settings.default_model).id
    store, owner = _store_and_owner(request)
    history: list[dict[str, Any]] = []
    if body.previous_response_id is not None:
        previous = await _get(store, body.previous_response_id, owner)
        if previous is None:
            raise _not_found(body.previous_response_id, param="previous_response_id")
        history = list(previous.get("conversation") or [])
    items = body.input_items()
    new = chat_messages(items)
    chat = body.chat_body(model, history, new)
    if len(chat["messages"]) > settings.max_messages:
        raise PayloadTooLarge(
            f"The conversation has {len(chat['messages'])} messages; at most "
            f"{settings.max_messages} are allowed (max_messages)",
            param="input",
            code="too_many_messages",
        )
    refuse_absurd(body.max_output_tokens, "max_output_tokens", settings.max_tokens_cap)
    try:
        chat_request = ChatCompletionRequest.model_validate(chat)
    except ValidationError as exc:
        raise _in_responses_terms(validation_to_bad_request(exc.errors())) from None
    turn = Turn(body, model)
    conversation = history + new

    def record(response: dict[str, Any]) -> dict[str, Any]:
        return {
            "response": response,
            "input_items": items,
            "conversation": conversation + output_messages(response["output"]),
        }

    try:
        inner = await openai_routes.chat_completions(request, chat_request)
    except BadRequest as err:  # the model's checks (parts it cannot read, images)
        raise _in_responses_terms(err) from None
    if not body.stream:
        if inner.status_code != 200 or not isinstance(inner, JSONResponse):
            return inner  # the client left (499)
        response = turn.from_completion(json.loads(bytes(inner.body)))
        if body.store is not False:
            await asyncio.to_thread(store.put, turn.id, owner, record(response))
        return JSONResponse(response)
    if not isinstance(inner, ManagedStream):
        return inner
    release: Callable[[], Awaitable[None]] | None = getattr(inner, "_release", None)
    translator = StreamTranslator(turn)
    keep = store if body.store is not False else None
    return ManagedStream(
        _stream(inner.body_iterator, translator, keep, owner, record),  # type: ignore[arg-type]
        release=release,
    )


async def _stream(
    chunks: AsyncIterator[bytes],
    translator: StreamTranslator,
    store: ResponseStore | None,
    owner: str,
    record: Callable[[dict[str, Any]], dict[str, Any]],
) -> AsyncIterator[bytes]:
    """The chat stream's SSE events (``data: {...}``, ``[DONE]``) as Responses events."""
    for out in translator.start():
        yield out
    pending = b""
    finished = False
    try:
        async for data in chunks:
            pending += data
            *events, pending = pending.split(b"\n\n")
            for event in events:
                if not event.startswith(b"data: "):
                    continue
                payload = event[6:]
                if payload == b"[DONE]":
                    finished = True
                    break
                chunk = json.loads(payload)
                if isinstance(chunk, dict) and "error" in chunk:
                    error = chunk["error"] if isinstance(chunk["error"], dict) else {}
                    for out in translator.failed(error):
                        yield out
                    return
                for out in translator.chunk(chunk):
                    yield out
            if finished:
                break
        if not finished:
            err = ElbowroomError("the chat stream ended without a result")
            for out in translator.failed(
                public_error(err, "a response stream").to_openai()["error"]
            ):
                yield out
            return
        last = translator.done()
        if store is not None and translator.final is not None:
            # Stored before the client hears it is complete: a GET right after finds it.
            await asyncio.to_thread(store.put, translator.turn.id, owner, record(translator.final))
        for out in last:
            yield out
    finally:
        close = getattr(chunks, "aclose", None)
        if close is not None:
            await close()


@router.get("/responses/{response_id}")
async def get_response(
    request: Request,
    response_id: str,
    stream: bool = False,
    include: Annotated[list[str] | None, Query()] = None,
) -> dict[str, Any]:
    if stream:
        raise BadRequest(
            "stream=true (replaying a stored response's events) is not supported: the stored "
            "response is returned whole",
            param="stream",
            code="invalid_value",
        )
    if include:
        raise BadRequest(
            f"include {include[0]!r} is not supported", param="include", code="invalid_value"
        )
    store, owner = _store_and_owner(request)
    found = await _get(store, response_id, owner)
    if found is None:
        raise _not_found(response_id)
    response: dict[str, Any] = found["response"]
    return response


@router.delete("/responses/{response_id}")
async def delete_response(request: Request, response_id: str) -> dict[str, Any]:
    store, owner = _store_and_owner(request)
    if not await asyncio.to_thread(store.delete, response_id, owner):
        raise _not_found(response_id)
    return {"id": response_id, "object": "response.deleted", "deleted": True}


@router.get("/responses/{response_id}/input_items")
async def list_input_items(
    request: Request,
    response_id: str,
    limit: int = Query(20, ge=1, le=100),
    order: str = Query("desc", pattern="^(asc|desc)$"),
    after: str | None = None,
) -> dict[str, Any]:
    store, owner = _store_and_owner(request)
    found = await _get(store, response_id, owner)
    if found is None:
        raise _not_found(response_id)
    items: list[dict[str, Any]] = list(found.get("input_items") or [])
    if order == "desc":
        items.reverse()
    if after is not None:
        ids = [item.get("id") for item in items]
        if after not in ids:
            raise BadRequest(
                f"after {after!r} is not an input item of {response_id}",
                param="after",
                code="invalid_value",
            )
        items = items[ids.index(after) + 1 :]
    page = items[:limit]
    return {
        "object": "list",
        "data": page,
        "first_id": page[0]["id"] if page else None,
        "last_id": page[-1]["id"] if page else None,
        "has_more": len(items) > limit,
    }


# ---- the store -------------------------------------------------------------------------------


def _store_and_owner(request: Request) -> tuple[ResponseStore, str]:
    """The app's store (made on first use) and who is asking: with keys set, the key's
    owner name, so that another key's responses do not exist for it."""
    settings = get_services(request).settings
    state = request.app.state
    store: ResponseStore | None = getattr(state, "responses_store", None)
    if store is None:
        store = ResponseStore(
            settings.responses_path, settings.responses_ttl, settings.responses_max
        )
        state.responses_store = store
        state.responses_keyed = Keys.from_settings(settings).any
    if not state.responses_keyed:
        return store, ""
    value = request.headers.get("authorization", "")
    scheme, _, token = value.partition(" ")
    # The API key middleware let this request in, so the token is one of the keys.
    return store, store.owner_of(token.strip() if scheme.lower() == "bearer" else "")


async def _get(store: ResponseStore, response_id: str, owner: str) -> dict[str, Any] | None:
    return await asyncio.to_thread(store.get, response_id, owner)


# The chat request's params, as this request named them.
_PARAMS = {
    "messages": "input",
    "response_format": "text.format",
    "max_completion_tokens": "max_output_tokens",
}


def _in_responses_terms(err: BadRequest) -> BadRequest:
    """A 400 of the chat schema, naming what the client sent instead of the chat field."""
    param = err.param or ""
    head = param.split(".", 1)[0].split("[", 1)[0]
    if head not in _PARAMS:
        return err
    where = _PARAMS[head]
    message = err.message.replace(repr(param), repr(where))
    if head == "messages":
        message += (
            f" ({param} of the conversation as chat messages: the instructions, the stored "
            "conversation, then input)"
        )
    return type(err)(message, param=where, code=err.code, details=err.details)


def _not_found(response_id: str, param: str | None = None) -> ResponseNotFound:
    return ResponseNotFound(
        f"No response with id {response_id!r} is stored here: it never was (store: false), "
        "it expired (responses_ttl), was deleted or pushed out (responses_max), or it belongs "
        "to another API key.",
        param=param,
        code="response_not_found",
    )
