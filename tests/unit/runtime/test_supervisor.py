"""Supervisor + worker as real processes: real llama.cpp on SmolLM2 for the main paths, tiny
stub engines (stub_engines.py) only for behaviours a model cannot show on demand."""

from __future__ import annotations

import asyncio
import contextlib
import functools
import os
import signal
import wave
from collections.abc import AsyncIterator, Awaitable, Callable, Iterator
from dataclasses import replace
from multiprocessing import resource_tracker
from pathlib import Path
from typing import Any, TypeVar

import pytest
import stub_engines
import xllamacpp  # noqa: F401  (a hard dependency: a broken install fails, never skips)
from bundled_models import bundled_spec

from elbowroom.config import Settings
from elbowroom.engines.options import EngineOptions, LlamaOptions
from elbowroom.engines.requests import CloseTicket, TextRequest, TextTicket, TranscribeRequest
from elbowroom.errors import BadRequest, EngineError, MemoryPressure, RunnerCrashed, Unavailable
from elbowroom.memory.types import ZERO_PROCESS_MEMORY
from elbowroom.models.spec import ModelSpec
from elbowroom.runtime.engine_events import text_events
from elbowroom.runtime.protocol import Runner, RunnerState
from elbowroom.runtime.supervisor import Supervisor, describe_exit, spawn_worker
from elbowroom.server.stream.relay import Answer, parse_events

T = TypeVar("T")
SETTINGS = Settings(load_timeout=120.0, stop_grace=5.0)
# kv_cache off: these tests read the context's own prefix reuse (the KV prefix cache has
# its own tests in tests/unit/kvcache).
OPTIONS = LlamaOptions(n_ctx=512, kv_cache=False)
COUNTING = TextRequest(
    kind="completion", prompt="1, 2, 3, 4, 5, 6, 7, 8, 9, 10,", temperature=0, max_tokens=256
)
DEADLINE = 60.0
SMOLLM2 = "smollm2-135m"


class Exits:
    """The on_exit callback: records every call."""

    def __init__(self) -> None:
        self.calls: list[tuple[Runner, str]] = []

    def __call__(self, runner: Runner, cause: str) -> None:
        self.calls.append((runner, cause))


@pytest.fixture(scope="module")
def loop() -> Iterator[asyncio.AbstractEventLoop]:
    lp = asyncio.new_event_loop()
    yield lp
    lp.close()


def make_run(loop: asyncio.AbstractEventLoop) -> Callable[[Awaitable[T]], T]:
    def run(aw: Awaitable[T]) -> T:
        return loop.run_until_complete(asyncio.wait_for(aw, DEADLINE))

    return run


@pytest.fixture(scope="module")
def run(loop: asyncio.AbstractEventLoop) -> Callable[[Awaitable[Any]], Any]:
    return make_run(loop)


@pytest.fixture(scope="module")
def llm(run: Callable[[Awaitable[Any]], Any]) -> Iterator[tuple[Supervisor, Exits, Any]]:
    exits = Exits()
    sup = Supervisor(bundled_spec(SMOLLM2), exits, settings=SETTINGS)
    info = run(sup.start(OPTIONS))
    yield sup, exits, info
    run(sup.stop(1.0))


def counting(max_tokens: int) -> TextRequest:
    return replace(COUNTING, max_tokens=max_tokens)


async def collect(stream: AsyncIterator[dict[str, Any]]) -> list[dict[str, Any]]:
    return [item async for item in stream]


async def complete(sup: Supervisor, request: TextRequest) -> dict[str, Any]:
    """The whole answer, read from the engine's own socket as the server's relay reads it
    (cached_tokens exact: the relay's rewriter rounds them)."""
    answer = Answer(SMOLLM2, chat_events=request.kind == "chat", block=1)
    events = text_events(sup, request)
    try:
        ticket = await anext(events)
        assert isinstance(ticket, TextTicket)
        async for block in events:
            assert isinstance(block, bytes)
            for chunk in parse_events(block):
                if chunk is not None:
                    answer.take(chunk)
        return {"blocks": answer.pieces, **answer.result(emulated=False)}
    finally:
        await events.aclose()


def pid_gone(pid: int) -> bool:
    """True once the process is gone *and reaped* (a zombie still has /proc/PID)."""
    return not Path(f"/proc/{pid}").exists()


def open_pipes() -> int:
    """This process's pipe fds (a spawned child's Popen holds two until it is closed)."""
    resource_tracker.ensure_running()  # the first spawn starts it, with a pipe of its own
    pipes = 0
    for fd in os.listdir("/proc/self/fd"):
        with contextlib.suppress(FileNotFoundError):  # the listing's own fd, closed since
            pipes += os.readlink(f"/proc/self/fd/{fd}").startswith("pipe:")
    return pipes


