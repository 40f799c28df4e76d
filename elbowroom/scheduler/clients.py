"""Per-client fairness: which API key a request came with, and its share of a model's queue.

The server's key middleware names the client (``key-1``, ``admin``...) in ``current_client``
for the duration of the request, only when more than one key is configured (one key cannot
tell clients apart). ``Scheduler.use`` reads it: while every slot of a model is busy, one
client may hold at most ``queue_cap`` of the requests waiting for it, so one key cannot fill
a model's whole queue and shut the others out (docs/security.md).
"""

from __future__ import annotations

import math
from contextvars import ContextVar

current_client: ContextVar[str | None] = ContextVar("elbowroom_client", default=None)


def queue_cap(queue_size: int, share: float) -> int:
    """Requests one client may have waiting for one model: ``share`` of the queue, >= 1."""
    return max(1, math.floor(queue_size * share))
