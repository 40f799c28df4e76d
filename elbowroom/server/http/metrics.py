"""Prometheus metrics: ``GET /metrics``, request-side instruments, and a scrape-time collector.

Two kinds of numbers, kept apart on purpose:

- State read at scrape time (``StateCollector``): memory gauges, pressure level, per-runner
  bytes by kind, the scheduler's and the guard's counters, KV cache hits. Nothing has to
  remember to update them; a scrape reads what is true now.
- Events only the server sees (``METRICS``, on its own ``CollectorRegistry`` so that the
  process-global default registry and other libraries stay out of it): requests by
  endpoint/model/status, latency and time-to-first-token histograms, 503/507 refusals by
  error type, tokens generated. ``MetricsMiddleware`` feeds most of them; routes call
  ``record_model`` when they know the request's model (its label) and ``record_tokens``
  when a generation finishes.

docs/pressure.md lists every metric.
"""

from __future__ import annotations

import asyncio
import json
import logging
import time
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from typing import Any

from fastapi import APIRouter, Request
from fastapi.responses import Response
from prometheus_client import CollectorRegistry, Counter, Histogram, generate_latest
from prometheus_client.exposition import CONTENT_TYPE_LATEST
from prometheus_client.metrics_core import (
    CounterMetricFamily,
    GaugeMetricFamily,
    Metric,
    SummaryMetricFamily,
)
from prometheus_client.registry import Collector
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from elbowroom.models.spec import ModelSpec
from elbowroom.server.deps import Services

log = logging.getLogger("elbowroom.server")

# Paths whose requests are measured, by their endpoint label.
ENDPOINTS = {
    "/v1/chat/completions": "chat",
    "/v1/completions": "completions",
    "/v1/embeddings": "embeddings",
    "/v1/audio/transcriptions": "transcriptions",
    "/v1/audio/translations": "translations",
    "/v1/audio/speech": "speech",
    "/v1/responses": "responses",
    # Ollama's API (ollama_routes)
    "/api/chat": "ollama_chat",
    "/api/generate": "ollama_generate",
    "/api/embed": "ollama_embed",
    "/api/embeddings": "ollama_embeddings",
}
_LATENCY_BUCKETS = (0.05, 0.1, 0.25, 0.5, 1, 2, 5, 10, 30, 60, 120, 300)
_TTFT_BUCKETS = (0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2, 5, 10, 30)
_STREAM_TYPES = (b"text/event-stream", b"application/x-ndjson")  # OpenAI's SSE, Ollama's NDJSON


class Metrics:
    """The server-side instruments, on a registry of their own."""

    def __init__(self) -> None:
        self.registry = CollectorRegistry(auto_describe=True)
        r = self.registry
        self.requests = Counter(
            "elbowroom_requests",
            "API requests answered, by endpoint, model and HTTP status",
            ["endpoint", "model", "status"],
            registry=r,
        )
        self.latency = Histogram(
            "elbowroom_request_duration_seconds",
            "Seconds from request to the last byte of the response",
            ["model", "endpoint"],
            buckets=_LATENCY_BUCKETS,
            registry=r,
        )
        self.ttft = Histogram(
            "elbowroom_time_to_first_token_seconds",
            "Seconds from request to the first streamed byte (streaming responses only)",
            ["model", "endpoint"],
            buckets=_TTFT_BUCKETS,
            registry=r,
        )
        self.refused = Counter(
            "elbowroom_refused_requests",
            "Requests refused with 503 (retry later) or 507 (cannot fit), by error type",
            ["status", "type"],
            registry=r,
        )
        self.tokens = Counter(
            "elbowroom_tokens_generated",
            "Completion tokens generated",
            ["model"],
            registry=r,
        )


METRICS = Metrics()


def record_tokens(model: str, usage: Mapping[str, Any] | None) -> None:
    """Count a finished generation's completion tokens (routes call this)."""
    if not usage:
        return
    n = usage.get("completion_tokens")
    if isinstance(n, int) and n > 0:
        METRICS.tokens.labels(model=model).inc(n)


# --- the scrape-time state ------------------------------------------------------------


@dataclass(slots=True)
class ScrapeState:
    """Everything the collector reads, gathered (with awaits) before rendering."""

    report: dict[str, Any] = field(default_factory=dict)  # Scheduler.memory_report()
    runners: list[dict[str, Any]] = field(default_factory=list)  # Scheduler.ps()
    counters: dict[str, int] = field(default_factory=dict)  # Scheduler.counters
    level: int | None = None  # the level the guard (or monitor) last saw
    guard: dict[str, Any] | None = None  # PressureGuard.state()
    kv: dict[str, dict[str, Any]] = field(default_factory=dict)  # model -> engine kv stats
    mlx: dict[str, dict[str, Any]] = field(default_factory=dict)  # model -> MLX memory stats