# ---- real llama.cpp ------------------------------------------------------------------


@pytest.mark.slow
def test_start_reports_ready_with_measured_weights(
    llm: tuple[Supervisor, Exits, Any],
) -> None:
    sup, _, info = llm
    assert sup.state is RunnerState.READY
    assert info.pid == sup.pid and info.pid != os.getpid()
    assert info.facts["n_ctx"] == 512 and info.facts["chat_template"] is True
    assert info.load_seconds > 0
    size = sup.spec.size_bytes
    # The weights are mmap'd: file-backed, about the size of the GGUF (plus shared libraries).
    assert 0.8 * size <= info.measured.file_backed <= size + 200 * 1024**2
    assert info.measured.anonymous > 0


@pytest.mark.slow
def test_open_hands_out_a_ticket_and_the_engine_streams_its_events(
    llm: tuple[Supervisor, Exits, Any], run: Callable[[Awaitable[Any]], Any]
) -> None:
    sup, _, _ = llm
    (ticket,) = run(collect(sup.request("open", counting(6))))
    assert ticket["type"] == "done" and ticket["ticket"].socket  # the slot is held: close it
    (closed,) = run(collect(sup.request("close", CloseTicket(ticket["ticket"].ticket))))
    assert closed["closed"] is True
    done = run(complete(sup, counting(6)))
    assert len(done["blocks"]) > 1 and done["text"] == "".join(done["blocks"])
    assert done["finish_reason"] == "length" and done["usage"]["completion_tokens"] == 6


@pytest.mark.slow
def test_engine_errors_travel_on_the_request_channel(
    llm: tuple[Supervisor, Exits, Any], run: Callable[[Awaitable[Any]], Any]
) -> None:
    sup, _, _ = llm
    with pytest.raises(BadRequest) as info:
        run(collect(sup.request("chat", {"messages": "not a list"})))
    assert "TextRequest" in info.value.message
    assert sup.state is RunnerState.READY


@pytest.mark.slow
def test_pressure_level_reaches_the_engine(
    llm: tuple[Supervisor, Exits, Any], run: Callable[[Awaitable[Any]], Any]
) -> None:
    sup, _, _ = llm
    sup.set_pressure(2)
    with pytest.raises(MemoryPressure):
        run(complete(sup, counting(4)))
    sup.set_pressure(0)
    done = run(complete(sup, counting(4)))
    assert done["usage"]["completion_tokens"] == 4


@pytest.mark.slow
def test_closing_the_stream_early_cancels_the_work(
    llm: tuple[Supervisor, Exits, Any], run: Callable[[Awaitable[Any]], Any]
) -> None:
    sup, _, _ = llm
    # How many tokens a request left in the context shows up as the next prompt's cached
    # prefix. Control: an uncancelled 64-token run leaves all of them there (cached_tokens
    # are exact here: the relay rounds them for clients).
    full = run(complete(sup, counting(64)))
    continued = replace(COUNTING, prompt=COUNTING.prompt + full["text"], max_tokens=1)
    control = run(complete(sup, continued))
    n_prompt = full["usage"]["prompt_tokens"]
    assert control["usage"]["cached_tokens"] >= n_prompt + 40

    async def take_two_then_leave() -> None:
        events = text_events(sup, counting(64))
        for _ in range(2):  # the ticket, then the first events
            await anext(events)
        await events.aclose()  # as the relay does when its client leaves

    run(take_two_then_leave())
    after = run(complete(sup, continued))
    # The engine stopped a few tokens in, not after 64.
    assert after["usage"]["cached_tokens"] < n_prompt + 20
    assert sup.state is RunnerState.READY


@pytest.mark.slow
def test_stats_answers_while_ready(
    llm: tuple[Supervisor, Exits, Any], run: Callable[[Awaitable[Any]], Any]
) -> None:
    sup, _, _ = llm
    assert isinstance(run(sup.stats()), dict)


