"""OpenAI /v1/embeddings: strings (or token ids) in, unit-length vectors out (float lists or
base64).

``check_inputs`` is the one check of the inputs (Ollama's routes use it too); it builds the
engine's ``EmbedRequest`` (engines/requests.py)."""

from __future__ import annotations

import asyncio
import base64
import struct
from typing import Any, Literal

from fastapi import APIRouter, Request
from fastapi.responses import JSONResponse
from pydantic import BaseModel, ConfigDict

from elbowroom.engines.requests import EmbedRequest
from elbowroom.errors import BadRequest
from elbowroom.models.spec import ModelKind
from elbowroom.server.deps import get_services, parse_keep_alive
from elbowroom.server.http.metrics import record_model
from elbowroom.server.http.ollama_paths import strip_tag
from elbowroom.server.http.parsed_json import ParsedJSONRoute
from elbowroom.server.openai.token_inputs import cl100k_vocab, decode_cl100k, token_arrays
from elbowroom.server.stream.model_calls import EMBEDDING_ALIASES, resolve_model, run_once
from elbowroom.server.stream.sse import ClientGone, gone_response, unless_client_leaves

router = APIRouter(prefix="/v1", route_class=ParsedJSONRoute)


class EmbeddingsRequest(BaseModel):
    model_config = ConfigDict(extra="ignore")
    model: str | None = None  # None: what text-embedding-3-small maps to
    input: Any = None  # checked by hand below, for messages that name the problem
    encoding_format: Literal["float", "base64"] = "float"
    dimensions: int | None = None
    user: str | None = None  # accepted and ignored
    keep_alive: int | float | str | None = None


def check_inputs(raw: Any, limit: int, *, tokens: bool = False) -> EmbedRequest:
    """The engine's request: a string or a list of non-empty strings, at most ``limit`` of
    them (the one check; OpenAI's and Ollama's routes share it). ``tokens``: token-id
    arrays are accepted too (OpenAI's route; server/openai/token_inputs.py), left for the route
    or the engine to decode."""
    if raw is None:
        raise BadRequest("Missing required parameter: 'input'", param="input")
    items = [raw] if isinstance(raw, str) else raw
    if not isinstance(items, list):
        raise BadRequest("input must be a string or a list of strings", param="input")
    if not items:
        raise BadRequest("input must not be empty", param="input")
    arrays = token_arrays(items)
    if arrays is not None and not tokens:
        raise BadRequest(
            "token-id arrays are not supported as input here; send the text as strings",
            param="input",
        )
    inputs: tuple[str | tuple[int, ...], ...] = arrays or tuple(items)
    for i, item in enumerate(inputs):
        if isinstance(item, tuple):
            continue
        if not isinstance(item, str):
            raise BadRequest(f"input[{i}] must be a string", param="input")
        if not item.strip():
            raise BadRequest(f"input[{i}] is empty; every input must have text", param="input")
    if len(inputs) > limit:
        raise BadRequest(
            f"input has {len(inputs)} items; at most {limit} are allowed per request "
            "(ELBOWROOM_MAX_EMBEDDING_INPUTS)",
            param="input",
        )
    return EmbedRequest(inputs=inputs)


async def decode_for_alias(payload: EmbedRequest) -> EmbedRequest:
    """Token ids sent to an OpenAI model name were counted with cl100k_base: decoded here,
    the engine gets text (server/openai/token_inputs.py)."""
    if not any(isinstance(item, tuple) for item in payload.inputs):
        return payload
    await asyncio.to_thread(cl100k_vocab)  # the first time: ~0.2 s off the event loop
    return EmbedRequest(
        inputs=tuple(
            decode_cl100k(item, i) if isinstance(item, tuple) else item
            for i, item in enumerate(payload.inputs)
        )
    )


async def embed(
    request: Request,
    model_id: str,
    keep_alive: float | None,
    payload: EmbedRequest,
    dimensions: int | None,
) -> tuple[list[list[float]], int] | None:
    """The vectors of ``payload`` and its prompt tokens (OpenAI's and Ollama's routes);
    None when the client left, which stops the batch (the engine checks between its
    batches). A ``dimensions`` other than the model's is a 400: vectors are not shortened."""
    services = get_services(request)
    try:
        result = await unless_client_leaves(
            request, run_once(services.scheduler, model_id, keep_alive, "embed", payload)
        )
    except ClientGone:
        return None
    vectors: list[list[float]] = result["embeddings"]
    if dimensions is not None and vectors and dimensions != len(vectors[0]):
        raise BadRequest(
            f"the model {model_id!r} makes {len(vectors[0])}-dimensional embeddings and cannot "
            f"shorten them; leave dimensions out or set it to {len(vectors[0])}",
            param="dimensions",
        )
    return vectors, int(result.get("prompt_tokens", 0))


def encode_base64(vector: list[float]) -> str:
    """OpenAI's base64 encoding: little-endian float32, no numpy needed."""
    return base64.b64encode(struct.pack(f"<{len(vector)}f", *vector)).decode("ascii")


@router.post("/embeddings")
async def embeddings(request: Request, body: EmbeddingsRequest) -> JSONResponse:
    services = get_services(request)
    payload = check_inputs(body.input, services.settings.max_embedding_inputs, tokens=True)
    if body.dimensions is not None and body.dimensions < 1:
        raise BadRequest("dimensions must be a positive integer", param="dimensions")
    spec = resolve_model(
        services.catalog, body.model, ModelKind.EMBEDDING, EMBEDDING_ALIASES, "/v1/embeddings"
    )
    if spec.id != strip_tag(body.model or ""):  # an alias: cl100k ids
        payload = await decode_for_alias(payload)
    record_model(request, spec)
    keep_alive = parse_keep_alive(body.keep_alive)
    embedded = await embed(request, spec.id, keep_alive, payload, body.dimensions)
    if embedded is None:
        return gone_response()  # type: ignore[return-value]
    vectors, tokens = embedded
    encode = encode_base64 if body.encoding_format == "base64" else list
    return JSONResponse(
        {
            "object": "list",
            "data": [
                {"object": "embedding", "index": i, "embedding": encode(v)}
                for i, v in enumerate(vectors)
            ],
            "model": spec.id,
            "usage": {"prompt_tokens": tokens, "total_tokens": tokens},
        }
    )
