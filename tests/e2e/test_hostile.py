"""A real ``elbowroom serve`` against hostile clients (docs/security.md).

One server for the module, started as a user would with a small context (``--ctx 1024``),
a models folder holding three crafted GGUF files, and the body limits raised so that the
deeper checks (the JSON scan, the context bound) are the ones that answer. Each test sends
what an attacker, a web page or a buggy client would, and asserts the status, that no work
started, and that everyone else was still served meanwhile.
"""

from __future__ import annotations

import json
import os
import secrets
import socket
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit

import httpx
import pytest
from bundled_models import bundled_spec
from crafted_gguf import write_crafted_templates, write_hostile_models
from serverproc import REPO, ServerFactory, ServerProcess, runner_pid, wait_for

MODEL = "smollm2-135m"
CHAT = {"model": MODEL, "messages": [{"role": "user", "content": "Say hi."}], "max_tokens": 4}
EVIL = "https://evil.example"
HI = [{"role": "user", "content": "x"}]


@pytest.fixture(scope="module")
def models(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, dict[str, str]]:
    folder = tmp_path_factory.mktemp("hostile-models")
    write_crafted_templates(bundled_spec(MODEL).path, folder / "templates")
    return folder, write_hostile_models(folder)


@pytest.fixture(scope="module")
def templates(models: tuple[Path, dict[str, str]]) -> dict[str, str]:
    from crafted_gguf import CRAFTED_TEMPLATES

    return {name: why for name, (_, why) in CRAFTED_TEMPLATES.items()}


@pytest.fixture(scope="module")
def server(server_factory: ServerFactory, models: tuple[Path, dict[str, str]]) -> ServerProcess:
    return server_factory(
        "--ctx",
        "1024",
        "--models-dir",
        str(models[0]),
        env={
            "ELBOWROOM_MAX_BODY": "128MiB",
            "ELBOWROOM_MAX_CHARS": "100000000",
            # Short, so that the connection tests see them act within seconds.
            "ELBOWROOM_HEADER_TIMEOUT": "2",
            "ELBOWROOM_BODY_TIMEOUT": "3",
            "ELBOWROOM_MAX_CONNECTIONS": "96",
        },
    )


def server_pid(server: ServerProcess) -> int:
    assert server.proc is not None
    return server.proc.pid


def status_kb(pid: int, field: str) -> int:
    with open(f"/proc/{pid}/status") as f:
        for line in f:
            if line.startswith(field + ":"):
                return int(line.split()[1])
    raise AssertionError(f"no {field} for {pid}")


def nothing_loaded(server: ServerProcess) -> bool:
    return server.ps() == []


# --- web pages ----------------------------------------------------------------------------


@pytest.mark.slow
@pytest.mark.parametrize(
    ("content_type", "body"),
    [
        ("text/plain", json.dumps(CHAT)),  # fetch(url, {mode: "no-cors", body: JSON})
        ("application/x-www-form-urlencoded", "model=smollm2-135m&x=1"),  # <form method=post>
        (
            "multipart/form-data; boundary=b",
            '--b\r\nContent-Disposition: form-data; name="x"\r\n\r\n1\r\n--b--\r\n',
        ),
    ],
)
@pytest.mark.parametrize(
    "path", ["/v1/chat/completions", f"/api/models/{MODEL}/load", f"/api/models/{MODEL}/unload"]
)
def test_cross_site_posts_are_refused_before_any_work(
    server: ServerProcess, content_type: str, body: str, path: str
) -> None:
    headers = {
        "content-type": content_type,
        "origin": EVIL,
        "sec-fetch-site": "cross-site",
        "sec-fetch-mode": "no-cors",
    }
    r = httpx.post(server.url + path, content=body, headers=headers, timeout=10)
    assert r.status_code == 403, r.text
    assert r.json()["error"]["code"] == "origin_not_allowed"
    assert nothing_loaded(server)


