"""One model larger than any node: split over the nodes with llama.cpp's RPC backend.

When placement refuses a GGUF model on every node, the router asks ``plan_split``: whole
layers per node in proportion to each node's free bytes (``split.split_layers``, exo's
largest remainder, one layer at least), checked against what each node's layers and KV
would hold. ``start_split`` then starts one ``rpc-server`` per node through its agent
(bound to that node's ``rpc_host``: loopback or private only), and one runner on the node
with the most room: the ``llama-rpc`` engine, a llama-server whose devices are those RPC
servers in the same order, ``--tensor-split`` their layer counts.

The split is supervised like a runner: an RPC server that exits, or a node of the split
that leaves, tears the whole split down (in-flight requests fail at once with the cause);
the next request plans it again over the nodes there are then.
"""

from __future__ import annotations

import asyncio
import dataclasses
import itertools
import logging
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from elbowroom.cluster.remote import Node, RemoteRunner, _ray_errors
from elbowroom.cluster.split import LayerSplit, SplitError, split_layers
from elbowroom.config import Settings
from elbowroom.engines.options import RpcLlamaOptions
from elbowroom.errors import ElbowroomError, RunnerCrashed
from elbowroom.models.spec import ModelSpec
from elbowroom.units import format_size

log = logging.getLogger("elbowroom.cluster")

_keys = itertools.count(1)


@dataclass(frozen=True, slots=True)
class SplitPlan:
    model: str
    split: LayerSplit  # node id -> layers, in device order
    n_ctx: int
    slots: int
    need: dict[str, int]  # node id -> predicted bytes of its share


def split_context(spec: ModelSpec, settings: Settings) -> int:
    trained = spec.gguf.trained_ctx if spec.gguf is not None else settings.max_ctx
    return settings.ctx or min(settings.max_ctx, trained or settings.max_ctx)


def plan_split(
    spec: ModelSpec, settings: Settings, free: dict[str, int], kv_bytes_per_token: int
) -> SplitPlan:
    """PURE: the layers per node for ``spec`` over nodes with ``free`` bytes (largest
    first is the device order); SplitError naming the node that cannot hold its share."""
    info = spec.gguf
    if info is None or not info.n_layers:
        raise SplitError(f"{spec.id} is not a llama.cpp model with layers; it cannot be split")
    n_ctx = split_context(spec, settings)
    slots = settings.slots_for(spec.id)
    per_layer_kv = kv_bytes_per_token * n_ctx * slots // max(1, info.n_layers)
    sizes = list(info.layer_bytes or ())
    fallback = (info.tensor_bytes or spec.size_bytes) // max(1, info.n_layers)
    # A node that cannot hold even one layer would only add a network hop: left out.
    one_layer = max(sizes, default=fallback) + per_layer_kv
    order = dict(
        sorted(((n, b) for n, b in free.items() if b >= one_layer), key=lambda kv: (-kv[1], kv[0]))
    )
    if len(order) < 2:
        raise SplitError(
            f"a split needs at least two nodes with room for a layer ({format_size(one_layer)})"
        )
    split = split_layers(info.n_layers, order)
    need: dict[str, int] = {}
    for i, (node, (first, last)) in enumerate(split.ranges().items()):
        weights = sum(sizes[first:last]) if len(sizes) >= last else fallback * (last - first)
        need[node] = weights + per_layer_kv * (last - first)
        if i == 0:
            need[node] += info.input_bytes  # the home node's llama-server keeps the input layer
        if i == len(order) - 1:
            need[node] += info.output_bytes  # the output layer follows the last block
        if need[node] > order[node]:
            raise SplitError(
                f"node {node} would hold {split.layers[node]} layers of {spec.id} "
                f"({format_size(need[node])}) but only {format_size(order[node])} is free "
                "there; add a node, free memory, or set a smaller --ctx"
            )
    return SplitPlan(spec.id, split, n_ctx, slots, need)


