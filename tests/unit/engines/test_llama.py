"""LlamaEngine (llama.cpp's server engine) in-process on the real SmolLM2-135M, and gemma3
270m for the no-template path."""

from __future__ import annotations

import os
import resource
import stat
import threading
import time
from collections.abc import Iterator
from dataclasses import replace
from pathlib import Path
from typing import Any

import psutil
import pytest
import xllamacpp  # noqa: F401  (a hard dependency: a broken install fails, never skips)
from bundled_models import bundled_spec
from engine_text import engine_run, no_emit

from elbowroom.config import Settings
from elbowroom.engines.llama import FALLBACK_STOPS, LlamaEngine, _fallback_prompt
from elbowroom.engines.llama_control import _UnixConnection
from elbowroom.engines.options import LlamaOptions
from elbowroom.engines.requests import EmbedRequest, TextRequest
from elbowroom.errors import BadRequest, ContextOverflow, MemoryPressure
from elbowroom.models.spec import ModelSpec

N_CTX = 512
SLOTS = 2


class Pressure:
    """The level the engine polls; tests raise it mid-generation."""

    def __init__(self) -> None:
        self.level = 0

    def __call__(self) -> int:
        return self.level


@pytest.fixture(scope="module")
def pressure() -> Pressure:
    return Pressure()


@pytest.fixture(scope="module")
def engine(pressure: Pressure) -> Iterator[LlamaEngine]:
    eng = LlamaEngine(pressure)
    options = LlamaOptions(
        n_ctx=N_CTX, slots=SLOTS, cache_ram_bytes=32 << 20, threads=2, kv_block_tokens=4
    )
    facts = eng.load(bundled_spec("smollm2-135m"), options)
    assert facts["n_ctx"] == N_CTX and facts["slots"] == SLOTS
    assert facts["n_ctx_total"] == N_CTX * SLOTS and facts["cache_ram_mib"] == 32
    assert facts["chat_template"] is True and facts["native_tools"] is False
    assert eng.max_concurrent == SLOTS
    yield eng
    eng.close()


@pytest.fixture(autouse=True)
def normal_pressure(pressure: Pressure) -> None:
    pressure.level = 0


run = engine_run  # open, the engine's socket, close: as the relay reads it


def chat(text: str, max_tokens: int, temperature: float = 0.0, **kw: Any) -> TextRequest:
    messages = ({"role": "user", "content": text},)
    return TextRequest(
        kind="chat", messages=messages, max_tokens=max_tokens, temperature=temperature, **kw
    )


def counting(max_tokens: int, **kw: Any) -> TextRequest:
    prompt = "1, 2, 3, 4, 5, 6, 7, 8, 9, 10,"
    return TextRequest(kind="completion", prompt=prompt, max_tokens=max_tokens, temperature=0, **kw)


@pytest.mark.slow
def test_chat_streams_text_that_adds_up(engine: LlamaEngine) -> None:
    result, deltas = run(engine, chat("Name three colours.", max_tokens=20))
    assert len(deltas) > 1
    assert "".join(deltas) == result["text"] and result["text"].strip()
    assert result["usage"]["completion_tokens"] == 20 and result["finish_reason"] == "length"
    assert result["usage"]["prompt_tokens"] > 5


@pytest.mark.slow
def test_greedy_is_deterministic_and_reuses_the_prefix(engine: LlamaEngine) -> None:
    first, _ = run(engine, counting(10))
    second, _ = run(engine, counting(10))
    assert first["text"] == second["text"]
    assert "11" in first["text"]
    assert second["usage"]["cached_tokens"] > 0  # the engine's prompt cache / slot reuse


@pytest.mark.slow
def test_stop_string_ends_the_text_before_it(engine: LlamaEngine) -> None:
    result, _ = run(engine, counting(30, stop=(" 14",)))
    assert result["finish_reason"] == "stop"
    assert " 14" not in result["text"] and "13" in result["text"]


