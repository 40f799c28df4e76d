"""The parent side of a runner: spawn the worker process, talk to it, notice its death.

One reader thread per runner blocks on the pipe *and* the process sentinel, so a message
or a death is seen at once; it hands everything to the event loop with
``call_soon_threadsafe``. On the loop, each request owns an ``asyncio.Queue`` (its response
channel): deltas, the result, its error and the news of a dead process all travel on it.

Stopping escalates: the ``stop`` op, then SIGTERM after ``grace``, then SIGKILL after
another ``grace``. A process that exits on its own while ready is a crash: every request
in flight fails with RunnerCrashed naming the exit code or signal, and ``on_exit`` is
called exactly once (never for ``stop()``, nor for a failed start: ``start`` raises).
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import itertools
import logging
import multiprocessing
import signal
import threading
import time
from collections import deque
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass, replace
from multiprocessing.connection import Connection, wait
from multiprocessing.context import ForkServerContext, SpawnContext
from multiprocessing.process import BaseProcess
from typing import Any

from elbowroom.config import Settings
from elbowroom.engines.options import EngineOptions
from elbowroom.engines.requests import Payload
from elbowroom.errors import ElbowroomError, RunnerCrashed, Unavailable
from elbowroom.memory.cgroup import oom_kill_count
from elbowroom.memory.process import measure_tree
from elbowroom.memory.types import ZERO_PROCESS_MEMORY, ProcessMemory
from elbowroom.models.spec import ModelSpec
from elbowroom.runtime.protocol import (
    STATS_TIMEOUT,
    ExitCallback,
    ReadyInfo,
    Runner,
    RunnerFactory,
    RunnerState,
    RunnerStatus,
)
from elbowroom.runtime.worker import worker_main

log = logging.getLogger(__name__)


# (child end of the pipe, spec, options) -> a started process. Tests inject their own.
Spawn = Callable[[Connection, ModelSpec, EngineOptions], BaseProcess]
WorkerTarget = Callable[[Connection, ModelSpec, EngineOptions], None]


START_METHODS = ("forkserver", "spawn")
# What a runner imports before its engine loads: a forkserver imports it once, and each
# runner forked from it starts with it imported. A fresh interpreter that imports it took
# 0.35-0.55 s of every model switch on 2 busy cores (issue 24's arena). The engine library
# itself (xllamacpp) is not preloaded: its OpenMP runtime reads GOMP_SPINCOUNT when it
# loads, which the worker sets first (runtime/worker.py).
PRELOAD = ("elbowroom.runtime.worker", "elbowroom.engines.registry", "elbowroom.engines.llama")


def start_context(method: str) -> SpawnContext | ForkServerContext:
    """multiprocessing's context for ``method`` (``runner_start``). Never ``fork``: the child
    must not inherit the server's threads, event loop and sockets. The forkserver is a fresh
    interpreter (started once, on the first runner, by exec, not fork), single-threaded, that
    imports ``PRELOAD`` and forks each runner from itself; it exits with the server."""
    if method == "spawn":
        return multiprocessing.get_context("spawn")
    if method != "forkserver":
        raise ValueError(f"runner_start must be one of {', '.join(START_METHODS)}, not {method!r}")
    ctx = multiprocessing.get_context("forkserver")
    # Read only when the forkserver starts: setting it again on every start is harmless.
    ctx.set_forkserver_preload(list(PRELOAD))
    return ctx


def spawn_worker(
    conn: Connection,
    spec: ModelSpec,
    options: EngineOptions,
    *,
    target: WorkerTarget = worker_main,
    method: str = "spawn",
) -> BaseProcess:
    """Start a runner process by ``method`` (``start_context``)."""
    ctx = start_context(method)
    proc: BaseProcess = ctx.Process(
        target=target, args=(conn, spec, options), daemon=False, name=f"elbowroom-{spec.id}"
    )
    proc.start()
    return proc


OOM_KILLED = "killed by the kernel's OOM killer"


def describe_exit(
    exitcode: int | None, oom_kills: tuple[int | None, int | None] = (None, None)
) -> str:
    """'exit code 1', 'killed by signal SIGKILL', ... (multiprocessing: -N means signal N).
    ``oom_kills``: the cgroup's OOM-kill counter when the runner started and after it
    exited; a SIGKILL while it went up is the OOM killer's."""
    before, after = oom_kills
    killed = exitcode == -signal.SIGKILL
    if killed and before is not None and after is not None and after > before:
        return f"{OOM_KILLED} (SIGKILL, the cgroup's oom_kill counter {before} -> {after})"
    if exitcode is None:
        return "unknown exit"
    if exitcode < 0:
        try:
            name = signal.Signals(-exitcode).name
        except ValueError:
            name = str(-exitcode)
        return f"killed by signal {name}"
    return f"exit code {exitcode}"


