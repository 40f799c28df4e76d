"""OpenAI audio routes: /v1/audio/transcriptions (speech to text), /v1/audio/translations
(speech to English text), /v1/audio/speech (text to speech). Inputs are checked here, once,
before a model is loaded (a bad request costs no memory), into the engine's typed request
(engines/requests.py): the engine only translates."""

from __future__ import annotations

from typing import Annotated, Any, Literal

from fastapi import APIRouter, Request
from fastapi.responses import JSONResponse, PlainTextResponse, Response
from pydantic import BaseModel, ConfigDict, Field

from elbowroom.engines.audio import FORMATS
from elbowroom.engines.requests import SpeechRequest, TranscribeRequest
from elbowroom.errors import BadRequest
from elbowroom.models.spec import ModelKind
from elbowroom.server.deps import get_services, parse_keep_alive
from elbowroom.server.http.metrics import record_model
from elbowroom.server.http.uploads import Form, receive_form
from elbowroom.server.openai import transcript_formats as tf
from elbowroom.server.stream.model_calls import (
    SPEECH_ALIASES,
    TRANSCRIPTION_ALIASES,
    resolve_model,
    run_once,
)
from elbowroom.server.stream.sse import ClientGone, gone_response, unless_client_leaves

router = APIRouter(prefix="/v1")


@router.post("/audio/transcriptions")
async def transcriptions(request: Request) -> Response:
    return await _speech_to_text(request, "transcribe")


@router.post("/audio/translations")
async def translations(request: Request) -> Response:
    """Speech in any language the model knows to English text (whisper's translate task;
    a model that knows only English transcribes: its audio is English already)."""
    return await _speech_to_text(request, "translate")


async def _speech_to_text(request: Request, task: Literal["transcribe", "translate"]) -> Response:
    services = get_services(request)
    endpoint = f"/v1/audio/{'translations' if task == 'translate' else 'transcriptions'}"
    async with receive_form(
        request, max_file=services.settings.max_upload, timeout=services.settings.body_timeout
    ) as form:
        if form.file is None:
            raise BadRequest("Missing required parameter: 'file'", param="file")
        spec = resolve_model(
            services.catalog,
            form.get("model"),
            ModelKind.ASR,
            TRANSCRIPTION_ALIASES,
            endpoint,
        )
        record_model(request, spec)
        response_format = _transcription_options(form)
        language = (form.get("language") or "").strip().lower()
        if task == "translate" and language:
            raise BadRequest(
                "translations detect the spoken language and always answer in English: "
                "leave language out (or use /v1/audio/transcriptions)",
                param="language",
            )
        payload = TranscribeRequest(
            audio_path=str(form.file.path),
            language=language or None,
            prompt=form.get("prompt") or None,
            temperature=_temperature(form.get("temperature")),
            task=task,
        )
        keep_alive = parse_keep_alive(form.get("keep_alive"))
        try:
            # A client that leaves stops the work: whisper checks between segments (a
            # 10-minute file burned a core for 3.5 minutes after its client was gone).
            result = await unless_client_leaves(
                request, run_once(services.scheduler, spec.id, keep_alive, "transcribe", payload)
            )
        except ClientGone:
            return gone_response()
    if response_format == "text":
        return PlainTextResponse(tf.as_text(result))
    if response_format == "srt":
        return PlainTextResponse(tf.as_srt(result))
    if response_format == "vtt":
        return PlainTextResponse(tf.as_vtt(result), media_type="text/vtt")
    if response_format == "verbose_json":
        return JSONResponse(tf.as_verbose_json(result))
    return JSONResponse(tf.as_json(result))


def _transcription_options(form: Form) -> str:
    response_format = form.get("response_format") or "json"
    if response_format not in tf.RESPONSE_FORMATS:
        raise BadRequest(
            f"response_format {response_format!r} is not supported; use one of: "
            + ", ".join(tf.RESPONSE_FORMATS),
            param="response_format",
        )
    granularities = set(form.get_all("timestamp_granularities[]"))
    if granularities - {"segment"}:
        raise BadRequest(
            "only segment timestamps are supported (timestamp_granularities: ['segment'])",
            param="timestamp_granularities",
        )
    if (form.get("stream") or "false").lower() not in ("false", "0"):
        raise BadRequest("streaming transcriptions are not supported", param="stream")
    return response_format


def _temperature(raw: str | None) -> float | None:
    if raw is None or raw == "":
        return None
    try:
        value = float(raw)
    except ValueError:
        raise BadRequest(f"temperature {raw!r} is not a number", param="temperature") from None
    if not 0.0 <= value <= 1.0:
        raise BadRequest("temperature must be between 0 and 1", param="temperature")
    return value


class SpeechBody(BaseModel):
    model_config = ConfigDict(extra="ignore")
    model: str | None = None  # None: what tts-1 maps to
    input: str
    voice: str | dict[str, Any] | None = None  # accepted; one-speaker voices ignore it
    response_format: str = "mp3"
    speed: Annotated[float, Field(ge=0.25, le=4.0)] = 1.0
    instructions: str | None = None  # accepted and ignored: piper takes no instructions
    stream_format: str | None = None
    keep_alive: int | float | str | None = None


@router.post("/audio/speech")
async def speech(request: Request, body: SpeechBody) -> Response:
    services = get_services(request)
    limit = services.settings.max_speech_chars
    if not body.input.strip():
        raise BadRequest("input must not be empty", param="input")
    if len(body.input) > limit:
        raise BadRequest(
            f"input is {len(body.input)} characters; the limit is {limit} "
            "(ELBOWROOM_MAX_SPEECH_CHARS)",
            param="input",
            code="string_above_max_length",
        )
    if body.response_format not in FORMATS:
        raise BadRequest(
            f"response_format {body.response_format!r} is not supported; use one of: "
            + ", ".join(FORMATS),
            param="response_format",
        )
    if body.stream_format not in (None, "audio"):
        raise BadRequest("only stream_format 'audio' is supported", param="stream_format")
    spec = resolve_model(
        services.catalog, body.model, ModelKind.TTS, SPEECH_ALIASES, "/v1/audio/speech"
    )
    record_model(request, spec)
    voice = body.voice.get("id") if isinstance(body.voice, dict) else body.voice
    payload = SpeechRequest(
        input=body.input,
        response_format=body.response_format,
        speed=body.speed,
        voice=None if voice is None else str(voice),
    )
    keep_alive = parse_keep_alive(body.keep_alive)
    try:
        result = await unless_client_leaves(
            request, run_once(services.scheduler, spec.id, keep_alive, "speech", payload)
        )
    except ClientGone:
        return gone_response()
    return Response(content=result["audio"], media_type=str(result["content_type"]))
