"""The one LLM request path in the server: a runner held, the engine's own events relayed.

Every chat and completion request, OpenAI's or Ollama's, streamed or not, goes the same way:

1. ``Relay.open``: the scheduler's claim on the model's runner (``Scheduler.use``), then
   ``runtime.engine_events.text_events``: the engine's ``open`` (slot chosen and restored,
   llama.cpp's request built) returns a ``TextTicket``, and the engine's OpenAI-shaped SSE
   events follow, read from the engine's own socket (or, for MLX and a node's runner, over
   the runner). The first events are read before any byte goes to the client, so errors
   that happen up front (unknown model, 507, queue full, a prompt over the context) keep
   their real HTTP status.
2. A rewriter turns the events into what the client reads. Each protocol supplies its own
   (``Relay.open`` takes a factory of ``Rewriter``; the relay imports no protocol):
   server/openai/rewriter.py ``OpenAIRewriter`` (chat chunks and completions: the model's
   name, cached_tokens in whole blocks, usage only when asked; logprobs in the client's
   shape, emulated tool calls parsed at the end, a transcript chat's completion events as
   chat chunks) or server/ollama/rewriter.py ``OllamaRewriter`` (NDJSON lines and the final
   object with Ollama's counts). Both assemble the answer with this module's ``Answer``.
   ``Relay.stream`` yields its bytes; ``Relay.collect`` feeds it the same events and
   returns the one answer of a non-streamed request.
3. ``Relay.release``, the one end of the request's lifetime, whatever ended it (done, the
   client gone, an error, hard memory pressure, the runner's death, a cancelled task): the
   engine connection closes (the engine cancels a generation whose reader left), the
   engine's ``close`` gives the slot back, the scheduler gets its runner back. Idempotent
   and shielded.

A preempted stream's continuation (server/stream/resume.py; docs/kvcache.md#preempt) is spliced in
``Relay._blocks``, the one place the engine's events are read: a resumable stream (a
streamed plain-text chat or completion) records the engine events it relays; when the
runner takes its slot for a request that needs its prefix, its events end with
``Preempted`` (the slot's state saved), and ``_blocks`` opens the continuation on another
slot with ``text_events`` and goes on with its events, the same id, no second opening
chunk, the usage fixed, so the rewriter reads one engine stream. Its ``aclose`` joins the
same exit stack: ``release`` stays the one end.
"""

from __future__ import annotations

import asyncio
import json
import logging
import time
from collections.abc import AsyncGenerator, AsyncIterator, Callable, Iterator
from contextlib import AsyncExitStack
from dataclasses import dataclass, field
from typing import Any, Protocol

import anyio
from starlette.requests import Request

from elbowroom.engines.llama import resumable, translate_error
from elbowroom.engines.llama_tools import parse as parse_tool_reply
from elbowroom.engines.requests import TextRequest, TextTicket
from elbowroom.errors import EngineError
from elbowroom.runtime.engine_events import Preempted, text_events
from elbowroom.server.http.metrics import record_tokens
from elbowroom.server.stream.resume import Resume
from elbowroom.server.stream.sse import ClientGone, unless_client_leaves

log = logging.getLogger("elbowroom.server")


class Scheduler(Protocol):
    def use(self, model: str, *, keep_alive: float | None = None) -> Any: ...


class Rewriter(Protocol):
    """Engine events -> the client's bytes (streamed) or its one answer (collected)."""

    done: bool  # the engine's [DONE] was seen

    def start(self) -> bytes: ...

    def feed(self, block: bytes) -> bytes:
        """Whole SSE events -> bytes for the client; an engine error event raises."""
        ...

    def error(self, err: BaseException) -> bytes: ...

    def answer(self) -> dict[str, Any]: ...


