"""The Ray actor on each node: it owns that node's runner processes and reads its memory.

One ``NodeAgent`` per node, pinned there with node affinity. It runs the same code a
single machine does: ``memory.probe`` for the node's snapshot (host, cgroup, PSI, GPUs;
``ELBOWROOM_OVERRIDE_MEMORY`` in the node's environment makes it look smaller) and a
``runtime.supervisor.Supervisor`` per model, whose worker process talks to it over the
usual pipe. The head reaches a runner through the agent: start, a streamed request, stop,
stats, pressure; the agent is the relay between Ray and the pipe.

Errors cross as ``ElbowroomError.to_wire`` dicts (never as pickled exceptions), so the
head raises exactly the error the runner raised. When a runner dies on its own,
``wait_exit`` returns its cause; when the node dies, the call itself fails on the head.
"""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import os
import signal
import socket
import subprocess
import sys
import time
import types
from collections.abc import AsyncIterator, Mapping
from multiprocessing.connection import Connection
from multiprocessing.process import BaseProcess
from pathlib import Path
from typing import Any

from elbowroom.cluster.relay import END
from elbowroom.cluster.rpc import rpc_server_args
from elbowroom.config import Settings
from elbowroom.engines.options import EngineOptions
from elbowroom.engines.requests import Payload, TextRequest, TextTicket
from elbowroom.errors import ElbowroomError
from elbowroom.memory.probe import default_probe
from elbowroom.memory.process import measure_pid
from elbowroom.memory.types import ZERO_PROCESS_MEMORY, ProcessMemory, Snapshot
from elbowroom.models.spec import ModelSpec
from elbowroom.rpc_bind import RpcBindError
from elbowroom.runtime.engine_events import text_events
from elbowroom.runtime.protocol import Runner
from elbowroom.runtime.supervisor import Supervisor, WorkerTarget, spawn_worker
from elbowroom.runtime.worker import worker_main
from elbowroom.units import parse_size

OVERRIDE_ENV = "ELBOWROOM_OVERRIDE_MEMORY"
RPC_HOST_ENV = "ELBOWROOM_RPC_HOST"
RPC_READY_TIMEOUT = 60.0


def node_settings(head: Settings, environ: Mapping[str, str] | None = None) -> Settings:
    """The head's settings with this node's own memory override and RPC address: a node's
    environment decides how large it looks and where its RPC server may listen (the
    head's values describe the head's machine)."""
    env = os.environ if environ is None else environ
    raw = env.get(OVERRIDE_ENV)
    return head.replace(
        override_memory=parse_size(raw) if raw else None,
        rpc_host=env.get(RPC_HOST_ENV) or head.rpc_host,
    )


def spawn_bare(
    conn: Connection,
    spec: ModelSpec,
    options: EngineOptions,
    *,
    target: WorkerTarget = worker_main,
) -> BaseProcess:
    """``spawn_worker`` with the Ray worker's ``__main__`` hidden while the child starts.

    multiprocessing's spawn runs the parent's main module again in the child (as
    ``__mp_main__``); in an actor that is Ray's worker script, so every runner on a node
    imported Ray: +25 MiB anonymous and +18 MiB file-backed per runner, measured on a
    simulated cluster (benchmarks/cluster_memory.py, issue 27), which no estimate counted
    (SmolLM2 was 9.5 % over its prediction there). The runner needs nothing of it."""
    main = sys.modules["__main__"]
    sys.modules["__main__"] = types.ModuleType("__main__")
    try:
        return spawn_worker(conn, spec, options, target=target)
    finally:
        sys.modules["__main__"] = main


