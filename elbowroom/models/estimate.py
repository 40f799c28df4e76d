"""PURE footprint arithmetic: what a model will hold once loaded, before loading it.

LLMs (llama.cpp, mmap):
    file_backed = GGUF file size + LLAMA_RUNTIME_FILE (the shared libraries' pages)
    anonymous   = KV bytes/token × n_ctx + LLAMA_FIXED_ANON + LLAMA_PER_VOCAB × n_vocab
                  + slots × n_vocab × 4 (one f32 logits row per sequence)
    KV bytes/token = Σ_layers kv_heads × (head_dim_k + head_dim_v) × bytes per element

``n_ctx`` is the total context llama.cpp allocates; ``slots`` sequences share it (each gets
n_ctx / slots tokens), so the KV cache does not grow with slots. Sliding-window models
(gemma3) are sized with a full-size KV cache on every layer: llama-cpp-python's default
(``swa_full``) and what we measured.

Resident engines (whisper, piper, onnx-embed, pocketsphinx):
    anonymous = weights on disk × factor + runtime (interpreter + library)
    file_backed = the library's mapped shared objects

Every constant below was measured on the bundled models with /proc/PID/smaps_rollup
(benchmarks/estimate_accuracy.py reproduces the measurements and records the error).
The state after one short request is what is predicted: a long prompt's prefill touches
more of llama.cpp's compute buffer (up to ~50 MB more on the bundled models, less with flash
attention), and a large embedding batch holds its activations while it runs.
docs/models.md has the details.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, replace
from typing import TYPE_CHECKING

from elbowroom.errors import BadRequest
from elbowroom.memory.types import ProcessMemory
from elbowroom.models.spec import Footprint, GGUFInfo, ModelSpec
from elbowroom.units import MiB

if TYPE_CHECKING:
    from elbowroom.models.measured import MeasuredStore

# Bytes per KV element: f16 is 2; q8_0 packs 32 values in 34 bytes, q4_0 in 18.
KV_TYPE_BYTES: dict[str, float] = {"f16": 2.0, "q8_0": 34 / 32, "q4_0": 18 / 32}

CTX_STEP = 256  # auto-sized contexts are multiples of this

# --- llama.cpp (llama-cpp-python 0.3.36, CPU), fitted on SmolLM2-135M (vocab 49,152) and
# gemma3-270m (vocab 262,144) after a short generation, n_ctx 512..8192, f16/q8_0/q4_0 KV,
# flash attention on and off. Anonymous minus KV was 45.6 MB and 90.2 MB: solving
# fixed + per_vocab × n_vocab for both gives 33.7 MB and 209.5 B (the per-vocab part is
# llama.cpp's vocabulary tables). The fixed part is the interpreter with llama_cpp imported
# (21.9 MB) plus the context's buffers, rounded up, plus 2 MiB for elbowroom's runner
# modules, which the calibration child does not import.
LLAMA_FIXED_ANON = 36 * MiB
LLAMA_PER_VOCAB = 210
LOGIT_BYTES = 4  # one f32 per vocabulary entry per sequence
# Shared libraries (libllama, libggml, numpy, python) mapped by the runner: 30.5 MB measured.
LLAMA_RUNTIME_FILE = 30 * MiB
# A GGUF without a vocabulary size is sized as if it had a large one (conservative).
DEFAULT_VOCAB = 128_000
RUNNER_MODULES = 2 * MiB  # elbowroom's runner + engine modules, on top of the library


@dataclass(frozen=True, slots=True)
class ResidentProfile:
    """How a resident engine's memory relates to its weights on disk."""

    anon_factor: float  # anonymous bytes per byte of weights on disk
    runtime_anon: int  # interpreter + library + our runner modules, before the model loads
    runtime_file: int  # the library's shared objects (file-backed)
    source: str  # where the numbers came from


