"""LlamaEngine in-process on the real SmolLM2-135M (and gemma3 270m for the no-template path)."""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import pytest
from bundled_models import bundled_spec

from elbowroom.config import Settings
from elbowroom.engines.llama import FALLBACK_STOPS, LlamaEngine, _fallback_prompt
from elbowroom.errors import BadRequest, ContextOverflow, MemoryPressure
from elbowroom.models.spec import ModelSpec

pytest.importorskip("llama_cpp")

N_CTX = 512
CAP = 64


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
    eng = LlamaEngine()
    # kv_cache off: these tests check the context's own prefix reuse exactly (the KV prefix
    # cache plugged into the same seam has its tests in tests/unit/kvcache).
    options = {"n_ctx": N_CTX, "max_tokens_cap": CAP, "pressure": pressure, "kv_cache": False}
    facts = eng.load(bundled_spec("smollm2-135m"), options)
    assert facts == {"n_ctx": N_CTX, "n_ctx_train": 8192, "kv_type": "f16", "chat_template": True}
    yield eng
    eng.close()


@pytest.fixture(autouse=True)
def normal_pressure(pressure: Pressure) -> None:
    pressure.level = 0


def run(
    engine: LlamaEngine, op: str, payload: dict[str, Any], cancel_after: int | None = None
) -> tuple[dict[str, Any], list[str]]:
    deltas: list[str] = []

    def emit(item: dict[str, Any]) -> None:
        assert item["type"] == "delta"
        deltas.append(item["text"])

    def cancelled() -> bool:
        return cancel_after is not None and len(deltas) >= cancel_after

    return engine.run(op, payload, emit, cancelled), deltas


def chat(text: str, **kw: Any) -> dict[str, Any]:
    return {"messages": [{"role": "user", "content": text}], "temperature": 0, **kw}


COUNTING = {"prompt": "1, 2, 3, 4, 5, 6, 7, 8, 9, 10,", "temperature": 0}


@pytest.mark.slow
def test_chat_streams_text_that_adds_up(engine: LlamaEngine) -> None:
    result, deltas = run(engine, "chat", chat("What is the capital of France?", max_tokens=24))
    assert result["text"].strip()
    assert "".join(deltas) == result["text"]
    usage = result["usage"]
    assert usage["prompt_tokens"] > 10
    assert 0 < usage["completion_tokens"] <= 24
    assert result["finish_reason"] in ("stop", "length")


@pytest.mark.slow
def test_greedy_is_deterministic_and_reuses_the_prefix(engine: LlamaEngine) -> None:
    payload = chat("Name three colors.", max_tokens=20)
    first, _ = run(engine, "chat", payload)
    second, _ = run(engine, "chat", payload)
    assert first["text"] == second["text"]
    # The same prompt again: everything but the last token comes from the context.
    assert second["usage"]["cached_tokens"] == second["usage"]["prompt_tokens"] - 1


@pytest.mark.slow
def test_a_follow_up_turn_reuses_the_conversation_so_far(engine: LlamaEngine) -> None:
    turn = [{"role": "user", "content": "Say hello."}]
    first, _ = run(engine, "chat", {"messages": turn, "temperature": 0, "max_tokens": 12})
    history = [
        *turn,
        {"role": "assistant", "content": first["text"]},
        {"role": "user", "content": "Now say goodbye."},
    ]
    second, _ = run(engine, "chat", {"messages": history, "temperature": 0, "max_tokens": 8})
    assert second["usage"]["cached_tokens"] >= first["usage"]["prompt_tokens"]


@pytest.mark.slow
def test_stop_string_ends_the_text_before_it(engine: LlamaEngine) -> None:
    full, _ = run(engine, "completion", {**COUNTING, "max_tokens": 16})
    assert "13," in full["text"]
    stopped, deltas = run(engine, "completion", {**COUNTING, "max_tokens": 16, "stop": ["13"]})
    assert stopped["finish_reason"] == "stop"
    assert stopped["text"] == full["text"][: full["text"].index("13")]
    assert "13" not in "".join(deltas)


@pytest.mark.slow
def test_max_tokens_ends_with_length(engine: LlamaEngine) -> None:
    result, _ = run(engine, "completion", {**COUNTING, "max_tokens": 5})
    assert result["finish_reason"] == "length"
    assert result["usage"]["completion_tokens"] == 5


@pytest.mark.slow
def test_max_tokens_is_clamped_to_the_cap_and_the_room_left(engine: LlamaEngine) -> None:
    result, _ = run(engine, "completion", {**COUNTING, "max_tokens": 10_000})
    assert result["usage"]["completion_tokens"] <= CAP
    assert engine._sampling({"max_tokens": None}, N_CTX - 10, ()).max_tokens == 10
    assert engine._sampling({"max_tokens": 3}, 100, ()).max_tokens == 3
    assert engine._sampling({}, 100, ()).max_tokens == CAP


