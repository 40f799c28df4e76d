"""PURE: OpenAI response and chunk bodies for chat and text completions.

Kept apart from the routes so the exact shapes (the part clients parse) are tested
without a server. The engine's pieces (engines/llama.py) come in as plain dicts: text,
tool calls (whole, or as OpenAI's streamed deltas), logprob entries and usage.
"""

from __future__ import annotations

import uuid
from dataclasses import dataclass
from typing import Any, Literal

Kind = Literal["chat", "completion"]


@dataclass(frozen=True, slots=True)
class Envelope:
    """What every body of one response shares."""

    kind: Kind
    id: str
    created: int
    model: str

    @staticmethod
    def new(kind: Kind, model: str, created: int) -> Envelope:
        prefix = "chatcmpl-" if kind == "chat" else "cmpl-"
        return Envelope(kind, prefix + uuid.uuid4().hex[:24], created, model)

    def _head(self, obj: str) -> dict[str, Any]:
        return {"id": self.id, "object": obj, "created": self.created, "model": self.model}

    def response(
        self,
        text: str,
        finish_reason: str | None,
        usage: dict[str, Any],
        *,
        tool_calls: list[dict[str, Any]] | None = None,
        logprobs: dict[str, Any] | None = None,
        reasoning: str | None = None,
    ) -> dict[str, Any]:
        """The whole answer. A chat message with tool calls and no text has ``content:
        null``, as OpenAI's has."""
        if self.kind == "chat":
            message: dict[str, Any] = {
                "role": "assistant",
                "content": text if text or not tool_calls else None,
                "refusal": None,
            }
            if tool_calls:
                message["tool_calls"] = [whole_call(c) for c in tool_calls]
            if reasoning:
                message["reasoning_content"] = reasoning
            choice: dict[str, Any] = {"index": 0, "message": message}
            body = self._head("chat.completion")
        else:
            choice = {"index": 0, "text": text}
            body = self._head("text_completion")
        choice["logprobs"] = logprobs
        choice["finish_reason"] = finish_reason
        body["choices"] = [choice]
        body["usage"] = usage_body(usage)
        return body

    def chunk(
        self,
        text: str | None,
        finish_reason: str | None = None,
        *,
        first: bool = False,
        include_usage: bool = False,
        tool_calls: list[dict[str, Any]] | None = None,
        logprobs: dict[str, Any] | None = None,
        reasoning: str | None = None,
    ) -> dict[str, Any]:
        """One streamed piece. Chat's first chunk carries the role; with include_usage every
        chunk has ``usage: null`` until the final usage chunk (as OpenAI sends them)."""
        if self.kind == "chat":
            delta: dict[str, Any] = {}
            if first:
                delta["role"] = "assistant"
            if text is not None:
                delta["content"] = text
            if reasoning:
                delta["reasoning_content"] = reasoning
            if tool_calls:
                delta["tool_calls"] = [call_delta(c) for c in tool_calls]
            choice: dict[str, Any] = {"index": 0, "delta": delta}
            body = self._head("chat.completion.chunk")
        else:
            choice = {"index": 0, "text": text or ""}
            body = self._head("text_completion")
        choice["logprobs"] = logprobs
        choice["finish_reason"] = finish_reason
        body["choices"] = [choice]
        if include_usage:
            body["usage"] = None
        return body

    def usage_chunk(self, usage: dict[str, Any]) -> dict[str, Any]:
        obj = "chat.completion.chunk" if self.kind == "chat" else "text_completion"
        body = self._head(obj)
        body["choices"] = []
        body["usage"] = usage_body(usage)
        return body


def usage_body(usage: dict[str, Any]) -> dict[str, Any]:
    """The engine's usage ({prompt_tokens, completion_tokens, cached_tokens}) as OpenAI's."""
    prompt = int(usage.get("prompt_tokens", 0))
    completion = int(usage.get("completion_tokens", 0))
    return {
        "prompt_tokens": prompt,
        "completion_tokens": completion,
        "total_tokens": prompt + completion,
        "prompt_tokens_details": {"cached_tokens": int(usage.get("cached_tokens", 0))},
    }


def whole_call(call: dict[str, Any]) -> dict[str, Any]:
    """A finished tool call: ``{"id", "type": "function", "function": {"name", "arguments"}}``."""
    fn = call.get("function") or {}
    return {
        "id": str(call.get("id") or ""),
        "type": "function",
        "function": {"name": str(fn.get("name", "")), "arguments": str(fn.get("arguments", ""))},
    }


def call_delta(call: dict[str, Any]) -> dict[str, Any]:
    """A streamed piece of a tool call. The first piece of a call has its ``id``, ``type``
    and ``name``; later pieces add to ``arguments``. ``index`` says which call."""
    out: dict[str, Any] = {"index": int(call.get("index", 0))}
    if call.get("id"):
        out["id"] = str(call["id"])
        out["type"] = "function"
    fn = call.get("function") or {}
    out["function"] = {k: str(fn[k]) for k in ("name", "arguments") if fn.get(k) is not None}
    return out


@dataclass(slots=True)
class Logprobs:
    """Renders the engine's logprob entries (OpenAI chat entries: token, logprob, bytes,
    top_logprobs) as the route answers them, for one response. ``top`` is how many
    alternatives the client asked for (the engine is asked for at least one).

    Chat: ``{"content": [{"token", "logprob", "bytes", "top_logprobs": [...]}], "refusal"}``.
    /v1/completions (the legacy shape): ``{"tokens", "token_logprobs", "top_logprobs":
    [{token: logprob}] (null for logprobs 0), "text_offset"}``; offsets count characters
    of the completion's text, continuing across the chunks of a stream.
    """

    kind: Kind
    top: int
    offset: int = 0

    def render(self, entries: list[dict[str, Any]]) -> dict[str, Any]:
        if self.kind == "chat":
            return {"content": [self._chat_entry(e) for e in entries], "refusal": None}
        tokens = [str(e.get("token", "")) for e in entries]
        offsets = []
        for token in tokens:
            offsets.append(self.offset)
            self.offset += len(token)
        tops: list[dict[str, float]] | None = None
        if self.top > 0:
            tops = [
                {str(t.get("token", "")): float(t["logprob"]) for t in self._alternatives(e)}
                for e in entries
            ]
        return {
            "tokens": tokens,
            "token_logprobs": [float(e.get("logprob", 0.0)) for e in entries],
            "top_logprobs": tops,
            "text_offset": offsets,
        }

    def _alternatives(self, entry: dict[str, Any]) -> list[dict[str, Any]]:
        return list(entry.get("top_logprobs") or ())[: self.top]

    def _chat_entry(self, entry: dict[str, Any]) -> dict[str, Any]:
        out = _token(entry)
        out["top_logprobs"] = [_token(t) for t in self._alternatives(entry)]
        return out


def _token(entry: dict[str, Any]) -> dict[str, Any]:
    raw = entry.get("bytes")
    return {
        "token": str(entry.get("token", "")),
        "logprob": float(entry.get("logprob", 0.0)),
        "bytes": [int(b) for b in raw] if isinstance(raw, list) else None,
    }
