"""PURE: the typed requests the server hands the LLM engine, across the runner pipe.

A chat or completion body is validated once, by the server's schemas (server/schemas.py),
and turned into a ``TextRequest`` in one place (``server/text_calls.engine_request``, which
also applies the one ``max_tokens`` clamp). The engine only translates it into llama.cpp's
request (engines/llama.py ``_body``); it checks nothing again. Both objects are frozen and
pickle across the runner pipe (and Ray, for a node's runner).

The other engines' payloads (transcribe, speech, embed) are still plain dicts: ``Payload``
is what ``Engine.run`` and ``Runner.request`` carry.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Literal

from elbowroom.errors import BadRequest

TextKind = Literal["chat", "completion"]


# NOTE: no slots. A slots dataclass pickles through Python-level __getstate__/__setstate__
# (one frozen setattr per field): measured ~2x the pickle round trip of this one, which
# crosses the runner pipe once per request on the direct path too.
@dataclass(frozen=True, kw_only=True)
class TextRequest:
    """One chat or completion request, valid by construction (built from a validated body).
    None leaves a setting to the engine."""

    kind: TextKind
    max_tokens: int  # at most the server's max_tokens_cap (always set: the cap is the default)
    messages: tuple[dict[str, Any], ...] = ()  # chat: OpenAI messages (text or text/image parts)
    prompt: str = ""  # completion
    temperature: float | None = None
    top_p: float | None = None
    seed: int | None = None  # within llama.cpp's 32-bit range (schemas.SEED_MODULUS)
    stop: tuple[str, ...] = ()
    presence_penalty: float | None = None
    frequency_penalty: float | None = None
    logit_bias: dict[str, float] | None = None  # token id (as a string) -> bias
    response_format: dict[str, Any] | None = None  # OpenAI's shape
    tools: tuple[dict[str, Any], ...] = ()  # OpenAI's function tools
    tool_choice: str | dict[str, Any] | None = None  # "none" | "auto" | "required" | named
    parallel_tool_calls: bool | None = None
    # Alternatives per token the engine reports (>= 1: it sends none for 0); None: no logprobs.
    logprobs: int | None = None
    isolated: bool = False  # cache_salt: shares no KV state with any other request
    stream: bool = False  # for ``open`` (server/direct.py): the engine streams its answer


@dataclass(frozen=True, slots=True)
class DirectClose:
    """A direct stream ended (server/direct.py): give its slot back."""

    ticket: int
    timings: dict[str, Any] | None = None  # the engine's prefill timings, for the cost model


Payload = TextRequest | DirectClose | dict[str, Any]


def fields(op: str, payload: Payload) -> dict[str, Any]:
    """A dict payload (transcribe, speech, embed), or a BadRequest naming the op."""
    if not isinstance(payload, dict):
        raise BadRequest(f"{op!r} takes a dict payload, not a {type(payload).__name__}")
    return payload
