"""GPU pools as the guard sees them: each NVIDIA GPU pool of the sample (the monitor
computes them: NVML's reading, our bytes there, reserve and limit) with its level
(``memory.pools.gpu_pressure``, the rules ``elbowroom memory`` shows). PURE."""

from __future__ import annotations

from collections.abc import Mapping, Sequence

from elbowroom.guard.ladder import PoolReading, Reading
from elbowroom.memory.budget import BudgetConfig
from elbowroom.memory.pools import Pool, gpu_pressure


def gpu_readings(
    pools: Sequence[Pool], cfg: BudgetConfig, freeing: Mapping[str, int] | None = None
) -> list[PoolReading]:
    """One reading per GPU pool; ``freeing``: bytes in each pool that unloads under way are
    taking away (still counted in ``ours``), subtracted from the usage the ladder sizes by."""
    out = []
    for pool in pools:
        if pool.kind != "gpu":
            continue
        level, why = gpu_pressure(pool, cfg)
        going = min(pool.ours, (freeing or {}).get(pool.name, 0))
        reading = Reading(
            usage=pool.ours - going,
            limit=pool.limit.value,
            soft=pool.limit.soft,
            hard=pool.limit.hard,
            freeing=going,
        )
        out.append(PoolReading(pool.name, level, reading, why))
    return out