@pytest.mark.slow
def test_a_rebinding_host_reads_nothing(server: ServerProcess) -> None:
    port = urlsplit(server.url).port
    for path in ("/v1/models", "/api/ps", "/api/memory", "/metrics"):
        # After DNS rebinding the page is "same-origin" with itself: Host and Origin agree.
        r = httpx.get(
            server.url + path,
            headers={"host": f"evil.example:{port}", "origin": f"http://evil.example:{port}"},
            timeout=10,
        )
        assert r.status_code == 403, (path, r.text)
        error = r.json()["error"]  # Ollama's shape on /api/ps: {"error": "message"}
        assert error["code"] == "host_not_allowed" if isinstance(error, dict) else "Host" in error
        assert "smollm2" not in r.text
    assert httpx.get(server.url + "/v1/models", timeout=10).status_code == 200


@pytest.mark.slow
def test_a_body_without_content_type_is_415(server: ServerProcess) -> None:
    r = httpx.post(server.url + "/v1/chat/completions", content=json.dumps(CHAT), timeout=10)
    assert "content-type" not in r.request.headers
    assert r.status_code == 415
    assert r.json()["error"]["code"] == "unsupported_media_type"
    assert nothing_loaded(server)


# --- sizes ----------------------------------------------------------------------------------


def raw_request(server: ServerProcess, head: str, timeout: float = 5.0) -> bytes:
    """Send only a request head (no body) on a raw socket; return what the server answers."""
    parts = urlsplit(server.url)
    with socket.create_connection((parts.hostname, parts.port), timeout=timeout) as sock:
        sock.sendall(head.encode())
        answer = b""
        while b"\r\n\r\n" not in answer or not answer.rstrip().endswith(b"}"):
            chunk = sock.recv(65536)
            if not chunk:
                break
            answer += chunk
    return answer


@pytest.mark.slow
def test_a_1gib_content_length_is_413_before_the_body(server: ServerProcess) -> None:
    began = time.perf_counter()
    answer = raw_request(
        server,
        "POST /v1/chat/completions HTTP/1.1\r\nHost: 127.0.0.1\r\n"
        "Content-Type: application/json\r\nContent-Length: 1073741824\r\n\r\n",
    )
    assert answer.startswith(b"HTTP/1.1 413"), answer[:200]
    assert b"request_too_large" in answer and b"max_body" in answer
    assert time.perf_counter() - began < 2.0  # answered without waiting for a GiB


class HealthProbe:
    """Polls /health and the server's RSS from a thread while the test sends something big."""

    def __init__(self, server: ServerProcess, pid: int) -> None:
        self.url = server.url + "/health"
        self.pid = pid
        self.latencies: list[float] = []
        self.peak_rss_kb = 0
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)

    def __enter__(self) -> HealthProbe:
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        self._thread.join(timeout=30)

    def _run(self) -> None:
        with httpx.Client(timeout=30) as client:
            while not self._stop.is_set():
                self.peak_rss_kb = max(self.peak_rss_kb, status_kb(self.pid, "VmRSS"))
                began = time.perf_counter()
                assert client.get(self.url).status_code == 200
                self.latencies.append(time.perf_counter() - began)
                self._stop.wait(0.02)

    def p99(self) -> float:
        ordered = sorted(self.latencies)
        return ordered[min(len(ordered) - 1, int(len(ordered) * 0.99))]

    def report(self, what: str) -> None:
        """The numbers benchmarks/results/hostile.md records (pytest -s shows them)."""
        ordered = sorted(self.latencies)
        print(
            f"\n/health during {what}: n={len(ordered)} "
            f"p50={ordered[len(ordered) // 2] * 1000:.1f} ms p99={self.p99() * 1000:.1f} ms "
            f"max={ordered[-1] * 1000:.1f} ms load={os.getloadavg()[0]:.2f}"
        )


def reset_peak_rss(pid: int) -> bool:
    """Reset VmHWM (Linux: write 5 to clear_refs), so the peak is this test's."""
    try:
        with open(f"/proc/{pid}/clear_refs", "w") as f:
            f.write("5")
    except OSError:
        return False
    return True


