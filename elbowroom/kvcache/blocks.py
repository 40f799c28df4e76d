"""Hash chain over fixed-size token blocks, and the index that finds cached prefixes.

Block ``i``'s hash covers its parent's hash and its own tokens, so equal hashes at depth
``i`` mean (up to a 128-bit collision, which lookups still rule out by comparing tokens)
equal first ``i`` blocks. The chain starts from a seed derived from the cache key, so
states of different models or context shapes can never be confused with each other.
Only full blocks are hashed; the tokens after the last full block still count once an
entry is found, because a hit is measured by comparing token lists.
"""

from __future__ import annotations

import array
import hashlib
from collections.abc import Iterable, Sequence

HASH_BYTES = 16


def seed_hash(key: str) -> bytes:
    """The chain's root: depends on the cache key only."""
    return hashlib.blake2b(key.encode(), digest_size=HASH_BYTES).digest()


def _token_bytes(tokens: Sequence[int]) -> bytes:
    return array.array("i", tokens).tobytes()


def chain_hashes(tokens: Sequence[int], block_tokens: int, seed: bytes) -> tuple[bytes, ...]:
    """One hash per full block: h[i] = H(h[i-1] || tokens of block i)."""
    if block_tokens < 1:
        raise ValueError(f"block_tokens must be >= 1, not {block_tokens}")
    out: list[bytes] = []
    parent = seed
    for start in range(0, len(tokens) - block_tokens + 1, block_tokens):
        h = hashlib.blake2b(parent, digest_size=HASH_BYTES)
        h.update(_token_bytes(tokens[start : start + block_tokens]))
        parent = h.digest()
        out.append(parent)
    return tuple(out)


def entry_id(tokens: Sequence[int], seed: bytes) -> str:
    """A stable name for an entry: its whole token list (not only full blocks) under the key."""
    h = hashlib.blake2b(seed, digest_size=HASH_BYTES)
    h.update(_token_bytes(tokens))
    return h.hexdigest()


def common_prefix(a: Sequence[int], b: Sequence[int]) -> int:
    """Length of the longest common prefix, by binary search over C-speed slice compares."""
    if type(a) is not type(b):  # a list slice never equals a tuple slice
        a, b = tuple(a), tuple(b)
    lo, hi = 0, min(len(a), len(b))
    if a[:hi] == b[:hi]:
        return hi
    # invariant: a[:lo] == b[:lo] and a[:hi] != b[:hi]
    while hi - lo > 1:
        mid = (lo + hi) // 2
        if a[:mid] == b[:mid]:
            lo = mid
        else:
            hi = mid
    return lo


class BlockIndex:
    """block hash -> ids of the entries whose chain contains it (at its fixed depth)."""

    def __init__(self) -> None:
        self._by_hash: dict[bytes, set[str]] = {}

    def __len__(self) -> int:
        return len(self._by_hash)

    def add(self, eid: str, hashes: Iterable[bytes]) -> None:
        for h in hashes:
            self._by_hash.setdefault(h, set()).add(eid)

    def remove(self, eid: str, hashes: Iterable[bytes]) -> None:
        for h in hashes:
            ids = self._by_hash.get(h)
            if ids is None:
                continue
            ids.discard(eid)
            if not ids:
                del self._by_hash[h]

    def deepest(self, hashes: Sequence[bytes]) -> tuple[int, frozenset[str]]:
        """How many leading blocks of a prompt some entry shares, and the entries at that depth.

        A chain hash at depth d implies the same hashes at depths < d, so walking forward
        until the first unknown hash finds the longest shared block prefix.
        """
        depth = 0
        found: set[str] = set()
        for h in hashes:
            ids = self._by_hash.get(h)
            if not ids:
                break
            depth += 1
            found = ids
        return depth, frozenset(found)