class Relay:
    """One LLM request from the runner claim to its release (module docstring)."""

    def __init__(
        self,
        model: str,
        stack: AsyncExitStack,
        events: AsyncGenerator[TextTicket | bytes, None],
        first: bytes,
        rewriter: Rewriter,
        runner: Any = None,
        resume: Resume | None = None,
    ) -> None:
        self.model = model
        self.rewriter = rewriter
        self._stack: AsyncExitStack | None = stack
        self._events = events
        self._first: bytes | None = first
        self._runner = runner  # for a continuation's ``open``
        self.resume = resume  # a resumable stream's state (server/stream/resume.py)

    @classmethod
    async def open(
        cls,
        scheduler: Scheduler,
        model: str,
        keep_alive: float | None,
        request: TextRequest,
        rewriter: Callable[[TextTicket], Rewriter],
    ) -> Relay:
        stack = AsyncExitStack()
        try:
            runner = await stack.enter_async_context(scheduler.use(model, keep_alive=keep_alive))
            resume = Resume(request) if resumable(request) else None
            events = text_events(runner, request, preemptible=resume is not None)
            stack.push_async_callback(events.aclose)  # the slot goes back before the runner
            ticket = await anext(events)
            first = await anext(events)
            if not isinstance(ticket, TextTicket) or not isinstance(first, bytes):
                raise EngineError(f"the engine's events began with {ticket!r}, {first!r}")
        except StopAsyncIteration:
            err = EngineError("the engine ended the request without a result")
            await _exit(stack, err)
            raise err from None
        except BaseException as exc:
            await _exit(stack, exc)
            raise
        if ticket.transcript:
            resume = None  # a transcript prompt has no assistant turn to prefill
        return cls(model, stack, events, first, rewriter(ticket), runner, resume)

    async def _blocks(self) -> AsyncIterator[bytes]:
        """The engine's events, until its [DONE] (the rewriter says when); a preempted
        stream's continuation spliced in (module docstring)."""
        first, self._first = self._first, None
        if first is not None:
            yield self._seam(first)
        while True:
            try:
                async for block in self._events:
                    assert isinstance(block, bytes)
                    yield self._seam(block)
            except Preempted as preempted:
                if self.resume is None or self.resume.resumed:
                    raise
                await self._continue(preempted)
                continue
            raise EngineError("the engine's stream ended without [DONE]")

    def _seam(self, block: bytes) -> bytes:
        """Engine events as one stream: recorded before a preemption, spliced after."""
        resume = self.resume
        if resume is None:
            return block
        if resume.resumed:
            return resume.splice(block)
        resume.record(block)
        return block

    async def _continue(self, preempted: Preempted) -> None:
        """Open the preempted stream's continuation (its slot's state was saved when the
        ticket went back): its events replace the preempted ones."""
        resume, stack = self.resume, self._stack
        assert resume is not None and stack is not None
        resume.preempt()
        resume.preempted_at = preempted.at
        resume.cached = preempted.cached
        continuation = resume.continuation(preempted.ticket)
        events = text_events(self._runner, continuation)  # a continuation is never preempted
        stack.push_async_callback(events.aclose)
        ticket = await anext(events)
        if not isinstance(ticket, TextTicket):
            raise EngineError(f"the continuation's events began with {ticket!r}")
        self._events = events
        log.info(
            "resumed a preempted stream on %s after %d tokens: stalled %.2f s",
            self.model,
            resume.produced,
            time.monotonic() - resume.preempted_at,
        )

    async def stream(self) -> AsyncIterator[bytes]:
        """The client's streamed body; the request is released when it ends (any way)."""
        failure: BaseException | None = None
        rewriter = self.rewriter
        try:
            head = rewriter.start()
            if head:
                yield head
            async for block in self._blocks():
                out = rewriter.feed(block)
                if out:
                    yield out
                if rewriter.done:
                    return
        except (GeneratorExit, asyncio.CancelledError):
            log.info("client went away mid-stream: cancelled a request on %s", self.model)
            raise
        except Exception as err:  # headers are gone: the error is the stream's last event
            failure = err
            yield rewriter.error(err)
        finally:
            await self.release(failure)

    async def _whole(self) -> dict[str, Any]:
        async for block in self._blocks():
            self.rewriter.feed(block)
            if self.rewriter.done:
                break
        return self.rewriter.answer()

    async def collect(self, request: Request) -> dict[str, Any] | None:
        """A non-streamed request's answer, released however it ends; None when the client
        left first (its generation is cancelled: answer with ``sse.gone_response``)."""
        try:
            done: dict[str, Any] = await unless_client_leaves(request, self._whole())
        except ClientGone:
            log.info("client went away before its answer: cancelled a request on %s", self.model)
            await self.release(None)
            return None
        except BaseException as exc:
            await self.release(exc)
            raise
        await self.release(None)
        return done

    async def release(self, failure: BaseException | None = None) -> None:
        """The one end of the request's lifetime: the engine connection and the slot, then
        the runner back to the scheduler. Idempotent, shielded (it runs while the request's
        task is being cancelled)."""
        stack, self._stack = self._stack, None
        if stack is not None:
            await _exit(stack, failure)


async def _exit(stack: AsyncExitStack, failure: BaseException | None) -> None:
    with anyio.CancelScope(shield=True):
        try:
            if failure is None:
                await stack.aclose()
            else:
                await stack.__aexit__(type(failure), failure, failure.__traceback__)
        except Exception:
            log.exception("error while releasing a request")


# ---- what every rewriter reads from the events ---------------------------------------------


def round_cached(cached: int, block: int) -> int:
    """cached_tokens in whole cache blocks, the one place they are rounded: exact counts
    would let one client probe, token by token, what another client's prompt began with."""
    return cached - cached % max(1, block)


