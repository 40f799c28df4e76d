"""Hand-built GGUF files, valid or crafted to hurt a reader (for the model-layer and e2e tests).

The gguf package's writer refuses to write most of these, so the bytes are put together
here, following the GGUF v3 layout: magic, version, tensor count, KV count, then each KV as
key (u64 length + bytes), value type (u32), value.
"""

from __future__ import annotations

import struct
from pathlib import Path

UINT32, INT32, STRING, ARRAY = 4, 5, 8, 9


def string(text: str | bytes) -> bytes:
    data = text.encode() if isinstance(text, str) else text
    return struct.pack("<Q", len(data)) + data


def kv(key: str, vtype: int, value: bytes) -> bytes:
    return string(key) + struct.pack("<I", vtype) + value


def u32(key: str, n: int) -> bytes:
    return kv(key, UINT32, struct.pack("<I", n))


def i32(key: str, n: int) -> bytes:
    return kv(key, INT32, struct.pack("<i", n))


def text(key: str, value: str) -> bytes:
    return kv(key, STRING, string(value))


def model_kvs(arch: str = "llama", **numbers: int) -> list[bytes]:
    """A minimal model header: what discovery needs to list it."""
    base = {"block_count": 2, "embedding_length": 64, "attention.head_count": 4}
    base.update({k.replace("__", "."): v for k, v in numbers.items()})
    return [text("general.architecture", arch)] + [
        u32(f"{arch}.{name}", n) for name, n in base.items()
    ]


def gguf(kvs: list[bytes], tail: bytes = b"") -> bytes:
    return b"GGUF" + struct.pack("<IQQ", 3, 0, len(kvs)) + b"".join(kvs) + tail


def nested_arrays(key: str, depth: int) -> bytes:
    """``depth`` arrays, each holding the next; the innermost holds no u8."""
    value = struct.pack("<IQ", 0, 0)  # array of 0 x u8
    for _ in range(depth - 1):
        value = struct.pack("<IQ", ARRAY, 1) + value
    return kv(key, ARRAY, value)


def string_array_header(key: str, count: int) -> bytes:
    """An array that claims ``count`` strings (the file may hold far fewer)."""
    return kv(key, ARRAY, struct.pack("<IQ", STRING, count))


def int_array(key: str, count: int) -> bytes:
    return kv(key, ARRAY, struct.pack("<IQ", INT32, count) + b"\0" * (4 * count))


def write_hostile_models(folder: Path) -> dict[str, str]:
    """The three crafted files of issue 9 in ``folder``; returns name -> expected reason."""
    folder.mkdir(parents=True, exist_ok=True)
    files = {
        "nested-2000.gguf": (
            gguf([*model_kvs(), nested_arrays("x.nested", 2000)]),
            "array of arrays",
        ),
        "array-1e7.gguf": (
            gguf([*model_kvs(), string_array_header("tokenizer.ggml.tokens", 10**7)]),
            "10000000 strings",
        ),
        "negative-kv.gguf": (
            gguf([*model_kvs(), i32("llama.attention.head_count_kv", -4)]),
            "head_count_kv = -4",
        ),
    }
    for name, (data, _) in files.items():
        (folder / name).write_bytes(data)
    return {name: reason for name, (_, reason) in files.items()}
