"""A cgroup v1 memory cgroup that a test or benchmark creates, limits and always removes,
plus the two child programs run inside it. Shared by benchmarks/chaos.py and
tests/e2e/test_pressure.py (pytest finds it through pyproject's ``pythonpath``)."""

from __future__ import annotations

import contextlib
import os
import signal
import sys
import time
from pathlib import Path

CGROUP_V1 = Path("/sys/fs/cgroup/memory")

# Runs in the child: join the cgroup named by argv[1], then exec the rest of argv.
JOIN = (
    "import os, sys; open(os.path.join(sys.argv[1], 'cgroup.procs'), 'w').write(str(os.getpid()));"
    " os.execv(sys.argv[2], sys.argv[2:])"
)

# The noisy neighbour, driven over stdin: "+N" holds N more MiB (touched, so really
# resident), "-N" frees the newest blocks until N MiB are gone, "-" frees everything.
# It answers "ok <bytes held>" after each line.
NEIGHBOUR = """
import sys
held = []
for line in sys.stdin:
    line = line.strip()
    if line.startswith("+"):
        n = int(line[1:]) * 1024 * 1024
        b = bytearray(n)
        b[::4096] = b"\\x01" * (n // 4096)
        held.append(b)
    elif line.startswith("-"):
        n = int(line[1:] or 0) * 1024 * 1024
        while held and (n <= 0 or n >= len(held[-1])):
            n -= len(held.pop())
    print("ok", sum(len(b) for b in held), flush=True)
"""


def oom_control(text: str) -> dict[str, int]:
    """cgroup v1 ``memory.oom_control``: ``oom_kill_disable``, ``under_oom``, ``oom_kill``
    (kernels >= 4.13; absent: 0)."""
    fields = dict(line.split() for line in text.splitlines() if line.strip())
    out = {k: int(v) for k, v in fields.items()}
    out.setdefault("oom_kill", 0)
    return out


def v1_available() -> bool:
    return os.geteuid() == 0 and (CGROUP_V1 / "memory.limit_in_bytes").exists()


class Cgroup:
    def __init__(self, name: str, limit: int) -> None:
        self.path = CGROUP_V1 / name
        self.path.mkdir()
        (self.path / "memory.limit_in_bytes").write_text(str(limit))
        self.limit = limit

    def read(self, name: str) -> str:
        return (self.path / name).read_text()

    @property
    def usage(self) -> int:
        return int(self.read("memory.usage_in_bytes"))

    @property
    def oom_kills(self) -> int:
        return oom_control(self.read("memory.oom_control"))["oom_kill"]

    @property
    def failcnt(self) -> int:
        """How often usage hit the limit (the kernel reclaimed or OOM-killed each time)."""
        return int(self.read("memory.failcnt"))

    def command(self, *argv: str) -> list[str]:
        """argv prefixed so that the process joins this cgroup before it execs."""
        return [sys.executable, "-c", JOIN, str(self.path), *argv]

    def remove(self) -> None:
        deadline = time.monotonic() + 30
        while True:
            for pid in self.read("cgroup.procs").split():
                with contextlib.suppress(ProcessLookupError):
                    os.kill(int(pid), signal.SIGKILL)  # only what we started is in here
            try:
                self.path.rmdir()
                return
            except OSError:
                if time.monotonic() > deadline:
                    raise
                time.sleep(0.1)  # cleanup only: the kernel reaps the killed tasks
