"""PURE: one model's layers split over nodes in proportion to their free memory.

exo's method: each node gets ``layers * free / total_free`` layers, rounded down, then the
layers left over go to the nodes with the largest remainders; every node gets at least one
layer (a node with none would only add a network hop). The result becomes llama.cpp's
``--tensor-split`` (layer proportions per device, in device order) for a llama-server
whose devices are the local CPU and the nodes' RPC servers.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass

from elbowroom.engines.options import tensor_split_arg
from elbowroom.units import format_size

__all__ = [
    "LayerSplit",
    "SplitError",
    "check_fits",
    "split_layers",
    "tensor_split",
]


class SplitError(ValueError):
    """The split is impossible; the message says what to change."""


@dataclass(frozen=True, slots=True)
class LayerSplit:
    layers: Mapping[str, int]  # node -> whole layers, in the order the nodes were given
    free: Mapping[str, int]

    def ranges(self) -> dict[str, tuple[int, int]]:
        """node -> [first, last) layer indexes: consecutive runs, in node order."""
        out, at = {}, 0
        for node, n in self.layers.items():
            out[node] = (at, at + n)
            at += n
        return out


def split_layers(n_layers: int, free: Mapping[str, int]) -> LayerSplit:
    """Whole layers per node, proportional to ``free`` bytes (largest remainder)."""
    nodes = list(free)
    if not nodes:
        raise SplitError("no node to split the model over")
    if any(b <= 0 for b in free.values()):
        empty = ", ".join(n for n in nodes if free[n] <= 0)
        raise SplitError(f"node(s) {empty} have no free memory; leave them out of the split")
    if n_layers < len(nodes):
        raise SplitError(
            f"{n_layers} layers cannot give each of {len(nodes)} nodes one; use fewer nodes"
        )
    total = sum(free.values())
    # Exact integer arithmetic: each quota as (whole layers, remainder over ``total``).
    shares = {n: divmod(n_layers * free[n], total) for n in nodes}
    layers = {n: shares[n][0] for n in nodes}
    left = n_layers - sum(layers.values())
    by_remainder = sorted(nodes, key=lambda n: (-shares[n][1], -free[n], nodes.index(n)))
    for n in by_remainder[:left]:
        layers[n] += 1
    # At least one layer each: taken from the node holding the most (the most free first).
    for n in nodes:
        if layers[n] == 0:
            donor = max(nodes, key=lambda d: (layers[d], free[d], -nodes.index(d)))
            layers[donor] -= 1
            layers[n] = 1
    return LayerSplit(layers, dict(free))


def check_fits(split: LayerSplit, layer_bytes: int, overhead: Mapping[str, int]) -> None:
    """Raise SplitError naming the node whose layers (plus its fixed ``overhead``: output
    layer, compute buffers) exceed its free bytes."""
    for node, n in split.layers.items():
        need = n * layer_bytes + overhead.get(node, 0)
        if need > split.free[node]:
            raise SplitError(
                f"node {node} would hold {n} layers ({format_size(need)}) but has "
                f"{format_size(split.free[node])} free; add a node or free memory there"
            )


def tensor_split(split: LayerSplit, device_order: Sequence[str]) -> str:
    """llama.cpp's ``--tensor-split`` value for ``split`` in ``device_order``."""
    missing = [n for n in split.layers if n not in device_order]
    if missing:
        raise SplitError(f"no device for node(s) {', '.join(missing)}")
    if not device_order:
        raise SplitError("no device to split over")
    return tensor_split_arg([split.layers.get(d, 0) for d in device_order])
