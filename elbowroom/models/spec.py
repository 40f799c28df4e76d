"""What a model is (ModelSpec) and what loading it costs (Footprint)."""

from __future__ import annotations

import enum
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path


# An MLX model folder's facts, read by models/mlx_meta.py from its config and safetensors
# headers: here beside the spec that holds them, so that the reader imports the spec and
# not the other way round.
@dataclass(frozen=True, slots=True)
class MLXInfo:
    model_type: str
    n_layers: int
    n_heads: int
    n_kv_heads: int
    head_dim: int
    hidden: int
    ffn: int
    vocab: int
    trained_ctx: int
    tensor_bytes: int  # every tensor of every safetensors file, as the headers say
    half_bytes: int  # ... of them in float16 / bfloat16
    act_bytes: int  # bytes per activation / KV element (the model's float dtype)
    bits: int | None  # quantization bits (None: not quantized)
    group_size: int | None
    files: tuple[str, ...]  # the safetensors files (names, in the folder)
    has_chat_template: bool
    sliding_window: int | None = None

    @property
    def quantization(self) -> str:
        return f"{self.bits}-bit" if self.bits else _dtype_name(self.act_bytes)

    def kv_bytes_per_token(self) -> int:
        return self.n_layers * 2 * self.n_kv_heads * self.head_dim * self.act_bytes


def _dtype_name(nbytes: int) -> str:
    return {4: "float32", 2: "float16"}.get(nbytes, f"{nbytes}-byte")


class ModelKind(enum.StrEnum):
    LLM = "llm"
    ASR = "asr"  # speech to text
    TTS = "tts"  # text to speech
    EMBEDDING = "embedding"


class Holding(enum.StrEnum):
    """How an engine holds its weights: decides the loading policy.

    MMAP: file-backed pages the OS can drop (GGUF via llama.cpp): cheap to keep loaded.
    RESIDENT: anonymous memory (whisper, piper, onnx): load lazily, unload when idle.
    """

    MMAP = "mmap"
    RESIDENT = "resident"


@dataclass(frozen=True, slots=True)
class GGUFInfo:
    architecture: str
    name: str
    n_layers: int
    n_heads: int
    n_kv_heads: int
    head_dim_k: int
    head_dim_v: int
    n_embd: int
    trained_ctx: int
    file_type: str | None
    has_chat_template: bool
    sliding_window: int | None = None
    mmproj: Path | None = None  # multimodal projector beside the model, if any
    n_params: int | None = None
    # KV heads per layer when they differ between layers (OpenELM; 0 = no KV in that layer,
    # e.g. recurrent layers); None when every layer has n_kv_heads.
    kv_heads_per_layer: tuple[int, ...] | None = None
    n_vocab: int | None = None
    # Bytes of the vocabulary's longest token as the file spells it (>= the characters of
    # text any one token covers): a cheap lower bound on a prompt's tokens (server.limits).
    max_token_bytes: int | None = None
    tokenizer_model: str | None = None  # tokenizer.ggml.model: "llama" (SPM), "gpt2" (BPE)...
    # Tensor bytes by where llama.cpp puts them (GPU offload placement): each repeating
    # block ``blk.N.*``; the input layer (token embeddings: always on the CPU); the output
    # layer (output norm + output matrix, or a copy of the token embeddings when the output
    # is tied to them). None when the file lists no tensors.
    layer_bytes: tuple[int, ...] | None = None
    input_bytes: int = 0
    output_bytes: int = 0
    n_ff: int | None = None  # feed-forward width (the compute buffer grows with it)
    # What the footprint estimate's compute-buffer, repacking and file terms need.
    n_expert: int = 0  # mixture of experts: experts per layer (0: a dense model)
    n_expert_used: int = 0  # ... and how many each token uses
    n_ff_expert: int | None = None  # one expert's feed-forward width
    n_ff_shared: int | None = None  # the shared expert's, where there is one
    swa_pattern: int | None = None  # {arch}.attention.sliding_window_pattern, when present
    tensor_bytes: int | None = None  # bytes of tensor data: what llama.cpp maps
    # Bytes of the weights that feed matrix multiplications (not token embeddings that are
    # only looked up, norms, biases), by ggml type name, counting only tensors whose row
    # count is a multiple of 8: the ones llama.cpp's CPU backend may copy into a repacked
    # (anonymous) buffer. A tied token_embd counts: it is the output projection's weight.
    matmul_bytes: tuple[tuple[str, int], ...] = ()


