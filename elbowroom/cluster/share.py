"""A node's share of a split model, as a resident of that node's scheduler.

Each node of a split holds a run of the model's layers in an ``rpc-server`` (and the home
node also the engine that drives them). That share is a model of the node's own
``Scheduler``, under the id ``<model>~share``: loaded with ``Scheduler.host`` and the
split's plan (its predicted bytes reserved before the RPC server starts, idle models of
that node evicted by the same byte-based order to make room, a 507 naming the node when
it cannot fit), measured once started (the node's poll reads the RPC server and, at home,
the engine), listed in that node's ``ps``, held busy by every request on the split
(``Scheduler.hold``), and stopped like any model: by the node's pressure guard, a load
that evicts it, keep-alive or an unload. A share that stops, for whatever reason, takes
the whole split down (``ShareHooks.on_stop``): its requests fail with the cause and every
node's share is unloaded, so the memory comes back on every node.

``ShareRunner`` is the share's ``Runner``: it starts and stops the RPC server through the
node's agent, forwards the pressure level the node's guard gives it to the split's engine
(hard aborts the split's generations), and reports the RPC server's exit as a crash.
"""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import logging
import time
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from elbowroom.cluster.remote import Node, _ray_errors, lost, watch_exit
from elbowroom.cluster.split_plan import SplitPlan
from elbowroom.engines.options import EngineOptions
from elbowroom.engines.requests import Payload
from elbowroom.errors import ElbowroomError, EngineError, ModelNotFound, RunnerCrashed
from elbowroom.memory.types import ZERO_PROCESS_MEMORY, ProcessMemory
from elbowroom.models.spec import Footprint, ModelSpec
from elbowroom.runtime.protocol import ExitCallback, ReadyInfo, Runner, RunnerState, RunnerStatus
from elbowroom.scheduler.inputs import ModelCatalog
from elbowroom.scheduler.policy import LoadRequest
from elbowroom.scheduler.sizing import Plan

log = logging.getLogger("elbowroom.cluster")

SHARE_ENGINE = "rpc-share"
SHARE_SUFFIX = "~share"  # never in a catalog id ([a-z0-9][a-z0-9._-]*)

_keys = itertools.count(1)


def share_id(model: str) -> str:
    return model + SHARE_SUFFIX


def share_spec(spec: ModelSpec, plan: SplitPlan, node: str) -> ModelSpec:
    cost = plan.shares[node]
    return ModelSpec(
        id=share_id(spec.id),
        kind=spec.kind,
        engine=SHARE_ENGINE,
        path=spec.path,
        size_bytes=cost.weights,
        holding=spec.holding,  # the split model's keep-alive rule
        source="split",
        description=f"layers {cost.first}-{cost.first + cost.layers - 1} of {spec.id}",
    )


def share_plan(plan: SplitPlan, node: str) -> Plan:
    """The scheduler's plan for ``node``'s share: the split plan's predicted bytes, all of
    them but the idle RPC server's arriving once the engine loads (the working part, kept
    reserved until the measurement grows past it)."""
    cost = plan.shares[node]
    fp = Footprint(
        weights=cost.weights,
        file_backed=0,
        anonymous=cost.total,
        kv_bytes=cost.kv,
        n_ctx=plan.n_ctx,
        slots=plan.slots,
        kv_type=plan.kv_type,
        compute=cost.compute,
        working=cost.total - cost.at_start,
    )
    request = LoadRequest(share_id(plan.model), cost.total)
    return Plan(request, fp, plan.n_ctx, plan.kv_type, plan.slots)


class NodeCatalog:
    """The cluster's catalog plus the shares of split models placed on one node: the node's
    scheduler looks both up by id (its lanes, loads, unloads and its guard's unloads)."""

    def __init__(self, catalog: ModelCatalog) -> None:
        self._catalog = catalog
        self.shares: dict[str, ModelSpec] = {}

    def get(self, model_id: str) -> ModelSpec:
        spec = self.shares.get(model_id)
        if spec is not None:
            return spec
        if model_id.endswith(SHARE_SUFFIX):
            raise ModelNotFound(f"no share {model_id!r} on this node")
        return self._catalog.get(model_id)


@dataclass(slots=True)
class ShareHooks:
    """What a share's runner needs from its split."""

    binary: Path  # rpc-server
    on_stop: Callable[[str], None]  # the share stopped or died: take the split down
    on_level: Callable[[int], None]  # the node's guard gave the share a pressure level
    engine: Runner | None = None  # at home: the split's engine, measured with the share


