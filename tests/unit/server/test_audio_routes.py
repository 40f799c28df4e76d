"""The audio routes' HTTP layer, with the scheduler and catalog stood in (the edge).

Uploads are parsed for real (python-multipart, real temp files) through a raw ASGI receive
channel that counts how much of the body was read: an oversized upload must stop early.
"""

from __future__ import annotations

from collections.abc import AsyncIterator, Iterator
from contextlib import asynccontextmanager
from pathlib import Path
from typing import Any

import anyio
import pytest
from server_fakes import http_scope
from starlette.requests import Request
from starlette.testclient import TestClient

from elbowroom.config import Settings
from elbowroom.engines.requests import SpeechRequest, TranscribeRequest
from elbowroom.errors import BadRequest, ModelNotFound, PayloadTooLarge
from elbowroom.models.spec import Holding, ModelKind, ModelSpec
from elbowroom.server.app import create_app
from elbowroom.server.deps import Services
from elbowroom.server.http.metrics import METRICS
from elbowroom.server.http.uploads import receive_form
from elbowroom.server.openai import transcript_formats as tf
from elbowroom.server.stream.model_calls import TRANSCRIPTION_ALIASES, resolve_model

BOUNDARY = "elbowroomtestboundary"


def make_spec(model_id: str, kind: ModelKind) -> ModelSpec:
    return ModelSpec(model_id, kind, "x", Path("/nonexistent"), 1, Holding.RESIDENT, "bundled")


class Catalog:
    def __init__(self, *specs: ModelSpec) -> None:
        self.specs = {s.id: s for s in specs}

    def get(self, model_id: str) -> ModelSpec:
        if model_id not in self.specs:
            raise ModelNotFound(model_id)
        return self.specs[model_id]

    def list(self) -> list[ModelSpec]:
        return list(self.specs.values())


class Scheduler:
    """Answers each op with a canned result and records what reached it."""

    def __init__(self) -> None:
        self.calls: list[tuple[str, str, Any]] = []
        self.seen_files: list[bytes] = []

    @asynccontextmanager
    async def use(self, model_id: str, keep_alive: float | None = None) -> AsyncIterator[Any]:
        yield _Runner(self, model_id)


class _Runner:
    def __init__(self, scheduler: Scheduler, model_id: str) -> None:
        self.s, self.model_id = scheduler, model_id

    async def request(self, op: str, payload: Any) -> AsyncIterator[dict[str, Any]]:
        self.s.calls.append((self.model_id, op, payload))
        if op == "transcribe":
            self.s.seen_files.append(Path(payload.audio_path).read_bytes())
            segments = [
                {"id": 0, "start": 0.0, "end": 1.5, "text": " Hello there."},
                {"id": 1, "start": 1.5, "end": 3725.5, "text": " General Kenobi."},
            ]
            yield {
                "type": "done",
                "text": "Hello there. General Kenobi.",
                "language": "en",
                "duration": 3725.5,
                "segments": segments,
            }
        else:
            yield {"type": "done", "audio": b"RIFFfake", "content_type": "audio/wav"}


@pytest.fixture
def app_parts() -> Iterator[tuple[TestClient, Scheduler]]:
    scheduler = Scheduler()
    catalog = Catalog(
        make_spec("whisper-tiny.en", ModelKind.ASR),
        make_spec("piper-en-us-joe", ModelKind.TTS),
        make_spec("smollm2-135m", ModelKind.LLM),
    )
    settings = Settings(max_upload=1000, max_speech_chars=20)
    services = Services(settings=settings, catalog=catalog, scheduler=scheduler)
    with TestClient(create_app(settings, services=services), base_url="http://localhost") as client:
        yield client, scheduler


def transcribe(client: TestClient, data: dict[str, str], content: bytes = b"audio!") -> Any:
    return client.post(
        "/v1/audio/transcriptions", data=data, files={"file": ("clip.wav", content, "audio/wav")}
    )


