"""Speech to text with faster-whisper (CTranslate2, int8 on CPU). A resident engine."""

from __future__ import annotations

from typing import Any

import numpy as np

from elbowroom.engines.audio import MAX_AUDIO_SECONDS, decode_audio
from elbowroom.engines.base import Cancelled, Emit
from elbowroom.engines.options import EngineOptions
from elbowroom.engines.requests import Payload, TranscribeRequest, expect
from elbowroom.errors import BadRequest, EngineError
from elbowroom.models.spec import ModelSpec

SAMPLE_RATE = 16000  # what every whisper model expects


class WhisperEngine:
    max_concurrent = 1

    def __init__(self) -> None:
        self._model: Any = None
        self._max_seconds = MAX_AUDIO_SECONDS
        self._requests = 0
        self._audio_seconds = 0.0

    def load(self, spec: ModelSpec, options: EngineOptions) -> dict[str, Any]:
        try:
            from faster_whisper import WhisperModel
        except ImportError as exc:
            raise EngineError(
                "faster-whisper is not installed: pip install 'elbowroom[asr]'"
            ) from exc
        threads = options.threads or 2
        try:
            self._model = WhisperModel(
                str(spec.path), device="cpu", compute_type="int8", cpu_threads=threads
            )
        except (RuntimeError, ValueError, OSError) as exc:
            raise EngineError(f"cannot load the whisper model at {spec.path}: {exc}") from exc
        return {"threads": threads, "multilingual": bool(self._model.model.is_multilingual)}

    def run(self, op: str, payload: Payload, emit: Emit, cancelled: Cancelled) -> dict[str, Any]:
        if op != "transcribe":
            raise BadRequest(f"the whisper engine does not serve {op!r}; it serves 'transcribe'")
        if self._model is None:
            raise EngineError("the whisper engine is not loaded")
        req = expect(op, payload, TranscribeRequest)
        multilingual = bool(self._model.model.is_multilingual)
        if not multilingual:
            req.require_english()
        elif req.language is not None and req.language not in self._model.supported_languages:
            raise BadRequest(f"unknown language {req.language!r}", param="language")
        samples = decode_audio(req.audio_path, SAMPLE_RATE, self._max_seconds)
        audio = samples.astype(np.float32) / 32768.0
        del samples
        # temperature 0 / unset: faster-whisper's fallback schedule (0.0, 0.2, ... 1.0), as
        # OpenAI does; otherwise sample at exactly the requested temperature.
        temperature: Any = {} if not req.temperature else {"temperature": req.temperature}
        if multilingual:
            temperature["task"] = req.task  # an English-only model only transcribes
        try:
            pieces, info = self._model.transcribe(
                audio, language=req.language, initial_prompt=req.prompt, **temperature
            )
            segments = []
            for seg in pieces:  # a generator: decoding happens as we iterate
                segments.append(_segment(seg))
                if cancelled():
                    break
        except (RuntimeError, ValueError) as exc:
            raise EngineError(f"transcription failed: {exc}") from exc
        self._requests += 1
        self._audio_seconds += float(info.duration)
        return {
            "text": "".join(s["text"] for s in segments).strip(),
            "language": info.language,
            "duration": round(float(info.duration), 3),
            "segments": segments,
        }

    def stats(self) -> dict[str, Any]:
        return {"requests": self._requests, "audio_seconds": round(self._audio_seconds, 1)}

    def relieve(self, level: int) -> None:
        """Nothing to give back: the model is all this engine holds."""

    def close(self, *, process_exit: bool = False) -> None:
        self._model = None


def _segment(seg: Any) -> dict[str, Any]:
    """The OpenAI verbose_json segment fields."""
    return {
        "id": int(seg.id) - 1,  # faster-whisper counts from 1; OpenAI from 0
        "seek": int(seg.seek),
        "start": round(float(seg.start), 3),
        "end": round(float(seg.end), 3),
        "text": seg.text,
        "tokens": [int(t) for t in seg.tokens],
        "temperature": float(seg.temperature or 0.0),
        "avg_logprob": float(seg.avg_logprob),
        "compression_ratio": float(seg.compression_ratio),
        "no_speech_prob": float(seg.no_speech_prob),
    }
