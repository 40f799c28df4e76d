"""Ollama's API under /api: tags, ps, show, version, chat, generate, embed, embeddings.

Text requests are translated into OpenAI request fields (``ollama_shapes``), validated by
the OpenAI routes' own schemas and made into the engine's ``TextRequest`` by the same
``text_calls.engine_request``, so the scheduler, the memory guard and the engine see one
kind of request whichever API it came from. Every error on these routes has Ollama's
shape, ``{"error": "..."}``, with the status elbowroom uses everywhere (a 507 keeps its
numbers as extra fields).
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Coroutine
from typing import Any

from fastapi import APIRouter, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, Response
from pydantic import ValidationError

from elbowroom import __version__
from elbowroom.engines.requests import TextTicket
from elbowroom.errors import BadRequest, ElbowroomError, ModelNotFound
from elbowroom.models.spec import ModelKind, ModelSpec
from elbowroom.server import admin_routes
from elbowroom.server.deps import ContextFitter, Services, get_services, parse_keep_alive
from elbowroom.server.errors import validation_to_bad_request
from elbowroom.server.http.auth import ADMIN_SCOPE_KEY
from elbowroom.server.http.metrics import record_model
from elbowroom.server.http.ollama_paths import error_body, strip_tag
from elbowroom.server.http.parsed_json import ParsedJSONRoute
from elbowroom.server.ollama import models as views
from elbowroom.server.ollama import shapes
from elbowroom.server.ollama.reply import NdjsonStream, Reply, Timing
from elbowroom.server.ollama.rewriter import OllamaRewriter
from elbowroom.server.openai.embeddings_routes import check_inputs
from elbowroom.server.openai.embeddings_routes import embed as embed_inputs
from elbowroom.server.openai.images import check_chat_images
from elbowroom.server.openai.schemas import ChatCompletionRequest, CompletionRequest, refuse_absurd
from elbowroom.server.openai.text_calls import engine_request
from elbowroom.server.stream.model_calls import run_once
from elbowroom.server.stream.relay import Relay
from elbowroom.server.stream.sse import gone_response

log = logging.getLogger("elbowroom.server")


class _NotImplementedHere(ElbowroomError):
    status = 501
    type = "not_implemented"


def ollama_error(err: ElbowroomError) -> JSONResponse:
    return JSONResponse(error_body(err), status_code=err.status, headers=err.headers())


class OllamaRoute(ParsedJSONRoute):
    """Turns every error of an Ollama route into Ollama's shape (the app's handlers would
    answer in OpenAI's)."""

    def get_route_handler(self) -> Callable[[Request], Coroutine[Any, Any, Response]]:
        handler = super().get_route_handler()

        async def ollama_handler(request: Request) -> Response:
            try:
                return await handler(_as_json(request))
            except ElbowroomError as err:
                if err.status >= 500:
                    log.warning("%s %s -> %d %s", request.method, request.url.path, err.status, err)
                return ollama_error(err)
            except RequestValidationError as exc:
                return ollama_error(validation_to_bad_request(exc.errors()))

        return ollama_handler


def _as_json(request: Request) -> Request:
    """Ollama reads every body as JSON whatever its Content-Type (its docs use plain
    `curl -d`, which sends a form type): do the same."""
    ctype = request.headers.get("content-type", "")
    if request.method not in ("POST", "DELETE") or ctype.startswith("application/json"):
        return request
    scope = dict(request.scope)
    scope["headers"] = [
        *((k, v) for k, v in request.scope["headers"] if k != b"content-type"),
        (b"content-type", b"application/json"),
    ]
    return Request(scope, request.receive)


router = APIRouter(prefix="/api", route_class=OllamaRoute)


