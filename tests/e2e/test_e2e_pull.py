"""`elbowroom pull` and Ollama's /api/pull for real: the CLI in a subprocess and a real server
with the real engine, against a local stand-in for the Hugging Face Hub (tests/fakehub.py,
HF_ENDPOINT) serving the bundled SmolLM2 GGUF and a header-only "70 GB" model. A model
pulled either way is chatted with through the official ``ollama`` client."""

from __future__ import annotations

import json
import os
import re
import resource
import signal
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import ollama
import pytest
from bundled_models import bundled_spec
from fakehub import FakeHub, Repo, big_gguf_header, disk_blob, generated_blob
from serverproc import REPO, ServerFactory, json_lines, wait_for

from elbowroom.units import MiB

pytestmark = pytest.mark.slow

SMOL = "SmolLM2-135M-Instruct.Q4_1.gguf"
PULLED = "smollm2-135m-instruct.q4_1"
NAME = "hf.co/test/SmolLM2-GGUF:Q4_1"
HI = [{"role": "user", "content": "Say hello."}]
GREEDY = {"temperature": 0, "num_predict": 4, "seed": 1}
# a machine of 16 GiB, wherever the tests run: SmolLM2 fits, 70 GB never does
MACHINE = {"ELBOWROOM_OVERRIDE_MEMORY": "16GiB"}


@pytest.fixture(scope="module")
def hub() -> Iterator[FakeHub]:
    head, size = big_gguf_header()
    hub = FakeHub(
        {
            "test/SmolLM2-GGUF": Repo({SMOL: disk_blob(bundled_spec("smollm2-135m").path)}),
            "test/Big-70B-GGUF": Repo({"Big-70B.Q8_0.gguf": generated_blob(head, size)}),
        }
    ).start()
    yield hub
    hub.stop()


def _env(home: Path, hub: FakeHub) -> dict[str, str]:
    env = {
        k: v
        for k, v in os.environ.items()
        if not k.startswith(("ELBOWROOM_", "HF_")) and k != "XDG_CACHE_HOME"
    }
    env.update(
        XDG_DATA_HOME=str(home / "data"),
        XDG_CACHE_HOME=str(home / "cache"),
        XDG_CONFIG_HOME=str(home / "config"),
        HF_ENDPOINT=hub.url,
        PYTHONUNBUFFERED="1",
        **MACHINE,
    )
    return env


def _pull_cmd(*args: str) -> list[str]:
    return [sys.executable, "-m", "elbowroom", "pull", *args]


def _pull(home: Path, hub: FakeHub, *args: str, **kw: Any) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        _pull_cmd(*args),
        cwd=REPO,
        env=_env(home, hub),
        capture_output=True,
        text=True,
        timeout=300,
        **kw,
    )


def _blobs(home: Path) -> Path:
    return home / "cache" / "huggingface" / "hub" / "models--test--SmolLM2-GGUF" / "blobs"


def _link(home: Path) -> Path:
    return home / "data" / "elbowroom" / "models" / "hf.co" / "test" / "SmolLM2-GGUF" / SMOL


def _sent(hub: FakeHub, repo: str, name: str) -> int:
    return hub.sent.get(hub.repos[repo].files[name].sha256, 0)


def test_cli_pull_json_then_chat(
    hub: FakeHub, tmp_path: Path, server_factory: ServerFactory
) -> None:
    done = _pull(tmp_path, hub, NAME, "--json")
    assert done.returncode == 0, done.stderr
    lines = json_lines(done.stdout)
    assert lines[0] == {"status": "pulling manifest"}
    progress = [x for x in lines if str(x["status"]).startswith("downloading")]
    assert progress and progress[-1]["completed"] == progress[-1]["total"] > 90_000_000
    assert str(progress[-1]["digest"]).startswith("sha256:")
    assert {"status": "verifying sha256 digest"} in lines
    final = lines[-1]
    assert final["status"] == "done" and final["model"] == PULLED
    assert final["fit"]["verdict"] == "fits" and 0 < final["header_bytes_read"] < 16 * MiB
    assert _link(tmp_path).is_symlink()

    server = server_factory(
        "--ctx", "1024", "--slots", "1", home=tmp_path, env={"HF_ENDPOINT": hub.url, **MACHINE}
    )
    client = ollama.Client(host=server.url, timeout=180)
    assert PULLED in [m.model.removesuffix(":latest") for m in client.list().models]
    out = client.chat(model=PULLED, messages=HI, options=GREEDY)
    assert out.done and out.message.content


