"""memory.heap.trim against the real C library: freed heap pages go back to the OS."""

from __future__ import annotations

import os
import platform
import subprocess
import sys
from pathlib import Path

import pytest

from elbowroom.memory.heap import trim

REPO = Path(__file__).resolve().parents[3]

# A child fills 40 MiB of its main heap with 4 KiB blocks (below glibc's mmap threshold),
# pins the heap's top with one more block and frees the rest: glibc keeps those pages
# mapped (they are not at the top) until malloc_trim hands them back.
CHILD = """
import ctypes, os
from elbowroom.memory.heap import trim
from elbowroom.memory.process import measure_pid
libc = ctypes.CDLL(None)
libc.malloc.restype = ctypes.c_void_p
libc.malloc.argtypes = [ctypes.c_size_t]
libc.free.argtypes = [ctypes.c_void_p]
blocks = [libc.malloc(4096) for _ in range(10240)]
for b in blocks:
    ctypes.memset(b, 1, 4096)
pin = libc.malloc(64)
for b in blocks:
    libc.free(b)
before = measure_pid(os.getpid()).anonymous
trimmed = trim()
after = measure_pid(os.getpid()).anonymous
print(trimmed, before, after)
"""


@pytest.mark.skipif(platform.libc_ver()[0] != "glibc", reason="malloc_trim is glibc's")
def test_trim_gives_freed_heap_pages_back() -> None:
    env = {**os.environ, "PYTHONPATH": str(REPO)}
    out = subprocess.run(
        [sys.executable, "-c", CHILD], env=env, capture_output=True, text=True, timeout=60
    )
    assert out.returncode == 0, out.stderr
    trimmed, before, after = out.stdout.split()
    assert trimmed == "True"
    assert int(before) - int(after) >= 30 * 2**20  # most of the 40 MiB freed


def test_trim_answers_whether_it_could() -> None:
    assert trim() is (platform.libc_ver()[0] == "glibc")