def test_transcription_passes_a_temp_file_and_removes_it(
    app_parts: tuple[TestClient, Scheduler],
) -> None:
    client, scheduler = app_parts
    labels = {"endpoint": "transcriptions", "model": "whisper-tiny.en", "status": "200"}
    before = METRICS.registry.get_sample_value("elbowroom_requests_total", labels) or 0.0
    r = transcribe(client, {"model": "whisper-1", "language": " EN ", "temperature": "0.3"})
    assert r.status_code == 200, r.text
    # The metric's model label is what the route resolved the alias to (not the form field).
    assert METRICS.registry.get_sample_value("elbowroom_requests_total", labels) == before + 1
    assert r.json() == {
        "text": "Hello there. General Kenobi.",
        "usage": {"type": "duration", "seconds": 3726},
    }
    model, op, payload = scheduler.calls[0]
    assert (model, op) == ("whisper-tiny.en", "transcribe")  # the alias resolved
    # The engine's typed request, the language normalized here (the engine checks nothing).
    assert isinstance(payload, TranscribeRequest)
    assert payload.language == "en" and payload.temperature == 0.3 and payload.prompt is None
    assert scheduler.seen_files == [b"audio!"]
    assert payload.audio_path.endswith(".wav")
    assert not Path(payload.audio_path).exists()


@pytest.mark.parametrize(
    ("fmt", "expected"),
    [
        ("text", "Hello there. General Kenobi.\n"),
        (
            "srt",
            "1\n00:00:00,000 --> 00:00:01,500\nHello there.\n\n"
            "2\n00:00:01,500 --> 01:02:05,500\nGeneral Kenobi.\n",
        ),
        (
            "vtt",
            "WEBVTT\n\n00:00:00.000 --> 00:00:01.500\nHello there.\n\n"
            "00:00:01.500 --> 01:02:05.500\nGeneral Kenobi.\n",
        ),
    ],
)
def test_text_response_formats(
    app_parts: tuple[TestClient, Scheduler], fmt: str, expected: str
) -> None:
    r = transcribe(app_parts[0], {"model": "whisper-tiny.en", "response_format": fmt})
    assert r.status_code == 200 and r.text == expected


def test_verbose_json_fills_openai_segment_fields(
    app_parts: tuple[TestClient, Scheduler],
) -> None:
    r = transcribe(app_parts[0], {"model": "whisper-1", "response_format": "verbose_json"})
    body = r.json()
    assert body["task"] == "transcribe" and body["duration"] == 3725.5
    assert {"seek", "tokens", "avg_logprob", "no_speech_prob"} <= body["segments"][0].keys()


@pytest.mark.parametrize(
    ("data", "content", "status", "param"),
    [
        ({"model": "whisper-1", "response_format": "docx"}, b"a", 400, "response_format"),
        ({"model": "whisper-1", "temperature": "hot"}, b"a", 400, "temperature"),
        (
            {"model": "whisper-1", "timestamp_granularities[]": "word"},
            b"a",
            400,
            "timestamp_granularities",
        ),
        ({"model": "smollm2-135m"}, b"a", 400, "model"),
        ({"model": "nope"}, b"a", 404, "model"),
        ({"model": "whisper-1"}, b"x" * 1001, 413, "file"),
    ],
)
def test_bad_transcription_requests_never_reach_a_model(
    app_parts: tuple[TestClient, Scheduler],
    data: dict[str, str],
    content: bytes,
    status: int,
    param: str,
) -> None:
    client, scheduler = app_parts
    r = transcribe(client, data, content)
    assert r.status_code == status, r.text
    assert r.json()["error"]["param"] == param
    assert scheduler.calls == []


def test_missing_file_and_not_multipart(app_parts: tuple[TestClient, Scheduler]) -> None:
    client, _ = app_parts
    r = client.post("/v1/audio/transcriptions", data={"model": "whisper-1"})
    assert r.status_code == 400 and "multipart" in r.json()["error"]["message"]
    r = client.post(
        "/v1/audio/transcriptions", data={"model": "whisper-1"}, files={"other": ("a.txt", b"x")}
    )
    assert r.status_code == 400 and r.json()["error"]["param"] == "file"


def test_speech_returns_audio_bytes(app_parts: tuple[TestClient, Scheduler]) -> None:
    client, scheduler = app_parts
    r = client.post(
        "/v1/audio/speech",
        json={
            "model": "tts-1",
            "input": "Hi there",
            "voice": "alloy",
            "response_format": "wav",
            "speed": 1.5,
        },
    )
    assert r.status_code == 200 and r.content == b"RIFFfake"
    assert r.headers["content-type"] == "audio/wav"
    assert scheduler.calls == [
        (
            "piper-en-us-joe",
            "speech",
            SpeechRequest(input="Hi there", voice="alloy", speed=1.5, response_format="wav"),
        )
    ]