def resolve(catalog: Any, name: str, kinds: tuple[ModelKind, ...], endpoint: str) -> ModelSpec:
    """The spec for an Ollama model name ("id" or "id:latest"), of one of ``kinds``."""
    spec: ModelSpec | None = None
    for candidate in dict.fromkeys((name, strip_tag(name))):
        try:
            spec = catalog.get(candidate)
            break
        except ModelNotFound:
            continue
    if spec is None:
        err = ModelNotFound(name)
        err.message = (
            f"model '{name}' not found: GET /api/tags lists the models this server has; "
            "models come from files (elbowroom serve --model PATH or the models folder) "
            "and from Hugging Face (POST /api/pull with hf.co/USER/REPO[:QUANT])"
        )
        raise err
    if spec.kind not in kinds:
        raise BadRequest(
            f"model '{spec.id}' is a {spec.kind} model ({spec.engine}); {endpoint} needs "
            f"a {' or '.join(str(k) for k in kinds)} model (GET /api/tags lists them)",
            param="model",
            code="model_not_supported",
        )
    return spec


# --- models -----------------------------------------------------------------------------


@router.get("/version")
async def version() -> dict[str, str]:
    return {"version": shapes.OLLAMA_API_VERSION, "elbowroom": __version__}


@router.get("/tags")
async def tags(request: Request) -> dict[str, Any]:
    catalog = get_services(request).catalog
    served = (ModelKind.LLM, ModelKind.EMBEDDING)  # what the Ollama API can run
    return {"models": [views.tag(s) for s in catalog.list() if s.kind in served]}


@router.post("/show")
async def show(request: Request, body: shapes.ShowBody) -> dict[str, Any]:
    catalog = get_services(request).catalog
    spec = resolve(catalog, body.model_name(), tuple(ModelKind), "/api/show")
    return views.show(spec)


@router.get("/ps")
async def ps(request: Request) -> dict[str, Any]:
    """Ollama's /api/ps, each model with elbowroom's measurements riding along."""
    services = get_services(request)
    rows = await admin_routes.ps_rows(services)
    now = time.time()
    models = []
    for row in rows:
        try:
            spec = services.catalog.get(row["id"])
        except ModelNotFound:
            continue
        entry = views.ps_entry(spec, row, now)
        if request.scope.get(ADMIN_SCOPE_KEY) is False:
            entry.pop("pid", None)  # an inference key learns no process ids
        models.append(entry)
    summary = admin_routes.summary(services.scheduler.memory_report())
    return {"models": models, "memory": summary}


@router.api_route("/push", methods=["POST"], operation_id="ollama_push")
@router.api_route("/create", methods=["POST"], operation_id="ollama_create")
@router.api_route("/copy", methods=["POST"], operation_id="ollama_copy")
@router.api_route("/blobs/{digest}", methods=["HEAD"], operation_id="ollama_blobs_head")
@router.api_route("/blobs/{digest}", methods=["POST"], operation_id="ollama_blobs_post")
async def not_here(request: Request) -> Response:
    raise _NotImplementedHere(
        f"{request.method} {request.url.path} is not supported: elbowroom does not push, "
        "create or copy models. It downloads them from Hugging Face (POST /api/pull with "
        "hf.co/USER/REPO[:QUANT]) and serves model files it finds: put a GGUF file (or a "
        "whisper/piper/ONNX folder) in the models folder (~/.local/share/elbowroom/models, "
        "ELBOWROOM_MODELS_DIR) or name it with `elbowroom serve --model PATH`; GET /api/tags "
        "lists what it serves."
    )


# --- text -------------------------------------------------------------------------------


@router.post("/chat")
async def chat(request: Request, body: shapes.ChatBody) -> Response:
    services = get_services(request)
    spec = resolve(services.catalog, body.model, (ModelKind.LLM,), "/api/chat")
    record_model(request, spec)
    keep_alive = parse_keep_alive(body.keep_alive)
    if not body.messages:  # Ollama: load (or, with keep_alive 0, unload) the model
        return await _load_or_unload(services, spec, body.model, keep_alive, chat=True)
    openai = shapes.chat_to_openai(body)
    return await _text(request, services, spec, body, "chat", openai, keep_alive)


