"""PURE: OpenAI response and chunk bodies for chat and text completions.

Kept apart from the routes so the exact shapes (the part clients parse) are tested
without a server.
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
        self, text: str, finish_reason: str | None, usage: dict[str, Any]
    ) -> dict[str, Any]:
        if self.kind == "chat":
            choice: dict[str, Any] = {
                "index": 0,
                "message": {"role": "assistant", "content": text, "refusal": None},
                "logprobs": None,
                "finish_reason": finish_reason,
            }
            body = self._head("chat.completion")
        else:
            choice = {"index": 0, "text": text, "logprobs": None, "finish_reason": finish_reason}
            body = self._head("text_completion")
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
    ) -> dict[str, Any]:
        """One streamed piece. Chat's first chunk carries the role; with include_usage every
        chunk has ``usage: null`` until the final usage chunk (as OpenAI sends them)."""
        if self.kind == "chat":
            delta: dict[str, Any] = {}
            if first:
                delta["role"] = "assistant"
            if text is not None:
                delta["content"] = text
            choice: dict[str, Any] = {"index": 0, "delta": delta}
            body = self._head("chat.completion.chunk")
        else:
            choice = {"index": 0, "text": text or ""}
            body = self._head("text_completion")
        choice["logprobs"] = None
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