@pytest.mark.slow
def test_kill_9_mid_stream_fails_the_request_and_reports_once(
    run: Callable[[Awaitable[Any]], Any],
) -> None:
    exits = Exits()
    sup = Supervisor(bundled_spec(SMOLLM2), exits, settings=SETTINGS)
    info = run(sup.start(OPTIONS))

    async def stream_then_kill() -> None:
        events = text_events(sup, counting(200))
        try:
            await anext(events)  # the ticket
            await anext(events)  # the first events
            os.kill(info.pid, signal.SIGKILL)
            async for _ in events:
                pass
        finally:
            await events.aclose()

    with pytest.raises(RunnerCrashed) as err:
        run(stream_then_kill())
    assert "killed by signal SIGKILL" in err.value.message
    assert err.value.status == 503
    assert exits.calls == [(sup, "killed by signal SIGKILL")]
    assert sup.state is RunnerState.CRASHED and sup.exit_cause == "killed by signal SIGKILL"
    assert sup.pid is None and sup.measure() == ZERO_PROCESS_MEMORY
    assert pid_gone(info.pid)  # reaped: no zombie
    with pytest.raises(RunnerCrashed):  # a later request fails at once, naming the cause
        run(complete(sup, COUNTING))
    run(sup.stop(1.0))  # never raises on a dead runner
    assert sup.state is RunnerState.STOPPED
    assert len(exits.calls) == 1


@pytest.mark.slow
def test_load_failure_raises_the_workers_error_and_reaps(
    run: Callable[[Awaitable[Any]], Any],
) -> None:
    exits = Exits()
    spawned: list[Any] = []

    def spawn(conn: Any, spec: ModelSpec, options: EngineOptions) -> Any:
        proc = spawn_worker(conn, spec, options)
        spawned.append(proc.pid)  # the Process object is closed once the runner exited
        return proc

    sup = Supervisor(
        replace(bundled_spec(SMOLLM2), path=Path("/nonexistent/model.gguf")),
        exits,
        settings=SETTINGS,
        spawn=spawn,
    )
    with pytest.raises(EngineError) as err:
        run(sup.start(OPTIONS))
    assert "/nonexistent/model.gguf" in err.value.message
    assert sup.state is RunnerState.STOPPED and sup.pid is None
    assert pid_gone(spawned[0]) and exits.calls == []


@pytest.mark.slow
def test_stop_ends_the_process_and_frees_its_memory(
    llm: tuple[Supervisor, Exits, Any], run: Callable[[Awaitable[Any]], Any]
) -> None:
    sup, exits, info = llm
    run(sup.stop(SETTINGS.stop_grace))
    assert sup.state is RunnerState.STOPPED
    assert sup.exit_cause == "exit code 0"  # it obeyed the stop op
    assert pid_gone(info.pid) and sup.pid is None
    assert sup.measure() == ZERO_PROCESS_MEMORY
    assert exits.calls == []  # stop() is not a crash
    assert sup._reader is not None and not sup._reader.is_alive()  # no leaked thread


@pytest.mark.slow
def test_a_stopped_runner_leaves_no_named_semaphore(
    run: Callable[[Awaitable[Any]], Any], tmp_path: Path
) -> None:
    """faster-whisper takes tqdm's multiprocessing lock on every transcription: a named
    semaphore in /dev/shm, mapped into the runner. The runner exits with os._exit, so it
    must unlink it itself; it used to stay until the server exited."""
    pytest.importorskip("faster_whisper")
    silence = tmp_path / "silence.wav"
    with wave.open(str(silence), "wb") as w:
        w.setnchannels(1)
        w.setsampwidth(2)
        w.setframerate(16000)
        w.writeframes(bytes(32000))
    sup = Supervisor(bundled_spec("whisper-tiny.en"), Exits(), settings=SETTINGS)
    info = run(sup.start(EngineOptions(threads=1)))
    try:
        run(collect(sup.request("transcribe", TranscribeRequest(audio_path=str(silence)))))
        # glibc maps a semaphore under a temporary name, then links it to its real one: the
        # inode is what the runner's mapping and the /dev/shm entry share.
        maps = Path(f"/proc/{info.pid}/maps").read_text().splitlines()
    finally:
        run(sup.stop(SETTINGS.stop_grace))  # a failure must not leave the runner behind
    inodes = {int(line.split()[4]) for line in maps if "/dev/shm/sem." in line}
    if not inodes:
        pytest.skip("this faster-whisper makes no named semaphore")
    assert pid_gone(info.pid) and sup.exit_cause == "exit code 0"
    left = [f.name for f in Path("/dev/shm").iterdir() if f.stat().st_ino in inodes]
    assert left == []


# ---- stub engines at the edge --------------------------------------------------------


def stub_supervisor(
    target: Callable[..., None], exits: Exits, settings: Settings = SETTINGS
) -> Supervisor:
    spawn = functools.partial(spawn_worker, target=target)
    return Supervisor(bundled_spec(SMOLLM2), exits, settings=settings, spawn=spawn)


