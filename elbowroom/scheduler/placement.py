"""PURE: where an LLM's layers go — GPUs, CPU, or both — given the room in each GPU pool.

    1. the whole model (every block, its KV and the output layer) on the single GPU with
       the most room, when it fits there;
    2. else, with several GPUs, split over them in proportion to their room (a layer
       split: consecutive runs of layers, each with its own KV);
    3. else partial offload: the most units that fit go to the GPU(s) — the output layer
       first, then blocks from the last one down, as llama.cpp counts ``n_gpu_layers`` —
       and the rest stays on the CPU (in the host pool);
    4. else the CPU alone.

"Room" is what the load may take in a pool: its ceiling minus the bytes of models that
cannot be evicted (busy, pinned, loading). Idle models can be evicted, so a model is
placed as fast as the memory allows and ``policy.decide`` evicts by bytes in each pool.
``gpu_layers`` overrides the choice (0: CPU only; -1: everything; N: N units).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from elbowroom.engines.options import Offload
from elbowroom.memory.pools import gpu_pool_name
from elbowroom.models.estimate import CTX_STEP
from elbowroom.scheduler.offload import Layout, OffloadBytes, split_bytes
from elbowroom.units import format_size

__all__ = ["GpuRoom", "Placement", "gpu_context", "place", "unified"]


@dataclass(frozen=True, slots=True)
class GpuRoom:
    device: int  # the GPU's index (NVML/PCI order; the runner uses the same order)
    room: int  # bytes this load may take in the GPU's pool
    label: str = ""


@dataclass(frozen=True, slots=True)
class Placement:
    mode: str  # "cpu" | "gpu" (everything offloaded) | "partial"
    devices: tuple[int, ...] = ()  # GPUs the engine uses, in split order
    counts: tuple[int, ...] = ()  # offloaded units per device, same order
    bytes: OffloadBytes | None = None  # None on the CPU: the CPU footprint applies
    reason: str = ""

    @property
    def n_gpu_layers(self) -> int:
        return sum(self.counts)

    @property
    def pool_bytes(self) -> dict[str, int]:
        """Predicted bytes per GPU pool ("gpu0": n)."""
        if self.bytes is None:
            return {}
        return {gpu_pool_name(d): b for d, b in zip(self.devices, self.bytes.gpu, strict=True)}

    @property
    def split(self) -> str:
        """Ollama's PROCESSOR column: "100% GPU", "100% CPU" or "35%/65% CPU/GPU"."""
        share = self.bytes.gpu_share if self.bytes is not None else 0.0
        gpu = round(share * 100)
        if self.mode == "gpu" or gpu >= 100:
            return "100% GPU"
        if self.mode == "cpu" or gpu <= 0:
            return "100% CPU"
        return f"{100 - gpu}%/{gpu}% CPU/GPU"

    def offload(self) -> Offload:
        """What the LLM engine is loaded with: llama.cpp's n_gpu_layers, the devices (by
        index; only these get a CUDA context) and the split between them."""
        if self.mode == "cpu":
            return Offload(0, devices=())
        if not self.devices:  # unified memory (Metal): one device, no VRAM pool
            return Offload(self.n_gpu_layers)
        split = tuple(float(c) for c in self.counts) if len(self.devices) > 1 else None
        return Offload(self.n_gpu_layers, devices=self.devices, tensor_split=split)

    def to_dict(self) -> dict[str, object]:
        return {
            "mode": self.mode,
            "split": self.split,
            "n_gpu_layers": self.n_gpu_layers,
            "devices": list(self.devices),
            "layers_per_device": list(self.counts),
            "gpu_bytes": self.pool_bytes,
            "reason": self.reason,
        }


def unified(layout: Layout, gpu_layers: int | None) -> Placement:
    """Apple Silicon: the GPU works in host RAM (the unified pool budgets it all), so every
    layer goes to Metal unless ``gpu_layers`` says otherwise."""
    if gpu_layers == 0:
        return _cpu("gpu_layers is 0: the CPU only")
    units = layout.units if gpu_layers is None or gpu_layers < 0 else min(gpu_layers, layout.units)
    mode = "gpu" if units == layout.units else "partial"
    return Placement(mode, counts=(units,), reason=f"{units} of {layout.units} layers on Metal")


def _cpu(reason: str) -> Placement:
    return Placement("cpu", reason=reason)


def _fits(b: OffloadBytes, rooms: Sequence[GpuRoom], counts: Sequence[int]) -> bool:
    return all(c == 0 or b.gpu[i] <= rooms[i].room for i, c in enumerate(counts))


def _proportional(total: int, rooms: Sequence[GpuRoom]) -> list[int]:
    """``total`` units split in proportion to room (largest remainders get the rest)."""
    whole = sum(max(0, r.room) for r in rooms)
    if whole <= 0:
        return [0] * len(rooms)
    exact = [total * max(0, r.room) / whole for r in rooms]
    counts = [int(x) for x in exact]
    order = sorted(range(len(rooms)), key=lambda i: exact[i] - counts[i], reverse=True)
    for i in order[: total - sum(counts)]:
        counts[i] += 1
    return counts


