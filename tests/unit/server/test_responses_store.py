"""The stored responses' bounds: TTL, the size cap (oldest first), owners, atomic files that
a new store (a restarted server) reads back."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from elbowroom.server.openai.responses_store import ResponseStore, new_id


class Clock:
    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


def record(size: int = 10) -> dict[str, object]:
    return {"response": {"text": "x" * size}, "input_items": [], "conversation": []}


def test_put_get_delete_and_owners(tmp_path: Path) -> None:
    store = ResponseStore(tmp_path, ttl=60, max_bytes=1 << 20)
    alice, bob = store.owner_of("key-a"), store.owner_of("key-b")
    assert alice != bob and alice == store.owner_of("key-a") and store.owner_of(None) == ""
    rid = new_id("resp")
    assert store.put(rid, alice, record())
    assert store.get(rid, alice) == {**record(), "owner": alice}
    assert store.get(rid, bob) is None and store.get(rid, "") is None
    assert not store.delete(rid, bob)
    assert store.delete(rid, alice) and store.get(rid, alice) is None
    assert not store.delete(rid, alice)


def test_ids_that_are_not_ours_never_reach_the_disk(tmp_path: Path) -> None:
    store = ResponseStore(tmp_path / "r", ttl=60, max_bytes=1 << 20)
    (tmp_path / "secret.json").write_text('{"owner": ""}')
    for rid in ("../secret", "resp_../../secret", "resp_x", "RESP_" + "0" * 32):
        assert store.get(rid, "") is None and not store.delete(rid, "")
    with pytest.raises(ValueError):
        store.put("../secret", "", record())
    assert (tmp_path / "secret.json").exists()


def test_ttl(tmp_path: Path) -> None:
    clock = Clock()
    store = ResponseStore(tmp_path, ttl=60, max_bytes=1 << 20, clock=clock)
    old, new = new_id("resp"), new_id("resp")
    store.put(old, "", record())
    clock.now += 50
    store.put(new, "", record())
    clock.now += 11
    assert store.get(old, "") is None and not (tmp_path / f"{old}.json").exists()
    assert store.get(new, "") is not None


def test_size_cap_drops_the_oldest(tmp_path: Path) -> None:
    clock = Clock()
    one = len(b'{"response":{"text":"' + b"x" * 100 + b'"},"input_items":[],"conversation":[]')
    store = ResponseStore(tmp_path, ttl=1e9, max_bytes=3 * (one + 20), clock=clock)
    ids = [new_id("resp") for _ in range(5)]
    for rid in ids:
        clock.now += 1
        assert store.put(rid, "", record(100))
    kept = [rid for rid in ids if store.get(rid, "") is not None]
    assert kept == ids[-3:]
    assert store.stats()["bytes"] <= store.max_bytes
    assert sorted(p.stem for p in tmp_path.glob("resp_*.json")) == sorted(kept)
    # One entry above the whole cap is not stored (and pushes nothing out).
    big = new_id("resp")
    assert not store.put(big, "", record(10 * store.max_bytes))
    assert store.get(big, "") is None and store.stats()["entries"] == 3


def test_a_new_store_reads_what_the_last_one_wrote(tmp_path: Path) -> None:
    store = ResponseStore(tmp_path, ttl=3600, max_bytes=1 << 20)
    owner = store.owner_of("key-a")
    rid = new_id("resp")
    store.put(rid, owner, record())
    (tmp_path / ".tmp-resp_half.json-1234").write_bytes(b'{"half')  # a write cut off
    (tmp_path / f"{new_id('resp')}.json").write_bytes(b"not json")  # a broken file
    again = ResponseStore(tmp_path, ttl=3600, max_bytes=1 << 20)
    assert again.owner_of("key-a") == owner  # the owner secret is kept too
    assert again.get(rid, owner) is not None
    assert again.stats()["entries"] == 1
    assert not list(tmp_path.glob(".tmp-*"))
    assert oct(os.stat(tmp_path / f"{rid}.json").st_mode & 0o777) == "0o600"
