"""PURE footprint arithmetic: what a model will hold once loaded, before loading it.

LLMs (llama.cpp's server engine, xllamacpp, CPU, mmap):
    file_backed = tensor data (the mapped weights) + LLAMA_RUNTIME_FILE
                  [+ CUDA_CPU_FILE: the CUDA build's libraries]
    anonymous   = LLAMA_RUNTIME_ANON + LLAMA_FIXED_ANON + LLAMA_PER_VOCAB × n_vocab
                  + KV + output (slots × n_vocab × 4) + repacked weights
                  + working                                       (the part use adds)
                  [+ CUDA_CPU_ANON: the CUDA build]
    repacked    = the repack types' matrix weights; on an AMX build (engine_build.py) the
                  AMX types' at AMX_COPY × their size, and the remaining repack types
    KV          = slots × Σ_layers cells × kv_heads × (head_dim_k + head_dim_v) × bytes
                  cells = n_ctx per slot (padded to 256); a sliding-window layer holds
                  min(n_ctx, pad256(window + n_ubatch)) (llama.cpp's iswa cache)
    working     = compute + slots × (SLOT_PER_VOCAB × n_vocab + checkpoints)
    checkpoints = CTX_CHECKPOINTS × the window's cells × sliding-window KV per cell
    compute     = n_ubatch × 4 × (3 × n_ff + 5 × n_embd [+ MoE router and outputs])
                  + n_ubatch × 2 × KV cells (the attention masks, f16)

``n_ctx`` is the PER-SLOT context: the engine gets n_ctx × slots, each slot owns n_ctx
(``kv_unified`` off). Quantized weights that llama.cpp's CPU backend repacks (q4_0, q4_K,
iq4_nl, mxfp4 on x86; more types on ARM) are copied into anonymous memory, and their mapped
pages stay resident as well. The RAM prompt cache is NOT part of a footprint: it is a grant
the budget hands out separately (``prompt_cache_grant``), which the engine never exceeds.

Resident engines (whisper, piper, onnx-embed, pocketsphinx):
    anonymous = weights on disk × factor + runtime (interpreter + library)
    file_backed = the library's mapped shared objects

The constants were fitted on the two bundled LLMs only (SmolLM2-135M, gemma3-270m) with
``elbowroom.models.calibrate``; ``benchmarks/estimate_accuracy.py`` checks them on
held-out synthetic models of other architectures and sizes (docs/models.md).
"""

from __future__ import annotations

import math
import platform
from dataclasses import dataclass, replace
from typing import Protocol

from elbowroom.config import KV_TYPES
from elbowroom.errors import BadRequest
from elbowroom.memory.types import ProcessMemory
from elbowroom.models.engine_build import PORTABLE, EngineBuild, engine_build
from elbowroom.models.mlx_meta import mlx_footprint
from elbowroom.models.spec import Footprint, GGUFInfo, ModelSpec
from elbowroom.models.vision import extra_footprint
from elbowroom.units import MiB


class Measurements(Protocol):
    """Where earlier measurements are looked up (``models.measured.MeasuredStore``; named
    by its shape here, since the store computes with this module's ``footprint``)."""

    def lookup(
        self, spec: ModelSpec, n_ctx: int, slots: int, kv_type: str
    ) -> ProcessMemory | None: ...


# Bytes per KV element: f16 is 2; q8_0 packs 32 values in 34 bytes, q4_0 in 18.
KV_TYPE_BYTES: dict[str, float] = dict(zip(KV_TYPES, (2.0, 34 / 32, 18 / 32), strict=True))

# Auto-sized contexts, GPU-fitted contexts and suggested --ctx values are multiples of this
# (llama.cpp pads the KV cache to 256 cells anyway, so a finer step would save nothing).
CTX_STEP = 256

# --- the engine's settings the estimate assumes (calibrate.engine_params passes them)
N_UBATCH = 512  # llama.cpp's default micro-batch: sizes the compute buffer
KV_PAD = 256  # llama.cpp pads KV caches (with flash attention) to multiples of this
# Context checkpoints per slot (llama.cpp's n_ctx_checkpoints): a sliding-window model
# (gemma3) snapshots its window state near the end of each prompt, so the next turn of a
# conversation can reuse the cache. Each holds the window's cells, not the cache's room
# for a micro-batch beyond it (gemma3-270m: 512 cells, 7.5 MiB; issue 27c measured 10.5
# to 14 MiB per served slot with the sampler's arrays, after ~1,400-1,800-token prompts);
# llama.cpp's default of 32 would let a slot grow by ~0.25 GiB. One is enough for a
# conversation that grows turn by turn, or a regenerated answer.
CTX_CHECKPOINTS = 1