@router.post("/generate")
async def generate(request: Request, body: shapes.GenerateBody) -> Response:
    services = get_services(request)
    spec = resolve(services.catalog, body.model, (ModelKind.LLM,), "/api/generate")
    record_model(request, spec)
    keep_alive = parse_keep_alive(body.keep_alive)
    if not body.prompt and not body.images:
        return await _load_or_unload(services, spec, body.model, keep_alive, chat=False)
    kind, openai = shapes.generate_to_openai(body)
    return await _text(request, services, spec, body, kind, openai, keep_alive)


async def _load_only(services: Services, spec: ModelSpec, keep_alive: float | None) -> None:
    """A request with nothing to run (Ollama's way to load a model): the model loads, and
    keep_alive sets how long it stays, as after any request."""
    async with services.scheduler.use(spec.id, keep_alive=keep_alive):
        pass


async def _load_or_unload(
    services: Services, spec: ModelSpec, name: str, keep_alive: float | None, *, chat: bool
) -> Response:
    scheduler = services.scheduler
    if keep_alive == 0:
        row = next((r for r in scheduler.ps() if r["id"] == spec.id), None)
        if row is not None and row.get("pinned"):
            raise BadRequest(
                f"model '{spec.id}' is pinned and stays loaded; unpin it first: "
                f'POST /api/models/{spec.id}/load with {{"pin": false}}',
                param="keep_alive",
                code="model_pinned",
            )
        await scheduler.unload(spec.id)
        reason = "unload"
    else:
        await _load_only(services, spec, keep_alive)
        reason = "load"
    body: dict[str, Any] = {"model": name, "created_at": shapes.now_iso()}
    if chat:
        body["message"] = {"role": "assistant", "content": ""}
    else:
        body["response"] = ""
    body.update(done=True, done_reason=reason)
    return JSONResponse(body)


def _validated(kind: str, openai: dict[str, Any]) -> ChatCompletionRequest | CompletionRequest:
    schema = ChatCompletionRequest if kind == "chat" else CompletionRequest
    try:
        return schema.model_validate(openai)
    except ValidationError as exc:
        raise validation_to_bad_request(exc.errors()) from None


async def _check_num_ctx(services: Services, spec: ModelSpec, num_ctx: int | None) -> None:
    """Ollama loads a model with the context ``num_ctx`` asks for: a model loaded with less
    is reloaded at ``num_ctx`` when the budget allows (after its requests in flight finish;
    ``Scheduler.fit_context``), the 507 when it does not. A smaller one runs as it is."""
    if num_ctx is None:
        return
    scheduler = services.scheduler
    if isinstance(scheduler, ContextFitter):
        await scheduler.fit_context(spec.id, num_ctx)
        return
    # A scheduler that cannot reload (the cluster's router): the loaded context is the most.
    ready = [r for r in scheduler.ps() if r["id"] == spec.id and r.get("state") == "ready"]
    row = ready[0] if ready else None
    if row is None:
        row = await scheduler.load(spec.id)
    n_ctx = row.get("n_ctx")
    if n_ctx and num_ctx > n_ctx:
        raise BadRequest(
            f"options.num_ctx={num_ctx} is above the {n_ctx}-token context elbowroom gave "
            f"'{spec.id}' (per request slot, sized from its memory budget when it loaded); "
            f"ask for at most {n_ctx}, or restart the server with --ctx {num_ctx} "
            "(ELBOWROOM_CTX) if memory allows",
            param="num_ctx",
            code="context_length_exceeded",
        )


