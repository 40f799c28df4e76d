"""The dashboard's document (pure), the event log, the 503/507 recorder, the static page,
and `elbowroom ps --watch`'s rendering."""

from __future__ import annotations

import io
from typing import Any

import pytest
from rich.console import Console
from server_fakes import Harness

from elbowroom.cli.watch import render
from elbowroom.errors import InsufficientMemory
from elbowroom.memory.budget import Limit
from elbowroom.memory.monitor import Sample
from elbowroom.memory.types import Pressure, Snapshot
from elbowroom.scheduler.events import EventLog
from elbowroom.server.dashboard import state as dashboard_state

GiB = 1 << 30
MiB = 1 << 20
NOW = 1_800_000_000.0


def sample(wall: float, usage: int, level: Pressure) -> Sample:
    snap = Snapshot("linux", 8 * GiB, 3 * GiB, 5 * GiB, 16 * GiB, 10 * GiB, override=8 * GiB)
    limit = Limit(4 * GiB, "reserve", (), int(3.4 * GiB), int(3.8 * GiB))
    return Sample(wall, wall, snap, usage, limit, level)


REPORT: dict[str, Any] = {
    "snapshot": {
        "total": 8 * GiB,
        "available": 3 * GiB,
        "host_total": 16 * GiB,
        "host_available": 10 * GiB,
        "override": 8 * GiB,
        "cgroup_limit": None,
        "gpus": [
            {"index": 0, "name": "H100", "total": 80 * GiB, "free": 70 * GiB, "used": 10 * GiB}
        ],
    },
    "limit": {
        "value": 4 * GiB,
        "winner": "reserve",
        "soft": 3 * GiB,
        "hard": 4 * GiB - 1,
        "candidates": [{"name": "reserve", "winner": True, "why": "total − reserve"}],
    },
    "ceiling": 3 * GiB,
    "committed": 300 * MiB,
    "own_usage": 300 * MiB,
    "pressure": "soft",
    "pressure_reasons": ["ours ≥ soft"],
    "loads_paused": True,
}
ROW: dict[str, Any] = {
    "id": "smollm2-135m",
    "kind": "llm",
    "state": "ready",
    "pinned": False,
    "busy": 1,
    "waiting": 2,
    "anonymous": 200 * MiB,
    "file_backed": 100 * MiB,
    "gpu": 5 * MiB,
    "bytes": 300 * MiB,
    "slots": 4,
    "n_ctx": 1024,
    "expires_at": "2027-01-15T08:00:30+00:00",
    "engine_stats": {
        "slots": 4,
        "slots_busy": 1,
        "kv_cache": {
            "entries_ram": 2,
            "bytes_ram": 5 * MiB,
            "hits_ram": 3,
            "entries_disk": 1,
            "bytes_disk": 2 * MiB,
            "hits_disk": 1,
            "misses": 4,
            "ram_budget": 64 * MiB,
        },
    },
}


def build(**kw: Any) -> dict[str, Any]:
    args: dict[str, Any] = dict(
        report=REPORT,
        rows=[ROW],
        samples=[],
        scheduler_events=[],
        guard_events=[],
        guard_state={"enabled": True, "admission_open": True},
        catalog=[
            {"id": "smollm2-135m", "kind": "llm"},
            {"id": "minilm-l6-v2", "kind": "embedding"},
        ],
        counters={"loads": 1},
        now_wall=NOW,
    )
    args.update(kw)
    return dashboard_state.build(**args)


def test_pools_show_limit_thresholds_and_what_each_model_holds() -> None:
    doc = build()
    budget, host, gpu = doc["pools"]
    assert budget["name"] == "Memory (ELBOWROOM_OVERRIDE_MEMORY)"
    assert (budget["limit"], budget["soft"], budget["hard"]) == (4 * GiB, 3 * GiB, 4 * GiB - 1)
    assert budget["limit_why"] == "total − reserve"
    assert budget["models"] == [
        {
            "id": "smollm2-135m",
            "anonymous": 200 * MiB,
            "file_backed": 100 * MiB,
            "gpu": 5 * MiB,
            "bytes": 300 * MiB,
        }
    ]
    assert host["total"] == 16 * GiB and host["used"] == 6 * GiB
    assert gpu["name"] == "GPU 0: H100" and gpu["models"][0]["gpu"] == 5 * MiB
    assert doc["pressure"]["level"] == "soft" and doc["pressure"]["loads_paused"] is True
    # The monitor's newest sample is the level the guard acts on: it wins over the report's.
    hard = build(latest=sample(NOW, 3, Pressure.HARD))
    assert hard["pressure"]["level"] == "hard"
    assert hard["pools"][0]["limit"] == 4 * GiB and hard["pools"][0]["own_usage"] == 3
    assert hard["pools"][0]["ceiling"] == 3 * GiB  # loads are still judged by the scheduler


