"""Preempt and resume: a relayed stream whose slot another request needs, continued on
another slot without the client noticing (issue 21, item 6; docs/kvcache.md#preempt).

Why: llama.cpp keeps a prompt's KV state only in the slot that computed it, and cannot copy
a busy slot's state. A client that reads a stream to its first token and drops it without
closing it (``return`` inside ``for chunk in stream``) leaves its answer running, and the
server cannot tell it from a slow reader (the answer fits in the socket buffers). Its next
request with the same long prefix found the prefix only in that busy slot and recomputed it
(~50x slower than a hit here).

The protocol (runner side: engines/llama.py ``_preempt``, engines/llama_slots.py
``Slots.acquire``; server side: this module, runtime/engine_events.py and
server/stream/relay.py ``Relay._blocks``):

1. A request whose best prefix is a busy slot, worth at least ``MIN_PREEMPT_S`` of
   recompute, asks the engine to preempt that slot's stream. The engine does so when a
   *resumable* relayed stream (engines/llama.py ``resumable``) holds the slot and has
   decoded a token; it sends the notice ``{"preempt": ticket, "cached": n}`` (n: the prompt
   tokens the engine reused for that stream's request; runner -> server, the
   worker's ``notice`` event, runtime/supervisor.py ``watch_notices``), and the slot is
   claimed for the waiting request.
2. The stream's engine connection (runtime/engine_events.py ``EngineConnection.on_notice``)
   closes (the engine cancels the task) and gives the ticket back with
   ``CloseTicket.resume`` (the slot comes free: the waiting request takes it and reuses
   the prefix); its read raises ``Preempted``, and the relay (``Relay._blocks``) opens the
   continuation: the same request with
   what the client has already received appended (an assistant prefill for chat, the
   prompt's tail for completions), ``max_tokens`` less the tokens sent, ``resumed=<the
   preempted ticket>`` (it takes a free slot at once, and is never preempted again). The
   runner saved the preempted slot's state (the engine's slot save, into its private slot
   folder) when the ticket was given back, before the waiting request got the slot, and
   restores it into the continuation's slot: only the seam is computed again, not the
   prompt. The continuation's open waits, before any of its own work, until the request
   that took the slot has decoded its first token (engines/llama.py ``_handoff``, at most
   ``HANDOFF_WAIT_S``).
3. The continuation's engine events join the same stream before any rewriter sees them:
   its ``id`` is rewritten to the first one's, its opening role-only chunk is dropped,
   and its usage counts the tokens sent before the preemption as completion tokens (not
   prompt tokens). The rewriter (OpenAI's or Ollama's) reads one engine stream.

``Resume`` is the state one stream keeps for this; it works on the engine's own events,
and nothing here talks to a socket.
"""

from __future__ import annotations

import dataclasses
import json
import re
import time
from typing import Any

from elbowroom.engines.requests import TextRequest

_ID = re.compile(rb'"id":"(?:[^"\\]|\\.)*"')


