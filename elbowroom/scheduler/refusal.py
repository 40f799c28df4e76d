"""A policy refusal as the 507 the client gets. PURE apart from one log line.

The policy sees the host load ceiling less the server process's own bytes; a host 507
reports the ceiling itself and what the server holds of it, plus the memory limit and the
rule it came from, so the body explains itself. A GPU pool's 507 gives that pool's numbers
alone (the server's host bytes are no part of a GPU's ceiling). ``elbowroom plan`` shows
the same suggestions.
"""

from __future__ import annotations

import dataclasses
import logging

from elbowroom.errors import InsufficientMemory
from elbowroom.memory.budget import Limit
from elbowroom.scheduler.policy import HOST, Refuse
from elbowroom.units import format_size

__all__ = ["insufficient_memory"]

log = logging.getLogger("elbowroom.scheduler")


def insufficient_memory(refusal: Refuse, server: int, limit: Limit | None) -> InsufficientMemory:
    """The 507 for ``refusal``; ``server``: the server's bytes the decision left out of the
    ceiling; ``limit``: the memory limit of that decision (None before any observation)."""
    log.warning(
        "refused %s: needs %s, available %s, evictable %s, ceiling %s, committed %s",
        refusal.model,
        format_size(refusal.needed),
        format_size(refusal.available),
        format_size(refusal.evictable),
        format_size(refusal.limit),
        format_size(refusal.committed),
    )
    message = refusal.message()
    if server and refusal.pool == HOST:
        # The policy saw the host ceiling less the server's own bytes: report the ceiling
        # itself, and what the server holds of it. A GPU pool's ceiling never held the
        # server's host bytes: its 507 speaks of that pool only.
        refusal = dataclasses.replace(refusal, limit=refusal.limit + server)
        bare = dataclasses.replace(refusal, suggestions=()).message()
        message = f"{bare} (the server process itself holds {format_size(server)} of it)"
        if refusal.suggestions:
            message += ": " + "; or ".join(s.message for s in refusal.suggestions)
    details = refusal.details()
    details["memory_limit"] = limit.value if limit is not None else 0
    details["memory_rule"] = limit.rule if limit is not None else "host"
    details["memory_rule_why"] = limit.rule_why if limit is not None else ""
    details["server_usage"] = server
    return InsufficientMemory(message, code="insufficient_memory", details=details)
