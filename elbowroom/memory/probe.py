"""Probes: one Snapshot of the machine's memory as this process can actually use it.

Linux reads ``/proc/meminfo``, the memory cgroup(s) this process belongs to (v1 and v2,
walking up to the mount root and keeping the tightest limit), ``/proc/pressure/memory``
and NVML. macOS asks ``sysctl`` and ``vm_stat``. Elsewhere psutil answers.

Effective numbers (docs/memory.md explains them):

* ``total`` = min(host total, cgroup limit, ELBOWROOM_OVERRIDE_MEMORY).
* ``available`` = min(host MemAvailable, cgroup headroom, override − ours), where a
  cgroup's headroom is ``limit − (usage − reclaimable)``, reclaimable being the larger of
  the inactive file list and every clean file page no process maps (page cache the
  kernel drops before the cgroup OOMs; ``cgroup.reclaimable``). The override acts like a
  memory cgroup of that size around elbowroom's own process tree: "ours" is the bytes
  resident in this process and its descendants (the runners), so the cap is deterministic
  whatever else the machine runs, while real shortage elsewhere still shows through MemAvailable.
"""

from __future__ import annotations

import collections
import dataclasses
import functools
import os
import sys
import threading
import time
from collections.abc import Callable
from dataclasses import asdict
from pathlib import Path
from typing import Any

import psutil

from elbowroom.config import Settings
from elbowroom.memory.cgroup import CgroupReading, read_cgroup, read_text
from elbowroom.memory.macos import (
    SYSCTL_NAMES,
    metal_working_set,
    parse_swapusage,
    parse_sysctl,
    parse_vm_stat,
    pressure_level_name,
    run_command,
    wired_limit,
)
from elbowroom.memory.nvml import gpu_memory
from elbowroom.memory.process import measure_tree
from elbowroom.memory.types import PSI_RECENT_S, Probe, Psi, Snapshot

__all__ = [
    "CgroupReading",
    "default_probe",
    "gpu_memory",
    "linux_probe",
    "macos_probe",
    "parse_meminfo",
    "parse_psi",
    "parse_sysctl",
    "parse_vm_stat",
    "psutil_probe",
    "read_cgroup",
    "snapshot_to_dict",
]

# ---------------------------------------------------------------- parsers (pure)


def parse_meminfo(text: str) -> dict[str, int]:
    """``/proc/meminfo`` as bytes (fields without a unit, e.g. HugePages_Total, stay counts)."""
    out: dict[str, int] = {}
    for line in text.splitlines():
        key, _, rest = line.partition(":")
        parts = rest.split()
        if not parts or not parts[0].isdigit():
            continue
        scale = 1024 if len(parts) > 1 and parts[1] == "kB" else 1
        out[key.strip()] = int(parts[0]) * scale
    return out


def parse_psi(text: str) -> Psi | None:
    """A PSI file (``some``/``full`` lines of ``avgN=`` percentages); None if unreadable."""
    values: dict[str, dict[str, float]] = {}
    for line in text.splitlines():
        kind, *fields = line.split()
        pairs = dict(f.split("=", 1) for f in fields if "=" in f)
        try:
            values[kind] = {k: float(v) for k, v in pairs.items()}
        except ValueError:
            return None
    some = values.get("some")
    if some is None:
        return None
    full = values.get("full", {})
    return Psi(
        some_avg10=some.get("avg10", 0.0),
        some_avg60=some.get("avg60", 0.0),
        full_avg10=full.get("avg10", 0.0),
        full_avg60=full.get("avg60", 0.0),
        some_total_us=int(some.get("total", 0)),
    )


PSI_MIN_SPAN_S = 0.2  # the shortest span some_recent is measured over
_psi_lock = threading.Lock()
_psi_seen: dict[str, collections.deque[tuple[float, int]]] = {}


def with_recent(key: str, psi: Psi, now: float) -> Psi:
    """``psi`` with ``some_recent``: the stall rate since this process's oldest reading of
    the same file (``key``) within the last PSI_RECENT_S seconds (at least PSI_MIN_SPAN_S
    ago; else None, as on the first reading)."""
    with _psi_lock:
        seen = _psi_seen.setdefault(key, collections.deque())
        seen.append((now, psi.some_total_us))
        while len(seen) > 1 and now - seen[1][0] >= PSI_RECENT_S:
            seen.popleft()  # keep the newest reading that is at least the window old
        then, total = seen[0]
    span = now - then
    if span < PSI_MIN_SPAN_S or psi.some_total_us < total:
        return psi
    stalled = (psi.some_total_us - total) / 1e6
    return dataclasses.replace(psi, some_recent=min(100.0, 100.0 * stalled / span))


# ---------------------------------------------------------------- effective numbers


def _own_tree_resident() -> int:
    """Bytes resident in this process and its descendants: what the override is charged."""
    return measure_tree(os.getpid()).resident


def _effective(
    *,
    platform: str,
    host_total: int,
    host_available: int,
    override: int | None,
    override_used: Callable[[], int] | None,
    cgroup: CgroupReading | None = None,
    **extra: Any,
) -> Snapshot:
    total, available = host_total, max(0, host_available)
    if cgroup is not None and cgroup.limit is not None and cgroup.headroom is not None:
        total = min(total, cgroup.limit)
        available = min(available, cgroup.headroom)
    if override is not None:
        ours = (override_used or _own_tree_resident)()
        available = min(available, max(0, override - ours))
        total = min(total, override)
    available = min(available, total)
    return Snapshot(
        platform=platform,
        total=total,
        available=available,
        used=total - available,
        host_total=host_total,
        host_available=host_available,
        cgroup_version=cgroup.version if cgroup else None,
        cgroup_limit=cgroup.limit if cgroup else None,
        cgroup_usage=cgroup.usage if cgroup else None,
        override=override,
        taken_at=time.monotonic(),
        **extra,
    )


