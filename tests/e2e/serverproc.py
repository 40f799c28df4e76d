"""``ServerProcess`` runs ``python -m elbowroom serve`` in a subprocess, for e2e tests.

The server binds ``--port 0`` (the OS picks a free port) and prints where it listens; we read
that line, then wait for /health, always with a deadline. Each server gets its own data,
cache and config folders, so measured footprints and KV caches never leak between modules
(pass ``home`` to share them on purpose). ``stop()`` sends SIGTERM (graceful: the server
stops its runners), then SIGKILLs the whole process group if it has to, and reaps.

Import it as ``from serverproc import ServerProcess, wait_for`` (tests/e2e is on sys.path for
its test modules; a uniquely named module, because every conftest.py is called "conftest").
The module-scoped ``server_factory`` fixture in conftest.py starts servers and stops them.
"""

from __future__ import annotations

import contextlib
import json
import os
import re
import signal
import subprocess
import sys
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import httpx
import openai

REPO = Path(__file__).resolve().parents[2]
STARTUP_DEADLINE = 120.0  # seconds; a preload of a small model takes a few
_LISTENING = re.compile(r"elbowroom listening on (http://\S+)")


def wait_for(
    condition: Callable[[], Any], *, timeout: float, interval: float = 0.05, what: str = ""
) -> Any:
    """Poll ``condition`` until it returns something truthy; fail after ``timeout`` seconds."""
    deadline = time.monotonic() + timeout
    while True:
        value = condition()
        if value:
            return value
        if time.monotonic() >= deadline:
            raise AssertionError(f"timed out after {timeout:.0f} s waiting for {what or condition}")
        time.sleep(interval)


def pid_alive(pid: int) -> bool:
    """True while ``pid`` exists and is not a zombie."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] != "Z"
    except (FileNotFoundError, ProcessLookupError, IndexError):
        return False


class ServerProcess:
    def __init__(
        self,
        home: Path,
        *args: str,
        env: dict[str, str] | None = None,
        api_key: str | None = None,
        prefix: Sequence[str] = (),
    ) -> None:
        self.home = home
        self.args = list(args)
        # argv that runs first and execs the server's (e.g. one that joins a cgroup)
        self.prefix = list(prefix)
        self.api_key = api_key
        self.extra_env = dict(env or {})
        self.log_path = home / f"server-{time.monotonic_ns()}.log"
        self.proc: subprocess.Popen[bytes] | None = None
        self.url = ""

    # --- lifetime

    def start(self) -> ServerProcess:
        env = {k: v for k, v in os.environ.items() if not k.startswith("ELBOWROOM_")}
        env.update(
            XDG_DATA_HOME=str(self.home / "data"),
            XDG_CACHE_HOME=str(self.home / "cache"),
            XDG_CONFIG_HOME=str(self.home / "config"),
            PYTHONUNBUFFERED="1",
        )
        env.update(self.extra_env)
        cmd = [sys.executable, "-m", "elbowroom", "serve", "--port", "0", *self.args]
        if self.api_key:
            cmd += ["--api-key", self.api_key]
        with open(self.log_path, "wb") as log:
            self.proc = subprocess.Popen(
                [*self.prefix, *cmd],
                cwd=REPO,
                env=env,
                stdout=log,
                stderr=subprocess.STDOUT,
                start_new_session=True,
            )
        self.url = wait_for(
            self._listening,
            timeout=STARTUP_DEADLINE,
            interval=0.1,
            what=f"the server to listen ({self.log_path})",
        )
        wait_for(self._healthy, timeout=30, what="/health")
        return self

    def _listening(self) -> str | None:
        assert self.proc is not None
        match = _LISTENING.search(self.log())
        if match:
            return match.group(1)
        if self.proc.poll() is not None:
            raise AssertionError(f"server exited with {self.proc.returncode}:\n{self.log()}")
        return None

    def _healthy(self) -> bool:
        try:
            return httpx.get(self.url + "/health", timeout=2).status_code == 200
        except httpx.HTTPError:
            return False

    def stop(self, timeout: float = 30.0) -> int | None:
        """SIGTERM, wait, then SIGKILL the process group; returns the exit code."""
        proc = self.proc
        if proc is None:
            return None
        if proc.poll() is None:
            proc.send_signal(signal.SIGTERM)
            try:
                proc.wait(timeout=timeout)
            except subprocess.TimeoutExpired:
                os.killpg(proc.pid, signal.SIGKILL)
                proc.wait(timeout=10)
        # Anything left in its session (a runner that outlived the server) is a bug, but
        # must not outlive the test run either.
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.killpg(proc.pid, signal.SIGKILL)
        return proc.returncode

    # --- clients

    @property
    def headers(self) -> dict[str, str]:
        return {"Authorization": f"Bearer {self.api_key}"} if self.api_key else {}

    def http(self) -> httpx.Client:
        return httpx.Client(base_url=self.url, headers=self.headers, timeout=120)

    def openai(self, **kw: Any) -> openai.OpenAI:
        kw.setdefault("max_retries", 0)
        kw.setdefault("timeout", 120)
        return openai.OpenAI(base_url=self.url + "/v1", api_key=self.api_key or "unused", **kw)

    def ps(self) -> list[dict[str, Any]]:
        r = httpx.get(self.url + "/api/elbowroom/ps", headers=self.headers, timeout=30)
        r.raise_for_status()
        return list(r.json()["models"])

    def memory(self) -> dict[str, Any]:
        r = httpx.get(self.url + "/api/memory", headers=self.headers, timeout=30)
        r.raise_for_status()
        return dict(r.json())

    def cli(self, *args: str) -> subprocess.CompletedProcess[str]:
        """Run an `elbowroom` client command against this server."""
        cmd = [sys.executable, "-m", "elbowroom", *args, "--url", self.url]
        if self.api_key:
            cmd += ["--api-key", self.api_key]
        return subprocess.run(cmd, cwd=REPO, capture_output=True, text=True, timeout=300)

    def log(self) -> str:
        try:
            return self.log_path.read_text(errors="replace")
        except FileNotFoundError:
            return ""


def runner_pid(server: ServerProcess, model: str) -> int | None:
    for row in server.ps():
        if row["id"] == model and row.get("state") == "ready":
            return int(row["pid"])
    return None


def json_lines(text: str) -> list[dict[str, Any]]:
    return [json.loads(line) for line in text.splitlines() if line.startswith("{")]


ServerFactory = Callable[..., ServerProcess]
