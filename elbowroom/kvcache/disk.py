"""The disk tier: entry files in ``kv_cache_dir``, capped by bytes, least recently used out.

Every runner (one per model) shares the directory; file names start with a hash of the
cache key, so a runner indexes only its own files but the byte cap (``kv_disk_max``)
covers the whole directory: when a write would pass it, the oldest files go first
(ours or another runner's; a runner whose file vanished just sees a miss).
Recency survives restarts as the file's mtime, refreshed on every hit.

Nothing here may crash the runner: a file that is corrupt, truncated, of another
version or another key is a miss and is removed; a failed write (disk full, read-only
directory) is skipped with a warning.

The files hold every cached conversation's tokens, so (docs/security.md): the directory
is ``0700`` (tightened if it is ours and looser; another user's directory turns the tier
off), files are ``0600``, temporary files are created with ``O_CREAT | O_EXCL |
O_NOFOLLOW`` (a planted symlink or file is never written through), every open is
``O_NOFOLLOW | O_NONBLOCK`` and must find a regular file (a planted FIFO cannot hang the
runner), and only regular files of ours that carry the format's magic (or begin like the
engine's slot files) are ever deleted (``_ours``): eviction and clean-up leave anything
else alone. A payload length
above the tier's cap or the file's size is corrupt before anything is allocated for it.

A restore hands the engine a symlink to the verified entry (``link_to``): the entry file
starts with the engine's own slot file (fileformat.py), so nothing is copied.
"""

from __future__ import annotations

import contextlib
import errno
import logging
import mmap
import os
import stat
from collections import OrderedDict
from collections.abc import Callable
from dataclasses import dataclass
from io import BufferedReader
from pathlib import Path
from typing import TypeVar

from elbowroom.kvcache.fileformat import (
    ENGINE_MAGIC,
    FIXED_SIZE,
    MAGIC,
    TAIL_SIZE,
    Blob,
    FormatError,
    Header,
    check_payload,
    decode_trailer,
    encode_trailer,
    trailer_length,
)

log = logging.getLogger(__name__)
_T = TypeVar("_T")

SUFFIX = ".kv"
TMP_SUFFIX = ".tmp"
DIR_MODE = 0o700
FILE_MODE = 0o600
_READ_FLAGS = os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK | getattr(os, "O_CLOEXEC", 0)
_CREATE_FLAGS = os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | getattr(os, "O_CLOEXEC", 0)