def test_models_have_slots_queue_countdown_and_kv_hit_rate() -> None:
    now = 1_800_000_000.0
    expires = ROW["expires_at"]
    m = build(now_wall=now)["models"][0]
    assert (m["slots"], m["slots_busy"], m["queue"]) == (4, 1, 2)
    from datetime import datetime

    assert m["expires_in"] == pytest.approx(datetime.fromisoformat(expires).timestamp() - now)
    assert m["kv"]["hits"] == 4 and m["kv"]["misses"] == 4 and m["kv"]["hit_rate"] == 0.5
    assert [t["tier"] for t in m["kv"]["tiers"]] == ["ram", "disk"]
    assert build()["catalog"] == [
        {"id": "smollm2-135m", "kind": "llm", "loaded": True},
        {"id": "minilm-l6-v2", "kind": "embedding", "loaded": False},
    ]


def test_the_engines_prompt_cache_lookups_that_found_nothing_are_misses() -> None:
    # A llama.cpp runner's RAM tier is the engine's own prompt cache (engines/llama_log.py):
    # its lookups that found no better state count in the hit rate beside the disk tier's.
    kv = {**ROW["engine_stats"]["kv_cache"], "misses_ram": 4, "lookups_ram": 7}
    summary = dashboard_state.kv_summary({"kv_cache": kv})
    assert summary is not None
    assert summary["hits"] == 4 and summary["misses"] == 8 and summary["hit_rate"] == 4 / 12
    ram = summary["tiers"][0]
    assert ram == {"tier": "ram", "entries": 2, "bytes": 5 * MiB, "hits": 3, "budget": 64 * MiB}


def test_timeline_is_the_window_after_since_and_events_merge_by_time() -> None:
    samples = [
        sample(NOW - 700, 1, Pressure.NORMAL),
        sample(NOW - 20, 2, Pressure.SOFT),
        sample(NOW - 10, 3, Pressure.HARD),
    ]
    doc = build(samples=samples)
    assert [p[1] for p in doc["timeline"]] == [2, 3]  # older than ten minutes: gone
    assert [p[5] for p in doc["timeline"]] == [1, 2]
    assert doc["timeline_fields"][:2] == ["wall", "usage"]
    assert [p[1] for p in build(samples=samples, since=NOW - 15)["timeline"]] == [3]
    events = build(
        scheduler_events=[
            {"wall": NOW - 5, "kind": "load", "message": "loaded"},
            {"wall": NOW - 900, "kind": "load", "message": "too old"},
        ],
        guard_events=[
            {"wall": NOW - 8, "kind": "abort", "model": "m", "message": "aborted", "level": "hard"},
            {"wall": NOW - 7, "kind": "unload", "message": "the scheduler says it"},
        ],
    )["events"]
    assert [(e["kind"], e["message"]) for e in events] == [("abort", "aborted"), ("load", "loaded")]


def test_event_log_is_bounded_and_readable_since_a_sequence() -> None:
    clock = iter(range(100, 200))
    log = EventLog(maxlen=3, wall_clock=lambda: float(next(clock)))
    for i in range(5):
        log.add("load", f"m{i}", f"loaded m{i}", bytes=i)
    assert [e.model for e in log.since(0)] == ["m2", "m3", "m4"]
    assert [e.seq for e in log.since(4)] == [5]
    assert log.since(0)[0].to_dict() == {
        "seq": 3,
        "wall": 102.0,
        "kind": "load",
        "model": "m2",
        "message": "loaded m2",
        "detail": {"bytes": 2},
    }
    with pytest.raises(ValueError):
        EventLog(maxlen=0)


