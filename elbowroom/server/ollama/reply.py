"""The body of one Ollama /api/chat or /api/generate answer: its NDJSON chunks and the
final object with Ollama's counts and durations (server/ollama/rewriter.py ``OllamaRewriter`` feeds
it the engine's events; errors after the first byte are the stream's last line)."""

from __future__ import annotations

import time
from typing import Any

from elbowroom.server.ollama import shapes
from elbowroom.server.stream.sse import ManagedStream


class NdjsonStream(ManagedStream):
    """Ollama streams newline-delimited JSON objects, not server-sent events."""

    media_type = "application/x-ndjson"


class Timing:
    def __init__(self, started: int, first: int, was_loaded: bool) -> None:
        self.started = started
        self.first = first
        self.was_loaded = was_loaded

    def durations(self, done: dict[str, Any]) -> dict[str, Any]:
        total = time.perf_counter_ns() - self.started
        load = 0
        if not self.was_loaded:
            # Until the first event the request waited for the load and the prompt: the
            # engine's prompt time is the second part.
            prompt_ns = int(float((done.get("timings") or {}).get("prompt_ms", 0)) * 1e6)
            load = max(0, self.first - self.started - prompt_ns)
        return shapes.durations(done, total, load)


class Reply:
    """Builds the chunks and the final body of one /api/chat or /api/generate answer."""

    def __init__(self, model: str, *, chat: bool, timing: Timing) -> None:
        self.model = model
        self.chat = chat
        self.timing = timing
        self.pieces: list[str] = []
        self.logprobs: list[dict[str, Any]] = []

    def _head(self) -> dict[str, Any]:
        return {"model": self.model, "created_at": shapes.now_iso()}

    def _content(self, text: str, tool_calls: list[dict[str, Any]] | None = None) -> Any:
        if not self.chat:
            return {"response": text}
        message: dict[str, Any] = {"role": "assistant", "content": text}
        if tool_calls:
            message["tool_calls"] = tool_calls
        return {"message": message}

    def chunk(self, item: dict[str, Any]) -> dict[str, Any] | None:
        text = str(item.get("text") or "")
        lp = item.get("logprobs")
        if isinstance(lp, list):
            self.logprobs.extend(lp)
        if not text:
            return None
        self.pieces.append(text)
        out = {**self._head(), **self._content(text), "done": False}
        if isinstance(lp, list) and lp:
            out["logprobs"] = shapes.logprobs_to_ollama(lp)
        return out

    def tool_chunk(self, done: dict[str, Any]) -> dict[str, Any] | None:
        calls = shapes.tool_calls_to_ollama(done.get("tool_calls"))
        if not calls or not self.chat:
            return None
        return {**self._head(), **self._content("", calls), "done": False}

    def final(self, done: dict[str, Any], *, include_text: bool) -> dict[str, Any]:
        text = str(done.get("text") or "".join(self.pieces)) if include_text else ""
        calls = shapes.tool_calls_to_ollama(done.get("tool_calls")) if include_text else None
        out = {
            **self._head(),
            **self._content(text, calls),
            "done": True,
            "done_reason": shapes.done_reason(done.get("finish_reason")),
            **self.timing.durations(done),
        }
        if include_text and self.logprobs:
            out["logprobs"] = shapes.logprobs_to_ollama(self.logprobs)
        return out
