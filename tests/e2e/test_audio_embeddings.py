"""Speech, transcription and embeddings through a real `elbowroom serve` with the official
openai client: piper -> whisper/sphinx round trips, every bad input, idle unload of the
resident runners, and the LLM plus the speech engines under a limit too small for all."""

from __future__ import annotations

import io
import threading
import wave
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import openai
import pytest
from serverproc import ServerFactory, ServerProcess, pid_alive, runner_pid, wait_for

from elbowroom.config import Settings
from elbowroom.units import MiB

pytestmark = pytest.mark.slow

SENTENCE = "The quick brown fox jumps over the lazy dog."
KEY_WORDS = ("quick", "brown", "fox", "lazy", "dog")
WHISPER, SPHINX, PIPER, MINILM, SMOL = (
    "whisper-tiny.en",
    "sphinx-en-us",
    "piper-en-us-joe",
    "minilm-l6-v2",
    "smollm2-135m",
)
MAX_UPLOAD = 512 * 1024
MAX_CHARS = 300
MAX_INPUTS = 8


@pytest.fixture(scope="module")
def server(server_factory: ServerFactory) -> ServerProcess:
    return server_factory(
        "--ctx",
        "1024",
        env={
            "ELBOWROOM_MAX_UPLOAD": str(MAX_UPLOAD),
            "ELBOWROOM_MAX_SPEECH_CHARS": str(MAX_CHARS),
            "ELBOWROOM_MAX_EMBEDDING_INPUTS": str(MAX_INPUTS),
            "ELBOWROOM_RESIDENT_IDLE": "2",
            # No RAM prompt-cache grant: the LLM's bytes are its own, on any machine (the
            # grant is the free room up to 512 MiB, so it would depend on the machine).
            "ELBOWROOM_KV_RAM_MAX": "0",
        },
    )


@pytest.fixture(scope="module")
def spoken(server: ServerProcess) -> dict[str, bytes]:
    """The sentence spoken by the server, as WAV and MP3."""
    client = server.openai()
    return {
        fmt: client.audio.speech.create(
            model="tts-1", voice="alloy", input=SENTENCE, response_format=fmt
        ).content
        for fmt in ("wav", "mp3")
    }


def test_speech_is_valid_audio(spoken: dict[str, bytes]) -> None:
    with wave.open(io.BytesIO(spoken["wav"])) as w:
        assert (w.getnchannels(), w.getsampwidth()) == (1, 2)
        assert 2.0 < w.getnframes() / w.getframerate() < 6.0
    assert spoken["mp3"][:3] == b"ID3" or spoken["mp3"][0] == 0xFF  # tag or frame sync


@pytest.mark.parametrize("fmt", ["wav", "mp3"])
def test_speech_to_whisper_round_trip(
    server: ServerProcess, spoken: dict[str, bytes], fmt: str
) -> None:
    out = server.openai().audio.transcriptions.create(
        model="whisper-1", file=(f"fox.{fmt}", spoken[fmt]), response_format="verbose_json"
    )
    text = out.text.lower()
    assert all(word in text for word in KEY_WORDS), text
    assert out.language == "en" and out.segments and out.segments[0].end > 1.0


def test_sphinx_transcribes_as_subtitles(server: ServerProcess, spoken: dict[str, bytes]) -> None:
    srt = server.openai().audio.transcriptions.create(
        model=SPHINX, file=("fox.wav", spoken["wav"]), response_format="srt"
    )
    assert isinstance(srt, str) and srt.startswith("1\n00:00:")
    assert sum(word in srt for word in KEY_WORDS) >= 3, srt


def test_embeddings_rank_related_sentences_first(server: ServerProcess) -> None:
    texts = ["A man is eating food.", "A man eats a piece of bread.", "The stocks fell today."]
    # The openai client asks for base64 and decodes it: that path is what this exercises.
    out = server.openai().embeddings.create(model="text-embedding-3-small", input=texts)
    vectors = np.array([d.embedding for d in out.data])
    assert vectors.shape == (3, 384) and out.model == MINILM
    assert np.allclose(np.linalg.norm(vectors, axis=1), 1.0, atol=1e-5)
    assert vectors[0] @ vectors[1] > vectors[0] @ vectors[2] + 0.3
    assert out.usage.prompt_tokens == out.usage.total_tokens > 10
    with server.http() as http:
        floats = http.post("/v1/embeddings", json={"model": MINILM, "input": texts}).json()
    assert np.allclose([d["embedding"] for d in floats["data"]], vectors, atol=1e-6)


