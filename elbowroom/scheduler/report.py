"""Plain-JSON views of the scheduler's state for /api/ps, /api/memory and the CLI."""

from __future__ import annotations

import dataclasses
import enum
import math
import time
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

from elbowroom.memory import budget
from elbowroom.memory.monitor import Sample
from elbowroom.memory.pools import pool_to_dict
from elbowroom.scheduler.records import Lane, Loaded, Phase


def plain(value: Any) -> Any:
    """Dataclasses, enums, paths and tuples as JSON-ready dicts, strings and lists."""
    if dataclasses.is_dataclass(value) and not isinstance(value, type):
        return {f.name: plain(getattr(value, f.name)) for f in dataclasses.fields(value)}
    if isinstance(value, enum.Enum):
        return value.value
    if isinstance(value, Path):
        return str(value)
    if isinstance(value, dict):
        return {str(k): plain(v) for k, v in value.items()}
    if isinstance(value, list | tuple):
        return [plain(v) for v in value]
    if isinstance(value, float) and not math.isfinite(value):
        return None
    return value


def iso(wall: float | None) -> str | None:
    if wall is None:
        return None
    return datetime.fromtimestamp(wall, tz=UTC).isoformat(timespec="seconds")


def describe(rec: Loaded, lane: Lane | None, now: float) -> dict[str, Any]:
    """One row of ``Scheduler.ps()``. ``now`` is the scheduler clock (for expires_at)."""
    mem = rec.measure()
    wall_now = time.time()  # display only: clock seconds become wall-clock instants
    expires = None if rec.expires_at is None else wall_now + (rec.expires_at - now)
    ready = rec.ready
    return {
        "id": rec.spec.id,
        "kind": rec.spec.kind.value,
        "engine": rec.spec.engine,
        "holding": rec.spec.holding.value,
        "state": rec.phase.value,
        "pid": rec.runner.pid,
        "pinned": rec.pinned,
        "busy": rec.busy,
        "waiting": lane.waiting if lane is not None else 0,
        "anonymous": mem.anonymous if mem is not None else 0,
        "file_backed": mem.file_backed if mem is not None else 0,
        "gpu": mem.gpu if mem is not None else 0,
        "bytes": rec.held_bytes(mem),
        "predicted": rec.predicted,
        "n_ctx": rec.n_ctx or None,
        "kv_type": rec.kv_type if rec.n_ctx else None,
        "slots": rec.slots if rec.n_ctx else None,
        "last_used": iso(rec.last_used_wall),
        "expires_at": iso(expires),
        "load_seconds": ready.load_seconds if ready is not None else None,
        "restarts": lane.restarts if lane is not None else 0,
        "oom_kills": lane.oom_kills if lane is not None else 0,
        "last_exit": lane.last_cause if lane is not None else None,
        # Where its layers are: "100% GPU", "35%/65% CPU/GPU", ... (None: not an LLM or no
        # placement was made, e.g. no GPU).
        "processor": rec.placement.split if rec.placement is not None else None,
        "placement": rec.placement.to_dict() if rec.placement is not None else None,
    }


def memory_report(
    sample: Sample, loaded: list[Loaded], server: int, loads_paused: bool
) -> dict[str, Any]:
    """``Scheduler.memory_report()``: the monitor's fresh sample and what is committed."""
    limit = sample.limit
    committed = sum(rec.held_bytes() for rec in loaded)
    return {
        "snapshot": plain(sample.snapshot),
        "limit": budget.limit_to_dict(limit),
        "thresholds": {"soft": limit.soft, "hard": limit.hard},
        "pressure": sample.level.label,
        "pressure_reasons": list(sample.reasons),
        "own_usage": sample.own_usage,
        "committed": committed,
        "ceiling": limit.ceiling,
        "server_usage": server,
        "available": max(0, limit.ceiling - committed - server),
        "reservations": [
            {"id": rec.spec.id, "bytes": rec.predicted}
            for rec in loaded
            if rec.phase is Phase.LOADING
        ],
        "loads_paused": loads_paused,
        "pools": [pool_to_dict(p) for p in sample.pools],
    }