class ShareRunner(RunnerStatus):
    """A node's share: its ``rpc-server``, through the node's agent."""

    def __init__(
        self, spec: ModelSpec, on_exit: ExitCallback, *, node: Node, hooks: ShareHooks
    ) -> None:
        super().__init__()
        self.spec = spec
        self.node = node
        self.hooks = hooks
        self._on_exit = on_exit
        self._key = f"rpc:{spec.id}#{next(_keys)}"
        self._pid: int | None = None
        self.endpoint: str | None = None
        self._done = False
        self._watch: asyncio.Task[None] | None = None
        node.track(self)

    @property
    def pid(self) -> int | None:
        return None if self._done else self._pid

    async def start(self, options: EngineOptions) -> ReadyInfo:
        if not self.node.alive:
            raise self._crashed(self.node.gone_cause or "node gone")
        self._state = RunnerState.STARTING
        began = time.monotonic()
        try:
            answer = await self.node.agent.start_rpc.remote(self._key, str(self.hooks.binary))
        except _ray_errors() as exc:
            self._state = RunnerState.CRASHED
            self.node.mark_gone(lost(self.node, f"starting the RPC server of {self.spec.id}", exc))
            raise self._crashed(self.node.gone_cause or "node gone") from None
        except asyncio.CancelledError:
            await self._stop_rpc(1.0)
            raise
        if "error" in answer:
            self._state = RunnerState.STOPPED
            self._done = True
            self.node.forget(self)
            raise ElbowroomError.from_wire(answer["error"])
        self._pid = int(answer["pid"])
        self.endpoint = str(answer["endpoint"])
        measured: ProcessMemory = answer["measured"]
        self.node.reading.runners[self._key] = measured
        if self._state is not RunnerState.STARTING:  # its node died meanwhile
            raise self._crashed(self._exit_cause or "stopped")
        self._state = RunnerState.READY
        self._watch = asyncio.create_task(
            watch_exit(self.node, self._key, self.node_gone), name=f"watch-{self._key}"
        )
        return ReadyInfo(self._pid, time.monotonic() - began, measured, {"endpoint": self.endpoint})

    def node_gone(self, cause: str) -> None:
        """The RPC server or its node died: a crash of this share, and the split is down."""
        if self._done:
            return
        self._done = True
        self._exit_cause = cause
        self.node.forget(self)
        was, self._state = self._state, RunnerState.CRASHED
        if was is RunnerState.READY:
            log.error("share %s died (%s)", self.spec.id, cause)
            try:
                self._on_exit(self, cause)
            except Exception:
                log.exception("on_exit callback for %s failed", self.spec.id)
        self.hooks.on_stop(f"its RPC server died: {cause}")

    async def request(self, kind: str, payload: Payload) -> AsyncIterator[dict[str, Any]]:
        # The split's engine serves the requests; a share only holds layers.
        raise EngineError(f"{self.spec.id} is a share of a split model; it serves no requests")
        yield {}  # pragma: no cover (makes this an async generator, as the protocol says)

    async def stop(self, grace: float) -> None:
        if self._state in (RunnerState.NEW, RunnerState.STOPPED) or self._done:
            self._state = RunnerState.STOPPED
            return
        self._state = RunnerState.STOPPING
        await self._stop_rpc(grace)
        self._state = RunnerState.STOPPED
        self.hooks.on_stop(f"its share on node {self.node.name} was unloaded")

    async def _stop_rpc(self, grace: float) -> None:
        self._done = True
        # The exit watch is left to end by itself (the agent answers it once the process
        # is stopped): a cancelled call is an error in Ray Client's reply thread.
        if self.node.alive:
            with contextlib.suppress(TimeoutError, *_ray_errors()):
                await asyncio.wait_for(
                    self.node.agent.stop_rpc.remote(self._key, grace), 4 * grace + 5
                )
        self.node.reading.runners.pop(self._key, None)
        self.node.forget(self)

    def measure(self) -> ProcessMemory:
        if self._state is not RunnerState.READY:
            return ZERO_PROCESS_MEMORY
        mem = self.node.reading.runners.get(self._key, ZERO_PROCESS_MEMORY)
        if self.hooks.engine is not None:
            mem = mem + self.hooks.engine.measure()
        return mem

    async def stats(self) -> dict[str, Any]:
        return {"endpoint": self.endpoint} if self.endpoint is not None else {}

    def set_pressure(self, level: int) -> None:
        self.hooks.on_level(int(level))

    def _crashed(self, cause: str) -> RunnerCrashed:
        return RunnerCrashed(
            f"the share of {self.spec.id.removesuffix(SHARE_SUFFIX)} on node {self.node.name} "
            f"could not start ({cause})",
            code="runner_crashed",
            details={"exit_cause": cause, "node": self.node.name},
        )
