"""MlxEngine in-process on real MLX models: SmolLM2-135M converted from the bundled GGUF
(real text) and a tiny random-weight llama (fast: the engine's mechanics)."""

from __future__ import annotations

import dataclasses
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from mlx_models import have_mlx, random_mlx, smollm2_mlx

from elbowroom.engines.mlx import MlxEngine
from elbowroom.engines.options import LlamaOptions, MlxOptions
from elbowroom.engines.requests import TextRequest, TextTicket
from elbowroom.errors import BadRequest, ContextOverflow, EngineError, MemoryPressure
from elbowroom.models.catalog import _mlx_model
from elbowroom.models.spec import ModelSpec
from elbowroom.server.stream.relay import Answer, parse_events

if (why := have_mlx()) is not None:
    pytest.skip(why, allow_module_level=True)

N_CTX = 512


class Pressure:
    def __init__(self) -> None:
        self.level = 0

    def __call__(self) -> int:
        return self.level


def spec_of(folder: Path, model_id: str) -> ModelSpec:
    return dataclasses.replace(_mlx_model(folder), id=model_id)


@pytest.fixture(scope="module")
def tiny(tmp_path_factory: pytest.TempPathFactory) -> ModelSpec:
    folder = random_mlx(tmp_path_factory.mktemp("mlx") / "tiny", bits=4, group_size=32)
    return spec_of(folder, "tiny")


@pytest.fixture(scope="module")
def engine(tiny: ModelSpec, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Any]:
    pressure = Pressure()
    eng = MlxEngine(pressure)
    kv = tmp_path_factory.mktemp("kv")
    eng.load(
        tiny,
        MlxOptions(
            n_ctx=N_CTX, cache_ram_bytes=64 << 20, kv_cache_dir=str(kv), kv_disk_max=1 << 30
        ),
    )
    eng.pressure = pressure  # type: ignore[attr-defined]
    yield eng
    eng.close()


def run(
    eng: Any, req: TextRequest, cancel_after: int | None = None
) -> tuple[dict[str, Any], list[str]]:
    """``open``: a ticket with no socket, then the engine's events over the runner, in the
    shape the relay reads (engines/events.py); returns the relay's assembled answer."""
    pieces: list[str] = []
    tickets: list[TextTicket] = []
    answer = Answer("m", chat_events=req.kind == "chat", block=1)

    def emit(item: dict[str, Any]) -> None:
        if item["type"] == "ticket":
            tickets.append(item["ticket"])
            return
        assert item["type"] == "events" and tickets and tickets[0].socket is None
        for chunk in parse_events(item["data"]):
            if chunk is not None:
                piece = answer.take(chunk)
                if piece.text:
                    pieces.append(piece.text)

    def cancelled() -> bool:
        return cancel_after is not None and len(pieces) >= cancel_after

    assert eng.run("open", req, emit, cancelled) == {}
    return answer.result(emulated=False), pieces


def completion(prompt: str = "Once upon a time", **kw: Any) -> TextRequest:
    kw.setdefault("max_tokens", 8)
    kw.setdefault("temperature", 0)
    return TextRequest(kind="completion", prompt=prompt, **kw)


def test_max_tokens_caps_the_reply_and_usage_counts_it(engine: Any) -> None:
    out, pieces = run(engine, completion(max_tokens=5))
    assert out["finish_reason"] == "length"
    assert out["usage"]["completion_tokens"] == 5
    assert "".join(pieces) == out["text"]
    assert out["usage"]["prompt_tokens"] > 0


def test_greedy_is_deterministic_and_the_slot_state_is_reused(engine: Any) -> None:
    first, _ = run(engine, completion("The same prompt " * 40, max_tokens=6))
    second, _ = run(engine, completion("The same prompt " * 40, max_tokens=6))
    assert first["text"] == second["text"]  # the reused KV state gives the same tokens
    assert second["usage"]["cached_tokens"] >= 64  # whole blocks of the reused prompt


def test_stop_string_ends_the_reply_before_it(engine: Any) -> None:
    base, _ = run(engine, completion(max_tokens=12))
    text = base["text"]
    if len(text) < 4:
        pytest.skip(f"the random model's reply is too short to cut: {text!r}")
    stop = text[2:4]
    out, pieces = run(engine, completion(max_tokens=12, stop=(stop,)))
    assert out["finish_reason"] == "stop"
    assert stop not in out["text"] and text.startswith(out["text"])
    assert "".join(pieces) == out["text"]


def test_cancel_stops_within_a_token(engine: Any) -> None:
    out, pieces = run(engine, completion(max_tokens=400), cancel_after=3)
    assert out["finish_reason"] == "cancelled"
    assert out["usage"]["completion_tokens"] <= len(pieces) + 2


def test_hard_pressure_aborts_within_16_tokens(engine: Any) -> None:
    pressure: Pressure = engine.pressure
    seen: list[str] = []

    def emit(item: dict[str, Any]) -> None:
        if item["type"] == "events":
            seen.append(item["data"])
        if len(seen) == 3:
            pressure.level = 2

    before = engine.stats()["tokens_generated"]
    try:
        with pytest.raises(MemoryPressure) as info:
            engine.run("open", completion(max_tokens=400), emit, lambda: False)
    finally:
        pressure.level = 0
    assert info.value.status == 503 and "memory pressure" in info.value.message
    generated = engine.stats()["tokens_generated"] - before
    # Emitted pieces trail tokens by what the detokenizer holds; at most 16 after the flip.
    assert generated <= 3 + 16, generated
    # Hard pressure also refuses a new generation before its prefill.
    pressure.level = 2
    try:
        with pytest.raises(MemoryPressure):
            run(engine, completion())
    finally:
        pressure.level = 0


