"""PURE: the typed requests the server hands an engine, across the runner pipe.

Every body is validated once, in the server, and turned into one of these objects:
- ``TextRequest`` (open): the server's schemas (server/openai/schemas.py), built
  in one place (``server/text_calls.engine_request``, which also applies the one
  ``max_tokens`` clamp); the LLM engine translates it into llama.cpp's request
  (engines/llama.py ``_body``);
- ``TranscribeRequest`` (transcribe): the upload form, checked in server/openai/audio_routes.py;
- ``SpeechRequest`` (speech): the speech body (server/openai/audio_routes.py);
- ``EmbedRequest`` (embed): ``server/embeddings_routes.check_inputs``, for OpenAI's and
  Ollama's routes.
An engine checks nothing the server checked: it takes its own type (``expect``) and only
translates. What the server cannot know stays the engine's: the languages a model speaks,
the audio formats this installation's FFmpeg encodes, whether the file decodes. All are
frozen and pickle across the runner pipe (and Ray, for a node's runner); ``Payload`` is
what ``Engine.run`` and ``Runner.request`` carry.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Literal, TypeVar

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
    samplers: dict[str, int | float] | None = None  # llama.cpp's by name (schemas.SAMPLERS)
    response_format: dict[str, Any] | None = None  # OpenAI's shape
    tools: tuple[dict[str, Any], ...] = ()  # OpenAI's function tools
    tool_choice: str | dict[str, Any] | None = None  # "none" | "auto" | "required" | named
    parallel_tool_calls: bool | None = None
    # Alternatives per token the engine reports (>= 1: it sends none for 0); None: no logprobs.
    logprobs: int | None = None
    isolated: bool = False  # cache_salt: shares no KV state with any other request
    stream: bool = False  # the client's wish (the engine always streams to the relay)
    # A preempted stream's continuation (server/stream/resume.py): the ticket it continues; 0: none.
    resumed: int = 0


@dataclass(frozen=True, slots=True)
class TextTicket:
    """The LLM engine's answer to ``open`` (its only text operation): the slot is chosen and
    restored, and this says where the request's events come from (runtime/engine_events.py).

    ``socket`` set: the engine's private Unix socket; the server posts ``body`` to ``path``
    with ``key`` and reads llama.cpp's own SSE events, and ``close`` with this ``ticket``
    gives the slot back. ``socket`` None: the events follow over the runner itself, as
    ``{"type": "events", "data": bytes}`` items in the same SSE shape (an engine without
    an HTTP server: MLX; or a node's runner relayed by its agent)."""

    ticket: int
    socket: str | None
    key: str = ""
    path: str = ""  # /v1/chat/completions or /v1/completions
    body: dict[str, Any] | None = None
    block_tokens: int = 1  # cached_tokens are reported in whole blocks of this many tokens
    emulated_tools: bool = False  # the reply is a JSON call object: parsed at the end
    transcript: bool = False  # a chat answered from a transcript prompt (completion events)


@dataclass(frozen=True, slots=True)
class CloseTicket:
    """A request's events ended (any way): give its slot back."""

    ticket: int
    timings: dict[str, Any] | None = None  # the engine's prefill timings, for the cost model
    resume: bool = False  # preempted: save the slot's state for the continuation first


@dataclass(frozen=True, kw_only=True)
class TranscribeRequest:
    """Speech to text of one uploaded file (the server deletes it after the answer)."""

    audio_path: str
    language: str | None = None  # trimmed, lower case ("en"); None: the model detects it
    prompt: str | None = None
    temperature: float | None = None  # 0..1; None or 0: the engine's fallback schedule
    # translate: English text of speech in any language (whisper's task; an English-only
    # model's audio is English, so it transcribes)
    task: Literal["transcribe", "translate"] = "transcribe"

    def require_english(self) -> None:
        """For a model that knows only English: any other language is a bad request (no
        language means English)."""
        if self.language not in (None, "en"):
            raise BadRequest(
                f"this model transcribes English only; language {self.language!r} is not "
                "supported (use 'en' or leave language out)",
                param="language",
            )


@dataclass(frozen=True, kw_only=True)
class SpeechRequest:
    """Text to speech: ``input`` has text and is within ``max_speech_chars``."""

    input: str
    response_format: str  # one of engines/audio.FORMATS (the engine knows which it encodes)
    speed: float = 1.0  # 0.25..4.0, OpenAI's range
    voice: str | None = None  # a multi-speaker voice's speaker; other names: the default


@dataclass(frozen=True, kw_only=True)
class EmbedRequest:
    """Text embeddings: 1..max_embedding_inputs strings, each with text, or token-id arrays
    in the model's own tokenizer (the engine decodes them; server/openai/token_inputs.py)."""

    inputs: tuple[str | tuple[int, ...], ...]


Payload = TextRequest | CloseTicket | TranscribeRequest | SpeechRequest | EmbedRequest

_P = TypeVar("_P", TextRequest, TranscribeRequest, SpeechRequest, EmbedRequest)


def expect(op: str, payload: Payload, kind: type[_P]) -> _P:
    """``payload`` as the engine's own request type, or a BadRequest naming both: an engine
    translates a validated object and never parses a dict."""
    if not isinstance(payload, kind):
        raise BadRequest(f"{op!r} takes the typed {kind.__name__}, not a {type(payload).__name__}")
    return payload
