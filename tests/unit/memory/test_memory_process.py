"""Per-process accounting: recorded smaps_rollup/status, then real child processes."""

from __future__ import annotations

import subprocess
import sys
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import pytest

from elbowroom.memory.process import measure_pid, measure_tree
from elbowroom.units import KiB, MiB

FIX = Path(__file__).resolve().parents[2] / "fixtures" / "memory" / "pids" / "proc"

# Multiplying bytes writes every page (a zeroed bytearray would stay untouched and
# unbacked), so the child really holds this much anonymous memory.
ANON = f"""
import sys
block = b"\\x01" * {100 * MiB}
print("ready", flush=True)
sys.stdin.read()
"""

MMAP = """
import mmap, sys
with open(sys.argv[1], "rb") as f:
    m = mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ)
touched = sum(m[i] for i in range(0, len(m), 4096))  # fault every page in
print("ready", flush=True)
sys.stdin.read()
"""

TREE = f"""
import subprocess, sys
g = subprocess.Popen([sys.executable, "-c", {ANON!r}], stdin=subprocess.PIPE,
                     stdout=subprocess.PIPE, text=True)
g.stdout.readline()
print(g.pid, flush=True)
sys.stdin.read()
g.stdin.close()
g.wait()
"""


@contextmanager
def child(code: str, *args: str) -> Iterator[tuple[subprocess.Popen[str], str]]:
    """A Python child that prints one line when its memory is in place, then waits."""
    proc = subprocess.Popen(
        [sys.executable, "-c", code, *args],
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        text=True,
    )
    try:
        assert proc.stdout is not None
        line = proc.stdout.readline().strip()  # blocks until the child is ready
        assert line, f"child exited early with {proc.wait()}"
        yield proc, line
    finally:
        if proc.stdin is not None:
            proc.stdin.close()
        proc.wait(timeout=30)


def test_smaps_rollup_where_status_has_no_split() -> None:
    mem = measure_pid(4242, proc=FIX)
    assert mem.anonymous == 51840 * KiB
    assert mem.file_backed == (147828 - 51840) * KiB
    assert mem.swap == 2048 * KiB
    assert mem.gpu == 0 and mem.pids == (4242,)
    assert mem.resident == 147828 * KiB


def test_status_split_read_first() -> None:
    mem = measure_pid(4243, proc=FIX)
    assert mem.anonymous == 223164 * KiB
    assert mem.file_backed == (4224 + 1024) * KiB  # file + shmem


def test_missing_process_raises_process_lookup_error() -> None:
    with pytest.raises(ProcessLookupError):
        measure_pid(999999, proc=FIX)
    with pytest.raises(ProcessLookupError):
        measure_tree(2**22 + 12345)  # above PID_MAX_LIMIT: never a live pid


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="anonymous split is Linux's")
def test_child_touching_100_mib_is_anonymous() -> None:
    with child(ANON) as (proc, _):
        mem = measure_pid(proc.pid)
    assert mem.anonymous >= 100 * MiB
    assert mem.file_backed < 100 * MiB


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="file-backed split is Linux's")
def test_child_reading_an_mmapped_file_is_file_backed(tmp_path: Path) -> None:
    data = tmp_path / "weights.bin"
    with data.open("wb") as f:
        for _ in range(64):
            f.write(b"\x07" * MiB)
    with child(MMAP, str(data)) as (proc, _):
        mem = measure_pid(proc.pid)
    assert mem.file_backed >= 64 * MiB
    assert mem.anonymous < 64 * MiB  # the mapping did not count as the process's own


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="anonymous split is Linux's")
def test_tree_includes_descendants() -> None:
    with child(TREE) as (proc, grandchild):
        tree = measure_tree(proc.pid)
        below = measure_tree(proc.pid, include_self=False)
    assert tree.pids == (proc.pid, int(grandchild))
    assert below.pids == (int(grandchild),)
    assert below.anonymous >= 100 * MiB
    assert tree.anonymous > below.anonymous