_LEVELS = {"normal": 0, "soft": 1, "hard": 2}


class StateCollector(Collector):
    def __init__(self, state: ScrapeState) -> None:
        self._s = state

    def collect(self) -> Iterable[Metric]:
        yield from self._memory()
        yield from self._runners()
        yield from self._scheduler()
        yield from self._guard()
        if self._s.kv:
            yield from self._kv()
        if self._s.mlx:
            yield from self._mlx()

    def _mlx(self) -> Iterable[Metric]:
        mem = GaugeMetricFamily(
            "elbowroom_mlx_memory_bytes",
            "MLX's own accounting in an MLX model's runner: active (arrays in use), cache "
            "(freed buffers kept for reuse), peak (the most active since load), limit "
            "(mx.set_memory_limit: the runner's grant)",
            labels=["model", "kind"],
        )
        for model, stats in sorted(self._s.mlx.items()):
            for kind, key in (
                ("active", "active"),
                ("cache", "cache"),
                ("peak", "peak"),
                ("limit", "memory_limit"),
            ):
                if isinstance(stats.get(key), int):
                    mem.add_metric([model, kind], stats[key])
        yield mem

    def _kv(self) -> Iterable[Metric]:
        hits = CounterMetricFamily(
            "elbowroom_kv_cache_hits",
            "KV prefix cache hits, by model and tier (ram, disk)",
            labels=["model", "tier"],
        )
        misses = CounterMetricFamily(
            "elbowroom_kv_cache_misses", "KV prefix cache lookups with no hit", labels=["model"]
        )
        size = GaugeMetricFamily(
            "elbowroom_kv_cache_bytes",
            "Bytes the KV prefix cache holds, by model and tier (an MLX runner's RAM tier shrinks "
            "under pressure; a llama.cpp runner's RAM tier is the engine's own prompt cache, a "
            "grant fixed at load)",
            labels=["model", "tier"],
        )
        for model, stats in sorted(self._s.kv.items()):
            for tier, n in sorted(kv_hits(stats).items()):
                hits.add_metric([model, tier], n)
            if isinstance(stats.get("misses"), int):
                misses.add_metric([model], stats["misses"])
            for tier in ("ram", "disk"):
                value = stats.get(f"bytes_{tier}")
                if isinstance(value, int):
                    size.add_metric([model, tier], value)
        yield hits
        yield misses
        yield size

    def _memory(self) -> Iterable[Metric]:
        rep = self._s.report
        snap = rep.get("snapshot") or {}
        gauges = {
            "host_total": ("Host RAM", snap.get("host_total")),
            "host_available": ("Host RAM available", snap.get("host_available")),
            "total": ("Effective total (smallest of host, cgroup, override)", snap.get("total")),
            "available": ("Effective available", snap.get("available")),
            "cgroup_limit": ("Memory cgroup limit", snap.get("cgroup_limit")),
            "cgroup_usage": ("Memory cgroup usage", snap.get("cgroup_usage")),
            "limit": ("Memory limit elbowroom's models may hold", _get(rep, "limit", "value")),
            "soft_threshold": (
                "Usage at which pressure turns soft",
                _get(rep, "thresholds", "soft"),
            ),
            "hard_threshold": (
                "Usage at which pressure turns hard",
                _get(rep, "thresholds", "hard"),
            ),
            "own_usage": ("Bytes elbowroom's runners hold", rep.get("own_usage")),
            "committed": ("Bytes committed to loaded models and loads", rep.get("committed")),
        }
        for name, (doc, value) in gauges.items():
            if isinstance(value, int | float):
                yield GaugeMetricFamily(f"elbowroom_memory_{name}_bytes", doc + " (bytes)", value)
        psi = snap.get("psi")
        if isinstance(psi, dict) and isinstance(psi.get("some_avg10"), int | float):
            yield GaugeMetricFamily(
                "elbowroom_memory_psi_some_avg10",
                "PSI memory 'some' avg10 (percent of time stalled)",
                psi["some_avg10"],
            )
        level = self._s.level
        if level is None:
            level = _LEVELS.get(str(rep.get("pressure")))
        if level is not None:
            yield GaugeMetricFamily(
                "elbowroom_memory_pressure_level",
                "Memory pressure: 0 normal, 1 soft, 2 hard",
                level,
            )

    def _runners(self) -> Iterable[Metric]:
        mem = GaugeMetricFamily(
            "elbowroom_runner_memory_bytes",
            "Bytes a model's runner process tree holds, by kind (anonymous, file_backed, gpu)",
            labels=["model", "kind"],
        )
        busy = GaugeMetricFamily(
            "elbowroom_runner_busy", "Requests in flight on a model's runner", labels=["model"]
        )
        for row in self._s.runners:
            model = str(row.get("id"))
            for kind in ("anonymous", "file_backed", "gpu"):
                mem.add_metric([model, kind], float(row.get(kind) or 0))
            busy.add_metric([model], float(row.get("busy") or 0))
        yield mem
        yield busy
        yield GaugeMetricFamily("elbowroom_models_loaded", "Models loaded", len(self._s.runners))

    def _scheduler(self) -> Iterable[Metric]:
        c = self._s.counters
        if not c:
            return
        simple = {
            "loads": ("elbowroom_model_loads", "Models loaded"),
            "load_failures": ("elbowroom_model_load_failures", "Model loads that failed"),
            "unloads": ("elbowroom_model_unloads", "Models unloaded, for any reason"),
            "crashes": ("elbowroom_runner_crashes", "Runner processes that died on their own"),
            "restarts": ("elbowroom_runner_restarts", "Loads that followed a crash"),
            "oom_kills": (
                "elbowroom_runner_oom_kills",
                "Runner processes the kernel's OOM killer took (SIGKILL + the cgroup counter)",
            ),
        }
        for key, (name, doc) in simple.items():
            if key in c:
                yield CounterMetricFamily(name, doc, c[key])
        evictions = CounterMetricFamily(
            "elbowroom_evictions",
            "Models unloaded by the scheduler, by reason (load, keep_alive, pressure)",
            labels=["reason"],
        )
        for key, n in sorted(c.items()):
            if key.startswith("evictions_"):
                evictions.add_metric([key.removeprefix("evictions_")], n)
        yield evictions

    def _guard(self) -> Iterable[Metric]:
        g = self._s.guard
        if g is None:
            return
        for name, doc in (
            ("enabled", "1 when the pressure guard acts on pressure"),
            ("admission_open", "0 while the guard refuses new requests (hard pressure)"),
            ("loads_paused", "1 while the guard pauses model loads (soft or hard pressure)"),
        ):
            yield GaugeMetricFamily(f"elbowroom_guard_{name}", doc, 1.0 if g.get(name) else 0.0)
        actions = CounterMetricFamily(
            "elbowroom_guard_actions",
            "Actions the pressure guard applied, by action and reason",
            labels=["action", "reason"],
        )
        aborts = CounterMetricFamily(
            "elbowroom_generation_aborts",
            "Generations aborted under hard pressure, by reason (newest, largest)",
            labels=["reason"],
        )
        for row in g.get("counters", []):
            actions.add_metric([row["action"], row["reason"]], row["count"])
            if row["action"] == "abort":
                aborts.add_metric([row["reason"]], row["count"])
        yield actions
        yield aborts
        reaction = g.get("reaction")
        if reaction:
            yield SummaryMetricFamily(
                "elbowroom_guard_reaction_seconds",
                "The kernel's memory notification to the guard's first relief action",
                count_value=reaction["count"],
                sum_value=reaction["sum_s"],
            )