@pytest.mark.slow
def test_a_million_messages_cost_little_and_stall_no_one(server: ServerProcess) -> None:
    pid = server_pid(server)
    body = json.dumps({"model": MODEL, "messages": [{"role": "user", "content": "x"}] * 10**6})
    rss_before = status_kb(pid, "VmRSS")
    hwm = reset_peak_rss(pid)
    # The big body goes from another process: this one's threads only measure.
    sender = subprocess.Popen(
        [sys.executable, "-c", SEND_BODY, server.url + "/v1/chat/completions"],
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
    )
    with HealthProbe(server, pid) as probe:
        out, _ = sender.communicate(body.encode(), timeout=120)
    status, answer = out.decode().split(" ", 1)
    assert status == "413", answer
    assert json.loads(answer)["error"]["code"] == "json_too_large"
    peak = max(probe.peak_rss_kb, status_kb(pid, "VmHWM") if hwm else 0)
    assert (peak - rss_before) * 1024 < 100 * 1024**2, f"server grew {peak - rss_before} KiB"
    assert probe.latencies, "no /health answer while the body was sent"
    assert max(probe.latencies) < 1.0, f"/health took {max(probe.latencies):.2f} s"


SEND_BODY = """
import sys, httpx
r = httpx.post(sys.argv[1], content=sys.stdin.buffer.read(),
               headers={"content-type": "application/json"}, timeout=120)
print(r.status_code, r.text)
"""


def fifty_mb_prompt() -> bytes:
    head = b'{"model": "smollm2-135m", "messages": [{"role": "user", "content": "'
    return head + b"word " * 10_000_000 + b'"}]}'


@pytest.mark.slow
def test_a_50mb_prompt_against_a_1k_context_is_a_fast_400(server: ServerProcess) -> None:
    began = time.perf_counter()
    r = httpx.post(
        server.url + "/v1/chat/completions",
        content=fifty_mb_prompt(),
        headers={"content-type": "application/json"},
        timeout=60,
    )
    took = time.perf_counter() - began
    assert r.status_code == 400, r.text[:300]
    err = r.json()["error"]
    assert (err["code"], err["param"]) == ("context_length_exceeded", "messages")
    assert "1024" in err["message"]
    assert took < 5.0, f"{took:.1f} s"
    assert nothing_loaded(server)  # refused before any runner was started for it


@pytest.mark.slow
def test_a_50mb_prompt_kills_no_runner(server: ServerProcess) -> None:
    """With the model loaded: the refusal never reaches the runner (needs the LLM engine)."""
    r = httpx.post(server.url + f"/api/models/{MODEL}/load", timeout=180)
    assert r.status_code == 200, r.text
    pid = runner_pid(server, MODEL)
    assert pid is not None
    bad = httpx.post(
        server.url + "/v1/chat/completions",
        content=fifty_mb_prompt(),
        headers={"content-type": "application/json"},
        timeout=60,
    )
    assert bad.status_code == 400
    assert runner_pid(server, MODEL) == pid  # the same runner, alive and ready
    ok = httpx.post(server.url + "/v1/chat/completions", json=CHAT, timeout=120)
    assert ok.status_code == 200, ok.text
    httpx.post(server.url + f"/api/models/{MODEL}/unload", timeout=60)
    wait_for(lambda: nothing_loaded(server), timeout=30, what="the unload")


# --- round 2 (issue 28): grammars, integers, prompts, connections ----------------------------


# /health's p99 while an attack runs. The target is 250 ms (benchmarks/results/hostile.md
# records it with the load average); a test on a shared machine allows a second, as the
# million-messages test above does.
HEALTH_P99 = 1.0


def enum_schema(n: int) -> dict[str, Any]:
    return {
        "type": "object",
        "properties": {"c": {"enum": [secrets.token_hex(4) for _ in range(n)]}},
    }


@pytest.mark.slow
@pytest.mark.parametrize(
    ("path", "extra"),
    [
        (
            "/v1/chat/completions",
            {
                "response_format": {
                    "type": "json_schema",
                    "json_schema": {"name": "x", "schema": enum_schema(30_000)},
                }
            },
        ),
        ("/api/chat", {"format": enum_schema(30_000), "stream": False}),
        ("/api/chat", {"format": enum_schema(1_000), "stream": False}),
    ],
)
def test_a_grammar_bomb_is_a_400_and_no_runner_sees_it(
    server: ServerProcess, path: str, extra: dict[str, Any]
) -> None:
    """An enum of 30,000 strings froze the model for everyone for 10+ minutes."""
    body = {"model": MODEL, "messages": HI, **extra}
    with HealthProbe(server, server_pid(server)) as probe:
        began = time.perf_counter()
        r = httpx.post(server.url + path, json=body, timeout=60)
        took = time.perf_counter() - began
        time.sleep(0.5)
    assert r.status_code == 400, r.text[:300]
    assert "max_schema_" in r.text
    assert took < 5.0
    assert nothing_loaded(server)
    probe.report(f"a grammar bomb on {path}")
    assert probe.p99() < HEALTH_P99


