"""The disk tier's file format (version 1). Pure: bytes in, bytes out.

All integers little-endian::

    offset size
    0      8    magic  b"ELBKV\\r\\n\\x1a" (the CR-LF and ^Z catch text-mode mangling)
    8      2    version (1)
    10     2    reserved (0)
    12     4    key_len: bytes of the cache key (UTF-8)
    16     4    n_tokens
    20     8    payload_len
    28     4    payload crc32
    32     4    header crc32: of bytes [0, 32) + key + tokens
    36     ...  key, then n_tokens x int32 tokens, then the payload (llama.cpp sequence state)

The header (with the token list) is small and read on its own when a directory is
indexed; the payload's checksum is verified when an entry is restored. crc32 (zlib, about
3 GB/s) guards against torn writes and bit rot, not against an adversary: the cache
directory is as trusted as the model files.
"""

from __future__ import annotations

import array
import struct
import sys
import zlib
from dataclasses import dataclass

MAGIC = b"ELBKV\r\n\x1a"
VERSION = 1
_FIXED = struct.Struct("<8sHHIIQII")
FIXED_SIZE = _FIXED.size  # 36
# A sanity bound so that a corrupt length field cannot make us allocate gigabytes.
MAX_KEY = 64 * 1024
MAX_TOKENS = 16 * 1024 * 1024
MAX_PAYLOAD = 64 * 1024**3  # no sequence state is this large; a reader bounds it further

Blob = bytes | bytearray


class FormatError(ValueError):
    """The bytes are not a valid entry file (corrupt, truncated, wrong version)."""


@dataclass(frozen=True, slots=True)
class Header:
    key: str
    tokens: tuple[int, ...]
    payload_len: int
    payload_crc: int
    size: int  # bytes before the payload

    @property
    def file_size(self) -> int:
        return self.size + self.payload_len


def _tokens_bytes(tokens: tuple[int, ...]) -> bytes:
    arr = array.array("i", tokens)
    if sys.byteorder != "little":
        arr.byteswap()
    return arr.tobytes()


def encode_header(key: str, tokens: tuple[int, ...], payload: Blob) -> bytes:
    """Everything before the payload; write the payload right after it."""
    key_bytes = key.encode()
    tok = _tokens_bytes(tokens)
    fixed = _FIXED.pack(
        MAGIC, VERSION, 0, len(key_bytes), len(tokens), len(payload), zlib.crc32(payload), 0
    )
    crc = zlib.crc32(tok, zlib.crc32(key_bytes, zlib.crc32(fixed[:32])))
    return fixed[:32] + struct.pack("<I", crc) + key_bytes + tok


def fixed_lengths(fixed: bytes) -> tuple[int, int]:
    """From the first FIXED_SIZE bytes: (key_len, n_tokens), checked for plausibility."""
    if len(fixed) < FIXED_SIZE:
        raise FormatError("truncated header")
    magic, version, _, key_len, n_tokens, _, _, _ = _FIXED.unpack(fixed[:FIXED_SIZE])
    if magic != MAGIC:
        raise FormatError("not an elbowroom KV file (bad magic)")
    if version != VERSION:
        raise FormatError(f"unsupported version {version} (this build reads {VERSION})")
    if key_len > MAX_KEY or n_tokens > MAX_TOKENS:
        raise FormatError("implausible header lengths")
    return key_len, n_tokens


def decode_header(head: bytes) -> Header:
    """Parse and verify a header (FIXED_SIZE + key + tokens bytes, or more)."""
    key_len, n_tokens = fixed_lengths(head)
    size = FIXED_SIZE + key_len + 4 * n_tokens
    if len(head) < size:
        raise FormatError("truncated header")
    _, _, _, _, _, payload_len, payload_crc, crc = _FIXED.unpack(head[:FIXED_SIZE])
    if payload_len > MAX_PAYLOAD:
        raise FormatError("implausible payload length")
    key_bytes = head[FIXED_SIZE : FIXED_SIZE + key_len]
    tok = head[FIXED_SIZE + key_len : size]
    if zlib.crc32(tok, zlib.crc32(key_bytes, zlib.crc32(head[:32]))) != crc:
        raise FormatError("header checksum mismatch")
    arr = array.array("i")
    arr.frombytes(tok)
    if sys.byteorder != "little":
        arr.byteswap()
    try:
        key = key_bytes.decode()
    except UnicodeDecodeError as exc:
        raise FormatError("key is not UTF-8") from exc
    return Header(key, tuple(arr), payload_len, payload_crc, size)


def check_payload(header: Header, payload: Blob | memoryview) -> None:
    if len(payload) != header.payload_len:
        raise FormatError(f"truncated payload ({len(payload)} of {header.payload_len} bytes)")
    if zlib.crc32(payload) != header.payload_crc:
        raise FormatError("payload checksum mismatch")