def _get(d: Mapping[str, Any], *keys: str) -> Any:
    for k in keys:
        if not isinstance(d, Mapping):
            return None
        d = d.get(k)  # type: ignore[assignment]
    return d


def kv_stats(stats: Mapping[str, Any]) -> dict[str, Any]:
    """The KV cache part of an engine's stats (``{"kv_cache": {...}}``), or {}."""
    kv = stats.get("kv_cache")
    return dict(kv) if isinstance(kv, Mapping) else {}


def kv_hits(kv: Mapping[str, Any]) -> dict[str, int]:
    """Hits per tier from the KV cache stats: ``{"hits": {"ram": n, "disk": n}}``."""
    hits = kv.get("hits")
    if not isinstance(hits, Mapping):
        return {}
    return {str(t): int(n) for t, n in hits.items() if isinstance(n, int)}


async def gather(services: Services | None) -> ScrapeState:
    """Read the services' state for one scrape (runner stats concurrently, bounded)."""
    state = ScrapeState()
    if services is None:
        return state
    scheduler = services.scheduler
    state.report = dict(scheduler.memory_report())
    state.runners = list(scheduler.ps())
    state.counters = dict(getattr(scheduler, "counters", {}))
    guard = getattr(services, "guard", None)
    sample = guard.latest if guard is not None else None
    if sample is None and services.monitor is not None:
        sample = services.monitor.latest
    if sample is not None:
        state.level = int(sample.level)
    if guard is not None:
        state.guard = guard.state()
    llms = [row["id"] for row in state.runners if row.get("kind") == "llm"]
    runner_of = getattr(scheduler, "runner", None)
    if runner_of is not None and llms:
        runners = [(m, runner_of(m)) for m in llms]
        results = await asyncio.gather(
            *(r.stats() for _, r in runners if r is not None), return_exceptions=True
        )
        named = [m for m, r in runners if r is not None]
        for model, result in zip(named, results, strict=True):
            if isinstance(result, Mapping):
                kv = kv_stats(result)
                if kv:
                    state.kv[model] = kv
                if isinstance(result.get("mlx"), Mapping):
                    state.mlx[model] = dict(result["mlx"])
    return state


