"""The cluster's scheduler: one ``Scheduler`` per node, and the placement between them.

Each node keeps the single-machine rules unchanged (its own budget from its own probe,
byte-based eviction, refusals, crash backoff, its own pressure guard). This router only
decides which node a model lives on (``placement.choose`` over every node's
``Scheduler.preview``), remembers it, and routes requests there. It has the public surface
the server uses of ``scheduler.loop.Scheduler`` (use, load, unload, ps, memory_report, ...).

A model stays on its node until it is unloaded there or the node is gone; then its next
request places it again. A node under hard pressure refuses new work for its models (503,
its guard's message) while other nodes keep serving.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections import Counter
from collections.abc import AsyncIterator, Awaitable, Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from elbowroom.cluster.pressure import cluster_pressure
from elbowroom.cluster.share import SHARE_SUFFIX, NodeCatalog
from elbowroom.cluster.split import SplitError
from elbowroom.cluster.split_plan import SplitPlan, plan_rooms, plan_split
from elbowroom.cluster.splitter import NodeSlot, RunningSplit, start_split, stop_split
from elbowroom.config import Settings
from elbowroom.engines.options import RpcLlamaOptions
from elbowroom.errors import ElbowroomError, InsufficientMemory, Unavailable
from elbowroom.memory.types import Pressure
from elbowroom.runtime.protocol import Runner
from elbowroom.scheduler.events import EventLog
from elbowroom.scheduler.loop import Scheduler
from elbowroom.scheduler.node_placement import ClusterRefusal, NodeOption, choose
from elbowroom.scheduler.policy import Evict, eviction_order
from elbowroom.scheduler.records import InFlightRequest
from elbowroom.units import format_size

log = logging.getLogger("elbowroom.cluster")

RPC_SETUP = "ELBOWROOM_RPC=1 scripts/setup.sh"  # builds the split's binaries (rpc_engine.sh)
GONE_SHOWN = 600.0  # s: a node that left stays in the node table, marked gone, this long


@dataclass(slots=True)
class NodeEntry:
    """A node with the services that run for it on the head."""

    node: Any  # cluster.remote.Node (or a test double with id/name/alive)
    scheduler: Scheduler
    guard: Any = None  # guard.guard.PressureGuard
    monitor: Any = None  # memory.monitor.Monitor
    # The node scheduler's catalog: the cluster's, plus the shares of split models here.
    catalog: NodeCatalog | None = None
    tasks: list[asyncio.Task[Any]] = field(default_factory=list)

    def level(self) -> Pressure:
        sample = self.monitor.latest if self.monitor is not None else None
        return sample.level if sample is not None else Pressure.NORMAL


class ClusterScheduler:
    def __init__(self, settings: Settings, catalog: Any, *, events: EventLog) -> None:
        self.settings = settings
        self._catalog = catalog
        self.events = events
        self.nodes: dict[str, NodeEntry] = {}
        self._homes: dict[str, str] = {}  # model id -> node id
        self._active: Counter[str] = Counter()  # model id -> requests routed, not finished
        self._place_lock = asyncio.Lock()
        self._splits: dict[str, RunningSplit] = {}  # models split over several nodes
        self._tasks: set[asyncio.Task[Any]] = set()
        # Set by connect.ClusterServices: closing the router ends monitors, guards, agents.
        self.closer: Callable[[], Awaitable[None]] | None = None

    # ---- membership --------------------------------------------------------------------

    def add(self, entry: NodeEntry) -> None:
        self.nodes[entry.node.id] = entry
        self.events.add("node", None, f"node {entry.node.name} joined the cluster")

    def node_gone(self, node_id: str) -> None:
        entry = self.nodes.get(node_id)
        if entry is None:
            return
        for model, home in list(self._homes.items()):
            if home == node_id:
                del self._homes[model]
        for running in list(self._splits.values()):
            if node_id in running.nodes():
                self._split_down(running, f"node {entry.node.name} left the cluster")
        self.events.add("node", None, f"node {entry.node.name} left the cluster")

    def live(self) -> list[NodeEntry]:
        return [e for e in self.nodes.values() if e.node.alive]

    @property
    def loads_paused(self) -> bool:
        """Whether no live node takes a new load: each has its loads paused by its own
        pressure guard (while one node takes loads, the next load goes there). The one
        answer that ``/api/memory`` and ``/api/guard`` give on a cluster."""
        live = self.live()
        return bool(live) and all(e.scheduler.loads_paused for e in live)

    @property
    def counters(self) -> Counter[str]:
        total: Counter[str] = Counter()
        for e in self.nodes.values():
            total.update(e.scheduler.counters)
        return total

    # ---- lifetime ------------------------------------------------------------------------

    async def start(self) -> None:
        for e in self.nodes.values():
            await e.scheduler.start()
        for model_id in self.settings.preload:
            try:
                await self.load(model_id)
            except Exception as exc:
                log.error("preload of %s failed: %s", model_id, exc)

    async def close(self) -> None:
        if self.closer is not None:
            closer, self.closer = self.closer, None
            await closer()
            return
        await self.close_schedulers()

    async def close_schedulers(self) -> None:
        splits, self._splits = list(self._splits.values()), {}
        await asyncio.gather(
            *(stop_split(r, self.settings.stop_grace) for r in splits), return_exceptions=True
        )
        await asyncio.gather(
            *(e.scheduler.close() for e in self.nodes.values()), return_exceptions=True
        )

    # ---- routing -------------------------------------------------------------------------

    @contextlib.asynccontextmanager
    async def use(self, model_id: str, *, keep_alive: float | None = None) -> AsyncIterator[Runner]:
        spec = self._catalog.get(model_id)
        entry = await self._home(spec.id)
        if isinstance(entry, RunningSplit):
            async with self._split_use(entry, keep_alive) as runner:
                yield runner
            return
        if entry.guard is not None:
            entry.guard.check_admission()  # that node is under hard pressure: 503
        self._active[spec.id] += 1
        try:
            async with entry.scheduler.use(spec.id, keep_alive=keep_alive) as runner:
                yield runner
        finally:
            self._active[spec.id] -= 1
            if not self._active[spec.id]:
                del self._active[spec.id]

    @contextlib.asynccontextmanager
    async def _split_use(
        self, running: RunningSplit, keep_alive: float | None
    ) -> AsyncIterator[Runner]:
        """A request on a split model holds its share on every node (in device order, so
        two requests never wait on each other): each node sees it busy and in flight (its
        guard may abort it), and its last use orders the shares for eviction there."""
        for share in running.shares:
            if share.guard is not None:
                share.guard.check_admission()  # a node of the split is under hard pressure
        async with contextlib.AsyncExitStack() as stack:
            for share in running.shares:
                await stack.enter_async_context(
                    share.scheduler.hold(share.id, keep_alive=keep_alive)
                )
            assert running.engine is not None
            running.busy += 1
            try:
                yield running.engine
            finally:
                running.busy -= 1

    def home_of(self, model_id: str) -> NodeEntry | None:
        node_id = self._homes.get(model_id)
        entry = self.nodes.get(node_id) if node_id is not None else None
        if entry is None or not entry.node.alive:
            return None
        held = entry.scheduler.state().get(model_id) is not None
        return entry if held or self._active[model_id] else None

    async def _home(self, model_id: str, pin: bool | None = None) -> NodeEntry | RunningSplit:
        running = self._splits.get(model_id)
        if running is not None:
            return running
        entry = self.home_of(model_id)
        if entry is not None:
            return entry
        async with self._place_lock:
            running = self._splits.get(model_id)  # split while this one waited
            if running is not None:
                return running
            entry = self.home_of(model_id)  # placed while this one waited
            if entry is not None:
                return entry
            try:
                entry = self._place(model_id)
            except InsufficientMemory as refusal:
                if not self.settings.cluster_split:
                    raise
                return await self._split(model_id, refusal, pin)
            self._homes[model_id] = entry.node.id
            return entry

    def _plan_split(
        self, model_id: str, refusal: InsufficientMemory
    ) -> tuple[SplitPlan, dict[str, int]]:
        """Layers in proportion to the room of each node not under hard pressure: the bytes
        free there now; if that does not fit, what evicting idle models would make free
        (each node's share then evicts its own least recently used idle models). Returns
        the plan and the rooms it was made with."""
        spec = self._catalog.get(model_id)
        rows = []
        for e in self.live():
            if e.level() is Pressure.HARD:
                continue
            available = int(e.scheduler.memory_report()["available"])
            evictable = sum(m.bytes for m in eviction_order(e.scheduler.state().models))
            rows.append((e.node.name, available, evictable))
        free, evict = plan_rooms(rows)
        try:
            if spec.gguf is None:
                raise SplitError(f"{model_id} is not a llama.cpp model")
            try:
                return plan_split(spec, self.settings, free), free
            except SplitError:
                return plan_split(spec, self.settings, evict), evict
        except SplitError as exc:
            raise InsufficientMemory(
                f"{_sentence(refusal.message)} A split over the nodes does not fit either: {exc}",
                code="insufficient_memory",
                details={**refusal.details, "split": str(exc)},
            ) from None

    async def _split(
        self, model_id: str, refusal: InsufficientMemory, pin: bool | None
    ) -> RunningSplit:
        """The model fits on no node: split it over them (docs/cluster.md), or refuse with
        both reasons."""
        from elbowroom.engines.llama_rpc import rpc_build_dir

        spec = self._catalog.get(model_id)
        if self._tasks:  # a split still being taken down: plan with its memory back
            await asyncio.gather(*list(self._tasks), return_exceptions=True)
        plan, rooms = self._plan_split(model_id, refusal)
        s = self.settings
        options = RpcLlamaOptions(
            threads=s.threads,
            kv_type=s.kv_type,
            cache_ram_bytes=0,
            kv_cache=False,  # the disk tier keys on one engine; a split has its own
            kv_block_tokens=s.kv_block_tokens,
        )
        slots = {e.node.name: self._slot(e) for e in self.live()}
        bin_dir = s.rpc_bin_dir or rpc_build_dir()
        await self._check_rpc_build(model_id, refusal, plan, slots, bin_dir)
        running = RunningSplit(plan)
        try:
            await start_split(spec, running, slots, options, bin_dir, self._split_down, pin)
        except BaseException:
            running.closed = True
            await asyncio.shield(stop_split(running, 2.0))
            raise
        self._splits[model_id] = running
        layers = dict(plan.split.layers)
        room = ", ".join(f"{n} {format_size(b)}" for n, b in rooms.items())
        self.events.add(
            "split", model_id, f"split {model_id} over {layers} (room: {room})",
            layers=layers, rooms=rooms,
        )  # fmt: skip
        return running

    async def _check_rpc_build(
        self,
        model_id: str,
        refusal: InsufficientMemory,
        plan: SplitPlan,
        slots: dict[str, NodeSlot],
        bin_dir: Path,
    ) -> None:
        """The model fits only split: every node of the plan needs the RPC build (the home
        node its llama-server too). Asked before anything is reserved; without it, a 507
        that says so and names the one command that enables splitting."""
        names = list(plan.split.layers)
        wanted = [str(bin_dir / "rpc-server")]
        asks = [
            slots[n].node.agent.missing_files.remote(
                [*wanted, str(bin_dir / "llama-server")] if i == 0 else wanted
            )
            for i, n in enumerate(names)
        ]
        answers = await asyncio.gather(*asks, return_exceptions=True)
        lacking = {}
        for name, answer in zip(names, answers, strict=True):
            if isinstance(answer, BaseException):
                raise Unavailable(
                    f"cannot split {model_id}: node {name} did not answer whether it has the "
                    "RPC build; retry",
                    retry_after=5.0,
                ) from None
            if answer:
                lacking[name] = list(answer)
        if not lacking:
            return
        layers = ", ".join(f"{n} {k} layers" for n, k in plan.split.layers.items())
        binaries = sorted({Path(p).name for paths in lacking.values() for p in paths})
        raise InsufficientMemory(
            f"{_sentence(refusal.message)} It fits only split over the nodes ({layers}), "
            f"and splitting needs llama.cpp's RPC build, which node(s) "
            f"{', '.join(lacking)} do not have (no {' or '.join(binaries)} in {bin_dir}). "
            f"To enable splitting, run `{RPC_SETUP}` on every node "
            "(5-40 min: it builds llama.cpp; docs/cluster.md), then retry.",
            code="split_unavailable",
            details={
                **refusal.details,
                "split_layers": dict(plan.split.layers),  # the plan that would fit
                "missing": lacking,
                "enable_split": RPC_SETUP,
            },
        )

    def _slot(self, e: NodeEntry) -> NodeSlot:
        if e.catalog is None:  # connect.ClusterServices gives every node its scheduler's
            raise RuntimeError(f"node {e.node.name} has no catalog its scheduler reads")
        return NodeSlot(e.node, e.scheduler, e.catalog, e.guard)

    def _split_down(self, running: RunningSplit, cause: str) -> None:
        """A part of a split stopped or died: fail its requests now, unload the rest on
        every node, forget it."""
        if running.closed:
            return
        running.closed = True
        running.cause = cause
        model = running.model
        if self._splits.get(model) is running:
            del self._splits[model]
        log.error("split of %s is down: %s", model, cause)
        self.events.add("crash", model, f"split of {model} is down: {cause}")
        if running.engine is not None:
            running.engine.node_gone(f"the split of {model} is down: {cause}")
        task = asyncio.get_running_loop().create_task(stop_split(running, 2.0))
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)

    def options(self, model_id: str) -> list[NodeOption]:
        out = []
        for e in self.nodes.values():
            if not e.node.alive:
                continue
            decision, request = e.scheduler.preview(model_id)
            report = e.scheduler.memory_report()
            newest = None
            if isinstance(decision, Evict):
                used = {m.id: m.last_used for m in e.scheduler.state().models}
                newest = max((used[i] for i in decision.ids if i in used), default=None)
            out.append(
                NodeOption(
                    node=e.node.id,
                    name=e.node.name,
                    decision=decision,
                    needed=request.needed,
                    available=int(report["available"]),
                    limit=int(report["ceiling"]),
                    pressure=e.level(),
                    evicts_used=newest,
                )
            )
        return out

    def _place(self, model_id: str) -> NodeEntry:
        chosen = choose(model_id, self.options(model_id))
        if isinstance(chosen, ClusterRefusal):
            raise InsufficientMemory(
                chosen.message(), code="insufficient_memory", details=chosen.details()
            )
        log.info(
            "placing %s on node %s (%s)", model_id, chosen.name, type(chosen.decision).__name__
        )
        self.events.add(
            "place", model_id, f"placed {model_id} on node {chosen.name}", node=chosen.name
        )
        return self.nodes[chosen.node]

    # ---- the admin surface ---------------------------------------------------------------

    async def load(self, model_id: str, *, pin: bool | None = None) -> dict[str, Any]:
        spec = self._catalog.get(model_id)
        entry = await self._home(spec.id, pin)
        if isinstance(entry, RunningSplit):
            for share in entry.shares:  # pin or unpin every share (never load one here)
                if pin is not None and share.scheduler.runner(share.id) is not None:
                    await share.scheduler.load(share.id, pin=pin)
            return {"id": spec.id, "loaded": True, "split": dict(entry.plan.split.layers)}
        self._active[spec.id] += 1  # holds the placement while it loads
        try:
            result = dict(await entry.scheduler.load(spec.id, pin=pin))
        finally:
            self._active[spec.id] -= 1
            if not self._active[spec.id]:
                del self._active[spec.id]
        return {**result, "node": entry.node.name}

    async def unload(self, model_id: str, *, reason: str = "explicit") -> dict[str, Any]:
        running = self._splits.pop(model_id, None)
        if running is not None:
            await stop_split(running, self.settings.stop_grace)
            return {"id": model_id, "unloaded": True, "split": True}
        entry = self.home_of(model_id)
        if entry is None:
            return {"id": model_id, "unloaded": False}
        result = dict(await entry.scheduler.unload(model_id, reason=reason))
        return {**result, "node": entry.node.name}

    def runner(self, model_id: str) -> Runner | None:
        if model_id in self._splits:
            return self._splits[model_id].engine
        entry = self.home_of(model_id)
        return entry.scheduler.runner(model_id) if entry is not None else None

    def inflight(self) -> list[InFlightRequest]:
        out = [r for e in self.live() for r in e.scheduler.inflight()]
        return sorted(out, key=lambda r: r.started_at)

    def ps(self) -> list[dict[str, Any]]:
        """Every node's rows (a split model's share on a node is a row of that node, id
        ``<model>~share``), then one row per split model over its shares."""
        rows = []
        shares: dict[tuple[str, str], dict[str, Any]] = {}
        for e in self.live():
            for row in e.scheduler.ps():
                row = {**row, "node": e.node.name}
                if row["id"].endswith(SHARE_SUFFIX):
                    row["share_of"] = row["id"].removesuffix(SHARE_SUFFIX)
                    shares[(e.node.name, row["id"])] = row
                rows.append(row)
        for model, running in self._splits.items():
            layers = dict(running.plan.split.layers)
            parts = [shares.get((s.node.name, s.id), {}) for s in running.shares]
            for part, share in zip(parts, running.shares, strict=True):
                part["layers"] = layers.get(share.node.name)
            engine = running.engine
            rows.append(
                {
                    "id": model,
                    "kind": "llm",
                    "engine": "llama-rpc",
                    "state": engine.state.value if engine is not None else "loading",
                    "busy": running.busy,
                    "node": "+".join(layers),
                    "split": layers,
                    "shares": [
                        {
                            "node": s.node.name,
                            "id": s.id,
                            "layers": layers.get(s.node.name),
                            "bytes": p.get("bytes", 0),
                            "predicted": p.get("predicted", 0),
                        }
                        for s, p in zip(running.shares, parts, strict=True)
                    ],
                    "bytes": sum(int(p.get("bytes", 0)) for p in parts),
                    "predicted": sum(int(p.get("predicted", 0)) for p in parts),
                    "rpc_pids": [s.runner.pid for s in running.shares],
                    "pid": engine.pid if engine is not None else None,
                    "n_ctx": running.plan.n_ctx,
                    "slots": running.plan.slots,
                }
            )
        return rows

    def pressure(self) -> dict[str, object]:
        return cluster_pressure({e.node.name: e.level() for e in self.live()}).to_dict()

    def memory_report(self) -> dict[str, Any]:
        """The worst node's report in the single-machine shape (what the dashboard, the
        metrics and `ps` read: the cluster is as pressed as that node), plus ``cluster``,
        ``cluster_pressure``, ``totals`` over the live nodes and every node's own report."""
        nodes = []
        totals = {"committed": 0, "available": 0, "ceiling": 0, "limit": 0}
        worst: tuple[int, str, dict[str, Any]] | None = None
        now = time.time()
        for e in self.nodes.values():
            row: dict[str, Any] = {"id": e.node.id, "name": e.node.name, "alive": e.node.alive}
            gone_at = getattr(e.node, "gone_at", None)
            if not e.node.alive and gone_at is not None:
                if now - gone_at > GONE_SHOWN:
                    continue  # gone long enough: out of the table
                row.update(gone_at=gone_at, gone_cause=getattr(e.node, "gone_cause", None))
            if e.node.alive:
                try:
                    report = e.scheduler.memory_report()
                except ElbowroomError as exc:
                    row["error"] = exc.message
                else:
                    row.update(report)
                    for k in ("committed", "available", "ceiling"):
                        totals[k] += int(report[k])
                    totals["limit"] += int(report["limit"]["value"])
                    row["models"] = [r["id"] for r in e.scheduler.ps()]
                    rank = (int(e.level()), e.node.name, report)
                    if worst is None or rank[:2] > worst[:2]:
                        worst = rank
            nodes.append(row)
        totals["nodes"] = sum(1 for row in nodes if row["alive"])  # what the sums are over
        pressure = self.pressure()
        out: dict[str, Any] = dict(worst[2]) if worst is not None else {}
        out.update(
            cluster=True,
            worst_node=worst[1] if worst is not None else None,
            pressure=pressure["level"],
            cluster_pressure=pressure,
            totals=totals,
            loads_paused=self.loads_paused,
            nodes=nodes,
        )
        return out


def _sentence(text: str) -> str:
    """``text`` ending as a sentence, so another can follow it."""
    text = text.rstrip()
    return text if text.endswith((".", "!", "?")) else text + "."
