"""Limits that act before any work: body bytes, JSON values and depth, messages, characters,
stop strings, the cheap context bound; and the 500s that tell nothing but an error id."""

from __future__ import annotations

import asyncio
import json
import time
from collections.abc import Callable
from dataclasses import replace
from typing import Any

import pytest
from server_fakes import FakeCatalog, FakeScheduler, Harness, http_scope, spec
from starlette.testclient import TestClient

from elbowroom.config import Settings
from elbowroom.errors import BadRequest, EngineError
from elbowroom.models.spec import GGUFInfo
from elbowroom.server.app import create_app
from elbowroom.server.deps import Services
from elbowroom.server.http import jsonscan
from elbowroom.server.http.jsonscan import Limits, inspect, min_tokens, scan

LIMITS = Limits(
    max_values=1000, max_depth=8, max_chars=10_000, max_messages=10, max_stop=4, max_stop_chars=8
)


def msgs(n: int, text: str = "x") -> list[dict[str, str]]:
    return [{"role": "user", "content": text}] * n


def post(h: Harness, body: Any, path: str = "/v1/chat/completions") -> tuple[int, dict]:
    r = h.client.post(path, json=body)
    return r.status_code, r.json()


# --- the pure scan ----------------------------------------------------------------------


def test_scan_counts_without_parsing() -> None:
    assert scan(b'{"a": [1, 2, 3], "b": "x,y[{"}', 100, 8) == 8  # 4 strings, 2 [{, 2 commas
    # escaped quotes and backslashes do not end a string
    assert scan(rb'["a\"],[", "b\\", "c"]', 100, 8) == 6


def test_scan_stops_at_the_limits() -> None:
    with pytest.raises(Exception, match="max_json_values") as err:
        scan(b"[" + b"1," * 10_000 + b"1]", 1000, 8)
    assert getattr(err.value, "status", None) == 413
    with pytest.raises(Exception, match="max_json_depth") as err:
        scan(b"[" * 9 + b"]" * 9, 1000, 8)
    assert getattr(err.value, "status", None) == 400


def test_scan_of_a_crafted_escape_body_is_fast() -> None:
    body = b'{"prompt": "' + b'\\"' * 5_000_000 + b'"}'
    began = time.perf_counter()
    assert scan(body, 1000, 8) == 3
    assert time.perf_counter() - began < 1.0


def test_scan_of_a_million_messages_stops_early() -> None:
    body = json.dumps({"messages": msgs(1_000_000)}).encode()
    began = time.perf_counter()
    with pytest.raises(Exception, match="max_json_values"):
        scan(body, 100_000, 64)
    assert time.perf_counter() - began < 1.0  # ~100k matches, not 4M


def _whole_structure(body: bytes) -> bytes:
    """The scan's view of a body as it was computed before pieces: one call each."""
    text = body.replace(b"\\\\", b"__").replace(b'\\"', b"__")
    return text.translate(None, jsonscan._UNSEEN)


def test_structure_in_pieces_is_the_whole_body_s(monkeypatch: pytest.MonkeyPatch) -> None:
    import random

    rng = random.Random(28)
    monkeypatch.setattr(jsonscan, "PIECE", 5)
    alphabet = [b"\\", b"\\", b"\\", b'"', b"a", b"[", b"]", b",", b"{", b"}"]
    for _ in range(2000):
        body = b"".join(rng.choice(alphabet) for _ in range(rng.randrange(0, 40)))
        assert jsonscan.structure(body) == _whole_structure(body), body
    # runs of backslashes longer than a piece, odd and even, before a quote
    for run in range(0, 23):
        body = b'["' + b"\\" * run + b'", "x"]'
        assert jsonscan.structure(body) == _whole_structure(body), run


