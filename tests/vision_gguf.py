"""A genuine multimodal projector (``mmproj``) GGUF with random weights, for the vision tests.

No vision-language model can be downloaded here, so the tests make one: a small ViT
(SigLIP-style, gemma3 projector: average-pool then a linear map into the text model's
embedding width) that llama.cpp's clip loader accepts as it would a real Gemma 3 projector.
Paired with the bundled SmolLM2-135M (n_embd 576), real images go through the real encoder
pass, real memory and the real request path; the text that comes out is meaningless.

Keys and tensor names follow llama.cpp's ``tools/mtmd/clip-impl.h`` (``clip.vision.*``,
``v.blk.N.*``, ``mm.input_projection.weight``, ``mm.soft_emb_norm.weight``). Shapes are
written in numpy order; GGUF (ggml) lists them reversed.

Image tokens per image = (image_size / patch_size / scale_factor) ** 2: 256 with the
defaults (448 px, patch 14, pool 2).
"""

from __future__ import annotations

import struct
import zlib
from pathlib import Path

import numpy as np

TEXT_EMBD = 576  # SmolLM2-135M's n_embd: the projector's output width must match it


def write_projector(
    path: Path,
    *,
    text_embd: int = TEXT_EMBD,
    n_embd: int = 192,
    n_ff: int = 384,
    n_head: int = 4,
    n_layer: int = 2,
    image_size: int = 448,
    patch_size: int = 14,
    scale_factor: int = 2,
    seed: int = 0,
) -> Path:
    """Write the projector to ``path`` (about 4 MB with the defaults, well under a second)."""
    import gguf

    if n_ff == n_embd:
        # clip.cpp tells up from down by their widths (it fixes old exports that swapped them).
        raise ValueError("n_ff must differ from n_embd")
    rng = np.random.default_rng(seed)
    path.parent.mkdir(parents=True, exist_ok=True)

    def rand(*shape: int, std: float = 0.02) -> np.ndarray:
        return (rng.standard_normal(shape) * std).astype(np.float32)

    def ones(n: int) -> np.ndarray:
        return np.ones(n, dtype=np.float32)

    def zeros(n: int) -> np.ndarray:
        return np.zeros(n, dtype=np.float32)

    w = gguf.GGUFWriter(str(path), "clip")
    w.add_name("elbowroom test projector (random weights)")
    w.add_description("synthetic gemma3-type mmproj for tests; not a trained model")
    w.add_file_type(0)  # all F32
    w.add_bool("clip.has_vision_encoder", True)
    w.add_string("clip.projector_type", "gemma3")
    w.add_bool("clip.use_gelu", True)
    w.add_uint32("clip.vision.image_size", image_size)
    w.add_uint32("clip.vision.patch_size", patch_size)
    w.add_uint32("clip.vision.embedding_length", n_embd)
    w.add_uint32("clip.vision.feed_forward_length", n_ff)
    w.add_uint32("clip.vision.block_count", n_layer)
    w.add_uint32("clip.vision.projection_dim", text_embd)
    w.add_uint32("clip.vision.attention.head_count", n_head)
    w.add_float32("clip.vision.attention.layer_norm_epsilon", 1e-6)
    w.add_uint32("clip.vision.projector.scale_factor", scale_factor)
    w.add_array("clip.vision.image_mean", [0.5, 0.5, 0.5])
    w.add_array("clip.vision.image_std", [0.5, 0.5, 0.5])

    n_patches = (image_size // patch_size) ** 2
    w.add_tensor("v.patch_embd.weight", rand(n_embd, 3, patch_size, patch_size))
    w.add_tensor("v.patch_embd.bias", zeros(n_embd))
    w.add_tensor("v.position_embd.weight", rand(n_patches, n_embd))
    for i in range(n_layer):
        for name in ("attn_q", "attn_k", "attn_v", "attn_out"):
            w.add_tensor(f"v.blk.{i}.{name}.weight", rand(n_embd, n_embd))
            w.add_tensor(f"v.blk.{i}.{name}.bias", zeros(n_embd))
        for name in ("ln1", "ln2"):
            w.add_tensor(f"v.blk.{i}.{name}.weight", ones(n_embd))
            w.add_tensor(f"v.blk.{i}.{name}.bias", zeros(n_embd))
        w.add_tensor(f"v.blk.{i}.ffn_up.weight", rand(n_ff, n_embd))
        w.add_tensor(f"v.blk.{i}.ffn_up.bias", zeros(n_ff))
        w.add_tensor(f"v.blk.{i}.ffn_down.weight", rand(n_embd, n_ff))
        w.add_tensor(f"v.blk.{i}.ffn_down.bias", zeros(n_embd))
    w.add_tensor("v.post_ln.weight", ones(n_embd))
    w.add_tensor("v.post_ln.bias", zeros(n_embd))
    w.add_tensor("mm.soft_emb_norm.weight", ones(n_embd))
    # ggml shape [text_embd, n_embd]: clip.cpp multiplies by its transpose.
    w.add_tensor("mm.input_projection.weight", rand(n_embd, text_embd))

    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return path


def image_tokens(image_size: int = 448, patch_size: int = 14, scale_factor: int = 2) -> int:
    return (image_size // patch_size // scale_factor) ** 2


def bomb_png(side: int = 20_000) -> bytes:
    """A genuine 1-bit PNG of side x side pixels (400 million at 20,000): ~50 KB of bytes,
    1.2 GB once an RGB decoder expands it."""

    def chunk(kind: bytes, data: bytes) -> bytes:
        body = kind + data
        return struct.pack(">I", len(data)) + body + struct.pack(">I", zlib.crc32(body))

    row = b"\x00" + b"\x00" * (side // 8)
    packer = zlib.compressobj(9)
    idat = b"".join(packer.compress(row) for _ in range(side)) + packer.flush()
    ihdr = struct.pack(">IIBBBBB", side, side, 1, 0, 0, 0, 0)
    return b"\x89PNG\r\n\x1a\n" + chunk(b"IHDR", ihdr) + chunk(b"IDAT", idat) + chunk(b"IEND", b"")


def inflating_png(inflated: int, *, side: int = 1, interlaced: bool = False) -> bytes:
    """A valid-looking side x side RGB PNG whose image data inflates to ``inflated`` bytes
    of zeros (checksums right): 1 GiB packs into ~1 MB. With ``inflated`` equal to what the
    pixels need it is an honest image."""

    def chunk(kind: bytes, data: bytes) -> bytes:
        body = kind + data
        return struct.pack(">I", len(data)) + body + struct.pack(">I", zlib.crc32(body))

    packer = zlib.compressobj(9)
    block = b"\x00" * (1 << 20)
    parts = [packer.compress(block) for _ in range(inflated >> 20)]
    parts.append(packer.compress(b"\x00" * (inflated & ((1 << 20) - 1))))
    idat = b"".join(parts) + packer.flush()
    ihdr = struct.pack(">IIBBBBB", side, side, 8, 2, 0, 0, int(interlaced))
    return b"\x89PNG\r\n\x1a\n" + chunk(b"IHDR", ihdr) + chunk(b"IDAT", idat) + chunk(b"IEND", b"")