def render(state: ScrapeState) -> bytes:
    registry = CollectorRegistry(auto_describe=False)
    registry.register(StateCollector(state))
    return generate_latest(METRICS.registry) + generate_latest(registry)


router = APIRouter()


@router.get("/metrics", include_in_schema=False)
async def metrics(request: Request) -> Response:
    services = getattr(request.app.state, "services", None)
    return Response(render(await gather(services)), media_type=CONTENT_TYPE_LATEST)


@router.get("/api/guard")
async def guard_state(request: Request, events: int = 100) -> dict[str, Any]:
    """The pressure guard's state and its last ``events`` actions (oldest first)."""
    services = getattr(request.app.state, "services", None)
    guard = getattr(services, "guard", None)
    if guard is None:
        return {"enabled": False, "present": False, "events": []}
    recent = guard.events()[-max(0, events) :] if events > 0 else []
    return {**guard.state(), "present": True, "events": [e.to_dict() for e in recent]}


# --- the request side -------------------------------------------------------------------


def record_model(request: Request, spec: ModelSpec) -> None:
    """The request's ``model`` label: the catalog id of the model its route resolved and
    accepted. A route calls it once it knows the model; the middleware reads it."""
    request.state.metrics_model = spec.id


class MetricsMiddleware:
    """Times the API endpoints in ``ENDPOINTS`` and counts their statuses and refusals.

    The model label is what the route recorded (``record_model``: a catalog id, an OpenAI
    alias such as ``whisper-1`` recorded as the model it maps to), on the request's ASGI
    ``state``; "-" for a request no route accepted a model for (an unknown path or model,
    a body too big, bad JSON, a model of the wrong kind). The body is never read here, and
    labels never carry client strings: 10,000 random names make one series, not 10,000.
    """

    def __init__(self, app: ASGIApp) -> None:
        self.app = app

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        endpoint = ENDPOINTS.get(scope.get("path", "")) if scope["type"] == "http" else None
        if endpoint is None or scope.get("method") != "POST":
            await self.app(scope, receive, send)
            return
        began = time.perf_counter()
        # The state dict the route's Request.state writes to; made here if the server gave
        # none, so scopes copied further in share it.
        state: dict[str, Any] = scope.setdefault("state", {})
        status = 500
        streaming = False
        first: float | None = None
        error_body = bytearray()

        async def tee_send(msg: Message) -> None:
            nonlocal status, streaming, first
            if msg["type"] == "http.response.start":
                status = int(msg["status"])
                for name, value in msg.get("headers", ()):
                    if name.lower() == b"content-type" and value.startswith(_STREAM_TYPES):
                        streaming = True
            elif msg["type"] == "http.response.body":
                body = msg.get("body", b"")
                if body and first is None:
                    first = time.perf_counter()
                if status >= 400 and len(error_body) < 4096:
                    error_body.extend(body[:4096])
            await send(msg)

        try:
            await self.app(scope, receive, tee_send)
        finally:
            try:
                model = str(state.get("metrics_model", "-"))
                self._observe(endpoint, model, status, streaming, began, first, error_body)
            except Exception:  # metrics must never break a response
                log.exception("recording request metrics failed")

    @staticmethod
    def _observe(
        endpoint: str,
        model: str,
        status: int,
        streaming: bool,
        began: float,
        first: float | None,
        error_body: bytearray,
    ) -> None:
        m = METRICS
        m.requests.labels(endpoint=endpoint, model=model, status=str(status)).inc()
        if status in (503, 507):
            m.refused.labels(status=str(status), type=_error_type(bytes(error_body))).inc()
        if status < 400:
            m.latency.labels(model=model, endpoint=endpoint).observe(time.perf_counter() - began)
            if streaming and first is not None:
                m.ttft.labels(model=model, endpoint=endpoint).observe(first - began)


def _error_type(body: bytes) -> str:
    try:
        err = json.loads(body).get("error", {})
        return str(err.get("type") or "unknown")
    except (ValueError, AttributeError):
        return "unknown"
