"""The disk tier's file format (version 3; version 2 is read too). Pure: bytes in, bytes out.

An entry file is the engine's own slot file (llama.cpp's sequence state, magic ``ggsq``)
followed by elbowroom's trailer, so the engine restores straight from the entry (through
a link in its private slot directory: docs/kvcache.md) and nothing is copied on a
restore; llama.cpp reads its state and ignores what follows it. All integers
little-endian::

    payload            payload_len bytes: the engine's slot file, byte for byte
    guard       8      b"ELBKVTRL" (never the engine's checkpoint-appendix magic "SCKP")
    key         k      the cache key (UTF-8)
    tokens      4 n    n x int32
    text        t      the prompt the tokens were made from, as the engine rendered it
                       (UTF-8; version 3, may be empty)
    text_len    8      t (version 3 only)
    fixed      40      from the end of the file:
                  0  2 version (3, or 2: no text, no text_len)
                  2  2 reserved (0)
                  4  4 k (key length)
                  8  4 n (token count)
                 12  8 payload_len
                 20  8 payload xxh3-64
                 28  4 trailer crc32: of everything from the guard up to here
                 32  8 magic b"ELBKV\\r\\n\\x1a" (the CR-LF and ^Z catch text-mode mangling)

The trailer (with the token list and text) is small and read on its own when a directory
is indexed (the last ``TAIL_SIZE`` bytes, then the rest before them); the payload's
checksum is verified when an entry is restored. The text lets a later prompt that begins
with it skip tokenizing that part (``PrefixCache.known_text``). xxh3-64 (about 15 GB/s;
zlib's crc32, version 1's, took ~25 ms of a 52 MiB restore here) guards against torn
writes and bit rot, not against an adversary: the cache directory is as trusted as the
model files. Version 1 files (the header in front) are not read: a miss, removed like any
other unusable entry.
"""

from __future__ import annotations

import array
import struct
import sys
import zlib
from dataclasses import dataclass

import xxhash

MAGIC = b"ELBKV\r\n\x1a"
GUARD = b"ELBKVTRL"
# What every payload starts with: llama.cpp's LLAMA_STATE_SEQ_MAGIC ("ggsq"). A file whose
# trailer was cut off is still known by it (disk.py: ``_ours``).
ENGINE_MAGIC = struct.pack("<I", 0x67677371)
VERSION = 3
READS = (2, 3)
_FIXED = struct.Struct("<HHIIQQI8s")
FIXED_SIZE = _FIXED.size  # 40
_TEXT_LEN = struct.Struct("<Q")
TAIL_SIZE = FIXED_SIZE + _TEXT_LEN.size  # enough of a file's end to size its trailer
# A sanity bound so that a corrupt length field cannot make us allocate gigabytes.
MAX_KEY = 64 * 1024
MAX_TOKENS = 16 * 1024 * 1024
MAX_TEXT = 256 * 1024 * 1024
MAX_PAYLOAD = 64 * 1024**3  # no sequence state is this large; a reader bounds it further

Blob = bytes | bytearray


class FormatError(ValueError):
    """The bytes are not a valid entry file (corrupt, truncated, wrong version)."""


@dataclass(frozen=True, slots=True)
class Header:
    key: str
    tokens: tuple[int, ...]
    payload_len: int
    payload_hash: int
    size: int  # the trailer's bytes (after the payload)
    text: str = ""  # the rendered prompt the tokens came from ("": not recorded)

    @property
    def file_size(self) -> int:
        return self.payload_len + self.size


def payload_hash(payload: Blob | memoryview) -> int:
    return xxhash.xxh3_64_intdigest(payload)


def _tokens_bytes(tokens: tuple[int, ...]) -> bytes:
    arr = array.array("i", tokens)
    if sys.byteorder != "little":
        arr.byteswap()
    return arr.tobytes()


def encode_trailer(key: str, tokens: tuple[int, ...], payload: Blob, text: str = "") -> bytes:
    """Everything after the payload."""
    key_bytes = key.encode()
    text_bytes = text.encode()
    head = GUARD + key_bytes + _tokens_bytes(tokens) + text_bytes
    head += _TEXT_LEN.pack(len(text_bytes))
    fixed = _FIXED.pack(
        VERSION, 0, len(key_bytes), len(tokens), len(payload), payload_hash(payload), 0, MAGIC
    )
    covered = head + fixed[:28]
    return covered + struct.pack("<I", zlib.crc32(covered)) + MAGIC


def trailer_length(tail: bytes) -> int:
    """From the last ``TAIL_SIZE`` bytes of a file (``FIXED_SIZE`` do for version 2, or a
    shorter file): the trailer's length, checked for plausibility."""
    if len(tail) < FIXED_SIZE:
        raise FormatError("truncated trailer")
    version, _, key_len, n_tokens, _, _, _, magic = _FIXED.unpack(tail[-FIXED_SIZE:])
    if magic != MAGIC:
        raise FormatError("not an elbowroom KV file (bad magic)")
    if version not in READS:
        raise FormatError(f"unsupported version {version} (this build reads {READS})")
    if key_len > MAX_KEY or n_tokens > MAX_TOKENS:
        raise FormatError("implausible trailer lengths")
    size = len(GUARD) + int(key_len) + 4 * int(n_tokens) + FIXED_SIZE
    if version == 2:
        return size
    if len(tail) < TAIL_SIZE:
        raise FormatError("truncated trailer")
    (text_len,) = _TEXT_LEN.unpack(tail[-TAIL_SIZE:-FIXED_SIZE])
    if text_len > MAX_TEXT:
        raise FormatError("implausible text length")
    return size + int(text_len) + _TEXT_LEN.size


def decode_trailer(tail: bytes) -> Header:
    """Parse and verify a trailer: the last ``trailer_length`` bytes of the file (or more:
    only the end counts)."""
    size = trailer_length(tail[-TAIL_SIZE:])
    if len(tail) < size:
        raise FormatError("truncated trailer")
    trailer = tail[-size:]
    version, _, key_len, n_tokens, payload_len, digest, crc, _ = _FIXED.unpack(
        trailer[-FIXED_SIZE:]
    )
    if payload_len > MAX_PAYLOAD:
        raise FormatError("implausible payload length")
    if zlib.crc32(trailer[:-12]) != crc:
        raise FormatError("trailer checksum mismatch")
    if trailer[: len(GUARD)] != GUARD:
        raise FormatError("trailer guard missing")
    at = len(GUARD)
    key_bytes = trailer[at : at + key_len]
    at += key_len
    arr = array.array("i")
    arr.frombytes(trailer[at : at + 4 * n_tokens])
    at += 4 * n_tokens
    if sys.byteorder != "little":
        arr.byteswap()
    text_bytes = trailer[at : size - TAIL_SIZE] if version >= 3 else b""
    try:
        key = key_bytes.decode()
        text = text_bytes.decode()
    except UnicodeDecodeError as exc:
        raise FormatError("key or text is not UTF-8") from exc
    return Header(key, tuple(arr), payload_len, digest, size, text)


def check_payload(header: Header, payload: Blob | memoryview) -> None:
    if len(payload) != header.payload_len:
        raise FormatError(f"truncated payload ({len(payload)} of {header.payload_len} bytes)")
    if payload_hash(payload) != header.payload_hash:
        raise FormatError("payload checksum mismatch")