# 52 bytes, every repetition at max_schema_repeat, one member: inside every schema bound.
NESTED_REPEATS = {"type": "string", "pattern": "^(((a?){0,1024}){0,1024}){0,1024}$"}


@pytest.mark.slow
def test_a_schema_inside_the_bounds_stalls_no_other_slot(server: ServerProcess) -> None:
    """As GBNF (llama.cpp's chat path) this schema kept the engine's loop for good: another
    slot's 2-token chat never answered (``^((a?){0,32}){0,32}$`` alone held it 16 s). As
    an llguidance grammar (engines/llama_grammar.py) it costs what a plain request costs;
    and a schema llguidance cannot compile is a 400, not an unconstrained answer."""
    fmt = {"type": "json_schema", "json_schema": {"name": "x", "schema": NESTED_REPEATS}}
    answers: list[httpx.Response] = []

    def constrained() -> None:
        body = {**CHAT, "max_tokens": 24, "response_format": fmt}
        answers.append(httpx.post(server.url + "/v1/chat/completions", json=body, timeout=600))

    def started() -> bool:
        rows = [row for row in server.ps() if row["id"] == MODEL]
        return bool(answers) or bool(rows and rows[0]["busy"] > 0)

    worker = threading.Thread(target=constrained, daemon=True)
    worker.start()
    wait_for(started, timeout=120, what="the constrained request to reach the engine")
    plain_body = {**CHAT, "max_tokens": 2}
    plain = httpx.post(server.url + "/v1/chat/completions", json=plain_body, timeout=120)
    assert plain.status_code == 200, plain.text[:300]
    worker.join(timeout=120)
    assert answers and answers[0].status_code == 200, answers and answers[0].text[:300]
    choice = answers[0].json()["choices"][0]
    if choice["finish_reason"] == "stop":
        assert set(json.loads(choice["message"]["content"])) <= {"a"}
    foo = {"type": "json_schema", "json_schema": {"name": "x", "schema": {"type": "foo"}}}
    bad = {**CHAT, "response_format": foo}
    r = httpx.post(server.url + "/v1/chat/completions", json=bad, timeout=120)
    assert r.status_code == 400, r.text[:300]
    assert r.json()["error"]["code"] == "invalid_schema" and "foo" in r.json()["error"]["message"]
    httpx.post(server.url + f"/api/models/{MODEL}/unload", timeout=60)  # as the module found it
    wait_for(lambda: nothing_loaded(server), timeout=60, what="the unload")


@pytest.mark.slow
def test_32mb_of_long_integers_is_a_400_and_stalls_no_one(server: ServerProcess) -> None:
    """4,299-digit integers (just inside Python's limit): 1.6 s per /health."""
    body = b'{"model": "smollm2-135m", "seed": [' + b",".join([b"7" * 4299] * 7400) + b"]}"
    with HealthProbe(server, server_pid(server)) as probe:
        outs = []
        senders = [
            subprocess.Popen(
                [sys.executable, "-c", SEND_BODY, server.url + "/v1/chat/completions"],
                stdin=subprocess.PIPE,
                stdout=subprocess.PIPE,
            )
            for _ in range(4)
        ]
        for sender in senders:
            assert sender.stdin is not None
            sender.stdin.write(body)
            sender.stdin.close()
        for sender in senders:
            assert sender.stdout is not None
            outs.append(sender.stdout.read().decode())
            sender.wait(timeout=120)
    for out in outs:
        status, answer = out.split(" ", 1)
        assert status == "400", answer[:300]
        assert json.loads(answer)["error"]["code"] == "integer_too_long"
    probe.report("four 32 MB bodies of 4,299-digit integers")
    assert probe.p99() < HEALTH_P99


LONG_INTEGER = b"9" * 100_000


