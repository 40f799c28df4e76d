"""The disk tier: entry files in ``kv_cache_dir``, capped by bytes, least recently used out.

Every runner (one per model) shares the directory; file names start with a hash of the
cache key, so a runner indexes only its own files but the byte cap (``kv_disk_max``)
covers the whole directory: when a write would pass it, the oldest files go first
(ours or another runner's; a runner whose file vanished just sees a miss).
Recency survives restarts as the file's mtime, refreshed on every hit.

Nothing here may crash the runner: a file that is corrupt, truncated, of another
version or another key is a miss and is removed; a failed write (disk full, read-only
directory) is skipped with a warning.
"""

from __future__ import annotations

import contextlib
import errno
import logging
import os
from collections import OrderedDict
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

from elbowroom.kvcache.fileformat import (
    FIXED_SIZE,
    Blob,
    FormatError,
    Header,
    check_payload,
    decode_header,
    encode_header,
    fixed_lengths,
)

log = logging.getLogger(__name__)

SUFFIX = ".kv"
TMP_SUFFIX = ".tmp"


@dataclass(frozen=True, slots=True)
class DiskEntry:
    eid: str
    tokens: tuple[int, ...]
    nbytes: int  # the file's size
    payload_bytes: int  # the state's size (what a restore copies)


@dataclass(frozen=True, slots=True)
class WriteResult:
    written: bool
    evicted: tuple[str, ...] = ()  # our entries removed to make room