def test_unsupported_fields_are_400(engine: Any) -> None:
    chat = {"role": "user", "content": "hi"}
    tool = {"type": "function", "function": {"name": "f", "parameters": {"type": "object"}}}
    for req in (
        TextRequest(kind="chat", max_tokens=4, messages=(chat,), tools=(tool,)),
        TextRequest(
            kind="chat",
            max_tokens=4,
            messages=(chat,),
            response_format={"type": "json_schema", "json_schema": {"schema": {}}},
        ),
        TextRequest(kind="chat", max_tokens=4, messages=(chat,), logprobs=1),
        TextRequest(
            kind="chat",
            max_tokens=4,
            messages=({"role": "user", "content": [{"type": "image_url", "image_url": {}}]},),
        ),
    ):
        with pytest.raises(BadRequest) as info:
            run(engine, req)
        assert info.value.status == 400


def test_a_prompt_longer_than_the_context_is_413_or_400(engine: Any) -> None:
    with pytest.raises(ContextOverflow) as info:
        run(engine, completion("word " * (N_CTX + 50)))
    assert info.value.details["n_ctx"] == N_CTX


def test_stats_report_mlx_memory(engine: Any) -> None:
    mem = engine.stats()["mlx"]
    assert mem["active"] > 0 and mem["peak"] >= mem["active"]
    assert mem["cache"] == 0  # emptied after every request


def test_the_disk_tier_restores_a_prompt_in_a_new_engine(tiny: ModelSpec, tmp_path: Path) -> None:
    opts = MlxOptions(
        n_ctx=N_CTX, cache_ram_bytes=0, kv_cache_dir=str(tmp_path), kv_disk_max=1 << 30
    )
    prompt = "A long shared preamble about memory and models. " * 20
    first = MlxEngine()
    first.load(tiny, opts)
    try:
        out1, _ = run(first, completion(prompt, max_tokens=4))
    finally:
        first.close()  # saves the slot's state to the disk tier
    assert any(tmp_path.iterdir()), "nothing was written to the disk tier"
    second = MlxEngine()
    second.load(tiny, opts)
    try:
        out2, _ = run(second, completion(prompt, max_tokens=4))
        kv = second.stats()["kv_cache"]
    finally:
        second.close()
    assert out2["usage"]["cached_tokens"] >= 64, (out2, kv)
    assert kv["hits"]["disk"] == 1
    assert out1["text"] == out2["text"]  # the restored state continues exactly as computed


def test_a_corrupt_disk_entry_is_a_miss_not_a_crash(tiny: ModelSpec, tmp_path: Path) -> None:
    opts = MlxOptions(n_ctx=N_CTX, kv_cache_dir=str(tmp_path), kv_disk_max=1 << 30)
    prompt = "Another preamble that is long enough to be stored. " * 20
    first = MlxEngine()
    first.load(tiny, opts)
    run(first, completion(prompt, max_tokens=2))
    first.close()
    for f in tmp_path.iterdir():
        data = bytearray(f.read_bytes())
        data[len(data) // 3] ^= 0xFF
        f.write_bytes(bytes(data))
    second = MlxEngine()
    second.load(tiny, opts)
    try:
        out, _ = run(second, completion(prompt, max_tokens=2))
    finally:
        second.close()
    assert out["usage"]["cached_tokens"] == 0
    assert out["usage"]["completion_tokens"] == 2


def test_wrong_options_kind_and_mismatched_tokenizer_refuse_to_load(
    tiny: ModelSpec, tmp_path: Path
) -> None:
    with pytest.raises(EngineError, match="MlxOptions"):
        MlxEngine().load(tiny, LlamaOptions())
    small = random_mlx(tmp_path / "small", vocab=1000)
    with pytest.raises(EngineError, match="tokenizer has"):
        MlxEngine().load(spec_of(small, "small"), MlxOptions(n_ctx=256, kv_cache=False))


def test_smollm2_converted_from_gguf_answers_in_real_text(
    tmp_path_factory: pytest.TempPathFactory,
) -> None:
    folder = smollm2_mlx(tmp_path_factory.mktemp("smol") / "smollm2-mlx")
    eng = MlxEngine()
    eng.load(spec_of(folder, "smollm2-mlx"), MlxOptions(n_ctx=256, kv_cache=False))
    try:
        msg = {"role": "user", "content": "What is the capital of France?"}
        out, _ = run(eng, TextRequest(kind="chat", max_tokens=8, messages=(msg,), temperature=0))
    finally:
        eng.close()
    assert "Paris" in out["text"], out


def test_soft_pressure_empties_the_buffer_cache_and_shrinks_the_ram_tier(engine: Any) -> None:
    grant = engine.stats()["kv_cache"]["ram_budget"]
    run(engine, completion("Pressure test preamble, long enough to keep. " * 12, max_tokens=2))
    engine.pressure.level = 1
    try:
        engine.relieve(1)
        stats = engine.stats()
        assert stats["mlx"]["cache"] == 0
        assert stats["kv_cache"]["ram_budget"] == grant // 4
        assert stats["kv_cache"]["entries_ram"] + stats["kv_cache"]["entries_disk"] >= 1
    finally:
        engine.pressure.level = 0
    run(engine, completion(max_tokens=1))  # pressure eased: the whole grant again
    assert engine.stats()["kv_cache"]["ram_budget"] == grant


def test_an_isolated_request_leaves_no_state_for_the_next(engine: Any) -> None:
    prompt = "Private preamble that nobody else may reuse. " * 12
    run(engine, completion(prompt, max_tokens=2, isolated=True))
    out, _ = run(engine, completion(prompt, max_tokens=2))
    assert out["usage"]["cached_tokens"] == 0