@pytest.mark.parametrize(
    ("body", "param", "words"),
    [
        ({"input": ""}, "input", "empty"),
        ({"input": "   "}, "input", "empty"),
        ({"input": "x" * 21}, "input", "limit is 20"),
        ({"input": "hi", "response_format": "ogg"}, "response_format", "wav, mp3, flac"),
        ({"input": "hi", "speed": 5}, "speed", "4"),
        ({"input": "hi", "model": "whisper-tiny.en"}, "model", "kind tts"),
    ],
)
def test_bad_speech_requests_never_reach_a_model(
    app_parts: tuple[TestClient, Scheduler], body: dict[str, Any], param: str, words: str
) -> None:
    client, scheduler = app_parts
    r = client.post("/v1/audio/speech", json={"voice": "alloy", **body})
    assert r.status_code == 400, r.text
    error = r.json()["error"]
    assert error["param"] == param and words in error["message"]
    assert scheduler.calls == []


# --- receive_form on a raw ASGI body ---------------------------------------------------------


def multipart(fields: dict[str, str], file_bytes: bytes) -> bytes:
    out = b""
    for name, value in fields.items():
        out += (
            f'--{BOUNDARY}\r\nContent-Disposition: form-data; name="{name}"\r\n\r\n{value}\r\n'
        ).encode()
    out += (
        f'--{BOUNDARY}\r\nContent-Disposition: form-data; name="file"; '
        f'filename="a.mp3"\r\nContent-Type: audio/mpeg\r\n\r\n'
    ).encode()
    return out + file_bytes + f"\r\n--{BOUNDARY}--\r\n".encode()


class Body:
    """An ASGI receive channel that hands out the body in chunks and counts them."""

    def __init__(self, body: bytes, chunk: int = 4096) -> None:
        self.chunks = [body[i : i + chunk] for i in range(0, len(body), chunk)]
        self.read = 0

    async def __call__(self) -> dict[str, Any]:
        self.read += 1
        more = self.read < len(self.chunks)
        return {"type": "http.request", "body": self.chunks[self.read - 1], "more_body": more}


def request(body: Body, length: int | None) -> Request:
    headers = [(b"content-type", f"multipart/form-data; boundary={BOUNDARY}".encode())]
    if length is not None:
        headers.append((b"content-length", str(length).encode()))
    return Request({"type": "http", "method": "POST", "headers": headers}, body)


def test_form_fields_and_file_then_cleanup() -> None:
    data = multipart({"model": "whisper-1", "prompt": "ünïcode"}, b"\x00\x01" * 5000)

    async def main() -> Path:
        async with receive_form(request(Body(data), len(data)), max_file=20_000) as form:
            assert form.get("model") == "whisper-1" and form.get("prompt") == "ünïcode"
            assert form.file is not None and form.file.filename == "a.mp3"
            assert form.file.size == 10_000 and form.file.content_type == "audio/mpeg"
            assert form.file.path.read_bytes() == b"\x00\x01" * 5000
            assert form.file.path.suffix == ".mp3"
            return form.file.path

    assert not anyio.run(main).exists()


def test_declared_length_over_the_limit_is_refused_before_reading() -> None:
    data = multipart({}, b"x" * 200_000)
    body = Body(data)

    async def main() -> None:
        async with receive_form(request(body, len(data)), max_file=1000):
            raise AssertionError("unreachable")

    with pytest.raises(PayloadTooLarge, match="ELBOWROOM_MAX_UPLOAD"):
        anyio.run(main)
    assert body.read == 0


def test_undeclared_length_stops_reading_at_the_limit(tmp_path: Path) -> None:
    data = multipart({}, b"x" * 1_000_000)
    body = Body(data, chunk=4096)

    async def main() -> None:
        req = request(body, None)  # chunked upload: no Content-Length to check
        async with receive_form(req, max_file=10_000, directory=str(tmp_path)):
            raise AssertionError("unreachable")

    with pytest.raises(PayloadTooLarge):
        anyio.run(main)
    assert body.read <= 4  # ~10 kB of a 1 MB body
    assert list(tmp_path.iterdir()) == []  # the partial file is gone


def test_oversized_text_field_is_refused() -> None:
    data = multipart({"prompt": "y" * 20_000}, b"x")

    async def main() -> None:
        async with receive_form(request(Body(data), None), max_file=1000):
            raise AssertionError("unreachable")

    with pytest.raises(BadRequest, match="prompt"):
        anyio.run(main)


# --- pure helpers ------------------------------------------------------------------------


def test_timestamps() -> None:
    assert tf.timestamp(0, ",") == "00:00:00,000"
    assert tf.timestamp(59.9996, ".") == "00:01:00.000"
    assert tf.timestamp(3725.5, ",") == "01:02:05,500"


