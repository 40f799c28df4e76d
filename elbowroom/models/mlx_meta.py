"""MLX model folders (mlx-community layout): recognise them, read their shape, and predict
what the ``mlx`` engine (engines/mlx.py) will hold. PURE apart from reading the folder.

A folder is an MLX model when it holds ``config.json`` (a ``model_type``), one or more
``*.safetensors`` and a tokenizer (``tokenizer.json`` or ``tokenizer_config.json``).

Footprint (docs/mlx.md), all anonymous memory (MLX copies the weights into its own
buffers; on macOS that is the unified pool):
    weights  = the tensor bytes of every safetensors file, read from their headers (quantized
               weights, their scales and biases: exactly what MLX allocates)
    KV       = slots x n_layers x 2 x n_kv_heads x head_dim x pad256(n_ctx) x act bytes
               (the engine allocates each slot's cache for its whole context at load)
    compute  = the prefill chunk's activations (MLX_PREFILL_CHUNK tokens) + its attention
               scores over the context + one row of logits (the part serving adds)
    runtime  = the interpreter with mlx, mlx-lm, transformers' tokenizer imported (measured)
The buffer cache is capped at the compute size, so freed buffers MLX keeps for reuse stay
inside the prediction.
"""

from __future__ import annotations

import json
import math
import struct
import sys
from dataclasses import replace
from pathlib import Path
from typing import Any

from elbowroom.models.spec import Footprint, MLXInfo
from elbowroom.units import MiB

# Bytes per element of the safetensors dtypes (MLX writes these).
DTYPE_BYTES = {
    "F64": 8,
    "F32": 4,
    "F16": 2,
    "BF16": 2,
    "I64": 8,
    "I32": 4,
    "U32": 4,
    "I16": 2,
    "U16": 2,
    "I8": 1,
    "U8": 1,
    "BOOL": 1,
}
MAX_HEADER = 100 * MiB  # a safetensors header larger than this is not one

# Tokens per prefill chunk (mlx-lm's generate_step ``prefill_step_size``; ours is smaller:
# it bounds the compute buffer and how long a cancel waits during a long prefill).
MLX_PREFILL_CHUNK = 256
KV_STEP = 256  # mlx-lm's KVCache grows in steps of this many tokens

# Measured on this machine (x86_64, Linux, mlx[cpu] 0.32.4, mlx-lm 0.32.2, Python 3.11) with
# ``benchmarks/mlx_footprint.py --calibrate`` (a 2-layer, 64-wide model, not one of the
# held-out shapes): a loaded runner less its weights and KV is 107.6 MiB anonymous (the
# interpreter, mlx, mlx-lm, transformers and the tokenizer's tables) and 38.7 MiB of mapped
# libraries, 43.8 MiB once a request has run.
MLX_RUNTIME_ANON = 108 * MiB
MLX_RUNTIME_FILE = 44 * MiB
# Compute: bytes per (chunk token x width) of the block's live activations (float32 on the
# CPU) and per (head x chunk token x context cell) of attention scores; read from
# ``mx.get_peak_memory`` less weights and KV on the calibration model (a full-context prompt).
COMPUTE_PER_WIDTH = 8
SCORE_BYTES = 4


class InvalidMLX(ValueError):
    pass


def is_mlx_dir(path: Path) -> bool:
    cfg = path / "config.json"
    if not cfg.is_file():
        return False
    if not ((path / "tokenizer.json").is_file() or (path / "tokenizer_config.json").is_file()):
        return False
    if not any(path.glob("*.safetensors")):
        return False
    try:
        data = json.loads(cfg.read_text())
    except (OSError, ValueError):
        return True  # looks like one: read_mlx_info reports why it cannot be read
    return isinstance(data, dict) and "model_type" in data


def safetensors_bytes(path: Path) -> tuple[int, dict[str, int]]:
    """Tensor data bytes of one safetensors file from its header, and bytes by dtype."""
    with path.open("rb") as f:
        raw = f.read(8)
        if len(raw) != 8:
            raise InvalidMLX(f"{path.name}: too short for a safetensors file")
        (n,) = struct.unpack("<Q", raw)
        if n <= 0 or n > MAX_HEADER:
            raise InvalidMLX(f"{path.name}: not a safetensors file (header of {n} bytes)")
        try:
            header = json.loads(f.read(n))
        except ValueError as exc:
            raise InvalidMLX(f"{path.name}: unreadable safetensors header: {exc}") from exc
    total = 0
    by_dtype: dict[str, int] = {}
    for name, t in header.items():
        if name == "__metadata__":
            continue
        if not isinstance(t, dict) or "dtype" not in t or "shape" not in t:
            raise InvalidMLX(f"{path.name}: tensor {name!r} has no dtype/shape")
        size = DTYPE_BYTES.get(str(t["dtype"]))
        if size is None:
            raise InvalidMLX(f"{path.name}: tensor {name!r} has unknown dtype {t['dtype']}")
        nbytes = math.prod(int(d) for d in t["shape"]) * size
        total += nbytes
        by_dtype[str(t["dtype"])] = by_dtype.get(str(t["dtype"]), 0) + nbytes
    return total, by_dtype