class Resume:
    """What a resumable relayed stream keeps so it can be continued after a preemption."""

    def __init__(self, request: TextRequest) -> None:
        self.request = request
        self.sent: list[bytes] = []  # the engine's events relayed so far (until the preemption)
        self.stream_id: bytes | None = None  # the first engine stream's ``"id":"..."``
        self.preempted = False  # the engine asked for the slot: resume when the read breaks
        self.resumed = False  # the continuation is being relayed
        self.produced = 0  # tokens the client had before the preemption
        self.preempted_at = 0.0
        self.stall_s: float | None = None  # preemption -> the continuation's first event
        # Prompt tokens the engine reused for the preempted request (the runner's notice):
        # the continuation restores the whole prompt, which is not this request's reuse.
        self.cached: int | None = None
        # Whitespace the client has that the chat template trims from an assistant prefill:
        # the model writes it again, and the seam drops it once (no doubled newline).
        self.skip = ""

    def record(self, out: bytes) -> None:
        """Engine events just relayed (whole SSE events)."""
        if self.resumed:
            return
        if self.stream_id is None:
            found = _ID.search(out)
            if found is not None:
                self.stream_id = found.group(0)
        self.sent.append(out)

    def preempt(self) -> None:
        self.preempted = True
        self.preempted_at = time.monotonic()

    def continuation(self, ticket: int) -> TextRequest:
        """The request that produces the rest of the answer of the preempted ``ticket``."""
        text, self.produced = sent_text(b"".join(self.sent), chat=self.request.kind == "chat")
        self.sent = []
        self.resumed = True
        req = self.request
        left = max(1, req.max_tokens - self.produced)
        if req.kind == "chat":
            kept = text.rstrip()
            self.skip = text[len(kept) :]
            prefill = {"role": "assistant", "content": kept}
            return dataclasses.replace(
                req, messages=(*req.messages, prefill), max_tokens=left, resumed=ticket
            )
        return dataclasses.replace(req, prompt=req.prompt + text, max_tokens=left, resumed=ticket)

    def splice(self, out: bytes) -> bytes:
        """The continuation's events as the client's stream goes on: the first id, no
        second opening (role-only) chunk."""
        if self.stall_s is None:
            self.stall_s = time.monotonic() - self.preempted_at
        events = []
        for event in out.split(b"\n\n"):
            if not event:
                continue
            if event.startswith(b"data: {") and _opening(event[6:]):
                continue
            if self.stream_id is not None:
                event = _ID.sub(lambda _: self.stream_id or b"", event, count=1)
            if self.skip and event.startswith(b"data: {"):
                event = self._skipped(event)
            if b'"usage"' in event and event.startswith(b"data: {"):
                event = self._fixed_usage(event)
            events.append(event + b"\n\n")
        return b"".join(events)

    def _skipped(self, event: bytes) -> bytes:
        """``event`` without the part of ``skip`` its content starts with (the trimmed
        whitespace written again); ``skip`` ends at the first content that differs."""
        try:
            chunk = json.loads(event[6:])
        except ValueError:
            return event
        for choice in chunk.get("choices") or ():
            delta = choice.get("delta") if isinstance(choice, dict) else None
            if not isinstance(delta, dict):
                continue
            content = delta.get("content")
            if not isinstance(content, str) or not content:
                continue
            same = 0
            while same < min(len(content), len(self.skip)) and content[same] == self.skip[same]:
                same += 1
            delta["content"] = content[same:]
            self.skip = self.skip[same:] if same == len(content) else ""
            return b"data: " + json.dumps(chunk, separators=(",", ":")).encode()
        return event

    def _fixed_usage(self, event: bytes) -> bytes:
        try:
            chunk = json.loads(event[6:])
        except ValueError:
            return event
        usage = chunk.get("usage")
        if not isinstance(usage, dict):
            return event
        self.fix_usage(usage)
        return b"data: " + json.dumps(chunk, separators=(",", ":")).encode()

    def fix_usage(self, usage: dict[str, Any]) -> None:
        """The continuation's usage as the whole answer's: the tokens sent before the
        preemption were generated, not prompt (a re-tokenized seam can differ by one), and
        the cached prompt tokens are the preempted request's (the continuation's restore of
        its own state is not a reuse the client's request got)."""
        if not self.resumed:
            return
        if self.produced:
            prompt = int(usage.get("prompt_tokens", 0))
            completion = int(usage.get("completion_tokens", 0))
            usage["prompt_tokens"] = max(0, prompt - self.produced)
            usage["completion_tokens"] = completion + self.produced
            usage["total_tokens"] = usage["prompt_tokens"] + usage["completion_tokens"]
        details = usage.get("prompt_tokens_details")
        if isinstance(details, dict) and "cached_tokens" in details:
            cached = int(details["cached_tokens"]) if self.cached is None else self.cached
            details["cached_tokens"] = min(cached, int(usage.get("prompt_tokens", 0)))


def sent_text(raw: bytes, *, chat: bool) -> tuple[str, int]:
    """The answer text in relayed SSE bytes, and the events that carried text (tokens)."""
    parts: list[str] = []
    for event in raw.split(b"\n\n"):
        if not event.startswith(b"data: {"):
            continue
        try:
            chunk = json.loads(event[6:])
        except ValueError:
            continue
        for choice in chunk.get("choices") or ():
            piece = (choice.get("delta") or {}).get("content") if chat else choice.get("text")
            if isinstance(piece, str) and piece:
                parts.append(piece)
    return "".join(parts), len(parts)


def _opening(data: bytes) -> bool:
    """A chat stream's first chunk: the role, no content, no finish."""
    if b'"role"' not in data:
        return False
    try:
        chunk = json.loads(data)
    except ValueError:
        return False
    choices = chunk.get("choices") or ()
    return bool(choices) and all(
        not (c.get("delta") or {}).get("content")
        and not (c.get("delta") or {}).get("tool_calls")
        and c.get("finish_reason") is None
        for c in choices
    )