def test_aliases_fall_back_and_real_ids_win() -> None:
    sphinx_only = Catalog(make_spec("sphinx-en-us", ModelKind.ASR))
    spec = resolve_model(sphinx_only, "whisper-1", ModelKind.ASR, TRANSCRIPTION_ALIASES, "x")
    assert spec.id == "sphinx-en-us"  # whisper missing: the fallback recognizer
    own = Catalog(
        make_spec("whisper-1", ModelKind.ASR), make_spec("whisper-tiny.en", ModelKind.ASR)
    )
    assert resolve_model(own, "whisper-1", ModelKind.ASR, TRANSCRIPTION_ALIASES, "x").id == (
        "whisper-1"
    )
    assert resolve_model(own, None, ModelKind.ASR, TRANSCRIPTION_ALIASES, "x").id == ("whisper-1")
    with pytest.raises(ModelNotFound):
        resolve_model(Catalog(), "whisper-1", ModelKind.ASR, TRANSCRIPTION_ALIASES, "x")


def test_a_file_part_without_a_filename_is_still_the_file() -> None:
    data = (
        f'--{BOUNDARY}\r\nContent-Disposition: form-data; name="file"\r\n\r\n'.encode()
        + b"x" * 30_000
        + f"\r\n--{BOUNDARY}--\r\n".encode()
    )

    async def main() -> int:
        async with receive_form(request(Body(data), len(data)), max_file=50_000) as form:
            assert form.file is not None and form.file.filename == ""
            return form.file.size

    assert anyio.run(main) == 30_000


def test_translations_aliases_and_alias_model_cards(
    app_parts: tuple[TestClient, Scheduler],
) -> None:
    """Issue 21: /v1/audio/translations (whisper's translate task), the gpt-4o-mini aliases,
    and GET /v1/models/<alias> (a 404 before, though the alias worked on POST)."""
    client, scheduler = app_parts
    r = client.post(
        "/v1/audio/translations",
        data={"model": "gpt-4o-mini-transcribe"},
        files={"file": ("clip.wav", b"audio!", "audio/wav")},
    )
    assert r.status_code == 200, r.text
    assert r.json()["text"] == "Hello there. General Kenobi."
    model, op, payload = scheduler.calls[-1]
    assert (model, op, payload.task) == ("whisper-tiny.en", "transcribe", "translate")
    r = client.post(
        "/v1/audio/translations",
        data={"model": "whisper-1", "language": "fr"},
        files={"file": ("clip.wav", b"audio!", "audio/wav")},
    )
    assert r.status_code == 400 and r.json()["error"]["param"] == "language"
    assert transcribe(client, {"model": "whisper-1"}).status_code == 200
    assert scheduler.calls[-1][2].task == "transcribe"
    speech = client.post("/v1/audio/speech", json={"model": "gpt-4o-mini-tts", "input": "hi"})
    assert speech.status_code == 200 and scheduler.calls[-1][0] == "piper-en-us-joe"
    card = client.get("/v1/models/whisper-1").json()
    assert card["id"] == "whisper-1" and card["root"] == "whisper-tiny.en"
    assert client.get("/v1/models/gpt-4o-mini-tts").json()["root"] == "piper-en-us-joe"
    assert client.get("/v1/models/text-embedding-3-small").status_code == 404  # none here


class _Hanging(Scheduler):
    """A runner that works until its request is closed (what cancels it in the worker)."""

    def __init__(self) -> None:
        super().__init__()
        self.closed: list[str] = []

    @asynccontextmanager
    async def use(self, model_id: str, keep_alive: float | None = None) -> AsyncIterator[Any]:
        yield _HangingRunner(self)


class _HangingRunner:
    def __init__(self, scheduler: _Hanging) -> None:
        self.s = scheduler

    async def request(self, op: str, payload: Any) -> AsyncIterator[dict[str, Any]]:
        self.s.calls.append(("", op, payload))
        try:
            yield {"type": "progress"}
            await anyio.sleep(3600)
            yield {"type": "done"}
        finally:
            self.s.closed.append(op)


