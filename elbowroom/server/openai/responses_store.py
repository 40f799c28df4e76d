"""Stored responses of ``/v1/responses`` (docs/api.md#responses): a bounded store on disk.

One JSON file per response under ``<data_dir>/responses`` holds the Response object, its
input items (for ``GET /v1/responses/{id}/input_items``) and the whole conversation it
ended (chat messages, without ``instructions``), which ``previous_response_id`` continues:
the continuation sends that conversation and the new input through the chat path, so the
engine's prompt cache and the KV disk tier find the prefix they already hold.

Bounds: an entry older than ``responses_ttl`` seconds is gone (never served, deleted when
seen or at the next write); the files together stay under ``responses_max`` bytes (the
oldest go first; a single entry bigger than that is not stored). Writes are atomic (a
temporary file, fsynced, renamed over), so a crash leaves the old entry or the new one.

Owners: when API keys are set, each entry is owned by the key that made it (an HMAC of
the key with a secret of this store, never the key itself); any other key sees a 404, as
for a response that does not exist. Without keys every entry is owned by "" (anyone).
"""

from __future__ import annotations

import contextlib
import hashlib
import hmac
import json
import logging
import os
import re
import secrets
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

log = logging.getLogger("elbowroom.server")

_ID = re.compile(r"^resp_[0-9a-f]{32}$")
_SECRET = ".owner-secret"


def new_id(prefix: str) -> str:
    return f"{prefix}_{secrets.token_hex(16)}"


def valid_id(response_id: str) -> bool:
    """Only ids this server makes name files: nothing else reaches the file system."""
    return bool(_ID.match(response_id))


@dataclass(slots=True)
class _Entry:
    owner: str
    created: float
    size: int


class ResponseStore:
    """Thread-safe; every method does file I/O (call it off the event loop)."""

    def __init__(
        self,
        root: Path,
        ttl: float,
        max_bytes: int,
        clock: Callable[[], float] = time.time,
    ) -> None:
        self.root = root
        self.ttl = ttl
        self.max_bytes = max_bytes
        self.clock = clock
        self._lock = threading.Lock()
        self._index: dict[str, _Entry] | None = None
        self._secret: bytes | None = None

    # ---- owners -------------------------------------------------------------------------

    def owner_of(self, token: str | None) -> str:
        """The owner name of a bearer token: "" without one (no keys set)."""
        if not token:
            return ""
        with self._lock:
            secret = self._load_secret()
        return hmac.new(secret, token.encode(), hashlib.sha256).hexdigest()

    def _load_secret(self) -> bytes:
        if self._secret is None:
            path = self.root / _SECRET
            try:
                self._secret = bytes.fromhex(path.read_text().strip())
            except (OSError, ValueError):
                self.root.mkdir(parents=True, exist_ok=True)
                self._secret = secrets.token_bytes(32)
                self._write_atomic(path, self._secret.hex().encode())
        return self._secret

    # ---- reads --------------------------------------------------------------------------

    def get(self, response_id: str, owner: str) -> dict[str, Any] | None:
        """The stored record (``response``, ``input_items``, ``conversation``), or None when
        it does not exist, expired or belongs to another owner."""
        if not valid_id(response_id):
            return None
        with self._lock:
            index = self._load_index()
            entry = index.get(response_id)
            if entry is None or not hmac.compare_digest(entry.owner, owner):
                return None
            if self._expired(entry):
                self._remove(response_id)
                return None
            try:
                record: dict[str, Any] = json.loads(self._path(response_id).read_bytes())
            except (OSError, ValueError) as exc:
                log.warning("stored response %s is unreadable (%s): dropped", response_id, exc)
                self._remove(response_id)
                return None
            return record

    def delete(self, response_id: str, owner: str) -> bool:
        if not valid_id(response_id):
            return False
        with self._lock:
            entry = self._load_index().get(response_id)
            if entry is None or not hmac.compare_digest(entry.owner, owner):
                return False
            expired = self._expired(entry)
            self._remove(response_id)
            return not expired

    def stats(self) -> dict[str, int]:
        with self._lock:
            index = self._load_index()
            return {"entries": len(index), "bytes": sum(e.size for e in index.values())}

    # ---- writes -------------------------------------------------------------------------

    def put(self, response_id: str, owner: str, record: dict[str, Any]) -> bool:
        """Store ``record`` (atomically); False when it alone is over ``max_bytes``."""
        if not valid_id(response_id):
            raise ValueError(f"not a response id: {response_id!r}")
        data = json.dumps({**record, "owner": owner}, separators=(",", ":")).encode()
        if len(data) > self.max_bytes:
            log.warning(
                "response %s is %d bytes, over responses_max (%d): not stored",
                response_id,
                len(data),
                self.max_bytes,
            )
            return False
        with self._lock:
            index = self._load_index()
            self._write_atomic(self._path(response_id), data)
            index[response_id] = _Entry(owner, self.clock(), len(data))
            self._trim(index)
        return True

    # ---- internals ----------------------------------------------------------------------

    def _path(self, response_id: str) -> Path:
        return self.root / f"{response_id}.json"

    def _expired(self, entry: _Entry) -> bool:
        return self.clock() - entry.created > self.ttl

    def _remove(self, response_id: str) -> None:
        assert self._index is not None
        self._index.pop(response_id, None)
        with contextlib.suppress(FileNotFoundError):
            self._path(response_id).unlink()

    def _trim(self, index: dict[str, _Entry]) -> None:
        """Expired entries go, then the oldest until the rest fit ``max_bytes``."""
        for response_id in [r for r, e in index.items() if self._expired(e)]:
            self._remove(response_id)
        total = sum(e.size for e in index.values())
        for response_id in sorted(index, key=lambda r: index[r].created):
            if total <= self.max_bytes:
                break
            total -= index[response_id].size
            self._remove(response_id)

    def _load_index(self) -> dict[str, _Entry]:
        """What is on disk, read once (the owner from each file; the time is its mtime)."""
        if self._index is not None:
            return self._index
        index: dict[str, _Entry] = {}
        self.root.mkdir(parents=True, exist_ok=True)
        for path in self.root.glob("resp_*.json"):
            response_id = path.stem
            if not valid_id(response_id):
                continue
            try:
                size = path.stat().st_size
                created = path.stat().st_mtime
                owner = json.loads(path.read_bytes()).get("owner", "")
            except (OSError, ValueError, AttributeError) as exc:
                log.warning("stored response %s is unreadable (%s): dropped", path.name, exc)
                with contextlib.suppress(OSError):
                    path.unlink()
                continue
            index[response_id] = _Entry(str(owner), created, size)
        for stale in self.root.glob(".tmp-*"):  # a write a crash interrupted
            with contextlib.suppress(OSError):
                stale.unlink()
        self._index = index
        self._trim(index)
        return index

    def _write_atomic(self, path: Path, data: bytes) -> None:
        tmp = path.with_name(f".tmp-{path.name}-{secrets.token_hex(4)}")
        try:
            fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
            with os.fdopen(fd, "wb") as f:
                f.write(data)
                f.flush()
                os.fsync(f.fileno())
            os.replace(tmp, path)
        except BaseException:
            with contextlib.suppress(OSError):
                tmp.unlink()
            raise