def test_killed_pull_resumes(hub: FakeHub, tmp_path: Path) -> None:
    hub.rate = 8 * MiB  # bytes per second: the download would take ~12 s; killed at 3
    proc = subprocess.Popen(
        _pull_cmd(NAME),
        cwd=REPO,
        env=_env(tmp_path, hub),
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )
    try:

        def partial_size() -> int:
            parts = list(_blobs(tmp_path).glob("*.incomplete"))
            return parts[0].stat().st_size if parts else 0

        wait_for(lambda: partial_size() >= 24 * MiB, timeout=120, what="half a download")
    finally:
        proc.kill()
        proc.wait(timeout=30)
        hub.rate = None
    kept = partial_size()
    assert 24 * MiB <= kept < 98_000_000
    assert not _link(tmp_path).exists()  # the catalog never sees a partial model
    hub.log.clear()
    done = _pull(tmp_path, hub, NAME)
    assert done.returncode == 0, done.stderr
    assert "resumed" in done.stdout and PULLED in done.stdout, done.stdout
    resumed = [r for m, p, r in hub.log if m == "GET" and p.startswith("/cdn/") and r]
    starts = [int(r[6:-1]) for r in resumed if re.fullmatch(r"bytes=\d+-", r)]
    assert starts and starts[0] >= kept, resumed  # the download went on from the partial file
    assert _link(tmp_path).is_symlink() and not list(_blobs(tmp_path).glob("*.incomplete"))
    assert "fit check: fits" in done.stderr and "read " in done.stderr, done.stderr


def _small_files() -> None:
    """In the child: files may not grow past 20 MiB (EFBIG, as a full disk gives ENOSPC)."""
    resource.setrlimit(resource.RLIMIT_FSIZE, (20 * MiB, 20 * MiB))
    signal.signal(signal.SIGXFSZ, signal.SIG_IGN)


def test_disk_full_midway_leaves_nothing(hub: FakeHub, tmp_path: Path) -> None:
    done = _pull(tmp_path, hub, NAME, "--json", preexec_fn=_small_files)
    assert done.returncode == 1
    error = json_lines(done.stdout)[-1]
    assert error["status"] == 507 and error["code"] == "disk_full", error
    assert "nothing was installed" in error["error"]
    assert list(_blobs(tmp_path).iterdir()) == []  # the partial file was removed
    assert not _link(tmp_path).exists()


