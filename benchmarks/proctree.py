"""What the memory benchmarks (soak, resident_idle_memory) share: waiting on a condition
with a deadline, and the bytes of a server's process tree, measured the way the server
measures its runners (``elbowroom.memory.process.measure_pid``: anonymous vs file-backed
from ``/proc/PID/smaps_rollup``)."""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import Any, TypeVar

import psutil

from elbowroom.memory.process import measure_pid
from elbowroom.memory.types import ProcessMemory

T = TypeVar("T")


def wait_for(condition: Any, timeout: float, what: str) -> Any:
    """``condition()``'s first truthy value, polled every 0.1 s; exits after ``timeout``."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        value = condition()
        if value:
            return value
        time.sleep(0.1)
    raise SystemExit(f"timed out after {timeout:.0f} s waiting for {what}")


def readings(read: Callable[[], T], seconds: float = 3.0) -> list[T]:
    """``read()`` every 0.25 s for ``seconds``: the server's monitor thread allocates and
    frees a little, so the benchmarks report medians over a few seconds."""
    out = []
    deadline = time.monotonic() + seconds
    while time.monotonic() < deadline:
        out.append(read())
        time.sleep(0.25)
    return out


def tree(pid: int) -> list[psutil.Process]:
    """``pid`` and all its descendants, root first ([] when it is gone)."""
    try:
        root = psutil.Process(pid)
        return [root, *root.children(recursive=True)]
    except psutil.NoSuchProcess:
        return []


def process_memory(pid: int) -> ProcessMemory | None:
    """One process's bytes; None when it exited meanwhile."""
    try:
        return measure_pid(pid)
    except (ProcessLookupError, FileNotFoundError):
        return None
