"""OpenAI text routes: /v1/models, /v1/chat/completions, /v1/completions."""

from __future__ import annotations

import logging
import time
from typing import Any

from fastapi import APIRouter, Request
from fastapi.responses import JSONResponse, Response

from elbowroom.engines.requests import TextTicket
from elbowroom.errors import BadRequest, ModelNotFound
from elbowroom.models.spec import ModelKind, ModelSpec
from elbowroom.models.vision import capabilities
from elbowroom.server.deps import get_services, parse_keep_alive
from elbowroom.server.http.metrics import record_model
from elbowroom.server.http.parsed_json import ParsedJSONRoute
from elbowroom.server.openai.images import check_chat_images
from elbowroom.server.openai.rewriter import OpenAIRewriter
from elbowroom.server.openai.schemas import ChatCompletionRequest, CompletionRequest, refuse_absurd
from elbowroom.server.openai.shapes import Envelope, Logprobs
from elbowroom.server.openai.text_calls import engine_request
from elbowroom.server.stream.model_calls import alias_target
from elbowroom.server.stream.relay import Relay
from elbowroom.server.stream.sse import ManagedStream, gone_response

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

    include_usage = body.include_usage()

    def rewriter(ticket: TextTicket) -> OpenAIRewriter:
        return OpenAIRewriter(ticket, envelope, include_usage, view, streamed=text.stream)

    relay = await Relay.open(services.scheduler, spec.id, keep_alive, text, rewriter)
    if text.stream:
        return ManagedStream(relay.stream(), release=relay.release)
    answer = await relay.collect(request)
    return gone_response() if answer is None else JSONResponse(answer)


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
