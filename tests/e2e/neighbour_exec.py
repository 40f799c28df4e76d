"""``python neighbour_exec.py CONTROL_DIR CMD...``: fork a memory neighbour, then exec CMD.

The neighbour stays a child of the process that becomes the server, so it is inside what
ELBOWROOM_OVERRIDE_MEMORY charges (the server's process tree) and inside what the monitor
counts as ours: allocating in it raises the server's pressure level for real, the way a
model growing past its prediction would. It holds ``CONTROL_DIR/want`` MiB (rewritten any
time; touched page by page so the bytes are resident) and reports ``CONTROL_DIR/have``.
It exits when the server does (its parent changes).
"""

from __future__ import annotations

import os
import sys
import time
from pathlib import Path

MiB = 1 << 20


def neighbour(control: Path, parent: int) -> None:
    held = bytearray()
    want_file = control / "want"
    have = -1
    while os.getppid() == parent:
        try:
            want = int(want_file.read_text().strip() or 0)
        except (FileNotFoundError, ValueError):
            want = 0
        if want != have:
            held = bytearray(b"\x01") * (want * MiB)  # filled: every page resident
            have = want
            (control / "have").write_text(str(have))
        time.sleep(0.05)  # the neighbour's own pacing, not a test's synchronisation
    del held


def main() -> None:
    control = Path(sys.argv[1])
    cmd = sys.argv[2:]
    parent = os.getpid()
    if os.fork() == 0:
        try:
            neighbour(control, parent)
        finally:
            os._exit(0)
    os.execv(cmd[0], cmd)


if __name__ == "__main__":
    main()
