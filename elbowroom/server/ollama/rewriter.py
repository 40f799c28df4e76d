"""The engine's events as Ollama's NDJSON lines: the rewriter the Ollama text routes hand to
the relay (server/stream/relay.py, ``Relay.open``)."""

from __future__ import annotations

import json
import logging
from typing import Any

from elbowroom.engines.requests import TextTicket
from elbowroom.errors import ElbowroomError
from elbowroom.server.http.ollama_paths import error_body
from elbowroom.server.ollama.reply import Reply
from elbowroom.server.stream.relay import Answer, parse_events

log = logging.getLogger("elbowroom.server")


class OllamaRewriter:
    """The engine's events as Ollama's NDJSON lines (/api/chat, /api/generate): a line per
    piece of text, the tool calls, then the final object with Ollama's counts and durations
    (server/ollama/reply.py ``Reply``). Collected: the one final object with the whole text."""

    def __init__(self, ticket: TextTicket, reply: Reply, kind: str, model_id: str) -> None:
        self.reply = reply
        self.emulated = ticket.emulated_tools
        chat_events = kind == "chat" and not ticket.transcript  # /api/generate may be a chat
        self.answered = Answer(model_id, chat_events, ticket.block_tokens)
        self.done = False

    def start(self) -> bytes:
        return b""

    def error(self, err: BaseException) -> bytes:
        if isinstance(err, ElbowroomError):
            return _line(error_body(err))
        log.error("unexpected error while streaming", exc_info=err)
        return _line({"error": "The server had an unexpected error; it has been logged."})

    def feed(self, block: bytes) -> bytes:
        out = []
        for chunk in parse_events(block):
            if chunk is None:
                self.done = True
                result = self.answered.result(self.emulated)
                if self.emulated and result["text"]:
                    line = self.reply.chunk({"text": result["text"]})
                    if line is not None:
                        out.append(_line(line))
                tools = self.reply.tool_chunk(result)
                if tools is not None:
                    out.append(_line(tools))
                out.append(_line(self.reply.final(result, include_text=False)))
                break
            piece = self.answered.take(chunk)
            if self.emulated:
                continue
            line = self.reply.chunk({"text": piece.text, "logprobs": piece.logprobs})
            if line is not None:
                out.append(_line(line))
        return b"".join(out)

    def answer(self) -> dict[str, Any]:
        result = self.answered.result(self.emulated)
        final: dict[str, Any] = self.reply.final(result, include_text=True)
        return final


def _line(obj: dict[str, Any]) -> bytes:
    return json.dumps(obj, separators=(",", ":")).encode() + b"\n"
