"""Direct streams (server/direct.py) against a scripted engine on a real Unix socket: the
relay's rewriting, chunk boundaries, errors before and after the first token, the slot
given back, and the hard-pressure abort. The real engine is in tests/e2e."""

from __future__ import annotations

import asyncio
import json
from collections.abc import AsyncIterator, Callable
from contextlib import AsyncExitStack
from pathlib import Path
from typing import Any

import pytest

from elbowroom.engines.requests import DirectClose, Payload, TextRequest
from elbowroom.errors import ContextOverflow
from elbowroom.server.direct import open_direct

ENGINE_MODEL = "/models/SmolLM2.gguf"


def _event(obj: dict[str, Any]) -> bytes:
    return b"data: " + json.dumps(obj, separators=(",", ":")).encode() + b"\n\n"


def _token(text: str) -> bytes:
    return _event(
        {
            "choices": [{"finish_reason": None, "index": 0, "delta": {"content": text}}],
            "id": "chatcmpl-1",
            "model": ENGINE_MODEL,
            "object": "chat.completion.chunk",
        }
    )


FINISH = _event(
    {
        "choices": [{"finish_reason": "length", "index": 0, "delta": {}}],
        "id": "chatcmpl-1",
        "model": ENGINE_MODEL,
        "object": "chat.completion.chunk",
    }
)
USAGE = _event(
    {
        "choices": [],
        "id": "chatcmpl-1",
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
DONE = b"data: [DONE]\n\n"


class Engine:
    """A Unix-socket HTTP server that answers one scripted response per connection."""

    def __init__(self, path: Path, status: int, pieces: list[bytes], hold: bool = False) -> None:
        self.path = path
        self.status = status
        self.pieces = pieces
        self.hold = hold  # keep the stream open after the pieces (until the client leaves)
        self.chunked = True  # False: one JSON answer (a non-streamed request)
        self.requests: list[dict[str, Any]] = []
        self.closed = asyncio.Event()

    async def handle(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        head = await reader.readuntil(b"\r\n\r\n")
        length = int(head.lower().split(b"content-length: ")[1].split(b"\r\n")[0])
        self.requests.append(
            {"head": head.decode(), "body": json.loads(await reader.readexactly(length))}
        )
        if self.status != 200 or not self.chunked:
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


class Runner:
    """The runner's side of a direct stream: open hands out the engine request, close
    gives the slot back; pressure watchers as runtime/supervisor.py has them."""

    direct_streams = True
    exit_cause: str | None = None

    async def exit_within(self, timeout: float) -> str | None:
        return self.exit_cause

    def __init__(self, socket: Path, direct: bool = True) -> None:
        self.socket = socket
        self.direct = direct
        self.closed: list[DirectClose] = []
        self.watchers: set[Callable[[int], None]] = set()

    async def request(self, kind: str, payload: Payload) -> AsyncIterator[dict[str, Any]]:
        if kind == "open":
            assert isinstance(payload, TextRequest)
            if not self.direct:
                yield {"type": "done", "direct": False}
                return
            yield {
                "type": "done",
                "direct": True,
                "ticket": 7,
                "socket": str(self.socket),
                "key": "k3y",
                "path": "/v1/chat/completions",
                "body": {"messages": list(payload.messages), "stream": True},
                "block_tokens": 64,
            }
        else:
            assert kind == "close" and isinstance(payload, DirectClose)
            self.closed.append(payload)
            yield {"type": "done", "closed": True}

    def watch_pressure(self, watcher: Callable[[int], None]) -> Callable[[], None]:
        self.watchers.add(watcher)
        return lambda: self.watchers.discard(watcher)


async def _relay(
    tmp_path: Path,
    status: int,
    pieces: list[bytes],
    include_usage: bool = True,
    hold: bool = False,
    direct: bool = True,
    on_first: Callable[[Runner], None] | None = None,
) -> tuple[bytes | None, Engine, Runner, list[str]]:
    sock = tmp_path / "engine.sock"
    engine = Engine(sock, status, pieces, hold)
    server = await asyncio.start_unix_server(engine.handle, path=str(sock))
    runner = Runner(sock, direct)
    released: list[str] = []
    stack = AsyncExitStack()
    stack.callback(released.append, "scheduler")
    try:
        request = TextRequest(kind="chat", messages=({"role": "user"},), max_tokens=8, stream=True)
        stream = await open_direct(runner, stack, "smollm2-135m", request, include_usage)
        if stream is None:
            await stack.aclose()
            return None, engine, runner, released
        out = []
        async for piece in stream:
            out.append(piece)
            if on_first is not None and len(out) == 1:
                on_first(runner)
        return b"".join(out), engine, runner, released
    finally:
        server.close()
        await server.wait_closed()


def _events(body: bytes) -> list[Any]:
    return [
        json.loads(e[6:]) if e != b"data: [DONE]" else "[DONE]"
        for e in body.split(b"\n\n")
        if e.startswith(b"data: ")
    ]


def test_relays_the_engine_stream_renamed_with_rounded_usage(tmp_path: Path) -> None:
    # Events split across chunk boundaries and several events in one chunk.
    stream = _token("Hel") + _token("lo") + FINISH + USAGE + DONE
    pieces = [stream[:10], stream[10:150], stream[150:]]
    body, engine, runner, released = asyncio.run(_relay(tmp_path, 200, pieces))
    assert body is not None
    events = _events(body)
    assert events[-1] == "[DONE]"
    chunks = events[:-1]
    assert "".join(c["choices"][0]["delta"].get("content", "") for c in chunks[:2]) == "Hello"
    assert {c["model"] for c in chunks} == {"smollm2-135m"}  # never the engine's file path
    usage = chunks[-1]["usage"]
    assert usage["prompt_tokens_details"]["cached_tokens"] == 192  # 199 down to 64-blocks
    assert "timings" not in chunks[-1]
    # The engine got the runner's request with its key; the slot went back with the timings.
    assert "Authorization: Bearer k3y" in engine.requests[0]["head"]
    assert engine.requests[0]["body"]["stream"] is True
    timings = {"cache_n": 199, "prompt_n": 1, "prompt_ms": 5.0, "predicted_n": 2}
    assert runner.closed == [DirectClose(7, timings)]
    assert released == ["scheduler"] and not runner.watchers


def test_without_include_usage_the_usage_event_is_dropped(tmp_path: Path) -> None:
    pieces = [_token("Hi") + FINISH + USAGE + DONE]
    body, _, runner, _ = asyncio.run(_relay(tmp_path, 200, pieces, include_usage=False))
    assert body is not None
    events = _events(body)
    assert events[-1] == "[DONE]"
    assert all("usage" not in e for e in events[:-1])
    assert events[-2]["choices"][0]["finish_reason"] == "length"
    closed = runner.closed[0].timings
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
    with pytest.raises(ContextOverflow) as info:
        asyncio.run(_relay(tmp_path, 400, [refusal]))
    assert "431 tokens" in str(info.value) and "256" in str(info.value)


def test_an_error_mid_stream_is_the_last_event_and_the_slot_goes_back(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    err = _event({"error": {"code": 500, "message": "decode failed", "type": "server_error"}})
    body, _, runner, released = asyncio.run(_relay(tmp_path, 200, [_token("a"), err]))
    assert body is not None
    events = _events(body)
    assert events[0]["choices"][0]["delta"]["content"] == "a"
    # An engine failure is an internal error: its text goes to the log under an error id.
    assert "error id" in events[-1]["error"]["message"]
    assert "decode failed" in caplog.text
    assert runner.closed and released == ["scheduler"]


def test_a_stream_that_breaks_off_is_an_error_event(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    body, _, runner, _ = asyncio.run(_relay(tmp_path, 200, [_token("a")]))  # no [DONE]
    assert body is not None
    assert "error id" in _events(body)[-1]["error"]["message"]
    assert "stream broke off" in caplog.text
    assert runner.closed


def test_a_runner_that_dies_mid_stream_is_reported_as_a_crash(tmp_path: Path) -> None:
    def kill(runner: Runner) -> None:
        runner.exit_cause = "killed by signal SIGKILL"

    body, _, _, _ = asyncio.run(_relay(tmp_path, 200, [_token("a")], on_first=kill))
    assert body is not None
    err = _events(body)[-1]["error"]
    assert "died (killed by signal SIGKILL)" in err["message"]


def test_hard_pressure_aborts_and_closes_the_engine_connection(tmp_path: Path) -> None:
    def squeeze(runner: Runner) -> None:
        for watcher in list(runner.watchers):
            watcher(1)  # soft: nothing happens
            watcher(2)  # hard: aborted

    body, engine, runner, released = asyncio.run(
        _relay(tmp_path, 200, [_token("a"), _token("b")], hold=True, on_first=squeeze)
    )
    assert body is not None
    last = _events(body)[-1]
    assert last["error"]["type"] == "memory_pressure"
    assert engine.closed.is_set()  # the engine saw its reader leave: it stops generating
    assert runner.closed and released == ["scheduler"]


def test_a_request_the_runner_declines_is_left_to_the_pipe_path(tmp_path: Path) -> None:
    body, engine, runner, released = asyncio.run(_relay(tmp_path, 200, [], direct=False))
    assert body is None and not engine.requests and not runner.closed
    assert released == ["scheduler"]


def test_a_non_streamed_answer_is_read_whole_and_rewritten(tmp_path: Path) -> None:
    answer = {
        "choices": [{"finish_reason": "stop", "index": 0, "message": {"content": "Hi"}}],
        "model": ENGINE_MODEL,
        "object": "chat.completion",
        "usage": {"prompt_tokens": 70, "prompt_tokens_details": {"cached_tokens": 69}},
        "timings": {"prompt_n": 1, "prompt_ms": 2.0},
    }

    async def run() -> tuple[dict[str, Any], Engine, Runner, list[str]]:
        sock = tmp_path / "engine.sock"
        engine = Engine(sock, 200, [json.dumps(answer).encode()])
        engine.chunked = False
        server = await asyncio.start_unix_server(engine.handle, path=str(sock))
        runner = Runner(sock)
        released: list[str] = []
        stack = AsyncExitStack()
        stack.callback(released.append, "scheduler")
        try:
            request = TextRequest(kind="chat", max_tokens=8)  # not streamed
            direct = await open_direct(runner, stack, "smollm2-135m", request, False)
            assert direct is not None
            return await direct.answer(), engine, runner, released
        finally:
            server.close()
            await server.wait_closed()

    got, engine, runner, released = asyncio.run(run())
    assert engine.requests[0]["body"]["stream"] is True  # the runner decided the body
    assert got["model"] == "smollm2-135m" and "timings" not in got
    assert got["usage"]["prompt_tokens_details"]["cached_tokens"] == 64
    assert got["choices"][0]["message"]["content"] == "Hi"
    assert runner.closed == [DirectClose(7, {"prompt_n": 1, "prompt_ms": 2.0})]
    assert released == ["scheduler"]
