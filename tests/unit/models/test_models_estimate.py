"""Footprint arithmetic (pure): hand-made specs, no files, no processes."""

from __future__ import annotations

import math
from dataclasses import replace
from pathlib import Path

import pytest
from bundled_models import SMOLLM2_INFO

from elbowroom.errors import BadRequest
from elbowroom.memory.types import ProcessMemory
from elbowroom.models import estimate as est
from elbowroom.models.spec import GGUFInfo, Holding, ModelKind, ModelSpec
from elbowroom.units import MiB

SMOL = SMOLLM2_INFO


def llm(info: GGUFInfo = SMOL, size: int = 98_362_432) -> ModelSpec:
    return ModelSpec(
        id="smol",
        kind=ModelKind.LLM,
        engine="llama",
        path=Path("/nonexistent/smol.gguf"),
        size_bytes=size,
        holding=Holding.MMAP,
        source="path",
        gguf=info,
    )


def resident(engine: str, size: int) -> ModelSpec:
    return ModelSpec(
        id=engine,
        kind=ModelKind.ASR,
        engine=engine,
        path=Path("/nonexistent"),
        size_bytes=size,
        holding=Holding.RESIDENT,
        source="path",
    )


def test_kv_type_bytes() -> None:
    assert est.KV_TYPE_BYTES == {"f16": 2.0, "q8_0": 34 / 32, "q4_0": 18 / 32}


@pytest.mark.parametrize(("kv", "expected"), [("f16", 23040), ("q8_0", 12240), ("q4_0", 6480)])
def test_kv_bytes_per_token(kv: str, expected: int) -> None:
    # 30 layers × 3 KV heads × (64 + 64) × bytes: llama.cpp printed 180.00 MiB at 8192 (f16).
    assert est.kv_bytes_per_token(SMOL, kv) == expected
    assert est.kv_bytes_per_token(SMOL, "f16") * 8192 == 180 * MiB


def test_kv_bytes_per_token_sums_per_layer_heads() -> None:
    info = replace(SMOL, n_layers=3, n_kv_heads=2, kv_heads_per_layer=(1, 2, 0))
    assert est.kv_bytes_per_token(info, "f16") == 3 * 128 * 2


def test_unknown_kv_type_is_a_bad_request() -> None:
    with pytest.raises(BadRequest, match="q8_0") as err:
        est.footprint(llm(), 512, kv_type="f32")
    assert err.value.status == 400 and err.value.param == "kv_type"


def test_llm_footprint_parts_add_up() -> None:
    fp = est.footprint(llm(), 4096)
    assert fp.kv_bytes_per_token == 23040
    assert fp.kv_bytes == 23040 * 4096
    assert fp.anonymous == fp.kv_bytes + fp.overhead
    assert fp.file_backed == fp.weights + est.LLAMA_RUNTIME_FILE
    assert fp.weights == 98_362_432
    assert fp.total == fp.anonymous + fp.file_backed
    assert (fp.n_ctx, fp.slots, fp.kv_type, fp.measured) == (4096, 1, "f16", False)


def test_kv_grows_with_context_not_with_slots() -> None:
    one, four = est.footprint(llm(), 4096), est.footprint(llm(), 4096, slots=4)
    assert four.kv_bytes == one.kv_bytes  # slots share n_ctx
    assert four.overhead - one.overhead == 3 * 49152 * est.LOGIT_BYTES
    bigger = est.footprint(llm(), 8192)
    assert bigger.anonymous - one.anonymous == 23040 * 4096


def test_quantized_kv_is_smaller() -> None:
    sizes = [est.footprint(llm(), 8192, kv_type=kv).total for kv in ("f16", "q8_0", "q4_0")]
    assert sizes[0] > sizes[1] > sizes[2]


def test_bigger_vocabulary_costs_more_overhead() -> None:
    small = est.footprint(llm(), 512)
    big = est.footprint(llm(replace(SMOL, n_vocab=262144)), 512)
    assert big.overhead - small.overhead == (262144 - 49152) * (est.LLAMA_PER_VOCAB + 4)


