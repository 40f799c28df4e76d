"""Runner crashes, the API key, refusing to start, and graceful shutdown, on real servers."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
from pathlib import Path

import httpx
import openai
import pytest
from serverproc import REPO, ServerFactory, pid_alive, runner_pid, wait_for

pytestmark = pytest.mark.slow

MODEL = "smollm2-135m"
HI = [{"role": "user", "content": "Hi"}]


def test_kill_9_of_the_runner_mid_stream(server_factory: ServerFactory) -> None:
    server = server_factory("--ctx", "1024")
    # Generous timeout: the assertion is that an error arrives, not that it is fast.
    client = server.openai(timeout=60)
    stream = client.completions.create(
        model=MODEL, prompt="1, 2, 3, 4, 5,", max_tokens=900, temperature=0, stream=True
    )
    chunks = iter(stream)
    assert next(chunks).choices[0].text is not None
    pid = runner_pid(server, MODEL)
    assert pid is not None
    os.kill(pid, signal.SIGKILL)
    with pytest.raises(openai.APIError) as info:
        for _ in chunks:
            pass
    assert "SIGKILL" in str(info.value) or "signal" in str(info.value), info.value
    wait_for(lambda: not pid_alive(pid), timeout=30, what="the killed runner to be reaped")

    # The next request restarts the runner and is served.
    out = client.chat.completions.create(model=MODEL, messages=HI, max_tokens=2)
    assert out.choices[0].message.content is not None
    new_pid = runner_pid(server, MODEL)
    assert new_pid is not None and new_pid != pid
    restarted = next(m for m in server.ps() if m["id"] == MODEL)
    assert restarted["restarts"] == 1

    # SIGTERM: the server stops its runner and exits cleanly.
    assert server.stop() == 0
    assert not pid_alive(new_pid)


def test_api_key(server_factory: ServerFactory) -> None:
    server = server_factory(api_key="sekrit")
    assert httpx.get(server.url + "/health").json() == {"status": "ok"}
    for headers in ({}, {"Authorization": "Bearer nope"}):
        for path in ("/v1/models", "/api/elbowroom/ps", "/api/memory"):
            r = httpx.get(server.url + path, headers=headers)
            assert r.status_code == 401, (path, headers)
            assert r.json()["error"]["type"] == "authentication_error"
        # Ollama's routes say it in Ollama's shape.
        r = httpx.get(server.url + "/api/ps", headers=headers)
        assert r.status_code == 401 and "API key" in r.json()["error"]
        r = httpx.post(
            server.url + "/v1/chat/completions",
            headers=headers,
            json={"model": MODEL, "messages": HI},
        )
        assert r.status_code == 401
    with pytest.raises(openai.AuthenticationError):
        openai.OpenAI(base_url=server.url + "/v1", api_key="wrong", max_retries=0).models.list()
    assert MODEL in [m.id for m in server.openai().models.list().data]
    ps = server.cli("ps", "--json")
    assert ps.returncode == 0, ps.stderr


def serve(home: Path, *args: str) -> subprocess.CompletedProcess[str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith("ELBOWROOM_")}
    env.update(XDG_DATA_HOME=str(home), XDG_CACHE_HOME=str(home), XDG_CONFIG_HOME=str(home))
    return subprocess.run(
        [sys.executable, "-m", "elbowroom", "serve", "--port", "0", *args],
        cwd=REPO,
        env=env,
        capture_output=True,
        text=True,
        timeout=120,
    )


def test_refuses_a_network_address_without_a_key(tmp_path: Path) -> None:
    r = serve(tmp_path, "--host", "0.0.0.0")
    assert r.returncode == 2
    assert "refusing to listen on 0.0.0.0 without an API key" in r.stderr


def test_refuses_to_start_with_an_unknown_preload(tmp_path: Path) -> None:
    r = serve(tmp_path, "--preload", "../../etc/passwd")
    assert r.returncode == 1
    assert "cannot start" in r.stderr and "does not exist" in r.stderr
