"""PiperEngine on the bundled voice: real synthesis, real encoders."""

from __future__ import annotations

import io
import subprocess
import sys
import wave
from dataclasses import replace
from pathlib import Path
from typing import Any

import pytest
from bundled_models import bundled_spec

from elbowroom.engines.audio import decode_audio, supported_formats
from elbowroom.engines.options import EngineOptions
from elbowroom.engines.piper import PiperEngine, check_format
from elbowroom.engines.requests import SpeechRequest
from elbowroom.errors import BadRequest, EngineError

pytest.importorskip("piper")
VOICE = "piper-en-us-joe"


@pytest.fixture(scope="module")
def engine() -> Any:
    eng = PiperEngine()
    facts = eng.load(bundled_spec(VOICE), EngineOptions())
    assert facts["sample_rate"] == 22050
    yield eng
    eng.close()


def speak(engine: PiperEngine, **payload: Any) -> dict[str, Any]:
    request = SpeechRequest(**{"voice": "alloy", "response_format": "wav", **payload})
    return engine.run("speech", request, lambda _: None, lambda: False)


def wav_seconds(data: bytes) -> float:
    with wave.open(io.BytesIO(data)) as w:
        assert (w.getnchannels(), w.getsampwidth()) == (1, 2)
        return w.getnframes() / w.getframerate()


@pytest.mark.slow
def test_wav_is_a_valid_wave_file_of_plausible_length(engine: PiperEngine) -> None:
    out = speak(engine, input="Hello there. This is a test.", response_format="wav")
    assert out["content_type"] == "audio/wav"
    assert 1.0 < wav_seconds(out["audio"]) < 6.0


@pytest.mark.slow
def test_speed_shortens_the_audio(engine: PiperEngine) -> None:
    text = "The weather today is sunny with a light breeze."
    normal = wav_seconds(speak(engine, input=text, response_format="wav", speed=1.0)["audio"])
    fast = wav_seconds(speak(engine, input=text, response_format="wav", speed=2.0)["audio"])
    assert fast < normal * 0.7


@pytest.mark.slow
@pytest.mark.parametrize("fmt", ["mp3", "flac", "opus", "aac"])
def test_compressed_formats_decode_back(engine: PiperEngine, fmt: str, tmp_path: Path) -> None:
    if fmt not in supported_formats():
        pytest.skip(f"this FFmpeg build cannot encode {fmt}")
    out = speak(engine, input="Testing one two three.", response_format=fmt)
    path = tmp_path / f"speech.{fmt}"
    path.write_bytes(out["audio"])
    samples = decode_audio(str(path), 16000)
    assert 0.8 < samples.size / 16000 < 5.0
    assert abs(samples.astype(float)).max() > 1000  # not silence


@pytest.mark.slow
def test_pcm_is_raw_24khz_int16(engine: PiperEngine) -> None:
    wav = speak(engine, input="Raw samples please.", response_format="wav")["audio"]
    pcm = speak(engine, input="Raw samples please.", response_format="pcm")
    assert pcm["content_type"] == "audio/pcm"
    assert not pcm["audio"].startswith(b"RIFF")
    # Same speech, resampled from 22.05 to 24 kHz: about the same duration (noise varies).
    assert abs(len(pcm["audio"]) / 2 / 24000 - wav_seconds(wav)) < 0.5


@pytest.mark.slow
@pytest.mark.parametrize(
    ("payload", "param"),
    [
        # The route checks the rest (empty input, speed): the engine only what it alone knows.
        ({"input": "..."}, "input"),  # no words: nothing to speak
        ({"input": "hi", "response_format": "ogg-vorbis"}, "response_format"),
    ],
)
def test_bad_input_is_a_bad_request(
    engine: PiperEngine, payload: dict[str, Any], param: str
) -> None:
    with pytest.raises(BadRequest) as info:
        speak(engine, **payload)
    assert info.value.param == param


def test_unsupported_format_lists_the_supported_ones() -> None:
    with pytest.raises(BadRequest, match="wav, mp3"):
        check_format("ogg-vorbis", ("wav", "mp3"))
    assert check_format("mp3", ("wav", "mp3")) == "mp3"


def test_wrong_op_and_unloaded_engine() -> None:
    with pytest.raises(EngineError, match="not loaded"):
        PiperEngine().run("speech", SpeechRequest(input="hi", response_format="wav"),
                          lambda _: None, lambda: False)  # fmt: skip
    with pytest.raises(BadRequest, match="'speech'"):
        PiperEngine().run("transcribe", SpeechRequest(input="hi", response_format="wav"),
                          lambda _: None, lambda: False)  # fmt: skip


@pytest.mark.slow
def test_an_untyped_payload_is_refused(engine: PiperEngine) -> None:
    with pytest.raises(BadRequest, match="takes the typed SpeechRequest, not a dict"):
        engine.run("speech", {"input": "hi", "response_format": "wav"},
                   lambda _: None, lambda: False)  # fmt: skip


def test_missing_config_is_a_load_error(tmp_path: Path) -> None:
    fake = tmp_path / "voice.onnx"
    fake.write_bytes(b"not a model")
    # No config option either: the engine looks for voice.onnx.json beside the fake.
    spec = replace(bundled_spec(VOICE), path=fake, options={})
    with pytest.raises(EngineError, match="config"):
        PiperEngine().load(spec, EngineOptions())


def test_missing_piper_is_a_clear_load_error(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setitem(sys.modules, "piper", None)  # what `import piper` sees when absent
    with pytest.raises(EngineError, match=r"elbowroom\[tts\].*GPL-3.0"):
        PiperEngine().load(bundled_spec(VOICE), EngineOptions())


def test_importing_the_engine_does_not_import_gpl_piper() -> None:
    code = "import sys, elbowroom.engines.piper; assert 'piper' not in sys.modules"
    subprocess.run([sys.executable, "-c", code], check=True)
