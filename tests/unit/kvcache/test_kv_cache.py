"""PrefixCache with opaque states: lookups, supersede, budget, spill, restart, damage."""

from __future__ import annotations

import hashlib
from pathlib import Path

from elbowroom.kvcache import CacheKey, CostModel, PrefixCache, Tier, budget_for_level
from elbowroom.kvcache.fileformat import Blob

KEY = CacheKey(model="/m/model.gguf:100:1", n_ctx=4096, kv_type="f16", engine="test")
B = 16
PER_TOKEN = 100  # bytes of fake state per token, like a real KV state grows with tokens


def state_of(tokens: list[int] | tuple[int, ...]) -> bytes:
    seed = hashlib.sha256(repr(tuple(tokens)).encode()).digest()
    return (seed * (len(tokens) * PER_TOKEN // 32 + 1))[: len(tokens) * PER_TOKEN]


def cache(tmp_path: Path | None = None, **kw: object) -> PrefixCache:
    kw.setdefault("block_tokens", B)
    kw.setdefault("ram_budget", 1_000_000)
    # A prefill this slow makes every restore worth it unless a test says otherwise.
    kw.setdefault("cost", CostModel(prefill_tps=1.0))
    return PrefixCache(KEY, disk_dir=tmp_path, **kw)  # type: ignore[arg-type]


def restore(c: PrefixCache, prompt: list[int], live: int = 0) -> tuple[int, Blob | None]:
    hit = c.lookup(prompt, live)
    if hit is None:
        return 0, None
    got: list[Blob] = []

    def apply(state: Blob) -> bool:
        got.append(state)
        return True

    assert c.restore(hit, apply)
    return hit.n_tokens, got[0]


def test_exact_hit_keeps_one_token_to_evaluate() -> None:
    c = cache()
    toks = list(range(100))
    assert c.store(toks, state_of(toks))
    n, state = restore(c, toks)
    assert n == 99 and state == state_of(toks)
    assert c.stats()["hits_ram"] == 1 and c.stats()["restored"] == 1


def test_partial_hit_is_token_exact_past_the_block_boundary() -> None:
    c = cache()
    stored = list(range(100))
    c.store(stored, state_of(stored))
    n, state = restore(c, [*range(40), 999, 998])
    assert n == 40 and state == state_of(stored)  # 2 full blocks + 8 tokens


def test_less_than_one_block_shared_is_a_miss() -> None:
    c = cache()
    c.store(list(range(100)), state_of(list(range(100))))
    assert c.lookup([*range(B - 1), 777, 1, 2, 3]) is None
    assert c.lookup([5] * 10) is None
    assert c.stats()["misses"] == 2


def test_no_restore_when_the_context_already_holds_it() -> None:
    c = cache()
    c.store(list(range(100)), state_of(list(range(100))))
    assert c.lookup(list(range(100)), live=99) is None
    assert c.lookup(list(range(100)), live=50) is not None


def test_growing_conversation_supersedes_older_turns() -> None:
    c = cache()
    turn1 = list(range(50))
    turn2 = [*turn1, *range(1000, 1060)]
    c.store(turn1, state_of(turn1))
    c.store(turn2, state_of(turn2))
    s = c.stats()
    assert s["entries_ram"] == 1 and s["bytes_ram"] == len(state_of(turn2))
    n, state = restore(c, [*turn1, 5, 5])
    assert n == 50 and state == state_of(turn2)
    # A shorter prefix of what is held adds nothing.
    assert not c.store(turn1, state_of(turn1))
    assert c.stats()["entries_ram"] == 1


def test_divergent_branches_are_both_kept_and_the_longer_match_wins() -> None:
    c = cache()
    a = [*range(64), *range(100, 140)]
    b = [*range(64), *range(200, 232)]
    c.store(a, state_of(a))
    c.store(b, state_of(b))
    n, state = restore(c, [*range(64), *range(100, 120), 7])
    assert n == 84 and state == state_of(a)


def test_ram_tier_never_exceeds_its_grant_and_spills_to_disk(tmp_path: Path) -> None:
    c = cache(tmp_path, ram_budget=25_000)
    prompts = [[i, *range(1, 100)] for i in range(6)]  # 9,900 bytes each
    for p in prompts:
        c.store(p, state_of(p))
        assert c.stats()["bytes_ram"] <= 25_000
    s = c.stats()
    assert s["entries_ram"] == 2 and s["entries_disk"] == 4 and s["spilled"] == 4
    hit = c.lookup(prompts[0])
    assert hit is not None and hit.tier is Tier.DISK
    n, state = restore(c, prompts[0])
    assert n == 99 and state == state_of(prompts[0])
    assert c.stats()["hits_disk"] == 1


def test_shrinking_the_grant_spills_lru_first(tmp_path: Path) -> None:
    c = cache(tmp_path)
    prompts = [[i, *range(1, 100)] for i in range(3)]
    for p in prompts:
        c.store(p, state_of(p))
    restore(c, prompts[0])  # prompts[0] becomes the most recently used
    c.set_ram_budget(10_000)
    s = c.stats()
    assert s["ram_budget"] == 10_000 and s["bytes_ram"] <= 10_000
    assert s["entries_ram"] == 1 and s["entries_disk"] == 2
    hit = c.lookup(prompts[0])
    assert hit is not None and hit.tier is Tier.RAM
    c.set_ram_budget(0)
    assert c.stats()["entries_ram"] == 0 and c.stats()["entries_disk"] == 3


def test_without_a_disk_tier_shrinking_drops(tmp_path: Path) -> None:
    c = cache(None)
    c.store(list(range(100)), state_of(list(range(100))))
    c.set_ram_budget(0)
    s = c.stats()
    assert s["entries_ram"] == 0 and s["dropped"] == 1 and s["entries_disk"] == 0
    assert c.lookup(list(range(100))) is None


def test_flush_then_restart_finds_entries_on_disk(tmp_path: Path) -> None:
    c = cache(tmp_path)
    toks = list(range(300))
    c.store(toks, state_of(toks))
    c.close()
    assert c.stats()["entries_ram"] == 0
    fresh = cache(tmp_path)
    assert fresh.stats()["entries_disk"] == 1
    n, state = restore(fresh, [*range(200), 1])
    assert n == 200 and state == state_of(toks)
    other = PrefixCache(
        CacheKey(model=KEY.model, n_ctx=2048, kv_type="f16", engine="test"),
        block_tokens=B,
        disk_dir=tmp_path,
    )
    assert other.lookup(toks) is None  # another context shape never sees these states


def test_a_stored_prompt_text_survives_a_restart_and_the_longest_one_is_known(
    tmp_path: Path,
) -> None:
    c = cache(tmp_path)
    short, long = list(range(100)), list(range(1000, 1300))
    c.store(short, state_of(short), "the sea")
    c.store(long, state_of(long), "the sea and its ships")
    other = list(range(2000, 2100))
    c.store(other, state_of(other))  # no text recorded
    c.close()
    fresh = cache(tmp_path)
    assert fresh.known_text("the sea and its ships, again") == (
        "the sea and its ships",
        tuple(long),
    )
    assert fresh.known_text("the sea, again") == ("the sea", tuple(short))
    assert fresh.known_text("rivers") == ("", ())


def test_corrupt_disk_entry_is_a_miss_and_removed(tmp_path: Path) -> None:
    c = cache(tmp_path)
    toks = list(range(300))
    c.store(toks, state_of(toks))
    c.flush()
    (path,) = tmp_path.glob("*.kv")
    data = bytearray(path.read_bytes())
    data[-10] ^= 0xFF
    path.write_bytes(bytes(data))
    hit = c.lookup(toks)
    assert hit is not None
    assert not c.restore(hit, lambda s: True)
    assert not path.exists()
    s = c.stats()
    assert s["entries_disk"] == 0 and s["misses"] == 1 and s["restored"] == 0
    assert c.lookup(toks) is None


def test_state_the_engine_rejects_is_dropped() -> None:
    c = cache()
    toks = list(range(100))
    c.store(toks, state_of(toks))
    hit = c.lookup(toks)
    assert hit is not None and not c.restore(hit, lambda s: False)
    assert c.stats()["entries_ram"] == 0 and c.lookup(toks) is None


def test_recompute_when_cheaper_and_count_it() -> None:
    c = cache(cost=CostModel({Tier.RAM: 1.0, Tier.DISK: 1.0}, prefill_tps=1e9))
    toks = list(range(100))
    c.store(toks, state_of(toks))
    assert c.lookup(toks) is None
    assert c.stats()["recomputed"] == 1 and c.stats()["misses"] == 0


def test_restore_timing_feeds_the_cost_model() -> None:
    ticks = iter([0.0, 2.0])
    c = cache(clock=lambda: next(ticks))
    toks = list(range(100))
    c.store(toks, state_of(toks))
    before = c.stats()["restore_bps_ram"]
    restore(c, toks)
    assert c.stats()["restore_bps_ram"] < before  # 10 kB in 2 s pulls the estimate down


def test_budget_for_pressure_levels() -> None:
    assert budget_for_level(0, 1000) == 1000
    assert budget_for_level(1, 1000) == 250
    assert budget_for_level(2, 1000) == 0


def test_sliding_window_states_longer_than_the_window_are_only_extended() -> None:
    c = cache(window=50)
    toks = list(range(100))
    c.store(toks, state_of(toks))
    assert c.lookup(toks) is None  # an exact repeat would trim one token: not possible
    assert c.lookup([*range(60), 5]) is None  # nor a shorter prefix
    hit = c.lookup([*toks, 7, 8])  # extending the whole state is fine
    assert hit is not None and hit.n_tokens == 100
    short = cache(window=200)
    short.store(toks, state_of(toks))
    assert short.lookup([*range(60), 5]) is not None  # within the window: trims freely