# ---------------------------------------------------------------- Linux


def linux_probe(
    *,
    proc: Path = Path("/proc"),
    cgroup_root: Path = Path("/sys/fs/cgroup"),
    self_cgroup: Path | None = None,
    override: int | None = None,
    nvml: bool = True,
    override_used: Callable[[], int] | None = None,
) -> Snapshot:
    """Read a Linux Snapshot from files under ``proc`` and ``cgroup_root``.

    ``self_cgroup`` is the cgroup membership file to follow (default ``proc/self/cgroup``;
    pass ``/proc/<pid>/cgroup`` to see the machine as another process does).
    ``override_used`` returns the bytes charged against ``override`` (default: this
    process tree's resident bytes; tests inject a number).
    Raises OSError only when ``proc/meminfo`` itself cannot be read.
    """
    info = parse_meminfo((proc / "meminfo").read_text())
    host_total = info["MemTotal"]
    # MemAvailable exists since Linux 3.14; before it, free + reclaimable cache approximates.
    host_available = info.get("MemAvailable")
    if host_available is None:
        cache = info.get("Cached", 0) + info.get("Buffers", 0) - info.get("Shmem", 0)
        host_available = info.get("MemFree", 0) + max(0, cache)
    membership = read_text(self_cgroup or proc / "self" / "cgroup") or ""
    cgroup = read_cgroup(membership, cgroup_root)
    # A limited v2 cgroup has its own PSI, which is what stalls *us*; else the host's.
    psi_file, psi_text = proc / "pressure" / "memory", None
    if cgroup is not None and cgroup.limit is not None and cgroup.pressure_file is not None:
        psi_text = read_text(cgroup.pressure_file)
        if psi_text is not None:
            psi_file = cgroup.pressure_file
    if psi_text is None:
        psi_text = read_text(psi_file)
    psi = parse_psi(psi_text) if psi_text else None
    if psi is not None:
        psi = with_recent(str(psi_file), psi, time.monotonic())
    swap_total = info.get("SwapTotal", 0)
    return _effective(
        platform="linux",
        host_total=host_total,
        host_available=host_available,
        override=override,
        override_used=override_used,
        cgroup=cgroup,
        swap_total=swap_total,
        swap_used=max(0, swap_total - info.get("SwapFree", 0)),
        psi=psi,
        gpus=gpu_memory() if nvml else (),
    )


# ---------------------------------------------------------------- macOS


def macos_probe(
    *,
    run: Callable[[list[str]], str] = run_command,
    override: int | None = None,
    override_used: Callable[[], int] | None = None,
) -> Snapshot:
    """A macOS Snapshot from ``sysctl`` and ``vm_stat`` (``run`` is injected by tests).

    available = free + speculative + inactive + purgeable pages (compressed pages are not
    available: getting them back costs decompression or swap), capped at total − wired −
    compressor, because purgeable pages may also sit on the inactive queue.
    """
    sysctl = parse_sysctl(run(["sysctl", *SYSCTL_NAMES]))
    if not sysctl.get("hw.memsize", "").isdigit():
        raise OSError("sysctl hw.memsize gave no memory size")
    total = int(sysctl["hw.memsize"])
    page, pages = parse_vm_stat(run(["vm_stat"]))
    free = sum(
        pages.get(k, 0)
        for k in ("Pages free", "Pages speculative", "Pages inactive", "Pages purgeable")
    )
    pinned = pages.get("Pages wired down", 0) + pages.get("Pages occupied by compressor", 0)
    available = max(0, min(free * page, total - pinned * page))
    swap_total, swap_used = parse_swapusage(sysctl.get("vm.swapusage"))
    return _effective(
        platform="darwin",
        host_total=total,
        host_available=available,
        override=override,
        override_used=override_used,
        swap_total=swap_total,
        swap_used=swap_used,
        os_pressure=pressure_level_name(sysctl),
        gpu_working_set=metal_working_set(total, sysctl),
        gpu_wired_limit=wired_limit(sysctl) if sysctl.get("hw.optional.arm64") == "1" else None,
    )


# ---------------------------------------------------------------- elsewhere


def psutil_probe(
    *, override: int | None = None, override_used: Callable[[], int] | None = None
) -> Snapshot:
    """The portable fallback (Windows, BSD): psutil's total/available and swap."""
    vm = psutil.virtual_memory()
    sw = psutil.swap_memory()
    return _effective(
        platform=sys.platform,
        host_total=int(vm.total),
        host_available=int(vm.available),
        override=override,
        override_used=override_used,
        swap_total=int(sw.total),
        swap_used=int(sw.used),
        gpus=gpu_memory(),
    )


def default_probe(settings: Settings | None = None) -> Probe:
    """The probe for this platform with ``settings.override_memory`` applied."""
    override = settings.override_memory if settings is not None else None
    if sys.platform.startswith("linux"):
        return functools.partial(linux_probe, override=override)
    if sys.platform == "darwin":
        return functools.partial(macos_probe, override=override)
    return functools.partial(psutil_probe, override=override)


def snapshot_to_dict(snap: Snapshot) -> dict[str, Any]:
    """A JSON-ready dict of a Snapshot (bytes stay ints; psi/gpus nested)."""
    data = asdict(snap)
    data["gpus"] = [asdict(g) for g in snap.gpus]
    return data
