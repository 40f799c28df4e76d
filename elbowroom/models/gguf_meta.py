"""Read what the footprint estimate needs from a GGUF file's header (no weights are read).

The ``gguf`` package's GGUFReader parses every array element into its own numpy view; a
262,144-token vocabulary (gemma3) then takes ~20 s. ``_HeaderReader`` keeps GGUFReader's
parsing but reads scalar arrays in one slice and skips over string arrays (the vocabulary,
merges) by their length prefixes, recording only their element count: ~0.1 s for any file.
"""

from __future__ import annotations

import struct
from pathlib import Path
from typing import Any

import numpy as np
import numpy.typing as npt
from gguf import GGUFReader
from gguf.constants import GGUFValueType, LlamaFileType

from elbowroom.errors import BadRequest
from elbowroom.models.spec import GGUFInfo

_GGUF_MAGIC = b"GGUF"


class InvalidModel(BadRequest):
    """A model file that cannot be used: not GGUF, truncated, or missing required keys."""

    def __init__(self, message: str, **kw: Any) -> None:
        kw.setdefault("code", "invalid_model")
        super().__init__(message, **kw)


class _HeaderReader(GGUFReader):
    """GGUFReader that does not materialise big arrays (see the module docstring)."""

    def __init__(self, path: Path) -> None:
        self.array_lengths: dict[int, int] = {}  # field offset -> element count
        super().__init__(path, "r")

    def _get_field_parts(
        self, orig_offs: int, raw_type: int
    ) -> tuple[int, list[npt.NDArray[Any]], list[int], list[GGUFValueType]]:
        if GGUFValueType(raw_type) != GGUFValueType.ARRAY:
            return super()._get_field_parts(orig_offs, raw_type)
        raw_itype = self._get(orig_offs, np.uint32)
        alen = self._get(orig_offs + 4, np.uint64)
        count = int(alen[0])
        itype = GGUFValueType(int(raw_itype[0]))
        offs = orig_offs + 12
        nptype = self.gguf_scalar_to_np.get(itype)
        if nptype is not None:
            values = self._get(offs, nptype, count)
            size = 12 + int(values.nbytes)
            return size, [raw_itype, alen, values], [2], [GGUFValueType.ARRAY, itype]
        if itype == GGUFValueType.STRING:
            offs = self._skip_strings(offs, count)
            return offs - orig_offs, [raw_itype, alen], [], [GGUFValueType.ARRAY, itype]
        # Nested arrays never appear in metadata we use; the stock parser handles them.
        return super()._get_field_parts(orig_offs, raw_type)

    def _skip_strings(self, offs: int, count: int) -> int:
        buf = self.data.data  # a memoryview: struct reads need no numpy views
        order = ">" if self.byte_order == "S" else "<"
        fmt = struct.Struct(order + "Q")
        for _ in range(count):
            (length,) = fmt.unpack_from(buf, offs)
            offs += 8 + int(length)
        if offs > len(self.data):
            raise ValueError("string array runs past the end of the file")
        return offs


def _field(reader: GGUFReader, key: str) -> Any:
    field = reader.get_field(key)
    if field is None:
        return None
    if field.types and field.types[0] == GGUFValueType.ARRAY:
        if field.types[-1] == GGUFValueType.STRING:
            return None  # skipped: only the element count is kept
        return [int(v) if isinstance(v, (int, np.integer)) else v for v in field.contents()]
    return field.contents()


def _int(reader: GGUFReader, key: str) -> int | None:
    value = _field(reader, key)
    if value is None:
        return None
    if isinstance(value, list):
        return max((int(v) for v in value), default=0)
    return int(value)


def _per_layer(reader: GGUFReader, key: str, n_layers: int) -> tuple[int, ...] | None:
    """A per-layer count that GGUF stores either as one scalar or as an array (OpenELM)."""
    value = _field(reader, key)
    if value is None:
        return None
    if isinstance(value, list):
        values = tuple(int(v) for v in value)
        if len(values) != n_layers:
            raise ValueError(f"{key} has {len(values)} entries for {n_layers} layers")
        return values
    return (int(value),) * n_layers


def _file_type(value: int | None) -> str | None:
    if value is None:
        return None
    try:
        return LlamaFileType(value).name.removeprefix("MOSTLY_").replace("ALL_", "")
    except ValueError:
        return f"type-{value}"


def _find_mmproj(path: Path) -> Path | None:
    """A multimodal projector beside the model: llama.cpp's convention is mmproj-*.gguf."""
    try:
        siblings = sorted(path.parent.iterdir())
    except OSError:
        return None
    for sibling in siblings:
        name = sibling.name.lower()
        if sibling != path and name.startswith("mmproj") and name.endswith(".gguf"):
            return sibling
    return None


def is_mmproj(path: Path) -> bool:
    return path.name.lower().startswith("mmproj") and path.suffix.lower() == ".gguf"