@pytest.mark.slow
def test_a_100000_digit_integer_is_a_400_in_each_api_s_shape(server: ServerProcess) -> None:
    """The body scan refuses an integer over ``max_int_digits`` before anything parses the
    body, on OpenAI's routes and Ollama's in their own error shapes, while /health is
    answered; nothing is loaded for it."""
    head = b'{"model": "smollm2-135m", "messages": [{"role": "user", "content": "x"}], '
    bodies = {
        "/v1/chat/completions": head + b'"seed": ' + LONG_INTEGER + b"}",
        "/api/chat": head + b'"options": {"seed": ' + LONG_INTEGER + b"}}",
    }
    answers: list[tuple[str, httpx.Response, float]] = []
    loaded = [row["id"] for row in server.ps()]

    def send(path: str) -> None:
        for _ in range(5):
            began = time.monotonic()
            r = httpx.post(
                server.url + path,
                content=bodies[path],
                headers={"content-type": "application/json"},
                timeout=120,
            )
            answers.append((path, r, time.monotonic() - began))

    senders = [threading.Thread(target=send, args=(path,)) for path in [*bodies, *bodies]]
    for sender in senders:
        sender.start()
    health = []
    while any(sender.is_alive() for sender in senders):
        health.append(httpx.get(server.url + "/health", timeout=30).status_code)
    for sender in senders:
        sender.join()
    assert health and set(health) == {200}
    assert len(answers) == 20
    for path, r, took in answers:
        assert r.status_code == 400, r.text[:300]
        assert "max_int_digits" in r.text and str(len(LONG_INTEGER)) in r.text
        if path.startswith("/api/"):
            assert isinstance(r.json()["error"], str)  # Ollama's shape
        else:
            assert r.json()["error"]["code"] == "integer_too_long"
        assert took < 60  # no parse of 100,000 digits, on a busy machine too
    assert [row["id"] for row in server.ps()] == loaded  # no runner started for them


@pytest.mark.slow
def test_a_4m_character_system_prompt_is_a_fast_400(server: ServerProcess) -> None:
    """It reached the runner, which tokenized 2 M tokens for 13-16 s before its 400."""
    body = {"model": MODEL, "prompt": "hi", "system": "word " * 800_000, "stream": False}
    began = time.perf_counter()
    r = httpx.post(server.url + "/api/generate", json=body, timeout=60)
    assert r.status_code == 400, r.text[:300]
    assert "characters" in r.json()["error"]
    assert time.perf_counter() - began < 5.0
    tool = {"type": "function", "function": {"name": "f", "description": "word " * 800_000}}
    r = httpx.post(
        server.url + "/v1/chat/completions",
        json={"model": MODEL, "messages": HI, "tools": [tool]},
        timeout=60,
    )
    assert r.status_code == 400 and r.json()["error"]["code"] == "context_length_exceeded"
    assert nothing_loaded(server)


def half_sent(server: ServerProcess, head: str) -> socket.socket:
    parts = urlsplit(server.url)
    sock = socket.create_connection((parts.hostname, parts.port), timeout=30)
    sock.sendall(head.encode())
    return sock


def closed_by_server(sock: socket.socket) -> bytes | None:
    """What the server sent before closing; None while it is still open."""
    sock.setblocking(False)
    try:
        data = sock.recv(65536)
    except BlockingIOError:
        return None
    except ConnectionResetError:
        return b""
    return data  # b"": closed; bytes: its last answer (a 503), then closed


@pytest.mark.slow
def test_half_sent_heads_are_closed_and_health_is_answered(server: ServerProcess) -> None:
    """~20,000 half-sent requests used up the open files; /health failed 62 of 62."""
    socks: list[socket.socket] = []
    with HealthProbe(server, server_pid(server)) as probe:
        try:
            for _ in range(400):  # > max_connections (96): the oldest heads make room
                socks.append(half_sent(server, "POST /v1/chat/completions HTTP/1.1\r\nHost: x"))
            # Every one is closed by the header timeout (2 s) or to make room.
            wait_for(
                lambda: all(closed_by_server(s) is not None for s in socks),
                timeout=30,
                what="the half-sent connections to be closed",
            )
        finally:
            for s in socks:
                s.close()
    probe.report("400 half-sent request heads")
    assert probe.p99() < HEALTH_P99