@dataclass(frozen=True, slots=True)
class DiskEntry:
    eid: str
    tokens: tuple[int, ...]
    nbytes: int  # the file's size
    payload_bytes: int  # the state's size (what a restore hands the engine)
    text: str = ""  # the rendered prompt the tokens came from ("": not recorded)


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
        self.enabled = cap > 0 and self._secure_directory()

    def _secure_directory(self) -> bool:
        """Create the directory 0700, or check that an existing one is ours and private."""
        directory = self.directory
        try:
            directory.mkdir(parents=True, exist_ok=True, mode=DIR_MODE)
            st = os.stat(directory)
            if st.st_uid != os.geteuid():
                log.warning(
                    "KV disk tier off: %s belongs to uid %d, not to us: its files could be "
                    "read or planted by another user",
                    directory,
                    st.st_uid,
                )
                return False
            if stat.S_IMODE(st.st_mode) & 0o077:
                os.chmod(directory, DIR_MODE)
                log.info("KV disk tier: %s was readable by others; now 0700", directory)
        except OSError as exc:
            log.warning("KV disk tier off: cannot create %s: %s", directory, exc)
            return False
        return True

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
                with _open_regular(path) as f:
                    st = os.fstat(f.fileno())
                    header = self._read_trailer(f, st.st_size)
            except (OSError, FormatError) as exc:
                self._discard(path, str(exc))
                continue
            if header.key != self._key:
                self._discard(path, "cache key mismatch")
                continue
            entry = DiskEntry(eid, header.tokens, st.st_size, header.payload_len, header.text)
            found.append((st.st_mtime, entry))
        self._entries.clear()
        self._bytes = 0
        for _, entry in sorted(found, key=lambda f: f[0]):
            self._entries[entry.eid] = entry
            self._bytes += entry.nbytes
        return list(self._entries.values())

    def _read_trailer(self, f: BufferedReader, size: int) -> Header:
        """The trailer of the open entry file of ``size`` bytes, checked against that size
        (a file cut short or grown is corrupt) and the tier's cap."""
        if size < FIXED_SIZE:
            raise FormatError("truncated trailer")
        tail = min(size, TAIL_SIZE)
        f.seek(size - tail)
        length = trailer_length(f.read(tail))
        if length > size:
            raise FormatError("truncated trailer")
        f.seek(size - length)
        header = decode_trailer(f.read(length))
        if header.payload_len > self.cap:
            raise FormatError(f"payload of {header.payload_len} bytes is over the cap")
        if header.file_size != size:
            raise FormatError(f"size {size} != {header.file_size} (truncated?)")
        return header

    def _remove_stale_tmp(self, path: Path) -> None:
        # name: <prefix>-<eid>.kv.<pid>.tmp ; a live writer's temp file is left alone
        parts = path.name.split(".")
        try:
            pid = int(parts[-2])
        except (ValueError, IndexError):
            pid = -1
        if pid != self._pid and not self._pid_alive(pid):
            self._discard(path, "stale temp file", empty_ok=True)

    # ---- read / write --------------------------------------------------------------------

    def read(self, eid: str) -> bytearray | None:
        """The entry's state, verified; None (and the file removed) when it is unusable."""
        return self._use(eid, _read_payload)

    def link_to(self, eid: str, dest: Path) -> bool:
        """Verify the entry and make ``dest`` a symlink to it, for the engine to restore
        from: the entry starts with the engine's slot file and the engine ignores the
        trailer after it. The checksum is taken over a memory map of the page cache; no
        byte of the state passes through this process or is copied (a copy took ~45 ms of
        a 52 MiB restore here). False (and the file removed) when the entry is unusable,
        like ``read``. ``dest`` is in the engine's private directory; whatever was left
        there is replaced."""
        if self._use(eid, _verify_mapped) is None:
            return False
        with contextlib.suppress(FileNotFoundError):
            dest.unlink()
        dest.symlink_to(self._path(eid).absolute())  # kv_cache_dir may be relative
        return True

    def _use(self, eid: str, fn: Callable[[BufferedReader, Header], _T]) -> _T | None:
        """``fn`` on the entry's open file once its trailer matches the index and its size;
        None (and the file removed) when anything about it is wrong."""
        entry = self._entries.get(eid)
        if entry is None:
            return None
        path = self._path(eid)
        try:
            with _open_regular(path) as f:
                header = self._read_trailer(f, os.fstat(f.fileno()).st_size)
                if header.key != self._key or header.tokens != entry.tokens:
                    raise FormatError("trailer does not match the index")
                out = fn(f, header)
        except (OSError, FormatError, ValueError) as exc:
            self.remove(eid)
            self._discard(path, str(exc))
            return None
        self._entries.move_to_end(eid)
        with contextlib.suppress(OSError):
            os.utime(path)  # recency for the next scan and for other runners' eviction
        return out

    def write(self, eid: str, tokens: tuple[int, ...], state: Blob, text: str = "") -> WriteResult:
        """Write atomically (temp file + rename), evicting LRU files to stay under the cap.
        ``text``: the rendered prompt ``tokens`` came from ("": not known)."""
        if not self.enabled:
            return WriteResult(False)
        trailer = encode_trailer(self._key, tokens, state, text)
        size = len(state) + len(trailer)
        if size > self.cap:
            return WriteResult(False)
        self.remove(eid)
        evicted = self._make_room(size)
        path = self._path(eid)
        tmp = path.with_name(f"{path.name}.{self._pid}{TMP_SUFFIX}")
        created = False
        try:
            fd = self._create(tmp)
            created = True
            with os.fdopen(fd, "wb") as f:
                # The trailer first: a temp file of a writer that dies mid-write ends with
                # the magic, so a later clean-up knows it as ours (``_ours``).
                f.seek(len(state))
                f.write(trailer)
                f.seek(0)
                f.write(state)
            # No fsync: a torn file after a power cut fails its checksum and is a miss.
            # rename() replaces whatever is at ``path`` (even a symlink) without following it.
            os.replace(tmp, path)
        except OSError as exc:
            if created:
                with contextlib.suppress(OSError):
                    tmp.unlink()
            why = "disk full" if exc.errno in (errno.ENOSPC, errno.EDQUOT) else "write failed"
            log.warning("KV disk tier: %s, entry not saved (%s): %s", why, path, exc)
            return WriteResult(False, evicted)
        self._entries[eid] = DiskEntry(eid, tokens, size, len(state), text)
        self._bytes += size
        return WriteResult(True, evicted)

    def _create(self, tmp: Path) -> int:
        """A new private temp file; a leftover of ours (same pid: a crash earlier) goes
        first, anything else at that name is not touched and the write fails."""
        try:
            return os.open(tmp, _CREATE_FLAGS, FILE_MODE)
        except FileExistsError:
            if not _ours(tmp, empty_ok=True):
                raise
            tmp.unlink()
            return os.open(tmp, _CREATE_FLAGS, FILE_MODE)

    def remove(self, eid: str) -> bool:
        entry = self._entries.pop(eid, None)
        if entry is None:
            return False
        self._bytes -= entry.nbytes
        path = self._path(eid)
        if _ours(path):
            with contextlib.suppress(OSError):
                path.unlink()
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
                if _ours(fpath):
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
        """Other runners' entry files, oldest first: (mtime, size, path). Only regular
        files with our magic count: anything else in the directory is not ours to evict."""
        out: list[tuple[float, int, Path]] = []
        try:
            with os.scandir(self.directory) as it:
                for de in it:
                    if (
                        de.name.endswith(SUFFIX)
                        and not de.name.startswith(self._prefix + "-")
                        and de.is_file(follow_symlinks=False)
                        and _ours(Path(de.path))
                    ):
                        with contextlib.suppress(OSError):
                            st = de.stat(follow_symlinks=False)
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

    def _discard(self, path: Path, why: str, *, empty_ok: bool = False) -> None:
        if not _ours(path, empty_ok=empty_ok):
            log.warning("KV disk tier: ignoring %s (%s): not an entry file of ours", path.name, why)
            return
        log.warning("KV disk tier: removing %s: %s", path.name, why)
        with contextlib.suppress(OSError):
            path.unlink()