@pytest.mark.parametrize(
    ("target", "signal_name"),
    [(stub_engines.stubborn_main, "SIGTERM"), (stub_engines.unkillable_main, "SIGKILL")],
)
def test_stop_escalates_to_signals(
    run: Callable[[Awaitable[Any]], Any], target: Callable[..., None], signal_name: str
) -> None:
    exits = Exits()
    pipes = open_pipes()
    sup = stub_supervisor(target, exits)
    info = run(sup.start(EngineOptions()))
    assert info.facts == {"stub": True}
    assert run(sup.stats()) == {"stub": "stats"}

    async def stuck_request_then_stop() -> BaseException | None:
        stream = sup.request("chat", {})
        assert (await anext(stream))["text"] == "started"
        rest = asyncio.ensure_future(collect(stream))
        await sup.stop(0.3)  # the engine ignores the stop op (and SIGTERM, if unkillable)
        try:
            await rest
        except RunnerCrashed as exc:
            return exc
        return None

    err = run(stuck_request_then_stop())
    assert isinstance(err, RunnerCrashed) and signal_name in err.message
    assert sup.exit_cause == f"killed by signal {signal_name}"
    assert sup.state is RunnerState.STOPPED and pid_gone(info.pid)
    assert exits.calls == []
    assert open_pipes() == pipes  # nothing of the process left open while sup lives on


def test_death_while_loading_is_a_crash_named_by_exit_code(
    run: Callable[[Awaitable[Any]], Any],
) -> None:
    exits = Exits()
    pipes = open_pipes()
    sup = stub_supervisor(stub_engines.dies_while_loading_main, exits)
    with pytest.raises(RunnerCrashed) as err:
        run(sup.start(EngineOptions()))
    assert "while loading (exit code 3)" in err.value.message
    assert sup.state is RunnerState.CRASHED and exits.calls == []
    assert open_pipes() == pipes  # a crash leaves no fd of the process behind either


def test_a_load_past_load_timeout_is_stopped(run: Callable[[Awaitable[Any]], Any]) -> None:
    exits = Exits()
    settings = Settings(load_timeout=0.5, stop_grace=0.2)
    spawned: list[Any] = []

    def spawn(conn: Any, spec: ModelSpec, options: EngineOptions) -> Any:
        proc = spawn_worker(conn, spec, options, target=stub_engines.never_loads_main)
        spawned.append(proc.pid)  # the Process object is closed once the runner exited
        return proc

    sup = Supervisor(bundled_spec(SMOLLM2), exits, settings=settings, spawn=spawn)
    with pytest.raises(Unavailable) as err:
        run(sup.start(EngineOptions()))
    assert "load_timeout" in err.value.message and err.value.status == 503
    assert sup.state is RunnerState.STOPPED and pid_gone(spawned[0])
    assert exits.calls == []


def test_stop_while_loading_fails_the_start(run: Callable[[Awaitable[Any]], Any]) -> None:
    exits = Exits()
    sup = stub_supervisor(stub_engines.never_loads_main, exits)

    async def start_then_stop() -> BaseException | None:
        starting = asyncio.ensure_future(sup.start(EngineOptions()))
        while sup.pid is None:  # spawned: the worker is now loading (forever)
            await asyncio.sleep(0)
        await sup.stop(0.2)
        try:
            await starting
        except RunnerCrashed as exc:
            return exc
        return None

    err = run(start_then_stop())
    assert isinstance(err, RunnerCrashed) and "was stopped while loading" in err.message
    assert sup.state is RunnerState.STOPPED and exits.calls == []


def test_describe_exit_names_codes_and_signals() -> None:
    assert describe_exit(0) == "exit code 0"
    assert describe_exit(3) == "exit code 3"
    assert describe_exit(-9) == "killed by signal SIGKILL"
    assert describe_exit(-15) == "killed by signal SIGTERM"
    assert describe_exit(None) == "unknown exit"


def test_a_sigkill_while_the_cgroup_counted_an_oom_kill_is_the_oom_killer_s() -> None:
    oom = describe_exit(-9, (2, 3))
    assert oom.startswith("killed by the kernel's OOM killer") and "2 -> 3" in oom
    assert describe_exit(-9, (3, 3)) == "killed by signal SIGKILL"  # someone's kill -9
    assert describe_exit(-9, (None, None)) == "killed by signal SIGKILL"  # no counter here
    assert describe_exit(1, (2, 3)) == "exit code 1"  # died some other way meanwhile


def test_request_before_start_is_unavailable(run: Callable[[Awaitable[Any]], Any]) -> None:
    sup = Supervisor(bundled_spec(SMOLLM2), Exits(), settings=SETTINGS)
    with pytest.raises(Unavailable) as err:
        run(collect(sup.request("chat", {})))
    assert "not ready" in err.value.message
    run(sup.stop(0.1))  # stopping a never-started runner is fine
    assert sup.state is RunnerState.STOPPED
