"""Audio helpers shared by the speech engines: decoding, encoding.

Decoding uses PyAV (FFmpeg), the decoder faster-whisper itself uses, so WAV, MP3, FLAC, OGG,
M4A, WebM, ... all work. It lives here rather than in faster-whisper's ``decode_audio`` so the
sphinx runner need not import ctranslate2, and so that library errors are translated in one
place. Encoding to WAV needs only the standard library; the compressed formats need PyAV.
"""

from __future__ import annotations

import io
import wave
from collections.abc import Iterator
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from elbowroom.errors import BadRequest, EngineError, PayloadTooLarge

if TYPE_CHECKING:  # numpy is imported where used: the server imports FORMATS only
    import numpy as np

# Decoded audio is held in memory (int16, then float32 for whisper): an hour at 16 kHz is
# ~115 MB + ~230 MB. A 25 MB upload of low-bitrate Opus could otherwise decode to gigabytes.
MAX_AUDIO_SECONDS = 3600.0


def _import_av() -> Any:
    try:
        import av
    except ImportError as exc:
        raise EngineError(
            "PyAV is not installed (it comes with the asr extra: pip install 'elbowroom[asr]')"
        ) from exc
    return av


def _valid_frames(frames: Iterator[Any], invalid: type[Exception]) -> Iterator[Any]:
    # Like faster-whisper: a damaged frame in the middle of a file is skipped, not fatal.
    while True:
        try:
            yield next(frames)
        except StopIteration:
            return
        except invalid:
            continue


def decode_audio(
    path: str, sample_rate: int = 16000, max_seconds: float = MAX_AUDIO_SECONDS
) -> np.ndarray:
    """Decode any audio file to mono int16 at ``sample_rate``.

    Not audio, corrupt, or no samples at all -> BadRequest; longer than ``max_seconds`` ->
    PayloadTooLarge, raised while decoding so memory stays bounded.
    """
    import numpy as np

    av = _import_av()
    max_samples = int(max_seconds * sample_rate)
    resampler = av.audio.resampler.AudioResampler(format="s16", layout="mono", rate=sample_rate)
    chunks: list[np.ndarray] = []
    count = 0
    try:
        with av.open(path, mode="r", metadata_errors="ignore") as container:
            if not container.streams.audio:
                raise BadRequest("the file has no audio stream", param="file")
            frames = _valid_frames(container.decode(audio=0), av.error.InvalidDataError)
            for frame in frames:
                for out in resampler.resample(frame):
                    chunks.append(out.to_ndarray().reshape(-1))
                    count += chunks[-1].size
                if count > max_samples:
                    raise PayloadTooLarge(
                        f"the audio is longer than the limit of {max_seconds:g} s", param="file"
                    )
            for out in resampler.resample(None):
                chunks.append(out.to_ndarray().reshape(-1))
    except av.error.FFmpegError as exc:
        # strerror, not str(exc): that names our temporary file
        reason = getattr(exc, "strerror", None) or type(exc).__name__
        raise BadRequest(
            f"the file is not audio this server can decode ({reason})", param="file"
        ) from exc
    except (IndexError, ValueError, OSError) as exc:
        raise BadRequest(f"cannot decode the audio: {exc}", param="file") from exc
    if not chunks or sum(c.size for c in chunks) == 0:
        raise BadRequest("the file contains no audio samples (empty or corrupt)", param="file")
    return np.concatenate(chunks).astype(np.int16, copy=False)


# --- encoding ------------------------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class AudioFormat:
    name: str  # the OpenAI response_format
    container: str  # FFmpeg muxer
    codec: str  # FFmpeg encoder
    content_type: str
    rate: int | None = None  # resample to this rate (None: keep the voice's rate)


# Opus only takes 8/12/16/24/48 kHz; OpenAI's raw "pcm" is 24 kHz 16-bit little-endian mono.
FORMATS: dict[str, AudioFormat] = {
    f.name: f
    for f in (
        AudioFormat("wav", "wav", "pcm_s16le", "audio/wav"),
        AudioFormat("mp3", "mp3", "libmp3lame", "audio/mpeg"),
        AudioFormat("flac", "flac", "flac", "audio/flac"),
        AudioFormat("opus", "ogg", "libopus", "audio/ogg", 48000),
        AudioFormat("aac", "adts", "aac", "audio/aac"),
        AudioFormat("pcm", "s16le", "pcm_s16le", "audio/pcm", 24000),
    )
}


def supported_formats() -> tuple[str, ...]:
    """The response formats this installation can encode (wav always)."""
    try:
        import av
    except ImportError:
        return ("wav",)
    names = []
    for fmt in FORMATS.values():
        try:
            av.codec.Codec(fmt.codec, "w")
        except Exception:  # an encoder missing from this FFmpeg build: the format is off
            continue
        if fmt.container in av.formats_available:
            names.append(fmt.name)
    return tuple(n for n in FORMATS if n == "wav" or n in names)


def encode_audio(samples: np.ndarray, sample_rate: int, fmt: str) -> bytes:
    """Encode mono int16 samples; ``fmt`` must be one of supported_formats()."""
    import numpy as np

    spec = FORMATS[fmt]
    if fmt == "wav":
        buf = io.BytesIO()
        with wave.open(buf, "wb") as out:
            out.setnchannels(1)
            out.setsampwidth(2)
            out.setframerate(sample_rate)
            out.writeframes(samples.astype("<i2", copy=False).tobytes())
        return buf.getvalue()
    av = _import_av()
    buf = io.BytesIO()
    try:
        with av.open(buf, mode="w", format=spec.container) as out:
            stream = out.add_stream(spec.codec, rate=spec.rate or sample_rate, layout="mono")
            frame = av.AudioFrame.from_ndarray(
                samples.astype(np.int16, copy=False).reshape(1, -1), format="s16", layout="mono"
            )
            frame.sample_rate = sample_rate
            # PyAV resamples to the encoder's format/rate and splits into its frame size.
            for packet in stream.encode(frame):
                out.mux(packet)
            for packet in stream.encode(None):
                out.mux(packet)
    except av.error.FFmpegError as exc:
        raise EngineError(f"encoding {fmt} failed: {exc}") from exc
    return buf.getvalue()
