"""Memory behaviour of a real server: keep-alive expiry, eviction under a limit that fits
one LLM but not both, and 507 refusals with their numbers.

The footprints are measured first (a server loads both models and reports their bytes);
the limited server shares that server's data folder, so its predictions are those
measurements. ELBOWROOM_CONTAINER_MARGIN is set so that the limit is exactly
``override - margin`` (an override gets the container rule, and the container candidate
wins over "available", see docs/memory.md), which makes the arithmetic of the test exact.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import openai
import pytest
from serverproc import ServerFactory, ServerProcess, pid_alive, runner_pid, wait_for

from elbowroom.config import Settings
from elbowroom.units import MiB

pytestmark = pytest.mark.slow

SMOL, GEMMA = "smollm2-135m", "gemma3-270m"
HI = [{"role": "user", "content": "Hi"}]
RESERVE = 512 * MiB
NO_GRANT = {"ELBOWROOM_KV_RAM_MAX": "0"}


@dataclass(frozen=True)
class Measured:
    home: Path
    bytes: dict[str, int]
    server: int  # the server process's own anonymous bytes: they count as ours too


@pytest.fixture(scope="module")
def measured(server_factory: ServerFactory, tmp_path_factory: pytest.TempPathFactory) -> Measured:
    home = tmp_path_factory.mktemp("measured")
    # No prompt-cache grant: the eviction arithmetic below is about the models' own bytes
    # (a grant only takes free room, so it would shrink to fit and hide the eviction).
    server = server_factory("--ctx", "1024", home=home, env=NO_GRANT)
    sizes = {}
    with server.http() as http:
        for model in (SMOL, GEMMA):
            r = http.post(f"/api/models/{model}/load")
            assert r.status_code == 200, r.text
            sizes[model] = int(r.json()["runner"]["bytes"])
    own = int(server.memory()["server_usage"])
    server.stop()
    return Measured(home, sizes, own)


def test_keep_alive_expiry_unloads_and_memory_returns(server_factory: ServerFactory) -> None:
    server = server_factory("--ctx", "1024")
    before = server.memory()
    assert before["committed"] == 0
    out = server.openai().chat.completions.create(
        model=SMOL, messages=HI, max_tokens=2, extra_body={"keep_alive": 1}
    )
    assert out.choices[0].message.content is not None
    pid = runner_pid(server, SMOL)
    loaded = server.memory()
    # Loaded: the runner's measured bytes are committed (unless it expired already).
    assert pid is None or loaded["committed"] > 0
    wait_for(
        lambda: all(m["id"] != SMOL for m in server.ps()), timeout=30, what="keep-alive expiry"
    )
    if pid is not None:
        wait_for(lambda: not pid_alive(pid), timeout=30, what="the runner to exit")
    after = server.memory()
    # Only the server process's own bytes are left of ours (sampled a moment apart).
    assert after["committed"] == 0
    assert abs(after["own_usage"] - after["server_usage"]) < 16 * MiB


def limited_server(
    server_factory: ServerFactory, home: Path, limit: int
) -> tuple[ServerProcess, int]:
    server = server_factory(
        "--ctx",
        "1024",
        home=home,
        env={
            **NO_GRANT,
            "ELBOWROOM_OVERRIDE_MEMORY": str(limit + RESERVE),
            "ELBOWROOM_CONTAINER_MARGIN": str(RESERVE),
        },
    )
    report = server.memory()
    assert report["limit"]["winner"] == "container", report["limit"]
    return server, int(report["limit"]["value"])


def test_alternating_models_evict_and_never_exceed_the_limit(
    server_factory: ServerFactory, measured: Measured
) -> None:
    small, big = sorted(measured.bytes.values())
    soft = Settings().load_fraction  # the load ceiling
    # Loads are admitted up to the load ceiling (load_fraction x limit), less the server's
    # own bytes: the bigger one fits under it with room to spare, both together do not.
    own = measured.server
    low, high = int((big + own) / soft) + 16 * MiB, int((small + big + own) / soft) - 16 * MiB
    if low >= high:
        pytest.skip(f"footprints {measured.bytes} leave no limit that fits one but not both")
    server, limit = limited_server(server_factory, measured.home, (low + high) // 2)
    client = server.openai()
    pids = []
    for i, model in enumerate([SMOL, GEMMA] * 2):
        out = client.chat.completions.create(model=model, messages=HI, max_tokens=2)
        assert out.choices[0].message.content is not None, (i, model)
        rows = server.ps()
        assert [r["id"] for r in rows] == [model], rows  # the other one was evicted
        assert sum(r["bytes"] for r in rows) <= limit
        assert server.memory()["committed"] <= limit
        pids.append(rows[0]["pid"])
    assert len(set(pids)) == 4  # every switch was an unload and a fresh load

    # Pinned, SmolLM2 cannot be evicted, so gemma cannot fit: 507 with the numbers.
    with server.http() as http:
        assert http.post(f"/api/models/{SMOL}/load", json={"pin": True}).status_code == 200
        r = http.post("/v1/chat/completions", json={"model": GEMMA, "messages": HI})
        assert r.status_code == 507, r.text
        err = r.json()["error"]
        assert err["type"] == "insufficient_memory" and err["model"] == GEMMA
        assert err["memory_limit"] == limit and err["limit"] == int(limit * soft)
        assert err["needed"] > err["available"]
        assert any(s["action"] == "unload_pinned" for s in err["suggestions"])
        # The server keeps serving the pinned model.
        ok = http.post(
            "/v1/chat/completions", json={"model": SMOL, "messages": HI, "max_tokens": 2}
        )
        assert ok.status_code == 200


def test_model_that_cannot_fit_at_all_is_507(
    server_factory: ServerFactory, measured: Measured
) -> None:
    # Above what the server process itself holds (else that alone is hard pressure: 503),
    # far below the model.
    server, limit = limited_server(server_factory, measured.home, 2 * measured.server + 16 * MiB)
    with pytest.raises(openai.APIStatusError) as info:
        server.openai().chat.completions.create(model=SMOL, messages=HI, max_tokens=2)
    assert info.value.status_code == 507
    err = info.value.body
    assert isinstance(err, dict)
    for key in ("model", "needed", "available", "limit", "suggestions", "message"):
        assert key in err, err
    assert err["model"] == SMOL and err["memory_limit"] == limit and err["needed"] > limit
    assert err["limit"] == int(limit * Settings().load_fraction)  # the load ceiling
    assert err["suggestions"], err
    assert server.ps() == []
    assert server.http().get("/health").json() == {"status": "ok"}


def test_two_small_llms_with_kv_sized_prompt_caches_stay_side_by_side(
    server_factory: ServerFactory, measured: Measured
) -> None:
    """Issue 24's arena: each LLM's prompt-cache grant was a fixed 512 MiB (kv_ram_max), so
    two small LLMs in a limit that holds both evicted each other on every switch. The grant
    is at most kv_ram_kv_factor (1) x the model's KV cache; the engine gets that grant."""
    grants = {}
    roomy = server_factory("--ctx", "1024", home=measured.home)
    with roomy.http() as http:
        for model in (SMOL, GEMMA):
            r = http.post(f"/api/models/{model}/load")
            assert r.status_code == 200, r.text
        for row in roomy.ps():
            grants[row["id"]] = int(row["engine_stats"]["prompt_cache_grant"])
    roomy.stop()
    # SmolLM2: 22.5 KiB/token x 1024 x 4 slots = 90 MiB of KV, so a 90 MiB grant, not 512
    assert grants[SMOL] == 90 * MiB, grants
    assert 0 <= grants[GEMMA] < 512 * MiB, grants
    # Room under the load ceiling for both models and both grants, 32 MiB to spare: far
    # less than a 512 MiB grant beside the first model would leave the second.
    both = sum(measured.bytes.values()) + sum(grants.values()) + measured.server + 32 * MiB
    assert both - sum(measured.bytes.values()) - measured.server < 512 * MiB
    server = server_factory(
        "--ctx",
        "1024",
        home=measured.home,
        env={
            "ELBOWROOM_OVERRIDE_MEMORY": str(int(both / Settings().load_fraction) + RESERVE),
            "ELBOWROOM_CONTAINER_MARGIN": str(RESERVE),
        },
    )
    client = server.openai()
    for model in (SMOL, GEMMA, SMOL, GEMMA):
        out = client.chat.completions.create(model=model, messages=HI, max_tokens=2)
        assert out.choices[0].message.content is not None
    rows = {r["id"]: r for r in server.ps()}
    assert set(rows) == {SMOL, GEMMA}, rows  # no switch evicted the other
    assert {m: int(r["engine_stats"]["prompt_cache_grant"]) for m, r in rows.items()} == grants
    assert server.memory()["committed"] <= server.memory()["limit"]["value"]
