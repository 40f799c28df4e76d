"""Read what the footprint estimate needs from a GGUF file's header (no weights are read).

A models folder is input from outside: a file there must not be able to stop discovery,
and with it ``serve`` and ``ls``. The ``gguf`` package's GGUFReader recursed into nested
arrays (2,000 levels: RecursionError), built a numpy view per array element (10⁷
elements: 260 MB, 4 s) and took any number as given (a negative ``head_count_kv`` made a
negative footprint). This reader walks the header once, iteratively, over an mmap:

- counts are bounded before they are looped over (``MAX_KV``, ``MAX_TENSORS``,
  ``MAX_STRING_ARRAY``); arrays of numbers are skipped by arithmetic, never iterated;
- arrays of arrays are refused (llama.cpp refuses them too), strings are kept only when
  short (``MAX_KEPT_STRING``), every length is checked against the file's size;
- every number the footprint uses is checked against a plausible range (``RANGES``).

Anything else is an ``InvalidModel`` naming the file and the reason; discovery lists it
as a problem (``elbowroom ls``, ``GET /api/elbowroom/models``). Reading the header of a
262,144-token vocabulary takes ~0.1 s: the string array is skipped by its length
prefixes, and its longest entry is kept (``max_token_bytes``, for the cheap context bound
in the server).
"""

from __future__ import annotations

import mmap
import struct
from collections.abc import Iterable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from gguf.constants import GGML_QUANT_SIZES, GGMLQuantizationType, LlamaFileType

from elbowroom.errors import BadRequest
from elbowroom.models.projector_names import projector_beside
from elbowroom.models.spec import GGUFInfo

_GGUF_MAGIC = b"GGUF"

MAX_KV = 1 << 16  # metadata entries
MAX_TENSORS = 1 << 16  # tensors of one file (large MoE models have a few thousand)
MAX_KEY = 1 << 16  # bytes of one metadata key or tensor name
MAX_STRING_ARRAY = 1 << 21  # strings in one array (vocabularies: up to ~262,144 tokens)
MAX_KEPT_STRING = 1 << 16  # longer strings (chat templates) are skipped, not decoded
MAX_KEPT_ARRAY = 1 << 16  # longer numeric arrays are skipped (only their count is kept)
MAX_DIMS = 4  # GGML_MAX_DIMS
MAX_ELEMENTS = 1 << 50  # elements of one tensor

# Plausible ranges of the numbers the footprint is computed from (inclusive).
RANGES: dict[str, tuple[int, int]] = {
    "block_count": (1, 4096),
    "embedding_length": (1, 1 << 20),
    "attention.head_count": (0, 1 << 16),
    "attention.head_count_kv": (0, 1 << 16),
    "attention.key_length": (0, 1 << 16),
    "attention.value_length": (0, 1 << 16),
    "context_length": (0, 1 << 26),
    "attention.sliding_window": (0, 1 << 26),
    "vocab_size": (0, 1 << 24),
    "feed_forward_length": (0, 1 << 24),
    "expert_count": (0, 1 << 16),
}

_STRING, _ARRAY = 8, 9
_SCALARS: dict[int, tuple[str, int]] = {
    0: ("B", 1),
    1: ("b", 1),
    2: ("H", 2),
    3: ("h", 2),
    4: ("I", 4),
    5: ("i", 4),
    6: ("f", 4),
    7: ("?", 1),
    10: ("Q", 8),
    11: ("q", 8),
    12: ("d", 8),
}
_INTEGERS = frozenset({0, 1, 2, 3, 4, 5, 10, 11})


class InvalidModel(BadRequest):
    """A model file that cannot be used: not GGUF, truncated, or missing required keys."""

    def __init__(self, message: str, **kw: Any) -> None:
        kw.setdefault("code", "invalid_model")
        super().__init__(message, **kw)


class _Bad(ValueError):
    """A structural problem; read_gguf_info adds the file's name."""


class HeaderShort(_Bad):
    """The bytes end inside the header: a truncated file, or a header read in part (a
    remote fit check reads more and tries again: pull/remote_gguf.py)."""


@dataclass(frozen=True, slots=True)
class Skipped:
    """A value not kept: a long string, or an array (its element type and count)."""

    type: int
    count: int


@dataclass(slots=True)
class Header:
    fields: dict[str, Any] = field(default_factory=dict)  # scalars, short strings, arrays
    longest: dict[str, int] = field(default_factory=dict)  # string arrays: longest entry
    n_params: int = 0
    tensors: list[tuple[str, int]] = field(default_factory=list)  # (name, bytes) in file order
    # Bytes of the weights that feed matrix multiplications, by ggml type (GGUFInfo's
    # matmul_bytes: what llama.cpp's CPU backend may repack).
    matmul_bytes: dict[str, int] = field(default_factory=dict)


