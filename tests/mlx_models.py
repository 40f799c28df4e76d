"""MLX model folders for tests and benchmarks, built at test time (none is on PyPI).

- ``smollm2_mlx(dest)``: the bundled SmolLM2-135M-Instruct GGUF (Q4_1) as an MLX folder, so
  tests get real text. ``mx.load`` reads GGUF Q4_1 tensors as MLX affine-quantized arrays
  (4 bits, groups of 32, a scale and a bias each: exactly Q4_1's layout), so the weights are
  the GGUF's own, bit for bit. GGUF stores the Q/K rows permuted for llama.cpp's rotary
  embedding, which is MLX's "traditional" RoPE: ``rope_traditional`` in config.json.
  The tokenizer (byte-level BPE) is rebuilt with ``tokenizers`` from the GGUF's vocabulary,
  merges and chat template (``transformers`` reads a GGUF tokenizer only with torch).
- ``random_mlx(dest, ...)``: a random-weight llama of any shape, made with mlx-lm's own model
  class, saved in fp16/bf16 or quantized with ``mlx.nn.quantize`` (what ``mlx_lm.convert -q``
  does), with SmolLM2's tokenizer: the held-out shapes of the footprint checks.

Needs ``mlx`` and ``mlx-lm`` (the ``mlx`` extra); callers skip without them.
"""

from __future__ import annotations

import functools
import json
import tempfile
from pathlib import Path
from typing import Any

SMOLLM2_GGUF_ID = "smollm2-135m"

_NAMES = {
    "attn_q": "self_attn.q_proj",
    "attn_k": "self_attn.k_proj",
    "attn_v": "self_attn.v_proj",
    "attn_output": "self_attn.o_proj",
    "ffn_gate": "mlp.gate_proj",
    "ffn_up": "mlp.up_proj",
    "ffn_down": "mlp.down_proj",
    "attn_norm": "input_layernorm",
    "ffn_norm": "post_attention_layernorm",
}


def _gguf_path() -> Path:
    from bundled_models import bundled_spec

    return bundled_spec(SMOLLM2_GGUF_ID).path


def _hf_name(name: str) -> str:
    if name.startswith("token_embd."):
        return "model.embed_tokens." + name.split(".", 1)[1]
    if name.startswith("output_norm."):
        return "model.norm." + name.split(".", 1)[1]
    if name.startswith("output."):
        return "lm_head." + name.split(".", 1)[1]
    _, layer, part, leaf = name.split(".", 3)
    return f"model.layers.{layer}.{_NAMES[part]}.{leaf}"


def write_tokenizer(dest: Path, gguf: Path | None = None) -> None:
    """tokenizer.json + tokenizer_config.json from the GGUF's byte-level BPE vocabulary
    (built once per process, then copied)."""
    dest.mkdir(parents=True, exist_ok=True)
    for name, data in _tokenizer_files(str(gguf or _gguf_path())).items():
        (dest / name).write_bytes(data)


@functools.cache
def _tokenizer_files(gguf: str) -> dict[str, bytes]:
    with tempfile.TemporaryDirectory() as tmp:
        _build_tokenizer(Path(tmp), Path(gguf))
        return {p.name: p.read_bytes() for p in Path(tmp).iterdir()}


def _build_tokenizer(dest: Path, gguf: Path) -> None:
    from gguf import GGUFReader
    from tokenizers import AddedToken, Tokenizer, decoders, models, pre_tokenizers

    reader = GGUFReader(str(gguf))

    def field(key: str) -> Any:
        return reader.fields[key].contents()

    tokens: list[str] = field("tokenizer.ggml.tokens")
    merges: list[str] = field("tokenizer.ggml.merges")
    types: list[int] = field("tokenizer.ggml.token_type")
    template: str = field("tokenizer.chat_template")
    eos = tokens[int(field("tokenizer.ggml.eos_token_id"))]
    bos = tokens[int(field("tokenizer.ggml.bos_token_id"))]
    vocab = {t: i for i, t in enumerate(tokens)}
    pairs = [tuple(m.split(" ", 1)) for m in merges]
    tok = Tokenizer(models.BPE(vocab, pairs, fuse_unk=False, byte_fallback=False))  # type: ignore[arg-type]
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
    tok.decoder = decoders.ByteLevel()
    special = [tokens[i] for i, kind in enumerate(types) if kind == 3]  # CONTROL
    tok.add_special_tokens([AddedToken(t, special=True, normalized=False) for t in special])
    dest.mkdir(parents=True, exist_ok=True)
    tok.save(str(dest / "tokenizer.json"))
    config = {
        "tokenizer_class": "PreTrainedTokenizerFast",
        "bos_token": bos,
        "eos_token": eos,
        "unk_token": eos,
        "pad_token": eos,
        "chat_template": template,
        "model_max_length": 8192,
        "clean_up_tokenization_spaces": False,
    }
    (dest / "tokenizer_config.json").write_text(json.dumps(config, indent=1))


