"""The RAM tier never holds more than its grant and evicts least recently used first."""

from __future__ import annotations

import pytest

from elbowroom.kvcache.ram import RamEntry, RamTier


def entry(eid: str, n: int) -> RamEntry:
    return RamEntry(eid, (1, 2, 3), bytes(n))


def test_put_evicts_lru_to_stay_within_budget() -> None:
    ram = RamTier(100)
    assert ram.put(entry("a", 40)) == []
    assert ram.put(entry("b", 40)) == []
    ram.get("a")  # a is now more recent than b
    evicted = ram.put(entry("c", 40))
    assert [e.eid for e in evicted] == ["b"]
    assert ram.nbytes == 80 and "a" in ram and "c" in ram


def test_entry_bigger_than_grant_is_refused() -> None:
    ram = RamTier(100)
    ram.put(entry("a", 50))
    evicted = ram.put(entry("huge", 101))
    assert [e.eid for e in evicted] == ["huge"]
    assert "a" in ram and ram.nbytes == 50


def test_reput_replaces_without_double_counting() -> None:
    ram = RamTier(100)
    ram.put(entry("a", 60))
    ram.put(entry("a", 70))
    assert ram.nbytes == 70 and len(ram) == 1


def test_shrinking_the_budget_returns_lru_victims() -> None:
    ram = RamTier(300)
    for name in "abc":
        ram.put(entry(name, 100))
    evicted = ram.set_budget(150)
    assert [e.eid for e in evicted] == ["a", "b"]
    assert ram.nbytes == 100 <= ram.budget
    assert [e.eid for e in ram.drain()] == ["c"]
    assert ram.nbytes == 0 and len(ram) == 0


def test_negative_budget_is_an_error() -> None:
    with pytest.raises(ValueError):
        RamTier(-1)
