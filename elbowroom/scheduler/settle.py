"""Waiting for evicted memory to show up before the next load decision.

A runner that exited has freed its bytes, but the probe may not show them yet: the kernel
reclaims a dead process's pages a moment later, and NVML reports VRAM the driver hands back
later still. A load sized before then would be sized short, so the scheduler waits until
the expected share is back (or the settle timeout passes, logged). Switching to a vision
model waits for a larger margin on top (``vision``; scheduler/vision_gate.py).
"""

from __future__ import annotations

import logging
from collections.abc import Awaitable, Callable
from dataclasses import dataclass

from elbowroom.memory.types import Probe, Snapshot
from elbowroom.scheduler import vision_gate
from elbowroom.units import format_size

__all__ = ["POLL", "Settle", "Sleep"]

log = logging.getLogger("elbowroom.scheduler")

POLL = 0.05  # seconds between probe readings while waiting for memory or busy models
# Freed memory "shows up" when this share of the evicted anonymous bytes is available
# again: other processes allocate meanwhile, and file-backed pages stay in the page cache.
_SETTLE_FRACTION = 0.9

Sleep = Callable[[float], Awaitable[None]]


@dataclass(frozen=True, slots=True)
class Settle:
    probe: Probe
    clock: Callable[[], float]
    sleep: Sleep
    timeout: float  # settings.unload_settle_timeout

    async def host(self, before_available: int, expected: int) -> None:
        """Wait until ``expected`` freed bytes show up as available (or the deadline)."""
        target = before_available + int(expected * _SETTLE_FRACTION)
        deadline = self.clock() + self.timeout
        while True:
            available = self.probe().available
            if available >= target:
                return
            if self.clock() >= deadline:
                log.warning(
                    "freed memory did not show up within %.1f s (available %s, expected %s)",
                    self.timeout,
                    format_size(available),
                    format_size(target),
                )
                return
            await self.sleep(POLL)

    async def vision(
        self, model_id: str, needed: int, before: int, freed: int, factor: float
    ) -> None:
        """Switching to a vision model: wait for the larger margin (scheduler/vision_gate.py)."""
        target = vision_gate.settle_target(needed, factor, before, freed)
        deadline = self.clock() + self.timeout
        while (available := self.probe().available) < target:
            if self.clock() >= deadline:
                log.warning(
                    "loading vision model %s: %s available after the eviction, not the %s "
                    "(%.1f x its %s) the vision settle waits for; going on",
                    model_id,
                    format_size(available),
                    format_size(target),
                    factor,
                    format_size(needed),
                )
                return
            await self.sleep(POLL)

    async def gpus(self, before: Snapshot, expected: dict[int, int]) -> None:
        """Wait until the evicted runners' VRAM is free again in NVML (or the deadline): a
        load sized on VRAM the driver has not handed back yet would be placed short."""
        free0 = {g.index: g.free for g in before.gpus}
        want = {i: free0[i] + int(b * _SETTLE_FRACTION) for i, b in expected.items() if i in free0}
        deadline = self.clock() + self.timeout
        while want:
            free = {g.index: g.free for g in self.probe().gpus}
            if all(free.get(i, 0) >= target for i, target in want.items()):
                return
            if self.clock() >= deadline:
                log.warning("freed VRAM did not show up within the settle timeout: %s", free)
                return
            await self.sleep(POLL)
