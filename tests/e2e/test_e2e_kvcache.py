"""The KV prefix cache through a real `elbowroom serve` and the official openai client:
``usage.prompt_tokens_details.cached_tokens`` reports a cache hit, and a restarted server
answers from the disk tier its predecessor wrote on shutdown."""

from __future__ import annotations

from pathlib import Path

import pytest
from openai.types.chat import ChatCompletion, ChatCompletionMessageParam
from serverproc import ServerFactory, ServerProcess

pytestmark = pytest.mark.slow

MODEL = "smollm2-135m"
SYSTEM = "You are the assistant of a hardware store. " + " ".join(
    f"Rule {i}: answer briefly and name the aisle of item {i}." for i in range(12)
)


def ask(server: ServerProcess, messages: list[ChatCompletionMessageParam]) -> ChatCompletion:
    return server.openai().chat.completions.create(
        model=MODEL, messages=messages, max_tokens=6, temperature=0
    )


QUESTION: list[ChatCompletionMessageParam] = [
    {"role": "system", "content": SYSTEM},
    {"role": "user", "content": "Hammers?"},
]
OTHER: list[ChatCompletionMessageParam] = [{"role": "user", "content": "One word about the sea."}]


def cached(out: ChatCompletion) -> int:
    assert out.usage is not None and out.usage.prompt_tokens_details is not None
    n = out.usage.prompt_tokens_details.cached_tokens
    assert n is not None
    return n


def test_cache_hit_and_disk_tier_after_restart(
    server_factory: ServerFactory, tmp_path_factory: pytest.TempPathFactory
) -> None:
    home: Path = tmp_path_factory.mktemp("kvhome")
    server = server_factory("--ctx", "1024", home=home)
    first = ask(server, QUESTION)
    n_prompt = first.usage.prompt_tokens if first.usage is not None else 0
    assert n_prompt > 150
    assert cached(first) < n_prompt // 2
    ask(server, OTHER)  # another conversation, on another slot
    again = ask(server, QUESTION)
    # All but the token that samples, reported in whole 64-token blocks.
    assert cached(again) == (n_prompt - 1) // 64 * 64
    assert again.choices[0].message.content == first.choices[0].message.content
    (row,) = [r for r in server.ps() if r["id"] == MODEL]
    stats = row["engine_stats"]
    assert stats["slots"] == 4 and stats["requests_served"] == 3
    assert stats["kv_cache"]["entries_disk"] == 0  # written when the runner stops

    server.stop()  # graceful: the runner saves its slots into the disk tier
    assert list((home / "cache" / "elbowroom" / "kv").glob("*.kv"))
    restarted = server_factory("--ctx", "1024", home=home)
    third = ask(restarted, QUESTION)
    assert cached(third) == (n_prompt - 1) // 64 * 64
    assert third.choices[0].message.content == first.choices[0].message.content
    (row,) = [r for r in restarted.ps() if r["id"] == MODEL]
    kv = row["engine_stats"]["kv_cache"]
    assert kv["hits_disk"] == 1 and kv["restored"] == 1 and kv["entries_disk"] >= 1


def test_the_ram_tier_is_the_engines_own_prompt_cache(server_factory: ServerFactory) -> None:
    """One slot: another conversation takes it, so the engine keeps the first one's prompt
    state in its RAM prompt cache and loads it back when the first conversation returns.
    /api/ps, /api/elbowroom/ps, the dashboard's document and /metrics show the engine's own
    counts of that cache (read from its log: engines/llama_log.py)."""
    server = server_factory("--ctx", "1024", "--slots", "1")
    first = ask(server, QUESTION)
    ask(server, OTHER)  # the same slot: the engine saves QUESTION's state in its cache
    again = ask(server, QUESTION)
    n_prompt = first.usage.prompt_tokens if first.usage is not None else 0
    assert cached(again) == (n_prompt - 1) // 64 * 64  # loaded back from the engine's cache

    (row,) = [r for r in server.ps() if r["id"] == MODEL]
    kv = row["engine_stats"]["kv_cache"]
    assert kv["hits_ram"] >= 1 and kv["hits"]["ram"] == kv["hits_ram"]
    assert kv["lookups_ram"] >= 2  # OTHER found nothing better, QUESTION found its state
    assert kv["entries_ram"] >= 1 and kv["bytes_ram"] > 0  # OTHER's state, saved now
    assert kv["ram_budget"] == row["engine_stats"]["prompt_cache_grant"] > 0
    with server.http() as http:
        (ollama,) = [m for m in http.get("/api/ps").json()["models"] if m["id"] == MODEL]
        assert ollama["engine_stats"]["kv_cache"]["hits_ram"] == kv["hits_ram"]
        doc = http.get("/api/elbowroom/dashboard").json()
        (view,) = [m for m in doc["models"] if m["id"] == MODEL]
        ram = next(t for t in view["kv"]["tiers"] if t["tier"] == "ram")
        assert ram["hits"] >= 1 and ram["entries"] >= 1 and ram["bytes"] > 0
        assert ram["budget"] == kv["ram_budget"]
        assert view["kv"]["hits"] >= 1 and view["kv"]["hit_rate"] is not None
        metrics = http.get("/metrics").text
    label = f'model="{MODEL}",tier="ram"'

    def sample(name: str) -> float:
        (line,) = [ln for ln in metrics.splitlines() if ln.startswith(name) and label in ln]
        return float(line.rsplit(" ", 1)[1])

    assert sample("elbowroom_kv_cache_hits_total") >= 1
    assert sample("elbowroom_kv_cache_bytes") > 0
    # The engine's info lines stay out of the server's log at the default log level.
    # (a request its slot holds whole makes llama.cpp warn "n_past was set to ...")
    assert "prompt cache" not in server.log() and "n_past" not in server.log()
