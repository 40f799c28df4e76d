"""Measured footprints, remembered per model file so the next prediction is a measurement.

A JSON file (``settings.measurements_path``)::

    {"version": 2, "models": {IDENTITY: {"engine": "llama", "entries": {
        "n_ctx=4096,slots=1,kv=f16": {"anonymous": ..., "file_backed": ..., "swap": ...,
                                      "gpu": ..., "n_ctx": 4096, "slots": 1, "kv_type": "f16"}}}}}

IDENTITY is ``ModelSpec.identity`` (resolved path, size, mtime): replacing the file starts
afresh. Recording the same settings again keeps the larger value of each kind of bytes, so
a resident engine's measurement right after load never hides a larger one taken after a
request.

What is recorded is a model's OWN footprint. An LLM (mmap, llama.cpp) is recorded right
after load only: everything it holds of its own (KV cache, compute buffers, vocabulary) is
allocated then, and what it grows into afterwards is its RAM prompt cache, a grant budgeted
separately, plus the working memory the estimate predicts (``Footprint.working``), which
``estimate.footprint`` adds back to a measurement. Measuring at unload would store the
cache as if the model needed it (the issue that made SmolLM2 look 2.4× its size). Version 1
files were recorded that way and are ignored.

Lookup: the exact settings win. For an LLM measured at other settings, the nearest
measurement (same slots and KV type first, then the closest n_ctx) is rescaled by the
estimate's difference between the two settings; what the estimate does not model is taken
as measured. Resident engines have no context: any measurement of the file applies. Writes
are atomic (temp file + rename); a corrupt or unreadable file reads as empty rather than
failing a load.
"""

from __future__ import annotations

import json
import logging
import os
import tempfile
import threading
from pathlib import Path
from typing import Any

from elbowroom.memory.types import ProcessMemory
from elbowroom.models.estimate import KV_TYPE_BYTES, footprint
from elbowroom.models.spec import ModelSpec

log = logging.getLogger(__name__)

_VERSION = 2
_FIELDS = ("anonymous", "file_backed", "swap", "gpu")


def _key(n_ctx: int, slots: int, kv_type: str) -> str:
    return f"n_ctx={n_ctx},slots={slots},kv={kv_type}"


class MeasuredStore:
    def __init__(self, path: Path) -> None:
        self.path = Path(path)
        self._lock = threading.Lock()

    # --- file
    def _load(self) -> dict[str, Any]:
        try:
            data = json.loads(self.path.read_text())
        except FileNotFoundError:
            return {"version": _VERSION, "models": {}}
        except (OSError, ValueError) as exc:
            log.warning("ignoring unreadable measurements file %s: %s", self.path, exc)
            return {"version": _VERSION, "models": {}}
        if not isinstance(data, dict) or not isinstance(data.get("models"), dict):
            return {"version": _VERSION, "models": {}}
        if data.get("version") != _VERSION:
            return {"version": _VERSION, "models": {}}  # recorded by other rules
        return data

    def _save(self, data: dict[str, Any]) -> None:
        self.path.parent.mkdir(parents=True, exist_ok=True)
        fd, tmp = tempfile.mkstemp(prefix=".measured-", suffix=".json", dir=self.path.parent)
        try:
            with os.fdopen(fd, "w") as fh:
                json.dump(data, fh, indent=1, sort_keys=True)
                fh.flush()
                os.fsync(fh.fileno())
            os.replace(tmp, self.path)
        except BaseException:
            Path(tmp).unlink(missing_ok=True)
            raise

    @staticmethod
    def _identity(spec: ModelSpec) -> str | None:
        try:
            return spec.identity
        except OSError:
            return None  # the file is gone: nothing to remember it by

    # --- API
    def record(
        self, spec: ModelSpec, n_ctx: int, slots: int, kv_type: str, mem: ProcessMemory
    ) -> None:
        identity = self._identity(spec)
        if identity is None:
            return
        with self._lock:
            data = self._load()
            model = data["models"].setdefault(identity, {"engine": spec.engine, "entries": {}})
            entries = model.setdefault("entries", {})
            old = entries.get(_key(n_ctx, slots, kv_type), {})
            entry: dict[str, Any] = {"n_ctx": n_ctx, "slots": slots, "kv_type": kv_type}
            for name in _FIELDS:
                entry[name] = max(int(getattr(mem, name)), int(old.get(name, 0)))
            if entry == old:
                return  # nothing new: no write (and no fsync) on a reload's way to its request
            entries[_key(n_ctx, slots, kv_type)] = entry
            self._save(data)

    def lookup(self, spec: ModelSpec, n_ctx: int, slots: int, kv_type: str) -> ProcessMemory | None:
        identity = self._identity(spec)
        if identity is None:
            return None
        model = self._load()["models"].get(identity)
        entries = [e for e in (model or {}).get("entries", {}).values() if _valid(e)]
        if not entries:
            return None
        exact = [
            e for e in entries if (e["n_ctx"], e["slots"], e["kv_type"]) == (n_ctx, slots, kv_type)
        ]
        if exact:
            return _memory(exact[0], 0)
        if spec.gguf is None:
            return _memory(max(entries, key=lambda e: e["anonymous"]), 0)

        def distance(e: dict[str, Any]) -> tuple[int, int, int]:
            return (e["kv_type"] != kv_type, e["slots"] != slots, abs(e["n_ctx"] - n_ctx))

        nearest = min(entries, key=distance)
        then = footprint(spec, nearest["n_ctx"], nearest["slots"], nearest["kv_type"])
        now = footprint(spec, n_ctx, slots, kv_type)
        # Right-after-load anonymous bytes: the state a measurement was taken in.
        delta = (now.anonymous - now.working) - (then.anonymous - then.working)
        return _memory(nearest, delta)


def _valid(entry: Any) -> bool:
    if not isinstance(entry, dict):
        return False
    ints = all(isinstance(entry.get(k), int) for k in ("n_ctx", "slots", *_FIELDS))
    return ints and entry.get("kv_type") in KV_TYPE_BYTES


def _memory(entry: dict[str, Any], anon_delta: int) -> ProcessMemory:
    return ProcessMemory(
        anonymous=max(0, entry["anonymous"] + anon_delta),
        file_backed=entry["file_backed"],
        swap=entry["swap"],
        gpu=entry["gpu"],
    )
