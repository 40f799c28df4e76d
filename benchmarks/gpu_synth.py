"""Random-weight GGUFs of real shapes (llama, qwen2) with a real tokenizer, for GPU runs.

    python benchmarks/gpu_synth.py OUT.gguf ARCH LAYERS EMBD HEADS KV FFN TOKENIZER.gguf [tied]
    python benchmarks/gpu_synth.py --quant Q4_K_M OUT.gguf ARCH LAYERS ... [tied]
    python benchmarks/gpu_synth.py --clone HEADER.gguf OUT.gguf   # a real file's structure

Random weights give real memory and speed figures (not sensible text), and a multi-GB
model is written in seconds (weights of one shape are generated once and reused), which
is how models reach a machine that downloads nothing and takes 64 MiB per call. ARCH
llama has its own output matrix; qwen2 adds q/k/v biases and, with "tied", reuses the
token embeddings as output (Qwen2.5-0.5B's layout). Grown from the shared
tools/synth_gguf.py of issue 10. Needs numpy and gguf.

``--quant`` writes Q8_0, Q4_K_M or Q5_K_M files: each tensor gets the type llama.cpp's
quantizer gives it for that mix (``quant_type``), filled with random blocks whose f16 scales
are set to small finite values (the gguf package quantizes Q8_0 but not the K-quants; for
memory and speed only the types, shapes and finite numbers matter). ``--clone`` copies a
real GGUF's header (its metadata and tensor list, e.g. ``head -c DATA_OFFSET`` of a bundled
model: 1.8 MB for SmolLM2, 6.5 MB for gemma3) and fills every tensor with random blocks of
its own type: the bundled models' exact structure on a machine they cannot be carried to.
"""

from __future__ import annotations

import sys
from typing import Any

import numpy as np

CTX = 32768

# name: (arch, layers, embd, heads, kv heads, ffn, tied) — two architectures, 0.5 to 8 B.
SHAPES: dict[str, tuple[str, int, int, int, int, int, bool]] = {
    "qwen05b": ("qwen2", 24, 896, 14, 2, 4864, True),  # Qwen2.5-0.5B-like
    "llama1b": ("llama", 16, 2048, 32, 8, 8192, False),  # Llama-3.2-1B-like
    "qwen3b": ("qwen2", 36, 2048, 16, 2, 11008, True),  # Qwen2.5-3B-like
    "llama8b": ("llama", 32, 4096, 32, 8, 14336, False),  # Llama-3-8B-like
}
TINY = {"tiny": ("llama", 2, 64, 4, 2, 128, False), "tinyq": ("qwen2", 2, 64, 4, 2, 128, True)}


def write(
    out: str,
    arch: str,
    layers: int,
    embd: int,
    heads: int,
    kv_heads: int,
    ffn: int,
    tokenizer: str,
    tied: bool = False,
) -> None:
    w, reader = _writer(out, arch, layers, embd, heads, kv_heads, ffn, tokenizer, file_type=1)
    head_dim = embd // heads
    vocab = len(reader.fields["tokenizer.ggml.tokens"].contents())
    rng = np.random.default_rng(0)
    cache: dict[tuple[int, ...], Any] = {}

    def mat(*shape: int) -> Any:
        if shape not in cache:
            cache[shape] = (rng.standard_normal(shape, dtype=np.float32) * 0.02).astype(np.float16)
        return cache[shape]

    def ones(n: int) -> Any:
        return np.ones(n, dtype=np.float32)

    kv = kv_heads * head_dim
    w.add_tensor("token_embd.weight", mat(vocab, embd))
    w.add_tensor("output_norm.weight", ones(embd))
    if not tied:
        w.add_tensor("output.weight", mat(vocab, embd))
    for i in range(layers):
        b = f"blk.{i}."
        w.add_tensor(b + "attn_norm.weight", ones(embd))
        w.add_tensor(b + "attn_q.weight", mat(embd, embd))
        w.add_tensor(b + "attn_k.weight", mat(kv, embd))
        w.add_tensor(b + "attn_v.weight", mat(kv, embd))
        w.add_tensor(b + "attn_output.weight", mat(embd, embd))
        if arch == "qwen2":
            w.add_tensor(b + "attn_q.bias", np.zeros(embd, dtype=np.float32))
            w.add_tensor(b + "attn_k.bias", np.zeros(kv, dtype=np.float32))
            w.add_tensor(b + "attn_v.bias", np.zeros(kv, dtype=np.float32))
        w.add_tensor(b + "ffn_norm.weight", ones(embd))
        w.add_tensor(b + "ffn_gate.weight", mat(ffn, embd))
        w.add_tensor(b + "ffn_up.weight", mat(ffn, embd))
        w.add_tensor(b + "ffn_down.weight", mat(embd, ffn))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()


