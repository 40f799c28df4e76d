"""SphinxEngine (pocketsphinx with its bundled en-us model): the fallback recognizer."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
from bundled_models import bundled_spec, speak

from elbowroom.engines.options import EngineOptions
from elbowroom.engines.requests import TranscribeRequest
from elbowroom.engines.sphinx import SphinxEngine, _segments, model_files
from elbowroom.errors import BadRequest, EngineError

pytest.importorskip("pocketsphinx")


SPHINX = "sphinx-en-us"
SPHINX_MODEL = bundled_spec(SPHINX).path / "en-us"  # pocketsphinx/model/en-us


@pytest.fixture(scope="module")
def speech_wav(tmp_path_factory: pytest.TempPathFactory) -> Path:
    (wav,) = speak("Hello world. The quick brown fox.", "wav")
    path = tmp_path_factory.mktemp("sphinx") / "hello.wav"
    path.write_bytes(wav)
    return path


@pytest.fixture(scope="module")
def engine() -> Any:
    eng = SphinxEngine()
    eng.load(bundled_spec(SPHINX), EngineOptions())
    yield eng
    eng.close()


def transcribe(engine: SphinxEngine, path: Path, **extra: Any) -> dict[str, Any]:
    payload = TranscribeRequest(audio_path=str(path), **extra)
    return engine.run("transcribe", payload, lambda _: None, lambda: False)


@pytest.mark.slow
def test_transcribes_synthesized_speech(engine: SphinxEngine, speech_wav: Path) -> None:
    out = transcribe(engine, speech_wav)
    words = out["text"].split()
    # A small n-gram recognizer: ask for most of the words, not all of them.
    hits = sum(w in words for w in ("hello", "world", "quick", "brown", "fox"))
    assert hits >= 3, out["text"]
    assert out["language"] == "en" and 1.0 < out["duration"] < 5.0
    assert out["segments"] and all(s["start"] < s["end"] for s in out["segments"])
    assert out["text"] == " ".join(s["text"].strip() for s in out["segments"])


@pytest.mark.slow
def test_cancelling_stops_early(engine: SphinxEngine, speech_wav: Path) -> None:
    payload = TranscribeRequest(audio_path=str(speech_wav))
    out = engine.run("transcribe", payload, lambda _: None, lambda: True)
    full = transcribe(engine, speech_wav)
    assert len(out["text"].split()) < len(full["text"].split())


@pytest.mark.slow
def test_bad_audio_and_other_languages(
    engine: SphinxEngine, speech_wav: Path, tmp_path: Path
) -> None:
    junk = tmp_path / "junk.ogg"
    junk.write_bytes(b"OggS" + b"\x00" * 500)
    with pytest.raises(BadRequest):
        transcribe(engine, junk)
    with pytest.raises(BadRequest, match="English only"):
        transcribe(engine, speech_wav, language="de")
    with pytest.raises(BadRequest, match="takes the typed TranscribeRequest, not a dict"):
        engine.run("transcribe", {"audio_path": str(speech_wav)}, lambda _: None, lambda: False)


def test_model_files_accepts_each_level_of_the_bundled_layout() -> None:
    for path in (SPHINX_MODEL.parent, SPHINX_MODEL, SPHINX_MODEL / "en-us"):
        files = model_files(path)
        assert files["lm"].endswith("en-us.lm.bin") and files["dict"].endswith(".dict")
    with pytest.raises(EngineError, match="mdef"):
        model_files(Path("/nonexistent"))


def test_segments_split_at_silences_and_drop_fillers() -> None:
    words = [
        ("<s>", 0, 2),
        ("hello", 3, 40),
        ("world", 41, 90),
        ("<sil>", 91, 120),
        ("[NOISE]", 121, 130),
        ("again", 131, 170),
        ("</s>", 171, 180),
    ]
    segs = _segments(words, 100)
    assert [s["text"] for s in segs] == [" hello world", " again"]
    assert (segs[0]["start"], segs[0]["end"]) == (0.03, 0.91)
    assert [s["id"] for s in segs] == [0, 1]
