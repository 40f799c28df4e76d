"""Join a Ray cluster and build the router's per-node services (``serve --cluster``).

Only imported when ``Settings.cluster`` is set: one machine never imports Ray.

For every live Ray node: a ``NodeAgent`` actor pinned there (node affinity, no CPU
reserved: it only relays), then on the head a ``Scheduler`` fed by that node's probe, a
``Monitor`` sampling it and a ``PressureGuard`` acting on that node's models. A watcher
polls every node each ``cluster_poll`` seconds: new readings, nodes that joined (used from
then on), nodes that left (their models fail over).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from typing import TYPE_CHECKING, Any, cast

from elbowroom.cluster.agent import NodeAgent
from elbowroom.cluster.remote import Node, Reading, _ray_errors
from elbowroom.cluster.router import ClusterScheduler, NodeEntry
from elbowroom.cluster.share import NodeCatalog, share_id
from elbowroom.config import Settings
from elbowroom.errors import ElbowroomError
from elbowroom.scheduler.events import EventLog

if TYPE_CHECKING:
    from elbowroom.guard.guard import PressureGuard
    from elbowroom.memory.monitor import Monitor

log = logging.getLogger("elbowroom.cluster")

AGENT_START_TIMEOUT = 60.0


class ClusterError(ElbowroomError):
    """The cluster cannot be joined; the message names the address and the fix."""


def _import_ray() -> Any:
    try:
        import ray
    except ImportError as exc:
        raise ClusterError(
            "--cluster needs Ray: pip install 'elbowroom[cluster]' (on every node)"
        ) from exc
    return ray


# Ray Client's per-client server sometimes dies as the proxy forks it (a gRPC race,
# ray-project/ray#63202: "Initialization failure from server"); a new connection works.
CLIENT_ATTEMPTS = 3


class _NotOurs(logging.Filter):
    """Ray's warnings that say nothing to an elbowroom user: the server handles SIGTERM
    itself (it joins from a worker thread, where Ray cannot install its handler)."""

    def filter(self, record: logging.LogRecord) -> bool:
        return not record.getMessage().startswith("SIGTERM handler is not set")


def quiet_ray() -> None:
    """Keep Ray's own noise out of the server's log: the SIGTERM warning above, and the
    error reports Ray prints to every driver (a raylet that died comes with its last 20
    log lines, ``[state-dump]`` and all), which become one line of elbowroom's log each.
    What a node's death means for requests is said by elbowroom (cluster.remote.lost)."""
    import ray._private.worker as worker

    logging.getLogger("ray._private.worker").addFilter(_NotOurs())
    printer = getattr(worker, "print_to_stdstream", None)
    if printer is None or getattr(printer, "elbowroom", False):
        return

    def to_log(data: dict[str, Any], ignore_prefix: bool = False) -> None:
        if data.get("pid") != "raylet":  # not an error report: Ray's own printing
            printer(data, ignore_prefix)
            return
        for text in data.get("lines") or ():
            first = next((line for line in str(text).splitlines() if line.strip()), "")
            first = first.split(" Last ")[0].strip()  # "Last 20 lines of the Raylet logs:"
            log.warning("Ray reports: %s (the rest is in Ray's logs)", first[:300])

    to_log.elbowroom = True  # type: ignore[attr-defined]
    worker.print_to_stdstream = to_log


def join(address: str) -> Any:
    ray = _import_ray()
    quiet_ray()
    attempts = CLIENT_ATTEMPTS if address.startswith("ray://") else 1
    for attempt in range(1, attempts + 1):
        if ray.is_initialized():
            break
        try:
            ray.init(
                address=address,
                namespace="elbowroom",
                log_to_driver=False,
                configure_logging=False,
            )
        except (ConnectionError, RuntimeError, ValueError) as exc:
            if attempt < attempts and "Initialization failure from server" in str(exc):
                log.warning("Ray Client could not start a server for us (%s); retrying", exc)
                ray.shutdown()
                continue
            raise ClusterError(
                f"cannot join the Ray cluster at {address!r}: {exc}. Start one with "
                "`ray start --head` (docs/cluster.md), or give its address"
            ) from exc
    return ray


def _names(nodes: list[dict[str, Any]]) -> dict[str, str]:
    """node id -> its address, or address/id-prefix where several nodes share one."""
    ips = [n["NodeManagerAddress"] for n in nodes]
    return {
        n["NodeID"]: (
            n["NodeManagerAddress"]
            if ips.count(n["NodeManagerAddress"]) == 1
            else f"{n['NodeManagerAddress']}/{n['NodeID'][:6]}"
        )
        for n in nodes
    }