@pytest.mark.parametrize(
    ("path", "content_type", "body"),
    [
        (
            "/v1/audio/transcriptions",
            b"multipart/form-data; boundary=b",
            b'--b\r\nContent-Disposition: form-data; name="model"\r\n\r\nwhisper-1\r\n'
            b'--b\r\nContent-Disposition: form-data; name="file"; filename="a.wav"\r\n'
            b"Content-Type: audio/wav\r\n\r\naudio!\r\n--b--\r\n",
        ),
        (
            "/v1/audio/speech",
            b"application/json",
            b'{"model": "piper-en-us-joe", "input": "hello", "voice": "joe"}',
        ),
    ],
)
def test_a_client_that_leaves_stops_the_work(path: str, content_type: bytes, body: bytes) -> None:
    """An abandoned 10-minute transcription kept whisper on a core for 3.5 minutes."""
    scheduler = _Hanging()
    catalog = Catalog(
        make_spec("whisper-tiny.en", ModelKind.ASR), make_spec("piper-en-us-joe", ModelKind.TTS)
    )
    settings = Settings(max_upload=1000, max_speech_chars=20)
    app = create_app(
        settings, services=Services(settings=settings, catalog=catalog, scheduler=scheduler)
    )
    pending = [{"type": "http.request", "body": body, "more_body": False}]
    sent: list[dict[str, Any]] = []

    async def receive() -> dict[str, Any]:
        if pending:
            return pending.pop()
        while not scheduler.calls and not scheduler.closed:
            await anyio.sleep(0.01)
        await anyio.sleep(0.05)
        return {"type": "http.disconnect"}  # the client leaves while the work runs

    async def send(message: dict[str, Any]) -> None:
        sent.append(message)

    scope = http_scope(
        path,
        [
            (b"content-type", content_type),
            (b"content-length", str(len(body)).encode()),
            (b"host", b"localhost"),
        ],
    )

    async def run() -> None:
        with anyio.fail_after(30):  # only the disconnect can end this call
            await app(scope, receive, send)

    anyio.run(run)
    assert scheduler.closed == [path.rsplit("/", 1)[1].replace("transcriptions", "transcribe")]


def test_a_client_gone_mid_upload_is_not_a_500(caplog: pytest.LogCaptureFixture) -> None:
    """It was logged as an internal error and counted as a 500."""
    scheduler = Scheduler()
    catalog = Catalog(make_spec("whisper-tiny.en", ModelKind.ASR))
    settings = Settings(max_upload=1000)
    app = create_app(
        settings, services=Services(settings=settings, catalog=catalog, scheduler=scheduler)
    )
    part = (
        b'--b\r\nContent-Disposition: form-data; name="file"; filename="a.wav"\r\n'
        b"Content-Type: audio/wav\r\n\r\naud"
    )
    pending = [
        {"type": "http.request", "body": part, "more_body": True},
        {"type": "http.disconnect"},
    ]
    sent: list[dict[str, Any]] = []

    async def receive() -> dict[str, Any]:
        return pending.pop(0)

    async def send(message: dict[str, Any]) -> None:
        sent.append(message)

    path = "/v1/audio/transcriptions"
    scope = http_scope(
        path,
        [
            (b"content-type", b"multipart/form-data; boundary=b"),
            (b"content-length", b"900"),
            (b"host", b"localhost"),
        ],
    )
    anyio.run(app, scope, receive, send)
    assert sent[0]["status"] == 499
    assert "internal error" not in caplog.text
    assert scheduler.calls == []


def test_a_stalled_upload_times_out() -> None:
    """Uploads skip the JSON body gate: a stalled one held its connection for good."""
    scheduler = Scheduler()
    catalog = Catalog(make_spec("whisper-tiny.en", ModelKind.ASR))
    settings = Settings(max_upload=1000, body_timeout=0.3)
    app = create_app(
        settings, services=Services(settings=settings, catalog=catalog, scheduler=scheduler)
    )
    part = b'--b\r\nContent-Disposition: form-data; name="file"; filename="a.wav"\r\n\r\nau'
    pending = [{"type": "http.request", "body": part, "more_body": True}]
    sent: list[dict[str, Any]] = []

    async def receive() -> dict[str, Any]:
        if pending:
            return pending.pop(0)
        await anyio.sleep(3600)  # the client sends nothing more and stays
        return {"type": "http.disconnect"}

    async def send(message: dict[str, Any]) -> None:
        sent.append(message)

    path = "/v1/audio/transcriptions"
    scope = http_scope(
        path,
        [
            (b"content-type", b"multipart/form-data; boundary=b"),
            (b"content-length", b"900"),
            (b"host", b"localhost"),
        ],
    )

    async def run() -> None:
        with anyio.fail_after(30):
            await app(scope, receive, send)

    anyio.run(run)
    assert sent[0]["status"] == 408
    assert scheduler.calls == []