# Measured with elbowroom.models.calibrate (elbowroom's own engine classes, 2 threads),
# after one small request: runtime_anon = the libraries imported (no weights) +
# RUNNER_MODULES; anon_factor = (after the request − after import) / weights on disk.
# runtime_file = file-backed after the request (the libraries' shared objects), rounded up.
RESIDENT_PROFILES: dict[str, ResidentProfile] = {
    # faster-whisper int8, tiny.en (78.1 MB folder), 3 s tone via av: 210-235 MiB over runs
    # (decoding varies), import 26.8 MiB; the factor aims at the middle, 226 MiB.
    "whisper": ResidentProfile(2.65, 27 * MiB + RUNNER_MODULES, 57 * MiB, "whisper-tiny.en"),
    # piper without the onnxruntime arena (engines/piper.py), en_US-joe-medium (63.2 MB),
    # one sentence: 136.3 MiB, import 23.4 MiB; rounded up to 2.0 because longer sentences
    # settle near 150 MB (the engine's own measurement).
    "piper": ResidentProfile(2.0, 23 * MiB + RUNNER_MODULES, 53 * MiB, "piper-en-us-joe"),
    # onnxruntime without constant folding or arena (engines/embed.py), MiniLM-L6 int8
    # (22.9 MB), 8 short inputs: 68.3 MiB, import 23.5 MiB. A big batch adds activations
    # for its duration only (no arena); they are not part of the footprint.
    "onnx-embed": ResidentProfile(2.1, 24 * MiB + RUNNER_MODULES, 45 * MiB, "minilm-l6-v2"),
    # pocketsphinx en-us (37.9 MB model folder), 3 s tone via av: 110.4 MiB, import 19.2.
    "pocketsphinx": ResidentProfile(2.55, 19 * MiB + RUNNER_MODULES, 41 * MiB, "sphinx-en-us"),
}
# An engine we have not measured: assume it holds three times its weights.
GENERIC_PROFILE = ResidentProfile(3.0, 64 * MiB, 64 * MiB, "unmeasured engine: a guess")


def check_kv_type(kv_type: str) -> float:
    try:
        return KV_TYPE_BYTES[kv_type]
    except KeyError:
        raise BadRequest(
            f"unknown KV cache type {kv_type!r}: use one of {', '.join(KV_TYPE_BYTES)}",
            param="kv_type",
        ) from None


def kv_bytes_per_token(info: GGUFInfo, kv_type: str) -> int:
    """Bytes the KV cache holds per context token, summed over layers."""
    per_element = check_kv_type(kv_type)
    heads = info.kv_heads_per_layer or (info.n_kv_heads,) * info.n_layers
    elements = sum(heads) * (info.head_dim_k + info.head_dim_v)
    return math.ceil(elements * per_element)


def _llm_footprint(
    spec: ModelSpec, info: GGUFInfo, n_ctx: int, slots: int, kv_type: str
) -> Footprint:
    per_token = kv_bytes_per_token(info, kv_type)
    vocab = info.n_vocab or DEFAULT_VOCAB
    overhead = LLAMA_FIXED_ANON + LLAMA_PER_VOCAB * vocab + slots * vocab * LOGIT_BYTES
    kv = per_token * n_ctx
    return Footprint(
        weights=spec.size_bytes,
        file_backed=spec.size_bytes + LLAMA_RUNTIME_FILE,
        anonymous=kv + overhead,
        kv_bytes_per_token=per_token,
        kv_bytes=kv,
        overhead=overhead,
        n_ctx=n_ctx,
        slots=slots,
        kv_type=kv_type,
    )


def resident_profile(engine: str) -> ResidentProfile:
    return RESIDENT_PROFILES.get(engine, GENERIC_PROFILE)


def _resident_footprint(spec: ModelSpec) -> Footprint:
    profile = resident_profile(spec.engine)
    in_memory = math.ceil(spec.size_bytes * profile.anon_factor)
    return Footprint(
        weights=spec.size_bytes,
        file_backed=profile.runtime_file,
        anonymous=in_memory + profile.runtime_anon,
        overhead=in_memory + profile.runtime_anon - spec.size_bytes,
    )


