"""The runner process's main: owns one engine and serves requests from the pipe.

The reader thread receives every message at once, so a cancel, a pressure level or a stats
question is seen while a request is running. Requests run on the main thread one at a time
(``Engine.run``), which is what most engine libraries expect, unless the engine says after
loading that it serves several at once (``max_concurrent`` > 1, the LLM engine's slots):
then each request gets a thread of a pool that size, and the engine batches them.
Wire messages are described in runtime/protocol.py.

The engine is loaded with the options of its kind (engines/options.py), as the scheduler
built them. It reads the current pressure level through the callable it was made with
(``create_engine(name, pressure)``): 0 (normal), 1 (soft) or 2 (hard), updated by the
parent's ``pressure`` op.
"""

from __future__ import annotations

import atexit
import contextlib
import functools
import logging
import os
import queue
import signal
import sys
import threading
from concurrent.futures import ThreadPoolExecutor
from multiprocessing.connection import Connection
from typing import Any

from elbowroom.engines.base import Engine
from elbowroom.engines.options import EngineOptions
from elbowroom.engines.registry import create_engine
from elbowroom.engines.requests import Payload
from elbowroom.errors import ElbowroomError, EngineError
from elbowroom.models.spec import ModelSpec

log = logging.getLogger("elbowroom.runner")

ORPHAN_GRACE = 10.0  # seconds a runner whose parent vanished waits for its request to end
_STOP = object()
MAX_BATCH = 256  # messages in one pipe write at most


class PressureLevel:
    """The runner's current memory pressure level, as the parent last sent it."""

    def __init__(self) -> None:
        self.value = 0

    def __call__(self) -> int:
        return self.value


def worker_main(conn: Connection, spec: ModelSpec, options: EngineOptions) -> None:
    """Entry point of the runner process (multiprocessing spawn target)."""
    # Ctrl-C in a terminal reaches the whole process group: the server decides how runners
    # stop, so the runner must not die on it on its own.
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    # llama.cpp's OpenMP threads busy-wait for each other between ops; with another program
    # on the cores that spinning collapses decode speed. A bounded spin measured the same on
    # a quiet machine and ~30 % faster beside two CPU hogs. Read when the engine's library
    # loads, so it is set before any engine import; a user's own value wins.
    os.environ.setdefault("GOMP_SPINCOUNT", "10000")
    logging.basicConfig(
        stream=sys.stderr,
        level=options.log_level.upper(),
        format=f"%(asctime)s runner[{spec.id}:{os.getpid()}] %(levelname)s %(message)s",
    )
    if options.memory_ceiling:
        _limit_memory(options.memory_ceiling)
    level = PressureLevel()
    try:
        engine = create_engine(spec.engine, level)
    except Exception as exc:
        _send_quietly(conn, {"event": "load_failed", "error": _wire(exc)})
        sys.exit(1)
    code = serve(conn, spec, options, engine, level)
    # The engine is closed and every message sent: skip the interpreter's teardown (module
    # finalizers, freeing every object one by one: ~0.2 s after an LLM), which is time a
    # swap waits before the next model may load. The atexit hooks still run (well under a
    # millisecond): multiprocessing's unlinks the named semaphores this process made
    # (tqdm's lock, which faster-whisper takes on every transcription); without it each
    # whisper runner left one in /dev/shm until the server exited.
    atexit._run_exitfuncs()
    logging.shutdown()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)


def _limit_memory(ceiling: int) -> None:
    """RLIMIT_DATA: an allocation past ``ceiling`` bytes of writable private memory fails
    in this runner (its load or request fails), instead of the host running out."""
    import resource

    try:
        _, hard = resource.getrlimit(resource.RLIMIT_DATA)
        if hard != resource.RLIM_INFINITY:
            ceiling = min(ceiling, hard)
        resource.setrlimit(resource.RLIMIT_DATA, (ceiling, hard))
    except (OSError, ValueError) as exc:  # a platform without it: the guard still watches
        logging.getLogger("elbowroom.runner").warning("no memory ceiling: %s", exc)


def serve(
    conn: Connection,
    spec: ModelSpec,
    options: EngineOptions,
    engine: Engine,
    level: PressureLevel | None = None,
) -> int:
    """Load ``engine`` and serve until stop or the parent goes away; return the exit code.
    ``level`` is what the engine reads the pressure level from."""
    return _Worker(conn, engine, level or PressureLevel()).serve(spec, options)


