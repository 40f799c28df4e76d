"""NVIDIA GPU memory through NVML (the ``nvidia-ml-py`` package, imported as ``pynvml``).

NVML is initialised once per process; when there is no driver (no GPU, macOS, CI) the
failure is remembered so the monitor does not retry a failing ``dlopen`` every second.
Every NVML error degrades to "no GPU information" rather than failing a probe: GPU bytes
are extra facts, never the reason a snapshot cannot be taken.
"""

from __future__ import annotations

import logging
import threading
from typing import Any

from elbowroom.memory.types import GpuMemory

log = logging.getLogger(__name__)

_lock = threading.Lock()
_state: dict[str, Any] = {"tried": False, "nvml": None}


def _nvml() -> Any | None:
    """The initialised pynvml module, or None where NVML cannot be used."""
    with _lock:
        if not _state["tried"]:
            _state["tried"] = True
            try:
                import pynvml

                pynvml.nvmlInit()
            except Exception as exc:  # ImportError, NVMLError_LibraryNotFound, driver errors
                log.debug("NVML unavailable: %s", exc)
            else:
                _state["nvml"] = pynvml
        return _state["nvml"]


def _text(value: Any) -> str:
    return value.decode() if isinstance(value, bytes) else str(value)


def gpu_memory() -> tuple[GpuMemory, ...]:
    """Total/free/used bytes per NVIDIA GPU; () without a driver.

    Devices whose memory NVML cannot report (Jetson's unified memory answers
    NOT_SUPPORTED) are left out: their memory is the host's, already in the snapshot.
    """
    nv = _nvml()
    if nv is None:
        return ()
    out: list[GpuMemory] = []
    try:
        count = int(nv.nvmlDeviceGetCount())
    except Exception as exc:
        log.debug("NVML device count failed: %s", exc)
        return ()
    for index in range(count):
        try:
            handle = nv.nvmlDeviceGetHandleByIndex(index)
            mem = nv.nvmlDeviceGetMemoryInfo(handle)
            name = _text(nv.nvmlDeviceGetName(handle))
        except Exception as exc:
            log.debug("NVML memory info for GPU %d failed: %s", index, exc)
            continue
        out.append(GpuMemory(index, name, int(mem.total), int(mem.free), int(mem.used)))
    return tuple(out)


def gpu_bytes_by_pid() -> dict[int, int]:
    """GPU bytes each process holds, summed over devices and compute/graphics contexts.

    Processes NVML reports without a byte count (no permission, WDDM) are left out.
    """
    nv = _nvml()
    if nv is None:
        return {}
    used: dict[int, int] = {}
    try:
        count = int(nv.nvmlDeviceGetCount())
    except Exception:
        return {}
    for index in range(count):
        try:
            handle = nv.nvmlDeviceGetHandleByIndex(index)
            procs = list(nv.nvmlDeviceGetComputeRunningProcesses(handle))
            procs += list(nv.nvmlDeviceGetGraphicsRunningProcesses(handle))
        except Exception as exc:
            log.debug("NVML process list for GPU %d failed: %s", index, exc)
            continue
        seen: set[int] = set()
        for p in procs:
            pid = int(p.pid)
            nbytes = getattr(p, "usedGpuMemory", None)
            # A process with compute and graphics contexts is listed twice on one device.
            if nbytes is None or pid in seen:
                continue
            seen.add(pid)
            used[pid] = used.get(pid, 0) + int(nbytes)
    return used