def test_decode_in_pieces_is_json_s(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(jsonscan, "PIECE", 3)
    doc = {"k": "h\u00e9llo \u2603 \U0001f600", "n": [1, 2]}
    for raw in (
        json.dumps(doc, ensure_ascii=False).encode(),
        json.dumps(doc).encode("utf-16"),
        json.dumps(doc).encode("utf-32-le"),
        b"\xef\xbb\xbf" + json.dumps(doc).encode(),
    ):
        assert json.loads(jsonscan.decode(raw)) == json.loads(raw) == doc
    with pytest.raises(ValueError):
        jsonscan.decode(b'{"a": "\xff"}')


class _Watched(bytearray):
    """A body that records every whole-body C call made on it (each holds the interpreter
    lock for as long as the body is long)."""

    calls: list[str]

    def translate(self, *args: Any, **kwargs: Any) -> bytearray:
        self.calls.append("translate")
        return super().translate(*args, **kwargs)

    def replace(self, *args: Any, **kwargs: Any) -> bytearray:
        self.calls.append("replace")
        return super().replace(*args, **kwargs)

    def decode(self, *args: Any, **kwargs: Any) -> str:
        self.calls.append("decode")
        return super().decode(*args, **kwargs)


def test_a_large_body_is_worked_through_in_pieces() -> None:
    """Four 32 MB bodies of 4,299-digit integers held /health up to 290 ms: their
    translate and json.loads' decode each ran over the whole body in one call, holding the
    interpreter lock throughout. Every pass over the body now goes in pieces."""
    body = _Watched(b'{"seed": [' + b",".join([b"7" * 4299] * 500) + b'], "p": "\\\\"}')
    body.calls = []
    with pytest.raises(Exception, match="max_int_digits"):
        inspect(body, "/v1/chat/completions", LIMITS)
    assert body.calls == []


def test_long_integers_are_refused_in_the_first_piece_before_any_decode(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Issue 28: four 32 MB bodies of 4,299-digit integers were translated and decoded
    whole (~300 ms of interpreter each) before json.loads' ``parse_int`` refused their first
    integer; /health waited up to 489 ms. The scan's first piece refuses them now."""
    pieces: list[int] = []
    watch_piece = jsonscan.IntegerWatch.piece

    def counted(self: jsonscan.IntegerWatch, piece: bytes | bytearray) -> None:
        pieces.append(len(piece))
        watch_piece(self, piece)

    def no_decode(body: bytes | bytearray) -> str:
        raise AssertionError("decoded")

    monkeypatch.setattr(jsonscan.IntegerWatch, "piece", counted)
    monkeypatch.setattr(jsonscan, "decode", no_decode)
    body = b'{"model": "m", "seed": [' + b",".join([b"7" * 4299] * 7400) + b"]}"
    with pytest.raises(BadRequest) as err:
        inspect(body, "/v1/chat/completions", LIMITS)
    assert err.value.code == "integer_too_long" and err.value.status == 400
    assert "max_int_digits" in err.value.message and "64 are allowed" in err.value.message
    assert pieces == [jsonscan.PIECE]


def _digits_over(limit: int) -> Callable[[str], Any]:
    """The parser's view of the watch's rule: an integer, or a number's integer part, of
    more than ``limit`` digits is refused."""

    def parse(text: str) -> Any:
        whole = text.lstrip("-")
        run = len(whole) - len(whole.lstrip("0123456789"))
        if run > limit:
            raise BadRequest("long", code="integer_too_long")
        return float(text)

    return parse


def _number(rng: Any) -> str:
    def digits() -> str:
        return "".join(rng.choice("0123456789") for _ in range(rng.randrange(1, 12)))

    kind = rng.randrange(4)
    if kind == 0:
        return rng.choice(["", "-"]) + digits()
    if kind == 1:
        return f"{digits()}.{digits()}"
    return digits() + rng.choice("eE") + rng.choice(["", "+", "-"]) + digits()


def _document(rng: Any, depth: int = 0) -> str:
    kind = rng.random()
    if depth > 3 or kind < 0.35:
        return _number(rng)
    if kind < 0.6:
        return json.dumps("".join(rng.choice('123\\"a,[ e.') for _ in range(rng.randrange(15))))
    if kind < 0.65:
        return rng.choice(["true", "false", "null"])
    if kind < 0.82:
        items = ", ".join(_document(rng, depth + 1) for _ in range(rng.randrange(5)))
        return f"[{items}]"
    keys = [json.dumps(_number(rng)) for _ in range(rng.randrange(4))]
    return "{" + ", ".join(f"{k}: {_document(rng, depth + 1)}" for k in keys) + "}"


@pytest.mark.parametrize("piece", [1, 2, 3, 8, 64])
def test_the_integer_watch_refuses_what_the_parser_would_and_nothing_else(
    monkeypatch: pytest.MonkeyPatch, piece: int
) -> None:
    """Digits in strings (escaped quotes included), fractions and exponents pass; an
    integer (part) of more than the limit is refused wherever the pieces cut it."""
    import random

    monkeypatch.setattr(jsonscan, "PIECE", piece)
    rng = random.Random(piece)
    refused = 0
    for _ in range(1500):
        text = _document(rng)
        try:
            json.loads(text, parse_int=_digits_over(6), parse_float=_digits_over(6))
            expected = False
        except BadRequest:
            expected = True
        except ValueError:
            continue  # not JSON (a leading zero): the parser's to judge
        try:
            jsonscan.structure(text.encode(), jsonscan.IntegerWatch(6))
            got = False
        except BadRequest:
            got = True
        assert got == expected, text
        refused += got
    assert refused > 100  # the documents hit the limit often


@pytest.mark.parametrize(
    ("body", "refused"),
    [
        (b'{"p": "' + b"1" * 1000 + b'"}', False),  # digits in a string
        (b'{"p": "a\\"' + b"1" * 1000 + b'"}', False),  # after an escaped quote
        (b'{"p": "a\\\\", "q": ' + b"1" * 1000 + b"}", True),  # after an escaped backslash
        (b"[0." + b"1" * 1000 + b"]", False),  # a fraction
        (b"[1e-" + b"0" * 1000 + b"]", False),  # an exponent
        (b"[-" + b"1" * 65 + b"]", True),
        (b"[" + b"1" * 64 + b", " + b"2" * 64 + b"]", False),
        (b"[" + b"1" * 65 + b".5]", True),  # a float's integer part
    ],
)
def test_the_integer_watch_cases(
    monkeypatch: pytest.MonkeyPatch, body: bytes, refused: bool
) -> None:
    for piece in (7, 1 << 18):
        monkeypatch.setattr(jsonscan, "PIECE", piece)
        if refused:
            with pytest.raises(BadRequest, match="max_int_digits"):
                scan(body, 100, 8, 64)
        else:
            assert scan(body, 100, 8, 64) >= 1


def test_inspect_checks() -> None:
    ok = inspect(
        json.dumps({"messages": msgs(3, "hello")}).encode(), "/v1/chat/completions", LIMITS
    )
    assert ok.prompt_chars == 15 and ok.chars > 15
    parts = {"messages": [{"role": "user", "content": [{"type": "text", "text": "abc"}]}]}
    assert inspect(json.dumps(parts).encode(), "/v1/chat/completions", LIMITS).prompt_chars == 3
    prompt = {"prompt": ["abcd"]}
    assert inspect(json.dumps(prompt).encode(), "/v1/completions", LIMITS).prompt_chars == 4
    cases = [
        ({"messages": msgs(11)}, 413, "too_many_messages"),
        ({"prompt": "x" * 10_001}, 413, "too_many_characters"),
        ({"prompt": "x", "stop": ["a"] * 5}, 400, "too_many_stop_strings"),
        ({"prompt": "x", "stop": "123456789"}, 400, "stop_too_long"),
    ]
    for body, status, code in cases:
        with pytest.raises(Exception) as err:
            inspect(json.dumps(body).encode(), "/v1/completions", LIMITS)
        assert (getattr(err.value, "status", None), getattr(err.value, "code", None)) == (
            status,
            code,
        )
    with pytest.raises(Exception, match="not valid JSON"):
        inspect(b'{"prompt": ', "/v1/completions", LIMITS)


def test_min_tokens() -> None:
    assert min_tokens(1000, 48) == 21
    assert min_tokens(0, 48) == 0
    assert min_tokens(10, 0) == 10  # a vocabulary that says nothing: one char per token


# --- through the app --------------------------------------------------------------------


def test_message_char_and_stop_limits_answer_before_work(
    make_harness: Callable[..., Harness],
) -> None:
    h = make_harness(max_messages=4, max_chars=100, max_stop=2, max_stop_chars=5)
    assert post(h, {"model": "smollm2-135m", "messages": msgs(4)})[0] == 200
    status, body = post(h, {"model": "smollm2-135m", "messages": msgs(5)})
    assert (status, body["error"]["code"]) == (413, "too_many_messages")
    assert "max_messages" in body["error"]["message"]
    status, body = post(h, {"model": "smollm2-135m", "messages": msgs(1, "y" * 101)})
    assert (status, body["error"]["code"]) == (413, "too_many_characters")
    status, body = post(h, {"model": "smollm2-135m", "messages": msgs(1), "stop": ["a", "b", "c"]})
    assert (status, body["error"]["param"]) == (400, "stop")
    assert len(h.scheduler.uses) == 1


def test_default_stop_limit_is_openai_s_four(harness: Harness) -> None:
    base = {"model": "smollm2-135m", "messages": msgs(1)}
    assert post(harness, {**base, "stop": ["a", "b", "c", "d"]})[0] == 200
    assert post(harness, {**base, "stop": ["a", "b", "c", "d", "e"]})[0] == 400


def test_json_values_and_depth(make_harness: Callable[..., Harness]) -> None:
    h = make_harness(max_json_values=50, max_json_depth=5)
    assert post(h, {"model": "smollm2-135m", "messages": msgs(30)})[0] == 413
    deep: Any = "x"
    for _ in range(10):
        deep = [deep]
    status, body = post(h, {"model": "smollm2-135m", "messages": msgs(1), "x": deep})
    assert (status, body["error"]["code"]) == (400, "json_too_deep")
    r = h.client.post(
        "/v1/chat/completions",
        content=b'{"model": "smo',
        headers={"content-type": "application/json"},
    )
    assert r.status_code == 400 and "not valid JSON" in r.json()["error"]["message"]


def asgi_post(
    app: Any, headers: list[tuple[bytes, bytes]], chunks: list[bytes]
) -> tuple[int, dict, int]:
    """One POST straight into the ASGI app, the body in ``chunks`` (what a server passes on);
    returns the status, the JSON body and how many body messages the app read."""
    sent: list[dict[str, Any]] = []
    pending = [
        {"type": "http.request", "body": c, "more_body": i < len(chunks) - 1}
        for i, c in enumerate(chunks)
    ]
    read = 0

    async def receive() -> dict[str, Any]:
        nonlocal read
        if pending:
            read += 1
            return pending.pop(0)
        await asyncio.sleep(3600)
        return {"type": "http.disconnect"}

    async def send(message: dict[str, Any]) -> None:
        sent.append(message)

    scope = http_scope(
        "/v1/chat/completions",
        [(b"host", b"localhost"), (b"content-type", b"application/json"), *headers],
        app=app,
    )
    asyncio.run(asyncio.wait_for(app(scope, receive, send), timeout=30))
    body = b"".join(m.get("body", b"") for m in sent if m["type"] == "http.response.body")
    return sent[0]["status"], json.loads(body), read


def test_a_huge_content_length_is_413_before_reading(harness: Harness) -> None:
    app = harness.client.app
    status, body, read = asgi_post(app, [(b"content-length", str(1 << 30).encode())], [b"{}"])
    assert status == 413 and body["error"]["code"] == "request_too_large"
    assert read == 0


def test_a_chunked_body_is_cut_off_at_the_limit(make_harness: Callable[..., Harness]) -> None:
    h = make_harness(max_body=10_000)
    chunks = [b'{"prompt": "'] + [b"x" * 4096] * 100 + [b'"}']
    status, body, read = asgi_post(h.client.app, [(b"transfer-encoding", b"chunked")], chunks)
    assert status == 413 and body["error"]["code"] == "request_too_large"
    assert read < 10


def test_large_bodies_share_the_inflight_budget(make_harness: Callable[..., Harness]) -> None:
    h = make_harness(max_body_inflight=100_000)
    big = {"model": "smollm2-135m", "messages": msgs(1, "z" * 300_000)}
    status, body = post(h, big)
    assert status == 503 and body["error"]["code"] == "too_many_large_requests"
    assert h.client.post("/v1/chat/completions", json=big).headers["retry-after"]


def test_large_bodies_are_inspected_one_at_a_time(
    harness: Harness, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Four bodies of 32 MB inspected by four threads at once added their interpreter-lock
    holds up: /health waited up to ~300 ms. A second large body now waits its turn."""
    import threading

    from elbowroom.server.http import limits

    active, most = [0], [0]
    turn = threading.Condition()

    def watched(body: Any, path: str, lims: Any) -> Any:
        with turn:
            active[0] += 1
            most[0] = max(most[0], active[0])
            turn.notify_all()
            # Wait (bounded) for the other body to come in beside this one.
            turn.wait_for(lambda: active[0] > 1, timeout=2.0)
        try:
            return inspect(body, path, lims)
        finally:
            with turn:
                active[0] -= 1

    monkeypatch.setattr(limits, "inspect", watched)
    big = {"model": "smollm2-135m", "messages": msgs(1, "z" * 300_000)}
    statuses: list[int] = []
    senders = [
        threading.Thread(target=lambda: statuses.append(post(harness, big)[0])) for _ in range(2)
    ]
    for sender in senders:
        sender.start()
    for sender in senders:
        sender.join(60)
    assert statuses == [200, 200]
    assert most[0] == 1


def llm_with_vocab(trained_ctx: int, max_token_bytes: int, tokenizer: str = "gpt2") -> Any:
    info = GGUFInfo(
        architecture="llama",
        name="tiny",
        n_layers=2,
        n_heads=4,
        n_kv_heads=2,
        head_dim_k=16,
        head_dim_v=16,
        n_embd=64,
        trained_ctx=trained_ctx,
        file_type=None,
        has_chat_template=True,
        max_token_bytes=max_token_bytes,
        tokenizer_model=tokenizer,
    )
    return replace(spec("tiny"), gguf=info)


@pytest.fixture
def tiny() -> tuple[TestClient, FakeScheduler]:
    scheduler = FakeScheduler()
    settings = Settings(ctx=1024, max_chars=100 * 1024**2, max_body=128 * 1024**2)
    svc = Services(settings, FakeCatalog(llm_with_vocab(8192, 16)), scheduler)
    return TestClient(create_app(settings, services=svc), base_url="http://localhost"), scheduler


def test_a_prompt_that_cannot_fit_is_refused_without_tokenizing(
    tiny: tuple[TestClient, FakeScheduler],
) -> None:
    client, scheduler = tiny
    fits = client.post("/v1/completions", json={"model": "tiny", "prompt": "a" * 16 * 1024})
    assert fits.status_code == 200  # 16,384 chars / 16 per token = 1024 tokens: may fit
    began = time.perf_counter()
    r = client.post("/v1/completions", json={"model": "tiny", "prompt": "a" * (16 * 1024 + 1)})
    assert r.status_code == 400
    err = r.json()["error"]
    assert (err["code"], err["param"]) == ("context_length_exceeded", "prompt")
    assert "1025 tokens" in err["message"] and "1024" in err["message"]
    huge = client.post(
        "/v1/chat/completions", json={"model": "tiny", "messages": msgs(1, "b" * 50_000_000)}
    )
    assert huge.status_code == 400 and huge.json()["error"]["param"] == "messages"
    assert time.perf_counter() - began < 10
    assert len(scheduler.uses) == 1  # only the prompt that may fit reached the scheduler


def test_context_ceiling_follows_sizing() -> None:
    from elbowroom.server.http.limits import context_ceiling

    info = llm_with_vocab(2048, 16).gguf
    assert context_ceiling(info, Settings()) == (2048, "the model's trained context")
    assert context_ceiling(info, Settings(max_ctx=1000)) == (1000, "max_ctx")
    assert context_ceiling(info, Settings(ctx=4096)) == (4096, "ctx")


# --- 500s and metric labels -------------------------------------------------------------


def test_a_500_carries_an_error_id_not_the_details(
    harness: Harness, caplog: pytest.LogCaptureFixture
) -> None:
    harness.scheduler.script.error = EngineError("llama_decode failed at /home/alice/secret.gguf")
    harness.scheduler.script.error_after = 0
    r = harness.client.post("/v1/completions", json={"model": "smollm2-135m", "prompt": "x"})
    assert r.status_code == 500
    err = r.json()["error"]
    assert "secret" not in r.text and err["code"] == "internal_error"
    assert err["error_id"] in err["message"]
    assert any(
        err["error_id"] in rec.getMessage() and "secret" in rec.getMessage()
        for rec in caplog.records
    )
