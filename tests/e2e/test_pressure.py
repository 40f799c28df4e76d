"""The pressure guard end to end.

Part 1 runs the real app in this process (uvicorn on a loopback port, real scheduler, real
runner processes with SmolLM2 and MiniLM) on a *fake machine*: the probe is the edge, and
the test controls how much memory "other processes" hold. Our own bytes are measured for
real, so unloading a model really lowers usage. The guard is the thing under test.

Part 2 runs `elbowroom serve` inside a real cgroup v1 memory cgroup with a real limit, and a
noisy-neighbour process in the same cgroup pushes real usage over the soft threshold.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import signal
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import openai
import pytest
import uvicorn
from cgroup_v1 import NEIGHBOUR, Cgroup, v1_available
from serverproc import ServerProcess, wait_for

from elbowroom.config import Settings
from elbowroom.memory.process import measure_pid, measure_tree
from elbowroom.memory.types import Snapshot
from elbowroom.server.app import create_app

pytestmark = pytest.mark.slow

GiB = 1024**3
LLM = "smollm2-135m"
EMBED = "minilm-l6-v2"
COUNT = "Write the numbers from 1 to 900, separated by commas: 1, 2, 3,"


class FakeMachine:
    """A 4 GiB Linux machine: ``others`` bytes belong to other processes, ours are measured
    (this process's descendants: the runners). Available = total - others - ours."""

    def __init__(self, total: int = 4 * GiB, margin: int = 256 * 1024**2) -> None:
        self.total = total
        self.margin = margin
        self.others = 0

    def ours(self) -> int:
        try:
            return measure_tree(os.getpid(), include_self=False).resident
        except (ProcessLookupError, FileNotFoundError):
            return 0

    def __call__(self) -> Snapshot:
        used = min(self.total, self.others + self.ours())
        available = self.total - used
        return Snapshot(
            "linux", self.total, available, used, self.total, available, taken_at=time.monotonic()
        )

    def squeeze(self, ratio: float) -> None:
        """Make our usage ``ratio`` × the limit (the limit is available + ours - margin).
        "Ours" to the guard is the runners (this process's descendants, in ``used``) and the
        server's own anonymous bytes (this process: pytest, which ``used`` leaves out and
        which grows as the suite imports third-party clients and MLX into it)."""
        runners = self.ours()
        try:
            server = measure_pid(os.getpid()).anonymous
        except (ProcessLookupError, FileNotFoundError):
            server = 0
        self.others = max(0, self.total - self.margin + server - int((runners + server) / ratio))


class InProcessServer:
    """The real app, served by uvicorn on a thread with its own event loop."""

    def __init__(self, settings: Settings, machine: FakeMachine) -> None:
        self._sock = socket.socket()
        self._sock.bind(("127.0.0.1", 0))
        self.url = f"http://127.0.0.1:{self._sock.getsockname()[1]}"
        app = create_app(settings, probe=machine)
        self._server = uvicorn.Server(uvicorn.Config(app, log_level="warning", lifespan="on"))
        self._thread = threading.Thread(target=self._main, name="test-server", daemon=True)

    def _main(self) -> None:
        asyncio.run(self._server.serve(sockets=[self._sock]))

    def start(self) -> InProcessServer:
        self._thread.start()

        def up() -> bool:
            assert self._thread.is_alive(), "the server thread died while starting"
            return self._server.started

        wait_for(up, timeout=120, what="the in-process server to start")
        return self

    def stop(self) -> None:
        self._server.should_exit = True
        self._thread.join(timeout=60)
        self._sock.close()

    def get(self, path: str) -> Any:
        r = httpx.get(self.url + path, timeout=30)
        r.raise_for_status()
        return r.json()

    def loaded(self) -> set[str]:
        return {m["id"] for m in self.get("/api/ps")["models"] if m["state"] == "ready"}

    def guard(self) -> dict[str, Any]:
        return dict(self.get("/api/guard?events=1000"))

    def events(self, kind: str) -> list[dict[str, Any]]:
        return [e for e in self.guard()["events"] if e["kind"] == kind]

    def openai(self) -> openai.OpenAI:
        return openai.OpenAI(base_url=self.url + "/v1", api_key="unused", max_retries=0)


@pytest.fixture(scope="module")
def machine() -> FakeMachine:
    return FakeMachine()


@pytest.fixture(scope="module")
def server(
    tmp_path_factory: pytest.TempPathFactory, machine: FakeMachine
) -> Iterator[InProcessServer]:
    home = tmp_path_factory.mktemp("pressure")
    settings = Settings(
        data_dir=home / "data",
        kv_cache_dir=home / "kv",
        ctx=1024,
        keep_alive=3600,
        resident_idle=3600,
        monitor_interval=0.1,
        safety_margin=machine.margin,
        preload=(LLM, EMBED),
    )
    srv = InProcessServer(settings, machine).start()
    wait_for(lambda: srv.loaded() == {LLM, EMBED}, timeout=120, what="both models to load")
    yield srv
    srv.stop()


def test_soft_pressure_unloads_the_least_recently_used_idle_model(
    server: InProcessServer, machine: FakeMachine
) -> None:
    out = server.openai().chat.completions.create(
        model=LLM, messages=[{"role": "user", "content": "Hi"}], max_tokens=4, temperature=0
    )
    assert out.choices[0].message.content is not None  # the LLM is now the most recent

    machine.squeeze(0.90)  # between soft (0.85) and hard (0.95)
    wait_for(lambda: EMBED not in server.loaded(), timeout=30, what=f"{EMBED} to be unloaded")
    machine.others = 0

    assert LLM in server.loaded()  # one unload was enough: the LLM stays
    unload = server.events("unload")[0]
    assert unload["model"] == EMBED and unload["level"] == "soft"
    # The message names the signal that moved the level: our usage over the soft threshold,
    # or (once the suite has made this process large) the machine's available floor.
    message = unload["message"]
    assert "over the soft threshold" in message or "machine-wide" in message, message
    assert "MiB" in message
    assert server.events("pause_loads"), "loads were not paused under soft pressure"
    wait_for(lambda: server.guard()["loads_paused"] is False, timeout=30, what="loads resumed")
    assert server.guard()["admission_open"]


def test_hard_pressure_aborts_the_generation_and_the_server_keeps_serving(
    server: InProcessServer, machine: FakeMachine
) -> None:
    assert server.loaded() == {LLM}
    client = server.openai()
    stream = client.completions.create(
        model=LLM, prompt=COUNT, max_tokens=2000, temperature=0, stream=True
    )
    pieces = []
    with pytest.raises(openai.APIError) as info:
        for chunk in stream:
            pieces.append(chunk.choices[0].text)
            if len(pieces) == 3:
                machine.squeeze(1.2)  # our usage 120 % of the limit: hard
    err = info.value
    assert isinstance(err.body, dict) and err.body.get("type") == "memory_pressure"
    assert len(pieces) < 1000  # stopped early, not at max_tokens

    abort = server.events("abort")[0]
    assert abort["model"] == LLM and "newest generation" in abort["message"]
    # over the hard threshold in bytes: the aborted model is evicted once its request ended
    evict = [e for e in server.events("unload") if "busy model" in e["message"]]
    assert [e["model"] for e in evict] == [LLM]
    wait_for(lambda: LLM not in server.loaded(), timeout=30, what=f"{LLM} to be evicted")

    # while hard, new work is refused with 503 + Retry-After
    refused = httpx.post(
        server.url + "/v1/chat/completions",
        json={"model": LLM, "messages": [{"role": "user", "content": "Hi"}]},
        timeout=30,
    )
    assert refused.status_code == 503
    assert refused.json()["error"]["type"] == "memory_pressure"
    assert int(refused.headers["retry-after"]) >= 1

    machine.others = 0
    wait_for(lambda: server.guard()["admission_open"], timeout=30, what="admission to reopen")
    out = client.chat.completions.create(
        model=LLM, messages=[{"role": "user", "content": "Hi"}], max_tokens=4, temperature=0
    )
    assert out.choices[0].message.content is not None
    assert server.guard()["counters"]  # every action was counted


# --- part 2: a real cgroup ------------------------------------------------------------

CGROUP_LIMIT = 1536 * 1024**2
MiB = 1024**2


def _cgroup_or_skip(name: str, limit: int) -> Cgroup:
    if not v1_available():
        pytest.skip("needs root and a cgroup v1 memory hierarchy at /sys/fs/cgroup/memory")
    try:
        return Cgroup(name, limit)
    except OSError as exc:
        pytest.skip(f"cannot create a memory cgroup: {exc}")


@pytest.mark.cgroup
def test_real_cgroup_noisy_neighbour_guard_unloads_and_nothing_is_oom_killed(
    tmp_path: Path,
) -> None:
    cg = _cgroup_or_skip(f"elbowroom-test-{os.getpid()}", CGROUP_LIMIT)
    server = ServerProcess(
        tmp_path,
        "--ctx",
        "1024",
        "--preload",
        LLM,
        env={"ELBOWROOM_MONITOR_INTERVAL": "0.2"},
        prefix=cg.command(),  # the server and its runners live in the cgroup
    )
    procs: list[subprocess.Popen[bytes]] = []
    try:
        url = server.start().url
        http = httpx.Client(base_url=url, timeout=30)

        def loaded() -> set[str]:
            rows = http.get("/api/ps").json()["models"]
            return {m["id"] for m in rows if m["state"] == "ready"}

        wait_for(lambda: loaded() == {LLM}, timeout=120, what=f"{LLM} to load")
        memory = http.get("/api/memory").json()
        assert memory["snapshot"]["cgroup_limit"] == CGROUP_LIMIT
        assert http.get("/api/guard").json()["level"] == "normal"

        neighbour = subprocess.Popen(
            cg.command(sys.executable, "-c", NEIGHBOUR),
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            start_new_session=True,
        )
        procs.append(neighbour)
        assert neighbour.stdin is not None and neighbour.stdout is not None

        def unloads() -> list[dict[str, Any]]:
            events = http.get("/api/guard?events=1000").json()["events"]
            return [e for e in events if e["kind"] == "unload"]

        # The limit follows what is available (available + ours - margin): soft begins when
        # the neighbour leaves about ours / 0.85 - ours + margin available. Jump to 64 MiB
        # short of that, then push 16 MiB at a time; after each step wait for a fresh
        # sample, so the guard has seen it; stop at the first unload. Never closer than
        # 96 MiB to the limit: past that the kernel would OOM-kill whatever the guard did.
        ours, available = memory["own_usage"], memory["snapshot"]["available"]
        margin = 256 * MiB
        jump = max(0, available - (int(ours / 0.85) - ours + margin) - 64 * MiB) // MiB
        held = 0
        step = jump
        while not unloads():
            assert cg.usage < CGROUP_LIMIT - 96 * MiB, (
                f"usage {cg.usage // MiB} MiB near the limit and the guard has not unloaded"
            )
            before = http.get("/api/guard").json()["sample_at"]
            neighbour.stdin.write(b"+%d\n" % step)
            neighbour.stdin.flush()
            assert neighbour.stdout.readline().startswith(b"ok")
            held += step
            step = 16
            wait_for(
                lambda b=before: http.get("/api/guard").json()["sample_at"] > b,
                timeout=10,
                what="a fresh memory sample",
            )
        event = unloads()[0]
        assert event["level"] in ("soft", "hard") and event["model"] == LLM
        assert "MiB" in event["message"]
        wait_for(lambda: event["model"] not in loaded(), timeout=30, what="the unload")

        neighbour.stdin.write(b"-\n")
        neighbour.stdin.flush()
        assert neighbour.stdout.readline().startswith(b"ok 0")
        wait_for(
            lambda: http.get("/api/guard").json()["admission_open"], timeout=30, what="admission"
        )
        out = httpx.post(
            url + "/v1/chat/completions",
            json={"model": LLM, "messages": [{"role": "user", "content": "Hi"}], "max_tokens": 4},
            timeout=120,
        )
        assert out.status_code == 200, out.text

        assert cg.oom_kills == 0, f"OOM kills in the cgroup after {held} MiB of neighbour"
        assert server.proc is not None and server.proc.poll() is None
        assert neighbour.poll() is None
        assert "exited:" not in server.log()  # no runner died
        neighbour.stdin.close()
        assert neighbour.wait(timeout=30) == 0
        assert server.stop(timeout=60) == 0, server.log()[-3000:]  # SIGTERM: a clean exit
    finally:
        for p in procs:
            if p.poll() is None:
                with contextlib.suppress(ProcessLookupError):
                    os.killpg(p.pid, signal.SIGKILL)
                p.wait(timeout=30)
        server.stop(timeout=10)
        cg.remove()
