"""The engine's RAM prompt cache, as llama.cpp itself accounts it: read from its log.

llama.cpp's server keeps idle slots' prompt states in a RAM prompt cache (``--cache-ram``,
``cache_ram_mib``: elbowroom's grant) and loads the best one into a slot when a request
comes. It exposes that cache nowhere but its log: not in ``/slots``, not in ``/metrics``,
not through xllamacpp. At log verbosity 4 each lookup writes, in the engine's own words::

    srv  get_availabl: updating prompt cache
    srv          load:  - found better prompt with f_keep = 0.935, f_sim = 0.957
    srv        update:  - cache state: 1 prompts, 0.902 MiB (limits: 64.000 MiB, ...)

So the runner process sends its fd 2 (where llama.cpp writes) through a pipe (``tap``): a
thread reads each line, counts what these lines say (``PromptCacheLog``), and writes the
line on to the real stderr unless it is one of the engine's info or warning lines, which
the runner's log level would not have shown (the engine used to run at verbosity 0: silent,
even about a failed load). Everything else (the runner's own Python log, the engine's
errors) passes unchanged. One process holds one engine, so the counts are that runner's.

What is counted: ``lookups`` (the engine consulted its cache for a request: "updating
prompt cache"), ``hits`` (it loaded a saved prompt into the slot: "found better prompt"),
and from the last "cache state" line its ``entries`` and ``bytes``. docs/kvcache.md.
"""

from __future__ import annotations

import atexit
import os
import re
import threading
from typing import Any

# The engine's log verbosity that writes its prompt-cache lines (4: llama.cpp's debug).
VERBOSITY = 4

# An engine log line: "0.10.528.735 I srv        update:  - cache state: ..." (timestamp,
# level letter); lines that continue a message (a sampler's parameters) start with a tab.
_ENGINE = re.compile(rb"^\d+\.\d{2}\.\d{3}\.\d{3} ([A-Z]) ")
_STATE = re.compile(rb"- cache state: (\d+) prompts, ([0-9.]+) MiB \(limits: ([0-9.]+) MiB")
_EXAMPLE = b"example_format: '"  # the chat template's example, quoted over several lines
_LOOKUP = b"updating prompt cache"
_HIT = b"- found better prompt"
_MIB = 1 << 20


class PromptCacheLog:
    """What the engine's log says about its RAM prompt cache (thread-safe)."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self.reset()

    def reset(self) -> None:
        with self._lock:
            self.entries = 0
            self.bytes = 0
            self.limit = 0
            self.lookups = 0
            self.hits = 0

    def feed(self, line: bytes) -> None:
        """Count one line of the engine's log (any other line is ignored)."""
        if _LOOKUP in line:
            with self._lock:
                self.lookups += 1
        elif _HIT in line:
            with self._lock:
                self.hits += 1
        else:
            state = _STATE.search(line)
            if state is not None:
                with self._lock:
                    self.entries = int(state.group(1))
                    self.bytes = round(float(state.group(2)) * _MIB)
                    self.limit = round(float(state.group(3)) * _MIB)

    def stats(self) -> dict[str, Any]:
        """The RAM tier's part of a runner's ``kv_cache`` stats."""
        with self._lock:
            return {
                "entries_ram": self.entries,
                "bytes_ram": self.bytes,
                "hits_ram": self.hits,
                "misses_ram": self.lookups - self.hits,
                "lookups_ram": self.lookups,
            }


class Shown:
    """Which lines written to fd 2 go on to the real stderr: all of them when the runner
    logs at debug; else all but the engine's info and warning lines (llama.cpp warns on
    every request that its slot holds whole: "n_past was set to ...") and the lines that
    continue them:
    those that start with a tab (a sampler's parameters), and the chat template's example
    at load, quoted over several lines up to a line that ends the quote. Any other line
    without the engine's prefix may be anyone's (a traceback, ggml's own allocation error
    that a failed load is told by): it is shown."""

    def __init__(self, verbose: bool) -> None:
        self.verbose = verbose
        self._hiding = False  # the last engine line was hidden: its tab lines are too
        self._quoted = False  # inside the hidden example's quote

    def __call__(self, line: bytes) -> bool:
        if self.verbose:
            return True
        if self._quoted:
            self._quoted = not line.endswith(b"'")
            return False
        found = _ENGINE.match(line)
        if found is not None:
            self._hiding = found.group(1) != b"E"
            self._quoted = self._hiding and _EXAMPLE in line and not line.endswith(b"'")
            return not self._hiding
        if self._hiding and line.startswith(b"\t"):
            return False
        self._hiding = False
        return True


class _Tap:
    """fd 2 through a pipe: each line counted, and passed on when ``shown``."""

    def __init__(self, verbose: bool) -> None:
        self.shown = Shown(verbose)
        self.prompt_cache = PromptCacheLog()
        self._out = os.dup(2)  # the real stderr
        read, self._write = os.pipe()
        os.dup2(self._write, 2)
        self._reader = threading.Thread(
            target=self._pump, args=(read,), name="engine-log", daemon=True
        )
        self._reader.start()
        atexit.register(self.close)

    def _pump(self, fd: int) -> None:
        pending = b""
        with os.fdopen(fd, "rb", buffering=0) as pipe:
            while True:
                try:
                    chunk = pipe.read(65536)
                except OSError:
                    break
                if not chunk:
                    break
                pending += chunk
                *lines, pending = pending.split(b"\n")
                self._lines(lines)
        if pending:
            self._lines([pending])

    def _lines(self, lines: list[bytes]) -> None:
        out = []
        for line in lines:
            self.prompt_cache.feed(line)
            if self.shown(line):
                out.append(line + b"\n")
        if out:
            _write_all(self._out, b"".join(out))

    def close(self) -> None:
        """fd 2 back to the real stderr; what the pipe still holds is passed on first."""
        if self._write < 0:
            return
        os.dup2(self._out, 2)
        os.close(self._write)
        self._write = -1
        self._reader.join(timeout=2.0)


def _write_all(fd: int, data: bytes) -> None:
    view = memoryview(data)
    while view:
        try:
            n = os.write(fd, view)
        except OSError:
            return  # the real stderr is gone: nothing to pass on to
        view = view[n:]


_TAP: _Tap | None = None
_TAP_LOCK = threading.Lock()


def tap(verbose: bool) -> PromptCacheLog:
    """Send this process's fd 2 through the engine-log reader (once per process) and return
    its prompt-cache counts, reset for the engine about to load."""
    global _TAP
    with _TAP_LOCK:
        if _TAP is None:
            _TAP = _Tap(verbose)
        _TAP.shown.verbose = verbose
        _TAP.prompt_cache.reset()
        return _TAP.prompt_cache