@dataclass(slots=True)
class RunningSplit:
    plan: SplitPlan
    runner: RemoteRunner
    parts: list[tuple[Node, str]] = field(default_factory=list)  # (node, rpc key)
    rpc_pids: list[int] = field(default_factory=list)  # each rpc-server's pid on its node
    watches: list[asyncio.Task[None]] = field(default_factory=list)
    busy: int = 0
    closed: bool = False

    def nodes(self) -> list[str]:
        return [node.id for node, _ in self.parts]


async def start_split(
    spec: ModelSpec,
    plan: SplitPlan,
    nodes: dict[str, Node],
    options: RpcLlamaOptions,
    bin_dir: Path,
    on_down: Callable[[RunningSplit, str], None],
) -> RunningSplit:
    """Start the RPC servers, then the runner that uses them; undo everything on failure."""
    parts: list[tuple[Node, str]] = []
    endpoints: list[str] = []
    pids: list[int] = []
    try:
        for node_id in plan.split.layers:
            node = nodes[node_id]
            key = f"rpc:{spec.id}#{next(_keys)}"
            try:
                answer = await node.agent.start_rpc.remote(key, str(bin_dir / "rpc-server"))
            except _ray_errors() as exc:
                node.mark_gone(f"node {node.name} is gone ({type(exc).__name__})")
                raise RunnerCrashed(
                    f"node {node.name} left while {spec.id} was being split; retry: the "
                    "split is planned again over the nodes there are",
                    code="runner_crashed",
                    details={"node": node.name},
                ) from None
            if "error" in answer:
                raise ElbowroomError.from_wire(answer["error"])
            parts.append((node, key))
            endpoints.append(answer["endpoint"])
            pids.append(int(answer["pid"]))
        home = nodes[next(iter(plan.split.layers))]
        split_spec = dataclasses.replace(spec, engine="llama-rpc")
        running: RunningSplit | None = None

        def runner_died(_runner: Any, cause: str) -> None:
            if running is not None:
                on_down(running, cause)

        runner = home.runner_factory(split_spec, runner_died)
        assert isinstance(runner, RemoteRunner)
        await runner.start(
            dataclasses.replace(
                options,
                n_ctx=plan.n_ctx,
                slots=plan.slots,
                rpc_servers=tuple(endpoints),
                rpc_split=tuple(plan.split.layers.values()),
                llama_server=str(bin_dir / "llama-server"),
            )
        )
    except BaseException:
        await asyncio.gather(*(n.agent.stop_rpc.remote(k, 2.0) for n, k in parts),
                             return_exceptions=True)  # fmt: skip
        raise
    running = RunningSplit(plan, runner, parts, pids)
    for node, key in parts:
        running.watches.append(asyncio.create_task(_watch_part(running, node, key, on_down)))
    log.info(
        "split %s over %s (layers %s)",
        spec.id,
        ", ".join(n.name for n, _ in parts),
        list(plan.split.layers.values()),
    )
    return running


async def _watch_part(
    running: RunningSplit, node: Node, key: str, on_down: Callable[[RunningSplit, str], None]
) -> None:
    try:
        cause = await node.agent.wait_exit.remote(key)
    except _ray_errors():
        cause = f"node {node.name} is gone"
    if cause is not None and not running.closed:
        on_down(running, f"{cause} (RPC server on {node.name})")


async def stop_split(running: RunningSplit, grace: float) -> None:
    running.closed = True
    for task in running.watches:
        task.cancel()
    await running.runner.stop(grace)
    await asyncio.gather(
        *(n.agent.stop_rpc.remote(k, grace) for n, k in running.parts if n.alive),
        return_exceptions=True,
    )
    # A fresh reading of each node once its RPC server is gone: the next plan sees the
    # freed memory, not the split's (as a scheduler waits for an unload to settle).
    await asyncio.gather(*(n.refresh() for n, _ in running.parts if n.alive))


def free_bytes(reports: Sequence[tuple[str, dict[str, Any]]]) -> dict[str, int]:
    """node id -> what a split may take there: room now plus what idle models would free."""
    return {node: int(r["available"]) for node, r in reports if int(r["available"]) > 0}