@dataclass(frozen=True, slots=True)
class _Exited:
    cause: str
    stopped: bool  # by stop(), not on its own


def supervisor_factory(settings: Settings) -> RunnerFactory:
    spawn = functools.partial(spawn_worker, method=settings.runner_start)

    def make(spec: ModelSpec, on_exit: ExitCallback) -> Runner:
        return Supervisor(spec, on_exit, settings=settings, spawn=spawn)

    return make


class Supervisor(RunnerStatus):
    """Implements runtime.protocol.Runner for one model in one worker process."""

    def __init__(
        self,
        spec: ModelSpec,
        on_exit: ExitCallback,
        *,
        settings: Settings,
        spawn: Spawn = spawn_worker,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        super().__init__()
        self.spec = spec
        self._on_exit = on_exit
        self._settings = settings
        self._spawn = spawn
        self._clock = clock
        self._proc: BaseProcess | None = None
        self._oom_before: int | None = None  # the cgroup's OOM-kill counter at its start
        self._sent_kill = False
        self._conn: Connection | None = None
        self._reader: threading.Thread | None = None
        self._loop: asyncio.AbstractEventLoop | None = None
        self._ready: asyncio.Future[dict[str, Any]] | None = None
        self._exited = asyncio.Event()
        self._stop_lock = asyncio.Lock()
        self._channels: dict[int, asyncio.Queue[Any]] = {}
        self._stats_waiters: deque[asyncio.Future[dict[str, Any]]] = deque()
        self._ids = itertools.count(1)
        self._send_lock = threading.Lock()
        self._level = 0
        self._pressure_watchers: set[Callable[[int], None]] = set()
        self._notice_watchers: set[Callable[[dict[str, Any]], None]] = set()

    # ---- Runner properties -------------------------------------------------------------

    @property
    def pid(self) -> int | None:
        if self._proc is None or self._exited.is_set():
            return None
        return self._proc.pid

    # ---- lifecycle ---------------------------------------------------------------------

    async def start(self, options: EngineOptions) -> ReadyInfo:
        if self._state is not RunnerState.NEW:
            raise RuntimeError(f"runner for {self.spec.id} was already started")
        self._loop = asyncio.get_running_loop()
        self._ready = self._loop.create_future()
        self._state = RunnerState.STARTING
        began = self._clock()
        parent, child = multiprocessing.Pipe(duplex=True)
        try:
            # The runner logs at this machine's level (a node's runner: the node's settings).
            options = replace(options, log_level=self._settings.log_level)
            proc = self._spawn(child, self.spec, options)
        except BaseException:
            parent.close()
            self._state = RunnerState.STOPPED
            raise
        finally:
            child.close()  # only the child holds its end now: its death means EOF here
        self._proc, self._conn = proc, parent
        self._oom_before = oom_kill_count()
        self._reader = threading.Thread(
            target=self._read, args=(parent, proc), name=f"runner-{self.spec.id}", daemon=True
        )
        self._reader.start()
        log.info("runner for %s: pid %s loading", self.spec.id, proc.pid)

        timeout = self._settings.load_timeout
        try:
            facts = await asyncio.wait_for(asyncio.shield(self._ready), timeout)
        except TimeoutError:
            self._ready.cancel()  # nobody awaits it any more
            await self._abandon_start(crashed=False)
            raise Unavailable(
                f"runner for {self.spec.id} did not load within {timeout:g} s "
                f"(load_timeout); the process was stopped",
                retry_after=5.0,
                code="load_timeout",
            ) from None
        except ElbowroomError as exc:
            crashed = isinstance(exc, RunnerCrashed) and self._state is RunnerState.CRASHED
            await self._abandon_start(crashed=crashed)
            raise
        except asyncio.CancelledError:  # the caller gave up (e.g. shutdown): leave no process
            self._ready.cancel()
            await self._abandon_start(crashed=False)
            raise
        if self._state is not RunnerState.STARTING:  # stop() was called while it loaded
            raise self._crashed(self._exit_cause or "stop requested", stopped=True, loading=True)
        if self._level:
            self._send_quietly({"op": "pressure", "level": self._level})
        self._state = RunnerState.READY
        return ReadyInfo(
            pid=proc.pid or 0,
            load_seconds=self._clock() - began,
            measured=self.measure(),
            facts=dict(facts),
        )

    async def _abandon_start(self, *, crashed: bool) -> None:
        """Reap a worker whose start failed; its error already explains why."""
        await self._shut_down(grace=min(self._settings.stop_grace, 2.0))
        if crashed:
            self._state = RunnerState.CRASHED

    async def stop(self, grace: float) -> None:
        async with self._stop_lock:
            if self._proc is None:
                self._state = RunnerState.STOPPED
                return
            await self._shut_down(grace)

    async def _shut_down(self, grace: float) -> None:
        if not self._exited.is_set():
            self._state = RunnerState.STOPPING
            self._send_quietly({"op": "stop"})
            for sig in (signal.SIGTERM, signal.SIGKILL):
                if await self._wait_exit(grace):
                    break
                log.warning(
                    "runner for %s (pid %s) did not exit within %g s; sending %s",
                    self.spec.id,
                    self._proc.pid if self._proc else None,
                    grace,
                    sig.name,
                )
                self._signal(sig)
            else:
                await self._wait_exit(None)
        if self._reader is not None:
            self._reader.join(timeout=5.0)  # it ends right after posting the exit
        if self._conn is not None:
            self._conn.close()
        self._state = RunnerState.STOPPED

    async def _wait_exit(self, timeout: float | None) -> bool:
        try:
            await asyncio.wait_for(self._exited.wait(), timeout)
        except TimeoutError:
            return False
        return True

    def _signal(self, sig: signal.Signals) -> None:
        if self._proc is None or self._exited.is_set():
            return  # gone already (and its Process object closed)
        if sig is signal.SIGKILL:
            self._sent_kill = True
            self._proc.kill()
        else:
            self._proc.terminate()

    # ---- requests ----------------------------------------------------------------------

    async def request(self, kind: str, payload: Payload) -> AsyncIterator[dict[str, Any]]:
        if self._state is not RunnerState.READY:
            raise self._not_ready()
        rid = next(self._ids)
        channel: asyncio.Queue[Any] = asyncio.Queue()
        self._channels[rid] = channel
        answered = False
        try:
            # A send to a dead process is fine: the exit notice arrives on the channel.
            self._send_quietly({"op": "run", "id": rid, "kind": kind, "payload": payload})
            while True:
                msg = await channel.get()
                if isinstance(msg, _Exited):
                    answered = True
                    raise self._crashed(msg.cause, stopped=msg.stopped)
                event = msg.get("event")
                if event == "delta":
                    yield msg["data"]
                elif event == "done":
                    answered = True
                    yield {"type": "done", **msg["data"]}
                    return
                elif event == "error":
                    answered = True
                    raise ElbowroomError.from_wire(msg["error"])
        finally:
            self._channels.pop(rid, None)
            if not answered:  # the consumer left early (client gone): stop the work
                self._send_quietly({"op": "cancel", "id": rid})

    async def stats(self) -> dict[str, Any]:
        if self._state is not RunnerState.READY or self._loop is None:
            return {}
        waiter: asyncio.Future[dict[str, Any]] = self._loop.create_future()
        self._stats_waiters.append(waiter)
        if not self._send_quietly({"op": "stats"}):
            return {}
        try:
            # shield: a late answer must still pop this waiter, keeping answers in order
            return await asyncio.wait_for(asyncio.shield(waiter), STATS_TIMEOUT)
        except TimeoutError:
            return {}

    def set_pressure(self, level: int) -> None:
        self._level = int(level)
        if self._state in (RunnerState.STARTING, RunnerState.READY):
            self._send_quietly({"op": "pressure", "level": self._level})
        for watcher in list(self._pressure_watchers):
            try:
                watcher(self._level)
            except Exception:
                log.exception("a pressure watcher of %s failed", self.spec.id)

    def watch_pressure(self, watcher: Callable[[int], None]) -> Callable[[], None]:
        """Call ``watcher(level)`` on every pressure change until the returned function is
        called: a request relayed from the engine's socket (runtime/engine_events.py) aborts
        on it."""
        self._pressure_watchers.add(watcher)
        if self._level:
            watcher(self._level)
        return lambda: self._pressure_watchers.discard(watcher)

    def watch_notices(self, watcher: Callable[[dict[str, Any]], None]) -> Callable[[], None]:
        """Call ``watcher(data)`` on every notice the engine sends unasked (a preempted relayed
        stream: server/stream/resume.py) until the returned function is called."""
        self._notice_watchers.add(watcher)
        return lambda: self._notice_watchers.discard(watcher)

    async def exit_within(self, timeout: float) -> str | None:
        """The exit cause, once the death of the process has been seen (None if it is still
        alive after ``timeout`` seconds). A relayed request sees its engine's socket close a
        moment before this reader thread reaps the process."""
        return self._exit_cause if await self._wait_exit(timeout) else None

    def measure(self) -> ProcessMemory:
        pid = self.pid
        if pid is None:
            return ZERO_PROCESS_MEMORY
        try:
            return measure_tree(pid)
        except (ProcessLookupError, FileNotFoundError, PermissionError):
            return ZERO_PROCESS_MEMORY

    # ---- the reader thread and what it posts to the loop -------------------------------

    def _read(self, conn: Connection, proc: BaseProcess) -> None:
        """Reader thread: forward messages until the process is gone, then reap it."""
        sentinel = proc.sentinel
        try:
            while True:
                ready = wait([conn, sentinel])
                if conn not in ready:
                    break  # exited; messages it sent before dying are drained below
                self._post(self._dispatch_all, conn.recv())
        except (EOFError, OSError):
            pass
        try:
            while conn.poll():
                self._post(self._dispatch_all, conn.recv())
        except (EOFError, OSError):
            pass
        proc.join()  # reap: no zombie; the pipe is closed, so the process is exiting
        # A SIGKILL we sent is ours, whatever the counter says
        after = None if self._sent_kill else oom_kill_count()
        self._post(self._exited_now, describe_exit(proc.exitcode, (self._oom_before, after)))

    def _post(self, fn: Callable[..., None], *args: Any) -> None:
        assert self._loop is not None
        # A closed loop raises RuntimeError: nobody is listening any more.
        with contextlib.suppress(RuntimeError):
            self._loop.call_soon_threadsafe(fn, *args)

    def _dispatch_all(self, msg: dict[str, Any]) -> None:
        """One message, or a batch of them (the worker batches what piles up)."""
        if "batch" in msg:
            for one in msg["batch"]:
                self._dispatch(one)
        else:
            self._dispatch(msg)

    def _dispatch(self, msg: dict[str, Any]) -> None:
        event = msg.get("event")
        if "id" in msg:
            channel = self._channels.get(msg["id"])
            if channel is not None:
                channel.put_nowait(msg)
            elif event != "delta":  # a cancelled request's late answer
                log.debug(
                    "runner for %s: request %s ended after its consumer left: %s",
                    self.spec.id,
                    msg["id"],
                    msg.get("data", msg.get("error")),
                )
        elif event == "ready":
            if self._ready is not None and not self._ready.done():
                self._ready.set_result(msg.get("data") or {})
        elif event == "load_failed":
            if self._ready is not None and not self._ready.done():
                self._ready.set_exception(ElbowroomError.from_wire(msg["error"]))
        elif event == "notice":
            for watcher in list(self._notice_watchers):
                try:
                    watcher(msg.get("data") or {})
                except Exception:
                    log.exception("a notice watcher of %s failed", self.spec.id)
        elif event == "stats":
            while self._stats_waiters:
                waiter = self._stats_waiters.popleft()
                if not waiter.done():
                    waiter.set_result(msg.get("data") or {})
                    break
        else:
            log.warning("runner for %s sent an unknown message %r", self.spec.id, msg)

    def _exited_now(self, cause: str) -> None:
        self._exit_cause = cause
        self._exited.set()
        if self._proc is not None:
            # The reader reaped it. A spawned child's Popen holds two pipe fds until the
            # Process object is collected, and a stopped runner often sits in a reference
            # cycle (a stream's frame, a Relay) that only a full collection frees:
            # the soak benchmark counted 4 such fds after every idle-out. Release them now.
            self._proc.close()
        stopped = self._state is RunnerState.STOPPING
        if self._ready is not None and not self._ready.done():
            self._ready.set_exception(self._crashed(cause, stopped=stopped, loading=True))
        for channel in self._channels.values():
            channel.put_nowait(_Exited(cause, stopped))
        for waiter in self._stats_waiters:
            if not waiter.done():
                waiter.set_result({})
        self._stats_waiters.clear()
        if self._state is RunnerState.STARTING:
            self._state = RunnerState.CRASHED
        elif self._state is RunnerState.READY:
            self._state = RunnerState.CRASHED
            log.error("runner for %s died (%s)", self.spec.id, cause)
            try:
                self._on_exit(self, cause)
            except Exception:
                log.exception("on_exit callback for %s failed", self.spec.id)

    # ---- helpers -----------------------------------------------------------------------

    def _send_quietly(self, msg: dict[str, Any]) -> bool:
        conn = self._conn
        if conn is None or self._exited.is_set():
            return False
        try:
            with self._send_lock:
                conn.send(msg)
        except (BrokenPipeError, EOFError, OSError):
            return False  # the process is gone; the reader thread reports how
        return True

    def _crashed(
        self, cause: str, *, stopped: bool = False, loading: bool = False
    ) -> RunnerCrashed:
        what = "was stopped" if stopped else "died"
        where = " while loading" if loading else ""
        return RunnerCrashed(
            f"runner for {self.spec.id} {what}{where} ({cause}); the request failed. "
            f"The next request starts the model again.",
            code="runner_crashed",
            details={"exit_cause": cause},
        )

    def _not_ready(self) -> ElbowroomError:
        if self._exit_cause is not None:
            return self._crashed(self._exit_cause)
        return Unavailable(
            f"runner for {self.spec.id} is {self._state.value}, not ready", retry_after=1.0
        )
