"""PrefixCache: the facade the LLM engine talks to (RAM tier -> disk tier, one index).

    lookup(tokens, live)  -> Hit | None   the best cached prefix worth restoring
    restore(hit, apply)   -> bool          fetch the state, hand it to ``apply``, learn speed
    store(tokens, state, text) -> bool     after a request: the context's tokens + its state
    known_text(prompt)    -> (text, tokens) the longest stored prompt text ``prompt`` extends
    set_ram_budget(bytes)                  a new grant; what no longer fits spills to disk
    flush()                                RAM tier -> disk (graceful unload)
    stats()                                counters for /api/ps

Every entry lives in exactly one tier. An entry whose tokens are a prefix of a newer one's
is superseded (the newer state restores the older prefix too, by trimming), so a growing
conversation holds one entry, not one per turn. The engine owns the llama.cpp calls; this
module only sees token lists and opaque state bytes, so it is tested without a model.
Thread-safe: the runner answers stats from its reader thread while a request runs.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import os
import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass, replace
from pathlib import Path
from typing import Any

from elbowroom.kvcache.blocks import (
    BlockIndex,
    chain_hashes,
    common_prefix,
    entry_id,
    seed_hash,
)
from elbowroom.kvcache.cost import CostModel, Tier
from elbowroom.kvcache.disk import DiskTier, write_all
from elbowroom.kvcache.fileformat import Blob
from elbowroom.kvcache.ram import RamEntry, RamTier

Clock = Callable[[], float]


@dataclass(frozen=True, slots=True)
class CacheKey:
    """What makes a saved state loadable: the same weights, context shape and engine."""

    model: str  # ModelSpec.identity: path, size, mtime of the weights
    n_ctx: int
    kv_type: str
    engine: str = ""  # library version and flags that change the state layout

    def text(self) -> str:
        return json.dumps(asdict(self), sort_keys=True)

    def file_prefix(self) -> str:
        return hashlib.blake2b(self.text().encode(), digest_size=8).hexdigest()


@dataclass(frozen=True, slots=True)
class Hit:
    eid: str
    tier: Tier
    n_tokens: int  # restore, then keep this many tokens (<= len(prompt) - 1)
    entry_tokens: int  # tokens the stored state holds
    nbytes: int  # bytes a restore copies


@dataclass(frozen=True, slots=True)
class _Meta:
    tokens: tuple[int, ...]
    hashes: tuple[bytes, ...]
    tier: Tier
    nbytes: int
    text: str = ""  # the rendered prompt the tokens came from ("": not known)


@dataclass(slots=True)
class _Counters:
    hits_ram: int = 0
    hits_disk: int = 0
    misses: int = 0
    restored: int = 0
    recomputed: int = 0
    tokens_restored: int = 0
    spilled: int = 0
    dropped: int = 0


def budget_for_level(level: int, ram_max: int) -> int:
    """The RAM tier's grant at a pressure level: 0 normal, 1 soft (a quarter), 2 hard (none)."""
    if level >= 2:
        return 0
    if level == 1:
        return ram_max // 4
    return ram_max