# --- fitted on SmolLM2-135M (BPE vocab 49,152) and gemma3-270m (SPM vocab 262,144), right
# after load, n_ctx 512..8192 per slot, slots 1 and 4, f16/q8_0/q4_0 KV: anonymous minus
# the import baseline minus llama.cpp's reported KV, output and repacked buffers was
# 26.6-27.1 MiB and 58.2-61.2 MiB, flat in n_ctx and slots. Solving
# fixed + per_vocab × n_vocab: 19.3 MiB and 161 B (the vocabulary tables and the token
# maps). The fixed part is engine state: threads, graph metadata, what warmup touched.
LLAMA_FIXED_ANON = int(19.3 * MiB)
LLAMA_PER_VOCAB = 161
# A runner before its model loads: the interpreter with the worker, the engine's modules
# and xllamacpp imported (15.1 MiB anonymous, 18.9 MiB of mapped libraries); loading maps
# 5 MiB more library code (file-backed after load minus the tensor data: 23.9 / 24.0 MiB).
LLAMA_RUNTIME_ANON = int(15.1 * MiB)
LLAMA_RUNTIME_FILE = 24 * MiB
LOGIT_BYTES = 4  # the output buffer: one f32 logits row per slot
# Per slot once it has served a request: the sampler's candidate arrays and the slot's
# token state, ~28.6 B per vocabulary entry on both models (4 slots vs 1, after a
# ~300-token prompt each).
SLOT_PER_VOCAB = 29
# The compute buffer llama.cpp reserves for an n_ubatch-token batch (flash attention on):
# 3 × n_ff + 5 × n_embd f32 values per token matched both models' reported buffers to
# 0.1 % and 2.5 % (SmolLM2: 3 × 1536 + 5.0 × 576; gemma3: 3 × 2048 + 4.6 × 640), plus an
# f16 mask row per KV cell (1,024 B per cell measured: n_ubatch × 2).
COMPUTE_PER_FF = 3
COMPUTE_PER_EMBD = 5
MASK_BYTES = 2
# A GGUF without a vocabulary size is sized as if it had a large one (conservative).
DEFAULT_VOCAB = 128_000
RUNNER_MODULES = 2 * MiB  # elbowroom's runner + engine modules, on top of a library

# Weight types llama.cpp's CPU backend repacks into its own (anonymous) buffer, by
# machine: x86 with AVX2 (ggml-cpu/repack.cpp), ARM with dot-product / int8 matmul.
REPACK_TYPES: dict[str, frozenset[str]] = {
    "x86_64": frozenset({"Q4_0", "Q4_K", "IQ4_NL", "MXFP4"}),
    "aarch64": frozenset({"Q4_0", "Q4_K", "Q5_K", "Q6_K", "IQ4_NL", "MXFP4", "Q8_0"}),
}
REPACK_TYPES["amd64"] = REPACK_TYPES["x86_64"]
REPACK_TYPES["arm64"] = REPACK_TYPES["aarch64"]
HOST_REPACK = REPACK_TYPES.get(platform.machine().lower(), frozenset())
# A build for an AMX CPU (engine_build.py) copies the weights of these types into its AMX
# buffer first, at these sizes per byte of the file (ggml-cpu/amx/mmq.cpp get_row_size:
# q8_0 gains an int32 per 32-value block, q4_K and q5_K 4 bytes per 256, iq4_xs 2); the
# types it does not take still go to the repack buffer. Measured on the H100 machine's
# Xeon (issue 27): llama 1 B f16, q8_0, q4_K_M, q5_K_M, qwen2 3 B q4_K_M, SmolLM2 and
# gemma3 CPU-only on the CUDA build: anonymous within 33-83 MiB above the estimate's
# other terms plus these copies (the rest is CUDA_CPU_ANON).
AMX_COPY: dict[str, float] = {
    "F16": 1.0,
    "Q4_0": 1.0,
    "Q4_1": 1.0,
    "Q8_0": 38 / 34,
    "Q4_K": 148 / 144,
    "Q5_K": 180 / 176,
    "Q6_K": 1.0,
    "IQ4_XS": 138 / 136,
}
# A CPU-only runner of the CUDA build (shown no GPU): the CUDA libraries that loading maps
# and touches (cuBLASLt 61 MiB, the driver 6 MiB: 64 MiB more file-backed than the CPU
# wheel's library), and 33-83 MiB more anonymous memory than the CPU wheel's estimate
# over seven models, 1 and 8 slots, 2,048 and 8,192 tokens (H100 machine, issue 27).
CUDA_CPU_ANON = 80 * MiB
CUDA_CPU_FILE = 64 * MiB