def looks_like_gguf(path: Path) -> bool:
    """Cheap magic-number check (4 bytes), for discovery."""
    try:
        with path.open("rb") as fh:
            return fh.read(4) == _GGUF_MAGIC
    except OSError:
        return False


def read_gguf_info(path: Path) -> GGUFInfo:
    """Architecture and attention shape of a GGUF model; raise InvalidModel when unreadable."""
    path = Path(path)
    if not looks_like_gguf(path):
        raise InvalidModel(f"{path} is not a GGUF file (no GGUF magic number)")
    try:
        reader = _HeaderReader(path)
        return _info(reader, path)
    except InvalidModel:
        raise
    except (ValueError, OSError, KeyError, IndexError, OverflowError, struct.error) as exc:
        raise InvalidModel(f"{path} is not a readable GGUF file: {exc}") from exc


def _info(reader: _HeaderReader, path: Path) -> GGUFInfo:
    arch = _field(reader, "general.architecture")
    if not isinstance(arch, str) or not arch:
        raise InvalidModel(f"{path} has no general.architecture: not a model GGUF")
    n_layers = _int(reader, f"{arch}.block_count")
    n_embd = _int(reader, f"{arch}.embedding_length")
    if not n_layers or not n_embd:
        raise InvalidModel(f"{path} lacks {arch}.block_count/embedding_length: not a model GGUF")
    heads = _per_layer(reader, f"{arch}.attention.head_count", n_layers) or (0,) * n_layers
    kv_heads = _per_layer(reader, f"{arch}.attention.head_count_kv", n_layers) or heads
    n_heads = max(heads)
    # llama.cpp's defaults when the file does not say: head dim = n_embd / n_head.
    default_dim = n_embd // n_heads if n_heads else 0
    head_dim_k = _int(reader, f"{arch}.attention.key_length") or default_dim
    head_dim_v = _int(reader, f"{arch}.attention.value_length") or default_dim
    uniform = len(set(kv_heads)) == 1
    tokens = reader.get_field("tokenizer.ggml.tokens")
    n_vocab = _int(reader, f"{arch}.vocab_size") or (
        int(tokens.parts[4][0]) if tokens is not None and len(tokens.parts) > 4 else None
    )
    templates = [k for k in reader.fields if k.startswith("tokenizer.chat_template")]
    name = _field(reader, "general.name")
    pattern = _field(reader, f"{arch}.attention.sliding_window_pattern")
    return GGUFInfo(
        architecture=arch,
        name=name if isinstance(name, str) else path.stem,
        n_layers=n_layers,
        n_heads=n_heads,
        n_kv_heads=max(kv_heads),
        head_dim_k=head_dim_k,
        head_dim_v=head_dim_v,
        n_embd=n_embd,
        trained_ctx=_int(reader, f"{arch}.context_length") or 0,
        file_type=_file_type(_int(reader, "general.file_type")),
        has_chat_template=bool(templates),
        sliding_window=_int(reader, f"{arch}.attention.sliding_window") or None,
        mmproj=_find_mmproj(path),
        n_params=sum(int(t.n_elements) for t in reader.tensors) or None,
        kv_heads_per_layer=None if uniform else kv_heads,
        n_vocab=n_vocab,
        n_ff=_int(reader, f"{arch}.feed_forward_length"),
        n_expert=_int(reader, f"{arch}.expert_count") or 0,
        n_expert_used=_int(reader, f"{arch}.expert_used_count") or 0,
        n_ff_expert=_int(reader, f"{arch}.expert_feed_forward_length"),
        n_ff_shared=_int(reader, f"{arch}.expert_shared_feed_forward_length"),
        swa_pattern=int(pattern) if isinstance(pattern, (int, np.integer)) else None,
        tensor_bytes=sum(int(t.n_bytes) for t in reader.tensors) or None,
        matmul_bytes=_matmul_bytes(reader),
    )


# Weights read by GET_ROWS (embedding lookups), not multiplied: never repacked.
_LOOKUP_TENSORS = ("token_embd.", "per_layer_token_embd.", "position_embd.", "token_types.")


def _matmul_bytes(reader: GGUFReader) -> tuple[tuple[str, int], ...]:
    by_type: dict[str, int] = {}
    # Tied embeddings (no output.weight): the output projection multiplies token_embd, and
    # llama.cpp repacks a copy of it for that (qwen2-style models at q4_0: +23.6 MiB).
    tied = not any(t.name == "output.weight" for t in reader.tensors)
    for t in reader.tensors:
        shape = [int(d) for d in t.shape]
        lookup = t.name.startswith(_LOOKUP_TENSORS) and not (tied and t.name == "token_embd.weight")
        if len(shape) < 2 or shape[1] % 8 or lookup:
            continue
        name = t.tensor_type.name
        by_type[name] = by_type.get(name, 0) + int(t.n_bytes)
    return tuple(sorted(by_type.items()))