class PrefixCache:
    def __init__(
        self,
        key: CacheKey,
        *,
        block_tokens: int = 64,
        ram_budget: int = 512 * 1024**2,
        disk_dir: Path | None = None,
        disk_max: int = 4 * 1024**3,
        cost: CostModel | None = None,
        clock: Clock = time.perf_counter,
        window: int = 0,
    ) -> None:
        if block_tokens < 1:
            raise ValueError(f"kv_block_tokens must be >= 1, not {block_tokens}")
        self.key = key
        self.block_tokens = block_tokens
        # Sliding-window attention (e.g. gemma3): a state longer than the window holds only
        # the window's last positions for those layers, so it can be extended but not trimmed.
        self.window = window
        self._seed = seed_hash(key.text())
        self._ram = RamTier(ram_budget)
        self._disk = (
            DiskTier(disk_dir, disk_max, key.text(), key.file_prefix())
            if disk_dir is not None and disk_max > 0
            else None
        )
        self._cost = cost or CostModel()
        self._clock = clock
        self._index = BlockIndex()
        self._meta: dict[str, _Meta] = {}
        self._n = _Counters()
        self._lock = threading.RLock()
        if self._disk is not None:
            for d in self._disk.scan():
                self._add_meta(d.eid, d.tokens, Tier.DISK, d.payload_bytes, d.text)

    # ---- lookups and restores ---------------------------------------------------------------

    def lookup(self, tokens: Sequence[int], live: int = 0) -> Hit | None:
        """The cached prefix of ``tokens`` worth restoring over what the context holds.

        ``live`` is how many leading tokens the context already holds; a hit must beat it,
        and restoring must be estimated cheaper than prefilling the tokens it saves.
        """
        with self._lock:
            prompt = tuple(tokens)
            hashes = chain_hashes(prompt, self.block_tokens, self._seed)
            depth, candidates = self._index.deepest(hashes)
            best: tuple[int, bool, str] | None = None
            for eid in candidates:
                meta = self._meta[eid]
                matched = common_prefix(meta.tokens, prompt)
                if matched < depth * self.block_tokens:
                    continue  # a hash collision: tokens decide
                usable = min(matched, len(prompt) - 1)
                if self.window and len(meta.tokens) > self.window and usable < len(meta.tokens):
                    continue  # would need a trim the sliding window no longer allows
                rank = (usable, meta.tier is Tier.RAM, eid)
                if best is None or rank > best:
                    best = rank
            if best is None:
                self._n.misses += 1
                return None
            usable, _, eid = best
            if usable <= live:
                return None  # the context already holds as much: nothing to restore
            meta = self._meta[eid]
            if not self._cost.estimate(meta.tier, meta.nbytes, usable - live).restore:
                self._n.recomputed += 1
                return None
            return Hit(eid, meta.tier, usable, len(meta.tokens), meta.nbytes)

    def restore(self, hit: Hit, apply: Callable[[Blob], bool]) -> bool:
        """Fetch the hit's state and ``apply`` it to the context (True on success).

        The time of fetch + apply teaches the cost model the tier's bandwidth. A state that
        cannot be read or applied is dropped and counts as a miss.
        """
        with self._lock:
            start = self._clock()
            state = self._fetch(hit)
            return self._restored(hit, start, state is not None and apply(state))

    def restore_file(self, hit: Hit, dest: Path, apply: Callable[[], bool]) -> bool:
        """Like ``restore``, for an engine that reads states from files: the hit's state is
        put at ``dest`` (a disk entry is verified and linked there, never read into this
        process nor copied), then ``apply()`` loads it into the context."""
        with self._lock:
            start = self._clock()
            return self._restored(hit, start, self._put(hit, dest) and apply())

    def _put(self, hit: Hit, dest: Path) -> bool:
        meta = self._meta.get(hit.eid)
        if meta is None:
            return False
        if meta.tier is Tier.DISK:
            return self._disk is not None and self._disk.link_to(hit.eid, dest)
        entry = self._ram.get(hit.eid)
        if entry is None:
            return False
        with contextlib.suppress(FileNotFoundError):
            dest.unlink()
        fd = os.open(dest, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW, 0o600)
        try:
            write_all(fd, entry.state)
        finally:
            os.close(fd)
        return True

    def _restored(self, hit: Hit, start: float, ok: bool) -> bool:
        """Count a restore's outcome; a failed one drops the entry (a miss)."""
        elapsed = self._clock() - start
        if not ok:
            self._forget(hit.eid)
            self._n.misses += 1
            return False
        self._cost.observe_restore(hit.tier, hit.nbytes, elapsed)
        if hit.tier is Tier.RAM:
            self._n.hits_ram += 1
        else:
            self._n.hits_disk += 1
        self._n.restored += 1
        self._n.tokens_restored += hit.n_tokens
        return True

    def _fetch(self, hit: Hit) -> Blob | None:
        meta = self._meta.get(hit.eid)
        if meta is None:
            return None
        if meta.tier is Tier.RAM:
            entry = self._ram.get(hit.eid)
            return entry.state if entry is not None else None
        return self._disk.read(hit.eid) if self._disk is not None else None

    def observe_prefill(self, n_tokens: int, seconds: float) -> None:
        with self._lock:
            self._cost.observe_prefill(n_tokens, seconds)

    # ---- storing -----------------------------------------------------------------------

    def wants(self, tokens: Sequence[int]) -> bool:
        """Cheap pre-check before the engine copies a state out of the context."""
        if len(tokens) < self.block_tokens:
            return False
        with self._lock:
            return self._covering(tuple(tokens)) is None

    def store(self, tokens: Sequence[int], state: Blob, text: str = "") -> bool:
        """Keep ``state`` (the context holding exactly ``tokens``); False if not kept.
        ``text``: the rendered prompt the tokens were made from, if known (``known_text``)."""
        toks = tuple(tokens)
        if len(toks) < self.block_tokens or not state:
            return False
        with self._lock:
            covering = self._covering(toks)
            if covering is not None:
                self._touch(covering)  # a longer entry already restores this prefix
                return False
            # Nothing covers toks, so every related entry that is a prefix of it is shorter:
            # superseded by the newer state, which restores that prefix too (by trimming).
            for old in self._related(chain_hashes(toks, self.block_tokens, self._seed)):
                if _is_prefix(self._meta[old].tokens, toks):
                    self._forget(old)
            eid = entry_id(toks, self._seed)
            self._add_meta(eid, toks, Tier.RAM, len(state), text)
            self._spill(self._ram.put(RamEntry(eid, toks, state)))
            return eid in self._meta

    def known_text(self, prompt: str) -> tuple[str, tuple[int, ...]]:
        """The longest stored prompt text that ``prompt`` begins with, and the tokens it
        was stored with (``("", ())`` when none): a caller tokenizes only the rest."""
        best: tuple[str, tuple[int, ...]] = ("", ())
        with self._lock:
            for meta in self._meta.values():
                text = meta.text
                if len(text) > len(best[0]) and prompt.startswith(text):
                    best = (text, meta.tokens)
        return best

    def _related(self, hashes: Sequence[bytes]) -> set[str]:
        """Entries sharing at least the first block with these hashes."""
        if not hashes:
            return set()
        _, first = self._index.deepest(hashes[:1])
        return set(first)

    def _covering(self, toks: tuple[int, ...]) -> str | None:
        """An entry whose tokens start with ``toks`` (equal or longer), if any."""
        hashes = chain_hashes(toks, self.block_tokens, self._seed)
        for eid in self._related(hashes):
            if _is_prefix(toks, self._meta[eid].tokens):
                return eid
        return None

    def _touch(self, eid: str) -> None:
        if self._meta[eid].tier is Tier.RAM:
            self._ram.get(eid)

    # ---- budget, flush -----------------------------------------------------------------

    def set_ram_budget(self, nbytes: int) -> None:
        """A new grant for the RAM tier: what no longer fits spills to disk (else is dropped)."""
        with self._lock:
            self._spill(self._ram.set_budget(max(0, nbytes)))

    def flush(self) -> None:
        """Move every RAM entry to the disk tier (graceful unload); the grant is kept."""
        with self._lock:
            self._spill(self._ram.drain())

    def close(self) -> None:
        self.flush()

    def _spill(self, evicted: list[RamEntry]) -> None:
        for entry in evicted:
            if self._disk is not None:
                meta = self._meta[entry.eid]
                result = self._disk.write(entry.eid, entry.tokens, entry.state, meta.text)
                for gone in result.evicted:
                    self._drop_meta(gone)
                if result.written:
                    self._meta[entry.eid] = replace(meta, tier=Tier.DISK, nbytes=entry.nbytes)
                    self._n.spilled += 1
                    continue
            self._drop_meta(entry.eid)
            self._n.dropped += 1

    # ---- bookkeeping -------------------------------------------------------------------

    def _add_meta(
        self, eid: str, tokens: tuple[int, ...], tier: Tier, nbytes: int, text: str = ""
    ) -> None:
        hashes = chain_hashes(tokens, self.block_tokens, self._seed)
        self._meta[eid] = _Meta(tokens, hashes, tier, nbytes, text)
        self._index.add(eid, hashes)

    def _drop_meta(self, eid: str) -> None:
        meta = self._meta.pop(eid, None)
        if meta is not None:
            self._index.remove(eid, meta.hashes)

    def _forget(self, eid: str) -> None:
        """Remove an entry from whichever tier holds it."""
        meta = self._meta.get(eid)
        if meta is None:
            return
        if meta.tier is Tier.RAM:
            self._ram.pop(eid)
        elif self._disk is not None:
            self._disk.remove(eid)
        self._drop_meta(eid)

    def stats(self) -> dict[str, Any]:
        with self._lock:
            disk = self._disk
            return {
                "entries_ram": len(self._ram),
                "entries_disk": len(disk) if disk is not None else 0,
                "bytes_ram": self._ram.nbytes,
                "bytes_disk": disk.nbytes if disk is not None else 0,
                "hits_ram": self._n.hits_ram,
                "hits_disk": self._n.hits_disk,
                "misses": self._n.misses,
                "restored": self._n.restored,
                "recomputed": self._n.recomputed,
                "ram_budget": self._ram.budget,
                "disk_max": disk.cap if disk is not None else 0,
                "tokens_restored": self._n.tokens_restored,
                "spilled": self._n.spilled,
                "dropped": self._n.dropped,
                "block_tokens": self.block_tokens,
                # The same hits keyed by tier, the shape /metrics reads.
                "hits": {"ram": self._n.hits_ram, "disk": self._n.hits_disk},
                **self._cost.snapshot(),
            }


def _is_prefix(short: tuple[int, ...], long: tuple[int, ...]) -> bool:
    return len(short) <= len(long) and long[: len(short)] == short