class NodeAgent:
    def __init__(self, settings: Settings) -> None:
        self._settings = node_settings(settings)
        self._probe = default_probe(self._settings)
        self._runners: dict[str, Supervisor] = {}
        self._exits: dict[str, asyncio.Future[str | None]] = {}
        self._rpc: dict[str, subprocess.Popen[bytes]] = {}
        self._pulls: dict[str, tuple[asyncio.Queue[dict[str, Any]], asyncio.Task[None]]] = {}
        self._pull_ids = itertools.count(1)

    # ---- the node --------------------------------------------------------------------

    async def info(self) -> dict[str, Any]:
        return {
            "hostname": socket.gethostname(),
            "pid": os.getpid(),
            "override_memory": self._settings.override_memory,
        }

    async def missing_files(self, paths: list[str]) -> list[str]:
        """Those of ``paths`` that are not files on this node (the split's RPC build)."""
        return [p for p in paths if not Path(p).is_file()]

    async def poll(self) -> dict[str, Any]:
        """One reading: the node's snapshot, the agent's own bytes, each runner's bytes."""
        return await asyncio.to_thread(self._reading)

    def _reading(self) -> dict[str, Any]:
        """The runners are measured right before the probe, in one go (one thread, no
        await between): the head takes ``snapshot − runners − agent`` as what other
        processes hold, so a runner measured even a tenth of a second after the snapshot
        while it loads (hundreds of MiB/s) would show up as another process shrinking,
        then growing — a trend the pressure guard answers by unloading an idle model."""
        runners = {key: sup.measure() for key, sup in list(self._runners.items())}
        for key, proc in list(self._rpc.items()):
            with contextlib.suppress(ProcessLookupError, OSError):
                runners[key] = measure_pid(proc.pid)
        snap: Snapshot = self._probe()
        try:
            agent = measure_pid(os.getpid()).anonymous
        except (ProcessLookupError, OSError):
            agent = 0
        return {"snapshot": snap, "agent_bytes": agent, "runners": runners}

    # ---- one runner ------------------------------------------------------------------

    async def start(self, key: str, spec: ModelSpec, options: EngineOptions) -> dict[str, Any]:
        loop = asyncio.get_running_loop()
        exit_future: asyncio.Future[str | None] = loop.create_future()

        def on_exit(_runner: Runner, cause: str) -> None:
            if not exit_future.done():
                exit_future.set_result(cause)

        sup = Supervisor(spec, on_exit, settings=self._settings, spawn=spawn_bare)
        self._runners[key] = sup
        self._exits[key] = exit_future
        try:
            ready = await sup.start(options)
        except ElbowroomError as exc:
            self._forget(key)
            return {"error": exc.to_wire(), "state": sup.state.value}
        return {"ready": ready}

    async def request(self, key: str, kind: str, payload: Payload) -> AsyncIterator[dict[str, Any]]:
        """Streamed to the head: ``{"item": ...}`` per delta/done, ``{"error": wire}`` last
        on failure. Cancelled by the head (client gone): the supervisor cancels the work."""
        sup = self._runners.get(key)
        if sup is None:
            yield {"error": _gone(key)}
            return
        try:
            if kind == "open" and isinstance(payload, TextRequest):
                # The engine's socket is on this node: read its events here and send them
                # on (the ticket says so: its socket is None), as MLX sends its own.
                async for event in text_events(sup, payload):
                    if isinstance(event, TextTicket):
                        yield {"item": {"type": "ticket", "ticket": event}}
                    else:
                        yield {"item": {"type": "events", "data": event}}
                yield {"item": {"type": "done"}}
                return
            async for item in sup.request(kind, payload):
                yield {"item": item}
        except ElbowroomError as exc:
            yield {"error": exc.to_wire()}

    # ---- the same, pulled (Ray Client has no streaming generators: cluster/relay.py) ----

    async def open_request(self, key: str, kind: str, payload: Payload) -> str:
        rid = f"{key}/{next(self._pull_ids)}"
        queue: asyncio.Queue[dict[str, Any]] = asyncio.Queue()

        async def pump() -> None:
            try:
                async for msg in self.request(key, kind, payload):
                    queue.put_nowait(msg)
            finally:
                queue.put_nowait(END)

        self._pulls[rid] = (queue, asyncio.get_running_loop().create_task(pump()))
        return rid

    async def next_items(self, rid: str, wait: float) -> list[dict[str, Any]]:
        """What arrived for ``rid``, waiting up to ``wait`` s for the first ([] if none)."""
        pull = self._pulls.get(rid)
        if pull is None:
            return [{"error": _gone(rid)}, END]
        queue = pull[0]
        try:
            items = [await asyncio.wait_for(queue.get(), wait)]
        except TimeoutError:
            return []
        while not queue.empty():
            items.append(queue.get_nowait())
        if items[-1].get("end"):
            del self._pulls[rid]
        return items

    async def cancel_request(self, rid: str) -> None:
        pull = self._pulls.pop(rid, None)
        if pull is not None:
            pull[1].cancel()  # closes the runner's request: the supervisor cancels the work

    async def wait_exit(self, key: str) -> str | None:
        """The cause when the runner dies on its own; None when it was stopped."""
        fut = self._exits.get(key)
        if fut is None:
            return None
        return await fut

    async def stop(self, key: str, grace: float) -> None:
        sup = self._runners.get(key)
        if sup is not None:
            await sup.stop(grace)
        fut = self._exits.get(key)
        if fut is not None and not fut.done():
            fut.set_result(None)
        self._forget(key)

    async def measure(self, key: str) -> ProcessMemory:
        sup = self._runners.get(key)
        return sup.measure() if sup is not None else ZERO_PROCESS_MEMORY

    async def stats(self, key: str) -> dict[str, Any]:
        sup = self._runners.get(key)
        return await sup.stats() if sup is not None else {}

    async def set_pressure(self, key: str, level: int) -> None:
        sup = self._runners.get(key)
        if sup is not None:
            sup.set_pressure(level)

    async def shutdown(self, grace: float) -> None:
        """Stop every runner and RPC server (the head is closing)."""
        await asyncio.gather(*(self.stop(k, grace) for k in list(self._runners)))
        await asyncio.gather(*(self.stop_rpc(k, grace) for k in list(self._rpc)))

    # ---- one llama.cpp RPC server (a share of a split model) -----------------------------

    async def start_rpc(self, key: str, binary: str) -> dict[str, Any]:
        """Start ``rpc-server`` on this node's ``rpc_host`` (loopback or private only) and
        wait until it accepts connections; ``{"endpoint": "host:port"}`` or an error."""
        host = self._settings.rpc_host
        try:
            port = _free_port(host)
            args = rpc_server_args(
                Path(binary), host, port, self._settings.threads or os.cpu_count()
            )
        except (RpcBindError, OSError) as exc:
            return {"error": _engine_error(f"cannot start an RPC server here: {exc}")}
        if not Path(binary).is_file():
            return {"error": _engine_error(f"no rpc-server at {binary}: run scripts/rpc_engine.sh")}
        proc = subprocess.Popen(args, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        self._rpc[key] = proc
        loop = asyncio.get_running_loop()
        exit_future: asyncio.Future[str | None] = loop.create_future()
        self._exits[key] = exit_future
        deadline = time.monotonic() + RPC_READY_TIMEOUT
        while not await asyncio.to_thread(_accepts, host, port):
            if proc.poll() is not None or time.monotonic() > deadline:
                await self.stop_rpc(key, 1.0)
                return {"error": _engine_error(f"rpc-server on {host}:{port} did not start")}
            await asyncio.sleep(0.05)  # a child's port opening: nothing to wait on but it

        async def watch() -> None:
            code = await asyncio.to_thread(proc.wait)
            if not exit_future.done():
                exit_future.set_result(f"rpc-server {_exit_text(code)}")

        asyncio.get_running_loop().create_task(watch())
        try:
            measured = measure_pid(proc.pid)
        except (ProcessLookupError, OSError):
            measured = ZERO_PROCESS_MEMORY
        return {"endpoint": f"{host}:{port}", "pid": proc.pid, "measured": measured}

    async def stop_rpc(self, key: str, grace: float) -> None:
        proc = self._rpc.pop(key, None)
        fut = self._exits.pop(key, None)
        if fut is not None and not fut.done():
            fut.set_result(None)
        if proc is None or proc.poll() is not None:
            return
        proc.send_signal(signal.SIGTERM)
        try:
            await asyncio.to_thread(proc.wait, grace)
        except subprocess.TimeoutExpired:
            proc.kill()
            await asyncio.to_thread(proc.wait)

    def _forget(self, key: str) -> None:
        self._runners.pop(key, None)
        self._exits.pop(key, None)


def _gone(key: str) -> dict[str, Any]:
    return {
        "class": "RunnerCrashed",
        "message": f"runner {key} is not on this node any more; the next request restarts it",
        "code": "runner_crashed",
        "details": {},
    }


def _free_port(host: str) -> int:
    with socket.socket(socket.AF_INET6 if ":" in host else socket.AF_INET) as sock:
        sock.bind((host, 0))
        port: int = sock.getsockname()[1]
        return port


def _accepts(host: str, port: int) -> bool:
    try:
        with socket.create_connection((host, port), timeout=0.5):
            return True
    except OSError:
        return False


def _engine_error(message: str) -> dict[str, Any]:
    return {"class": "EngineError", "message": message, "code": "rpc_failed", "details": {}}


def _exit_text(code: int) -> str:
    if code < 0:
        with contextlib.suppress(ValueError):
            return f"killed by signal {signal.Signals(-code).name}"
    return f"exited with code {code}"
