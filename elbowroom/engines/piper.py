"""Text to speech with piper (VITS voices in ONNX). A resident engine.

piper-tts is GPL-3.0 and an optional extra (``elbowroom[tts]``): it is imported only inside
the runner that loads a piper voice, and a missing install is a clear load error.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import numpy as np

from elbowroom.engines.audio import FORMATS, encode_audio, supported_formats
from elbowroom.engines.base import Cancelled, Emit
from elbowroom.engines.options import EngineOptions
from elbowroom.engines.requests import Payload, SpeechRequest, expect
from elbowroom.errors import BadRequest, EngineError
from elbowroom.models.spec import ModelSpec


def check_format(fmt: str, supported: tuple[str, ...]) -> str:
    """``fmt`` if this installation's FFmpeg encodes it (the server knows only the names)."""
    if fmt not in supported:
        raise BadRequest(
            f"response_format {fmt!r} is not supported; use one of: {', '.join(supported)}",
            param="response_format",
        )
    return fmt


class PiperEngine:
    max_concurrent = 1

    def __init__(self) -> None:
        self._voice: Any = None
        self._syn_config: Any = None
        self._formats: tuple[str, ...] = ("wav",)
        self._requests = 0
        self._audio_seconds = 0.0

    def load(self, spec: ModelSpec, options: EngineOptions) -> dict[str, Any]:
        try:
            import onnxruntime as ort
            from piper import PiperConfig, PiperVoice, SynthesisConfig
        except ImportError as exc:
            raise EngineError(
                "piper-tts is not installed, so speech synthesis is off; install the tts extra "
                "(pip install 'elbowroom[tts]'; piper-tts is GPL-3.0)"
            ) from exc
        config = spec.options.get("config") or f"{spec.path}.json"
        if not Path(config).is_file():
            raise EngineError(f"the piper voice config {config} is missing")
        # What PiperVoice.load does, but without onnxruntime's memory arena: with it the
        # runner kept every sentence length's buffers (measured: 103 MB anonymous after
        # load, 296 MB after six requests); without, it stays near 150 MB.
        session_options = ort.SessionOptions()
        session_options.enable_cpu_mem_arena = False
        session_options.intra_op_num_threads = options.threads or 2
        try:
            voice_config = PiperConfig.from_dict(json.loads(Path(config).read_text()))
            session = ort.InferenceSession(
                str(spec.path), session_options, providers=["CPUExecutionProvider"]
            )
            self._voice = PiperVoice(config=voice_config, session=session)
        except Exception as exc:  # onnxruntime's exception types are not importable
            raise EngineError(f"cannot load the piper voice at {spec.path}: {exc}") from exc
        self._syn_config = SynthesisConfig
        self._formats = supported_formats()
        return {
            "sample_rate": int(self._voice.config.sample_rate),
            "speakers": sorted(self._voice.config.speaker_id_map),
            "formats": list(self._formats),
        }

    def run(self, op: str, payload: Payload, emit: Emit, cancelled: Cancelled) -> dict[str, Any]:
        if op != "speech":
            raise BadRequest(f"the piper engine does not serve {op!r}; it serves 'speech'")
        if self._voice is None:
            raise EngineError("the piper engine is not loaded")
        req = expect(op, payload, SpeechRequest)
        fmt = check_format(req.response_format, self._formats)
        cfg = self._voice.config
        # OpenAI voice names (alloy, ...) have no piper equivalent: a multi-speaker voice
        # uses the named speaker if it has one, every other name gets the default speaker.
        speaker = cfg.speaker_id_map.get(req.voice or "")
        syn = self._syn_config(speaker_id=speaker, length_scale=cfg.length_scale / req.speed)
        pieces: list[np.ndarray] = []
        try:
            for chunk in self._voice.synthesize(req.input, syn):  # one chunk per sentence
                pieces.append(chunk.audio_int16_array.reshape(-1))
                if cancelled():
                    break
        except (RuntimeError, ValueError, KeyError) as exc:
            raise EngineError(f"speech synthesis failed: {exc}") from exc
        if not pieces:
            raise BadRequest("input has nothing to speak (no words)", param="input")
        samples = np.concatenate(pieces)
        self._requests += 1
        self._audio_seconds += samples.size / cfg.sample_rate
        return {
            "audio": encode_audio(samples, int(cfg.sample_rate), fmt),
            "content_type": FORMATS[fmt].content_type,
        }

    def stats(self) -> dict[str, Any]:
        return {"requests": self._requests, "audio_seconds": round(self._audio_seconds, 1)}

    def relieve(self, level: int) -> None:
        """Nothing to give back: the model is all this engine holds."""

    def close(self, *, process_exit: bool = False) -> None:
        self._voice = None
