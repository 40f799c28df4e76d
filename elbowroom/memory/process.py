"""Per-process accounting: anonymous vs file-backed (mmap) vs GPU bytes.

Linux reads ``/proc/PID/status``: ``RssAnon`` is the process's own memory (KV cache,
activations, resident engines) and cannot be reclaimed; ``RssFile + RssShmem`` is
file-backed and shared memory (mmap'd GGUF weights) that the OS may drop and re-read.
Those are the kernel's running counters, read in ~15 µs. ``/proc/PID/smaps_rollup`` gives
the same split (``Anonymous`` vs ``Rss − Anonymous``) but walks every page table of the
process — ~6 ms for a small loaded LLM, under the process's mmap lock and on the cores
the engine decodes on — so it is only the fallback where status lacks the split
(Linux < 4.5). Off Linux, psutil only knows RSS, so all of it counts as anonymous: the
safe side of the line. A process that no longer exists raises ProcessLookupError.
"""

from __future__ import annotations

import contextlib
import os
import sys
import time
from collections.abc import Callable
from pathlib import Path

import psutil

from elbowroom.memory.nvml import gpu_bytes_by_pid
from elbowroom.memory.types import ZERO_PROCESS_MEMORY, ProcessMemory

__all__ = ["ServerBytes", "measure_pid", "measure_tree", "parse_smaps_rollup", "parse_status"]

_PROC = Path("/proc")


def _kb_fields(text: str) -> dict[str, int]:
    out: dict[str, int] = {}
    for line in text.splitlines():
        key, _, rest = line.partition(":")
        parts = rest.split()
        if len(parts) == 2 and parts[1] == "kB" and parts[0].isdigit():
            out[key.strip()] = int(parts[0]) * 1024
    return out


def parse_smaps_rollup(text: str) -> tuple[int, int, int]:
    """``smaps_rollup`` -> (anonymous, file_backed, swap) bytes."""
    f = _kb_fields(text)
    anonymous = f.get("Anonymous", 0)
    return anonymous, max(0, f.get("Rss", 0) - anonymous), f.get("Swap", 0)


def parse_status(text: str) -> tuple[int, int, int]:
    """``/proc/PID/status`` -> (anonymous, file_backed, swap) bytes."""
    f = _kb_fields(text)
    return f.get("RssAnon", 0), f.get("RssFile", 0) + f.get("RssShmem", 0), f.get("VmSwap", 0)


def _read(path: str) -> str:
    with open(path, encoding="utf-8") as f:
        return f.read()


def _linux(pid: int, proc: Path) -> tuple[int, int, int]:
    # Plain strings, not pathlib: before Python 3.12 a PurePath interns every part, so a pid
    # string made for each of these readings (many a second under load) churned the
    # interpreter's interned-string table until it doubled (+0.9 MiB for good, traced in
    # the soak benchmark).
    base = f"{proc}/{pid}"
    try:
        status = _read(f"{base}/status")
    except FileNotFoundError:
        if not os.path.exists(base):
            raise ProcessLookupError(pid) from None
        status = ""
    if "RssAnon:" in status:
        return parse_status(status)
    try:
        return parse_smaps_rollup(_read(f"{base}/smaps_rollup"))
    except FileNotFoundError:
        raise ProcessLookupError(pid) from None


def _psutil(pid: int) -> tuple[int, int, int]:
    try:
        rss = int(psutil.Process(pid).memory_info().rss)
    except psutil.NoSuchProcess:
        raise ProcessLookupError(pid) from None
    return rss, 0, 0


def _measure(pid: int, proc: Path, gpu: dict[int, int]) -> ProcessMemory:
    if sys.platform.startswith("linux") or proc != _PROC:
        anonymous, file_backed, swap = _linux(pid, proc)
    else:
        anonymous, file_backed, swap = _psutil(pid)
    return ProcessMemory(anonymous, file_backed, swap, gpu.get(pid, 0), (pid,))


def measure_pid(pid: int, *, proc: Path = _PROC) -> ProcessMemory:
    """Bytes one process holds, by kind. GPU bytes come from NVML for the real /proc only."""
    return _measure(pid, proc, gpu_bytes_by_pid() if proc == _PROC else {})


def _children_linux(pid: int) -> list[int] | None:
    """Direct children from /proc/PID/task/*/children; None where the kernel lacks it."""
    tasks = f"{_PROC}/{pid}/task"  # strings, not pathlib: see _linux
    try:
        tids = os.listdir(tasks)
    except FileNotFoundError:
        return []  # exited meanwhile
    kids: list[int] = []
    for tid in tids:
        try:
            kids.extend(int(c) for c in _read(f"{tasks}/{tid}/children").split())
        except FileNotFoundError:
            if not os.path.exists(f"{tasks}/{tid}"):
                continue  # the thread exited
            return None  # CONFIG_PROC_CHILDREN is off
    return kids


def _descendants(pid: int) -> list[int]:
    # /proc/PID/task/*/children walks only our own subtree (~0.2 ms here); psutil scans
    # every process on the machine for its parent (~10 ms), too slow for once a second.
    if sys.platform.startswith("linux"):
        found: list[int] = []
        stack = [pid]
        while stack:
            kids = _children_linux(stack.pop())
            if kids is None:
                break
            found.extend(kids)
            stack.extend(kids)
        else:
            return found
    try:
        return [c.pid for c in psutil.Process(pid).children(recursive=True)]
    except psutil.NoSuchProcess:
        return []


def measure_tree(pid: int, *, include_self: bool = True) -> ProcessMemory:
    """Bytes held by ``pid`` and all its descendants (children that exit meanwhile skipped).

    Raises ProcessLookupError when ``pid`` itself is gone.
    """
    if not psutil.pid_exists(pid):
        raise ProcessLookupError(pid)
    gpu = gpu_bytes_by_pid()
    total = _measure(pid, _PROC, gpu) if include_self else ZERO_PROCESS_MEMORY
    for child in _descendants(pid):
        try:
            total = total + _measure(child, _PROC, gpu)
        except ProcessLookupError:
            continue
    return total


def forkserver_pid() -> int | None:
    """The pid of this process's multiprocessing forkserver while it runs (runners start
    from it: runtime/supervisor.py ``start_context``); None when there is none."""
    from multiprocessing import forkserver

    pid = getattr(getattr(forkserver, "_forkserver", None), "_forkserver_pid", None)
    return pid if isinstance(pid, int) else None


class ServerBytes:
    """The server process's anonymous bytes (request bodies, Python objects: what it cannot
    give back), and its runners' forkserver's (the runner code it imported once), re-read
    at most every ``ttl`` seconds: the scheduler asks on every decision. File-backed pages
    (the interpreter, libraries) are left out, as for runners' weights."""

    def __init__(self, ttl: float = 0.5, clock: Callable[[], float] = time.monotonic) -> None:
        self._ttl = ttl
        self._clock = clock
        self._at = -ttl
        self._value = 0

    def __call__(self) -> int:
        now = self._clock()
        if now - self._at >= self._ttl:
            try:
                self._value = measure_pid(os.getpid()).anonymous
            except (ProcessLookupError, OSError):
                self._value = 0
            pid = forkserver_pid()
            if pid is not None:
                with contextlib.suppress(ProcessLookupError, OSError):
                    self._value += measure_pid(pid).anonymous
            self._at = now
        return self._value
