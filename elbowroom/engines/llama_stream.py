"""PURE: turn the engine's OpenAI-style stream chunks into elbowroom deltas and a result.

The runner always asks the engine for a stream (even when the client did not): a stream is
what lets a request be cancelled or aborted between tokens. ``StreamState.feed`` takes one
parsed chunk and returns the deltas to emit now; ``result()`` is the request's final
answer (text, tool calls, logprobs, usage) once the stream ended.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any


@dataclass(slots=True)
class _Call:
    id: str = ""
    name: str = ""
    arguments: list[str] = field(default_factory=list)


@dataclass(slots=True)
class StreamState:
    chat: bool
    pieces: list[str] = field(default_factory=list)
    reasoning: list[str] = field(default_factory=list)
    calls: dict[int, _Call] = field(default_factory=dict)
    logprobs: list[dict[str, Any]] = field(default_factory=list)
    finish_reason: str | None = None
    usage: dict[str, Any] = field(default_factory=dict)
    timings: dict[str, Any] = field(default_factory=dict)
    tokens: int = 0  # generated pieces seen (the pressure check counts these)
    error: dict[str, Any] | None = None

    def feed(self, chunk: dict[str, Any]) -> list[dict[str, Any]]:
        if "error" in chunk:
            err = chunk["error"]
            self.error = err if isinstance(err, dict) else {"message": str(err)}
            return []
        if isinstance(chunk.get("usage"), dict):
            self.usage = chunk["usage"]
        if isinstance(chunk.get("timings"), dict):
            self.timings = chunk["timings"]
        out: list[dict[str, Any]] = []
        for choice in chunk.get("choices") or ():
            if choice.get("finish_reason"):
                self.finish_reason = str(choice["finish_reason"])
            delta = self._delta(choice)
            if delta:
                out.append(delta)
        return out

    def _delta(self, choice: dict[str, Any]) -> dict[str, Any]:
        delta: dict[str, Any] = {}
        if self.chat:
            d = choice.get("delta") or {}
            text = d.get("content")
            if d.get("reasoning_content"):
                self.reasoning.append(str(d["reasoning_content"]))
                delta["reasoning"] = str(d["reasoning_content"])
            calls = d.get("tool_calls")
            if calls:
                delta["tool_calls"] = [self._call_delta(c) for c in calls]
        else:
            text = choice.get("text")
        if text:
            self.pieces.append(str(text))
            self.tokens += 1
            delta["text"] = str(text)
        lp = choice.get("logprobs")
        if isinstance(lp, dict) and lp.get("content"):
            entries = list(lp["content"])
            self.logprobs.extend(entries)
            delta["logprobs"] = entries
        if delta:
            delta["type"] = "delta"
        return delta

    def _call_delta(self, c: dict[str, Any]) -> dict[str, Any]:
        index = int(c.get("index", 0))
        call = self.calls.setdefault(index, _Call())
        out: dict[str, Any] = {"index": index}
        if c.get("id"):
            call.id = str(c["id"])
            out["id"] = call.id
            out["type"] = "function"
        fn = c.get("function") or {}
        piece: dict[str, Any] = {}
        if fn.get("name"):
            call.name = str(fn["name"])
            piece["name"] = call.name
        if fn.get("arguments"):
            call.arguments.append(str(fn["arguments"]))
            piece["arguments"] = str(fn["arguments"])
        self.tokens += 1
        out["function"] = piece
        return out

    def tool_calls(self) -> list[dict[str, Any]]:
        return [
            {
                "id": call.id or f"call_{i}",
                "type": "function",
                "function": {"name": call.name, "arguments": "".join(call.arguments)},
            }
            for i, call in sorted(self.calls.items())
        ]

    def result(self, finish_override: str | None = None) -> dict[str, Any]:
        usage = self.usage
        details = usage.get("prompt_tokens_details") or {}
        out: dict[str, Any] = {
            "text": "".join(self.pieces),
            "finish_reason": finish_override or self.finish_reason or "stop",
            "usage": {
                "prompt_tokens": int(usage.get("prompt_tokens", 0)),
                "completion_tokens": int(usage.get("completion_tokens", 0)),
                "cached_tokens": int(details.get("cached_tokens", 0)),
            },
        }
        if self.calls:
            out["tool_calls"] = self.tool_calls()
        if self.logprobs:
            out["logprobs"] = self.logprobs
        if self.reasoning:
            out["reasoning"] = "".join(self.reasoning)
        if self.timings:
            out["timings"] = {
                k: self.timings[k]
                for k in ("cache_n", "prompt_n", "prompt_ms", "predicted_n", "predicted_ms")
                if k in self.timings
            }
        return out