def test_503_and_507_answers_become_events(harness: Harness) -> None:
    log = EventLog()
    harness.scheduler.events = log  # type: ignore[attr-defined]
    harness.scheduler.use_error = InsufficientMemory(
        "needs more", details={"model": "smollm2-135m", "needed": 20, "available": 10}
    )
    r = harness.client.post(
        "/v1/chat/completions",
        json={"model": "smollm2-135m", "messages": [{"role": "user", "content": "x"}]},
    )
    assert r.status_code == 507
    r = harness.client.post("/api/generate", json={"model": "smollm2-135m", "prompt": "x"})
    assert r.status_code == 507
    events = [e.to_dict() for e in log.since(0)]
    assert [(e["kind"], e["model"], e["detail"]["needed"]) for e in events] == [
        ("refused_507", "smollm2-135m", 20),
        ("refused_507", "smollm2-135m", 20),
    ]
    assert events[1]["detail"]["path"] == "/api/generate" and events[1]["message"] == "needs more"


def test_the_page_is_served_with_a_policy_that_allows_only_this_server(harness: Harness) -> None:
    c = harness.client
    page = c.get("/ui")
    assert page.status_code == 200 and page.headers["content-type"].startswith("text/html")
    assert "default-src 'self'" in page.headers["content-security-policy"]
    for src in ("/ui/dashboard.js", "/ui/dashboard.css"):
        assert src in page.text
        assert c.get(src).status_code == 200
    assert "http" not in c.get("/ui/dashboard.js").text.replace("http://www.w3.org/2000/svg", "")
    assert c.get("/ui/../app.py").status_code == 404
    assert c.get("/ui/secrets.txt").status_code == 404
    home = c.get("/", headers={"Accept": "text/html"}, follow_redirects=False)
    assert home.status_code == 307 and home.headers["location"] == "/ui"
    assert c.get("/").text.startswith("elbowroom is running")


def test_watch_renders_the_same_picture_in_a_terminal() -> None:
    doc = build(scheduler_events=[{"wall": NOW - 5, "kind": "refused_507", "message": "too big"}])
    out = io.StringIO()
    Console(file=out, width=140, color_system=None).print(render(doc))
    text = out.getvalue()
    for words in (
        "pressure soft",
        "loads paused",
        "Memory (ELBOWROOM_OVERRIDE_MEMORY)",
        "4.0 GiB",
        "smollm2-135m",
        "1/4",
        "200.0 MiB",
        "50% hits",
        "refused_507",
        "too big",
    ):
        assert words in text, (words, text)


def test_cluster_nodes_and_where_each_model_runs() -> None:
    """Over a cluster (docs/cluster.md) the report has every node; one machine has none."""
    assert build()["nodes"] == [] and build()["models"][0]["node"] is None
    nodes = [
        {"name": "10.0.0.1", "alive": True, "pressure": "normal", "committed": 300 * MiB,
         "available": GiB, "ceiling": 2 * GiB, "models": ["smollm2-135m"]},
        {"name": "10.0.0.2", "alive": False},
    ]  # fmt: skip
    doc = build(report={**REPORT, "nodes": nodes}, rows=[{**ROW, "node": "10.0.0.1"}])
    assert doc["models"][0]["node"] == "10.0.0.1"
    up, gone = doc["nodes"]
    assert up == {**nodes[0], "gone_at": None, "gone_cause": None}
    assert gone["alive"] is False and gone["models"] == [] and gone["ceiling"] == 0
    assert doc["cluster"] is None  # no "cluster" key in this report: one machine's shape


def test_cluster_numbers_are_labelled_totals_and_the_pools_name_their_node() -> None:
    nodes = [
        {"name": "10.0.0.1", "alive": True, "committed": 300 * MiB, "available": GiB,
         "ceiling": 2 * GiB, "models": []},
        {"name": "10.0.0.2", "alive": False, "gone_at": 1.0e9, "gone_cause": "node 10.0.0.2 "
         "stopped answering"},
    ]  # fmt: skip
    report = {
        **REPORT,
        "cluster": True,
        "worst_node": "10.0.0.1",
        "nodes": nodes,
        "totals": {"nodes": 1, "committed": 300 * MiB, "available": GiB, "ceiling": 2 * GiB,
                   "limit": 3 * GiB},
    }  # fmt: skip
    doc = build(report=report)
    assert doc["cluster"] == {
        "nodes": 1, "worst_node": "10.0.0.1", "committed": 300 * MiB, "available": GiB,
        "ceiling": 2 * GiB, "limit": 3 * GiB,
    }  # fmt: skip
    assert doc["pools"][0]["name"].endswith("node 10.0.0.1 (the most pressed node)")
    gone = doc["nodes"][1]
    assert gone["gone_at"] == 1.0e9 and "stopped answering" in gone["gone_cause"]
    # One machine: its pools carry no node.
    assert "node" not in build()["pools"][0]