def _split_fitting(
    layout: Layout, n_ctx: int, slots: int, kv_type: str, rooms: Sequence[GpuRoom], total: int
) -> tuple[list[int], OffloadBytes] | None:
    """``total`` units over ``rooms``: proportional first, then units move from a device
    over its room to the one with the most room left, until all fit (or cannot)."""
    counts = _proportional(total, rooms)
    for _ in range(total * len(rooms) + 1):
        b = split_bytes(layout, n_ctx, slots, kv_type, counts)
        over = [i for i, c in enumerate(counts) if c > 0 and b.gpu[i] > rooms[i].room]
        if not over:
            return counts, b
        src = over[0]
        slack = [
            (rooms[i].room - (b.gpu[i] if counts[i] else 0), i)
            for i in range(len(rooms))
            if i != src and i not in over
        ]
        if not slack:
            return None
        _, dst = max(slack)
        counts[src] -= 1
        counts[dst] += 1
    return None


def _describe(counts: Sequence[int], rooms: Sequence[GpuRoom], b: OffloadBytes, units: int) -> str:
    parts = [
        f"{c} on gpu{rooms[i].device} ({format_size(b.gpu[i])} of {format_size(rooms[i].room)}"
        " room)"
        for i, c in enumerate(counts)
        if c
    ]
    return f"{sum(counts)} of {units} layers: " + ", ".join(parts)


def _placed(
    mode: str, counts: Sequence[int], rooms: Sequence[GpuRoom], b: OffloadBytes, units: int
) -> Placement:
    used = [i for i, c in enumerate(counts) if c]
    kept = split_bytes_subset(b, used)
    return Placement(
        mode,
        devices=tuple(rooms[i].device for i in used),
        counts=tuple(counts[i] for i in used),
        bytes=kept,
        reason=_describe(counts, rooms, b, units),
    )


def split_bytes_subset(b: OffloadBytes, used: Sequence[int]) -> OffloadBytes:
    """``b`` with only the devices in ``used`` (the others hold nothing)."""
    return OffloadBytes(
        gpu=tuple(b.gpu[i] for i in used),
        host_anonymous=b.host_anonymous,
        host_file=b.host_file,
        gpu_weights=b.gpu_weights,
        cpu_weights=b.cpu_weights,
    )


def _try(
    layout: Layout,
    n_ctx: int,
    slots: int,
    kv_type: str,
    rooms: Sequence[GpuRoom],
    units: int,
) -> tuple[list[int], OffloadBytes, list[GpuRoom]] | None:
    """``units`` on the single GPU with the most room if they fit, else split."""
    best = max(rooms, key=lambda r: r.room)
    b = split_bytes(layout, n_ctx, slots, kv_type, [units])
    if b.gpu[0] <= best.room:
        return [units], b, [best]
    if len(rooms) > 1:
        found = _split_fitting(layout, n_ctx, slots, kv_type, rooms, units)
        if found is not None:
            return found[0], found[1], list(rooms)
    return None


def place(
    layout: Layout,
    n_ctx: int,
    slots: int,
    kv_type: str,
    rooms: Sequence[GpuRoom],
    gpu_layers: int | None = None,
) -> Placement:
    """Where ``layout`` goes with ``n_ctx`` tokens per slot × ``slots`` (see the module doc)."""
    units = layout.units
    if gpu_layers == 0:
        return _cpu("gpu_layers is 0: the CPU only")
    if not rooms:
        return _cpu("no GPU")
    if gpu_layers is not None:
        want = units if gpu_layers < 0 else min(gpu_layers, units)
        found = _try(layout, n_ctx, slots, kv_type, rooms, want)
        if found is None:
            # Asked for: placed on the GPU with the most room; the policy refuses it if
            # that pool cannot make the room (a 507 naming the pool), never an OOM.
            best = max(rooms, key=lambda r: r.room)
            b = split_bytes(layout, n_ctx, slots, kv_type, [want])
            found = [want], b, [best]
        counts, b, used = found
        mode = "gpu" if want == units else "partial"
        placed = _placed(mode, counts, used, b, units)
        return Placement(
            placed.mode,
            placed.devices,
            placed.counts,
            placed.bytes,
            f"gpu_layers {gpu_layers}: " + placed.reason,
        )
    full = _try(layout, n_ctx, slots, kv_type, rooms, units)
    if full is not None:
        return _placed("gpu", full[0], full[2], full[1], units)
    # Partial: GPU bytes grow with the units offloaded, so the most that fit is found by
    # bisection (a split's repair keeps it monotonic enough; each step is checked).
    lo, hi, best_found = 1, units - 1, None
    while lo <= hi:
        mid = (lo + hi) // 2
        found = _try(layout, n_ctx, slots, kv_type, rooms, mid)
        if found is not None:
            best_found, lo = found, mid + 1
        else:
            hi = mid - 1
    if best_found is None:
        room = max(r.room for r in rooms)
        return _cpu(f"no GPU has room for one layer ({format_size(room)} at most)")
    return _placed("partial", best_found[0], best_found[2], best_found[1], units)


def gpu_context(
    layout: Layout,
    slots: int,
    kv_type: str,
    rooms: Sequence[GpuRoom],
    cap: int,
    min_ctx: int,
) -> int:
    """The largest context per slot (a multiple of 256, ≤ ``cap``) at which the whole
    model fits on the GPU(s), KV included; 0 when not even ``min_ctx`` does."""
    if not rooms or cap <= 0:
        return 0

    def full(n: int) -> bool:
        return _try(layout, n, slots, kv_type, rooms, layout.units) is not None

    if cap < CTX_STEP:
        return cap if cap >= min_ctx and full(cap) else 0
    lo, hi, best = 1, cap // CTX_STEP, 0
    while lo <= hi:
        mid = (lo + hi) // 2
        if full(mid * CTX_STEP):
            best, lo = mid * CTX_STEP, mid + 1
        else:
            hi = mid - 1
    return best if best >= min(min_ctx, cap) else 0