# --- bad input -----------------------------------------------------------------------------


def status_of(call: Any) -> tuple[int, dict[str, Any]]:
    with pytest.raises(openai.APIStatusError) as info:
        call()
    body = info.value.body
    assert isinstance(body, dict), body
    return info.value.status_code, body


def test_bad_audio_uploads(server: ServerProcess, spoken: dict[str, bytes]) -> None:
    transcribe = server.openai().audio.transcriptions.create
    cases = {
        "not audio": ("notes.txt", b"just some text, not audio\n" * 40),
        # (Any bytes after a valid WAV header are valid samples: corrupt the header.)
        "corrupt header": ("fox.wav", spoken["wav"][:20] + b"\xff" * 8 + spoken["wav"][28:]),
        "header only": ("fox.wav", spoken["wav"][:44]),
        "truncated mp3": ("fox.mp3", spoken["mp3"][:200]),
        "empty": ("empty.wav", b""),
    }
    for name, upload in cases.items():
        status, body = status_of(lambda u=upload: transcribe(model="whisper-1", file=u))
        assert status == 400, (name, body)
        assert body["type"] == "invalid_request_error" and body["param"] == "file"
        assert "elbowroom-upload" not in body["message"]  # no temp paths leak
    status, body = status_of(
        lambda: transcribe(model="whisper-1", file=("big.wav", b"\0" * (MAX_UPLOAD + 1)))
    )
    assert status == 413 and "ELBOWROOM_MAX_UPLOAD" in body["message"]
    status, body = status_of(
        lambda: transcribe(model="whisper-1", file=("a.wav", spoken["wav"]), response_format="docx")  # type: ignore[arg-type]
    )
    assert status == 400 and body["param"] == "response_format"
    status, body = status_of(lambda: transcribe(model=PIPER, file=("a.wav", spoken["wav"])))
    assert status == 400 and body["param"] == "model" and "asr" in body["message"]


def test_bad_speech_requests(server: ServerProcess) -> None:
    speech = server.openai().audio.speech.create
    for text in ("", "  \n"):
        status, body = status_of(lambda t=text: speech(model="tts-1", voice="alloy", input=t))
        assert status == 400 and body["param"] == "input"
    status, body = status_of(
        lambda: speech(model="tts-1", voice="alloy", input="x" * (MAX_CHARS + 1))
    )
    assert status == 400 and str(MAX_CHARS) in body["message"]
    status, body = status_of(
        lambda: speech(model="tts-1", voice="alloy", input="hi", response_format="ogg-vorbis")  # type: ignore[arg-type]
    )
    assert status == 400 and "wav" in body["message"] and body["param"] == "response_format"
    status, body = status_of(lambda: speech(model=SMOL, voice="alloy", input="hi"))
    assert status == 400 and body["param"] == "model"


def test_bad_embedding_requests(server: ServerProcess) -> None:
    embed = server.openai().embeddings.create
    for bad in ([], "", ["ok", ""]):
        status, body = status_of(lambda b=bad: embed(model=MINILM, input=b))
        assert status == 400 and body["param"] == "input", (bad, body)
    status, body = status_of(lambda: embed(model=MINILM, input=["x"] * (MAX_INPUTS + 1)))
    assert status == 400 and f"at most {MAX_INPUTS}" in body["message"]
    # Token ids are the model's own when it is named by its id (issue 21): one past its
    # vocabulary is refused, naming the tokenizer.
    status, body = status_of(lambda: embed(model=MINILM, input=[[10**7]]))
    assert status == 400 and "tokenizer has" in body["message"], body
    status, body = status_of(lambda: embed(model=WHISPER, input="hello"))
    assert status == 400 and "embedding" in body["message"]