# Offsets of the f16 scale fields inside one block, by type (ggml-common.h's block layouts).
F16_FIELDS: dict[str, tuple[int, ...]] = {
    "Q4_0": (0,),
    "Q4_1": (0, 2),
    "Q5_0": (0,),
    "Q5_1": (0, 2),
    "Q8_0": (0,),
    "Q2_K": (80, 82),
    "Q3_K": (108,),
    "Q4_K": (0, 2),
    "Q5_K": (0, 2),
    "Q6_K": (208,),
}
MIXES = ("Q8_0", "Q4_K_M", "Q5_K_M")


def _more_bits(i: int, n: int) -> bool:
    """llama.cpp's use_more_bits: the first and last eighth of the layers and every third."""
    return i < n // 8 or i >= 7 * n // 8 or (i - n // 8) % 3 == 2


def quant_type(mix: str, name: str, layer: int, n_layers: int, tied: bool) -> str:
    """The type llama.cpp's quantizer gives ``name`` in ``mix`` (llama_tensor_get_type, for
    the tensors these shapes have): Q6_K for the output (the embeddings when tied), for
    attn_v and ffn_down in the layers use_more_bits picks; the mix's base type elsewhere."""
    if name.endswith("norm.weight") or name.endswith(".bias"):
        return "F32"
    if mix == "Q8_0":
        return "Q8_0"
    base = {"Q4_K_M": "Q4_K", "Q5_K_M": "Q5_K"}[mix]
    if name == "output.weight" or (tied and name == "token_embd.weight"):
        return "Q6_K"
    if name.endswith(("attn_v.weight", "ffn_down.weight")) and _more_bits(layer, n_layers):
        return "Q6_K"
    return base


class Blocks:
    """Random blocks of a ggml type with finite f16 scales; rows of one shape made once."""

    def __init__(self, seed: int = 0) -> None:
        self.rng = np.random.default_rng(seed)
        self.cache: dict[tuple[str, int, int], Any] = {}

    def rows(self, kind: str, rows: int, cols: int) -> Any:
        """A (rows, bytes per row) uint8 array of ``kind`` blocks for a rows × cols matrix."""
        import gguf

        key = (kind, rows, cols)
        if key in self.cache:
            return self.cache[key]
        qtype = gguf.GGMLQuantizationType[kind]
        block, size = gguf.GGML_QUANT_SIZES[qtype]
        assert cols % block == 0, f"{kind} needs rows of whole {block}-value blocks, not {cols}"
        nblocks = cols // block
        one = self.rng.integers(0, 256, size=(min(rows, 64), nblocks, size), dtype=np.uint8)
        scale = np.frombuffer(np.float16(0.002).tobytes(), dtype=np.uint8)
        for off in F16_FIELDS[kind]:
            one[:, :, off : off + 2] = scale
        data = np.resize(one.reshape(-1, nblocks * size), (rows, nblocks * size))
        self.cache[key] = data
        return data


def write_quant(
    out: str,
    mix: str,
    arch: str,
    layers: int,
    embd: int,
    heads: int,
    kv_heads: int,
    ffn: int,
    tokenizer: str,
    tied: bool = False,
) -> None:
    """``write``'s model in a llama.cpp quantization mix (Q8_0, Q4_K_M, Q5_K_M)."""
    import gguf

    file_type = {"Q8_0": 7, "Q4_K_M": 15, "Q5_K_M": 17}[mix]
    w, reader = _writer(out, arch, layers, embd, heads, kv_heads, ffn, tokenizer, file_type)
    head_dim = embd // heads
    vocab = len(reader.fields["tokenizer.ggml.tokens"].contents())
    blocks = Blocks()
    kv = kv_heads * head_dim

    def add(name: str, rows: int, cols: int, layer: int = 0) -> None:
        kind = quant_type(mix, name, layer, layers, tied)
        if kind == "F32":
            value = 1.0 if name.endswith("norm.weight") else 0.0
            w.add_tensor(name, np.full(rows * cols, value, dtype=np.float32))
            return
        raw = gguf.GGMLQuantizationType[kind]
        w.add_tensor(name, blocks.rows(kind, rows, cols), raw_dtype=raw)

    add("token_embd.weight", vocab, embd)
    add("output_norm.weight", 1, embd)
    if not tied:
        add("output.weight", vocab, embd)
    for i in range(layers):
        b = f"blk.{i}."
        add(b + "attn_norm.weight", 1, embd, i)
        add(b + "attn_q.weight", embd, embd, i)
        add(b + "attn_k.weight", kv, embd, i)
        add(b + "attn_v.weight", kv, embd, i)
        add(b + "attn_output.weight", embd, embd, i)
        if arch == "qwen2":
            add(b + "attn_q.bias", 1, embd, i)
            add(b + "attn_k.bias", 1, kv, i)
            add(b + "attn_v.bias", 1, kv, i)
        add(b + "ffn_norm.weight", 1, embd, i)
        add(b + "ffn_gate.weight", ffn, embd, i)
        add(b + "ffn_up.weight", ffn, embd, i)
        add(b + "ffn_down.weight", embd, ffn, i)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()


