"""PURE: llama.cpp's OpenAI-shaped SSE events, for an engine that has no HTTP server of its
own (MLX) and sends its pieces over the runner instead (engines/base.py, ``open``).

The server's relay (server/stream/relay.py) reads every LLM answer in this one shape, whichever
engine made it: ``data: {chunk}`` events, a usage event and ``data: [DONE]``.
"""

from __future__ import annotations

import json
from typing import Any, Literal

DONE = b"data: [DONE]\n\n"


def event(chunk: dict[str, Any]) -> bytes:
    return b"data: " + json.dumps(chunk, separators=(",", ":")).encode() + b"\n\n"


def _choice(kind: Literal["chat", "completion"], text: str | None, finish: str | None) -> Any:
    if kind == "chat":
        delta = {} if text is None else {"content": text}
        return {"index": 0, "delta": delta, "finish_reason": finish}
    return {"index": 0, "text": text or "", "finish_reason": finish}


def piece(kind: Literal["chat", "completion"], text: str) -> bytes:
    """One generated piece of text."""
    return event({"choices": [_choice(kind, text, None)]})


def ending(kind: Literal["chat", "completion"], finish: str, usage: dict[str, int]) -> bytes:
    """The finish reason, the usage (``prompt_tokens``, ``completion_tokens``,
    ``cached_tokens`` exact: the relay rounds them) and the end of the stream."""
    prompt, completion = int(usage["prompt_tokens"]), int(usage["completion_tokens"])
    body = {
        "prompt_tokens": prompt,
        "completion_tokens": completion,
        "total_tokens": prompt + completion,
        "prompt_tokens_details": {"cached_tokens": int(usage.get("cached_tokens", 0))},
    }
    return b"".join(
        (
            event({"choices": [_choice(kind, None, finish)]}),
            event({"choices": [], "usage": body}),
            DONE,
        )
    )
