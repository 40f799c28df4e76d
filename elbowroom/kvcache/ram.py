"""The RAM tier: sequence states in process memory, least recently used first out.

Its byte size is a grant (``kv_ram_max``); the tier never holds more than the grant. The
MLX engine's RAM tier is this one, and it lowers the grant under memory pressure
(``cache.budget_for_level``: a quarter at soft, none at hard). The llama.cpp engine keeps
no entries here (``ram_budget=0``): its RAM tier is the engine's own prompt cache, a grant
fixed at load (docs/kvcache.md). What falls out is handed back to the caller, who spills it to
the disk tier or drops it: this module touches nothing outside itself.
"""

from __future__ import annotations

from collections import OrderedDict
from dataclasses import dataclass

from elbowroom.kvcache.fileformat import Blob


@dataclass(frozen=True, slots=True)
class RamEntry:
    eid: str
    tokens: tuple[int, ...]
    state: Blob  # never mutated: a bytearray only spares a copy out of llama.cpp

    @property
    def nbytes(self) -> int:
        return len(self.state)


class RamTier:
    def __init__(self, budget: int) -> None:
        if budget < 0:
            raise ValueError(f"RAM tier budget must be >= 0, not {budget}")
        self._budget = budget
        self._bytes = 0
        # Oldest first: popitem(last=False) is the LRU victim.
        self._entries: OrderedDict[str, RamEntry] = OrderedDict()

    @property
    def budget(self) -> int:
        return self._budget

    @property
    def nbytes(self) -> int:
        return self._bytes

    def __len__(self) -> int:
        return len(self._entries)

    def __contains__(self, eid: object) -> bool:
        return eid in self._entries

    def get(self, eid: str) -> RamEntry | None:
        """The entry, now most recently used; None if absent."""
        entry = self._entries.get(eid)
        if entry is not None:
            self._entries.move_to_end(eid)
        return entry

    def fits(self, nbytes: int) -> bool:
        """Whether an entry this big can ever live here under the current grant."""
        return nbytes <= self._budget

    def put(self, entry: RamEntry) -> list[RamEntry]:
        """Insert (or refresh) an entry; returns the entries evicted to make room.

        An entry bigger than the whole grant is not stored: it comes back as evicted.
        """
        old = self._entries.pop(entry.eid, None)
        if old is not None:
            self._bytes -= old.nbytes
        if not self.fits(entry.nbytes):
            return [entry]
        evicted = self._evict_until(self._budget - entry.nbytes)
        self._entries[entry.eid] = entry
        self._bytes += entry.nbytes
        return evicted

    def pop(self, eid: str) -> RamEntry | None:
        entry = self._entries.pop(eid, None)
        if entry is not None:
            self._bytes -= entry.nbytes
        return entry

    def set_budget(self, budget: int) -> list[RamEntry]:
        """Change the grant; returns what no longer fits, least recently used first."""
        if budget < 0:
            raise ValueError(f"RAM tier budget must be >= 0, not {budget}")
        self._budget = budget
        return self._evict_until(budget)

    def drain(self) -> list[RamEntry]:
        """Remove everything, least recently used first (for a flush to disk)."""
        return self._evict_until(0)

    def _evict_until(self, limit: int) -> list[RamEntry]:
        evicted: list[RamEntry] = []
        while self._entries and self._bytes > limit:
            _, entry = self._entries.popitem(last=False)
            self._bytes -= entry.nbytes
            evicted.append(entry)
        return evicted
