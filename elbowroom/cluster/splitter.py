"""One model larger than any node: split over the nodes with llama.cpp's RPC backend.

When placement refuses a GGUF model on every node, the router plans a split
(``split_plan.plan_split``: whole layers per node in proportion to each node's room, each
node's share predicted term by term). ``start_split`` then loads every node's share in
that node's own scheduler (``Scheduler.host``: reserved, evicting idle models there by the
same order, refused with a 507 naming the node; ``cluster.share``), each share starting
an ``rpc-server`` on its node's ``rpc_host`` (loopback or private only), and finally the
engine on the home node (the node with the most room): the ``llama-rpc`` engine, a
llama-server whose devices are those RPC servers in the same order, ``--tensor-split``
their layer counts.

The split is supervised like a runner: a share that stops (its node's guard, a load that
evicts it, keep-alive, an RPC server that dies, its node leaving) or an engine that dies
takes the whole split down: in-flight requests fail at once with the cause, and every
node's share is unloaded through its scheduler; the next request plans it again over the
nodes there are then.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import functools
import logging
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from elbowroom.cluster.remote import RemoteRunner
from elbowroom.cluster.share import (
    NodeCatalog,
    ShareHooks,
    ShareRunner,
    share_id,
    share_plan,
    share_spec,
)
from elbowroom.cluster.split_plan import SplitPlan
from elbowroom.engines.options import EngineOptions, RpcLlamaOptions
from elbowroom.engines.requests import Payload
from elbowroom.errors import ElbowroomError, InsufficientMemory, MemoryPressure, RunnerCrashed
from elbowroom.memory.types import Pressure, ProcessMemory
from elbowroom.models.spec import ModelSpec
from elbowroom.runtime.protocol import ExitCallback, ReadyInfo, Runner, RunnerState
from elbowroom.scheduler.loop import Scheduler

log = logging.getLogger("elbowroom.cluster")


@dataclass(slots=True)
class Share:
    """One node's share of a running split."""

    node: Any  # cluster.remote.Node
    scheduler: Scheduler
    guard: Any  # guard.guard.PressureGuard | None
    id: str
    runner: ShareRunner


@dataclass(slots=True)
class RunningSplit:
    plan: SplitPlan
    shares: list[Share] = field(default_factory=list)  # in device order, home first
    engine: SplitRunner | None = None
    levels: dict[str, int] = field(default_factory=dict)  # node name -> its guard's level
    busy: int = 0
    closed: bool = False
    cause: str | None = None

    @property
    def model(self) -> str:
        return self.plan.model

    def nodes(self) -> list[str]:
        return [s.node.id for s in self.shares]

    def pressed(self) -> list[str]:
        """The nodes whose guard told their share hard pressure."""
        return [n for n, lv in self.levels.items() if lv >= Pressure.HARD]

    def set_level(self, node: str, level: int) -> None:
        self.levels[node] = level
        if self.engine is not None and not self.closed:
            self.engine.set_pressure(max(self.levels.values(), default=0))


@dataclass(frozen=True, slots=True)
class NodeSlot:
    """What the router hands ``start_split`` for each node of the plan."""

    node: Any  # cluster.remote.Node
    scheduler: Scheduler
    catalog: NodeCatalog
    guard: Any = None


class SplitRunner:
    """The split's engine (a ``RemoteRunner`` on the home node) as the router hands it to a
    request: an answer cut by hard memory pressure names the node whose share is pressed
    (the engine only knows it was told level 2)."""

    def __init__(self, engine: RemoteRunner, running: RunningSplit) -> None:
        self.spec: ModelSpec = engine.spec
        self._engine = engine
        self._running = running

    @property
    def pid(self) -> int | None:
        return self._engine.pid

    @property
    def state(self) -> RunnerState:
        return self._engine.state

    @property
    def exit_cause(self) -> str | None:
        return self._engine.exit_cause

    async def start(self, options: EngineOptions) -> ReadyInfo:
        return await self._engine.start(options)

    async def request(self, kind: str, payload: Payload) -> AsyncIterator[dict[str, Any]]:
        try:
            async for item in self._engine.request(kind, payload):
                yield item
        except MemoryPressure as exc:
            nodes = self._running.pressed()
            if not nodes:
                raise
            raise MemoryPressure(
                f"{exc.message} (node {', '.join(nodes)}, which holds a share of the split "
                f"model {self._running.model}, is under hard memory pressure)",
                retry_after=exc.retry_after,
                code=exc.code,
                details={**exc.details, "nodes": nodes},
            ) from exc

    async def stop(self, grace: float) -> None:
        await self._engine.stop(grace)

    def measure(self) -> ProcessMemory:
        return self._engine.measure()

    async def stats(self) -> dict[str, Any]:
        return await self._engine.stats()

    def set_pressure(self, level: int) -> None:
        self._engine.set_pressure(level)

    def node_gone(self, cause: str) -> None:
        self._engine.node_gone(cause)


