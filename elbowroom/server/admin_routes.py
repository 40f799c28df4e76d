"""Admin API under /api: what is loaded, load/unload by hand, the memory report.

``/api/ps`` is Ollama's path: its handler (ollama_routes) answers in Ollama's shape with
these rows riding along. elbowroom's own view, unchanged, is ``/api/elbowroom/ps``.
"""

from __future__ import annotations

import asyncio
from typing import Any

from fastapi import APIRouter, Request
from pydantic import BaseModel, ConfigDict

from elbowroom.server.deps import Services, get_services

router = APIRouter(prefix="/api")


class LoadRequest(BaseModel):
    model_config = ConfigDict(strict=True, extra="forbid")
    pin: bool | None = None  # True pins, False unpins, absent keeps the pin as it is


@router.get("/elbowroom/models")
async def models(request: Request) -> dict[str, Any]:
    """Every model the catalog serves, and the files it skipped with the reason."""
    from elbowroom.server.openai.routes import model_card

    catalog = get_services(request).catalog
    return {
        "models": [model_card(spec) for spec in catalog.list()],
        "problems": [
            {"path": str(p.path), "reason": p.reason} for p in getattr(catalog, "problems", ())
        ],
    }


@router.get("/elbowroom/ps")
async def ps(request: Request) -> dict[str, Any]:
    services = get_services(request)
    rows = await ps_rows(services)
    report = services.scheduler.memory_report()
    out = {"models": rows, "memory": summary(report)}
    if "nodes" in report:  # over a cluster (docs/cluster.md): each node's numbers
        out["nodes"] = [node_summary(n) for n in report["nodes"]]
    return out


def node_summary(node: dict[str, Any]) -> dict[str, Any]:
    return {
        "name": node.get("name"),
        "alive": node.get("alive"),
        "pressure": node.get("pressure"),
        "available": node.get("available"),
        "ceiling": node.get("ceiling"),
        "committed": node.get("committed"),
        "models": node.get("models", []),
        "gone_at": node.get("gone_at"),
        "gone_cause": node.get("gone_cause"),
    }


async def ps_rows(services: Services) -> list[dict[str, Any]]:
    """The scheduler's rows, each with its runner's ``engine_stats``."""
    scheduler = services.scheduler
    rows: list[dict[str, Any]] = scheduler.ps()
    # Engine stats (e.g. the KV prefix cache's entries, bytes and hits per tier) come from
    # each ready runner; asked concurrently so one slow runner delays the answer only by
    # its own stats timeout.
    runners = [scheduler.runner(row["id"]) for row in rows]
    stats = await asyncio.gather(*(r.stats() if r is not None else _no_stats() for r in runners))
    for row, engine_stats in zip(rows, stats, strict=True):
        row["engine_stats"] = engine_stats
        # The scheduler stops counting a request when its client leaves; the runner counts
        # it until the engine lets go (a grammar still being set up on the engine's loop).
        row["busy"] = max(int(row.get("busy") or 0), int(engine_stats.get("slots_busy") or 0))
    return rows


async def _no_stats() -> dict[str, Any]:
    return {}


@router.post("/models/{model_id:path}/load")
async def load(request: Request, model_id: str, body: LoadRequest | None = None) -> dict[str, Any]:
    services = get_services(request)
    spec = services.catalog.get(model_id)  # 404 before any work
    row = await services.scheduler.load(spec.id, pin=body.pin if body is not None else None)
    return {"model": spec.id, "status": "loaded", "pinned": bool(row.get("pinned")), "runner": row}


@router.post("/models/{model_id:path}/unload")
async def unload(request: Request, model_id: str) -> dict[str, Any]:
    services = get_services(request)
    spec = services.catalog.get(model_id)
    result = dict(await services.scheduler.unload(spec.id))
    result.pop("id", None)
    return {"model": spec.id, **result}


@router.get("/memory")
async def memory(request: Request, history: bool = False) -> dict[str, Any]:
    services = get_services(request)
    report: dict[str, Any] = dict(services.scheduler.memory_report())
    if history:
        monitor = services.monitor
        report["history"] = [s.to_dict() for s in monitor.history()] if monitor is not None else []
    return report


def summary(report: dict[str, Any]) -> dict[str, Any]:
    """The few numbers `elbowroom ps` shows under its table. ``scope`` says whose they are:
    ``machine`` (this server's), or ``cluster``: sums over the live nodes (``nodes`` of
    them; each node's own numbers are in ``nodes`` of the ps answer), pressure the worst
    node's."""
    if report.get("cluster"):
        totals = report.get("totals") or {}
        return {
            "scope": "cluster",
            "nodes": totals.get("nodes"),
            "limit": totals.get("limit"),
            "ceiling": totals.get("ceiling"),
            "committed": totals.get("committed"),
            "available": totals.get("available"),
            "pressure": report.get("pressure"),
            "worst_node": report.get("worst_node"),
        }
    limit = report.get("limit")
    return {
        "scope": "machine",
        "limit": limit.get("value") if isinstance(limit, dict) else limit,
        "ceiling": report.get("ceiling"),
        "committed": report.get("committed"),
        "available": report.get("available"),
        "pressure": report.get("pressure"),
    }
