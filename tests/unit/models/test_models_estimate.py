"""Footprint arithmetic (pure): hand-made specs, no files, no processes.

The reference numbers in comments are llama.cpp's own buffer report and /proc/PID/smaps_rollup
measured with ``elbowroom.models.calibrate`` on the bundled models (docs/models.md).
"""

from __future__ import annotations

import math
from dataclasses import replace
from pathlib import Path

import pytest
from bundled_models import GEMMA3_INFO, SMOLLM2_INFO

from elbowroom.errors import BadRequest
from elbowroom.memory.types import ProcessMemory
from elbowroom.models import estimate as est
from elbowroom.models.spec import GGUFInfo, Holding, ModelKind, ModelSpec
from elbowroom.units import MiB

SMOL = SMOLLM2_INFO
GEMMA = GEMMA3_INFO


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


def close(a: float, b: float, rel: float) -> bool:
    return abs(a - b) <= rel * b


def test_kv_type_bytes() -> None:
    assert est.KV_TYPE_BYTES == {"f16": 2.0, "q8_0": 34 / 32, "q4_0": 18 / 32}


@pytest.mark.parametrize(("kv", "expected"), [("f16", 23040), ("q8_0", 12240), ("q4_0", 6480)])
def test_kv_bytes_per_token(kv: str, expected: int) -> None:
    # 30 layers × 3 KV heads × (64 + 64) × bytes: llama.cpp printed 180.00 MiB at 8192 (f16).
    assert est.kv_bytes_per_token(SMOL, kv) == expected
    assert est.kv_bytes(SMOL, 8192, 1, "f16") == 180 * MiB


def test_kv_bytes_sums_per_layer_heads() -> None:
    info = replace(SMOL, n_layers=3, n_kv_heads=2, kv_heads_per_layer=(1, 2, 0))
    assert est.kv_bytes_per_token(info, "f16") == 3 * 128 * 2


def test_every_slot_owns_its_context() -> None:
    # The engine gets n_ctx × slots (kv_unified off): llama.cpp printed 720 MiB at 8192 × 4.
    assert est.kv_bytes(SMOL, 8192, 4, "f16") == 720 * MiB
    assert est.kv_bytes(SMOL, 8192, 4, "q8_0") == int(382.5 * MiB)
    one, four = est.footprint(llm(), 4096), est.footprint(llm(), 4096, slots=4)
    assert four.kv_bytes == 4 * one.kv_bytes


def test_contexts_are_padded_like_llama_cpp() -> None:
    assert est.kv_bytes(SMOL, 1000, 1, "f16") == est.kv_bytes(SMOL, 1024, 1, "f16")


def test_sliding_window_layers_hold_the_window_only() -> None:
    # gemma3: layers 5, 11, 17 are global; the other 15 hold pad256(512 + 512) = 1024 cells.
    assert est.swa_layers(GEMMA).count(False) == 3
    assert [i for i, w in enumerate(est.swa_layers(GEMMA)) if not w] == [5, 11, 17]
    # llama.cpp at 2048 × 4: non-SWA 24.00 MiB (2048 cells), SWA 60.00 MiB (1024 cells)
    assert est.kv_bytes(GEMMA, 2048, 4, "f16") == 84 * MiB
    # below the window every layer holds the whole context: 512 cells × 18 layers × 1 KiB
    assert est.kv_bytes(GEMMA, 512, 1, "f16") == 9 * MiB


def test_phi3_window_is_ignored_like_llama_cpp_does() -> None:
    phi3 = replace(SMOL, architecture="phi3", sliding_window=2047)
    assert not any(est.swa_layers(phi3))
    assert est.kv_bytes(phi3, 4096, 1, "f16") == est.kv_bytes(SMOL, 4096, 1, "f16")
    # a file may state its own pattern
    assert est.swa_layers(replace(GEMMA, swa_pattern=2)).count(False) == 9


def test_compute_buffer_matches_llama_cpp_report() -> None:
    # llama.cpp's "CPU compute buffer size" for the bundled models (flash attention on)
    for info, n_ctx, reported in (
        (SMOL, 512, 15.14),
        (SMOL, 8192, 22.64),
        (GEMMA, 512, 19.28),
        (GEMMA, 2048, 21.28),
        (GEMMA, 8192, 27.28),
    ):
        for slots in (1, 4):
            got = est.compute_bytes(info, n_ctx, slots) / MiB
            assert close(got, reported, 0.01), (info.name, n_ctx, slots, got, reported)