@pytest.mark.slow
def test_prompt_over_the_context_is_refused_with_the_numbers(engine: LlamaEngine) -> None:
    with pytest.raises(ContextOverflow) as info:
        run(engine, TextRequest(kind="completion", prompt="word " * 700, max_tokens=4))
    err = info.value
    assert err.status == 400 and err.code == "context_length_exceeded"
    assert f"the context is {N_CTX} tokens per slot" in err.message
    assert err.details["prompt_tokens"] > N_CTX


@pytest.mark.slow
def test_a_reader_that_leaves_ends_the_generation_and_the_slot_goes_back(
    engine: LlamaEngine,
) -> None:
    result, deltas = run(engine, counting(60), cancel_after=3)
    assert result["finish_reason"] == "cancelled" and len(deltas) == 3
    # The slot stays busy until the engine's loop lets go of the cancelled task (issue 28:
    # busy tells the truth), then goes back without anyone closing it again.
    deadline = time.monotonic() + 60
    while engine.stats()["slots_busy"] != 0:
        assert time.monotonic() < deadline, "the cancelled request's slot never went back"
        time.sleep(0.02)
    after, _ = run(engine, counting(3))  # both slots take work again
    assert after["usage"]["completion_tokens"] == 3


@pytest.mark.slow
def test_hard_pressure_before_the_first_token_refuses_at_once(
    engine: LlamaEngine, pressure: Pressure
) -> None:
    pressure.level = 2
    with pytest.raises(MemoryPressure):
        run(engine, counting(60))
    pressure.level = 1  # soft does not abort
    result, _ = run(engine, counting(3))
    assert result["usage"]["completion_tokens"] == 3


@pytest.mark.slow
def test_seeded_sampling_repeats(engine: LlamaEngine) -> None:
    request = chat("Tell me a story.", max_tokens=12, temperature=1.0, seed=1234)
    first, _ = run(engine, request)
    second, _ = run(engine, request)
    assert first["text"] == second["text"]


@pytest.mark.slow
def test_two_requests_run_at_once_in_two_slots(engine: LlamaEngine) -> None:
    """Continuous batching: a request that arrives while another is generating gets its
    first token before the other one ends (with one slot it would wait for all of it)."""
    started = threading.Event()
    firsts: dict[int, float] = {}
    ends: dict[int, float] = {}

    def one(i: int) -> None:
        def piece(_text: str) -> None:
            firsts.setdefault(i, time.monotonic())
            started.set()

        run(engine, chat(f"Story number {i}:", max_tokens=64), on_piece=piece)
        ends[i] = time.monotonic()

    first = threading.Thread(target=one, args=(0,))
    first.start()
    assert started.wait(timeout=120)  # the first request is generating now
    second = threading.Thread(target=one, args=(1,))
    second.start()
    first.join(timeout=120)
    second.join(timeout=120)
    assert set(ends) == {0, 1}
    assert firsts[1] < ends[0]


@pytest.mark.slow
def test_unknown_op_or_an_untyped_payload_is_a_bad_request(engine: LlamaEngine) -> None:
    with pytest.raises(BadRequest, match="'embed'"):
        engine.run("embed", EmbedRequest(inputs=("x",)), no_emit, lambda: False)
    with pytest.raises(BadRequest, match="TextRequest"):
        engine.run("completion", {"prompt": "1, 2,", "max_tokens": 2}, no_emit, lambda: False)


def test_fallback_prompt_is_a_plain_transcript() -> None:
    prompt = _fallback_prompt(
        [
            {"role": "system", "content": "Be brief."},
            {"role": "user", "content": "Hi"},
            {"role": "assistant", "content": "Hello."},
            {"role": "user", "content": "Bye"},
        ]
    )
    assert prompt == "System: Be brief.\nUser: Hi\nAssistant: Hello.\nUser: Bye\nAssistant:"
    assert "\nUser:" in FALLBACK_STOPS