class _Cursor:
    def __init__(self, buf: mmap.mmap | bytes, order: str) -> None:
        self.buf = buf
        self.size = len(buf)
        self.order = order
        self.off = 0

    def take(self, fmt: str, size: int) -> Any:
        if self.off + size > self.size:
            raise HeaderShort("the header runs past the end of the file (truncated?)")
        (value,) = struct.unpack_from(self.order + fmt, self.buf, self.off)
        self.off += size
        return value

    def skip(self, n: int) -> None:
        if n < 0:
            raise _Bad("a negative length in the header")
        if self.off + n > self.size:
            raise HeaderShort("the header runs past the end of the file (truncated?)")
        self.off += n

    def string(self, limit: int | None = None) -> str | Skipped:
        n = int(self.take("Q", 8))
        if limit is not None and n > limit:
            raise _Bad(f"a key or name of {n} bytes (at most {limit})")
        start = self.off
        self.skip(n)
        if n > MAX_KEPT_STRING:
            return Skipped(_STRING, n)
        return bytes(self.buf[start : start + n]).decode("utf-8", "replace")


def parse_header(buf: mmap.mmap | bytes, file_size: int | None = None) -> Header:
    """Metadata and tensor sizes of a GGUF file (its bytes, from the magic on).

    ``buf`` may be the file's first bytes only (a remote header read): ``file_size`` is then
    the whole file's, which the tensors' data must lie within; running out of ``buf`` is a
    ``HeaderShort``."""
    if len(buf) < 24 and buf[: len(buf)] == _GGUF_MAGIC[: len(buf)]:
        raise HeaderShort("the file ends before its header does (truncated?)")
    if len(buf) < 24 or buf[:4] != _GGUF_MAGIC:
        raise _Bad("not a GGUF file (no GGUF magic number)")
    (version,) = struct.unpack_from("<I", buf, 4)
    order = "<"
    if version not in (2, 3):
        (swapped,) = struct.unpack_from(">I", buf, 4)
        if swapped not in (2, 3):
            raise _Bad(f"unsupported GGUF version {version} (this reader knows 2 and 3)")
        order = ">"
    cur = _Cursor(buf, order)
    cur.off = 8
    n_tensors = int(cur.take("Q", 8))
    n_kv = int(cur.take("Q", 8))
    if n_kv > MAX_KV or n_tensors > MAX_TENSORS:
        raise _Bad(f"{n_kv} metadata entries / {n_tensors} tensors is implausible")
    header = Header()
    for _ in range(n_kv):
        key = cur.string(MAX_KEY)
        if not isinstance(key, str):
            raise _Bad("unreadable metadata key")
        if key in header.fields:
            raise _Bad(f"duplicate metadata key {key!r}")
        header.fields[key] = _value(cur, int(cur.take("I", 4)), key, header)
    _tensors(cur, n_tensors, header, cur.size if file_size is None else file_size)
    return header


def _value(cur: _Cursor, vtype: int, key: str, header: Header) -> Any:
    if vtype == _STRING:
        return cur.string()
    if vtype in _SCALARS:
        fmt, size = _SCALARS[vtype]
        return cur.take(fmt, size)
    if vtype != _ARRAY:
        raise _Bad(f"{key} has unknown value type {vtype}")
    itype = int(cur.take("I", 4))
    count = int(cur.take("Q", 8))
    if itype == _ARRAY:
        raise _Bad(f"{key} is an array of arrays (llama.cpp cannot read those either)")
    if itype == _STRING:
        if count > MAX_STRING_ARRAY:
            raise _Bad(f"{key} has {count} strings (at most {MAX_STRING_ARRAY})")
        header.longest[key] = _skip_strings(cur, count)
        return Skipped(_STRING, count)
    if itype not in _SCALARS:
        raise _Bad(f"{key} is an array of unknown type {itype}")
    fmt, size = _SCALARS[itype]
    start = cur.off
    cur.skip(count * size)
    if count > MAX_KEPT_ARRAY:
        return Skipped(itype, count)
    return list(struct.unpack_from(f"{cur.order}{count}{fmt}", cur.buf, start))


