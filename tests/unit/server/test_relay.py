"""The one LLM request path (server/stream/relay.py, runtime/engine_events.py) against a scripted
engine on a real Unix socket: the rewriters (OpenAI byte for byte, logprobs, emulated tool
calls, a transcript chat, Ollama NDJSON), chunk boundaries, errors before and after the
first token, and one release whatever ends the request: the engine connection closed, the
slot given back (with the timings), the runner back to the scheduler. The real engine is
in tests/e2e."""

from __future__ import annotations

import asyncio
import json
from collections.abc import AsyncIterator, Callable
from contextlib import asynccontextmanager
from pathlib import Path
from typing import Any

import pytest

from elbowroom.engines.requests import CloseTicket, Payload, TextRequest, TextTicket
from elbowroom.errors import ContextOverflow
from elbowroom.server.ollama.reply import Reply, Timing
from elbowroom.server.ollama.rewriter import OllamaRewriter
from elbowroom.server.openai.rewriter import OpenAIRewriter
from elbowroom.server.openai.shapes import Envelope, Logprobs
from elbowroom.server.stream.relay import Relay, Rewriter

ENGINE_MODEL = "/models/SmolLM2.gguf"
MODEL = "smollm2-135m"


def _event(obj: dict[str, Any]) -> bytes:
    return b"data: " + json.dumps(obj, separators=(",", ":")).encode() + b"\n\n"


def _chunk(choice: dict[str, Any], obj: str = "chat.completion.chunk") -> bytes:
    return _event({"choices": [choice], "id": "x-1", "model": ENGINE_MODEL, "object": obj})


def _token(text: str, logprob: float | None = None) -> bytes:
    choice: dict[str, Any] = {"finish_reason": None, "index": 0, "delta": {"content": text}}
    if logprob is not None:
        entry = {"token": text, "logprob": logprob, "bytes": list(text.encode())}
        choice["logprobs"] = {"content": [{**entry, "top_logprobs": [entry]}]}
    return _chunk(choice)


def _text(text: str, logprob: float | None = None) -> bytes:
    """A completion-shaped event (/v1/completions: a completion, or a transcript chat)."""
    choice: dict[str, Any] = {"finish_reason": None, "index": 0, "text": text}
    if logprob is not None:
        entry = {"token": text, "logprob": logprob}
        choice["logprobs"] = {"content": [{**entry, "top_logprobs": [entry]}]}
    return _chunk(choice, "text_completion")


def _finish(reason: str = "length", chat: bool = True) -> bytes:
    choice: dict[str, Any] = {"finish_reason": reason, "index": 0}
    choice.update({"delta": {}} if chat else {"text": ""})
    return _chunk(choice)


USAGE = _event(
    {
        "choices": [],
        "id": "x-1",
        "model": ENGINE_MODEL,
        "object": "chat.completion.chunk",
        "usage": {
            "completion_tokens": 2,
            "prompt_tokens": 200,
            "total_tokens": 202,
            "prompt_tokens_details": {"cached_tokens": 199},
        },
        "timings": {"cache_n": 199, "prompt_n": 1, "prompt_ms": 5.0, "predicted_n": 2},
    }
)
PROGRESS = _event(
    {
        "choices": [{"text": "", "index": 0, "finish_reason": None}],
        "model": ENGINE_MODEL,
        "prompt_progress": {"total": 900, "cache": 0, "processed": 512, "time_ms": 9.0},
    }
)
DONE = b"data: [DONE]\n\n"
TIMINGS = {"cache_n": 199, "prompt_n": 1, "prompt_ms": 5.0, "predicted_n": 2}


