"""WhisperEngine on the bundled whisper tiny.en: a piper -> whisper round trip, bad audio."""

from __future__ import annotations

import shutil
from pathlib import Path
from typing import Any

import pytest
from bundled_models import bundled_spec, speak

from elbowroom.engines.audio import decode_audio
from elbowroom.engines.options import EngineOptions
from elbowroom.engines.requests import TranscribeRequest
from elbowroom.engines.whisper import WhisperEngine
from elbowroom.errors import BadRequest, PayloadTooLarge

pytest.importorskip("faster_whisper")

SENTENCE = "The quick brown fox jumps over the lazy dog."
KEY_WORDS = ("quick", "brown", "fox", "lazy", "dog")


@pytest.fixture(scope="module")
def speech(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    """The known sentence spoken by piper, as WAV and MP3 files."""
    folder = tmp_path_factory.mktemp("speech")
    files = {}
    for fmt, audio in zip(("wav", "mp3"), speak(SENTENCE, "wav", "mp3"), strict=True):
        files[fmt] = folder / f"fox.{fmt}"
        files[fmt].write_bytes(audio)
    return files


@pytest.fixture(scope="module")
def engine() -> Any:
    eng = WhisperEngine()
    facts = eng.load(bundled_spec("whisper-tiny.en"), EngineOptions(threads=2))
    assert facts["multilingual"] is False
    yield eng
    eng.close()


def transcribe(engine: WhisperEngine, path: Path | str, **extra: Any) -> dict[str, Any]:
    return engine.run(
        "transcribe",
        TranscribeRequest(audio_path=str(path), **extra),
        lambda _: None,
        lambda: False,
    )


@pytest.mark.slow
@pytest.mark.parametrize("fmt", ["wav", "mp3"])
def test_round_trip_recovers_the_key_words(
    engine: WhisperEngine, speech: dict[str, Path], fmt: str
) -> None:
    out = transcribe(engine, speech[fmt], language="en")
    text = out["text"].lower()
    assert all(word in text for word in KEY_WORDS), text
    assert out["language"] == "en"
    assert 2.0 < out["duration"] < 6.0
    seg = out["segments"][0]
    assert seg["id"] == 0 and 0.0 <= seg["start"] < seg["end"] <= out["duration"] + 0.5
    assert {"tokens", "avg_logprob", "no_speech_prob", "temperature"} <= seg.keys()


@pytest.mark.slow
def test_a_prompt_and_a_temperature_are_accepted(
    engine: WhisperEngine, speech: dict[str, Path]
) -> None:
    out = transcribe(engine, speech["wav"], prompt="Animals.", temperature=0.2)
    assert "fox" in out["text"].lower()


@pytest.mark.slow
def test_not_audio_and_corrupt_audio_are_bad_requests(
    engine: WhisperEngine, speech: dict[str, Path], tmp_path: Path
) -> None:
    text = tmp_path / "notes.txt"
    text.write_text("this is not audio at all\n" * 50)
    truncated = tmp_path / "truncated.wav"
    truncated.write_bytes(speech["wav"].read_bytes()[:60])  # header, no samples
    garbage_mp3 = tmp_path / "garbage.mp3"
    garbage_mp3.write_bytes(bytes(range(256)) * 40)
    empty = tmp_path / "empty.wav"
    empty.write_bytes(b"")
    for path in (text, truncated, garbage_mp3, empty):
        with pytest.raises(BadRequest):
            transcribe(engine, path)


@pytest.mark.slow
def test_english_only_model_refuses_other_languages(
    engine: WhisperEngine, speech: dict[str, Path]
) -> None:
    with pytest.raises(BadRequest, match="English only") as info:
        transcribe(engine, speech["wav"], language="fr")
    assert info.value.param == "language"


def test_an_untyped_payload_is_refused_before_any_decoding(
    engine: WhisperEngine, speech: dict[str, Path]
) -> None:
    # The route builds the TranscribeRequest (the one check); a dict is a caller's bug.
    with pytest.raises(BadRequest, match="takes the typed TranscribeRequest, not a dict"):
        engine.run("transcribe", {"audio_path": str(speech["wav"])}, lambda _: None, lambda: False)


@pytest.mark.slow
def test_decoding_stops_at_the_length_limit(speech: dict[str, Path], tmp_path: Path) -> None:
    copy = tmp_path / "fox.wav"
    shutil.copy(speech["wav"], copy)
    assert decode_audio(str(copy), 16000).size > 16000
    with pytest.raises(PayloadTooLarge, match="limit of 1 s"):
        decode_audio(str(copy), 16000, max_seconds=1.0)
