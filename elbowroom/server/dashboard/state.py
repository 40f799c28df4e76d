"""PURE: the one JSON document the dashboard and `elbowroom ps --watch` draw.

Built from what the server already knows (the memory report, the scheduler's rows with
their runners' stats, the monitor's samples, the event logs); no I/O here, so the shape is
tested without a server.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping, Sequence
from datetime import datetime
from typing import Any

from elbowroom.memory.budget import limit_to_dict

WINDOW_SECONDS = 600.0  # the timeline shows the last ten minutes

TIMELINE_FIELDS = ("wall", "usage", "limit", "soft", "hard", "level", "available", "total")
_LEVELS = {"normal": 0, "soft": 1, "hard": 2}

# Guard actions worth a mark on the timeline (its unloads are the scheduler's evictions).
GUARD_KINDS = {
    "abort": "abort",
    "pause_loads": "pause_loads",
    "resume_loads": "resume_loads",
    "close_admission": "refusing",
    "open_admission": "admitting",
}


def _mem_of(row: Mapping[str, Any]) -> dict[str, Any]:
    return {
        "id": row.get("id"),
        "anonymous": int(row.get("anonymous") or 0),
        "file_backed": int(row.get("file_backed") or 0),
        "gpu": int(row.get("gpu") or 0),
        "bytes": int(row.get("bytes") or 0),
    }


def pools(
    report: Mapping[str, Any], rows: Sequence[Mapping[str, Any]], latest: Any = None
) -> list[dict[str, Any]]:
    """Every memory pool: the budgeted one (host RAM, or the cgroup / override inside it),
    the host when a smaller limit applies, and each GPU. With the monitor's ``latest``
    sample, the limit, its thresholds and our usage are that sample's: the numbers the
    pressure level and the timeline come from."""
    snap: Mapping[str, Any] = report.get("snapshot") or {}
    limit: Mapping[str, Any] = report.get("limit") or {}
    own_usage = report.get("own_usage")
    if latest is not None:
        limit = limit_to_dict(latest.limit)
        own_usage = latest.own_usage
    total = int(snap.get("total") or 0)
    available = int(snap.get("available") or 0)
    candidates = limit.get("candidates", ())
    winner: Mapping[str, Any] = next((c for c in candidates if c.get("winner")), {})
    if snap.get("override"):
        name = "Memory (ELBOWROOM_OVERRIDE_MEMORY)"
    elif snap.get("cgroup_limit"):
        name = f"Memory (cgroup v{snap.get('cgroup_version')} limit)"
    else:
        name = "Memory (host RAM)"
    out: list[dict[str, Any]] = [
        {
            "id": "memory",
            "kind": "budget",
            "name": name,
            "total": total,
            "available": available,
            "used": max(0, total - available),
            "limit": limit.get("value"),
            "limit_winner": limit.get("winner"),
            "limit_why": winner.get("why"),
            "soft": limit.get("soft"),
            "hard": limit.get("hard"),
            "ceiling": report.get("ceiling"),  # what loads are judged against
            "committed": report.get("committed"),
            "own_usage": own_usage,
            "models": [_mem_of(r) for r in rows],
        }
    ]
    host_total = int(snap.get("host_total") or 0)
    if host_total and host_total != total:
        host_available = int(snap.get("host_available") or 0)
        out.append(
            {
                "id": "host",
                "kind": "host",
                "name": "Host RAM",
                "total": host_total,
                "available": host_available,
                "used": max(0, host_total - host_available),
            }
        )
    if snap.get("cgroup_limit") and snap.get("override"):
        out.append(
            {
                "id": "cgroup",
                "kind": "cgroup",
                "name": f"cgroup v{snap.get('cgroup_version')}",
                "total": int(snap["cgroup_limit"]),
                "used": int(snap.get("cgroup_usage") or 0),
                "available": max(0, int(snap["cgroup_limit"]) - int(snap.get("cgroup_usage") or 0)),
            }
        )
    gpus = list(snap.get("gpus") or ())
    for gpu in gpus:
        on_gpu = [_mem_of(r) for r in rows if int(r.get("gpu") or 0) > 0]
        out.append(
            {
                "id": f"gpu{gpu.get('index')}",
                "kind": "gpu",
                "name": f"GPU {gpu.get('index')}: {gpu.get('name')}",
                "total": int(gpu.get("total") or 0),
                "available": int(gpu.get("free") or 0),
                "used": int(gpu.get("used") or 0),
                # Per-GPU bytes of a process are summed over GPUs: exact with one GPU.
                "models": on_gpu if len(gpus) == 1 else [],
            }
        )
    return out


def kv_summary(stats: Mapping[str, Any]) -> dict[str, Any] | None:
    """KV cache tiers and the hit rate, from a runner's engine stats (None: no cache). A
    llama.cpp runner's RAM tier is the engine's own prompt cache (engines/llama_log.py),
    whose lookups that found nothing (``misses_ram``) count as misses too: the rate is over
    lookups in either tier."""
    kv = stats.get("kv_cache")
    if not isinstance(kv, Mapping):
        return None
    tiers = []
    hits = 0
    for tier in ("ram", "disk"):
        n = int(kv.get(f"hits_{tier}") or 0)
        hits += n
        tiers.append(
            {
                "tier": tier,
                "entries": int(kv.get(f"entries_{tier}") or 0),
                "bytes": int(kv.get(f"bytes_{tier}") or 0),
                "hits": n,
                "budget": kv.get("ram_budget" if tier == "ram" else "disk_max"),
            }
        )
    misses = int(kv.get("misses") or 0) + int(kv.get("misses_ram") or 0)
    lookups = hits + misses
    return {
        "tiers": tiers,
        "hits": hits,
        "misses": misses,
        "hit_rate": (hits / lookups) if lookups else None,
    }


def model_view(row: Mapping[str, Any], now_wall: float) -> dict[str, Any]:
    stats: Mapping[str, Any] = row.get("engine_stats") or {}
    expires = row.get("expires_at")
    expires_in = None
    if isinstance(expires, str):
        expires_in = max(0.0, datetime.fromisoformat(expires).timestamp() - now_wall)
    slots = stats.get("slots") or row.get("slots") or 1
    busy = stats.get("slots_busy")
    return {
        "id": row.get("id"),
        "kind": row.get("kind"),
        "engine": row.get("engine"),
        "state": row.get("state"),
        "pid": row.get("pid"),
        "pinned": bool(row.get("pinned")),
        "slots": int(slots),
        "slots_busy": int(busy if busy is not None else row.get("busy") or 0),
        "queue": int(row.get("waiting") or 0),
        "n_ctx": row.get("n_ctx"),
        "bytes": int(row.get("bytes") or 0),
        "anonymous": int(row.get("anonymous") or 0),
        "file_backed": int(row.get("file_backed") or 0),
        "gpu": int(row.get("gpu") or 0),
        "expires_at": expires,
        "expires_in": expires_in,
        "kv": kv_summary(stats),
        "restarts": int(row.get("restarts") or 0),
        "node": row.get("node"),  # over a cluster: where it runs (docs/cluster.md)
    }


def node_view(node: Mapping[str, Any]) -> dict[str, Any]:
    """One cluster node's numbers (``/api/memory``'s ``nodes``), for the nodes table."""
    return {
        "name": node.get("name"),
        "alive": bool(node.get("alive")),
        "pressure": node.get("pressure"),
        "committed": int(node.get("committed") or 0),
        "available": int(node.get("available") or 0),
        "ceiling": int(node.get("ceiling") or 0),
        "models": list(node.get("models") or []),
        "gone_at": node.get("gone_at"),  # a node that left: when, and why (shown a while)
        "gone_cause": node.get("gone_cause"),
    }


def cluster_view(report: Mapping[str, Any]) -> dict[str, Any] | None:
    """Over a cluster: the sums over the live nodes (what the nodes table's totals line
    shows) and the node whose numbers the pools and the timeline are (the most pressed)."""
    if not report.get("cluster"):
        return None
    totals: Mapping[str, Any] = report.get("totals") or {}
    return {
        "nodes": int(totals.get("nodes") or 0),
        "worst_node": report.get("worst_node"),
        "committed": int(totals.get("committed") or 0),
        "available": int(totals.get("available") or 0),
        "ceiling": int(totals.get("ceiling") or 0),
        "limit": int(totals.get("limit") or 0),
    }


def labelled_pools(
    report: Mapping[str, Any], rows: Sequence[Mapping[str, Any]], latest: Any = None
) -> list[dict[str, Any]]:
    """``pools``; over a cluster they are one node's (the most pressed), and say so."""
    out = pools(report, rows, latest)
    worst = report.get("worst_node") if report.get("cluster") else None
    if worst:
        for pool in out:
            pool["name"] = f"{pool['name']}, node {worst} (the most pressed node)"
            pool["node"] = worst
    return out


