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


_SIZES = {0: 1, 1: 1, 2: 2, 3: 2, 4: 4, 5: 4, 6: 4, 7: 1, 10: 8, 11: 8, 12: 8}


def with_chat_template(source: Path, target: Path, template: str) -> Path:
    """A copy of the GGUF ``source`` at ``target`` whose ``tokenizer.chat_template`` is
    ``template`` (the weights unchanged: the data section is re-aligned after the header)."""
    data = source.read_bytes()
    off = 24
    n_tensors, n_kv = struct.unpack_from("<QQ", data, 8)

    def take_string(at: int) -> tuple[bytes, int]:
        (n,) = struct.unpack_from("<Q", data, at)
        return data[at + 8 : at + 8 + n], at + 8 + n

    def skip_value(vtype: int, at: int) -> int:
        if vtype == STRING:
            return take_string(at)[1]
        if vtype != ARRAY:
            return at + _SIZES[vtype]
        itype, count = struct.unpack_from("<IQ", data, at)
        at += 12
        if itype == STRING:
            for _ in range(count):
                at = take_string(at)[1]
            return at
        return at + _SIZES[itype] * count

    kvs: list[bytes] = []
    alignment = 32
    for _ in range(n_kv):
        start = off
        key, off = take_string(off)
        (vtype,) = struct.unpack_from("<I", data, off)
        end = skip_value(vtype, off + 4)
        if key == b"general.alignment":
            (alignment,) = struct.unpack_from("<I", data, off + 4)
        if key != b"tokenizer.chat_template":
            kvs.append(data[start:end])
        off = end
    kvs.append(text("tokenizer.chat_template", template))
    tensors_start = off
    for _ in range(n_tensors):
        _, off = take_string(off)
        (n_dims,) = struct.unpack_from("<I", data, off)
        off += 4 + 8 * n_dims + 4 + 8
    infos = data[tensors_start:off]
    data_start = -(-off // alignment) * alignment
    head = b"GGUF" + struct.pack("<IQQ", 3, n_tensors, len(kvs)) + b"".join(kvs) + infos
    head += b"\0" * (-len(head) % alignment)
    target.write_bytes(head + data[data_start:])
    return target


# Chat templates that hurt llama.cpp while it loads (issue 28): the loop took a runner to
# 23.6 GB, the recursive macro crashed it (SIGSEGV) on every load.
CRAFTED_TEMPLATES = {
    "template-loop": ("{%- for i in range(1000000000) -%}{%- endfor -%}hi", "sandbox limit"),
    "template-recursive": (
        "{%- macro f(x) -%}{{ f(x) }}{%- endmacro -%}{{ f(1) }}",
        "recurses without end",
    ),
    "template-nested": (
        "{%- for i in range(100000) -%}{%- for j in range(100000) -%}{%- endfor -%}"
        "{%- endfor -%}hi",
        "s of CPU",
    ),
    "template-memory": (
        "{%- set s = 'x' * 100000000 -%}{%- set t = s ~ s ~ s ~ s -%}{{ t|length }}",
        "MiB to render",
    ),
}


def write_crafted_templates(source: Path, folder: Path) -> dict[str, str]:
    """Copies of the GGUF ``source`` with each crafted chat template; returns model id ->
    what the refusal says."""
    folder.mkdir(parents=True, exist_ok=True)
    for name, (template, _) in CRAFTED_TEMPLATES.items():
        with_chat_template(source, folder / f"{name}.gguf", template)
    return {name: why for name, (_, why) in CRAFTED_TEMPLATES.items()}
