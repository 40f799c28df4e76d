"""A transcription result as each OpenAI ``response_format``: json, text, verbose_json,
srt, vtt. Pure functions over the engine's result dict."""

from __future__ import annotations

import math
from typing import Any

RESPONSE_FORMATS = ("json", "text", "verbose_json", "srt", "vtt")


def _usage(result: dict[str, Any]) -> dict[str, Any]:
    return {"type": "duration", "seconds": math.ceil(float(result.get("duration", 0.0)))}


def as_json(result: dict[str, Any]) -> dict[str, Any]:
    return {"text": result["text"], "usage": _usage(result)}


# OpenAI's verbose segment fields; engines without a value (pocketsphinx) get these.
_SEGMENT_DEFAULTS: dict[str, Any] = {
    "seek": 0,
    "tokens": [],
    "temperature": 0.0,
    "avg_logprob": 0.0,
    "compression_ratio": 0.0,
    "no_speech_prob": 0.0,
}


def as_verbose_json(result: dict[str, Any]) -> dict[str, Any]:
    return {
        "task": "transcribe",
        "language": result.get("language", ""),
        "duration": result.get("duration", 0.0),
        "text": result["text"],
        "segments": [{**_SEGMENT_DEFAULTS, **s} for s in result.get("segments", [])],
        "usage": _usage(result),
    }


def timestamp(seconds: float, separator: str) -> str:
    """3725.5 -> '01:02:05,500' (srt, separator ',') or '01:02:05.500' (vtt, '.')."""
    millis = max(0, round(seconds * 1000))
    hours, millis = divmod(millis, 3_600_000)
    minutes, millis = divmod(millis, 60_000)
    secs, millis = divmod(millis, 1000)
    return f"{hours:02d}:{minutes:02d}:{secs:02d}{separator}{millis:03d}"


def _cues(result: dict[str, Any], separator: str) -> list[tuple[str, str]]:
    return [
        (
            f"{timestamp(s['start'], separator)} --> {timestamp(s['end'], separator)}",
            str(s["text"]).strip(),
        )
        for s in result.get("segments", [])
        if str(s["text"]).strip()
    ]


def as_srt(result: dict[str, Any]) -> str:
    blocks = [f"{i}\n{times}\n{text}\n" for i, (times, text) in enumerate(_cues(result, ","), 1)]
    return "\n".join(blocks)


def as_vtt(result: dict[str, Any]) -> str:
    blocks = [f"{times}\n{text}\n" for times, text in _cues(result, ".")]
    return "WEBVTT\n\n" + "\n".join(blocks)


def as_text(result: dict[str, Any]) -> str:
    return str(result["text"]) + "\n"
