"""The OpenAI API of a real `elbowroom serve` (SmolLM2 on llama.cpp in a runner process),
driven by the official openai client; bad input of every kind; the ps/load/unload CLI."""

from __future__ import annotations

import json
import threading
import time
from typing import Any

import httpx
import openai
import pytest
from serverproc import ServerFactory, ServerProcess, pid_alive, runner_pid, wait_for

pytestmark = pytest.mark.slow

MODEL = "smollm2-135m"
HI = [{"role": "user", "content": "Say hello."}]


@pytest.fixture(scope="module")
def server(server_factory: ServerFactory) -> ServerProcess:
    return server_factory("--ctx", "1024")


def test_models_list(server: ServerProcess) -> None:
    models = {m.id: m for m in server.openai().models.list().data}
    assert {MODEL, "gemma3-270m"} <= set(models)
    raw = server.http().get(f"/v1/models/{MODEL}").json()
    assert raw["object"] == "model" and raw["kind"] == "llm" and raw["engine"] == "llama"


def test_chat_non_streaming(server: ServerProcess) -> None:
    out = server.openai().chat.completions.create(
        model=MODEL, messages=HI, max_tokens=8, temperature=0, seed=1
    )
    assert out.id.startswith("chatcmpl-") and out.model == MODEL
    choice = out.choices[0]
    assert choice.message.role == "assistant" and choice.message.content
    assert choice.finish_reason in ("stop", "length")
    assert out.usage is not None and out.usage.prompt_tokens > 0
    assert 0 < out.usage.completion_tokens <= 8
    assert out.usage.prompt_tokens_details is not None
    assert out.usage.prompt_tokens_details.cached_tokens is not None


def _engine_stats(server: ServerProcess) -> dict[str, Any]:
    (row,) = [r for r in server.ps() if r["id"] == MODEL]
    stats: dict[str, Any] = row["engine_stats"]
    return stats


def test_chat_streaming_with_usage(server: ServerProcess) -> None:
    # A system prompt longer than one 64-token cache block, so the repeat has cached tokens.
    msgs = [{"role": "system", "content": "You answer briefly and kindly. " * 16}, *HI]
    server.openai().chat.completions.create(model=MODEL, messages=msgs, max_tokens=1)
    direct_before = _engine_stats(server)["socket_streams"]["all"]
    stream = server.openai().chat.completions.create(
        model=MODEL,
        messages=msgs,
        max_tokens=8,
        temperature=0,
        stream=True,
        stream_options={"include_usage": True},
    )
    chunks = list(stream)
    # Relayed straight from the engine's socket (runtime/engine_events.py).
    assert _engine_stats(server)["socket_streams"]["all"] == direct_before + 1
    assert chunks[0].choices[0].delta.role == "assistant"
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert text.strip()
    finish = [
        c.choices[0].finish_reason for c in chunks if c.choices and c.choices[0].finish_reason
    ]
    assert len(finish) == 1 and finish[0] in ("stop", "length")
    usage = chunks[-1].usage
    assert chunks[-1].choices == [] and usage is not None and usage.completion_tokens > 0
    assert {c.model for c in chunks} == {MODEL}  # elbowroom's id, not the engine's file path
    assert usage.prompt_tokens_details is not None
    cached = usage.prompt_tokens_details.cached_tokens or 0
    assert cached > 0 and cached % 64 == 0  # whole cache blocks: the warm-up's prefix
    # Same prompt, greedy, not streamed: the same text.
    again = server.openai().chat.completions.create(
        model=MODEL, messages=msgs, max_tokens=8, temperature=0
    )
    assert again.choices[0].message.content == text


def test_completions(server: ServerProcess) -> None:
    client = server.openai()
    out = client.completions.create(
        model=MODEL, prompt="The capital of France is", max_tokens=5, temperature=0
    )
    assert out.object == "text_completion" and out.choices[0].text
    assert out.choices[0].finish_reason in ("stop", "length")
    streamed = list(
        client.completions.create(
            model=MODEL,
            prompt=["The capital of France is"],
            max_tokens=5,
            temperature=0,
            stream=True,
        )
    )
    assert "".join(c.choices[0].text for c in streamed) == out.choices[0].text
    assert streamed[-1].choices[0].finish_reason == out.choices[0].finish_reason


def test_stop_sequences_and_length(server: ServerProcess) -> None:
    out = server.openai().completions.create(
        model=MODEL, prompt="1, 2, 3, 4,", max_tokens=3, temperature=0
    )
    assert out.choices[0].finish_reason == "length"
    assert out.usage is not None and out.usage.completion_tokens == 3
    stopped = server.openai().completions.create(
        model=MODEL, prompt="1, 2, 3, 4,", max_tokens=20, temperature=0, stop=[","]
    )
    assert "," not in stopped.choices[0].text and stopped.choices[0].finish_reason == "stop"


