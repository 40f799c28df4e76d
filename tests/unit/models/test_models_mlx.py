"""MLX model folders: recognised by the catalog, read from their headers, sized by the
estimate. Pure: the safetensors files are written by hand (no mlx needed)."""

from __future__ import annotations

import json
import math
import struct
from dataclasses import replace
from pathlib import Path
from typing import Any

import pytest

from elbowroom.config import Settings
from elbowroom.models.catalog import discover
from elbowroom.models.estimate import footprint, max_context
from elbowroom.models.mlx_meta import (
    MLX_RUNTIME_ANON,
    MLX_RUNTIME_FILE,
    compute_bytes,
    read_mlx_info,
    safetensors_bytes,
)

SIZES = {"F32": 4, "F16": 2, "BF16": 2, "U32": 4}


def write_safetensors(path: Path, tensors: dict[str, tuple[str, list[int]]]) -> int:
    """A valid safetensors file with zeroed data; returns its tensor bytes."""
    header: dict[str, Any] = {"__metadata__": {"format": "mlx"}}
    offset = 0
    for name, (dtype, shape) in tensors.items():
        n = math.prod(shape) * SIZES[dtype]
        header[name] = {"dtype": dtype, "shape": shape, "data_offsets": [offset, offset + n]}
        offset += n
    raw = json.dumps(header).encode()
    path.write_bytes(struct.pack("<Q", len(raw)) + raw + bytes(offset))
    return offset


def mlx_folder(root: Path, *, quantized: bool = True, layers: int = 2) -> tuple[Path, int]:
    folder = root / "tiny-4bit"
    folder.mkdir(parents=True)
    hidden, vocab = 64, 1000
    config: dict[str, Any] = {
        "model_type": "llama",
        "hidden_size": hidden,
        "num_hidden_layers": layers,
        "intermediate_size": 128,
        "num_attention_heads": 4,
        "num_key_value_heads": 2,
        "vocab_size": vocab,
        "max_position_embeddings": 4096,
        "torch_dtype": "float16",
    }
    tensors: dict[str, tuple[str, list[int]]] = {}
    if quantized:
        config["quantization"] = {"group_size": 64, "bits": 4}
        tensors["model.embed_tokens.weight"] = ("U32", [vocab, hidden // 8])
        tensors["model.embed_tokens.scales"] = ("F16", [vocab, 1])
        tensors["model.embed_tokens.biases"] = ("F16", [vocab, 1])
    else:
        tensors["model.embed_tokens.weight"] = ("F16", [vocab, hidden])
    tensors["model.norm.weight"] = ("F16", [hidden])
    (folder / "config.json").write_text(json.dumps(config))
    (folder / "tokenizer.json").write_text("{}")
    half = sum(math.prod(s) * SIZES[d] for d, s in tensors.values() if d == "F16")
    total = write_safetensors(folder / "model.safetensors", tensors)
    assert half <= total
    return folder, total


def test_weight_bytes_come_from_the_headers_exactly(tmp_path: Path) -> None:
    folder, total = mlx_folder(tmp_path)
    nbytes, by_dtype = safetensors_bytes(folder / "model.safetensors")
    assert nbytes == total
    assert by_dtype["U32"] == 1000 * 8 * 4  # the packed 4-bit weights
    info = read_mlx_info(folder)
    assert info.tensor_bytes == total and info.bits == 4 and info.group_size == 64
    assert info.half_bytes == total - by_dtype["U32"]
    assert (info.n_layers, info.n_kv_heads, info.head_dim, info.trained_ctx) == (2, 2, 16, 4096)
    assert info.act_bytes == 2 and info.quantization == "4-bit"


def test_catalog_lists_an_mlx_folder_as_an_llm(tmp_path: Path) -> None:
    folder, total = mlx_folder(tmp_path / "models")
    catalog = discover(Settings(data_dir=tmp_path / "data", models_dir=tmp_path / "models"))
    spec = catalog.get("tiny-4bit")
    assert spec.engine == "mlx" and spec.kind == "llm" and spec.mlx is not None
    assert spec.size_bytes == total and spec.path == folder
    assert "MLX llama, 4-bit" in spec.description
    # Replacing a weight file changes the identity (the KV disk tier's key).
    before = spec.identity
    write_safetensors(folder / "model.safetensors", {"x": ("F32", [7])})
    assert spec.identity != before


def test_a_broken_folder_is_a_problem_not_a_crash(tmp_path: Path) -> None:
    folder, _ = mlx_folder(tmp_path / "models")
    (folder / "model.safetensors").write_bytes(struct.pack("<Q", 1 << 40) + b"{}")
    catalog = discover(Settings(data_dir=tmp_path / "data", models_dir=tmp_path / "models"))
    assert "tiny-4bit" not in catalog
    assert any("not a safetensors file" in p.reason for p in catalog.problems)


@pytest.mark.parametrize("cpu", [True, False])
def test_footprint_terms(tmp_path: Path, cpu: bool) -> None:
    from elbowroom.models.mlx_meta import mlx_footprint

    folder, total = mlx_folder(tmp_path)
    info = read_mlx_info(folder)
    fp = mlx_footprint(info, 1000, cpu=cpu)
    act = 4 if cpu else 2
    kv = 1024 * 2 * 2 * 2 * 16 * act  # cells padded to 256 x layers x K,V x heads x dim
    weights = total + (info.half_bytes if cpu else 0)
    assert fp.kv_bytes == kv and fp.kv_bytes_per_token == kv // 1024
    assert fp.compute == compute_bytes(replace(info, act_bytes=act), 1000) > 0
    assert fp.anonymous == weights + kv + MLX_RUNTIME_ANON + fp.compute
    assert fp.file_backed == MLX_RUNTIME_FILE and fp.working == fp.compute
    assert fp.at_load == fp.total - fp.compute


def test_the_context_is_sized_like_a_gguf_models(tmp_path: Path) -> None:
    mlx_folder(tmp_path / "models")
    spec = discover(Settings(data_dir=tmp_path / "data", models_dir=tmp_path / "models")).get(
        "tiny-4bit"
    )
    big = footprint(spec, 4096)
    assert max_context(spec, big.total) == 4096  # capped by the trained context
    small = footprint(spec, 512)
    assert max_context(spec, small.total) in (512, 768)  # KV cells come in 256s
    assert footprint(spec, 2048).total > small.total
