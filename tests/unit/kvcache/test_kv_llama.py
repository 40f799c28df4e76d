"""The KV prefix cache inside the real LlamaEngine on the real SmolLM2-135M.

Every greedy output with the cache must equal the output of an engine without it. Between
the requests that should hit, another prompt replaces the live context, so a hit can only
come from the cache (RAM tier, or disk tier after a restart), never from the context.
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from bundled_models import bundled_spec

from elbowroom.engines.llama import LlamaEngine

pytest.importorskip("llama_cpp")

N_CTX = 1024
BLOCK = 64
SYSTEM = "You are a careful assistant for a hardware store. " + " ".join(
    f"Rule {i}: answer briefly, name the aisle, and never guess a price for item {i}."
    for i in range(9)
)  # ~200 tokens shared by every question below


class Level:
    def __init__(self) -> None:
        self.value = 0

    def __call__(self) -> int:
        return self.value


def load(kv_dir: Path | None, level: Level | None = None, **options: Any) -> LlamaEngine:
    eng = LlamaEngine()
    opts: dict[str, Any] = {
        "n_ctx": N_CTX,
        "seed": 7,
        "kv_cache": kv_dir is not None,
        "kv_block_tokens": BLOCK,
        "pressure": level or Level(),
        **options,
    }
    if kv_dir is not None:
        opts["kv_cache_dir"] = str(kv_dir)
    eng.load(bundled_spec("smollm2-135m"), opts)
    return eng


def ask(eng: LlamaEngine, messages: list[dict[str, str]], max_tokens: int = 12) -> dict[str, Any]:
    payload = {"messages": messages, "temperature": 0, "max_tokens": max_tokens}
    return eng.run("chat", payload, lambda _: None, lambda: False)


def q(text: str) -> list[dict[str, str]]:
    return [{"role": "system", "content": SYSTEM}, {"role": "user", "content": text}]


OTHER = [{"role": "user", "content": "Write one word about the sea."}]


def kv(eng: LlamaEngine) -> dict[str, Any]:
    stats: dict[str, Any] = eng.stats()["kv_cache"]
    return stats


@pytest.fixture(scope="module")
def plain() -> Iterator[LlamaEngine]:
    eng = load(None)
    assert eng.stats() == {}
    yield eng
    eng.close()


@pytest.fixture(scope="module")
def reference(plain: LlamaEngine) -> dict[str, str]:
    """Greedy answers without any cache, each from a context that held something else."""
    out = {}
    for name, messages in {"hammer": q("Where are hammers?"), "glue": q("Where is glue?")}.items():
        ask(plain, OTHER, 2)
        out[name] = ask(plain, messages)["text"]
    return out


@pytest.fixture(scope="module")
def kv_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tmp_path_factory.mktemp("kv")


@pytest.fixture(scope="module")
def cached(kv_dir: Path) -> Iterator[LlamaEngine]:
    eng = load(kv_dir)
    yield eng
    eng.close()


@pytest.mark.slow
def test_exact_hit_from_ram_matches_no_cache(
    cached: LlamaEngine, reference: dict[str, str]
) -> None:
    first = ask(cached, q("Where are hammers?"))
    assert first["text"] == reference["hammer"]
    ask(cached, OTHER, 2)  # the live context now holds something else
    before = kv(cached)
    again = ask(cached, q("Where are hammers?"))
    after = kv(cached)
    assert again["text"] == reference["hammer"]
    assert again["usage"]["cached_tokens"] == again["usage"]["prompt_tokens"] - 1
    assert after["hits_ram"] == before["hits_ram"] + 1
    assert after["restored"] == before["restored"] + 1


@pytest.mark.slow
def test_partial_prefix_hit_trims_and_matches_no_cache(
    cached: LlamaEngine, reference: dict[str, str]
) -> None:
    ask(cached, q("Where are hammers?"))
    ask(cached, OTHER, 2)
    before = kv(cached)
    glue = ask(cached, q("Where is glue?"))  # shares the system prompt, not the question
    after = kv(cached)
    assert glue["text"] == reference["glue"]
    assert after["restored"] == before["restored"] + 1
    n_prompt = glue["usage"]["prompt_tokens"]
    assert BLOCK < glue["usage"]["cached_tokens"] < n_prompt - 1


@pytest.mark.slow
def test_multi_turn_conversation_matches_and_keeps_one_entry(
    cached: LlamaEngine, plain: LlamaEngine
) -> None:
    turns = ["Where are hammers?", "And nails?", "Which is cheaper?"]
    history: list[dict[str, str]] = [{"role": "system", "content": SYSTEM}]
    for i, text in enumerate(turns):
        history.append({"role": "user", "content": text})
        expected = ask(plain, history)["text"]
        ask(cached, OTHER, 2)
        before = kv(cached)
        got = ask(cached, history)
        assert got["text"] == expected
        if i > 0:  # the previous turn's state (prompt + answer) is restored and extended
            assert kv(cached)["restored"] == before["restored"] + 1
            assert got["usage"]["cached_tokens"] > before["block_tokens"]
        history.append({"role": "assistant", "content": got["text"]})
    # Each turn's entry superseded the one before: one entry for the whole conversation,
    # besides the module's other entries (hammers, glue; the short prompt is under a block).
    entries = kv(cached)["entries_ram"] + kv(cached)["entries_disk"]
    assert entries <= 3


@pytest.mark.slow
def test_restart_hits_the_disk_tier(kv_dir: Path, reference: dict[str, str]) -> None:
    first = load(kv_dir)
    ask(first, q("Where are hammers?"))
    first.close()  # graceful unload: the RAM tier goes to disk
    second = load(kv_dir)
    try:
        assert kv(second)["entries_disk"] >= 1 and kv(second)["entries_ram"] == 0
        got = ask(second, q("Where are hammers?"))
        assert got["text"] == reference["hammer"]
        assert kv(second)["hits_disk"] == 1
        assert got["usage"]["cached_tokens"] == got["usage"]["prompt_tokens"] - 1
    finally:
        second.close()


@pytest.mark.slow
def test_corrupt_and_truncated_files_are_misses_and_removed(
    tmp_path: Path, reference: dict[str, str]
) -> None:
    eng = load(tmp_path)
    ask(eng, q("Where are hammers?"))
    ask(eng, OTHER, 2)  # under one block: not cached
    ask(eng, q("Where is glue?"))  # diverges from hammers: a second entry
    eng.close()
    files = sorted(tmp_path.glob("*.kv"), key=lambda p: p.stat().st_size)
    assert len(files) == 2
    corrupt, truncated = files
    data = bytearray(corrupt.read_bytes())
    data[len(data) // 2] ^= 0xFF
    corrupt.write_bytes(bytes(data))
    truncated.write_bytes(truncated.read_bytes()[: truncated.stat().st_size // 2])
    eng = load(tmp_path)
    try:
        assert not truncated.exists()  # found at indexing
        assert kv(eng)["entries_disk"] == 1
        answers = {ask(eng, q("Where are hammers?"))["text"], ask(eng, q("Where is glue?"))["text"]}
        assert answers == {reference["hammer"], reference["glue"]}
        assert not corrupt.exists()  # found at restore
        assert kv(eng)["misses"] >= 1 and kv(eng)["hits_disk"] == 0
    finally:
        eng.close()


@pytest.mark.slow
def test_ram_tier_stays_within_its_grant_and_pressure_spills_it(
    tmp_path: Path, reference: dict[str, str]
) -> None:
    level = Level()
    probe = load(None, kv_cache=True)  # RAM tier only: learn one entry's size
    ask(probe, q("Where are hammers?"))
    one_entry = kv(probe)["bytes_ram"]
    probe.close()
    assert one_entry > 0
    eng = load(tmp_path, level, kv_ram_max=int(one_entry * 1.5))
    try:
        for text in ("Where are hammers?", "Where is glue?", "Where are saws?"):
            ask(eng, q(text))
            s = kv(eng)
            assert s["bytes_ram"] <= s["ram_budget"] == int(one_entry * 1.5)
        assert kv(eng)["entries_disk"] >= 1
        level.value = 2  # hard pressure: the grant drops to zero, the RAM tier spills
        assert eng._kv is not None
        eng._kv.sync_budget()  # what the watcher thread does; called here to stay timeless
        s = kv(eng)
        assert s["ram_budget"] == 0 and s["bytes_ram"] == 0 and s["entries_ram"] == 0
        assert s["entries_disk"] >= 3
        level.value = 0
        ask(eng, OTHER, 2)
        got = ask(eng, q("Where are hammers?"))
        assert got["text"] == reference["hammer"]
        assert kv(eng)["hits_disk"] >= 1
    finally:
        eng.close()