class Engine:
    """A Unix-socket HTTP server that answers one scripted response per connection."""

    def __init__(self, path: Path, status: int, pieces: list[bytes], hold: bool = False) -> None:
        self.path = path
        self.status = status
        self.pieces = pieces
        self.hold = hold  # keep the stream open after the pieces (until the client leaves)
        self.requests: list[dict[str, Any]] = []
        self.closed = asyncio.Event()

    async def handle(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        head = await reader.readuntil(b"\r\n\r\n")
        length = int(head.lower().split(b"content-length: ")[1].split(b"\r\n")[0])
        self.requests.append(
            {"head": head.decode(), "body": json.loads(await reader.readexactly(length))}
        )
        if self.status != 200:
            body = self.pieces[0]
            writer.write(
                f"HTTP/1.1 {self.status} -\r\nContent-Type: application/json\r\n"
                f"Content-Length: {len(body)}\r\nConnection: close\r\n\r\n".encode()
                + body
            )
        else:
            writer.write(
                b"HTTP/1.1 200 OK\r\nContent-Type: text/event-stream\r\n"
                b"Transfer-Encoding: chunked\r\nConnection: close\r\n\r\n"
            )
            for piece in self.pieces:
                writer.write(b"%x\r\n%s\r\n" % (len(piece), piece))
                await writer.drain()
            if self.hold:
                await reader.read()  # until the relay closes the connection
            else:
                writer.write(b"0\r\n\r\n")
        await writer.drain()
        writer.close()
        self.closed.set()


class Spec:
    id = MODEL


class Runner:
    """The runner's side: ``open`` hands out the ticket (the slot held), ``close`` gives the
    slot back; pressure watchers and exit causes as runtime/supervisor.py has them."""

    spec = Spec()

    def __init__(self, socket: Path, ticket: dict[str, Any]) -> None:
        self.socket = socket
        self.ticket = ticket
        self.closed: list[CloseTicket] = []
        self.watchers: set[Callable[[int], None]] = set()
        self.exit_cause: str | None = None

    async def exit_within(self, timeout: float) -> str | None:
        return self.exit_cause

    async def request(self, kind: str, payload: Payload) -> AsyncIterator[dict[str, Any]]:
        if kind == "open":
            assert isinstance(payload, TextRequest)
            ticket = TextTicket(
                ticket=7,
                socket=str(self.socket),
                key="k3y",
                path="/v1/chat/completions",
                body={"messages": list(payload.messages), "stream": True},
                block_tokens=64,
                **self.ticket,
            )
            yield {"type": "done", "ticket": ticket}
        else:
            assert kind == "close" and isinstance(payload, CloseTicket)
            self.closed.append(payload)
            yield {"type": "done", "closed": True}

    def watch_pressure(self, watcher: Callable[[int], None]) -> Callable[[], None]:
        self.watchers.add(watcher)
        return lambda: self.watchers.discard(watcher)


class Scheduler:
    def __init__(self, runner: Runner) -> None:
        self.runner = runner
        self.released: list[BaseException | None] = []

    @asynccontextmanager
    async def use(self, model: str, *, keep_alive: float | None = None) -> AsyncIterator[Any]:
        try:
            yield self.runner
        except BaseException as exc:
            self.released.append(exc)
            raise
        else:
            self.released.append(None)


Make = Callable[[TextTicket], Rewriter]


def openai(
    kind: str = "chat", include_usage: bool = True, top: int | None = None, streamed: bool = True
) -> Make:
    envelope = Envelope.new(kind, MODEL, 1)  # type: ignore[arg-type]
    view = Logprobs(kind, top) if top is not None else None  # type: ignore[arg-type]
    return lambda ticket: OpenAIRewriter(ticket, envelope, include_usage, view, streamed=streamed)


class Run:
    def __init__(self, engine: Engine, runner: Runner, scheduler: Scheduler) -> None:
        self.engine = engine
        self.runner = runner
        self.scheduler = scheduler
        self.body = b""


def relay(
    tmp_path: Path,
    pieces: list[bytes],
    make: Make | None = None,
    *,
    status: int = 200,
    hold: bool = False,
    ticket: dict[str, Any] | None = None,
    on_first: Callable[[Runner], None] | None = None,
    request: TextRequest | None = None,
) -> Run:
    async def go() -> Run:
        sock = tmp_path / "engine.sock"
        engine = Engine(sock, status, pieces, hold)
        server = await asyncio.start_unix_server(engine.handle, path=str(sock))
        runner = Runner(sock, ticket or {})
        run = Run(engine, runner, Scheduler(runner))
        text = request or TextRequest(
            kind="chat", messages=({"role": "user"},), max_tokens=8, stream=True
        )
        try:
            r = await Relay.open(run.scheduler, MODEL, None, text, make or openai())
            out = []
            async for piece in r.stream():
                out.append(piece)
                if on_first is not None and len(out) == 1:
                    on_first(runner)
            run.body = b"".join(out)
            await asyncio.wait_for(engine.closed.wait(), 30)
            return run
        finally:
            server.close()
            await server.wait_closed()

    return asyncio.run(go())


def events(body: bytes) -> list[Any]:
    return [
        json.loads(e[6:]) if e != b"data: [DONE]" else "[DONE]"
        for e in body.split(b"\n\n")
        if e.startswith(b"data: ")
    ]


def released_once(run: Run) -> bool:
    """The one release: the slot back (once) and the runner back to the scheduler (once)."""
    return len(run.runner.closed) == 1 and len(run.scheduler.released) == 1


def test_a_plain_stream_is_relayed_renamed_with_rounded_usage(tmp_path: Path) -> None:
    # Events split across chunk boundaries and several events in one chunk.
    stream = _token("Hel") + PROGRESS + _token("lo") + _finish() + USAGE + DONE
    run = relay(tmp_path, [stream[:10], stream[10:150], stream[150:]])
    got = events(run.body)
    assert got[-1] == "[DONE]"
    chunks = got[:-1]
    assert "".join(c["choices"][0]["delta"].get("content", "") for c in chunks[:2]) == "Hello"
    assert all("prompt_progress" not in c for c in chunks)  # progress events are no news
    assert {c["model"] for c in chunks} == {MODEL}  # never the engine's file path
    usage = chunks[-1]["usage"]
    assert usage["prompt_tokens_details"]["cached_tokens"] == 192  # 199 down to 64-blocks
    assert "timings" not in chunks[-1]
    # The engine got the runner's request with its key; the slot went back with the timings.
    assert "Authorization: Bearer k3y" in run.engine.requests[0]["head"]
    assert run.runner.closed == [CloseTicket(7, TIMINGS)]
    assert run.scheduler.released == [None] and not run.runner.watchers


def test_without_include_usage_the_usage_event_is_dropped(tmp_path: Path) -> None:
    run = relay(tmp_path, [_token("Hi") + _finish() + USAGE + DONE], openai(include_usage=False))
    got = events(run.body)
    assert got[-1] == "[DONE]"
    assert all("usage" not in e for e in got[:-1])
    assert got[-2]["choices"][0]["finish_reason"] == "length"
    closed = run.runner.closed[0].timings
    assert closed is not None and closed["prompt_n"] == 1  # still read for the cost model


def test_an_engine_refusal_before_the_first_token_keeps_its_status(tmp_path: Path) -> None:
    refusal = json.dumps(
        {
            "error": {
                "code": 400,
                "message": "request (431 tokens) exceeds the available context size",
                "type": "exceed_context_size_error",
                "n_prompt_tokens": 431,
                "n_ctx": 256,
            }
        }
    ).encode()
    holder: list[Run] = []

    def keep(ticket: TextTicket) -> Rewriter:
        raise AssertionError("no rewriter: the request failed before its first event")

    with pytest.raises(ContextOverflow) as info:
        holder.append(relay(tmp_path, [refusal], keep, status=400))
    assert "431 tokens" in str(info.value) and "256" in str(info.value)


def test_an_error_mid_stream_is_the_last_event_and_everything_goes_back(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    err = _event({"error": {"code": 500, "message": "decode failed", "type": "server_error"}})
    run = relay(tmp_path, [_token("a"), err])
    got = events(run.body)
    assert got[0]["choices"][0]["delta"]["content"] == "a"
    # An engine failure is an internal error: its text goes to the log under an error id.
    assert "error id" in got[-1]["error"]["message"]
    assert "decode failed" in caplog.text
    assert released_once(run) and run.scheduler.released[0] is not None


def test_a_stream_that_breaks_off_is_an_error_event(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    run = relay(tmp_path, [_token("a")])  # no [DONE]
    assert "error id" in events(run.body)[-1]["error"]["message"]
    assert "stream broke off" in caplog.text
    assert released_once(run)


def test_a_runner_that_dies_mid_stream_is_reported_as_a_crash(tmp_path: Path) -> None:
    def kill(runner: Runner) -> None:
        runner.exit_cause = "killed by signal SIGKILL"

    run = relay(tmp_path, [_token("a")], on_first=kill)
    err = events(run.body)[-1]["error"]
    assert "died (killed by signal SIGKILL)" in err["message"]
    assert released_once(run)


def test_hard_pressure_aborts_and_closes_the_engine_connection(tmp_path: Path) -> None:
    def squeeze(runner: Runner) -> None:
        for watcher in list(runner.watchers):
            watcher(1)  # soft: nothing happens
            watcher(2)  # hard: aborted

    run = relay(tmp_path, [_token("a"), _token("b")], hold=True, on_first=squeeze)
    last = events(run.body)[-1]
    assert last["error"]["type"] == "memory_pressure"
    assert run.engine.closed.is_set()  # the engine saw its reader leave: it stops generating
    assert released_once(run) and not run.runner.watchers


def test_a_client_gone_before_the_first_byte_releases_everything(tmp_path: Path) -> None:
    """Starlette may never iterate the body (the client left first): ``release`` alone
    (ManagedStream calls it) closes the engine connection and gives everything back."""

    async def go() -> Run:
        sock = tmp_path / "engine.sock"
        engine = Engine(sock, 200, [_token("a")], hold=True)
        server = await asyncio.start_unix_server(engine.handle, path=str(sock))
        runner = Runner(sock, {})
        run = Run(engine, runner, Scheduler(runner))
        try:
            text = TextRequest(kind="chat", max_tokens=8, stream=True)
            r = await Relay.open(run.scheduler, MODEL, None, text, openai())
            await r.release()
            # Given back by release itself, not later by the garbage collector.
            assert len(runner.closed) == 1 and run.scheduler.released == [None]
            await r.release()  # idempotent
            await asyncio.wait_for(engine.closed.wait(), 30)
            return run
        finally:
            server.close()
            await server.wait_closed()

    run = asyncio.run(go())
    assert released_once(run) and run.scheduler.released == [None]


class _Idle:
    """A client that waits for its answer (never disconnects)."""

    async def receive(self) -> dict[str, Any]:
        await asyncio.Event().wait()
        return {}


def collected(tmp_path: Path, pieces: list[bytes], make: Make, **kw: Any) -> tuple[Any, Run]:
    async def go() -> tuple[Any, Run]:
        from starlette.requests import Request

        sock = tmp_path / "engine.sock"
        engine = Engine(sock, 200, pieces)
        server = await asyncio.start_unix_server(engine.handle, path=str(sock))
        runner = Runner(sock, kw.get("ticket") or {})
        run = Run(engine, runner, Scheduler(runner))
        try:
            text = kw.get("request") or TextRequest(kind="chat", max_tokens=8)
            r = await Relay.open(run.scheduler, MODEL, None, text, make)
            request = Request({"type": "http", "method": "POST"}, _Idle().receive)
            return await r.collect(request), run
        finally:
            server.close()
            await server.wait_closed()

    return asyncio.run(go())


def test_a_non_streamed_answer_is_the_same_events_collected(tmp_path: Path) -> None:
    stream = _token("Hel") + _token("lo") + _finish("stop") + USAGE + DONE
    got, run = collected(tmp_path, [stream], openai(streamed=False))
    assert run.engine.requests[0]["body"]["stream"] is True  # the engine always streams
    assert got["object"] == "chat.completion" and got["model"] == MODEL
    assert got["choices"][0]["message"] == {
        "role": "assistant",
        "content": "Hello",
        "refusal": None,
    }
    assert got["choices"][0]["finish_reason"] == "stop" and got["choices"][0]["logprobs"] is None
    assert got["usage"]["prompt_tokens_details"]["cached_tokens"] == 192
    assert run.runner.closed == [CloseTicket(7, TIMINGS)] and run.scheduler.released == [None]


def test_completion_logprobs_are_rendered_in_the_legacy_shape(tmp_path: Path) -> None:
    stream = _text("Hel", -0.1) + _text("lo", -0.2) + _finish(chat=False) + USAGE + DONE
    request = TextRequest(kind="completion", prompt="x", max_tokens=8, logprobs=1, stream=True)
    run = relay(tmp_path, [stream], openai("completion", top=0), request=request)
    chunks = [c for c in events(run.body)[:-1] if c["choices"] and c["choices"][0]["logprobs"]]
    lps = [c["choices"][0]["logprobs"] for c in chunks]
    assert [t for lp in lps for t in lp["tokens"]] == ["Hel", "lo"]
    assert [o for lp in lps for o in lp["text_offset"]] == [0, 3]  # across the chunks
    assert all(lp["top_logprobs"] is None for lp in lps)  # logprobs=0: no alternatives
    assert {c["model"] for c in chunks} == {MODEL}


def test_emulated_tool_calls_are_parsed_from_the_whole_reply(tmp_path: Path) -> None:
    reply = '{"name": "get_weather", "arguments": {"city": "Oslo"}}'
    stream = _token(reply[:20]) + _token(reply[20:]) + _finish("stop") + USAGE + DONE
    run = relay(tmp_path, [stream], ticket={"emulated_tools": True})
    chunks = events(run.body)[:-1]
    assert chunks[0]["choices"][0]["delta"] == {"role": "assistant", "content": ""}
    # The JSON text never reaches the client: one chunk with the call, then the finish.
    calls = [c for c in chunks if c["choices"] and c["choices"][0]["delta"].get("tool_calls")]
    assert len(calls) == 1
    (call,) = calls[0]["choices"][0]["delta"]["tool_calls"]
    assert call["function"] == {"name": "get_weather", "arguments": '{"city": "Oslo"}'}
    assert all("get_weather" not in (c["choices"][0]["delta"].get("content") or "")
               for c in chunks if c["choices"])  # fmt: skip
    finish = [c["choices"][0]["finish_reason"] for c in chunks if c["choices"]]
    assert finish[-1] == "tool_calls"


def test_an_emulated_answer_without_a_call_is_its_content(tmp_path: Path) -> None:
    stream = _token('{"content": "Hi!"}') + _finish("stop") + USAGE + DONE
    got, _ = collected(tmp_path, [stream], openai(streamed=False), ticket={"emulated_tools": True})
    message = got["choices"][0]["message"]
    assert message["content"] == "Hi!" and "tool_calls" not in message
    assert got["choices"][0]["finish_reason"] == "stop"


def test_a_transcript_chat_answers_chat_chunks_from_completion_events(tmp_path: Path) -> None:
    stream = _text("Par") + _text("is") + _finish(chat=False) + USAGE + DONE
    run = relay(tmp_path, [stream], ticket={"transcript": True})
    chunks = events(run.body)[:-1]
    assert all(c["object"] == "chat.completion.chunk" for c in chunks)
    assert chunks[0]["choices"][0]["delta"]["role"] == "assistant"
    text = "".join(c["choices"][0]["delta"].get("content") or "" for c in chunks if c["choices"])
    assert text == "Paris"
    assert chunks[-1]["usage"]["prompt_tokens_details"]["cached_tokens"] == 192


def ollama(chat: bool = True, kind: str = "chat") -> Make:
    reply = Reply("smollm2-135m:latest", chat=chat, timing=Timing(0, 0, True))
    return lambda ticket: OllamaRewriter(ticket, reply, kind, MODEL)


def test_ollama_lines_from_the_engine_events(tmp_path: Path) -> None:
    stream = _token("Hel", -0.1) + _token("lo", -0.2) + _finish("length") + USAGE + DONE
    run = relay(tmp_path, [stream], ollama())
    lines = [json.loads(line) for line in run.body.splitlines()]
    assert [line["message"]["content"] for line in lines[:-1]] == ["Hel", "lo"]
    assert not any(line["done"] for line in lines[:-1])
    final = lines[-1]
    assert final["model"] == "smollm2-135m:latest" and final["done"] is True
    assert final["done_reason"] == "length" and final["message"]["content"] == ""
    assert final["prompt_eval_count"] == 200 and final["eval_count"] == 2
    assert final["prompt_eval_duration"] == 5_000_000
    assert released_once(run)


def test_ollama_generate_collected_with_emulated_calls(tmp_path: Path) -> None:
    reply = '{"name": "get_weather", "arguments": {"city": "Oslo"}}'
    stream = _token(reply) + _finish("stop") + USAGE + DONE
    got, run = collected(tmp_path, [stream], ollama(), ticket={"emulated_tools": True})
    assert got["done"] is True and got["message"]["content"] == ""
    (call,) = got["message"]["tool_calls"]
    assert call["function"]["name"] == "get_weather"
    assert call["function"]["arguments"] == {"city": "Oslo"}
    assert released_once(run)


# ---- preempt and resume: the continuation spliced in (server/stream/resume.py) -----------


def _delta(sid: str, content: str | None, role: bool = False) -> bytes:
    delta: dict[str, Any] = {"content": content}
    if role:
        delta["role"] = "assistant"
    choice = {"finish_reason": None, "index": 0, "delta": delta}
    return _event({"choices": [choice], "id": sid, "model": ENGINE_MODEL})


class SeamEngine(Engine):
    """One scripted response per connection, in turn: the preempted stream, then its
    continuation."""

    def __init__(self, path: Path, scripts: list[tuple[list[bytes], bool]]) -> None:
        super().__init__(path, 200, [])
        self.scripts = scripts

    async def handle(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        self.closed.clear()
        self.pieces, self.hold = self.scripts[len(self.requests)]
        await super().handle(reader, writer)


class NoticeRunner(Runner):
    """A runner whose engine preempts: tickets 7, 8, ... and the notice watchers."""

    def __init__(self, socket: Path) -> None:
        super().__init__(socket, {})
        self.opened: list[TextRequest] = []
        self.notice_watchers: set[Callable[[dict[str, Any]], None]] = set()

    def watch_notices(self, watcher: Callable[[dict[str, Any]], None]) -> Callable[[], None]:
        self.notice_watchers.add(watcher)
        return lambda: self.notice_watchers.discard(watcher)

    async def request(self, kind: str, payload: Payload) -> AsyncIterator[dict[str, Any]]:
        if kind == "open":
            assert isinstance(payload, TextRequest)
            self.opened.append(payload)
            ticket = TextTicket(
                ticket=6 + len(self.opened),
                socket=str(self.socket),
                key="k3y",
                path="/v1/chat/completions",
                body={"messages": list(payload.messages), "stream": True},
                block_tokens=64,
            )
            yield {"type": "done", "ticket": ticket}
        else:
            async for item in super().request(kind, payload):
                yield item


def preempted(tmp_path: Path, make: Make) -> tuple[bytes, NoticeRunner, Scheduler]:
    """A stream preempted after "Hel" "lo" (ticket 7), continued as ticket 8: " world"."""
    usage = {
        "completion_tokens": 3,
        "prompt_tokens": 202,  # the prompt's 200 + the 2 tokens prefilled
        "total_tokens": 205,
        "prompt_tokens_details": {"cached_tokens": 201},
    }
    first = _delta("x-1", None, role=True) + _delta("x-1", "Hel") + _delta("x-1", "lo")
    more = [
        _delta("x-2", None, role=True)
        + _delta("x-2", " world")
        + _event({"choices": [{"finish_reason": "length", "index": 0, "delta": {}}], "id": "x-2"})
        + _event({"choices": [], "id": "x-2", "model": ENGINE_MODEL, "usage": usage})
        + DONE
    ]

    async def go() -> tuple[bytes, NoticeRunner, Scheduler]:
        sock = tmp_path / "engine.sock"
        engine = SeamEngine(sock, [([first], True), (more, False)])
        server = await asyncio.start_unix_server(engine.handle, path=str(sock))
        runner = NoticeRunner(sock)
        scheduler = Scheduler(runner)
        text = TextRequest(kind="chat", messages=({"role": "user"},), max_tokens=8, stream=True)
        try:
            r = await Relay.open(scheduler, MODEL, None, text, make)  # type: ignore[arg-type]
            out = []
            async for piece in r.stream():
                out.append(piece)
                if len(out) == 1:
                    for watcher in list(runner.notice_watchers):
                        watcher({"preempt": 99})  # another stream's: nothing happens
                        watcher({"preempt": 7, "cached": 130})
            await asyncio.wait_for(engine.closed.wait(), 30)
            return b"".join(out), runner, scheduler
        finally:
            server.close()
            await server.wait_closed()

    return asyncio.run(go())


def test_a_preempted_stream_goes_on_as_one_openai_stream(tmp_path: Path) -> None:
    body, runner, scheduler = preempted(tmp_path, openai())
    got = events(body)
    assert got[-1] == "[DONE]"
    chunks = got[:-1]
    assert {c["id"] for c in chunks} == {"x-1"}  # one id across the seam
    assert {c["model"] for c in chunks if "model" in c} == {MODEL}
    deltas = [c["choices"][0]["delta"] for c in chunks if c["choices"]]
    assert sum("role" in d for d in deltas) == 1  # no second opening chunk
    assert "".join(d.get("content") or "" for d in deltas) == "Hello world"
    usage = chunks[-1]["usage"]  # the prefilled tokens count as generated
    assert usage["prompt_tokens"] == 200 and usage["completion_tokens"] == 5
    assert usage["total_tokens"] == 205
    # The preempted request's own reuse (the runner's notice), in blocks: not the 201 the
    # continuation's restore of its saved state got.
    assert usage["prompt_tokens_details"]["cached_tokens"] == 128
    # The continuation: the text sent as an assistant prefill, the tokens left, the ticket.
    more = runner.opened[1]
    assert more.messages[-1] == {"role": "assistant", "content": "Hello"}
    assert more.resumed == 7 and more.max_tokens == 6
    # The preempted ticket saved its slot's state; one release for the whole request.
    assert [(c.ticket, c.resume) for c in runner.closed] == [(7, True), (8, False)]
    assert len(scheduler.released) == 1 and not runner.notice_watchers


def test_a_preempted_stream_goes_on_as_one_ollama_stream(tmp_path: Path) -> None:
    body, runner, scheduler = preempted(tmp_path, ollama())
    lines = [json.loads(line) for line in body.splitlines()]
    assert "".join(line["message"]["content"] for line in lines) == "Hello world"
    final = lines[-1]
    assert final["done"] is True and final["done_reason"] == "length"
    assert final["prompt_eval_count"] == 200 and final["eval_count"] == 5
    assert [(c.ticket, c.resume) for c in runner.closed] == [(7, True), (8, False)]
    assert len(scheduler.released) == 1