@pytest.mark.slow
def test_multibyte_characters_split_across_tokens_arrive_whole(engine: LlamaEngine) -> None:
    prompt = "日本語: こんにちは。東京は日本の首都です。大阪は"
    result, deltas = run(
        engine, "completion", {"prompt": prompt, "temperature": 0, "max_tokens": 16}
    )
    assert not any("\ufffd" in d for d in deltas)
    assert "".join(deltas) == result["text"]
    assert any(ord(c) > 0x3000 for c in result["text"])
    # Fewer pieces than tokens: some characters took several tokens.
    assert len(deltas) < result["usage"]["completion_tokens"]


@pytest.mark.slow
def test_prompt_over_the_context_is_refused_with_the_numbers(engine: LlamaEngine) -> None:
    with pytest.raises(ContextOverflow) as info:
        run(engine, "completion", {"prompt": "word " * 700, "max_tokens": 4})
    err = info.value
    assert err.status == 400 and err.code == "context_length_exceeded"
    assert f"the context is {N_CTX} tokens" in err.message
    assert err.details["prompt_tokens"] > N_CTX


@pytest.mark.slow
def test_cancel_stops_within_a_token(engine: LlamaEngine) -> None:
    result, deltas = run(engine, "completion", {**COUNTING, "max_tokens": 60}, cancel_after=3)
    assert result["finish_reason"] == "cancelled"
    assert len(deltas) == 3
    assert result["usage"]["completion_tokens"] == 3


@pytest.mark.slow
def test_hard_pressure_aborts_generation(engine: LlamaEngine, pressure: Pressure) -> None:
    deltas: list[str] = []

    def emit(item: dict[str, Any]) -> None:
        deltas.append(item["text"])
        pressure.level = 2  # memory turns hard right after the first token

    with pytest.raises(MemoryPressure) as info:
        engine.run("completion", {**COUNTING, "max_tokens": 60}, emit, lambda: False)
    assert info.value.status == 503 and info.value.code == "memory_pressure"
    assert 1 <= len(deltas) <= 16  # noticed at the next 16-token check


@pytest.mark.slow
def test_hard_pressure_before_the_first_token_refuses_at_once(
    engine: LlamaEngine, pressure: Pressure
) -> None:
    pressure.level = 2
    with pytest.raises(MemoryPressure):
        run(engine, "completion", {**COUNTING, "max_tokens": 60})
    pressure.level = 1  # soft does not abort
    result, _ = run(engine, "completion", {**COUNTING, "max_tokens": 3})
    assert result["usage"]["completion_tokens"] == 3


@pytest.mark.slow
def test_seeded_sampling_repeats(engine: LlamaEngine) -> None:
    payload = {**chat("Tell me a story.", max_tokens=12), "temperature": 1.0, "seed": 1234}
    # Same seed, same context state -> same sample. (A prompt evaluated in a different batch
    # shape, e.g. fully vs from a cached prefix, may differ in the last bits of its logits,
    # so the first run only brings the context to the state the next two share.)
    run(engine, "chat", payload)
    first, _ = run(engine, "chat", payload)
    second, _ = run(engine, "chat", payload)
    assert first["text"] == second["text"]


@pytest.mark.slow
@pytest.mark.parametrize(
    ("payload", "param"),
    [
        ({"messages": []}, "messages"),
        ({"messages": [{"content": "no role"}]}, "messages"),
        ({"messages": [{"role": "user", "content": 5}]}, "messages"),
        ({**chat("hi"), "max_tokens": 0}, "max_tokens"),
        ({**chat("hi"), "temperature": 3}, "temperature"),
        ({**chat("hi"), "top_p": "high"}, "top_p"),
        ({**chat("hi"), "stop": [1]}, "stop"),
        ({**chat("hi"), "seed": 1.5}, "seed"),
    ],
)
def test_bad_payloads_are_bad_requests(
    engine: LlamaEngine, payload: dict[str, Any], param: str
) -> None:
    with pytest.raises(BadRequest) as info:
        run(engine, "chat", payload)
    assert info.value.param == param


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
        options = {"n_ctx": N_CTX, "kv_type": "q8_0", "kv_cache": False}
        facts = eng.load(gemma, options)
        assert facts["chat_template"] is False and facts["kv_type"] == "q8_0"
        payload = chat("What is the capital of France?", max_tokens=24)
        first, _ = run(eng, "chat", payload)
        assert "Paris" in first["text"]
        assert "User:" not in first["text"]  # the fallback's turn marker stops generation
        second, _ = run(eng, "chat", payload)  # sliding-window cache: prefix reuse still exact
        assert second["text"] == first["text"]
        assert second["usage"]["cached_tokens"] > 0
    finally:
        eng.close()