def _read_payload(f: BufferedReader, header: Header) -> bytearray:
    payload = bytearray(header.payload_len)
    f.seek(0)
    got = f.readinto(payload)
    check_payload(header, payload[:got] if got != len(payload) else payload)
    return payload


def _verify_mapped(f: BufferedReader, header: Header) -> bool:
    if header.payload_len == 0:
        raise FormatError("empty payload")
    with (
        mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ) as mapped,
        memoryview(mapped) as view,
        view[: header.payload_len] as payload,
    ):
        check_payload(header, payload)
    return True


def write_all(fd: int, data: Blob) -> None:
    """All of ``data`` onto ``fd`` (os.write may write less than asked)."""
    view = memoryview(data)
    while view:
        view = view[os.write(fd, view) :]


def _open_regular(path: Path) -> BufferedReader:
    """Open for reading without following a symlink or blocking on a FIFO; a regular file
    only (anything else raises FormatError, which callers treat as a miss)."""
    fd = os.open(path, _READ_FLAGS)
    try:
        if not stat.S_ISREG(os.fstat(fd).st_mode):
            raise FormatError("not a regular file")
        return os.fdopen(fd, "rb")
    except BaseException:
        os.close(fd)
        raise


def _ours(path: Path, *, empty_ok: bool = False) -> bool:
    """A regular file owned by us that ends with the format's magic, or starts with it (a
    version 1 file) or with the engine's (an entry whose trailer was cut off), or, with
    ``empty_ok``, is empty (a temp file whose writer died before writing): the only files
    this tier ever deletes."""
    try:
        fd = os.open(path, _READ_FLAGS)
    except OSError:
        return False
    try:
        st = os.fstat(fd)
        if not stat.S_ISREG(st.st_mode) or st.st_uid != os.geteuid():
            return False
        head = os.read(fd, len(MAGIC))
        tail = os.pread(fd, len(MAGIC), max(0, st.st_size - len(MAGIC)))
    except OSError:
        return False
    finally:
        os.close(fd)
    return MAGIC in (head, tail) or head.startswith(ENGINE_MAGIC) or (empty_ok and st.st_size == 0)


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
