"""The hash chain and block index: equal prefixes find each other, different ones never do."""

from __future__ import annotations

import random

from elbowroom.kvcache.blocks import (
    BlockIndex,
    chain_hashes,
    common_prefix,
    entry_id,
    seed_hash,
)

SEED = seed_hash("model-a")


def test_only_full_blocks_are_hashed() -> None:
    assert len(chain_hashes(list(range(10)), 4, SEED)) == 2
    assert chain_hashes([1, 2, 3], 4, SEED) == ()


def test_hash_covers_parent_not_just_the_block() -> None:
    a = chain_hashes([1, 1, 1, 1, 9, 9, 9, 9], 4, SEED)
    b = chain_hashes([2, 2, 2, 2, 9, 9, 9, 9], 4, SEED)
    assert a[0] != b[0]
    assert a[1] != b[1]  # same second block, different history


def test_shared_prefix_shares_hashes() -> None:
    a = chain_hashes([5, 6, 7, 8, 1, 2, 3, 4], 4, SEED)
    b = chain_hashes([5, 6, 7, 8, 4, 3, 2, 1], 4, SEED)
    assert a[0] == b[0] and a[1] != b[1]


def test_seed_separates_keys() -> None:
    toks = list(range(8))
    assert chain_hashes(toks, 4, SEED) != chain_hashes(toks, 4, seed_hash("model-b"))
    assert entry_id(toks, SEED) != entry_id(toks, seed_hash("model-b"))


def test_entry_id_covers_the_partial_tail() -> None:
    assert entry_id([1, 2, 3, 4, 5], SEED) != entry_id([1, 2, 3, 4, 6], SEED)


def test_common_prefix_matches_a_plain_loop() -> None:
    rng = random.Random(7)
    for _ in range(200):
        a = [rng.randrange(3) for _ in range(rng.randrange(0, 40))]
        b = [rng.randrange(3) for _ in range(rng.randrange(0, 40))]
        n = 0
        while n < min(len(a), len(b)) and a[n] == b[n]:
            n += 1
        assert common_prefix(a, b) == n
        assert common_prefix(a, a) == len(a)


def test_index_finds_the_deepest_shared_block() -> None:
    idx = BlockIndex()
    short = chain_hashes(list(range(8)), 4, SEED)
    long = chain_hashes(list(range(16)), 4, SEED)
    idx.add("short", short)
    idx.add("long", long)
    prompt = chain_hashes([*range(12), 99, 99, 99, 99], 4, SEED)
    depth, ids = idx.deepest(prompt)
    assert depth == 3
    assert ids == {"long"}
    assert idx.deepest(chain_hashes([9, 9, 9, 9], 4, SEED)) == (0, frozenset())


def test_index_remove_forgets_and_cleans_up() -> None:
    idx = BlockIndex()
    hashes = chain_hashes(list(range(8)), 4, SEED)
    idx.add("a", hashes)
    idx.add("b", hashes[:1])
    idx.remove("a", hashes)
    assert idx.deepest(hashes) == (1, frozenset({"b"}))
    idx.remove("b", hashes[:1])
    assert len(idx) == 0


def test_common_prefix_of_a_list_and_a_tuple() -> None:
    assert common_prefix([1, 2, 3], (1, 2, 4)) == 2