def test_ollama_client_pull_chat_delete(
    hub: FakeHub, tmp_path: Path, server_factory: ServerFactory
) -> None:
    server = server_factory(
        "--ctx",
        "1024",
        "--slots",
        "1",
        "--admin-key",
        "adm",
        home=tmp_path,
        api_key="infer",
        env={"HF_ENDPOINT": hub.url, **MACHINE},
    )
    admin = ollama.Client(host=server.url, timeout=180, headers={"Authorization": "Bearer adm"})
    user = ollama.Client(host=server.url, timeout=180, headers={"Authorization": "Bearer infer"})
    with pytest.raises(ollama.ResponseError) as denied:
        user.pull(NAME)
    assert denied.value.status_code == 403  # an admin operation
    foreign = httpx.post(
        server.url + "/api/pull",
        json={"model": NAME},
        headers={"Authorization": "Bearer adm", "Origin": server.url + ".evil.example"},
    )
    assert foreign.status_code == 403, foreign.text
    assert not _link(tmp_path).exists()

    # the 70 GB model: refused before downloading, in Ollama's error shape
    with pytest.raises(ollama.ResponseError) as refused:
        admin.pull("hf.co/test/Big-70B-GGUF")
    assert refused.value.status_code == 507 and "needs" in refused.value.error
    assert 0 < _sent(hub, "test/Big-70B-GGUF", "Big-70B.Q8_0.gguf") < 16 * MiB

    events = list(admin.pull(NAME, stream=True))
    statuses = [e.status for e in events]
    assert statuses[0] == "pulling manifest" and statuses[-1] == "success", statuses
    assert (statuses[1] or "").startswith("fit check: fits: predicted"), statuses
    downloading = [e for e in events if (e.status or "").startswith("downloading")]
    assert downloading[-1].completed == downloading[-1].total and downloading[-1].digest
    assert "verifying sha256 digest" in statuses
    assert PULLED in [m.model.removesuffix(":latest") for m in user.list().models]
    out = user.chat(model=PULLED, messages=HI, options=GREEDY)
    assert out.done and out.message.content
    again = admin.pull(NAME, stream=False)  # already there: nothing to download
    assert again.status == "success"

    assert admin.delete(PULLED).status == "success"
    assert PULLED not in [m.model.removesuffix(":latest") for m in user.list().models]
    assert not _link(tmp_path).exists() and list(_blobs(tmp_path).iterdir()) == []
    with pytest.raises(ollama.ResponseError) as gone:
        admin.delete(PULLED)
    assert gone.value.status_code == 404
    # the server's log says nothing went wrong on the way
    assert "Traceback" not in server.log(), server.log()[-3000:]

    # a client that drops the stream halfway: the download stops, nothing is installed, the
    # partial file stays, and the next pull resumes it
    hub.rate = 8 * MiB
    try:
        with httpx.stream(
            "POST",
            server.url + "/api/pull",
            json={"model": NAME},
            headers={"Authorization": "Bearer adm"},
            timeout=120,
        ) as r:
            for line in r.iter_lines():
                if json.loads(line).get("completed", 0) >= 16 * MiB:
                    break  # closes the connection without reading the rest
    finally:
        hub.rate = None
    assert not _link(tmp_path).exists()
    hub.log.clear()
    raw = httpx.post(
        server.url + "/api/pull",
        json={"model": NAME, "stream": False},
        headers={"Authorization": "Bearer adm"},
        timeout=120,
    )
    assert raw.status_code == 200 and json.loads(raw.text)["status"] == "success"
    ranges = [r for m, p, r in hub.log if m == "GET" and p.startswith("/cdn/") and r]
    starts = [int(r[6:-1]) for r in ranges if re.fullmatch(r"bytes=\d+-", r)]
    assert starts and starts[0] >= 16 * MiB, ranges
    assert PULLED in [m.model.removesuffix(":latest") for m in user.list().models]
    assert "Traceback" not in server.log(), server.log()[-3000:]


def test_server_stops_cleanly_during_a_pull(
    hub: FakeHub, tmp_path: Path, server_factory: ServerFactory
) -> None:
    """SIGTERM while /api/pull downloads: the server exits by itself (the stream's end stops
    the download; the test harness would SIGKILL it after 30 s), installs nothing, and keeps
    the partial file for the next pull."""
    server = server_factory(
        "--ctx", "256", "--slots", "1", home=tmp_path, env={"HF_ENDPOINT": hub.url, **MACHINE}
    )
    hub.rate = 1 * MiB  # ~95 s for the whole file
    try:
        with httpx.stream("POST", server.url + "/api/pull", json={"model": NAME}, timeout=120) as r:
            for line in r.iter_lines():
                if json.loads(line).get("completed", 0) > 0:
                    break
            code = server.stop()
    finally:
        hub.rate = None
    assert code == 0, server.log()[-3000:]
    assert not _link(tmp_path).exists()
    assert [p.name.endswith(".incomplete") for p in _blobs(tmp_path).iterdir()] == [True]
