"""The head's side of a node: its latest memory reading, and runners that live there.

``RemoteRunner`` implements ``runtime.protocol.Runner`` by calling the node's
``NodeAgent``, so a per-node ``Scheduler`` drives remote models exactly as it drives local
ones: the same byte-based budget, eviction and refusals, fed by ``Node.snapshot`` (the
node's own probe, refreshed every ``cluster_poll`` seconds) and by each runner's bytes as
the node measured them.

A node that dies shows up two ways, whichever comes first: an in-flight call to its agent
fails (Ray's actor death), or the poll fails. Either marks the node gone; every runner
there fails its requests at once with RunnerCrashed naming the node, and the cluster
scheduler places those models elsewhere on their next request.
"""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import logging
import threading
import time
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass, field
from typing import Any, Protocol

from elbowroom.cluster.relay import Pulled, Source, Streamed, client_mode
from elbowroom.engines.options import EngineOptions
from elbowroom.engines.requests import Payload
from elbowroom.errors import ElbowroomError, EngineError, RunnerCrashed, Unavailable
from elbowroom.memory.types import ZERO_PROCESS_MEMORY, ProcessMemory, Snapshot
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

log = logging.getLogger("elbowroom.cluster")

_keys = itertools.count(1)


def _ray_errors() -> tuple[type[BaseException], ...]:
    import ray.exceptions as rex

    return (rex.RayActorError, rex.ActorDiedError, rex.ActorUnavailableError, rex.NodeDiedError)


def lost(node: Node, what: str, exc: BaseException) -> str:
    """Why ``node`` is taken for gone, in elbowroom's words: the node, what failed, and
    that Ray no longer reaches its agent. Ray's own exception goes to the log only."""
    log.debug("node %s: %s failed: %r", node.name, what, exc)
    return (
        f"node {node.name} stopped answering: {what} failed, because Ray no longer "
        "reaches elbowroom's agent there (the node, its raylet or the agent is gone)"
    )


async def watch_exit(node: Node, key: str, exited: Callable[[str], None]) -> None:
    """Wait for the process ``key`` on ``node`` to end and report its cause to ``exited``
    (a runner and a split's share alike); a node that is gone is marked so instead."""
    try:
        cause = await node.agent.wait_exit.remote(key)
    except _ray_errors() as exc:
        node.mark_gone(lost(node, f"watching process {key.split('#')[0]}", exc))
        return
    if cause is not None:
        exited(f"{cause} on node {node.name}")


def _task_error() -> type[BaseException]:
    import ray.exceptions as rex

    return rex.RayTaskError


def _with_timeout() -> tuple[type[BaseException], ...]:
    return (TimeoutError, *_ray_errors())


@dataclass(slots=True)
class Reading:
    snapshot: Snapshot
    agent_bytes: int
    runners: dict[str, ProcessMemory] = field(default_factory=dict)


class Node:
    """One Ray node as the head sees it. Not frozen: it holds the latest reading."""

    def __init__(self, node_id: str, name: str, agent: Any, reading: Reading) -> None:
        self.id = node_id
        self.name = name
        self.agent = agent
        self.reading = reading
        # Held while a reading is replaced, and by the node's monitor while it takes the
        # snapshot and our usage: both must come from the same reading (Monitor.pair).
        self.lock = threading.Lock()
        self.alive = True
        self.gone_cause: str | None = None
        self.gone_at: float | None = None  # wall clock (time.time()) when it was marked gone
        self._runners: set[_OnNode] = set()
        self._on_gone: list[Callable[[Node], None]] = []
        # Runners made by another factory, by model id: a split model's share on this node
        # (cluster.share.ShareRunner), registered by the router before its load.
        self.factories: dict[str, RunnerFactory] = {}

    # ---- what the node's Scheduler and Monitor are given --------------------------------

    def snapshot(self) -> Snapshot:
        return self.reading.snapshot

    def agent_bytes(self) -> int:
        return self.reading.agent_bytes

    def runners_bytes(self) -> int:
        return sum(m.resident for m in self.reading.runners.values()) + self.agent_bytes()

    def runner_factory(self, spec: ModelSpec, on_exit: ExitCallback) -> Runner:
        make = self.factories.get(spec.id)
        if make is not None:
            return make(spec, on_exit)
        return RemoteRunner(spec, on_exit, node=self)

    def track(self, runner: _OnNode) -> None:
        """``runner`` lives on this node: its requests fail at once if the node dies."""
        self._runners.add(runner)

    # ---- liveness ---------------------------------------------------------------------

    async def refresh(self) -> None:
        try:
            data = await self.agent.poll.remote()
        except _ray_errors() as exc:
            self.mark_gone(lost(self, "reading its memory", exc))
            return
        with self.lock:
            self.reading = Reading(data["snapshot"], data["agent_bytes"], data["runners"])

    def on_gone(self, callback: Callable[[Node], None]) -> None:
        self._on_gone.append(callback)

    def mark_gone(self, cause: str) -> None:
        if not self.alive:
            return
        self.alive = False
        self.gone_cause = cause
        self.gone_at = time.time()
        log.error("%s; its models fail over to other nodes on their next request", cause)
        for runner in list(self._runners):
            runner.node_gone(cause)
        for callback in self._on_gone:
            callback(self)

    def forget(self, runner: _OnNode) -> None:
        self._runners.discard(runner)


