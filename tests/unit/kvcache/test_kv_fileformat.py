"""The entry file format round-trips and rejects every kind of damage."""

from __future__ import annotations

import pytest

from elbowroom.kvcache.fileformat import (
    FIXED_SIZE,
    FormatError,
    check_payload,
    decode_header,
    encode_header,
)

KEY = '{"model": "m"}'
TOKENS = (1, 2, 3, 70000, 0)
PAYLOAD = bytes(range(256)) * 4


def test_round_trip() -> None:
    head = encode_header(KEY, TOKENS, PAYLOAD)
    h = decode_header(head)
    assert (h.key, h.tokens, h.payload_len, h.size) == (KEY, TOKENS, len(PAYLOAD), len(head))
    check_payload(h, PAYLOAD)


@pytest.mark.parametrize("offset", [0, 9, 13, 17, 21, 33, FIXED_SIZE + 2, FIXED_SIZE + 20])
def test_any_flipped_header_byte_is_rejected(offset: int) -> None:
    head = bytearray(encode_header(KEY, TOKENS, PAYLOAD))
    head[offset] ^= 0xFF
    with pytest.raises(FormatError):
        h = decode_header(bytes(head))
        check_payload(h, PAYLOAD)


def test_truncated_header_is_rejected() -> None:
    head = encode_header(KEY, TOKENS, PAYLOAD)
    for n in (0, 5, FIXED_SIZE, len(head) - 1):
        with pytest.raises(FormatError):
            decode_header(head[:n])


def test_damaged_or_short_payload_is_rejected() -> None:
    h = decode_header(encode_header(KEY, TOKENS, PAYLOAD))
    bad = bytearray(PAYLOAD)
    bad[500] ^= 1
    with pytest.raises(FormatError, match="checksum"):
        check_payload(h, bad)
    with pytest.raises(FormatError, match="truncated"):
        check_payload(h, PAYLOAD[:-1])