def test_moe_compute_counts_the_experts_a_token_uses() -> None:
    dense = replace(SMOL, n_ff=512)
    moe = replace(dense, n_expert=16, n_expert_used=4, n_ff_expert=512)
    assert est.compute_bytes(moe, 1024, 1) > est.compute_bytes(dense, 1024, 1)
    values = 3 * 4 * 512 + 5 * SMOL.n_embd + 3 * 16 + 4 * SMOL.n_embd
    assert est.compute_bytes(moe, 1024, 1) == 512 * (4 * values + 2 * 1024)


def test_repacked_weights_are_anonymous_on_cpus_that_repack() -> None:
    x86 = est.REPACK_TYPES["x86_64"]
    assert est.repacked_bytes(GEMMA, x86) == 13_271_040  # llama.cpp: CPU_REPACK 12.66 MiB
    assert est.repacked_bytes(SMOL, x86) == 0  # Q4_1 and Q8_0 stay mapped
    arm = est.REPACK_TYPES["aarch64"]
    # on ARM q8_0 repacks too, and a tied token_embd is the output projection's weight
    assert est.repacked_bytes(GEMMA, arm) == 13_271_040 + 9_676_800 + 179_824_640


def test_llm_footprint_parts_add_up() -> None:
    fp = est.footprint(llm(), 4096, slots=2)
    assert fp.kv_bytes == est.kv_bytes(SMOL, 4096, 2, "f16")
    assert fp.anonymous == fp.kv_bytes + fp.repacked + fp.overhead
    assert fp.file_backed == SMOL.tensor_bytes + est.LLAMA_RUNTIME_FILE
    assert fp.working == fp.compute + 2 * est.slot_bytes(SMOL, 4096, "f16")
    assert fp.at_load == fp.total - fp.working
    assert fp.weights == 98_362_432
    assert (fp.n_ctx, fp.slots, fp.kv_type, fp.measured) == (4096, 2, "f16", False)
    # no tensor sizes in the metadata: the file size stands in for them
    bare = est.footprint(llm(replace(SMOL, tensor_bytes=None)), 4096)
    assert bare.file_backed == 98_362_432 + est.LLAMA_RUNTIME_FILE


@pytest.mark.parametrize(
    ("info", "n_ctx", "slots", "measured_mib"),
    [
        # right after load, calibrate on the new engine (this machine, runner modules)
        (SMOL, 512, 1, 169.6),
        (SMOL, 2048, 4, 338.4),
        (SMOL, 8192, 4, 878.4),
        (GEMMA, 512, 1, 356.6),
        (GEMMA, 2048, 4, 433.2),
        (GEMMA, 8192, 4, 505.1),
    ],
)
def test_bundled_models_at_load(
    info: GGUFInfo, n_ctx: int, slots: int, measured_mib: float
) -> None:
    fp = est.footprint(llm(info), n_ctx, slots)
    assert close(fp.at_load / MiB, measured_mib, 0.02)


def test_slots_add_sampling_state_and_sliding_window_checkpoints() -> None:
    assert est.slot_bytes(SMOL, 4096, "f16") == 49152 * est.SLOT_PER_VOCAB
    # gemma3: one checkpoint of the 15 windowed layers × the window's 512 cells × 1 KiB
    # (issue 27c: not the cache's 1,024, which leaves room for a micro-batch beyond it)
    checkpoint = est.CTX_CHECKPOINTS * 15 * 512 * 1024
    assert est.slot_bytes(GEMMA, 4096, "f16") == 262144 * est.SLOT_PER_VOCAB + checkpoint
    # a context shorter than the window checkpoints all of it (padded as the cache is)
    assert est.checkpoint_cells(GEMMA, 200) == 256 and est.checkpoint_cells(SMOL, 4096) == 0


def test_quantized_kv_is_smaller() -> None:
    sizes = [est.footprint(llm(), 8192, kv_type=kv).total for kv in ("f16", "q8_0", "q4_0")]
    assert sizes[0] > sizes[1] > sizes[2]


def test_bigger_vocabulary_costs_more() -> None:
    small = est.footprint(llm(), 512)
    big = est.footprint(llm(replace(SMOL, n_vocab=262144)), 512)
    per_vocab = est.LLAMA_PER_VOCAB + est.LOGIT_BYTES + est.SLOT_PER_VOCAB
    assert big.overhead - small.overhead == (262144 - 49152) * per_vocab


def test_unknown_kv_type_is_a_bad_request() -> None:
    with pytest.raises(BadRequest, match="q8_0") as err:
        est.footprint(llm(), 512, kv_type="f32")
    assert err.value.status == 400 and err.value.param == "kv_type"


def test_resident_footprint_scales_with_weights() -> None:
    profile = est.RESIDENT_PROFILES["whisper"]
    fp = est.footprint(resident("whisper", 100 * MiB), 0)
    assert fp.weights == 100 * MiB
    assert fp.anonymous == math.ceil(100 * MiB * profile.anon_factor) + profile.runtime_anon
    assert fp.file_backed == profile.runtime_file
    assert fp.kv_bytes == 0 and fp.working == 0
    bigger = est.footprint(resident("whisper", 200 * MiB), 0)
    assert bigger.anonymous > fp.anonymous


