"""GET /metrics of a real server: it parses as Prometheus text, the memory gauges describe the
real machine, and the request-side counters move as requests are served and refused."""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import httpx
import openai
import pytest
from prometheus_client.parser import text_string_to_metric_families
from serverproc import ServerFactory, ServerProcess, wait_for

from elbowroom.server.http.metrics import kv_hits, kv_stats

MODEL = "smollm2-135m"
HI = [{"role": "user", "content": "Say hello."}]


# --- pure helpers (no server) ---------------------------------------------------------


def test_kv_hits_reads_the_engine_stats_shape() -> None:
    kv = kv_stats({"kv_cache": {"hits": {"ram": 3, "disk": 1}, "misses": 2}})
    assert kv_hits(kv) == {"ram": 3, "disk": 1}
    assert kv_stats({}) == {} and kv_hits({"hits": None}) == {}


# --- a real server ----------------------------------------------------------------------


def scrape(server: ServerProcess) -> dict[str, Any]:
    """{family name: {sample name + sorted labels: value}}."""
    text = httpx.get(server.url + "/metrics", timeout=30).text
    out: dict[str, dict[tuple[Any, ...], float]] = {}
    for family in text_string_to_metric_families(text):
        samples = out.setdefault(family.name, {})
        for s in family.samples:
            samples[(s.name, *sorted(s.labels.items()))] = s.value
    return out


def value(metrics: dict[str, Any], family: str, sample: str, **labels: str) -> float:
    return float(metrics.get(family, {}).get((sample, *sorted(labels.items())), 0.0))


@pytest.fixture(scope="module")
def server(server_factory: ServerFactory) -> Iterator[ServerProcess]:
    # one slot, queue_size 0: a second request while one runs is refused at once (a 503)
    srv = server_factory(
        "--ctx",
        "512",
        "--preload",
        MODEL,
        env={"ELBOWROOM_QUEUE_SIZE": "0", "ELBOWROOM_SLOTS": "1"},
    )
    wait_for(lambda: any(m["id"] == MODEL for m in srv.ps()), timeout=60, what="the preload")
    yield srv


@pytest.mark.slow
def test_memory_gauges_describe_the_machine_and_the_runner(server: ServerProcess) -> None:
    m = scrape(server)
    mem = server.memory()
    host_total = value(m, "elbowroom_memory_host_total_bytes", "elbowroom_memory_host_total_bytes")
    assert host_total == mem["snapshot"]["host_total"] > 0
    limit = value(m, "elbowroom_memory_limit_bytes", "elbowroom_memory_limit_bytes")
    soft = value(
        m, "elbowroom_memory_soft_threshold_bytes", "elbowroom_memory_soft_threshold_bytes"
    )
    assert 0 < soft < limit <= host_total
    level = value(m, "elbowroom_memory_pressure_level", "elbowroom_memory_pressure_level")
    assert level in (0, 1, 2)
    anon = value(
        m,
        "elbowroom_runner_memory_bytes",
        "elbowroom_runner_memory_bytes",
        model=MODEL,
        kind="anonymous",
    )
    mapped = value(
        m,
        "elbowroom_runner_memory_bytes",
        "elbowroom_runner_memory_bytes",
        model=MODEL,
        kind="file_backed",
    )
    assert anon > 10 * 1024**2 and mapped > 10 * 1024**2  # llama.cpp KV + mmap'd weights
    assert value(m, "elbowroom_model_loads", "elbowroom_model_loads_total") >= 1
    assert value(m, "elbowroom_guard_enabled", "elbowroom_guard_enabled") == 1
    # the llama engine's KV prefix cache reports its tiers
    kv = m.get("elbowroom_kv_cache_hits", {})
    assert ("elbowroom_kv_cache_hits_total", ("model", MODEL), ("tier", "ram")) in kv
    assert value(m, "elbowroom_guard_admission_open", "elbowroom_guard_admission_open") == 1


@pytest.mark.slow
def test_request_counters_move_with_requests(server: ServerProcess) -> None:
    before = scrape(server)
    client = server.openai()
    out = client.chat.completions.create(model=MODEL, messages=HI, max_tokens=6, temperature=0)
    generated = out.usage.completion_tokens if out.usage else 0
    chunks = list(
        client.chat.completions.create(
            model=MODEL,
            messages=HI,
            max_tokens=6,
            temperature=0,
            stream=True,
            stream_options={"include_usage": True},
        )
    )
    usage = chunks[-1].usage
    generated += usage.completion_tokens if usage else 0
    with pytest.raises(openai.NotFoundError):
        client.chat.completions.create(model="no-such-model", messages=HI)
    after = scrape(server)

    def delta(family: str, sample: str, **labels: str) -> float:
        return value(after, family, sample, **labels) - value(before, family, sample, **labels)

    ok = {"endpoint": "chat", "model": MODEL, "status": "200"}
    assert delta("elbowroom_requests", "elbowroom_requests_total", **ok) == 2
    assert (
        delta(
            "elbowroom_requests",
            "elbowroom_requests_total",
            endpoint="chat",
            model="-",  # labels are catalog ids the route resolved: a 404 names none
            status="404",
        )
        == 1
    )
    lat = {"model": MODEL, "endpoint": "chat"}
    assert (
        delta(
            "elbowroom_request_duration_seconds", "elbowroom_request_duration_seconds_count", **lat
        )
        == 2
    )
    assert (
        delta(
            "elbowroom_time_to_first_token_seconds",
            "elbowroom_time_to_first_token_seconds_count",
            **lat,
        )
        == 1
    )
    assert generated > 0
    assert (
        delta("elbowroom_tokens_generated", "elbowroom_tokens_generated_total", model=MODEL)
        == generated
    )


@pytest.mark.slow
def test_a_503_is_counted_by_error_type(server: ServerProcess) -> None:
    before = scrape(server)
    client = server.openai()
    stream = client.completions.create(
        model=MODEL, prompt="Count: 1, 2, 3,", max_tokens=300, temperature=0, stream=True
    )
    first = next(iter(stream))  # the runner is now busy with this request
    assert first.choices
    refused = httpx.post(
        server.url + "/v1/chat/completions", json={"model": MODEL, "messages": HI}, timeout=30
    )
    stream.close()
    assert refused.status_code == 503, refused.text
    kind = refused.json()["error"]["type"]
    after = scrape(server)
    labels = {"status": "503", "type": kind}
    before_n = value(
        before, "elbowroom_refused_requests", "elbowroom_refused_requests_total", **labels
    )
    after_n = value(
        after, "elbowroom_refused_requests", "elbowroom_refused_requests_total", **labels
    )
    assert after_n - before_n == 1
