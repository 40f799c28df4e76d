"""Give the server process's free heap pages back to the OS (glibc's ``malloc_trim``).

glibc keeps what the server frees. Only the top of the main heap is returned on its own,
and only above the trim threshold, which glibc raises (up to 64 MiB) each time a large
temporary buffer that it had mmapped is freed — an upload, a WAV answer, a big JSON body;
free chunks inside the heap stay mapped for good. ``malloc_trim(0)`` walks every arena and
returns each whole free page (``madvise(MADV_DONTNEED)``), so the process's anonymous bytes
come back to what it uses: 0.4–0.65 MiB at each idle-out of the soak benchmark's rounds
(benchmarks/results/soak.md). It takes a few ms, so the server
calls it when it goes idle — its last runner stopped (``trim_when_idle``) — not per
request.

Where there is no ``malloc_trim`` (macOS, musl) ``trim()`` does nothing and says so.
"""

from __future__ import annotations

import ctypes
import functools
from collections.abc import Callable

__all__ = ["trim"]


@functools.cache
def _malloc_trim() -> Callable[[int], int] | None:
    try:
        libc = ctypes.CDLL(None)  # the symbols already in the process: its C library
        fn = libc.malloc_trim
    except (AttributeError, OSError):
        return None
    fn.argtypes = [ctypes.c_size_t]
    fn.restype = ctypes.c_int
    return fn


def trim() -> bool:
    """Return the C heap's free pages to the OS; False where the C library cannot.

    ctypes releases the GIL for the call, so other threads run meanwhile; glibc takes each
    arena's lock in turn, so it is safe while they allocate."""
    fn = _malloc_trim()
    if fn is None:
        return False
    fn(0)
    return True
