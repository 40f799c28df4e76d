"""Memory pools. PURE: every input is a parameter.

Host RAM and every discrete GPU are budgeted separately, because running out of either
is what takes a load (or the machine) down, and bytes in one do not relieve the other.
Apple Silicon's unified memory is one pool: the GPU wires host RAM, so the host budget
gains the Metal limits as candidates.

Every pool has the same shape: total, free, ours (what elbowroom's runners hold there),
others (everything else: other processes, the driver), a reserve, a limit with its
candidates and soft/hard thresholds; loads are admitted up to the load ceiling
(``load_fraction`` of the limit, below soft). A GPU's limit is the smallest of

    total − reserve                 (reserve: 512 MiB up to 16 GiB cards, 1 GiB above;
                                     fragmentation and the driver's own allocations)
    free + ours − safety margin     (other processes' use, as NVML sees it now)

with ``override_gpu_memory`` making every card look that small (total = min(total,
override), free ≤ override − ours), like ``override_memory`` does for host RAM.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from elbowroom.memory.budget import (
    BudgetConfig,
    Candidate,
    Limit,
    limit_of,
    limit_to_dict,
    memory_limit,
)
from elbowroom.memory.types import GpuMemory, Pressure, Snapshot
from elbowroom.units import GiB, MiB, format_size

__all__ = [
    "HOST",
    "Pool",
    "gpu_pool",
    "gpu_pool_name",
    "gpu_pressure",
    "gpu_reserve",
    "host_pool",
    "memory_pools",
    "pool_to_dict",
]

HOST = "host"


@dataclass(frozen=True, slots=True)
class Pool:
    name: str  # "host", "unified" or "gpu<NVML index>"
    kind: str  # "host" | "unified" | "gpu"
    label: str  # for people: "host RAM", "NVIDIA H200"
    total: int
    free: int
    ours: int  # bytes elbowroom's runners hold in this pool
    others: int  # used by everything else (other processes, the driver)
    reserve: int
    limit: Limit
    device: int | None = None  # the GPU's index (NVML order = PCI bus order)

    @property
    def ceiling(self) -> int:
        """Bytes our models may be admitted to hold here (below the soft threshold)."""
        return self.limit.ceiling


def gpu_pool_name(index: int) -> str:
    return f"gpu{index}"


def gpu_reserve(total: int) -> int:
    """VRAM kept back on a card of ``total`` bytes: 512 MiB up to 16 GiB, else 1 GiB."""
    return min(512 * MiB if total <= 16 * GiB else 1 * GiB, total // 4)


_GPU_RULE_WHY = "a GPU's own memory: its reserve and what other processes use on it"


def gpu_pool(
    gpu: GpuMemory,
    ours: int,
    cfg: BudgetConfig,
    *,
    reserve: int | None = None,
    override: int | None = None,
) -> Pool:
    """The pool of one NVIDIA GPU from its NVML reading; ``ours`` = our runners' bytes on it."""
    fs = format_size
    total, free = gpu.total, max(0, gpu.free)
    others = max(0, gpu.used - ours)
    if override is not None:
        total = min(total, override)
        free = min(free, max(0, override - ours))
    held = reserve if reserve is not None else gpu_reserve(total)
    how = "set by gpu_reserve" if reserve is not None else "tier for this size"
    cands = [
        Candidate(
            "reserve", max(0, total - held), f"total {fs(total)} − reserve {fs(held)} ({how})"
        ),
        Candidate(
            "available",
            max(0, free + ours - cfg.safety_margin),
            f"free {fs(free)} + ours {fs(ours)} − safety margin {fs(cfg.safety_margin)}",
        ),
    ]
    if override is not None:
        cands[0] = Candidate(
            "override",
            max(0, total - held),
            f"override_gpu_memory {fs(override)} − reserve {fs(held)}",
        )
    return Pool(
        name=gpu_pool_name(gpu.index),
        kind="gpu",
        label=gpu.name,
        total=total,
        free=free,
        ours=ours,
        others=others,
        reserve=held,
        limit=limit_of(cands, cfg, "gpu", _GPU_RULE_WHY),
        device=gpu.index,
    )


def host_pool(snap: Snapshot, own_usage: int, cfg: BudgetConfig) -> Pool:
    """Host RAM (budget.memory_limit); on Apple Silicon the unified pool, where the wired
    limit ``iogpu.wired_limit_mb`` (when a user set it) is one more candidate beside Metal's
    recommended working set."""
    limit = memory_limit(snap, own_usage, cfg)
    unified = snap.gpu_working_set is not None
    if unified and snap.gpu_wired_limit is not None:
        wired = Candidate(
            "wired_limit",
            snap.gpu_wired_limit,
            f"iogpu.wired_limit_mb {snap.gpu_wired_limit // MiB} (what the GPU may wire)",
        )
        limit = limit_of([*limit.candidates, wired], cfg, limit.rule, limit.rule_why)
    used = max(0, snap.total - snap.available)
    return Pool(
        name="unified" if unified else HOST,
        kind="unified" if unified else "host",
        label="unified memory (CPU + GPU)" if unified else "host RAM",
        total=snap.total,
        free=snap.available,
        ours=own_usage,
        others=max(0, used - own_usage),
        reserve=next(
            (max(0, snap.total - c.value) for c in limit.candidates if c.name == "reserve"), 0
        ),
        limit=limit,
    )


def memory_pools(
    snap: Snapshot,
    own_host: int,
    own_gpu: Mapping[int, int],
    cfg: BudgetConfig,
    *,
    gpu_reserve_bytes: int | None = None,
    gpu_override: int | None = None,
) -> tuple[Pool, ...]:
    """The host (or unified) pool first, then one pool per NVIDIA GPU in NVML order."""
    pools = [host_pool(snap, own_host, cfg)]
    for gpu in snap.gpus:
        pools.append(
            gpu_pool(
                gpu,
                own_gpu.get(gpu.index, 0),
                cfg,
                reserve=gpu_reserve_bytes,
                override=gpu_override,
            )
        )
    return tuple(pools)


def gpu_pressure(pool: Pool, cfg: BudgetConfig) -> tuple[Pressure, str | None]:
    """A GPU pool's level: our bytes against its thresholds, then the card's free memory
    under the safety margin (another process took it) → hard."""
    fs = format_size
    if pool.free < min(cfg.safety_margin, pool.total // 20):
        return Pressure.HARD, f"{pool.name} free {fs(pool.free)} under the safety margin"
    if pool.ours > 0 and pool.ours >= pool.limit.hard:
        return Pressure.HARD, f"{pool.name} ours {fs(pool.ours)} ≥ hard {fs(pool.limit.hard)}"
    if pool.ours > 0 and pool.ours >= pool.limit.soft:
        return Pressure.SOFT, f"{pool.name} ours {fs(pool.ours)} ≥ soft {fs(pool.limit.soft)}"
    return Pressure.NORMAL, None


def pool_to_dict(pool: Pool) -> dict[str, Any]:
    return {
        "name": pool.name,
        "kind": pool.kind,
        "label": pool.label,
        "device": pool.device,
        "total": pool.total,
        "free": pool.free,
        "ours": pool.ours,
        "others": pool.others,
        "reserve": pool.reserve,
        "ceiling": pool.ceiling,
        "limit": limit_to_dict(pool.limit),
    }