def test_idle_resident_runner_exits_and_its_memory_returns(server: ServerProcess) -> None:
    server.openai().embeddings.create(model=MINILM, input="keep me warm")
    pid = runner_pid(server, MINILM)
    if pid is not None:  # None: it idled out already (2 s) before we looked
        assert any(r["id"] == MINILM and r["bytes"] > 0 for r in server.ps())
    wait_for(lambda: not server.ps(), timeout=60, what="every resident runner to idle out")
    if pid is not None:
        wait_for(lambda: not pid_alive(pid), timeout=30, what="the runner process to exit")
    report = server.memory()
    # Only the server process's own bytes are left of ours (sampled a moment apart).
    assert report["committed"] == 0
    assert abs(report["own_usage"] - report["server_usage"]) < 16 * MiB


# --- the LLM and the speech engines under a small limit -------------------------------------

RESERVE = 512 * MiB


@dataclass(frozen=True)
class Measured:
    home: Path
    bytes: dict[str, int]
    server: int  # the server process's own anonymous bytes: they count as ours too


def _one_request(client: openai.OpenAI, model: str, audio: bytes) -> None:
    if model == SMOL:
        out = client.chat.completions.create(
            model=model, messages=[{"role": "user", "content": "Hi"}], max_tokens=4
        )
        assert out.choices[0].message.content is not None
    elif model == PIPER:
        assert client.audio.speech.create(
            model=model, voice="alloy", input="Hello there.", response_format="wav"
        ).content.startswith(b"RIFF")
    elif model == WHISPER:
        text = client.audio.transcriptions.create(model=model, file=("a.wav", audio)).text
        assert "fox" in text.lower()
    else:
        assert len(client.embeddings.create(model=model, input="hello").data[0].embedding) == 384


@pytest.fixture(scope="module")
def measured(server: ServerProcess) -> Measured:
    """Each model's bytes right after loading it (the admin load answers with them). The
    limited server shares this server's data folder, so it predicts these measurements."""
    sizes = {}
    with server.http() as http:
        for model in (SMOL, PIPER, WHISPER, MINILM):
            r = http.post(f"/api/models/{model}/load")
            assert r.status_code == 200, r.text
            sizes[model] = int(r.json()["runner"]["bytes"])
        own = int(http.get("/api/memory").json()["server_usage"])
    return Measured(server.home, sizes, own)


def test_mixed_requests_evict_idle_engines_within_the_limit(
    server_factory: ServerFactory,
    server: ServerProcess,
    measured: Measured,
    spoken: dict[str, bytes],
) -> None:
    server.stop()  # the last test of the module: free its data folder for the next server
    sizes = sorted(measured.bytes.values())
    soft = Settings().load_fraction  # the load ceiling
    # The two biggest fit with room under the load ceiling, all four do not: some
    # requests must evict idle engines (the scheduler for a load, or the pressure guard).
    # The server's own bytes fill the same ceiling.
    low = int((sizes[-1] + sizes[-2] + measured.server) / soft) + 16 * MiB
    high = sum(sizes) - 32 * MiB
    if low >= high:
        pytest.skip(f"footprints {measured.bytes} leave no limit that fits two but not all")
    limit_asked = (low + high) // 2
    limited = server_factory(
        "--ctx",
        "1024",
        home=measured.home,
        env={
            "ELBOWROOM_OVERRIDE_MEMORY": str(limit_asked + RESERVE),
            "ELBOWROOM_CONTAINER_MARGIN": str(RESERVE),
            "ELBOWROOM_KV_RAM_MAX": "0",
        },
    )
    limit = int(limited.memory()["limit"]["value"])
    assert limit <= limit_asked

    peak = [0]
    done = threading.Event()

    def sample() -> None:  # committed bytes, sampled while the requests run
        while not done.is_set():
            peak[0] = max(peak[0], int(limited.memory()["committed"]))
            done.wait(0.05)

    sampler = threading.Thread(target=sample, daemon=True)
    sampler.start()
    client = limited.openai()
    evictions = 0
    try:
        for model in [PIPER, WHISPER, SMOL, MINILM, PIPER, WHISPER]:
            before = {r["id"] for r in limited.ps()}
            _one_request(client, model, spoken["wav"])
            rows = limited.ps()
            evictions += len(before - {r["id"] for r in rows})
            assert sum(r["bytes"] for r in rows) <= limit, rows
    finally:
        done.set()
        sampler.join(timeout=10)
    assert evictions >= 2  # idle engines made room: all four never fit together
    assert 0 < peak[0] <= limit