class _Worker:
    def __init__(self, conn: Connection, engine: Engine, level: PressureLevel) -> None:
        self.conn = conn
        self.engine = engine
        self.work: queue.SimpleQueue[Any] = queue.SimpleQueue()
        self.cancel_flags: dict[int, threading.Event] = {}
        self.flags_lock = threading.Lock()
        # Everything to the parent goes through one queue and one sender thread: messages
        # that pile up while the pipe is busy (several slots streaming at once) leave as one
        # batch, one pickle and one wake-up of the parent, instead of one per token.
        self.outbox: queue.SimpleQueue[Any] = queue.SimpleQueue()
        self.level = level
        self.loaded = threading.Event()
        if hasattr(
            engine, "notify"
        ):  # the engine's notices to the server (server/stream/resume.py)
            engine.notify = self._notice

    def serve(self, spec: ModelSpec, options: EngineOptions) -> int:
        sender = threading.Thread(target=self._send_loop, name="runner-sender", daemon=True)
        sender.start()
        try:
            return self._serve(spec, options)
        finally:
            self.outbox.put(_STOP)  # after everything queued before it
            sender.join(timeout=10.0)

    def _serve(self, spec: ModelSpec, options: EngineOptions) -> int:
        reader = threading.Thread(target=self._read, name="runner-reader", daemon=True)
        reader.start()
        try:
            facts = self.engine.load(spec, options)
        except Exception as exc:
            if not isinstance(exc, ElbowroomError):
                log.exception("load failed")
            self._send({"event": "load_failed", "error": _wire(exc)})
            return 1
        self.loaded.set()
        self._send({"event": "ready", "data": facts})
        log.info("ready: %s", facts)
        try:
            self._loop()
        finally:
            self.engine.close(process_exit=True)  # worker_main exits right after
        return 0

    def _send_loop(self) -> None:
        while True:
            batch = [self.outbox.get()]
            while len(batch) < MAX_BATCH:
                try:
                    batch.append(self.outbox.get_nowait())
                except queue.Empty:
                    break
            stop = batch[-1] is _STOP
            if stop:
                batch.pop()
            if len(batch) == 1:
                _send_quietly(self.conn, batch[0])
            elif batch:
                _send_quietly(self.conn, {"batch": batch})
            if stop:
                return

    def _loop(self) -> None:
        width = max(1, self.engine.max_concurrent)
        pool = ThreadPoolExecutor(width, thread_name_prefix="request") if width > 1 else None
        try:
            while True:
                item = self.work.get()
                if item is _STOP:
                    return
                if pool is None:
                    self._run(*item)
                else:
                    pool.submit(self._run, *item)
        finally:
            if pool is not None:
                pool.shutdown(wait=True)  # requests see their cancel flags set by _shutdown

    def _run(self, rid: int, kind: str, payload: Payload) -> None:
        with self.flags_lock:
            flag = self.cancel_flags.get(rid)
        if flag is None or flag.is_set():  # cancelled before it started: nobody waits
            self._drop_flag(rid)
            return
        try:
            emit = functools.partial(self._event, rid, "delta")
            result = self.engine.run(kind, payload, emit, flag.is_set)
            self._event(rid, "done", result)
        except Exception as exc:
            if not isinstance(exc, ElbowroomError):
                log.exception("request %s failed", rid)
            self._send({"id": rid, "event": "error", "error": _wire(exc)})
        finally:
            self._drop_flag(rid)

    def _read(self) -> None:
        """Reader thread: route every message; on EOF (parent gone) wind down."""
        while True:
            try:
                msg = self.conn.recv()
            except (EOFError, OSError):
                log.warning("parent went away; exiting")
                self._shutdown()
                # A request that ignores cancellation must not keep an orphan alive.
                timer = threading.Timer(ORPHAN_GRACE, os._exit, args=(1,))
                timer.daemon = True
                timer.start()
                return
            op = msg.get("op")
            if op == "run":
                with self.flags_lock:
                    self.cancel_flags[msg["id"]] = threading.Event()
                self.work.put((msg["id"], msg["kind"], msg["payload"]))
            elif op == "cancel":
                with self.flags_lock:
                    flag = self.cancel_flags.get(msg["id"])
                if flag is not None:
                    flag.set()
            elif op == "pressure":
                previous, self.level.value = self.level.value, int(msg["level"])
                if self.level.value > previous and self.loaded.is_set():
                    # Off the reader thread: saving state takes disk time.
                    args = (self.level.value,)
                    threading.Thread(target=self.engine.relieve, args=args, daemon=True).start()
            elif op == "stats":
                self._send({"event": "stats", "data": self._stats()})
            elif op == "stop":
                self._shutdown()
                return
            else:
                log.warning("unknown message %r", msg)

    def _stats(self) -> dict[str, Any]:
        if not self.loaded.is_set():
            return {}
        try:
            return self.engine.stats()
        except Exception:
            log.exception("stats failed")
            return {}

    def _shutdown(self) -> None:
        with self.flags_lock:
            for flag in self.cancel_flags.values():
                flag.set()
        self.work.put(_STOP)

    def _drop_flag(self, rid: int) -> None:
        with self.flags_lock:
            self.cancel_flags.pop(rid, None)

    def _notice(self, data: dict[str, Any]) -> None:
        self._send({"event": "notice", "data": data})

    def _event(self, rid: int, event: str, data: dict[str, Any]) -> None:
        self._send({"id": rid, "event": event, "data": data})

    def _send(self, msg: dict[str, Any]) -> None:
        self.outbox.put(msg)


def _send_quietly(conn: Connection, msg: dict[str, Any]) -> None:
    # A failure means the parent is gone; the reader thread sees EOF and winds down.
    with contextlib.suppress(OSError, EOFError):
        conn.send(msg)


def _wire(exc: BaseException) -> dict[str, Any]:
    if isinstance(exc, ElbowroomError):
        return exc.to_wire()
    return EngineError(f"{type(exc).__name__}: {exc}").to_wire()
