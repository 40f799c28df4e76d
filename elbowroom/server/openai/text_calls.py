"""What the OpenAI and Ollama text routes share: the engine's request built from a validated
body (with the one ``max_tokens`` clamp); both then run it through server/stream/relay.py.

Route -> engine, for /v1/chat/completions, /v1/completions, /api/chat and /api/generate:
the body is validated by ``server/openai/schemas.py`` (Ollama's first translated into it),
``engine_request`` makes the ``TextRequest`` (engines/requests.py), and the engine turns
that into llama.cpp's request without checking it again.
"""

from __future__ import annotations

from typing import Any

from elbowroom.config import Settings
from elbowroom.engines.requests import TextRequest
from elbowroom.server.openai.schemas import ChatCompletionRequest, CompletionRequest


def engine_request(
    body: ChatCompletionRequest | CompletionRequest,
    settings: Settings,
    messages: list[dict[str, Any]] | None = None,
) -> TextRequest:
    """The engine's request for a validated body. ``max_tokens`` is clamped here and only
    here: clients often ask for far more than they need (16384 is a common default) or
    for nothing, and every request generates at most ``max_tokens_cap`` tokens (the
    context's room is the engine's own limit); the reply then ends with finish_reason
    "length"."""
    requested, _ = body.requested_max_tokens()
    cap = settings.max_tokens_cap
    return body.to_engine(min(requested or cap, cap), messages)