@dataclass(slots=True)
class _Call:
    id: str = ""
    name: str = ""
    arguments: list[str] = field(default_factory=list)


@dataclass(slots=True)
class Piece:
    """What one engine event adds to the answer."""

    text: str = ""
    reasoning: str = ""
    calls: list[dict[str, Any]] = field(default_factory=list)  # OpenAI's streamed deltas
    logprobs: list[dict[str, Any]] = field(default_factory=list)  # OpenAI chat entries


@dataclass(slots=True)
class Answer:
    """The answer so far, assembled from the engine's events (chat- or completion-shaped:
    ``chat_events``), with its usage accounted once."""

    model: str
    chat_events: bool
    block: int
    pieces: list[str] = field(default_factory=list)
    reasoning: list[str] = field(default_factory=list)
    calls: dict[int, _Call] = field(default_factory=dict)
    logprobs: list[dict[str, Any]] = field(default_factory=list)
    finish_reason: str | None = None
    usage: dict[str, int] = field(default_factory=dict)
    timings: dict[str, Any] = field(default_factory=dict)

    def take(self, chunk: dict[str, Any]) -> Piece:
        if "error" in chunk:
            err = chunk["error"]
            raise translate_error(err if isinstance(err, dict) else {"message": str(err)})
        if isinstance(chunk.get("usage"), dict):
            self.account(chunk["usage"])
        if isinstance(chunk.get("timings"), dict):
            self.timings = chunk["timings"]
        piece = Piece()
        for choice in chunk.get("choices") or ():
            if choice.get("finish_reason"):
                self.finish_reason = str(choice["finish_reason"])
            self._choice(choice, piece)
        return piece

    def account(self, usage: dict[str, Any]) -> dict[str, int]:
        details = usage.get("prompt_tokens_details") or {}
        self.usage = {
            "prompt_tokens": int(usage.get("prompt_tokens", 0)),
            "completion_tokens": int(usage.get("completion_tokens", 0)),
            "cached_tokens": round_cached(int(details.get("cached_tokens", 0)), self.block),
        }
        record_tokens(self.model, self.usage)
        return self.usage

    def _choice(self, choice: dict[str, Any], piece: Piece) -> None:
        if self.chat_events:
            delta = choice.get("delta") or {}
            text = delta.get("content")
            if delta.get("reasoning_content"):
                piece.reasoning = str(delta["reasoning_content"])
                self.reasoning.append(piece.reasoning)
            for call in delta.get("tool_calls") or ():
                piece.calls.append(self._call(call))
        else:
            text = choice.get("text")
        if text:
            piece.text += str(text)
            self.pieces.append(str(text))
        lp = choice.get("logprobs")
        if isinstance(lp, dict) and lp.get("content"):
            piece.logprobs.extend(lp["content"])
            self.logprobs.extend(lp["content"])

    def _call(self, c: dict[str, Any]) -> dict[str, Any]:
        index = int(c.get("index", 0))
        call = self.calls.setdefault(index, _Call())
        out: dict[str, Any] = {"index": index}
        if c.get("id"):
            call.id = str(c["id"])
            out["id"] = call.id
            out["type"] = "function"
        fn = c.get("function") or {}
        part: dict[str, Any] = {}
        if fn.get("name"):
            call.name = part["name"] = str(fn["name"])
        if fn.get("arguments"):
            call.arguments.append(str(fn["arguments"]))
            part["arguments"] = str(fn["arguments"])
        out["function"] = part
        return out

    def result(self, emulated: bool) -> dict[str, Any]:
        """The whole answer: text, finish_reason, usage, tool calls, logprobs, reasoning,
        the engine's timings. Emulated tool calls are parsed from the whole reply here."""
        out: dict[str, Any] = {
            "text": "".join(self.pieces),
            "finish_reason": self.finish_reason or "stop",
            "usage": self.usage,
            "timings": self.timings,
        }
        calls = [
            {
                "id": call.id or f"call_{i}",
                "type": "function",
                "function": {"name": call.name, "arguments": "".join(call.arguments)},
            }
            for i, call in sorted(self.calls.items())
        ]
        if emulated:
            out["text"], calls = parse_tool_reply(out["text"])
        if calls:
            out["tool_calls"] = calls
            if out["finish_reason"] == "stop":
                out["finish_reason"] = "tool_calls"
        if self.logprobs:
            out["logprobs"] = self.logprobs
        if self.reasoning:
            out["reasoning"] = "".join(self.reasoning)
        return out


def parse_events(block: bytes) -> Iterator[dict[str, Any] | None]:
    """The JSON objects of a block of SSE events (None for [DONE])."""
    for event in block.split(b"\n\n"):
        if not event.startswith(b"data: "):
            continue
        data = event[6:]
        yield None if data == b"[DONE]" else json.loads(data)