# Sliding-window layer patterns llama.cpp applies when the file does not say: in each
# group of N layers, all but the last use the window (gemma3: 5 local, 1 global).
# Architectures not listed (phi3: llama.cpp turns its window off) use full attention.
SWA_PATTERNS: dict[str, int] = {"gemma3": 6, "gemma2": 2, "cohere2": 4, "gpt-oss": 2}
SWA_DEFAULT_WINDOW = {"gemma2": 4096}


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


def _pad(n: int, to: int) -> int:
    return -(-n // to) * to


def _row_bytes(elements: int, kv_type: str) -> int:
    """Bytes of one KV row: quantized types store whole 32-value blocks."""
    per = check_kv_type(kv_type)
    if kv_type == "f16":
        return int(elements * per)
    return math.ceil(elements / 32) * int(per * 32)


def swa_layers(info: GGUFInfo) -> tuple[bool, ...]:
    """Which layers use a sliding window, as llama.cpp decides for this architecture."""
    window = info.sliding_window or SWA_DEFAULT_WINDOW.get(info.architecture)
    pattern = info.swa_pattern or SWA_PATTERNS.get(info.architecture)
    if not window or not pattern:
        return (False,) * info.n_layers
    return tuple(i % pattern < pattern - 1 for i in range(info.n_layers))


def _kv_per_cell(info: GGUFInfo, kv_type: str) -> tuple[int, int]:
    """KV bytes per cell (one token of one slot), summed over full and over SWA layers."""
    heads = info.kv_heads_per_layer or (info.n_kv_heads,) * info.n_layers
    full = swa = 0
    for n, windowed in zip(heads, swa_layers(info), strict=True):
        cell = _row_bytes(n * info.head_dim_k, kv_type) + _row_bytes(n * info.head_dim_v, kv_type)
        if windowed:
            swa += cell
        else:
            full += cell
    return full, swa


def _cells(info: GGUFInfo, n_ctx: int) -> tuple[int, int]:
    """KV cells per slot: (full-attention layers, sliding-window layers)."""
    full = _pad(n_ctx, KV_PAD) if n_ctx > 0 else 0
    window = info.sliding_window or SWA_DEFAULT_WINDOW.get(info.architecture) or 0
    return full, min(full, _pad(window + N_UBATCH, KV_PAD))


def kv_bytes_per_token(info: GGUFInfo, kv_type: str) -> int:
    """KV bytes per token of one slot's context, in the layers whose cache grows with it
    (a sliding-window layer stops growing at its window)."""
    return _kv_per_cell(info, kv_type)[0] or _kv_per_cell(info, kv_type)[1]


def kv_bytes(info: GGUFInfo, n_ctx: int, slots: int, kv_type: str) -> int:
    """The whole KV cache: every slot owns ``n_ctx`` cells (sliding-window layers fewer)."""
    full_cell, swa_cell = _kv_per_cell(info, kv_type)
    full, swa = _cells(info, n_ctx)
    return slots * (full * full_cell + swa * swa_cell)


def _ff_width(info: GGUFInfo) -> tuple[int, int]:
    """(feed-forward values per token, extra MoE values per token) for the compute buffer."""
    if info.n_expert and info.n_expert_used:
        expert = info.n_ff_expert or info.n_ff or 4 * info.n_embd
        shared = info.n_ff_shared or 0
        # the experts' gate/up/act, the router's logits/probabilities, and the chosen
        # experts' outputs before they are summed
        width = info.n_expert_used * expert + shared
        return width, 3 * info.n_expert + info.n_expert_used * info.n_embd
    return info.n_ff or 4 * info.n_embd, 0


def compute_bytes(info: GGUFInfo, n_ctx: int, slots: int) -> int:
    """llama.cpp's compute buffer for an n_ubatch-token batch, masks included."""
    tokens = min(N_UBATCH, max(1, n_ctx * slots))
    ff, moe = _ff_width(info)
    values = COMPUTE_PER_FF * ff + COMPUTE_PER_EMBD * info.n_embd + moe
    full, swa = _cells(info, n_ctx)
    windowed = any(swa_layers(info))
    masks = full * (not windowed or not all(swa_layers(info))) + swa * windowed
    return tokens * (4 * values + MASK_BYTES * masks)


def repacked_bytes(
    info: GGUFInfo, repack: frozenset[str] = HOST_REPACK, build: EngineBuild = PORTABLE
) -> int:
    """Weights the CPU backend copies into its repacked (or AMX) buffer: anonymous."""
    total = 0
    for kind, size in info.matmul_bytes:
        if build.amx and kind in AMX_COPY:
            total += math.ceil(size * AMX_COPY[kind])
        elif kind in repack:
            total += size
    return total


def slot_bytes(info: GGUFInfo, n_ctx: int, kv_type: str) -> int:
    """What one slot holds once it has served: sampling state and context checkpoints."""
    vocab = info.n_vocab or DEFAULT_VOCAB
    _full_cell, swa_cell = _kv_per_cell(info, kv_type)
    return SLOT_PER_VOCAB * vocab + CTX_CHECKPOINTS * checkpoint_cells(info, n_ctx) * swa_cell


def checkpoint_cells(info: GGUFInfo, n_ctx: int) -> int:
    """Cells of a sliding-window layer in one context checkpoint: the window (the cache
    prunes what falls out of it), or the whole context when that is shorter."""
    window = info.sliding_window or SWA_DEFAULT_WINDOW.get(info.architecture) or 0
    return min(_cells(info, n_ctx)[0], window) if any(swa_layers(info)) else 0


def _llm_footprint(
    spec: ModelSpec, info: GGUFInfo, n_ctx: int, slots: int, kv_type: str, build: EngineBuild
) -> Footprint:
    vocab = info.n_vocab or DEFAULT_VOCAB
    kv = kv_bytes(info, n_ctx, slots, kv_type)
    compute = compute_bytes(info, n_ctx, slots)
    repacked = repacked_bytes(info, build=build)
    working = compute + slots * slot_bytes(info, n_ctx, kv_type)
    overhead = (
        LLAMA_RUNTIME_ANON
        + LLAMA_FIXED_ANON
        + LLAMA_PER_VOCAB * vocab
        + slots * vocab * LOGIT_BYTES
        + working
    )
    tensors = info.tensor_bytes or spec.size_bytes
    runtime_file = LLAMA_RUNTIME_FILE
    if build.cuda:
        overhead += CUDA_CPU_ANON
        runtime_file += CUDA_CPU_FILE
    if spec.projector is not None:
        # The projector's weights and encoder: anonymous; its working part appears with
        # the first image (models/vision.py).
        cost = extra_footprint(spec.projector, info.n_embd)
        working += cost.working
        overhead += cost.at_load + cost.working
    return Footprint(
        weights=spec.size_bytes,
        file_backed=tensors + runtime_file,
        anonymous=kv + repacked + overhead,
        kv_bytes_per_token=kv_bytes_per_token(info, kv_type),
        kv_bytes=kv,
        overhead=overhead,
        n_ctx=n_ctx,
        slots=slots,
        kv_type=kv_type,
        compute=compute,
        repacked=repacked,
        working=working,
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
    measured: Measurements | ProcessMemory | None = None,
    build: EngineBuild | None = None,
) -> Footprint:
    """Predicted bytes once loaded; a measurement for the same file and settings wins.

    ``build`` is the LLM engine's build (default: the installed one, ``engine_build``): the
    CUDA build's runner on the CPU and an AMX build's weight copies add host bytes.

    ``n_ctx`` is the context of each of the ``slots`` (the engine gets n_ctx × slots).
    ``measured`` is the store to look in, or a measurement already looked up (what the
    scheduler passes). KV bytes/token and the KV total stay the prediction's either way.
    """
    if n_ctx < 0 or slots < 1:
        raise BadRequest(f"need n_ctx >= 0 and slots >= 1, got n_ctx={n_ctx} slots={slots}")
    check_kv_type(kv_type)
    if spec.gguf is not None:
        build = engine_build() if build is None else build
        predicted = _llm_footprint(spec, spec.gguf, n_ctx, slots, kv_type, build)
    elif spec.mlx is not None:
        predicted = mlx_footprint(spec.mlx, n_ctx, slots)
    else:
        predicted = _resident_footprint(spec)
    if isinstance(measured, ProcessMemory) or measured is None:
        seen = measured
    else:
        seen = measured.lookup(spec, n_ctx, slots, kv_type)
    if seen is None:
        return predicted
    anonymous, file_backed = seen.anonymous, seen.file_backed
    if spec.gguf is not None or spec.mlx is not None:
        # An LLM is measured right after load (docs/models.md: what it grows into later is
        # its prompt cache, a grant): what serving adds is still the prediction's.
        anonymous += predicted.working
    elif spec.engine in RESIDENT_PROFILES:
        # A resident engine's working memory appears at its first request (whisper: 93 MiB
        # after load, 217 after one transcription), and a measurement may have been taken
        # right after load: a calibrated prediction is a floor, a larger measurement wins.
        anonymous = max(anonymous, predicted.anonymous)
        file_backed = max(file_backed, predicted.file_backed)
    if spec.gguf is not None:
        not_overhead = predicted.kv_bytes + predicted.repacked
    elif spec.mlx is not None:
        not_overhead = predicted.kv_bytes + predicted.weights
    else:
        not_overhead = spec.size_bytes
    return replace(
        predicted,
        file_backed=file_backed,
        anonymous=anonymous,
        overhead=max(0, anonymous - not_overhead),
        measured=True,
    )


# A prompt cache smaller than this cannot hold a useful prompt's state (SmolLM2: 22 MiB per
# 1,000 tokens): the engine gets none rather than one that only thrashes.
MIN_PROMPT_CACHE = 16 * MiB


def prompt_cache_grant(room: int, fp: Footprint, wanted: int, kv_factor: float = 0.0) -> int:
    """Bytes of RAM prompt cache to grant an LLM being loaded (the engine's ``cache_ram_mib``).

    ``room`` is what the budget lets this load take (the load ceiling less what others hold
    and cannot give up), ``fp`` the model's own footprint, ``wanted`` the ``kv_ram_max``
    knob, ``kv_factor`` the ``kv_ram_kv_factor`` knob (0: no such cap). The grant is what
    is wanted, at most ``kv_factor`` x the model's KV cache (``fp.kv_bytes``, every slot's
    context: a cache that size already holds a full context's state for every slot, and
    the disk tier keeps more), shrunk to the room the model leaves, in whole MiB (the
    engine's unit); under ``MIN_PROMPT_CACHE`` it is 0 (no cache). It is budgeted beside the
    model's footprint, never inside it: the engine keeps the cache under the grant, and a
    measurement of the model remembers its own bytes only. Engines without a context get 0.
    """
    if fp.kv_bytes_per_token == 0:
        return 0
    if kv_factor > 0:
        wanted = min(wanted, int(kv_factor * fp.kv_bytes))
    grant = min(wanted, room - fp.total) // MiB * MiB
    return grant if grant >= MIN_PROMPT_CACHE else 0


def context_cap(spec: ModelSpec, ceiling: int | None) -> int:
    """The largest context allowed: the trained context, capped by ``ceiling``."""
    trained = spec.gguf.trained_ctx if spec.gguf is not None else 0
    if spec.mlx is not None:
        trained = spec.mlx.trained_ctx
    caps = [c for c in (trained, ceiling) if c]
    return min(caps) if caps else 0


def max_context(
    spec: ModelSpec,
    budget_bytes: int,
    slots: int = 1,
    kv_type: str = "f16",
    ceiling: int | None = None,
    measured: Measurements | None = None,
) -> int:
    """Largest n_ctx (a multiple of 256) whose footprint fits ``budget_bytes``; 0 if none.

    Never above the trained context nor ``ceiling``. A model trained on fewer than 256
    tokens may get its whole trained context. Non-LLMs have no context: 0.
    """
    if spec.gguf is None and spec.mlx is None:
        return 0
    cap = context_cap(spec, ceiling)
    if cap <= 0:
        return 0

    def fits(n: int) -> bool:
        return footprint(spec, n, slots, kv_type, measured).total <= budget_bytes

    if cap < CTX_STEP:
        return cap if fits(cap) else 0
    # Footprints only grow with n_ctx (KV, masks, a measurement rescaled by them), though
    # not linearly (sliding windows stop growing): bisect over multiples of CTX_STEP.
    lo, hi = 0, cap // CTX_STEP
    while lo < hi:
        mid = (lo + hi + 1) // 2
        if fits(mid * CTX_STEP):
            lo = mid
        else:
            hi = mid - 1
    return lo * CTX_STEP


def auto_context(
    spec: ModelSpec,
    budget_bytes: int,
    settings_max_ctx: int,
    min_ctx: int,
    slots: int = 1,
    kv_type: str = "f16",
    measured: Measurements | None = None,
) -> int:
    """The context to load an LLM with when the user did not set one; 0 = refuse.

    The largest multiple of 256 ≤ min(trained ctx, settings_max_ctx) that fits the budget;
    below ``min_ctx`` (or the trained context, if smaller) it is 0.
    """
    n = max_context(spec, budget_bytes, slots, kv_type, settings_max_ctx, measured)
    floor = min(min_ctx, context_cap(spec, settings_max_ctx)) or min_ctx
    return n if n >= floor and n > 0 else 0
