"""The entry file format round-trips and rejects every kind of damage."""

from __future__ import annotations

import struct
import zlib

import pytest

from elbowroom.kvcache.fileformat import (
    FIXED_SIZE,
    GUARD,
    MAGIC,
    TAIL_SIZE,
    FormatError,
    check_payload,
    decode_trailer,
    encode_trailer,
    payload_hash,
    trailer_length,
)

KEY = '{"model": "m"}'
TOKENS = (1, 2, 3, 70000, 0)
PAYLOAD = bytes(range(256)) * 4
TEXT = "<|im_start|>user\nÜber die Brücke?<|im_end|>\n<|im_start|>assistant\n"


@pytest.mark.parametrize("text", ["", TEXT])
def test_round_trip(text: str) -> None:
    tail = encode_trailer(KEY, TOKENS, PAYLOAD, text)
    h = decode_trailer(tail)
    assert (h.key, h.tokens, h.payload_len, h.size) == (KEY, TOKENS, len(PAYLOAD), len(tail))
    assert h.text == text
    assert trailer_length(tail[-TAIL_SIZE:]) == len(tail)
    check_payload(h, PAYLOAD)
    # Read from the end: the payload in front of the trailer does not matter.
    assert decode_trailer(PAYLOAD + tail) == h


def _version_2(key: str, tokens: tuple[int, ...], payload: bytes) -> bytes:
    """A trailer as the previous release wrote it: no text, no text length."""
    body = GUARD + key.encode() + struct.pack(f"<{len(tokens)}i", *tokens)
    fixed = struct.pack(
        "<HHIIQQ", 2, 0, len(key.encode()), len(tokens), len(payload), payload_hash(payload)
    )
    return body + fixed + struct.pack("<I", zlib.crc32(body + fixed)) + MAGIC


def test_a_version_2_trailer_is_still_read() -> None:
    tail = _version_2(KEY, TOKENS, PAYLOAD)
    h = decode_trailer(PAYLOAD + tail)
    assert (h.key, h.tokens, h.text, h.size) == (KEY, TOKENS, "", len(tail))
    assert trailer_length(tail[-FIXED_SIZE:]) == len(tail)
    check_payload(h, PAYLOAD)


# guard, key, tokens, text, its length, then the fixed part (version, lengths, hash, crc,
# magic)
@pytest.mark.parametrize(
    "back", [1, 5, 9, 13, 21, 27, 33, 37, FIXED_SIZE + 3, TAIL_SIZE + 5, TAIL_SIZE + 60]
)
def test_any_flipped_trailer_byte_is_rejected(back: int) -> None:
    tail = bytearray(encode_trailer(KEY, TOKENS, PAYLOAD, TEXT))
    tail[-back] ^= 0xFF
    with pytest.raises(FormatError):
        h = decode_trailer(bytes(tail))
        check_payload(h, PAYLOAD)


def test_the_guard_is_checked() -> None:
    tail = bytearray(encode_trailer(KEY, TOKENS, PAYLOAD))
    tail[0] ^= 0xFF
    with pytest.raises(FormatError):
        decode_trailer(bytes(tail))


def test_truncated_trailer_is_rejected() -> None:
    tail = encode_trailer(KEY, TOKENS, PAYLOAD)
    for n in (0, 5, FIXED_SIZE, len(tail) - 1):
        with pytest.raises(FormatError):
            decode_trailer(tail[len(tail) - n :])


def test_a_version_1_file_is_not_read() -> None:
    tail = bytearray(encode_trailer(KEY, TOKENS, PAYLOAD))
    tail[-FIXED_SIZE] = 1  # version field
    with pytest.raises(FormatError, match="unsupported version 1"):
        decode_trailer(bytes(tail))


def test_damaged_or_short_payload_is_rejected() -> None:
    h = decode_trailer(encode_trailer(KEY, TOKENS, PAYLOAD))
    bad = bytearray(PAYLOAD)
    bad[500] ^= 1
    with pytest.raises(FormatError, match="checksum"):
        check_payload(h, bad)
    with pytest.raises(FormatError, match="truncated"):
        check_payload(h, PAYLOAD[:-1])