def _skip_strings(cur: _Cursor, count: int) -> int:
    """Skip ``count`` length-prefixed strings; return the longest one's length in bytes."""
    length = struct.Struct(cur.order + "Q")
    buf, off, end, longest = cur.buf, cur.off, cur.size, 0
    for _ in range(count):
        if off + 8 > end:
            raise HeaderShort("a string array runs past the end of the file (truncated?)")
        (n,) = length.unpack_from(buf, off)
        off += 8 + n
        longest = max(longest, n)
    if off > end:
        raise HeaderShort("a string array runs past the end of the file (truncated?)")
    cur.off = off
    return int(longest)


# Weights read by GET_ROWS (embedding lookups), not multiplied: never repacked.
_LOOKUP_TENSORS = ("token_embd.", "per_layer_token_embd.", "position_embd.", "token_types.")


def _tensors(cur: _Cursor, count: int, header: Header, file_size: int) -> None:
    """Walk the tensor infos: count parameters, check that the data lies inside the file."""
    spans: list[tuple[str, int, int]] = []
    tied_embd: tuple[str, int] | None = None  # token_embd's (type, bytes) if repackable
    has_output = False
    for _ in range(count):
        name = cur.string(MAX_KEY)
        n_dims = int(cur.take("I", 4))
        if not 0 < n_dims <= MAX_DIMS:
            raise _Bad(f"tensor {name!r} has {n_dims} dimensions (1 to {MAX_DIMS})")
        elements = 1
        dims = [int(cur.take("Q", 8)) for _ in range(n_dims)]
        for d in dims:
            elements *= d
        if elements > MAX_ELEMENTS:
            raise _Bad(f"tensor {name!r} has an implausible shape {dims}")
        ttype = int(cur.take("I", 4))
        offset = int(cur.take("Q", 8))
        try:
            block, type_size = GGML_QUANT_SIZES[GGMLQuantizationType(ttype)]
        except (ValueError, KeyError):
            raise _Bad(f"tensor {name!r} has unknown type {ttype}") from None
        if dims[0] % block:
            raise _Bad(f"tensor {name!r}: {dims[0]} is not a multiple of its block {block}")
        header.n_params += elements
        nbytes = elements // block * type_size
        spans.append((str(name), offset, nbytes))
        header.tensors.append((str(name), nbytes))
        has_output = has_output or name == "output.weight"
        # The repack buffers take 2-D (and 3-D expert) weights whose rows come in 8s.
        if n_dims >= 2 and dims[1] % 8 == 0:
            kind = GGMLQuantizationType(ttype).name
            if name == "token_embd.weight":
                tied_embd = (kind, nbytes)
            elif not str(name).startswith(_LOOKUP_TENSORS):
                header.matmul_bytes[kind] = header.matmul_bytes.get(kind, 0) + nbytes
    # Tied embeddings (no output.weight): the output projection multiplies token_embd, and
    # llama.cpp repacks a copy of it for that (qwen2-style models at q4_0: +23.6 MiB).
    if tied_embd is not None and not has_output:
        kind, nbytes = tied_embd
        header.matmul_bytes[kind] = header.matmul_bytes.get(kind, 0) + nbytes
    alignment = header.fields.get("general.alignment", 32)
    if not isinstance(alignment, int) or alignment <= 0 or alignment & (alignment - 1):
        raise _Bad(f"general.alignment {alignment!r} is not a power of two")
    data = -(-cur.off // alignment) * alignment
    for name, offset, nbytes in spans:
        if data + offset + nbytes > file_size:
            raise _Bad(f"tensor {name!r} runs past the end of the file (truncated download?)")


# --- the footprint's numbers ---------------------------------------------------------


def _int(header: Header, key: str, suffix: str | None = None) -> int | None:
    """An integer field (an array gives its largest entry), range-checked when listed."""
    value = header.fields.get(key)
    if value is None:
        return None
    values = value if isinstance(value, list) else [value]
    if isinstance(value, Skipped) or any(
        isinstance(v, bool) or not isinstance(v, int) for v in values
    ):
        raise _Bad(f"{key} is not an integer")
    for v in values:
        _check_range(key, v, suffix)
    return max(values, default=0)


def _check_range(key: str, value: int, suffix: str | None) -> None:
    if suffix is None:
        return
    lo, hi = RANGES[suffix]
    if not lo <= value <= hi:
        raise _Bad(f"{key} = {value} is out of the plausible range [{lo}, {hi}]")


def _per_layer(header: Header, arch: str, suffix: str, n_layers: int) -> tuple[int, ...] | None:
    """A per-layer count that GGUF stores either as one scalar or as an array (OpenELM)."""
    key = f"{arch}.{suffix}"
    value = header.fields.get(key)
    if value is None:
        return None
    _int(header, key, suffix)  # type and range of every entry
    if isinstance(value, list):
        if len(value) != n_layers:
            raise _Bad(f"{key} has {len(value)} entries for {n_layers} layers")
        return tuple(int(v) for v in value)
    return (int(value),) * n_layers


def _file_type(value: int | None) -> str | None:
    if value is None:
        return None
    try:
        return LlamaFileType(value).name.removeprefix("MOSTLY_").replace("ALL_", "")
    except ValueError:
        return f"type-{value}"


def _find_mmproj(path: Path) -> Path | None:
    """The multimodal projector beside the model (models/projector_names.py)."""
    return projector_beside(path)


def is_mmproj(path: Path) -> bool:
    return path.name.lower().startswith("mmproj") and path.suffix.lower() == ".gguf"


def looks_like_gguf(path: Path) -> bool:
    """Cheap magic-number check (4 bytes), for discovery."""
    try:
        with path.open("rb") as fh:
            return fh.read(4) == _GGUF_MAGIC
    except OSError:
        return False


def read_header(path: Path) -> Header:
    with path.open("rb") as fh, mmap.mmap(fh.fileno(), 0, access=mmap.ACCESS_READ) as buf:
        return parse_header(buf)


def read_gguf_info(path: Path) -> GGUFInfo:
    """Architecture and attention shape of a GGUF model; raise InvalidModel when unreadable."""
    path = Path(path)
    if not looks_like_gguf(path):
        raise InvalidModel(f"{path} is not a GGUF file (no GGUF magic number)")
    try:
        return _info(read_header(path), path)
    except InvalidModel:
        raise
    except (_Bad, ValueError, OSError, OverflowError, struct.error) as exc:
        raise InvalidModel(f"{path} is not a readable GGUF file: {exc}") from exc


def info_from_header(header: Header, path: Path, *, beside: bool = True) -> GGUFInfo:
    """The footprint's numbers from a parsed header (``path`` names it in errors and gives
    the model's name when the file has none); InvalidModel when it is not a model.
    ``beside``: look for a projector beside ``path`` (False for a file not on disk)."""
    try:
        return _info(header, path, beside=beside)
    except InvalidModel:
        raise
    except (_Bad, ValueError, OverflowError, struct.error) as exc:
        raise InvalidModel(f"{path} is not a readable GGUF file: {exc}") from exc


def _info(header: Header, path: Path, *, beside: bool = True) -> GGUFInfo:
    f = header.fields
    arch = f.get("general.architecture")
    if not isinstance(arch, str) or not arch:
        raise InvalidModel(f"{path} has no general.architecture: not a model GGUF")
    n_layers = _int(header, f"{arch}.block_count", "block_count")
    n_embd = _int(header, f"{arch}.embedding_length", "embedding_length")
    if not n_layers or not n_embd:
        raise InvalidModel(f"{path} lacks {arch}.block_count/embedding_length: not a model GGUF")
    heads = _per_layer(header, arch, "attention.head_count", n_layers) or (0,) * n_layers
    kv_heads = _per_layer(header, arch, "attention.head_count_kv", n_layers) or heads
    n_heads = max(heads)
    # llama.cpp's defaults when the file does not say: head dim = n_embd / n_head.
    default_dim = n_embd // n_heads if n_heads else 0
    head_dim_k = _int(header, f"{arch}.attention.key_length", "attention.key_length")
    head_dim_v = _int(header, f"{arch}.attention.value_length", "attention.value_length")
    uniform = len(set(kv_heads)) == 1
    tokens = f.get("tokenizer.ggml.tokens")
    n_vocab = _int(header, f"{arch}.vocab_size", "vocab_size") or (
        tokens.count if isinstance(tokens, Skipped) else None
    )
    name = f.get("general.name")
    tokenizer = f.get("tokenizer.ggml.model")
    file_type = f.get("general.file_type")
    layers, input_bytes, output_bytes = tensor_bytes_by_layer(header.tensors, n_layers)
    pattern = f.get(f"{arch}.attention.sliding_window_pattern")
    return GGUFInfo(
        architecture=arch,
        name=name if isinstance(name, str) else path.stem,
        n_layers=n_layers,
        n_heads=n_heads,
        n_kv_heads=max(kv_heads),
        head_dim_k=head_dim_k or default_dim,
        head_dim_v=head_dim_v or default_dim,
        n_embd=n_embd,
        trained_ctx=_int(header, f"{arch}.context_length", "context_length") or 0,
        file_type=_file_type(file_type if isinstance(file_type, int) else None),
        has_chat_template=any(k.startswith("tokenizer.chat_template") for k in f),
        sliding_window=_int(header, f"{arch}.attention.sliding_window", "attention.sliding_window")
        or None,
        mmproj=_find_mmproj(path) if beside else None,
        n_params=header.n_params or None,
        kv_heads_per_layer=None if uniform else kv_heads,
        n_vocab=n_vocab,
        max_token_bytes=header.longest.get("tokenizer.ggml.tokens") or None,
        tokenizer_model=tokenizer if isinstance(tokenizer, str) else None,
        layer_bytes=layers,
        input_bytes=input_bytes,
        output_bytes=output_bytes,
        n_ff=_int(header, f"{arch}.feed_forward_length", "feed_forward_length") or None,
        n_expert=_int(header, f"{arch}.expert_count", "expert_count") or 0,
        n_expert_used=_int(header, f"{arch}.expert_used_count", "expert_count") or 0,
        n_ff_expert=_int(header, f"{arch}.expert_feed_forward_length", "feed_forward_length"),
        n_ff_shared=_int(
            header, f"{arch}.expert_shared_feed_forward_length", "feed_forward_length"
        ),
        swa_pattern=pattern if isinstance(pattern, int) and 0 < pattern <= 4096 else None,
        tensor_bytes=sum(n for _, n in header.tensors) or None,
        matmul_bytes=tuple(sorted(header.matmul_bytes.items())),
    )


def tensor_bytes_by_layer(
    tensors: Iterable[tuple[str, int]], n_layers: int
) -> tuple[tuple[int, ...] | None, int, int]:
    """(bytes per block, input layer bytes, output layer bytes) from (name, bytes) pairs.

    llama.cpp keeps the input layer (token embeddings) on the CPU and offloads the output
    layer with the last blocks. A model without ``output.weight`` ties its output to the
    token embeddings, and llama.cpp loads a second copy of them into the output layer.
    """
    blocks = [0] * n_layers
    input_bytes = output_bytes = embd = 0
    has_output = seen = False
    for name, nbytes in tensors:
        seen = True
        if name.startswith("blk."):
            index = name.split(".", 2)[1]
            if index.isdigit() and int(index) < n_layers:
                blocks[int(index)] += nbytes
                continue
        if name.startswith("output"):
            output_bytes += nbytes
            has_output = has_output or name == "output.weight"
            continue
        if name == "token_embd.weight":
            embd = nbytes
        input_bytes += nbytes
    if not seen:
        return None, 0, 0
    if not has_output:
        output_bytes += embd
    return tuple(blocks), input_bytes, output_bytes


MAX_TEMPLATE = 1 << 24  # bytes of one chat template read for the template check


def read_chat_templates(path: Path) -> dict[str, str]:
    """Every ``tokenizer.chat_template*`` string of a GGUF file, whole (the header walk keeps
    only short strings). The load-time template check renders them (models.template_check);
    a template longer than ``MAX_TEMPLATE`` bytes is an InvalidModel."""
    with path.open("rb") as fh, mmap.mmap(fh.fileno(), 0, access=mmap.ACCESS_READ) as buf:
        try:
            return _chat_templates(buf)
        except _Bad as exc:
            raise InvalidModel(f"{path.name}: {exc}") from None


def _chat_templates(buf: mmap.mmap) -> dict[str, str]:
    if len(buf) < 24 or buf[:4] != _GGUF_MAGIC:
        raise _Bad("not a GGUF file (no GGUF magic number)")
    (version,) = struct.unpack_from("<I", buf, 4)
    order = "<" if version in (2, 3) else ">"
    cur = _Cursor(buf, order)
    cur.off = 16
    n_kv = int(cur.take("Q", 8))
    if n_kv > MAX_KV:
        raise _Bad(f"{n_kv} metadata entries is implausible")
    scratch = Header()
    templates: dict[str, str] = {}
    for _ in range(n_kv):
        key = cur.string(MAX_KEY)
        if not isinstance(key, str):
            raise _Bad("unreadable metadata key")
        vtype = int(cur.take("I", 4))
        if vtype == _STRING and key.startswith("tokenizer.chat_template"):
            n = int(cur.take("Q", 8))
            if n > MAX_TEMPLATE:
                raise _Bad(f"{key} is {n} bytes (at most {MAX_TEMPLATE})")
            start = cur.off
            cur.skip(n)
            templates[key] = bytes(buf[start : start + n]).decode("utf-8", "replace")
        else:
            _value(cur, vtype, key, scratch)
    return templates
