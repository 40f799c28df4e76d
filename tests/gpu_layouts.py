"""Layouts of the synthetic models measured on the device (benchmarks/gpu_synth.py shapes)."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from gpu_synth import SHAPES

from elbowroom.models.gguf_meta import tensor_bytes_by_layer
from elbowroom.scheduler.offload import Layout

FIX = Path(__file__).parent / "fixtures" / "gpu"
VOCAB = 49152  # SmolLM2's tokenizer, which the synthetic models carry


def synth_tensors(shape: dict[str, Any]) -> list[tuple[str, int]]:
    """(name, bytes) of the tensors gpu_synth.py writes (f16 matrices, f32 vectors)."""
    L, E, H, KV, FF = (shape[k] for k in ("layers", "embd", "heads", "kv_heads", "ffn"))
    kv = KV * (E // H)
    out = [("token_embd.weight", VOCAB * E * 2), ("output_norm.weight", E * 4)]
    if not shape["tied"]:
        out.append(("output.weight", VOCAB * E * 2))
    for i in range(L):
        b = f"blk.{i}."
        out += [(b + "attn_norm.weight", E * 4), (b + "ffn_norm.weight", E * 4)]
        out += [(b + "attn_q.weight", E * E * 2), (b + "attn_output.weight", E * E * 2)]
        out += [(b + "attn_k.weight", kv * E * 2), (b + "attn_v.weight", kv * E * 2)]
        out += [
            (b + n, FF * E * 2) for n in ("ffn_gate.weight", "ffn_up.weight", "ffn_down.weight")
        ]
        if shape["arch"] == "qwen2":
            out += [
                (b + "attn_q.bias", E * 4),
                (b + "attn_k.bias", kv * 4),
                (b + "attn_v.bias", kv * 4),
            ]
    return out


def synth_layout(shape: dict[str, Any]) -> Layout:
    blocks, inp, outp = tensor_bytes_by_layer(synth_tensors(shape), shape["layers"])
    assert blocks is not None
    hd = shape["embd"] // shape["heads"]
    return Layout(
        n_layers=shape["layers"],
        block_bytes=blocks,
        input_bytes=inp,
        output_bytes=outp,
        kv_elements=(shape["kv_heads"] * 2 * hd,) * shape["layers"],
        n_vocab=VOCAB,
        n_embd=shape["embd"],
        n_ff=shape["ffn"],
    )


def shape_of(name: str) -> dict[str, Any]:
    """A synthetic model's shape by name ("llama1b", "qwen05b", "qwen3b", "llama8b")."""
    arch, layers, embd, heads, kv, ffn, tied = SHAPES[name.removesuffix(".gguf")]
    keys = ("arch", "layers", "embd", "heads", "kv_heads", "ffn", "tied")
    return dict(zip(keys, (arch, layers, embd, heads, kv, ffn, tied), strict=True))


def shape(name: str) -> Layout:
    return synth_layout(shape_of(name))


def recorded(name: str) -> dict[str, Any]:
    data: dict[str, Any] = json.loads((FIX / name).read_text())
    return data


def calib() -> dict[str, Any]:
    return recorded("h200_calib.json")
