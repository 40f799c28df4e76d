"""GPU pools as the guard sees them: each NVIDIA GPU's level from the sample's NVML reading
and the bytes our models hold there (``memory.pools``'s rules, the same as ``elbowroom
memory`` shows). PURE: the snapshot and our bytes per pool are parameters."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass

from elbowroom.guard.ladder import PoolReading, Reading
from elbowroom.memory.budget import BudgetConfig
from elbowroom.memory.pools import gpu_pool, gpu_pool_name, gpu_pressure
from elbowroom.memory.types import Snapshot


@dataclass(frozen=True, slots=True)
class GpuBudget:
    cfg: BudgetConfig
    reserve: int | None = None  # settings.gpu_reserve
    override: int | None = None  # settings.override_gpu_memory

    def readings(
        self,
        snap: Snapshot,
        ours: Mapping[str, int],
        freeing: Mapping[str, int] | None = None,
    ) -> list[PoolReading]:
        """One reading per GPU in the snapshot; ``ours``/``freeing``: bytes our models hold
        in each pool, and those of them that unloads under way are taking away."""
        out = []
        for gpu in snap.gpus:
            name = gpu_pool_name(gpu.index)
            pool = gpu_pool(
                gpu, ours.get(name, 0), self.cfg, reserve=self.reserve, override=self.override
            )
            level, why = gpu_pressure(pool, self.cfg)
            going = min(pool.ours, (freeing or {}).get(name, 0))
            reading = Reading(
                usage=pool.ours - going,
                limit=pool.limit.value,
                soft=pool.limit.soft,
                hard=pool.limit.hard,
                freeing=going,
            )
            out.append(PoolReading(name, level, reading, why))
        return out
