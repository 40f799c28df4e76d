"""PURE: what each node's share of a split model will hold, and the plan of a split.

A split model (docs/cluster.md) runs as one ``rpc-server`` per node holding a consecutive
run of whole layers, and one engine process on the first node (the "home": the node with
the most room) driving them. Each node's share is budgeted like a model on that node
(``cluster.share``), so its bytes are predicted here, term by term:

    share  = its layers' weights (+ the output layer on the last node)
           + its layers' KV cache
           + the compute buffer of an RPC device            (``share_compute``)
           + the rpc-server process itself                  (``RPC_SERVER_RUNTIME``)
           + on the home node: the engine process           (``engine_bytes``)

Everything an RPC server holds is anonymous memory: the weights arrive over the network
into its buffers, they are not mapped from a file.

Layers go to nodes in proportion to their room (``split.split_layers``: exo's largest
remainder, at least one layer each); the plan is refused (SplitError naming the node)
when a node's share does not fit its room. The router plans with the bytes free now
first, then with what evicting idle models would free (docs/cluster.md).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping, Sequence
from dataclasses import dataclass

from elbowroom.cluster.split import LayerSplit, SplitError, split_layers
from elbowroom.config import Settings
from elbowroom.models.estimate import N_UBATCH, compute_bytes, footprint, kv_bytes
from elbowroom.models.spec import GGUFInfo, ModelSpec
from elbowroom.units import MiB, format_size

__all__ = [
    "ShareCost",
    "SplitPlan",
    "engine_bytes",
    "plan_rooms",
    "plan_split",
    "share_compute",
    "split_context",
]

# llama.cpp's scheduler turns on pipeline parallelism when a model is fully offloaded over
# several devices ("pipeline parallelism enabled", "sched copies = 4" in its log) and
# keeps this many copies of every device's graph inputs, so batches can overlap.
PIPELINE_COPIES = 4
# f32 rows of the batch's hidden state (n_ubatch × n_embd) that the first device and the
# engine's own CPU buffer hold beyond one layer's intermediates: fitted to llama.cpp's
# reported compute buffers on SmolLM2 (n_embd 576) and gemma3-270m (n_embd 640), where
# the differences were 9.0 and 10.0 such rows on both models (tests/e2e/test_split_engine
# checks the prediction against the reported buffers).
FIRST_DEVICE_ROWS = 9
ENGINE_ROWS = 10
# The rpc-server process before it holds a tensor: 0.7 MiB anonymous and 4.2 MiB of
# mapped libraries (5.0 MiB once serving), measured on this machine's build.
RPC_SERVER_RUNTIME = 6 * MiB
# The split's engine is a llama-server child of elbowroom's worker: its own libraries
# (measured 11.7 MiB mapped beside the input layer) come on top of a whole-model
# footprint's runtime, which counts the worker with the llama.cpp library imported.
LLAMA_SERVER_LIBS = 12 * MiB


@dataclass(frozen=True, slots=True)
class ShareCost:
    """Predicted bytes of one node's share, by term."""

    layers: int
    first: int  # index of its first layer
    weights: int  # its blocks' tensors (+ the output layer on the last node)
    kv: int
    compute: int
    runtime: int = RPC_SERVER_RUNTIME
    engine: int = 0  # the split's engine process, on the home node only

    @property
    def total(self) -> int:
        return self.weights + self.kv + self.compute + self.runtime + self.engine

    @property
    def at_start(self) -> int:
        """What the share holds when its RPC server is up and the engine not loaded yet:
        the rest arrives when the engine loads (the plan's working part)."""
        return self.runtime

    def to_dict(self) -> dict[str, int]:
        return {
            "layers": self.layers,
            "weights": self.weights,
            "kv": self.kv,
            "compute": self.compute,
            "runtime": self.runtime,
            "engine": self.engine,
            "total": self.total,
        }


@dataclass(frozen=True, slots=True)
class SplitPlan:
    model: str
    split: LayerSplit  # node id -> layers, in device order (the home node first)
    n_ctx: int
    slots: int
    kv_type: str
    shares: Mapping[str, ShareCost]  # node id -> its share, same order

    @property
    def home(self) -> str:
        return next(iter(self.split.layers))

    @property
    def need(self) -> dict[str, int]:
        return {node: cost.total for node, cost in self.shares.items()}


def split_context(spec: ModelSpec, settings: Settings) -> int:
    trained = spec.gguf.trained_ctx if spec.gguf is not None else settings.max_ctx
    return settings.ctx or min(settings.max_ctx, trained or settings.max_ctx)


def _tokens(n_ctx: int, slots: int) -> int:
    return min(N_UBATCH, max(1, n_ctx * slots))


def _mask_and_hidden(info: GGUFInfo, n_ctx: int, slots: int) -> tuple[int, int]:
    """The attention-mask bytes of the whole-model compute formula, and one f32 hidden
    state of the batch (n_ubatch × n_embd)."""
    tokens = _tokens(n_ctx, slots)
    # compute_bytes at n_ctx 0 is one token's intermediates and no mask: the formula's
    # mask part is what the full buffer has beyond ``tokens`` of those.
    mask = compute_bytes(info, n_ctx, slots) - tokens * compute_bytes(info, 0, 1)
    return mask, tokens * info.n_embd * 4


