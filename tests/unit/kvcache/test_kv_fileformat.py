"""The entry file format round-trips and rejects every kind of damage."""

from __future__ import annotations

import pytest

from elbowroom.kvcache.fileformat import (
    FIXED_SIZE,
    FormatError,
    check_payload,
    decode_trailer,
    encode_trailer,
    trailer_length,
)

KEY = '{"model": "m"}'
TOKENS = (1, 2, 3, 70000, 0)
PAYLOAD = bytes(range(256)) * 4


def test_round_trip() -> None:
    tail = encode_trailer(KEY, TOKENS, PAYLOAD)
    h = decode_trailer(tail)
    assert (h.key, h.tokens, h.payload_len, h.size) == (KEY, TOKENS, len(PAYLOAD), len(tail))
    assert trailer_length(tail[-FIXED_SIZE:]) == len(tail)
    check_payload(h, PAYLOAD)
    # Read from the end: the payload in front of the trailer does not matter.
    assert decode_trailer(PAYLOAD + tail) == h


# guard, key, tokens, then the fixed part (version, lengths, hash, crc, magic)
@pytest.mark.parametrize("back", [1, 5, 9, 13, 21, 27, 33, 37, FIXED_SIZE + 3, FIXED_SIZE + 30])
def test_any_flipped_trailer_byte_is_rejected(back: int) -> None:
    tail = bytearray(encode_trailer(KEY, TOKENS, PAYLOAD))
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
