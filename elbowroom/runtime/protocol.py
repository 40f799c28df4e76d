"""The contract between the scheduler and a model's runner (the supervisor side).

The runner's process is started with the spec and the options of its engine's kind
(engines/options.py). Wire messages on the pipe between supervisor (parent) and worker
(child) are dicts; a request's payload is typed (engines/requests.py: ``TextRequest``,
``CloseTicket``, ``TranscribeRequest``, ``SpeechRequest`` or ``EmbedRequest``):

parent -> child: {"op": "run", "id": int, "kind": str, "payload": Payload}
                 {"op": "cancel", "id": int}
                 {"op": "stats"}          -> child answers {"event": "stats", "data": dict}
                 {"op": "pressure", "level": int}   (0 normal, 1 soft, 2 hard)
                 {"op": "stop"}
child -> parent: {"event": "ready", "data": {...load facts...}}
                 {"event": "load_failed", "error": ElbowroomError.to_wire()}
                 {"id": int, "event": "delta", "data": dict}
                 {"id": int, "event": "done", "data": dict}
                 {"id": int, "event": "error", "error": ElbowroomError.to_wire()}
                 {"batch": [message, ...]}  (messages that piled up, in order)
"""

from __future__ import annotations

import enum
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass, field
from typing import Any, Protocol

from elbowroom.engines.options import EngineOptions
from elbowroom.engines.requests import Payload
from elbowroom.memory.types import ProcessMemory
from elbowroom.models.spec import ModelSpec


class RunnerState(enum.StrEnum):
    NEW = "new"
    STARTING = "starting"
    READY = "ready"
    STOPPING = "stopping"
    STOPPED = "stopped"
    CRASHED = "crashed"


# How long a runner's stats request waits for its answer (local or over the cluster).
STATS_TIMEOUT = 5.0


class RunnerStatus:
    """``state`` and ``exit_cause`` as every Runner reports them: the implementations
    (the local Supervisor, a cluster node's RemoteRunner, a split's ShareRunner) start NEW
    with no exit cause and set ``_state`` and ``_exit_cause``; these read them."""

    def __init__(self) -> None:
        self._state = RunnerState.NEW
        self._exit_cause: str | None = None

    @property
    def state(self) -> RunnerState:
        return self._state

    @property
    def exit_cause(self) -> str | None:
        return self._exit_cause


@dataclass(frozen=True, slots=True)
class ReadyInfo:
    pid: int
    load_seconds: float
    measured: ProcessMemory  # the runner's process tree right after load
    facts: dict[str, Any] = field(default_factory=dict)  # from Engine.load (n_ctx, ...)


class Runner(Protocol):
    """One model in one OS process. Implemented by runtime.supervisor.Supervisor."""

    spec: ModelSpec

    @property
    def pid(self) -> int | None: ...

    @property
    def state(self) -> RunnerState: ...

    @property
    def exit_cause(self) -> str | None:
        """After a crash: 'exit code 1', 'killed by signal SIGKILL', ..."""
        ...

    async def start(self, options: EngineOptions) -> ReadyInfo:
        """Spawn the worker and wait for its ready handshake (load_timeout). Raises the
        worker's load error (e.g. InsufficientMemory, EngineError) or RunnerCrashed."""
        ...

    def request(self, kind: str, payload: Payload) -> AsyncIterator[dict[str, Any]]:
        """Send one request. Yields each "delta" event's data; the final item is
        {"type": "done", **result}. Raises the ElbowroomError carried by an error event,
        or RunnerCrashed (naming exit code/signal) at once if the process dies.
        Closing the iterator early (client gone) cancels the work in the worker."""
        ...

    async def stop(self, grace: float) -> None:
        """Ask the worker to exit; SIGTERM after ``grace``; SIGKILL after another grace."""
        ...

    def measure(self) -> ProcessMemory:
        """Bytes the runner's process tree holds now (zero once stopped)."""
        ...

    async def stats(self) -> dict[str, Any]:
        """Engine stats (e.g. KV cache), {} if unavailable."""
        ...

    def set_pressure(self, level: int) -> None:
        """Tell the worker the current pressure level (checked every 16 tokens)."""
        ...


# Called by a runner when its process exits on its own (crash, OOM kill, kill -9).
ExitCallback = Callable[["Runner", str], None]
RunnerFactory = Callable[[ModelSpec, ExitCallback], Runner]
