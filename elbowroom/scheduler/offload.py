"""PURE: what a GGUF model holds on each GPU and in host RAM for a given layer split (CUDA).

llama.cpp counts ``n_layers + 1`` offloadable units: the repeating blocks and the output
layer. ``n_gpu_layers = k`` puts the output layer and the last ``k - 1`` blocks on the GPUs
(the input layer, the token embeddings, always stays on the CPU); with several GPUs the
units are cut into consecutive runs, the first run on the first device. Each block's KV
cache lives with the block. Per GPU in use:

    gpu bytes = weights of its units + KV of its blocks × context tokens
                + CUDA_DEVICE_BASE + activations + mask (+ OUTPUT_DEVICE_EXTRA on the
                output layer's device) + CUBLAS_VRAM, or MMQ_POOL for a model whose
                matrices llama.cpp multiplies with its own kernels (``needs_cublas``)
                (+ one FFN matrix when blocks stay on the CPU: op offload copies it over)
                (+ SPLIT_FIRST_EXTRA on the first GPU of a split over several)
    activations = 16 × ubatch × (n_ff + n_embd)     mask = 2 × ubatch × n_ctx per slot
    KV of a sliding-window block: its window's cells per slot, as on the CPU

Fitted on an H200 (CUDA 13.0, xllamacpp 2026.10.11549 built for sm_90, flash attention on,
n_batch = n_ubatch = 512) with NVML's device memory before and after a load plus one short
generation, over two architectures (llama 1.1 B and qwen2 0.5 B), contexts 2,048 and 8,192
per slot and 1 or 8 slots: the residual after weights and KV was linear in the context per
slot (not in slots: each slot attends only to its own cells) with the terms above, within
0.5 MB. Checked through elbowroom's server on two more models (qwen2 3 B, llama 8 B): all
16 loads within 0.3 %. ``benchmarks/results/gpu.md`` has the numbers.

Host bytes with a CUDA build: the weights left on the CPU are file-backed (mmap), the CUDA
libraries add ``CUDA_RUNTIME_FILE``, and the runtime's host allocations
``CUDA_HOST_ANON`` come on top of the CPU estimate's overhead, with what each served slot
holds, and cuBLAS's host bytes where it is loaded (issue 27c, an H100: all 140 host and VRAM
predictions of f16 and quantized models within -2.8 ... +7.6 %).
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass

from elbowroom.models.estimate import (
    CTX_CHECKPOINTS,
    DEFAULT_VOCAB,
    KV_PAD,
    LLAMA_FIXED_ANON,
    LLAMA_PER_VOCAB,
    LLAMA_RUNTIME_ANON,
    LLAMA_RUNTIME_FILE,
    LOGIT_BYTES,
    SLOT_PER_VOCAB,
    SWA_DEFAULT_WINDOW,
    check_kv_type,
    swa_layers,
)
from elbowroom.models.spec import GGUFInfo
from elbowroom.units import MiB

# The engine's micro-batch (engines.llama.N_BATCH; a test keeps them equal).
UBATCH = 512
# Per GPU in use: the CUDA context, llama.cpp's buffers and pools, CUDA graphs (591 MiB
# fitted on the H200 with f16 models, after one generation), less the cuBLAS step below.
CUDA_DEVICE_BASE = 487 * MiB
# cuBLAS, on a runner whose matrix multiplications need it: llama.cpp multiplies f16 / bf16
# / f32 weights (and types without its own kernels) by a batch of tokens with cuBLAS, and
# creates the handle at the first batched prompt. Quantized weights use its MMQ kernels
# and never load it (issue 27c, H100: an f16 runner's VRAM stepped by 104 MiB, its host
# memory by 115-135 MiB anonymous and 14 MiB of cuBLASLt's pages at its first ~1,000-token
# prompt; no quantized runner's did. cublasCreate alone took 68 MiB of VRAM, the first
# GEMM 51 MiB anonymous: the step is cuBLAS). A prefix restored from the disk tier skips
# the batches and the step until the next new prompt: the prediction keeps the step.
CUBLAS_VRAM = 104 * MiB
# Quantized runners instead grow llama.cpp's memory pool with the first batched prompts
# (MMQ's and flash attention's temporaries, op offload's copies): +14-49 MiB over the
# quantized models measured wholly or partly offloaded (issue 27c), budgeted at the most.
MMQ_POOL = 56 * MiB
# The weight types llama.cpp's CUDA backend multiplies with its own MMQ kernels (mmq.cu,
# ggml_cuda_should_use_mmq on Turing and newer); any other matrix type on a GPU means cuBLAS.
MMQ_TYPES = frozenset(
    {
        "Q4_0", "Q4_1", "Q5_0", "Q5_1", "Q8_0", "MXFP4", "Q2_K", "Q3_K", "Q4_K", "Q5_K",
        "Q6_K", "IQ2_XXS", "IQ2_XS", "IQ2_S", "IQ3_XXS", "IQ3_S", "IQ1_S", "IQ4_XS", "IQ4_NL",
    }
)  # fmt: skip
# Head sizes llama.cpp's CUDA flash attention runs; with another, "auto" turns it off and
# the attention's KQ product goes through cuBLAS.
FLASH_ATTN_HEAD_DIMS = frozenset({64, 80, 96, 112, 128, 256})
# On the output layer's GPU: 96 MiB more on the H200 machine, where the fit took it for a
# logits buffer of 4 × ubatch × n_vocab (every model there had 49,152 tokens). On an H100
# (issue 27) a 262,144-token vocabulary (gemma3) added no more than a 49,152-token one
# did (the 4 × ubatch × n_vocab term over-predicted it by 416 MiB, +60 %), so it is flat.
OUTPUT_DEVICE_EXTRA = 96 * MiB
ACTIVATION_BYTES = 16  # × ubatch × (n_ff + n_embd)
MASK_BYTES = 2  # f16 KQ mask: × ubatch × context per slot
# Host side of a CUDA runner: the CUDA libraries' mapped pages and their host allocations
# (the driver's state, pinned staging buffers), without cuBLAS's. Fitted on the quantized
# runners of issue 27c (H100; qwen2 0.5 B q8_0, llama 1 B q4_K_M, SmolLM2, gemma3; wholly
# and partly offloaded, 4,096 x 4, measured after a ~1,000-token prompt and every slot
# served): anonymous 73-83 MiB and file-backed 32-50 MiB under the H200's earlier
# 240 / 216 MiB, which had been fitted on f16 runners, cuBLAS included.
CUDA_RUNTIME_FILE = 186 * MiB
CUDA_HOST_ANON = 168 * MiB
# cuBLAS's host side once it has run (see CUBLAS_VRAM): its kernels' images and state
# (f16 runners of the same run: 102-133 MiB anonymous over CUDA_HOST_ANON's runners), and
# the cuBLASLt pages its first GEMMs touch (61 -> 73-75 MiB resident).
CUBLAS_HOST_ANON = 136 * MiB
CUBLAS_HOST_FILE = 14 * MiB
# Compute buffers per GPU of a split. llama.cpp can keep up to 4 copies for pipeline
# parallelism; splits measured on two H200s showed one (benchmarks/results/gpu.md).
PIPELINE_COPIES = 1
# The first GPU of a split held 148-195 MB more than its layers and buffers in the three
# splits measured on two H200s (llama 1.1 B, qwen2 3 B, llama 8 B); fitted, not explained.
SPLIT_FIRST_EXTRA = 160 * MiB


@dataclass(frozen=True, slots=True)
class Layout:
    """The per-unit sizes offload needs, from a GGUF's metadata and tensor list."""

    n_layers: int
    block_bytes: tuple[int, ...]
    input_bytes: int
    output_bytes: int
    kv_elements: tuple[int, ...]  # KV elements per context token, per block
    n_vocab: int
    n_embd: int
    n_ff: int
    # The output layer's own mapped bytes (0 when it is a copy of the tied embeddings,
    # whose pages are the input layer's): a partial offload leaves them resident.
    output_file: int = 0
    # Sliding-window blocks (gemma3: 5 of every 6) keep only ``window_cells`` per slot.
    swa: tuple[bool, ...] = ()
    window: int = 0
    # Whether the runner loads cuBLAS (``needs_cublas``); assumed when not known.
    cublas: bool = True

    def cells(self, block: int, n_ctx: int) -> int:
        """KV cells per slot of ``block`` at ``n_ctx`` per slot (as the CPU estimate)."""
        full = -(-n_ctx // KV_PAD) * KV_PAD if n_ctx > 0 else 0
        if self.swa and self.swa[block] and self.window:
            return min(full, -(-(self.window + UBATCH) // KV_PAD) * KV_PAD)
        return full

    @classmethod
    def from_info(cls, info: GGUFInfo) -> Layout:
        if info.layer_bytes is None:
            raise ValueError(f"{info.name}: the GGUF lists no tensors; cannot place layers")
        heads = info.kv_heads_per_layer or (info.n_kv_heads,) * info.n_layers
        per_block = tuple(h * (info.head_dim_k + info.head_dim_v) for h in heads)
        return cls(
            n_layers=info.n_layers,
            block_bytes=info.layer_bytes,
            input_bytes=info.input_bytes,
            output_bytes=info.output_bytes,
            kv_elements=per_block,
            n_vocab=info.n_vocab or DEFAULT_VOCAB,
            n_embd=info.n_embd,
            # llama.cpp's FFN is ~4x the embedding when the file does not say (GPT-2 shape).
            n_ff=info.n_ff or 4 * info.n_embd,
            output_file=_own_output(info),
            swa=swa_layers(info),
            window=info.sliding_window or SWA_DEFAULT_WINDOW.get(info.architecture) or 0,
            cublas=needs_cublas(info),
        )

    @property
    def units(self) -> int:
        """Offloadable units: the blocks and the output layer."""
        return self.n_layers + 1


def needs_cublas(info: GGUFInfo) -> bool:
    """Whether llama.cpp's CUDA backend multiplies some of this model's matrices with cuBLAS:
    a matrix type it has no MMQ kernel for (f16, bf16, f32, ...), or a head size its flash
    attention does not run. Unknown types (no tensor list) count as needing it."""
    kinds = {kind for kind, _ in info.matmul_bytes}
    if not kinds or not kinds <= MMQ_TYPES:
        return True
    return not {info.head_dim_k, info.head_dim_v} <= FLASH_ATTN_HEAD_DIMS


def _own_output(info: GGUFInfo) -> int:
    """The output layer's bytes that are its own in the file: all of them, less the copy of
    the token embeddings that a tied model's output layer is loaded as."""
    counted = sum(info.layer_bytes or ()) + info.input_bytes + info.output_bytes
    copy = max(0, counted - (info.tensor_bytes or counted))
    return max(0, info.output_bytes - copy)


@dataclass(frozen=True, slots=True)
class OffloadBytes:
    """Predicted bytes per device for one split; ``gpu[i]`` belongs to the i-th device."""

    gpu: tuple[int, ...]
    host_anonymous: int
    host_file: int
    gpu_weights: int  # weights + KV on the GPUs (the offloaded share of the model)
    cpu_weights: int  # weights + KV left on the CPU

    @property
    def host(self) -> int:
        return self.host_anonymous + self.host_file

    @property
    def gpu_share(self) -> float:
        """The share of weights + KV on the GPUs (what "65% GPU" means)."""
        whole = self.gpu_weights + self.cpu_weights
        return self.gpu_weights / whole if whole else 0.0


def unit_devices(n_layers: int, counts: Sequence[int]) -> list[int | None]:
    """The device index of every unit (blocks 0..n-1, then the output layer); None = CPU.

    ``counts[i]`` units go to device i, in order, ending at the output layer: llama.cpp's
    split points are the cumulative counts, and the GPU units are the last ``sum(counts)``.
    """
    total = sum(counts)
    if any(c < 0 for c in counts) or total > n_layers + 1:
        raise ValueError(f"bad split {list(counts)} for {n_layers + 1} units")
    start = n_layers + 1 - total
    out: list[int | None] = [None] * start
    for device, count in enumerate(counts):
        out.extend([device] * count)
    return out


def kv_bytes_per_token_per_block(layout: Layout, kv_type: str) -> list[int]:
    per_element = check_kv_type(kv_type)
    return [math.ceil(e * per_element) for e in layout.kv_elements]


def split_bytes(
    layout: Layout, n_ctx: int, slots: int, kv_type: str, counts: Sequence[int]
) -> OffloadBytes:
    """Bytes per device with ``counts[i]`` units on device i (``n_ctx`` is per slot)."""
    where = unit_devices(layout.n_layers, counts)
    kv_per_block = kv_bytes_per_token_per_block(layout, kv_type)
    n_dev = len(counts)
    gpu = [0] * n_dev
    cpu_weights = layout.input_bytes
    cpu_kv = 0
    for block in range(layout.n_layers):
        dev = where[block]
        kv = kv_per_block[block] * slots * layout.cells(block, n_ctx)
        if dev is None:
            cpu_weights += layout.block_bytes[block]
            cpu_kv += kv
        else:
            gpu[dev] += layout.block_bytes[block] + kv
    out_dev = where[layout.n_layers]
    if out_dev is None:
        cpu_weights += layout.output_bytes
    else:
        gpu[out_dev] += layout.output_bytes
    offloaded = sum(gpu)
    used = [i for i, c in enumerate(counts) if c > 0]
    pipeline = len(used) > 1 and sum(counts) == layout.units
    copies = PIPELINE_COPIES if pipeline else 1
    for i in used:
        compute = ACTIVATION_BYTES * UBATCH * (layout.n_ff + layout.n_embd)
        compute += MASK_BYTES * UBATCH * n_ctx
        if i == out_dev:
            compute += OUTPUT_DEVICE_EXTRA
        gpu[i] += CUDA_DEVICE_BASE + compute * copies
        gpu[i] += CUBLAS_VRAM if layout.cublas else MMQ_POOL
    if len(used) > 1:
        gpu[used[0]] += SPLIT_FIRST_EXTRA
    if used and out_dev is not None and where[0] is None:
        # Blocks on the CPU: a prompt batch's matmuls are run on the GPU with the weight
        # copied over, one matrix at a time (op offload): about a quarter of a block.
        gpu[used[0]] += max(layout.block_bytes) // 4
    on_gpu = bool(used)
    vocab = layout.n_vocab
    # the CPU estimate's runtime (interpreter, runner, xllamacpp) and engine state
    fixed = LLAMA_RUNTIME_ANON + LLAMA_FIXED_ANON
    anonymous = fixed + LLAMA_PER_VOCAB * vocab + slots * vocab * LOGIT_BYTES + cpu_kv
    # what each slot holds on the host once it has served (estimate.slot_bytes): the
    # sampler's arrays and, for a sliding-window model, its context checkpoint
    window_state = sum(
        kv_per_block[b] * min(-(-n_ctx // KV_PAD) * KV_PAD, layout.window)
        for b in range(layout.n_layers)
        if layout.swa and layout.swa[b]
    )
    anonymous += slots * (SLOT_PER_VOCAB * vocab + CTX_CHECKPOINTS * window_state)
    file_backed = cpu_weights + LLAMA_RUNTIME_FILE
    if on_gpu and where[0] is None and out_dev is not None:
        # Blocks on the CPU, the output layer on the GPU: its mapped pages were read for the
        # upload and stay resident (H100, issue 27: +79/+102/+192 MiB for Q6_K/Q8_0/F16
        # output matrices; none with the whole model on the GPU, none for a tied output).
        file_backed += layout.output_file
    if on_gpu:
        anonymous += CUDA_HOST_ANON
        file_backed += CUDA_RUNTIME_FILE
        if layout.cublas:
            anonymous += CUBLAS_HOST_ANON
            file_backed += CUBLAS_HOST_FILE
    return OffloadBytes(
        gpu=tuple(gpu),
        host_anonymous=anonymous,
        host_file=file_backed,
        gpu_weights=offloaded,
        cpu_weights=cpu_weights + cpu_kv,
    )