@pytest.fixture(scope="module")
def gemma(gemma_settings: Settings | None) -> ModelSpec:
    if gemma_settings is None:
        pytest.skip("the gemma3 chunk packages are not installed")
    return bundled_spec("gemma3-270m", gemma_settings)


@pytest.mark.slow
def test_a_model_without_chat_template_still_chats(gemma: ModelSpec) -> None:
    eng = LlamaEngine()
    try:
        options = LlamaOptions(
            n_ctx=N_CTX, slots=1, kv_type="q8_0", cache_ram_bytes=32 << 20, kv_block_tokens=4
        )
        facts = eng.load(gemma, options)
        assert facts["chat_template"] is False and facts["kv_type"] == "q8_0"
        payload = chat("What is the capital of France?", max_tokens=24)
        first, _ = run(eng, payload)
        assert "Paris" in first["text"]
        assert "User:" not in first["text"]  # the fallback's turn marker stops generation
        second, _ = run(eng, payload)
        assert second["text"] == first["text"]
        assert second["usage"]["cached_tokens"] > 0
    finally:
        eng.close()


@pytest.mark.slow
def test_the_engines_own_listener_is_private(engine: LlamaEngine) -> None:
    """llama.cpp's server engine always listens: on a Unix socket in a 0700 directory, with
    a random key, and never on a TCP port."""
    control = engine._control
    assert control is not None
    assert stat.S_IMODE(os.stat(control.dir).st_mode) == 0o700
    assert stat.S_ISSOCK(os.stat(control.socket).st_mode)
    listening = [c for c in psutil.Process().net_connections(kind="inet") if c.status == "LISTEN"]
    assert listening == []
    conn = _UnixConnection(control.socket, 10)  # no key: refused
    conn.request("GET", "/props")
    assert conn.getresponse().status == 401
    conn.close()
    assert "chat_template" in control.request("GET", "/props")  # with the key: answered


@pytest.mark.slow
def test_a_salted_request_shares_no_kv_state(engine: LlamaEngine) -> None:
    """cache_salt: nothing is reused for it, and nothing of it is left for the next request
    (which would otherwise reuse the whole shared prefix)."""
    text = "The quick brown fox jumps over the lazy dog. " * 6
    plain = TextRequest(kind="completion", prompt=text, max_tokens=2, temperature=0)
    salted = replace(plain, isolated=True)
    first, _ = run(engine, salted)
    again, _ = run(engine, salted)
    assert first["usage"]["cached_tokens"] == 0 and again["usage"]["cached_tokens"] == 0
    unsalted, _ = run(engine, plain)
    assert unsalted["usage"]["cached_tokens"] == 0  # the salted state was wiped, not cached
    repeat, _ = run(engine, plain)
    assert repeat["usage"]["cached_tokens"] > 0  # unsalted requests still share
    assert again["text"] == first["text"] == unsalted["text"]


def _locked_bytes() -> int:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith("VmLck:"):
            return int(line.split()[1]) * 1024
    raise AssertionError("no VmLck in /proc/self/status")


@pytest.mark.slow
def test_mlock_locks_the_weights_in_ram() -> None:
    """The mlock knob reaches llama.cpp: the mapped weights are locked (and, without it,
    they are not: the module's engine above holds none)."""
    soft, _ = resource.getrlimit(resource.RLIMIT_MEMLOCK)
    if os.geteuid() != 0 and soft != resource.RLIM_INFINITY and soft < 256 << 20:
        pytest.skip("RLIMIT_MEMLOCK is too small to lock the weights")
    before = _locked_bytes()
    eng = LlamaEngine()
    try:
        eng.load(bundled_spec("smollm2-135m"), LlamaOptions(n_ctx=256, mlock=True))
        assert _locked_bytes() - before >= 80 << 20  # the ~92 MB of mapped weights
    finally:
        eng.close()