def timeline(samples: Iterable[Any], since: float, now_wall: float) -> list[list[float]]:
    """Monitor samples newer than ``since`` within the window, as compact rows
    (TIMELINE_FIELDS)."""
    cutoff = max(since, now_wall - WINDOW_SECONDS)
    out = []
    for s in samples:
        if s.wall <= cutoff:
            continue
        out.append(
            [
                round(s.wall, 3),
                s.own_usage,
                s.limit.value,
                s.limit.soft,
                s.limit.hard,
                int(s.level),
                s.snapshot.available,
                s.snapshot.total,
            ]
        )
    return out


def events(
    scheduler_events: Iterable[Mapping[str, Any]],
    guard_events: Iterable[Mapping[str, Any]],
    now_wall: float,
) -> list[dict[str, Any]]:
    """The scheduler's and server's events and the guard's actions of the window, by time."""
    cutoff = now_wall - WINDOW_SECONDS
    out = [dict(e) for e in scheduler_events if float(e.get("wall", 0)) >= cutoff]
    for g in guard_events:
        kind = GUARD_KINDS.get(str(g.get("kind")))
        if kind is None or float(g.get("wall", 0)) < cutoff:
            continue
        out.append(
            {
                "wall": g.get("wall"),
                "kind": kind,
                "model": g.get("model"),
                "message": g.get("message"),
                "detail": {"level": g.get("level")},
            }
        )
    out.sort(key=lambda e: float(e.get("wall") or 0))
    return out