def test_unmeasured_engine_gets_the_generic_guess() -> None:
    fp = est.footprint(resident("brand-new", 10 * MiB), 0)
    assert fp.anonymous == 3 * 10 * MiB + est.GENERIC_PROFILE.runtime_anon


def test_an_llm_measurement_wins_and_keeps_the_predicted_working_memory() -> None:
    # A measurement is taken right after load: what serving adds is still predicted.
    seen = ProcessMemory(anonymous=300 * MiB, file_backed=120 * MiB)
    predicted = est.footprint(llm(), 8192)
    fp = est.footprint(llm(), 8192, measured=seen)
    assert fp.measured is True
    assert (fp.anonymous, fp.file_backed) == (300 * MiB + predicted.working, 120 * MiB)
    assert fp.at_load == 420 * MiB
    assert fp.kv_bytes == 23040 * 8192  # still the arithmetic, for sizing
    assert fp.overhead == fp.anonymous - fp.kv_bytes


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


# ---------------------------------------------------------------- the prompt-cache grant


def test_prompt_cache_grant_is_what_is_asked_shrunk_to_the_room() -> None:
    fp = est.footprint(llm(), 2048, slots=4)
    room = fp.total + 100 * MiB
    assert est.prompt_cache_grant(room, fp, 512 * MiB) == 100 * MiB
    assert est.prompt_cache_grant(room, fp, 64 * MiB) == 64 * MiB
    # whole MiB (the engine's unit), and nothing below the floor: a cache too small to
    # hold one prompt is turned off rather than thrashed
    assert est.prompt_cache_grant(fp.total + 100 * MiB + 5000, fp, 512 * MiB) == 100 * MiB
    assert est.prompt_cache_grant(fp.total + est.MIN_PROMPT_CACHE - 1, fp, 512 * MiB) == 0
    assert est.prompt_cache_grant(fp.total - MiB, fp, 512 * MiB) == 0
    assert est.prompt_cache_grant(room, fp, 0) == 0  # kv_ram_max 0: no cache


def test_prompt_cache_grant_is_at_most_kv_factor_times_the_kv_cache() -> None:
    fp = est.footprint(llm(), 2048, slots=1)  # a small KV cache: the cap binds
    room = fp.total + 1024 * MiB
    kv = fp.kv_bytes
    assert MiB * 16 < kv < 512 * MiB
    assert est.prompt_cache_grant(room, fp, 512 * MiB, 1.0) == kv // MiB * MiB
    assert est.prompt_cache_grant(room, fp, 512 * MiB, 2.0) == 2 * kv // MiB * MiB
    assert est.prompt_cache_grant(room, fp, 512 * MiB, 0.0) == 512 * MiB  # 0: no such cap
    # kv_ram_max still caps it, the room still shrinks it
    assert est.prompt_cache_grant(room, fp, 8 * MiB, 1.0) == 0  # under MIN_PROMPT_CACHE
    assert est.prompt_cache_grant(fp.total + 20 * MiB, fp, 512 * MiB, 1.0) == 20 * MiB


def test_resident_engines_get_no_grant() -> None:
    fp = est.footprint(resident("whisper", 78 * MiB), 0)
    assert est.prompt_cache_grant(10 * 1024 * MiB, fp, 512 * MiB) == 0


# ---------------------------------------------------------------- max_context / auto_context


def test_max_context_is_the_largest_fitting_multiple_of_256() -> None:
    spec = llm()
    budget = est.footprint(spec, 2816).total + 100_000  # less than 256 more tokens' KV
    n = est.max_context(spec, budget)
    assert n == 2816
    assert est.footprint(spec, n).total <= budget
    assert est.footprint(spec, n + 256).total > budget


def test_max_context_with_slots_and_sliding_windows() -> None:
    for info, slots in ((SMOL, 4), (GEMMA, 1), (GEMMA, 4)):
        spec = llm(info)
        budget = est.footprint(spec, 5000, slots).total
        n = est.max_context(spec, budget, slots)
        assert est.footprint(spec, n, slots).total <= budget
        assert est.footprint(spec, n + 256, slots).total > budget


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
    four = est.auto_context(spec, est.footprint(spec, 4096).total, 8192, 512, slots=4)
    assert 512 <= four < 4096  # four slots each own a context


def test_auto_context_when_trained_context_is_below_min_ctx() -> None:
    spec = llm(replace(SMOL, trained_ctx=256))
    assert est.auto_context(spec, 100 * 1024 * MiB, 8192, 512) == 256
