"""A runner target that reports what its process had imported when it began, and who its
parent is (imported by the started child: the test directory is on sys.path, which
multiprocessing passes to it). It imports nothing of elbowroom itself."""

from __future__ import annotations

import os
import sys
from multiprocessing.connection import Connection
from typing import Any


def report_main(conn: Connection, spec: Any, options: Any) -> None:
    conn.send({"modules": sorted(m for m in sys.modules if m.startswith("elbowroom")),
               "ppid": os.getppid()})  # fmt: skip
    conn.close()