@pytest.mark.slow
def test_stalled_bodies_hold_no_budget_and_time_out(server: ServerProcess) -> None:
    """Four connections declaring 32 MiB bodies and sending nothing made every request over
    256 KiB a 503 for as long as they stayed; one 128 MiB /api/chat did it alone."""
    head = (
        "POST {path} HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Type: application/json\r\n"
        "Content-Length: {n}\r\n\r\n{{"
    )
    stalled = [
        half_sent(server, head.format(path="/v1/chat/completions", n=32 * 1024**2))
        for _ in range(4)
    ]
    stalled.append(half_sent(server, head.format(path="/api/chat", n=128 * 1024**2)))
    try:
        big = {"model": "no-such-model", "messages": [{"role": "user", "content": "z" * 400_000}]}
        r = httpx.post(server.url + "/v1/chat/completions", json=big, timeout=30)
        assert r.status_code == 404, r.text[:300]  # read and routed: not 503
        # body_timeout (3 s): each stalled one gets 408 and is closed.
        for sock in stalled:
            sock.settimeout(30)
            answer = sock.recv(65536)
            assert answer.startswith(b"HTTP/1.1 408"), answer[:200]
    finally:
        for sock in stalled:
            sock.close()


@pytest.mark.slow
def test_a_1gib_content_length_on_ollama_routes_is_413(server: ServerProcess) -> None:
    for path in ("/api/chat", "/api/generate", "/api/embed"):
        answer = raw_request(
            server,
            f"POST {path} HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Length: 1073741824\r\n\r\n",
        )
        assert answer.startswith(b"HTTP/1.1 413"), (path, answer[:200])
        assert b"max_body" in answer


@pytest.mark.slow
def test_inference_keys_see_no_pids_and_runners_get_no_keys(
    server_factory: ServerFactory,
) -> None:
    keyed = server_factory(
        env={"ELBOWROOM_API_KEY": "inference-key-28", "ELBOWROOM_ADMIN_KEY": "admin-key-28"}
    )
    keyed.api_key = "admin-key-28"  # for its admin calls (load, ps)
    r = httpx.post(keyed.url + f"/api/models/{MODEL}/load", headers=keyed.headers, timeout=180)
    assert r.status_code == 200, r.text
    pid = runner_pid(keyed, MODEL)
    assert pid is not None
    with open(f"/proc/{pid}/environ", "rb") as f:
        environ = f.read()
    assert b"key-28" not in environ
    # The runner's own memory ceiling (runner_memory_ceiling), above what it holds.
    with open(f"/proc/{pid}/limits") as f:
        data_line = next(line for line in f if line.startswith("Max data size"))
    ceiling = int(data_line.split()[3])
    assert status_kb(pid, "VmData") * 1024 < ceiling < 64 * 1024**3, data_line
    chat = httpx.post(
        keyed.url + "/v1/chat/completions", json=CHAT, headers=keyed.headers, timeout=120
    )
    assert chat.status_code == 200, chat.text
    seen = httpx.get(
        keyed.url + "/api/ps", headers={"Authorization": "Bearer inference-key-28"}, timeout=30
    ).json()["models"]
    assert [m["name"] for m in seen] == [f"{MODEL}:latest"] and "pid" not in seen[0]
    assert str(pid) not in json.dumps(seen)


# --- metrics --------------------------------------------------------------------------------


def series(server: ServerProcess) -> set[str]:
    text = httpx.get(server.url + "/metrics", timeout=30).text
    return {line.rsplit(" ", 1)[0] for line in text.splitlines() if line and line[0] != "#"}