def footprint(
    spec: ModelSpec,
    n_ctx: int,
    slots: int = 1,
    kv_type: str = "f16",
    measured: MeasuredStore | ProcessMemory | None = None,
) -> Footprint:
    """Predicted bytes once loaded; a measurement for the same file and settings wins.

    ``measured`` is the store to look in, or a measurement already looked up (what the
    scheduler passes). KV bytes/token and the KV total stay the prediction's either way.
    """
    if n_ctx < 0 or slots < 1:
        raise BadRequest(f"need n_ctx >= 0 and slots >= 1, got n_ctx={n_ctx} slots={slots}")
    check_kv_type(kv_type)
    if spec.gguf is not None:
        predicted = _llm_footprint(spec, spec.gguf, n_ctx, slots, kv_type)
    else:
        predicted = _resident_footprint(spec)
    if isinstance(measured, ProcessMemory) or measured is None:
        seen = measured
    else:
        seen = measured.lookup(spec, n_ctx, slots, kv_type)
    if seen is None:
        return predicted
    anonymous, file_backed = seen.anonymous, seen.file_backed
    if spec.gguf is None and spec.engine in RESIDENT_PROFILES:
        # A resident engine's working memory appears at its first request (whisper: 93 MiB
        # after load, 217 after one transcription), and a measurement may have been taken
        # right after load: a calibrated prediction is a floor, a larger measurement wins.
        anonymous = max(anonymous, predicted.anonymous)
        file_backed = max(file_backed, predicted.file_backed)
    return replace(
        predicted,
        file_backed=file_backed,
        anonymous=anonymous,
        overhead=max(0, anonymous - predicted.kv_bytes - (0 if spec.gguf else spec.size_bytes)),
        measured=True,
    )


def context_cap(spec: ModelSpec, ceiling: int | None) -> int:
    """The largest context allowed: the trained context, capped by ``ceiling``."""
    trained = spec.gguf.trained_ctx if spec.gguf is not None else 0
    caps = [c for c in (trained, ceiling) if c]
    return min(caps) if caps else 0


def max_context(
    spec: ModelSpec,
    budget_bytes: int,
    slots: int = 1,
    kv_type: str = "f16",
    ceiling: int | None = None,
    measured: MeasuredStore | None = None,
) -> int:
    """Largest n_ctx (a multiple of 256) whose footprint fits ``budget_bytes``; 0 if none.

    Never above the trained context nor ``ceiling``. A model trained on fewer than 256
    tokens may get its whole trained context. Non-LLMs have no context: 0.
    """
    if spec.gguf is None:
        return 0
    cap = context_cap(spec, ceiling)
    if cap <= 0:
        return 0

    def fits(n: int) -> bool:
        return footprint(spec, n, slots, kv_type, measured).total <= budget_bytes

    if cap < CTX_STEP:
        return cap if fits(cap) else 0
    # Footprints are linear in n_ctx (predicted and rescaled measurements alike):
    # solve, then step down in case a measurement makes it slightly non-linear.
    base = footprint(spec, 0, slots, kv_type, measured).total
    slope = kv_bytes_per_token(spec.gguf, kv_type)
    best = cap if slope == 0 else min(cap, max(0, (budget_bytes - base) // slope))
    n = best // CTX_STEP * CTX_STEP
    while n >= CTX_STEP and not fits(n):
        n -= CTX_STEP
    return n


def auto_context(
    spec: ModelSpec,
    budget_bytes: int,
    settings_max_ctx: int,
    min_ctx: int,
    slots: int = 1,
    kv_type: str = "f16",
    measured: MeasuredStore | None = None,
) -> int:
    """The context to load an LLM with when the user did not set one; 0 = refuse.

    The largest multiple of 256 ≤ min(trained ctx, settings_max_ctx) that fits the budget;
    below ``min_ctx`` (or the trained context, if smaller) it is 0.
    """
    n = max_context(spec, budget_bytes, slots, kv_type, settings_max_ctx, measured)
    floor = min(min_ctx, context_cap(spec, settings_max_ctx)) or min_ctx
    return n if n >= floor and n > 0 else 0
