"""The engine's own HTTP listener, used only from inside the runner process.

llama.cpp's server engine always opens an HTTP listener. The runner binds it to a Unix
socket in a private (0700) directory and gives it a random API key, so nothing outside
this process can reach it, and it never shares elbowroom's port. The runner uses it for
what the Python binding does not expose: the chat template's capabilities (``/props``) and
slot save/restore (``/slots``).
"""

from __future__ import annotations

import http.client
import json
import secrets
import shutil
import socket
import tempfile
import time
from pathlib import Path
from typing import Any

TIMEOUT = 60.0


class _UnixConnection(http.client.HTTPConnection):
    def __init__(self, path: str, timeout: float) -> None:
        super().__init__("localhost", timeout=timeout)
        self._path = path

    def connect(self) -> None:
        sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        sock.settimeout(self.timeout)
        sock.connect(self._path)
        self.sock = sock


class EngineControl:
    """A private Unix-socket endpoint and key for one engine."""

    def __init__(self) -> None:
        # mkdtemp creates the directory 0700: only this user can even reach the socket.
        self.dir = Path(tempfile.mkdtemp(prefix="elbowroom-engine-"))
        self.socket = str(self.dir / "engine.sock")
        self.key = secrets.token_urlsafe(32)

    def request(self, method: str, path: str, body: dict[str, Any] | None = None) -> Any:
        conn = _UnixConnection(self.socket, TIMEOUT)
        try:
            headers = {"Authorization": f"Bearer {self.key}"}
            data = None
            if body is not None:
                data = json.dumps(body).encode()
                headers["Content-Type"] = "application/json"
            conn.request(method, path, body=data, headers=headers)
            resp = conn.getresponse()
            raw = resp.read()
            parsed = json.loads(raw) if raw else {}
            if resp.status != 200:
                message = parsed.get("error", {}).get("message") if isinstance(parsed, dict) else ""
                raise RuntimeError(
                    f"engine {method} {path}: HTTP {resp.status}: {message or raw!r}"
                )
            return parsed
        finally:
            conn.close()

    def wait_slot_idle(self, slot: int, poll: float = 0.05) -> None:
        """Return once the engine's loop no longer works on ``slot``. ``GET /slots`` is
        answered by that loop itself, so while it is held (a grammar being set up, a batch
        being decoded) the answer waits too; a slot still processing (a cancel not yet
        taken) is asked again. An engine that is gone or answers no ``/slots`` ends it."""
        while True:
            try:
                rows = self.request("GET", "/slots")
            except TimeoutError:
                continue  # the loop is still held: keep waiting
            except (OSError, RuntimeError, ValueError):
                return
            row = (
                next((r for r in rows if isinstance(r, dict) and r.get("id") == slot), None)
                if isinstance(rows, list)
                else None
            )
            if row is None or not row.get("is_processing"):
                return
            time.sleep(poll)

    def cleanup(self) -> None:
        shutil.rmtree(self.dir, ignore_errors=True)