def chat(**kw: Any) -> dict[str, Any]:
    body: dict[str, Any] = {"model": MODEL, "messages": HI, "max_tokens": 4}
    body.update(kw)
    return body


BAD = [
    # (name, path, json body or raw bytes, status, param)
    ("malformed json", "/v1/chat/completions", b'{"model": "smollm2-135m", ', 400, None),
    ("body is a list", "/v1/chat/completions", b"[1]", 400, None),
    ("messages not a list", "/v1/chat/completions", chat(messages="hi"), 400, "messages"),
    ("max_tokens a string", "/v1/chat/completions", chat(max_tokens="many"), 400, "max_tokens"),
    ("temperature a string", "/v1/chat/completions", chat(temperature="hot"), 400, "temperature"),
    ("unknown model", "/v1/chat/completions", chat(model="gpt-17"), 404, "model"),
    ("path traversal model", "/v1/chat/completions", chat(model="../../etc/passwd"), 404, "model"),
    ("empty messages", "/v1/chat/completions", chat(messages=[]), 400, "messages"),
    ("n=2", "/v1/chat/completions", chat(n=2), 400, "n"),
    ("negative max_tokens", "/v1/chat/completions", chat(max_tokens=-1), 400, "max_tokens"),
    ("absurd max_tokens", "/v1/chat/completions", chat(max_tokens=10**9), 400, "max_tokens"),
    ("prompt not a string", "/v1/completions", {"model": MODEL, "prompt": [1, 2]}, 400, "prompt"),
    ("wrong kind of model", "/v1/chat/completions", chat(model="whisper-tiny.en"), 400, "model"),
]


@pytest.mark.parametrize(("name", "path", "body", "status", "param"), BAD, ids=[b[0] for b in BAD])
def test_bad_input_gets_an_openai_error(
    server: ServerProcess, name: str, path: str, body: Any, status: int, param: str | None
) -> None:
    with server.http() as http:
        if isinstance(body, bytes):
            r = http.post(path, content=body, headers={"content-type": "application/json"})
        else:
            r = http.post(path, json=body)
    assert r.status_code == status, r.text
    err = r.json()["error"]
    assert err["message"] and err["type"] and "param" in err and "code" in err
    assert err["param"] == param


def test_errors_for_routes_and_ids(server: ServerProcess) -> None:
    with server.http() as http:
        for path in ("/v1/models/..%2F..%2Fetc%2Fpasswd", "/v1/models/nope", "/v1/nothing"):
            r = http.get(path)
            assert r.status_code == 404 and r.json()["error"]["type"] == "not_found_error"
        r = http.post("/api/models/..%2F..%2Fetc%2Fpasswd/load")
        assert r.status_code == 404 and r.json()["error"]["code"] == "model_not_found"
    with pytest.raises(openai.NotFoundError):
        server.openai().chat.completions.create(model="../../etc/passwd", messages=HI)


def test_prompt_over_the_context_is_a_400(server: ServerProcess) -> None:
    long_prompt = "word " * 3000  # well over --ctx 1024
    for stream in (False, True):
        with pytest.raises(openai.BadRequestError) as info:
            result = server.openai().chat.completions.create(
                model=MODEL, messages=[{"role": "user", "content": long_prompt}], stream=stream
            )
            list(result) if stream else None  # type: ignore[call-overload]
        assert info.value.code == "context_length_exceeded"
    # ... and the server still answers.
    ok = server.openai().chat.completions.create(model=MODEL, messages=HI, max_tokens=2)
    assert ok.choices[0].message.content is not None


def test_client_disconnect_mid_stream_frees_the_runner(server: ServerProcess) -> None:
    body = {
        "model": MODEL,
        "prompt": "1, 2, 3, 4, 5,",
        "max_tokens": 900,
        "temperature": 0,
        "stream": True,
    }
    with server.http() as http, http.stream("POST", "/v1/completions", json=body) as r:
        lines = r.iter_lines()
        first = next(line for line in lines if line.startswith("data: "))
        assert json.loads(first.removeprefix("data: "))["choices"]
    # The response is closed: the server must close the engine's request (cancel) ...
    wait_for(lambda: "client went away" in server.log(), timeout=30, what="the cancel log")
    # ... the model goes idle, its engine slot is given back, and the next request is served.
    wait_for(lambda: all(m["busy"] == 0 for m in server.ps()), timeout=60, what="idle runner")
    wait_for(lambda: _engine_stats(server)["slots_busy"] == 0, timeout=30, what="a free slot")
    ok = server.openai().completions.create(model=MODEL, prompt="Hi", max_tokens=2)
    assert ok.choices[0].text is not None


