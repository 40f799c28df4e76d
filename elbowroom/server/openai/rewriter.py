"""The engine's events as OpenAI's chat chunks or completions: the rewriter the OpenAI
routes hand to the relay (server/stream/relay.py, ``Relay.open``)."""

from __future__ import annotations

import json
import re
from typing import Any

from elbowroom.engines.requests import TextTicket
from elbowroom.server.errors import public_error
from elbowroom.server.openai.shapes import Envelope, Logprobs
from elbowroom.server.stream.relay import Answer, Piece, parse_events
from elbowroom.server.stream.sse import DONE, sse

_MODEL = re.compile(rb'"model":"(?:[^"\\]|\\.)*"')
_PROGRESS = b'"prompt_progress"'


class OpenAIRewriter:
    """The engine's events as OpenAI's chat chunks or completions.

    A plain request (no logprobs, no emulated tools, no transcript) is relayed nearly byte
    for byte: the ``model`` field gets elbowroom's id, the usage event gets its
    cached_tokens rounded and loses the engine's ``timings``, and without
    ``stream_options.include_usage`` the usage is dropped. The others are rendered piece by
    piece with ``shapes.Envelope``: logprobs in the client's shape (chat's, or the legacy
    completions shape), a transcript chat's completion events as chat chunks, emulated tool
    calls (or the content object) parsed from the whole reply and sent as one chunk before
    the last, so a stream adds up to the whole answer."""

    def __init__(
        self,
        ticket: TextTicket,
        envelope: Envelope,
        include_usage: bool,
        view: Logprobs | None,
        *,
        streamed: bool,
    ) -> None:
        self.envelope = envelope
        self.include_usage = include_usage
        self.view = view
        self.emulated = ticket.emulated_tools
        chat_events = envelope.kind == "chat" and not ticket.transcript
        self.answered = Answer(envelope.model, chat_events, ticket.block_tokens)
        self.streamed = streamed
        self.plain = streamed and view is None and not self.emulated and not ticket.transcript
        self.done = False
        self.model_field = b'"model":' + json.dumps(envelope.model).encode()
        self.engine_model: bytes | None = None  # the engine's own "model" field, once seen

    def start(self) -> bytes:
        if self.plain or self.envelope.kind != "chat":
            return b""
        return sse(self.envelope.chunk("", first=True, include_usage=self.include_usage))

    def error(self, err: BaseException) -> bytes:
        return sse(public_error(err, f"stream on {self.envelope.model}").to_openai())

    def feed(self, block: bytes) -> bytes:
        if self.plain:
            return self._relayed(block)
        out = []
        for chunk in parse_events(block):
            if chunk is None:
                self.done = True
                if self.streamed:
                    out.append(self._ending())
                break
            piece = self.answered.take(chunk)
            if self.streamed:
                out.append(self._rendered(piece))
        return b"".join(out)

    # -- byte for byte

    def _relayed(self, block: bytes) -> bytes:
        if self.engine_model is None:
            found = _MODEL.search(block)
            if found is not None:
                self.engine_model = found.group(0)
        # No such key can occur unescaped inside a JSON string: a plain substring test is
        # exact, and the common event (one token) takes the fast path.
        if (
            b'"usage"' not in block
            and b'"error"' not in block
            and b"[DONE]" not in block
            and _PROGRESS not in block
        ):
            return self._renamed(block)
        out = []
        for event in block.split(b"\n\n"):
            if not event.startswith(b"data: "):
                continue
            data = event[6:]
            if data == b"[DONE]":
                out.append(DONE)
                self.done = True
                break
            if _PROGRESS in data:
                continue  # a prompt batch done (engines/llama.py asks for them): no news
            if b'"usage"' in data or b'"error"' in data:
                out.append(self._special(json.loads(data)))
                continue
            out.append(self._renamed(data).join((b"data: ", b"\n\n")))
        return b"".join(out)

    def _renamed(self, data: bytes) -> bytes:
        if self.engine_model is None:
            return data
        return data.replace(self.engine_model, self.model_field)

    def _special(self, chunk: dict[str, Any]) -> bytes:
        usage = chunk.get("usage")
        self.answered.take({k: v for k, v in chunk.items() if k != "choices"})
        chunk.pop("timings", None)
        if isinstance(usage, dict):
            details = usage.get("prompt_tokens_details")
            if isinstance(details, dict) and "cached_tokens" in details:
                details["cached_tokens"] = self.answered.usage["cached_tokens"]
        if not self.include_usage:
            chunk.pop("usage", None)
        if "model" in chunk:
            chunk["model"] = self.envelope.model
        if not chunk.get("choices") and "usage" not in chunk:
            return b""  # the usage-only event of a client that did not ask for usage
        return sse(chunk)

    # -- piece by piece

    def _rendered(self, piece: Piece) -> bytes:
        if self.emulated or not self.streamed_piece(piece):
            return b""
        view = self.view
        return sse(
            self.envelope.chunk(
                piece.text if piece.text or self.envelope.kind == "completion" else None,
                include_usage=self.include_usage,
                tool_calls=piece.calls or None,
                logprobs=view.render(piece.logprobs) if view and piece.logprobs else None,
                reasoning=piece.reasoning or None,
            )
        )

    def streamed_piece(self, piece: Piece) -> bool:
        return bool(piece.text or piece.calls or piece.reasoning or (piece.logprobs and self.view))

    def _ending(self) -> bytes:
        result = self.answered.result(self.emulated)
        env, include = self.envelope, self.include_usage
        out = []
        if self.emulated:  # the whole reply, parsed: its calls or its content, at the end
            calls = result.get("tool_calls")
            entries = result.get("logprobs") or []
            if calls or result["text"] or entries:
                out.append(
                    env.chunk(
                        result["text"] or (None if env.kind == "chat" else ""),
                        include_usage=include,
                        tool_calls=[{"index": i, **c} for i, c in enumerate(calls or ())] or None,
                        logprobs=self.view.render(entries) if self.view and entries else None,
                    )
                )
        out.append(env.chunk(None, result["finish_reason"], include_usage=include))
        if include:
            out.append(env.usage_chunk(result["usage"]))
        return b"".join(sse(c) for c in out) + DONE

    def answer(self) -> dict[str, Any]:
        result = self.answered.result(self.emulated)
        view = self.view
        return self.envelope.response(
            result["text"],
            result["finish_reason"],
            result["usage"],
            tool_calls=result.get("tool_calls"),
            logprobs=view.render(result.get("logprobs") or []) if view is not None else None,
            reasoning=result.get("reasoning"),
        )