async def _text(
    request: Request,
    services: Services,
    spec: ModelSpec,
    body: shapes.ChatBody | shapes.GenerateBody,
    kind: str,
    openai: dict[str, Any],
    keep_alive: float | None,
) -> Response:
    openai["model"] = spec.id
    validated = _validated(kind, openai)
    refuse_absurd(validated.max_tokens, "num_predict", services.settings.max_tokens_cap)
    messages = None
    if isinstance(validated, ChatCompletionRequest):
        await check_chat_images(services, validated)  # vision: before any load or engine work
        messages = _engine_messages(validated, openai["messages"])
    _, num_ctx = shapes.options_to_openai(body.options)
    await _check_num_ctx(services, spec, num_ctx)
    text = engine_request(validated, services.settings, messages)

    started = time.perf_counter_ns()
    was_loaded = services.scheduler.runner(spec.id) is not None
    chat = isinstance(body, shapes.ChatBody)
    reply: Reply | None = None

    def rewriter(ticket: TextTicket) -> OllamaRewriter:
        nonlocal reply
        timing = Timing(started, time.perf_counter_ns(), was_loaded)
        reply = Reply(body.model, chat=chat, timing=timing)
        return OllamaRewriter(ticket, reply, text.kind, spec.id)

    relay = await Relay.open(services.scheduler, spec.id, keep_alive, text, rewriter)
    if body.stream:
        return NdjsonStream(relay.stream(), release=relay.release)
    done = await relay.collect(request)
    return gone_response() if done is None else JSONResponse(done)


def _engine_messages(
    validated: ChatCompletionRequest, raw: list[dict[str, Any]]
) -> list[dict[str, Any]]:
    """The schema's engine messages, with the tool calls and tool-call ids of the Ollama
    conversation kept (the engine renders them with the chat template)."""
    out = []
    for message, sent in zip(validated.messages, raw, strict=True):
        engine = message.to_engine()
        for key in ("tool_calls", "tool_call_id"):
            if key in sent and key not in engine:
                engine[key] = sent[key]
        out.append(engine)
    return out


# --- embeddings -------------------------------------------------------------------------


def _embed_options(options: dict[str, Any] | None) -> None:
    """A sampling option means nothing to an embedding model: a 400 when it has a value.
    A null one is unset (langchain-ollama's OllamaEmbeddings sends every option, null)."""
    for key, value in (options or {}).items():
        if value is not None and key not in shapes.NO_EFFECT_OPTIONS and key != "num_ctx":
            raise BadRequest(f"options.{key} has no meaning for embeddings", param=key)


@router.post("/embed")
async def embed(request: Request, body: shapes.EmbedBody) -> JSONResponse:
    services = get_services(request)
    spec = resolve(services.catalog, body.model, (ModelKind.EMBEDDING,), "/api/embed")
    record_model(request, spec)
    keep_alive = parse_keep_alive(body.keep_alive)
    _embed_options(body.options)
    if body.truncate is False:
        raise BadRequest(
            "truncate=false is not supported: inputs longer than the model's window are "
            "truncated (leave truncate out or set it to true)",
            param="truncate",
        )
    started = time.perf_counter_ns()
    if body.input is None or body.input == []:  # Ollama: just load the model
        await _load_only(services, spec, keep_alive)
        return JSONResponse({"model": body.model, "embeddings": []})
    payload = check_inputs(body.input, services.settings.max_embedding_inputs)
    embedded = await embed_inputs(request, spec.id, keep_alive, payload, body.dimensions)
    if embedded is None:
        return gone_response()  # type: ignore[return-value]
    vectors, tokens = embedded
    return JSONResponse(
        {
            "model": body.model,
            "embeddings": vectors,
            "total_duration": time.perf_counter_ns() - started,
            "load_duration": 0,
            "prompt_eval_count": tokens,
        }
    )


@router.post("/embeddings")
async def embeddings(request: Request, body: shapes.EmbeddingsBody) -> JSONResponse:
    """The older single-prompt endpoint."""
    services = get_services(request)
    spec = resolve(services.catalog, body.model, (ModelKind.EMBEDDING,), "/api/embeddings")
    record_model(request, spec)
    keep_alive = parse_keep_alive(body.keep_alive)
    _embed_options(body.options)
    if not body.prompt:
        await _load_only(services, spec, keep_alive)
        return JSONResponse({"embedding": []})
    payload = check_inputs(body.prompt, 1)
    result = await run_once(services.scheduler, spec.id, keep_alive, "embed", payload)
    return JSONResponse({"embedding": result["embeddings"][0]})