def random_names(server: ServerProcess, n: int, connections: int = 8) -> list[int]:
    """``n`` chat requests naming random models, pipelined on raw keep-alive connections
    (an HTTP client's own overhead would dominate the time); returns their statuses."""
    parts = urlsplit(server.url)
    statuses: list[int] = []

    def one_connection(count: int) -> None:
        with socket.create_connection((parts.hostname, parts.port), timeout=60) as sock:
            requests = []
            for _ in range(count):
                body = json.dumps({"model": secrets.token_hex(12), "messages": HI}).encode()
                requests.append(
                    b"POST /v1/chat/completions HTTP/1.1\r\nHost: 127.0.0.1\r\n"
                    b"Content-Type: application/json\r\nContent-Length: %d\r\n\r\n%s"
                    % (len(body), body)
                )
            sender = threading.Thread(target=sock.sendall, args=(b"".join(requests),))
            sender.start()
            buf = b""
            for _ in range(count):
                while b"\r\n\r\n" not in buf:
                    buf += sock.recv(65536)
                head, buf = buf.split(b"\r\n\r\n", 1)
                length = int(head.lower().split(b"content-length: ", 1)[1].split(b"\r\n")[0])
                while len(buf) < length:
                    buf += sock.recv(65536)
                buf = buf[length:]
                statuses.append(int(head.split(b" ", 2)[1]))
            sender.join()

    threads = [
        threading.Thread(target=one_connection, args=(n // connections,))
        for _ in range(connections)
    ]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=300)
    return statuses


@pytest.mark.slow
def test_ten_thousand_random_model_names_add_no_series(server: ServerProcess) -> None:
    random_names(server, 8)  # the "-"/404 series exist from here on
    before = series(server)
    statuses = random_names(server, 10_000)
    assert len(statuses) == 10_000 and set(statuses) == {404}
    after = series(server)
    grown = {s for s in after - before if "model=" in s}
    assert grown == set(), sorted(grown)[:5]
    assert len(after) == len(before)


# --- model files ----------------------------------------------------------------------------


@pytest.mark.slow
def test_crafted_ggufs_are_listed_as_problems_and_serve_starts(
    server: ServerProcess, models: tuple[Path, dict[str, str]]
) -> None:
    folder, expected = models
    listing = httpx.get(server.url + "/api/elbowroom/models", timeout=30).json()
    reasons = {Path(p["path"]).name: p["reason"] for p in listing["problems"]}
    assert set(reasons) == set(expected)
    for name, why in expected.items():
        assert why in reasons[name]
    ids = {m["id"] for m in httpx.get(server.url + "/v1/models", timeout=30).json()["data"]}
    assert MODEL in ids and not any(i.startswith(("nested", "array", "negative")) for i in ids)
    env = {k: v for k, v in os.environ.items() if not k.startswith("ELBOWROOM_")}
    env["XDG_DATA_HOME"] = str(server.home / "data")
    env["XDG_CONFIG_HOME"] = str(server.home / "config")
    ls = subprocess.run(
        [sys.executable, "-m", "elbowroom", "ls", "--json", "--models-dir", str(folder)],
        cwd=REPO,
        env=env,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert ls.returncode == 0, ls.stderr
    assert {Path(p["path"]).name for p in json.loads(ls.stdout)["problems"]} == set(expected)


@pytest.mark.slow
@pytest.mark.parametrize("name", ["template-loop", "template-recursive", "template-nested"])
def test_a_crafted_chat_template_is_a_fast_422_and_others_keep_serving(
    server: ServerProcess, templates: dict[str, str], name: str
) -> None:
    """Issue 28: the loop spun a loading runner until load_timeout (180 s) and up to 23.6 GB;
    the recursive macro crashed it on every load. The template check renders it in a
    bounded child first: a 422 in seconds, no runner, and the verdict is remembered."""
    for attempt in range(2):
        started = time.monotonic()
        r = httpx.post(
            server.url + "/v1/chat/completions", json={**CHAT, "model": name}, timeout=170
        )
        took = time.monotonic() - started
        assert r.status_code == 422, r.text
        error = r.json()["error"]
        assert error["code"] == "chat_template_unsafe"
        assert templates[name] in error["message"] and "chat_template_check" in error["message"]
        # Far inside load_timeout (180 s), even on a busy machine: the CPU bound is 3 s.
        assert took < 90, f"attempt {attempt}: {took:.1f} s"
        assert all(m["id"] != name for m in server.ps())
    ollama = httpx.post(
        server.url + "/api/chat",
        json={"model": name, "messages": HI, "stream": False},
        timeout=170,
    )
    assert ollama.status_code == 422 and "the chat template in" in ollama.json()["error"]
    assert (
        httpx.post(server.url + "/v1/chat/completions", json=CHAT, timeout=170).status_code == 200
    )


@pytest.mark.slow
def test_the_server_survived_all_of_it(server: ServerProcess) -> None:
    """Last in the module: the same server process, healthy, no runner left behind."""
    assert server.proc is not None and server.proc.poll() is None
    assert httpx.get(server.url + "/health", timeout=5).status_code == 200
    assert "Traceback" not in server.log()