def test_cli_ps_load_unload(server: ServerProcess) -> None:
    loaded = server.cli("load", MODEL, "--pin", "--json")
    assert loaded.returncode == 0, loaded.stderr
    data = json.loads(loaded.stdout)
    assert data["model"] == MODEL and data["pinned"] is True
    pid = runner_pid(server, MODEL)
    assert pid is not None and pid_alive(pid)

    table = server.cli("ps")
    assert table.returncode == 0 and MODEL in table.stdout and "PINNED" in table.stdout
    # The footer says whose numbers these are: this machine's (a cluster says "cluster total").
    assert table.stdout.strip().splitlines()[-1].startswith("this machine: committed ")
    ps = json.loads(server.cli("ps", "--json").stdout)
    rows = ps["models"]
    assert [r["pinned"] for r in rows if r["id"] == MODEL] == [True]
    assert ps["memory"]["scope"] == "machine" and ps["memory"]["committed"] > 0

    # `elbowroom memory --url`: the running server's numbers (GET /api/memory), not a
    # standalone probe's (whose committed is always 0).
    memory = server.cli("memory")
    assert memory.returncode == 0, memory.stderr
    assert "one machine (these numbers are this machine's)" in memory.stdout
    report = json.loads(server.cli("memory", "--json").stdout)
    assert report["committed"] > 0 and report["ceiling"] > 0 and ps["memory"]["ceiling"] > 0
    assert "committed  0 B" not in memory.stdout and "by models" in memory.stdout

    unloaded = server.cli("unload", MODEL)
    assert unloaded.returncode == 0 and "unloaded" in unloaded.stdout
    wait_for(lambda: not pid_alive(pid), timeout=30, what="the runner to exit")
    assert runner_pid(server, MODEL) is None

    missing = server.cli("load", "no-such-model", "--json")
    assert missing.returncode == 1 and "does not exist" in missing.stderr
    assert json.loads(missing.stdout)["error"]["status"] == 404


def test_unreachable_server_is_a_clear_cli_error(server: ServerProcess) -> None:
    import subprocess
    import sys

    from serverproc import REPO

    r = subprocess.run(
        [sys.executable, "-m", "elbowroom", "ps", "--url", "http://127.0.0.1:9"],
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert r.returncode == 1 and "cannot reach the server" in r.stderr
    assert httpx.get(server.url + "/health").json() == {"status": "ok"}


def test_four_clients_are_served_at_once_in_four_slots(server: ServerProcess) -> None:
    """Continuous batching through the whole stack: every client's first token arrives
    before any client's reply is complete (served one after another, the 4th would wait
    for three whole replies)."""
    firsts: dict[int, float] = {}
    ends: dict[int, float] = {}
    errors: list[BaseException] = []

    def client(i: int) -> None:
        try:
            stream = server.openai().chat.completions.create(
                model=MODEL,
                messages=[{"role": "user", "content": f"Tell story number {i}."}],
                max_tokens=40,
                temperature=0,
                stream=True,
            )
            for chunk in stream:
                if chunk.choices and chunk.choices[0].delta.content:
                    firsts.setdefault(i, time.monotonic())
            ends[i] = time.monotonic()
        except BaseException as exc:
            errors.append(exc)

    threads = [threading.Thread(target=client, args=(i,)) for i in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=240)
    assert not errors and len(ends) == 4
    assert max(firsts.values()) < min(ends.values())
    (row,) = [r for r in server.ps() if r["id"] == MODEL]
    assert row["slots"] == 4 and row["waiting"] == 0


def test_client_disconnect_before_a_non_streamed_answer_cancels_it(server: ServerProcess) -> None:
    body = {"model": MODEL, "prompt": "1, 2, 3, 4, 5,", "max_tokens": 900, "temperature": 0}
    with server.http() as http, pytest.raises(httpx.ReadTimeout):
        # The client gives up long before 900 tokens and closes the connection.
        http.post("/v1/completions", json=body, timeout=httpx.Timeout(10.0, read=1.5))
    wait_for(
        lambda: "client went away before its answer" in server.log(),
        timeout=30,
        what="the cancel log",
    )
    wait_for(lambda: all(m["busy"] == 0 for m in server.ps()), timeout=30, what="idle runner")
    ok = server.openai().completions.create(model=MODEL, prompt="Hi", max_tokens=2)
    assert ok.usage is not None and ok.usage.completion_tokens == 2