class DiskTier:
    def __init__(
        self,
        directory: Path,
        cap: int,
        key: str,
        prefix: str,
        *,
        pid: int | None = None,
        pid_alive: Callable[[int], bool] | None = None,
    ) -> None:
        self.directory = directory
        self.cap = cap
        self._key = key
        self._prefix = prefix  # file-name prefix for this cache key
        self._pid = os.getpid() if pid is None else pid
        self._pid_alive = pid_alive or _pid_alive
        self._entries: OrderedDict[str, DiskEntry] = OrderedDict()  # oldest first
        self._bytes = 0
        self.enabled = cap > 0
        if self.enabled:
            try:
                directory.mkdir(parents=True, exist_ok=True)
            except OSError as exc:
                log.warning("KV disk tier off: cannot create %s: %s", directory, exc)
                self.enabled = False

    @property
    def nbytes(self) -> int:
        return self._bytes

    def __len__(self) -> int:
        return len(self._entries)

    def __contains__(self, eid: object) -> bool:
        return eid in self._entries

    def entries(self) -> list[DiskEntry]:
        return list(self._entries.values())

    def _path(self, eid: str) -> Path:
        return self.directory / f"{self._prefix}-{eid}{SUFFIX}"

    # ---- indexing ------------------------------------------------------------------------

    def scan(self) -> list[DiskEntry]:
        """Index our files (oldest first); remove invalid ones and stale temp files."""
        if not self.enabled:
            return []
        found: list[tuple[float, DiskEntry]] = []
        try:
            names = os.listdir(self.directory)
        except OSError as exc:
            log.warning("KV disk tier: cannot list %s: %s", self.directory, exc)
            return []
        for name in names:
            if not name.startswith(self._prefix + "-"):
                continue
            path = self.directory / name
            if name.endswith(TMP_SUFFIX):
                self._remove_stale_tmp(path)
                continue
            if not name.endswith(SUFFIX):
                continue
            eid = name[len(self._prefix) + 1 : -len(SUFFIX)]
            try:
                st = path.stat()
                header = self._read_header(path)
            except (OSError, FormatError) as exc:
                self._discard(path, str(exc))
                continue
            if header.key != self._key:
                self._discard(path, "cache key mismatch")
                continue
            if st.st_size != header.file_size:
                self._discard(path, f"size {st.st_size} != {header.file_size} (truncated)")
                continue
            entry = DiskEntry(eid, header.tokens, st.st_size, header.payload_len)
            found.append((st.st_mtime, entry))
        self._entries.clear()
        self._bytes = 0
        for _, entry in sorted(found, key=lambda f: f[0]):
            self._entries[entry.eid] = entry
            self._bytes += entry.nbytes
        return list(self._entries.values())

    def _read_header(self, path: Path) -> Header:
        with path.open("rb") as f:
            fixed = f.read(FIXED_SIZE)
            key_len, n_tokens = fixed_lengths(fixed)
            rest = f.read(key_len + 4 * n_tokens)
        return decode_header(fixed + rest)

    def _remove_stale_tmp(self, path: Path) -> None:
        # name: <prefix>-<eid>.kv.<pid>.tmp ; a live writer's temp file is left alone
        parts = path.name.split(".")
        try:
            pid = int(parts[-2])
        except (ValueError, IndexError):
            pid = -1
        if pid != self._pid and not self._pid_alive(pid):
            self._discard(path, "stale temp file")

    # ---- read / write --------------------------------------------------------------------

    def read(self, eid: str) -> bytearray | None:
        """The entry's state, verified; None (and the file removed) when it is unusable."""
        entry = self._entries.get(eid)
        if entry is None:
            return None
        path = self._path(eid)
        try:
            with path.open("rb") as f:
                fixed = f.read(FIXED_SIZE)
                key_len, n_tokens = fixed_lengths(fixed)
                header = decode_header(fixed + f.read(key_len + 4 * n_tokens))
                if header.key != self._key or header.tokens != entry.tokens:
                    raise FormatError("header does not match the index")
                payload = bytearray(header.payload_len)
                got = f.readinto(payload)
                check_payload(header, payload[:got] if got != len(payload) else payload)
                if f.read(1):
                    raise FormatError("trailing bytes after the payload")
        except (OSError, FormatError) as exc:
            self.remove(eid)
            self._discard(path, str(exc))
            return None
        self._entries.move_to_end(eid)
        with contextlib.suppress(OSError):
            os.utime(path)  # recency for the next scan and for other runners' eviction
        return payload

    def write(self, eid: str, tokens: tuple[int, ...], state: Blob) -> WriteResult:
        """Write atomically (temp file + rename), evicting LRU files to stay under the cap."""
        if not self.enabled:
            return WriteResult(False)
        header = encode_header(self._key, tokens, state)
        size = len(header) + len(state)
        if size > self.cap:
            return WriteResult(False)
        self.remove(eid)
        evicted = self._make_room(size)
        path = self._path(eid)
        tmp = path.with_name(f"{path.name}.{self._pid}{TMP_SUFFIX}")
        try:
            with tmp.open("wb") as f:
                f.write(header)
                f.write(state)
            # No fsync: a torn file after a power cut fails its checksum and is a miss.
            os.replace(tmp, path)
        except OSError as exc:
            with contextlib.suppress(OSError):
                tmp.unlink()
            why = "disk full" if exc.errno in (errno.ENOSPC, errno.EDQUOT) else "write failed"
            log.warning("KV disk tier: %s, entry not saved (%s): %s", why, path, exc)
            return WriteResult(False, evicted)
        self._entries[eid] = DiskEntry(eid, tokens, size, len(state))
        self._bytes += size
        return WriteResult(True, evicted)

    def remove(self, eid: str) -> bool:
        entry = self._entries.pop(eid, None)
        if entry is None:
            return False
        self._bytes -= entry.nbytes
        with contextlib.suppress(OSError):
            self._path(eid).unlink()
        return True

    def _make_room(self, size: int) -> tuple[str, ...]:
        """Delete least recently used files (the whole directory counts) until size fits."""
        foreign = self._foreign_files()
        total = self._bytes + sum(s for _, s, _ in foreign)
        evicted: list[str] = []
        while total + size > self.cap and (self._entries or foreign):
            own_oldest = next(iter(self._entries.values()), None)
            own_mtime = self._mtime(own_oldest.eid) if own_oldest else float("inf")
            if foreign and foreign[0][0] < own_mtime:
                _, fsize, fpath = foreign.pop(0)
                with contextlib.suppress(OSError):
                    fpath.unlink()
                total -= fsize
            elif own_oldest is not None:
                total -= own_oldest.nbytes
                self.remove(own_oldest.eid)
                evicted.append(own_oldest.eid)
            else:
                break
        return tuple(evicted)

    def _foreign_files(self) -> list[tuple[float, int, Path]]:
        """Other runners' entry files, oldest first: (mtime, size, path)."""
        out: list[tuple[float, int, Path]] = []
        try:
            with os.scandir(self.directory) as it:
                for de in it:
                    if de.name.endswith(SUFFIX) and not de.name.startswith(self._prefix + "-"):
                        with contextlib.suppress(OSError):
                            st = de.stat()
                            out.append((st.st_mtime, st.st_size, Path(de.path)))
        except OSError:
            return []
        out.sort(key=lambda f: f[0])
        return out

    def _mtime(self, eid: str) -> float:
        try:
            return self._path(eid).stat().st_mtime
        except OSError:
            return float("-inf")  # gone already: evict it first

    def _discard(self, path: Path, why: str) -> None:
        log.warning("KV disk tier: removing %s: %s", path.name, why)
        with contextlib.suppress(OSError):
            path.unlink()


def _pid_alive(pid: int) -> bool:
    if pid <= 0:
        return False
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True