async def start_split(
    spec: ModelSpec,
    running: RunningSplit,
    slots: dict[str, NodeSlot],
    options: RpcLlamaOptions,
    bin_dir: Path,
    on_down: Callable[[RunningSplit, str], None],
    pin: bool | None = None,
) -> None:
    """Load every node's share (home first), then start the engine that uses them. Raises
    InsufficientMemory naming the node whose share cannot be made room for; the caller
    stops what was started (``stop_split``)."""
    plan = running.plan
    sid = share_id(spec.id)
    for name in plan.split.layers:
        slot = slots[name]
        hooks = ShareHooks(
            bin_dir / "rpc-server",
            on_stop=functools.partial(on_down, running),
            on_level=functools.partial(running.set_level, name),
        )
        slot.catalog.shares[sid] = share_spec(spec, plan, name)
        slot.node.factories[sid] = _share_factory(slot.node, hooks)
        try:
            await slot.scheduler.host(sid, share_plan(plan, name), pin=pin)
        except InsufficientMemory as exc:
            raise InsufficientMemory(
                f"cannot split {spec.id}: its share on node {name} does not fit there: "
                f"{exc.message}",
                code="insufficient_memory",
                details={"node": name, "share": plan.shares[name].to_dict(), **exc.details},
            ) from None
        runner = slot.scheduler.runner(sid)
        if not isinstance(runner, ShareRunner) or running.closed:
            raise RunnerCrashed(
                f"the split of {spec.id} went down while it started ({running.cause}); retry",
                code="runner_crashed",
            )
        running.shares.append(Share(slot.node, slot.scheduler, slot.guard, sid, runner))
    home = running.shares[0]

    def engine_died(_runner: Any, cause: str) -> None:
        on_down(running, f"its engine on node {home.node.name} died ({cause})")

    engine = home.node.runner_factory(dataclasses.replace(spec, engine="llama-rpc"), engine_died)
    assert isinstance(engine, RemoteRunner)
    home.runner.hooks.engine = engine  # measured with the home share from now on
    running.engine = SplitRunner(engine, running)
    async with contextlib.AsyncExitStack() as stack:
        # The shares are busy while the engine loads into them: no node's guard or load
        # takes one for an idle model meanwhile (hard pressure still aborts the start).
        for share in running.shares:
            await stack.enter_async_context(share.scheduler.hold(share.id))
        await engine.start(
            dataclasses.replace(
                options,
                n_ctx=plan.n_ctx,
                slots=plan.slots,
                rpc_servers=tuple(str(s.runner.endpoint) for s in running.shares),
                rpc_split=tuple(plan.split.layers.values()),
                llama_server=str(bin_dir / "llama-server"),
            )
        )
    if running.closed:
        raise RunnerCrashed(
            f"the split of {spec.id} went down while it started ({running.cause}); retry",
            code="runner_crashed",
        )
    if running.levels:  # a node's guard spoke while the engine loaded
        engine.set_pressure(max(running.levels.values()))
    log.info(
        "split %s over %s (layers %s)",
        spec.id,
        ", ".join(s.node.name for s in running.shares),
        list(plan.split.layers.values()),
    )


def _share_factory(node: Any, hooks: ShareHooks) -> Callable[[ModelSpec, ExitCallback], Runner]:
    def make(spec: ModelSpec, on_exit: ExitCallback) -> Runner:
        return ShareRunner(spec, on_exit, node=node, hooks=hooks)

    return make


async def stop_split(running: RunningSplit, grace: float) -> None:
    """Stop the engine, then unload every node's share through its scheduler (a share
    still held by a failing request goes as soon as it is released), and wait for each
    node's fresh reading: the next plan sees the memory back."""
    running.closed = True
    if running.engine is not None:
        try:
            await running.engine.stop(grace)
        except ElbowroomError as exc:
            log.warning("stopping the engine of %s: %s", running.model, exc)
    live = [s for s in running.shares if s.node.alive]
    await asyncio.gather(
        *(s.scheduler.unload(s.id, reason="split") for s in live), return_exceptions=True
    )
    await asyncio.gather(*(s.node.refresh() for s in live), return_exceptions=True)