def _writer(
    out: str,
    arch: str,
    layers: int,
    embd: int,
    heads: int,
    kv_heads: int,
    ffn: int,
    tokenizer: str,
    file_type: int,
) -> tuple[Any, Any]:
    """A GGUF writer with the shape's header and the tokenizer file's vocabulary, and the
    tokenizer's reader: what ``write`` and ``write_quant`` share before their tensors."""
    from gguf import GGUFReader, GGUFWriter

    head_dim = embd // heads
    reader = GGUFReader(tokenizer)
    w = GGUFWriter(out, arch)
    w.add_context_length(CTX)
    w.add_embedding_length(embd)
    w.add_block_count(layers)
    w.add_feed_forward_length(ffn)
    w.add_head_count(heads)
    w.add_head_count_kv(kv_heads)
    w.add_rope_dimension_count(head_dim)
    w.add_layer_norm_rms_eps(1e-6)
    w.add_rope_freq_base(1000000.0)
    w.add_file_type(file_type)
    _copy_tokenizer(reader, w)
    return w, reader


def _copy_tokenizer(reader: Any, w: Any) -> None:
    import gguf

    for key, field in reader.fields.items():
        if not key.startswith("tokenizer."):
            continue
        value, kind = field.contents(), field.types[0]
        if kind == gguf.GGUFValueType.ARRAY:
            w.add_array(key, value)
        elif kind == gguf.GGUFValueType.STRING:
            w.add_string(key, value)
        elif kind == gguf.GGUFValueType.BOOL:
            w.add_bool(key, value)
        else:
            w.add_uint32(key, int(value))


def clone(header: str, out: str) -> None:
    """A GGUF with ``header``'s metadata and tensors (types, shapes, offsets), each tensor
    filled with random blocks of its type (F32/F16 tensors with small values). ``header``
    is the real file's first DATA_OFFSET bytes (the tensor data itself is not needed)."""
    import os

    import gguf

    with open(header, "rb") as fh:
        raw = fh.read()
    # GGUFReader needs the data region: read the header through a sparse copy of the size
    # the tensor list implies (no disk is used for the hole).
    sparse = out + ".header"
    with open(sparse, "wb") as fh:
        fh.write(raw)
        fh.truncate(len(raw) + 2**40)
    reader = gguf.GGUFReader(sparse, "r")
    end = max(int(t.data_offset) + int(t.n_bytes) for t in reader.tensors)
    blocks = Blocks()
    rng = np.random.default_rng(1)
    with open(out, "wb") as fh:
        fh.write(raw[: reader.data_offset])
        fh.truncate(end)
        for t in reader.tensors:
            kind = t.tensor_type.name
            n = int(t.n_bytes)
            fh.seek(int(t.data_offset))
            if kind in ("F32", "F16", "BF16"):
                dtype = {"F32": np.float32, "F16": np.float16, "BF16": np.uint16}[kind]
                count = n // np.dtype(dtype).itemsize
                values = np.full(count, 1.0 if kind != "BF16" else 0x3F80, dtype=dtype)
                if "norm" not in t.name and kind != "BF16":
                    values = (rng.standard_normal(count) * 0.02).astype(dtype)
                fh.write(values.tobytes())
                continue
            cols = int(t.shape[0])
            rows = int(np.prod([int(x) for x in t.shape[1:]])) if len(t.shape) > 1 else 1
            data = blocks.rows(kind, rows, cols)
            assert data.nbytes == n, (t.name, kind, data.nbytes, n)
            fh.write(data.tobytes())
    os.unlink(sparse)


def main(argv: list[str]) -> None:
    if argv[0] == "--clone":
        clone(argv[1], argv[2])
        print("wrote", argv[2])
        return
    if argv[0] == "--quant":
        mix, rest = argv[1], argv[2:]
        lay, emb, hd, kvh, ff = map(int, rest[2:7])
        tied = len(rest) > 8 and rest[8] == "tied"
        write_quant(rest[0], mix, rest[1], lay, emb, hd, kvh, ff, rest[7], tied)
        print("wrote", rest[0])
        return
    out, arch = argv[0], argv[1]
    layers, embd, heads, kv_heads, ffn = map(int, argv[2:7])
    write(
        out, arch, layers, embd, heads, kv_heads, ffn, argv[7], len(argv) > 8 and argv[8] == "tied"
    )
    print("wrote", out)


if __name__ == "__main__":
    main(sys.argv[1:])
