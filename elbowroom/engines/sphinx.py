"""Speech to text with pocketsphinx: the small fallback recognizer (English, lower accuracy).

Same op and result shape as the whisper engine. The audio is resampled to 16 kHz mono int16
and fed to the decoder one second at a time, so a long file can be cancelled mid-way.
Segments are the stretches of words between the silences the decoder marks.
"""

from __future__ import annotations

import re
from pathlib import Path
from typing import Any

from elbowroom.engines.audio import MAX_AUDIO_SECONDS, decode_audio
from elbowroom.engines.base import Cancelled, Emit
from elbowroom.engines.options import EngineOptions
from elbowroom.engines.requests import Payload, TranscribeRequest, expect
from elbowroom.errors import BadRequest, EngineError
from elbowroom.models.spec import ModelSpec

SAMPLE_RATE = 16000
CHUNK_SAMPLES = SAMPLE_RATE  # one second between cancellation checks
_NOT_WORDS = re.compile(r"^(<.*>|\[.*\]|\+\+.*\+\+)$")  # <s>, <sil>, [NOISE], ++UH++
_ALTERNATE = re.compile(r"\(\d+\)$")  # "the(2)": second pronunciation of "the"


def model_files(path: Path) -> dict[str, str]:
    """Find the acoustic model folder (has ``mdef``), language model and dictionary.

    Accepts pocketsphinx's ``model`` folder, its ``en-us`` folder or the acoustic model
    folder itself; the language model (``*.lm.bin``, not the phone LM) and the ``*.dict``
    lie beside the acoustic model folder.
    """
    candidates = [path, path / "en-us", path / "en-us" / "en-us"]
    hmm = next((p for p in candidates if (p / "mdef").is_file()), None)
    if hmm is None:
        raise EngineError(f"no pocketsphinx acoustic model (a folder with mdef) at {path}")
    lms = sorted(p for p in hmm.parent.glob("*.lm.bin") if "phone" not in p.name)
    dicts = sorted(hmm.parent.glob("*.dict"))
    if not lms or not dicts:
        raise EngineError(f"no language model (*.lm.bin) or dictionary (*.dict) in {hmm.parent}")
    return {"hmm": str(hmm), "lm": str(lms[0]), "dict": str(dicts[0])}


class SphinxEngine:
    max_concurrent = 1

    def __init__(self) -> None:
        self._decoder: Any = None
        self._frate = 100
        self._max_seconds = MAX_AUDIO_SECONDS
        self._requests = 0

    def load(self, spec: ModelSpec, options: EngineOptions) -> dict[str, Any]:
        try:
            from pocketsphinx import Decoder
        except ImportError as exc:
            raise EngineError(
                "pocketsphinx is not installed: pip install 'elbowroom[asr]'"
            ) from exc
        files = model_files(spec.path)
        try:
            self._decoder = Decoder(samprate=SAMPLE_RATE, loglevel="FATAL", **files)
        except (RuntimeError, ValueError, OSError) as exc:
            raise EngineError(f"cannot load the pocketsphinx model at {spec.path}: {exc}") from exc
        self._frate = int(self._decoder.config["frate"])
        return {"sample_rate": SAMPLE_RATE}

    def run(self, op: str, payload: Payload, emit: Emit, cancelled: Cancelled) -> dict[str, Any]:
        if op != "transcribe":
            raise BadRequest(f"the sphinx engine does not serve {op!r}; it serves 'transcribe'")
        if self._decoder is None:
            raise EngineError("the sphinx engine is not loaded")
        req = expect(op, payload, TranscribeRequest)
        req.require_english()
        samples = decode_audio(req.audio_path, SAMPLE_RATE, self._max_seconds)
        dec = self._decoder
        try:
            dec.start_utt()
            for start in range(0, samples.size, CHUNK_SAMPLES):
                dec.process_raw(samples[start : start + CHUNK_SAMPLES].tobytes(), False, False)
                if cancelled():
                    break
            dec.end_utt()
            words = [(_ALTERNATE.sub("", s.word), s.start_frame, s.end_frame) for s in dec.seg()]
        except RuntimeError as exc:
            raise EngineError(f"pocketsphinx failed: {exc}") from exc
        segments = _segments(words, self._frate)
        self._requests += 1
        return {
            "text": " ".join(s["text"].strip() for s in segments),
            "language": "en",
            "duration": round(samples.size / SAMPLE_RATE, 3),
            "segments": segments,
        }

    def stats(self) -> dict[str, Any]:
        return {"requests": self._requests}

    def relieve(self, level: int) -> None:
        """Nothing to give back: the model is all this engine holds."""

    def close(self, *, process_exit: bool = False) -> None:
        self._decoder = None


def _segments(words: list[tuple[str, int, int]], frate: int) -> list[dict[str, Any]]:
    """Group words into segments, split at every silence/filler the decoder marks."""
    groups: list[list[tuple[str, int, int]]] = [[]]
    for word in words:
        if _NOT_WORDS.match(word[0]):
            if groups[-1]:
                groups.append([])
        else:
            groups[-1].append(word)
    return [
        {
            "id": i,
            "start": round(group[0][1] / frate, 3),
            "end": round((group[-1][2] + 1) / frate, 3),
            "text": " " + " ".join(w for w, _, _ in group),
        }
        for i, group in enumerate(g for g in groups if g)
    ]
