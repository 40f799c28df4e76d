"""`elbowroom serve` with a heap probe, for `soak.py --trace DIR`: where do the bytes go?

    python benchmarks/soak_trace.py serve --port 0 ...   (SOAK_TRACE_DIR=DIR in the env)

Starts tracemalloc (SOAK_TRACE_FRAMES frames, default 8) before the server imports
anything, then runs the ordinary CLI. On SIGUSR1 it writes DIR/<n>.pickle: the Python
heap (a tracemalloc snapshot, the tracer's own bytes excluded), glibc's view of the C heap
(mallinfo2: bytes in use vs free but kept in the arenas, and malloc_info's per-arena XML),
Python's own allocator (sys._debugmallocstats: its 1 MiB arenas, bytes in live blocks) and
the process's anonymous bytes. The probe only looks, unless SOAK_TRACE_TRIM=1: then it also
calls malloc_trim(0) and records the anonymous bytes after it (what glibc kept that it
could give back). SOAK_TRACE_FRAMES=0 leaves tracemalloc off: the tracer's own tables
interleave with the heap and inflate glibc's free bytes several times over, so take the
glibc numbers from an untraced run and the tracebacks from a traced one.

    python benchmarks/soak_trace.py report DIR FIRST LAST   # what grew between two probes

The handler runs in the main thread (Python delivers signals there), between bytecodes of
the event loop, so it sees the heap as the server leaves it.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import itertools
import os
import pickle
import signal
import sys
import tracemalloc
from pathlib import Path
from typing import Any

_FIELDS = ("arena", "ordblks", "smblks", "hblks", "hblkhd", "usmblks", "fsmblks")
_FIELDS += ("uordblks", "fordblks", "keepcost")


class _MallInfo2(ctypes.Structure):
    _fields_ = [(name, ctypes.c_size_t) for name in _FIELDS]


def _libc() -> Any:
    libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6")
    libc.mallinfo2.restype = _MallInfo2
    libc.fopen.restype = ctypes.c_void_p
    libc.fopen.argtypes = [ctypes.c_char_p, ctypes.c_char_p]
    libc.fclose.argtypes = [ctypes.c_void_p]
    libc.malloc_info.argtypes = [ctypes.c_int, ctypes.c_void_p]
    return libc


def _anonymous() -> int:
    for line in Path("/proc/self/smaps_rollup").read_text().splitlines():
        if line.startswith("Anonymous:"):
            return int(line.split()[1]) * 1024
    return 0


def _pymalloc_totals(text: str) -> dict[str, int]:
    """The summary lines of sys._debugmallocstats: arenas, bytes in used and free blocks."""
    out = {}
    for line in text.splitlines():
        name, sep, value = line.rpartition("=")
        if sep and name.startswith("#") and value.strip().replace(",", "").isdigit():
            out[name.strip("# ").strip()] = int(value.strip().replace(",", ""))
    return out


def _dump(out: Path, n: int, libc: Any) -> None:
    info = libc.mallinfo2()
    xml = out / f"{n}.malloc.xml"
    fp = libc.fopen(str(xml).encode(), b"w")
    libc.malloc_info(0, fp)
    libc.fclose(fp)
    # Python's own allocator (objects up to 512 bytes live in 1 MiB arenas it mmaps,
    # outside glibc's counts): sys._debugmallocstats writes its table to fd 2.
    stats = out / f"{n}.pymalloc.txt"
    saved = os.dup(2)
    with open(stats, "wb") as f:
        os.dup2(f.fileno(), 2)
        try:
            sys._debugmallocstats()
        finally:
            os.dup2(saved, 2)
            os.close(saved)
    tracing = tracemalloc.is_tracing()
    record: dict[str, Any] = {
        "anonymous": _anonymous(),
        "mallinfo2": {name: getattr(info, name) for name in _FIELDS},
        "traced": tracemalloc.get_traced_memory()[0],
        "tracer_bytes": tracemalloc.get_tracemalloc_memory(),
        "pymalloc": _pymalloc_totals(stats.read_text()),
        "snapshot": tracemalloc.take_snapshot().filter_traces(
            [tracemalloc.Filter(False, tracemalloc.__file__)]
        )
        if tracing
        else None,
    }
    if os.environ.get("SOAK_TRACE_TRIM") == "1":  # what glibc would give back if asked
        libc.malloc_trim(0)
        record["anonymous_after_trim"] = _anonymous()
    part = out / f"{n}.pickle.part"  # soak.py waits for the final name: write, then rename
    part.write_bytes(pickle.dumps(record))
    part.rename(out / f"{n}.pickle")


def report(folder: Path, first: int, last: int, top: int = 25) -> None:
    """What changed between probe ``first`` and probe ``last``: the process's anonymous
    bytes, glibc's in-use and free-but-kept bytes, the Python heap, and the tracebacks
    whose bytes grew the most."""
    a, b = (pickle.loads((folder / f"{n}.pickle").read_bytes()) for n in (first, last))

    def mib(n: int) -> str:
        return f"{n / 2**20:+.2f} MiB"

    print(f"probe {first} -> {last}")
    print(f"  anonymous        {mib(b['anonymous'] - a['anonymous'])}")
    for name in ("arena", "hblkhd", "uordblks", "fordblks", "keepcost"):
        print(f"  mallinfo2.{name:9s} {mib(b['mallinfo2'][name] - a['mallinfo2'][name])}")
    if "anonymous_after_trim" in b:
        trimmed = b["anonymous"] - b["anonymous_after_trim"]
        print(f"  malloc_trim gave back {trimmed / 2**20:.2f} MiB")
    for name in ("arenas allocated current", "bytes in allocated blocks"):
        name_a, name_b = a.get("pymalloc", {}).get(name), b.get("pymalloc", {}).get(name)
        if name_a is not None and name_b is not None:
            print(f"  pymalloc {name}: {name_a} -> {name_b}")
    print(f"  python traced    {mib(b['traced'] - a['traced'])}")
    print(f"  tracer's own     {mib(b['tracer_bytes'] - a['tracer_bytes'])}")
    if b["snapshot"] is None:
        return
    for stat in b["snapshot"].compare_to(a["snapshot"], "traceback")[:top]:
        print(f"  {stat.size_diff / 1024:+9.1f} KiB {stat.count_diff:+7d} objects")
        for line in stat.traceback.format(limit=4):
            print(f"      {line}")


def main() -> int:
    if sys.argv[1:2] == ["report"]:  # soak_trace.py report DIR FIRST LAST
        report(Path(sys.argv[2]), int(sys.argv[3]), int(sys.argv[4]))
        return 0
    out = Path(os.environ["SOAK_TRACE_DIR"])
    out.mkdir(parents=True, exist_ok=True)
    frames = int(os.environ.get("SOAK_TRACE_FRAMES", "8"))
    if frames > 0:  # 0: glibc's numbers only, without the tracer's own bytes in them
        tracemalloc.start(frames)
    libc = _libc()
    counter = itertools.count()
    signal.signal(signal.SIGUSR1, lambda *_: _dump(out, next(counter), libc))
    from elbowroom.cli import main as cli

    return cli(sys.argv[1:])


if __name__ == "__main__":
    raise SystemExit(main())