def test_resident_footprint_scales_with_weights() -> None:
    profile = est.RESIDENT_PROFILES["whisper"]
    fp = est.footprint(resident("whisper", 100 * MiB), 0)
    assert fp.weights == 100 * MiB
    assert fp.anonymous == math.ceil(100 * MiB * profile.anon_factor) + profile.runtime_anon
    assert fp.file_backed == profile.runtime_file
    assert fp.kv_bytes == 0
    bigger = est.footprint(resident("whisper", 200 * MiB), 0)
    assert bigger.anonymous > fp.anonymous


def test_unmeasured_engine_gets_the_generic_guess() -> None:
    fp = est.footprint(resident("brand-new", 10 * MiB), 0)
    assert fp.anonymous == 3 * 10 * MiB + est.GENERIC_PROFILE.runtime_anon


def test_a_measurement_wins() -> None:
    seen = ProcessMemory(anonymous=300 * MiB, file_backed=120 * MiB)
    fp = est.footprint(llm(), 8192, measured=seen)
    assert fp.measured is True
    assert (fp.anonymous, fp.file_backed) == (300 * MiB, 120 * MiB)
    assert fp.kv_bytes == 23040 * 8192  # still the arithmetic, for sizing
    assert fp.overhead == 300 * MiB - fp.kv_bytes


def test_resident_measurement_below_the_calibrated_prediction_is_a_floor() -> None:
    # Taken right after load, before the engine's working memory exists.
    spec = resident("whisper", 78 * MiB)
    predicted = est.footprint(spec, 0)
    low = est.footprint(spec, 0, measured=ProcessMemory(90 * MiB, 40 * MiB))
    assert low.measured and (low.anonymous, low.file_backed) == (
        predicted.anonymous,
        predicted.file_backed,
    )
    high = est.footprint(spec, 0, measured=ProcessMemory(400 * MiB, 80 * MiB))
    assert (high.anonymous, high.file_backed) == (400 * MiB, 80 * MiB)
    assert high.overhead == 400 * MiB - 78 * MiB
    # An uncalibrated engine's guess is no floor: the measurement wins outright.
    guess = est.footprint(resident("brand-new", 78 * MiB), 0, measured=ProcessMemory(MiB, MiB))
    assert (guess.anonymous, guess.file_backed) == (MiB, MiB)


def test_negative_context_or_zero_slots_rejected() -> None:
    with pytest.raises(BadRequest):
        est.footprint(llm(), -1)
    with pytest.raises(BadRequest):
        est.footprint(llm(), 512, slots=0)


# ---------------------------------------------------------------- max_context / auto_context


def test_max_context_is_the_largest_fitting_multiple_of_256() -> None:
    spec = llm()
    budget = est.footprint(spec, 3000).total
    n = est.max_context(spec, budget)
    assert n == 2816  # 11 × 256 ≤ 3000 < 12 × 256
    assert est.footprint(spec, n).total <= budget
    assert est.footprint(spec, n + 256).total > budget


def test_max_context_capped_by_trained_and_ceiling() -> None:
    spec = llm()
    huge = 100 * 1024 * MiB
    assert est.max_context(spec, huge) == 8192  # trained context
    assert est.max_context(spec, huge, ceiling=4000) == 3840
    assert est.max_context(spec, 1) == 0
    assert est.max_context(resident("whisper", MiB), huge) == 0  # no context


def test_max_context_for_a_tiny_trained_context() -> None:
    spec = llm(replace(SMOL, trained_ctx=128))
    assert est.max_context(spec, 100 * 1024 * MiB) == 128


def test_auto_context_refuses_below_min_ctx() -> None:
    spec = llm()
    assert est.auto_context(spec, 100 * 1024 * MiB, 8192, 512) == 8192
    assert est.auto_context(spec, 100 * 1024 * MiB, 2048, 512) == 2048
    just_256 = est.footprint(spec, 256).total
    assert est.auto_context(spec, just_256, 8192, 512) == 0
    assert est.auto_context(spec, just_256, 8192, 256) == 256
    q8 = est.auto_context(spec, est.footprint(spec, 4096).total, 8192, 512, kv_type="q8_0")
    assert q8 > 4096  # a quantized cache buys context


def test_auto_context_when_trained_context_is_below_min_ctx() -> None:
    spec = llm(replace(SMOL, trained_ctx=256))
    assert est.auto_context(spec, 100 * 1024 * MiB, 8192, 512) == 256