def share_compute(info: GGUFInfo, n_ctx: int, slots: int, *, first: bool) -> int:
    """llama.cpp's compute buffer on one RPC device holding some of the layers.

    Derived as ``models.estimate.compute_bytes`` is for a whole model: the graph allocator
    reuses memory from one layer to the next, so a device's buffer is one layer's
    intermediates for an n_ubatch batch, the whole model's formula, however many layers
    the device holds. Two things are particular to a split: with pipeline parallelism each
    device keeps ``PIPELINE_COPIES`` copies of its inputs (the hidden state coming in, f32,
    and the attention mask, f16), of which the formula counts one; and the first device
    holds ``FIRST_DEVICE_ROWS`` more hidden-state rows of the batch."""
    mask, hidden = _mask_and_hidden(info, n_ctx, slots)
    extra = (PIPELINE_COPIES - 1) * (hidden + mask)
    if first:
        extra += FIRST_DEVICE_ROWS * hidden
    return compute_bytes(info, n_ctx, slots) + extra


def engine_bytes(spec: ModelSpec, n_ctx: int, slots: int, kv_type: str) -> int:
    """The split's engine process on the home node. It holds no block: the input layer
    (token embeddings, mapped: they are looked up on its CPU) and, of a whole-model
    footprint, the runtime, vocabulary, logits and slot state (not the KV cache, compute
    buffer or repacked weights: those are the RPC servers'); plus llama-server's own
    libraries and its CPU compute buffer (the batch's embeddings and the mask's copies)."""
    info = spec.gguf
    assert info is not None
    fp = footprint(spec, n_ctx, slots, kv_type)
    runtime_file = fp.file_backed - (info.tensor_bytes or spec.size_bytes)
    runtime_anon = fp.anonymous - fp.kv_bytes - fp.repacked - fp.compute
    mask, hidden = _mask_and_hidden(info, n_ctx, slots)
    host_compute = ENGINE_ROWS * hidden + PIPELINE_COPIES * mask
    return info.input_bytes + runtime_file + runtime_anon + LLAMA_SERVER_LIBS + host_compute


def _range_kv(info: GGUFInfo, first: int, last: int, n_ctx: int, slots: int, kv: str) -> int:
    """KV bytes of layers [first, last): the whole cache's formula with the other layers'
    KV heads set to none (so sliding windows and per-layer heads count as they are)."""
    heads = info.kv_heads_per_layer or (info.n_kv_heads,) * info.n_layers
    kept = tuple(h if first <= i < last else 0 for i, h in enumerate(heads))
    return kv_bytes(dataclasses.replace(info, kv_heads_per_layer=kept), n_ctx, slots, kv)


def _costs(
    spec: ModelSpec, split: LayerSplit, n_ctx: int, slots: int, kv_type: str
) -> dict[str, ShareCost]:
    info = spec.gguf
    assert info is not None
    sizes = list(info.layer_bytes or ())
    fallback = (info.tensor_bytes or spec.size_bytes) // max(1, info.n_layers)
    ranges = list(split.ranges().items())
    out = {}
    for i, (node, (first, last)) in enumerate(ranges):
        weights = sum(sizes[first:last]) if len(sizes) >= last else fallback * (last - first)
        if i == len(ranges) - 1:
            weights += info.output_bytes  # the output layer follows the last block
        out[node] = ShareCost(
            layers=last - first,
            first=first,
            weights=weights,
            kv=_range_kv(info, first, last, n_ctx, slots, kv_type),
            compute=share_compute(info, n_ctx, slots, first=i == 0),
            engine=engine_bytes(spec, n_ctx, slots, kv_type) if i == 0 else 0,
        )
    return out


def _one_layer_share(spec: ModelSpec, info: GGUFInfo, n_ctx: int, slots: int, kv: str) -> int:
    fallback = (info.tensor_bytes or spec.size_bytes) // max(1, info.n_layers)
    weights = max(info.layer_bytes or (), default=fallback)
    layer_kv = max(_range_kv(info, i, i + 1, n_ctx, slots, kv) for i in range(info.n_layers))
    return weights + layer_kv + share_compute(info, n_ctx, slots, first=False) + RPC_SERVER_RUNTIME


def plan_split(spec: ModelSpec, settings: Settings, room: Mapping[str, int]) -> SplitPlan:
    """The layers per node for ``spec`` over nodes with ``room`` bytes to give (largest
    first is the device order, and the largest is home), and each node's share; SplitError
    naming the node whose share does not fit its room."""
    info = spec.gguf
    if info is None or not info.n_layers:
        raise SplitError(f"{spec.id} is not a llama.cpp model with layers; it cannot be split")
    n_ctx = split_context(spec, settings)
    slots = settings.slots_for(spec.id)
    kv_type = settings.kv_type
    # A node that cannot hold even one layer's share would only add a network hop.
    floor = _one_layer_share(spec, info, n_ctx, slots, kv_type)
    order = dict(
        sorted(((n, b) for n, b in room.items() if b >= floor), key=lambda kv: (-kv[1], kv[0]))
    )
    if len(order) < 2:
        raise SplitError(
            "a split needs at least two nodes with room for a layer's share "
            f"({format_size(floor)}: its weights, KV, a compute buffer and an RPC server)"
        )
    split = split_layers(info.n_layers, order)
    shares = _costs(spec, split, n_ctx, slots, kv_type)
    for node, cost in shares.items():
        if cost.total > order[node]:
            what = " and the split's engine" if cost.engine else ""
            raise SplitError(
                f"node {node} would hold {cost.layers} layers of {spec.id}{what} "
                f"({format_size(cost.total)}) but has {format_size(order[node])} to give; "
                "add a node, free memory there, or set a smaller --ctx"
            )
    return SplitPlan(spec.id, split, n_ctx, slots, kv_type, shares)


def plan_rooms(entries: Sequence[tuple[str, int, int]]) -> tuple[dict[str, int], dict[str, int]]:
    """(node name, available, evictable) -> the rooms to plan a split with: what is free
    now, then what evicting idle models would make free."""
    free = {name: available for name, available, _ in entries if available > 0}
    evict = {name: a + e for name, a, e in entries if a + e > 0}
    return free, evict