def build(
    *,
    report: Mapping[str, Any],
    rows: Sequence[Mapping[str, Any]],
    samples: Iterable[Any],
    scheduler_events: Iterable[Mapping[str, Any]],
    guard_events: Iterable[Mapping[str, Any]],
    guard_state: Mapping[str, Any] | None,
    catalog: Iterable[Mapping[str, Any]],
    counters: Mapping[str, int],
    now_wall: float,
    since: float = 0.0,
    latest: Any = None,
) -> dict[str, Any]:
    """``latest`` is the monitor's newest sample: its level is the one the guard acts on
    (it counts everything the server's process tree holds), so it is the one shown."""
    loaded = {r.get("id") for r in rows}
    if latest is not None:
        level, reasons = latest.level.label, list(latest.reasons)
    else:
        level, reasons = report.get("pressure"), list(report.get("pressure_reasons") or ())
    return {
        "now": now_wall,
        "window": WINDOW_SECONDS,
        "pressure": {
            "level": level,
            "reasons": reasons,
            "loads_paused": bool(report.get("loads_paused")),
            "admission_open": (guard_state or {}).get("admission_open", True),
            "guard_enabled": (guard_state or {}).get("enabled", False),
        },
        "pools": labelled_pools(report, rows, latest),
        "models": [model_view(r, now_wall) for r in rows],
        "nodes": [node_view(n) for n in report.get("nodes") or ()],
        "cluster": cluster_view(report),
        "catalog": [{**m, "loaded": m.get("id") in loaded} for m in catalog],
        "timeline_fields": list(TIMELINE_FIELDS),
        "timeline": timeline(samples, since, now_wall),
        "events": events(scheduler_events, guard_events, now_wall),
        "counters": dict(counters),
    }


def level_number(label: str | None) -> int:
    return _LEVELS.get(label or "normal", 0)