def read_mlx_info(path: Path) -> MLXInfo:
    """The shape and weight bytes of the MLX model folder ``path``."""
    try:
        cfg: dict[str, Any] = json.loads((path / "config.json").read_text())
    except ValueError as exc:
        raise InvalidMLX(f"config.json is not JSON: {exc}") from exc
    text = cfg.get("text_config")
    if isinstance(text, dict):  # multimodal configs keep the language model's shape here
        cfg = {**text, **{k: v for k, v in cfg.items() if k not in text}}

    def need(*keys: str) -> int:
        for key in keys:
            if isinstance(cfg.get(key), int) and cfg[key] > 0:
                return int(cfg[key])
        raise InvalidMLX(f"config.json has no {keys[0]}")

    hidden = need("hidden_size", "n_embd", "d_model")
    heads = need("num_attention_heads", "n_head")
    kv_heads = int(cfg.get("num_key_value_heads") or heads)
    head_dim = int(cfg.get("head_dim") or hidden // heads)
    files = sorted(p.name for p in path.glob("*.safetensors"))
    tensor_bytes = 0
    floats: dict[str, int] = {}
    for name in files:
        nbytes, by_dtype = safetensors_bytes(path / name)
        tensor_bytes += nbytes
        for dtype, n in by_dtype.items():
            if dtype in ("F32", "F16", "BF16"):
                floats[dtype] = floats.get(dtype, 0) + n
    quant = cfg.get("quantization") or cfg.get("quantization_config") or {}
    bits = int(quant["bits"]) if isinstance(quant, dict) and quant.get("bits") else None
    group = int(quant.get("group_size", 64)) if bits else None
    act = _act_bytes(cfg, floats)
    template = False
    tk = path / "tokenizer_config.json"
    if tk.is_file():
        try:
            template = bool(json.loads(tk.read_text()).get("chat_template"))
        except ValueError:
            template = False
    template = template or (path / "chat_template.jinja").is_file()
    window = cfg.get("sliding_window")
    return MLXInfo(
        model_type=str(cfg.get("model_type", "?")),
        n_layers=need("num_hidden_layers", "n_layer", "num_layers"),
        n_heads=heads,
        n_kv_heads=kv_heads,
        head_dim=head_dim,
        hidden=hidden,
        ffn=int(cfg.get("intermediate_size") or 4 * hidden),
        vocab=need("vocab_size"),
        trained_ctx=int(cfg.get("max_position_embeddings") or 0),
        tensor_bytes=tensor_bytes,
        half_bytes=floats.get("F16", 0) + floats.get("BF16", 0),
        act_bytes=act,
        bits=bits,
        group_size=group,
        files=tuple(files),
        has_chat_template=template,
        sliding_window=int(window) if isinstance(window, int) and window > 0 else None,
    )


def _act_bytes(cfg: dict[str, Any], floats: dict[str, int]) -> int:
    """The model's float type: what its activations and KV cache are stored in. MLX keeps
    a quantized model's scales in it; a float model's weights are it."""
    if floats:
        dominant = max(floats, key=lambda k: floats[k])
        return 4 if dominant == "F32" else 2
    dtype = str(cfg.get("torch_dtype") or cfg.get("dtype") or "float16")
    return 4 if "32" in dtype else 2


def kv_bytes(info: MLXInfo, n_ctx: int, slots: int) -> int:
    cells = math.ceil(max(1, n_ctx) / KV_STEP) * KV_STEP
    return slots * cells * info.kv_bytes_per_token()


def compute_bytes(info: MLXInfo, n_ctx: int) -> int:
    """Peak working memory of one prefill chunk: activations, attention scores against the
    whole context, and the logits of the last position (f32)."""
    chunk = MLX_PREFILL_CHUNK
    cells = math.ceil(max(1, n_ctx) / KV_STEP) * KV_STEP
    width = 3 * info.hidden + 3 * info.ffn
    acts = chunk * width * COMPUTE_PER_WIDTH
    scores = info.n_heads * chunk * cells * SCORE_BYTES
    logits = info.vocab * 4 * 2
    return acts + scores + logits


def on_cpu() -> bool:
    """MLX computes on the CPU here (Linux, ``mlx[cpu]``); on macOS on the Metal GPU."""
    return sys.platform != "darwin"


def weight_bytes(info: MLXInfo, cpu: bool) -> int:
    """Bytes the weights take once loaded. On a CPU the engine computes in float32 (MLX's
    half-precision and quantized-with-half-scales CPU kernels measured 10-60x slower), so
    half-precision tensors (and a quantized model's scales and biases) double."""
    if not cpu or info.act_bytes == 4:
        return info.tensor_bytes
    return info.tensor_bytes + info.half_bytes


def mlx_footprint(info: MLXInfo, n_ctx: int, slots: int = 1, cpu: bool | None = None) -> Footprint:
    cpu = on_cpu() if cpu is None else cpu
    act = 4 if cpu else info.act_bytes
    scaled = replace(info, act_bytes=act)
    weights = weight_bytes(info, cpu)
    kv = kv_bytes(scaled, n_ctx, slots)
    compute = compute_bytes(scaled, n_ctx)
    overhead = MLX_RUNTIME_ANON + compute
    return Footprint(
        weights=info.tensor_bytes,
        file_backed=MLX_RUNTIME_FILE,
        anonymous=weights + kv + overhead,
        kv_bytes_per_token=scaled.kv_bytes_per_token(),
        kv_bytes=kv,
        overhead=overhead,
        n_ctx=n_ctx,
        slots=slots,
        kv_type="f32" if act == 4 else "f16",
        compute=compute,
        working=compute,
    )