class ClusterServices:
    """The router plus what keeps it current; ``build`` makes it, ``close`` ends it."""

    def __init__(self, settings: Settings, catalog: Any, measured: Any) -> None:
        self.settings = settings
        self._catalog = catalog
        self._measured = measured
        self.events = EventLog()
        self.router = ClusterScheduler(settings, catalog, events=self.events)
        self._watcher: asyncio.Task[None] | None = None
        self._ray: Any = None

    async def build(self) -> ClusterScheduler:
        assert self.settings.cluster is not None
        self._ray = await asyncio.to_thread(join, self.settings.cluster)
        await self._discover()
        if not self.router.live():
            raise ClusterError(f"the Ray cluster at {self.settings.cluster!r} has no live node")
        self.router.closer = self.close
        await self.router.start()
        self._watcher = asyncio.create_task(self._watch(), name="elbowroom-cluster-watch")
        return self.router

    async def close(self) -> None:
        if self._watcher is not None:
            self._watcher.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._watcher
        for e in self.router.nodes.values():
            if e.monitor is not None:
                await asyncio.to_thread(e.monitor.stop)
            if e.guard is not None:
                await e.guard.close()
        await self.router.close_schedulers()
        for e in self.router.live():
            with contextlib.suppress(Exception):
                await asyncio.wait_for(e.node.agent.shutdown.remote(self.settings.stop_grace), 30)
            with contextlib.suppress(Exception):
                self._ray.kill(e.node.agent)

    # ---- membership ------------------------------------------------------------------

    async def _discover(self) -> None:
        ray_nodes = [n for n in await asyncio.to_thread(self._ray.nodes) if n.get("Alive")]
        alive_ids = {n["NodeID"] for n in ray_nodes}
        for entry in list(self.router.nodes.values()):
            if entry.node.alive and entry.node.id not in alive_ids:
                entry.node.mark_gone(f"node {entry.node.name} left the cluster")
        names = _names(ray_nodes)
        for n in ray_nodes:
            known = self.router.nodes.get(n["NodeID"])
            if known is not None and known.node.alive:
                continue
            try:
                node = await self._start_node(n["NodeID"], names[n["NodeID"]])
            except Exception as exc:
                # Ray lists a dead node as alive until its heartbeats are missed: the gone
                # node stays in the table, marked gone, until a new agent runs there.
                first = next(iter(str(exc).strip().splitlines()), type(exc).__name__)
                log.warning("node %s: cannot start its agent: %s", names[n["NodeID"]], first)
                continue
            if known is not None:  # its agent died but the node is back: start afresh
                await self._retire(known)
            self.router.add(await self._services_for(node))

    async def _start_node(self, node_id: str, name: str) -> Node:
        from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy

        actor_cls = self._ray.remote(NodeAgent)
        agent = actor_cls.options(
            num_cpus=0,
            max_restarts=0,
            max_concurrency=1000,
            scheduling_strategy=NodeAffinitySchedulingStrategy(node_id, soft=False),
        ).remote(self.settings)
        data = await asyncio.wait_for(agent.poll.remote(), AGENT_START_TIMEOUT)
        reading = Reading(data["snapshot"], data["agent_bytes"], data["runners"])
        node = Node(node_id, name, agent, reading)
        node.on_gone(lambda gone: self.router.node_gone(gone.id))
        log.info("node %s joined (%s)", name, node_id)
        return node

    async def _services_for(self, node: Node) -> NodeEntry:
        from elbowroom.guard.adapter import SchedulerTarget
        from elbowroom.guard.guard import PressureGuard
        from elbowroom.scheduler.loop import Scheduler

        # Preloads and pins are placed by the router, not loaded on every node.
        # A split model's share serves as many requests at once as the model's engine.
        share_slots = tuple(
            f"{share_id(name.strip())}={n}"
            for name, _, n in (item.partition("=") for item in self.settings.model_slots)
        )
        per_node = self.settings.replace(
            preload=(),
            pin=(),
            override_memory=None,
            model_slots=(*self.settings.model_slots, *share_slots),
        )
        catalog = NodeCatalog(self._catalog)  # + the shares of split models on this node
        scheduler = Scheduler(
            per_node,
            catalog,
            probe=node.snapshot,
            runner_factory=node.runner_factory,
            measured=self._measured,
            server_usage=node.agent_bytes,
            events=self.events,
        )
        # The node scheduler's monitor samples that node's reading (its own usage: the
        # node's runners as the node measured them, plus the agent).
        monitor = scheduler.monitor
        monitor.pair(node.lock)
        guard = PressureGuard(
            SchedulerTarget(scheduler),
            enabled=self.settings.memory_guard,
            budget=monitor.cfg,
            horizon=self.settings.pressure_horizon,
        )
        monitor.subscribe(guard.on_sample)
        # No fast kernel watch (pressure_events): that node's kernel is not this one's; its
        # readings come every cluster_poll seconds.
        await guard.start()
        monitor.start()
        return NodeEntry(node, scheduler, guard=guard, monitor=monitor, catalog=catalog)

    async def _retire(self, entry: NodeEntry) -> None:
        if entry.monitor is not None:
            await asyncio.to_thread(entry.monitor.stop)
        if entry.guard is not None:
            await entry.guard.close()
        with contextlib.suppress(Exception):
            await entry.scheduler.close()
        self.router.nodes.pop(entry.node.id, None)

    async def _watch(self) -> None:
        rounds = 0
        while True:
            await asyncio.sleep(self.settings.cluster_poll)
            live = self.router.live()
            await asyncio.gather(*(e.node.refresh() for e in live), return_exceptions=True)
            rounds += 1
            if rounds % 10 == 0 or any(not e.node.alive for e in live):
                try:
                    await self._discover()
                except _ray_errors() as exc:
                    first = next(iter(str(exc).strip().splitlines()), type(exc).__name__)
                    log.warning("cluster membership check failed: %s", first)
                except Exception:
                    log.exception("cluster membership check failed")


async def start_cluster(
    settings: Settings, catalog: Any, measured: Any
) -> tuple[ClusterScheduler, Monitor, PressureGuard]:
    """The scheduler (the router), monitor and guard of a Ray cluster, which the server
    builds its services from (``server.app.start_services``, which also loads the pins)."""
    from elbowroom.cluster.views import ClusterGuard, ClusterMonitor

    cluster = ClusterServices(settings, catalog, measured)
    try:
        router = await cluster.build()
    except BaseException:
        await cluster.close()
        raise
    # The views have the monitor's and the guard's surface the server reads (duck types
    # over every node's own monitor and guard), not their classes.
    return (
        router,
        cast("Monitor", ClusterMonitor(router)),
        cast("PressureGuard", ClusterGuard(router)),
    )