@dataclass(frozen=True, slots=True)
class Projector:
    """A multimodal projector (``mmproj`` GGUF) that gives an LLM vision: a ViT encoder and
    the map from its features into the text model's embeddings (models/vision.py)."""

    path: Path
    projector_type: str  # clip.projector_type: gemma3, idefics3, mlp (llava), ...
    image_size: int  # pixels per side the encoder sees (one tile)
    patch_size: int
    n_embd: int  # the encoder's width
    n_ff: int
    n_layer: int
    n_head: int
    merge: int  # patches merged per side into one image token (1: none)
    weight_bytes: int  # tensor bytes: clip.cpp reads them into anonymous memory
    image_tokens: int  # tokens one image becomes (a one-tile estimate for tiling types)

    @property
    def n_patches(self) -> int:
        return (self.image_size // max(1, self.patch_size)) ** 2


@dataclass(frozen=True, slots=True)
class ModelSpec:
    id: str  # stable, URL-safe: [a-z0-9][a-z0-9._-]*
    kind: ModelKind
    engine: str  # "llama" | "mlx" | "whisper" | "piper" | "onnx-embed" | "pocketsphinx"
    path: Path  # the file or folder the engine opens
    size_bytes: int  # weights on disk
    holding: Holding
    source: str  # "bundled" | "models_dir" | "path"
    gguf: GGUFInfo | None = None
    description: str = ""
    # Engine-specific extra files or values (e.g. "tokenizer": path, "config": path).
    options: Mapping[str, str] = field(default_factory=dict)
    projector: Projector | None = None  # vision: the mmproj paired with this LLM
    mlx: MLXInfo | None = None  # an MLX model folder (engine "mlx", models/mlx_meta.py)

    @property
    def vision(self) -> bool:
        return self.projector is not None

    @property
    def identity(self) -> str:
        """Identity of the weights on disk: changes when the file is replaced."""
        st = self.path.stat()
        identity = f"{self.path.resolve()}:{st.st_size}:{int(st.st_mtime)}"
        if self.mlx is not None:  # a folder: its weight files are what can be replaced
            for name in self.mlx.files:
                fst = (self.path / name).stat()
                identity += f"+{name}:{fst.st_size}:{int(fst.st_mtime)}"
        if self.projector is not None:  # a vision model holds more than its text model
            pst = self.projector.path.stat()
            identity += f"+{self.projector.path.resolve()}:{pst.st_size}:{int(pst.st_mtime)}"
        return identity


@dataclass(frozen=True, slots=True)
class Footprint:
    """Predicted (or measured) bytes a loaded model holds.

    ``file_backed`` is the mmap'd weights (reclaimable, but needed resident for speed);
    ``anonymous`` is KV cache + compute buffers + runtime (+ weights for resident engines).
    """

    weights: int
    file_backed: int
    anonymous: int
    kv_bytes_per_token: int = 0
    kv_bytes: int = 0
    overhead: int = 0
    n_ctx: int = 0
    slots: int = 1
    kv_type: str = "f16"
    measured: bool = False
    compute: int = 0  # llama.cpp's compute buffer (part of anonymous)
    repacked: int = 0  # weights copied into CPU-repacked buffers (part of anonymous)
    # The part of anonymous that appears only once the model serves (compute-buffer pages
    # touched by a full batch, per-slot sampling state, context checkpoints): a measurement
    # right after load does not see it yet.
    working: int = 0

    @property
    def total(self) -> int:
        return self.anonymous + self.file_backed

    @property
    def at_load(self) -> int:
        """What the process holds right after load, before serving (total − working)."""
        return self.total - self.working