def have_mlx() -> str | None:
    """None when mlx and mlx-lm import, else why not (a skip reason)."""
    import importlib.util

    for name in ("mlx", "mlx_lm"):
        if importlib.util.find_spec(name) is None:
            return f"{name} is not installed (pip install 'elbowroom[mlx]')"
    return None


def smollm2_mlx(dest: Path) -> Path:
    """The bundled SmolLM2 GGUF as an MLX model folder at ``dest`` (built once per folder)."""
    import mlx.core as mx

    if (dest / "model.safetensors").is_file():
        return dest
    gguf = _gguf_path()
    weights, meta = mx.load(str(gguf), return_metadata=True)

    def num(key: str) -> Any:
        value = meta[key]
        return value.item() if hasattr(value, "item") else value

    out: dict[str, Any] = {}
    for name, array in weights.items():
        # Norms are f32 in the GGUF: f16 like the rest, or every activation becomes f32.
        out[_hf_name(name)] = array.astype(mx.float16) if array.dtype == mx.float32 else array
    n_embd = int(num("llama.embedding_length"))
    n_head = int(num("llama.attention.head_count"))
    config = {
        "model_type": "llama",
        "hidden_size": n_embd,
        "num_hidden_layers": int(num("llama.block_count")),
        "intermediate_size": int(num("llama.feed_forward_length")),
        "num_attention_heads": n_head,
        "num_key_value_heads": int(num("llama.attention.head_count_kv")),
        "head_dim": n_embd // n_head,
        "rms_norm_eps": float(num("llama.attention.layer_norm_rms_epsilon")),
        "vocab_size": int(num("llama.vocab_size")),
        "rope_theta": float(num("llama.rope.freq_base")),
        "rope_traditional": True,  # GGUF's permuted Q/K rows
        "tie_word_embeddings": "lm_head.weight" not in out,
        "max_position_embeddings": int(num("llama.context_length")),
        "quantization": {"group_size": 32, "bits": 4, "mode": "affine"},
        "torch_dtype": "float16",
    }
    dest.mkdir(parents=True, exist_ok=True)
    mx.save_safetensors(str(dest / "model.safetensors"), out, metadata={"format": "mlx"})
    (dest / "config.json").write_text(json.dumps(config, indent=1))
    write_tokenizer(dest, gguf)
    return dest


def random_mlx(
    dest: Path,
    *,
    layers: int = 2,
    hidden: int = 64,
    heads: int = 4,
    kv_heads: int = 2,
    ffn: int = 128,
    vocab: int = 49152,
    dtype: str = "float16",
    bits: int | None = None,
    group_size: int = 64,
    max_positions: int = 2048,
    seed: int = 0,
) -> Path:
    """A random-weight llama of this shape in MLX format (quantized when ``bits``)."""
    import mlx.core as mx
    import mlx.nn as nn
    from mlx.utils import tree_flatten
    from mlx_lm.models import llama

    mx.random.seed(seed)
    config: dict[str, Any] = {
        "model_type": "llama",
        "hidden_size": hidden,
        "num_hidden_layers": layers,
        "intermediate_size": ffn,
        "num_attention_heads": heads,
        "num_key_value_heads": kv_heads,
        "head_dim": hidden // heads,
        "rms_norm_eps": 1e-5,
        "vocab_size": vocab,
        "rope_theta": 10000.0,
        "tie_word_embeddings": True,
        "max_position_embeddings": max_positions,
        "torch_dtype": dtype,
    }
    model = llama.Model(llama.ModelArgs.from_dict(config))
    model.set_dtype(getattr(mx, dtype))
    if bits is not None:
        nn.quantize(model, group_size=group_size, bits=bits)
        config["quantization"] = {"group_size": group_size, "bits": bits, "mode": "affine"}
    weights = dict(tree_flatten(model.parameters()))
    mx.eval(weights)
    dest.mkdir(parents=True, exist_ok=True)
    mx.save_safetensors(str(dest / "model.safetensors"), weights, metadata={"format": "mlx"})
    (dest / "config.json").write_text(json.dumps(config, indent=1))
    write_tokenizer(dest)
    return dest
