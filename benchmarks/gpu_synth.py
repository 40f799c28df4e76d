"""Random-weight GGUFs of real shapes (llama, qwen2) with a real tokenizer, for GPU runs.

    python benchmarks/gpu_synth.py OUT.gguf ARCH LAYERS EMBD HEADS KV FFN TOKENIZER.gguf [tied]

Random weights give real memory and speed figures (not sensible text), and a multi-GB
model is written in seconds (weights of one shape are generated once and reused), which
is how models reach a machine that downloads nothing and takes 64 MiB per call. ARCH
llama has its own output matrix; qwen2 adds q/k/v biases and, with "tied", reuses the
token embeddings as output (Qwen2.5-0.5B's layout). Grown from the shared
tools/synth_gguf.py of issue 10. Needs numpy and gguf.
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
    import gguf
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
    w.add_file_type(1)
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


def main(argv: list[str]) -> None:
    out, arch = argv[0], argv[1]
    layers, embd, heads, kv_heads, ffn = map(int, argv[2:7])
    write(
        out, arch, layers, embd, heads, kv_heads, ffn, argv[7], len(argv) > 8 and argv[8] == "tied"
    )
    print("wrote", out)


if __name__ == "__main__":
    main(sys.argv[1:])