class _OnNode(Protocol):
    def node_gone(self, cause: str) -> None: ...


class RemoteRunner(RunnerStatus):
    """A model's runner on another node, through that node's agent."""

    def __init__(self, spec: ModelSpec, on_exit: ExitCallback, *, node: Node) -> None:
        super().__init__()
        self.spec = spec
        self.node = node
        self._on_exit = on_exit
        self._key = f"{spec.id}#{next(_keys)}"
        self._pid: int | None = None
        self._exited = asyncio.Event()
        self._watch: asyncio.Task[None] | None = None
        node.track(self)

    @property
    def pid(self) -> int | None:
        return None if self._exited.is_set() else self._pid

    async def start(self, options: EngineOptions) -> ReadyInfo:
        if self._state is not RunnerState.NEW:
            raise RuntimeError(f"runner for {self.spec.id} was already started")
        if not self.node.alive:
            raise self._crashed(self.node.gone_cause or "node gone", loading=True)
        self._state = RunnerState.STARTING
        try:
            answer = await self.node.agent.start.remote(self._key, self.spec, options)
        except _ray_errors() as exc:
            self._state = RunnerState.CRASHED
            self.node.mark_gone(lost(self.node, f"starting {self.spec.id}", exc))
            raise self._crashed(self.node.gone_cause or "node gone", loading=True) from None
        except _task_error() as exc:  # a bug in the agent, not the model: say where
            self._state = RunnerState.STOPPED
            self.node.forget(self)
            raise EngineError(
                f"the elbowroom agent on node {self.node.name} failed to start "
                f"{self.spec.id}: {exc}"
            ) from None
        except asyncio.CancelledError:
            await self._stop_remote(1.0)
            raise
        if "error" in answer:
            self._state = RunnerState(answer.get("state", "stopped"))
            self.node.forget(self)
            raise ElbowroomError.from_wire(answer["error"])
        ready: ReadyInfo = answer["ready"]
        self._pid = ready.pid
        if self._state is not RunnerState.STARTING:  # node died while it loaded
            raise self._crashed(self._exit_cause or "stop requested", loading=True)
        self._state = RunnerState.READY
        self.node.reading.runners[self._key] = ready.measured
        self._watch = asyncio.create_task(
            watch_exit(self.node, self._key, self._exited_now), name=f"watch-{self._key}"
        )
        return ready

    def node_gone(self, cause: str) -> None:
        self._exited_now(cause)

    def _exited_now(self, cause: str) -> None:
        if self._exited.is_set():
            return
        self._exit_cause = cause
        self._exited.set()
        self.node.forget(self)
        was = self._state
        if was in (RunnerState.STOPPING, RunnerState.STOPPED):
            return
        self._state = RunnerState.CRASHED
        if self.node.alive:  # the agent keeps a dead runner's supervisor until told
            with contextlib.suppress(Exception):
                self.node.agent.stop.remote(self._key, 0.1)
        if was is RunnerState.READY:
            log.error("runner for %s died (%s)", self.spec.id, cause)
            try:
                self._on_exit(self, cause)
            except Exception:
                log.exception("on_exit callback for %s failed", self.spec.id)

    async def request(self, kind: str, payload: Payload) -> AsyncIterator[dict[str, Any]]:
        if self._state is not RunnerState.READY:
            raise self._not_ready()
        source: Source
        if client_mode():
            try:
                source = await Pulled.open(self.node.agent, self._key, kind, payload)
            except _ray_errors() as exc:
                self.node.mark_gone(lost(self.node, f"a request to {self.spec.id}", exc))
                raise self._crashed(self.node.gone_cause or "node gone") from None
        else:
            source = Streamed(self.node.agent, self._key, kind, payload)
        exited = asyncio.ensure_future(self._exited.wait())
        answered = False
        try:
            while True:
                nxt = asyncio.ensure_future(source.next())
                await asyncio.wait({nxt, exited}, return_when=asyncio.FIRST_COMPLETED)
                if not nxt.done():  # the runner or its node died: fail now, not at Ray's pace
                    nxt.cancel()
                    answered = True
                    raise self._crashed(self._exit_cause or "exited")
                try:
                    msg = nxt.result()
                except _ray_errors() as exc:
                    answered = True
                    self.node.mark_gone(lost(self.node, f"a request to {self.spec.id}", exc))
                    raise self._crashed(self.node.gone_cause or "node gone") from None
                if msg is None:
                    answered = True
                    return
                if "error" in msg:
                    answered = True
                    raise ElbowroomError.from_wire(msg["error"])
                item = msg["item"]
                yield item
                if item.get("type") == "done":
                    answered = True
                    return
        finally:
            exited.cancel()
            if not answered:  # the consumer left early: cancel the work on the node
                with contextlib.suppress(Exception):
                    source.cancel()

    async def stop(self, grace: float) -> None:
        if self._state in (RunnerState.NEW, RunnerState.STOPPED):
            self._state = RunnerState.STOPPED
            return
        self._state = RunnerState.STOPPING
        await self._stop_remote(grace)
        self._state = RunnerState.STOPPED

    async def _stop_remote(self, grace: float) -> None:
        # The exit watch is left to end by itself (the agent answers it once the process
        # is stopped): a cancelled call is an error in Ray Client's reply thread.
        if self.node.alive:
            try:
                await asyncio.wait_for(self.node.agent.stop.remote(self._key, grace), 4 * grace + 5)
            except _with_timeout() as exc:
                log.warning("stopping %s on node %s: %r", self.spec.id, self.node.name, exc)
        self.node.reading.runners.pop(self._key, None)
        self.node.forget(self)
        self._exited.set()

    def measure(self) -> ProcessMemory:
        # While it loads too: the node's reading has it, and bytes left out of ours would
        # look like another process growing (the guard's trend).
        if self._state not in (RunnerState.STARTING, RunnerState.READY):
            return ZERO_PROCESS_MEMORY
        return self.node.reading.runners.get(self._key, ZERO_PROCESS_MEMORY)

    async def stats(self) -> dict[str, Any]:
        if self._state is not RunnerState.READY:
            return {}
        try:
            result: dict[str, Any] = await asyncio.wait_for(
                self.node.agent.stats.remote(self._key), STATS_TIMEOUT
            )
        except _with_timeout():
            return {}
        return result

    def set_pressure(self, level: int) -> None:
        if self._state in (RunnerState.STARTING, RunnerState.READY) and self.node.alive:
            self.node.agent.set_pressure.remote(self._key, int(level))

    def _crashed(self, cause: str, *, loading: bool = False) -> RunnerCrashed:
        where = " while loading" if loading else ""
        if not self.node.alive:  # the node, not the model: say so, and what comes next
            return RunnerCrashed(
                f"{cause}. The request to {self.spec.id} failed{where}; the next request "
                f"places {self.spec.id} on another node (no crash backoff: the model did "
                "not crash).",
                code="runner_crashed",
                details={"exit_cause": cause, "node": self.node.name, "node_gone": True},
            )
        return RunnerCrashed(
            f"runner for {self.spec.id} on node {self.node.name} died{where} ({cause}); "
            "the request failed. The next request places the model again.",
            code="runner_crashed",
            details={"exit_cause": cause, "node": self.node.name},
        )

    def _not_ready(self) -> ElbowroomError:
        if self._exit_cause is not None:
            return self._crashed(self._exit_cause)
        return Unavailable(
            f"runner for {self.spec.id} is {self._state.value}, not ready", retry_after=1.0
        )
