"""The memory facts every layer shares. Frozen, slotted, bytes as plain ints."""

from __future__ import annotations

import enum
from collections.abc import Callable
from dataclasses import dataclass

# The window of ``Psi.some_recent``: the stall rate the probe measures from the file's
# cumulative ``total`` (avg10 trails by about ten seconds; see memory/budget.py).
PSI_RECENT_S = 2.0


@dataclass(frozen=True, slots=True)
class Psi:
    """/proc/pressure/memory: percent of time some / all tasks stalled on memory."""

    some_avg10: float
    some_avg60: float
    full_avg10: float
    full_avg60: float
    some_total_us: int = 0  # cumulative time some task stalled (the file's total=), µs
    # Percent of time some task stalled over the last ~PSI_RECENT_S seconds, from this
    # process's earlier reading of ``some_total_us``; None until there is one that old.
    some_recent: float | None = None


@dataclass(frozen=True, slots=True)
class GpuMemory:
    index: int
    name: str
    total: int
    free: int
    used: int


@dataclass(frozen=True, slots=True)
class Snapshot:
    """One reading of the machine's memory.

    ``total``/``available`` are *effective*: the smallest of host, cgroup limit and
    ELBOWROOM_OVERRIDE_MEMORY, with available reduced to the cgroup's (or override's) headroom.
    ``host_*`` keep the raw host values for display.
    """

    platform: str  # "linux" | "darwin" | other sys.platform values
    total: int
    available: int
    used: int
    host_total: int
    host_available: int
    swap_total: int = 0
    swap_used: int = 0
    cgroup_version: int | None = None  # 1 or 2 when we run in a limited cgroup
    cgroup_limit: int | None = None  # None: unlimited
    cgroup_usage: int | None = None
    psi: Psi | None = None
    gpus: tuple[GpuMemory, ...] = ()
    override: int | None = None  # ELBOWROOM_OVERRIDE_MEMORY when set
    os_pressure: str | None = None  # macOS memory-pressure level: normal | warn | critical
    # Metal's recommended working set (unified memory) where known: a budget candidate.
    gpu_working_set: int | None = None
    # iogpu.wired_limit_mb where a user set it (0 = macOS default): caps what the GPU wires.
    gpu_wired_limit: int | None = None
    taken_at: float = 0.0  # time.monotonic() of the reading


# What every consumer takes: a callable returning a fresh Snapshot (tests inject their own).
Probe = Callable[[], Snapshot]


@dataclass(frozen=True, slots=True)
class ProcessMemory:
    """Bytes held by a process tree, by kind. ``gpu`` is 0 where NVML cannot tell."""

    anonymous: int  # not reclaimable: KV cache, activations, resident weights
    file_backed: int  # mmap'd files (GGUF weights): the OS can drop and re-read them
    swap: int = 0
    gpu: int = 0
    pids: tuple[int, ...] = ()

    @property
    def resident(self) -> int:
        return self.anonymous + self.file_backed

    def __add__(self, other: ProcessMemory) -> ProcessMemory:
        return ProcessMemory(
            self.anonymous + other.anonymous,
            self.file_backed + other.file_backed,
            self.swap + other.swap,
            self.gpu + other.gpu,
            self.pids + other.pids,
        )


ZERO_PROCESS_MEMORY = ProcessMemory(0, 0)


class Pressure(enum.IntEnum):
    NORMAL = 0
    SOFT = 1
    HARD = 2

    @property
    def label(self) -> str:
        return self.name.lower()
