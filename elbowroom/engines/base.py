"""The Engine protocol: what a runner process needs from an inference library.

An engine lives inside one runner process (runtime/worker.py) and owns one model. The
worker calls ``load`` once, then ``run`` once per request (one at a time unless the
engine says otherwise), and ``close(process_exit=True)`` before exit. Errors raised from
``run`` should be ``elbowroom.errors.ElbowroomError`` subclasses (library errors
translated with ``raise ... from exc``); anything else reaches the client as a 500
EngineError.

``load`` takes the engine's options object (engines/options.py: ``LlamaOptions`` for the
LLM engine, ``RpcLlamaOptions`` for a split one, ``EngineOptions`` for the rest). Every
payload is a typed request from engines/requests.py, validated by the server; an engine
takes its own type (``requests.expect``: anything else is a 400) and checks only what the
server cannot know (a model's languages, the formats this FFmpeg encodes). Ops and payloads:

- llama, mlx ``open``: an ``engines.requests.TextRequest`` (validated by the server): the
         engine's only text operation. It picks and restores the slot, builds the engine's
         request and returns ``{"ticket": TextTicket}``; the events then come from the
         engine's socket (llama) or follow over the runner as ``{"type": "events", "data":
         bytes}`` items after a ``{"type": "ticket", "ticket": TextTicket}`` one (mlx).
         Both are llama.cpp's OpenAI-shaped SSE events (runtime/engine_events.py).
         ``close``: a ``CloseTicket`` (the relay's end, however it ended)
- whisper, pocketsphinx ``transcribe``: a ``TranscribeRequest``;
         returns {"text", "language", "duration", "segments": [...]}
- piper  ``speech``:      a ``SpeechRequest``; returns {"audio": bytes, "content_type": str}
- onnx-embed ``embed``:   an ``EmbedRequest``;
         returns {"embeddings": [[float, ...], ...], "prompt_tokens": int}
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, Protocol

from elbowroom.engines.options import EngineOptions
from elbowroom.engines.requests import Payload
from elbowroom.models.spec import ModelSpec

Emit = Callable[[dict[str, Any]], None]
Cancelled = Callable[[], bool]
PressureLevel = Callable[[], int]  # 0 normal, 1 soft, 2 hard (memory.types.Pressure)


class Engine(Protocol):
    # Requests the worker runs at once, each on its own thread (1: one at a time; the LLM
    # engine: its slots). Read after ``load``.
    max_concurrent: int

    def load(self, spec: ModelSpec, options: EngineOptions) -> dict[str, Any]:
        """Load the model with the options of the engine's kind (engines/options.py).
        Returns facts about the load (e.g. {"n_ctx": 4096}) that the supervisor reports."""
        ...

    def run(self, op: str, payload: Payload, emit: Emit, cancelled: Cancelled) -> dict[str, Any]:
        """Serve one request; call ``emit`` for streamed pieces; poll ``cancelled()`` often
        (at least every few tokens) and stop early when it returns True."""
        ...

    def stats(self) -> dict[str, Any]:
        """Engine-specific stats for /api/ps (e.g. KV cache tiers). May be {}."""
        ...

    def relieve(self, level: int) -> None:
        """Memory pressure rose to ``level`` (1 soft, 2 hard): give back what can go without
        stopping a request (caches, idle state). Called off the worker's reader thread. May
        do nothing."""
        ...

    def close(self, *, process_exit: bool = False) -> None:
        """Release the model. ``process_exit``: the runner process exits right after this
        call (the worker's close), so what the kernel reclaims at exit may be left to it."""
        ...
