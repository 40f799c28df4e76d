"""Byte sizes: the one place where they are parsed and formatted.

Bytes are plain ``int`` everywhere else. ``parse_size`` accepts what people type
("8GiB", "512 MiB", "1.5G", "4096"); binary units (KiB, MiB, ...) and the short forms
(K, M, G, T) are powers of 1024, decimal units (KB, MB, GB, TB) powers of 1000.
"""

from __future__ import annotations

import re

_UNITS: dict[str, int] = {
    "": 1,
    "b": 1,
    "k": 1024,
    "kib": 1024,
    "kb": 1000,
    "m": 1024**2,
    "mib": 1024**2,
    "mb": 1000**2,
    "g": 1024**3,
    "gib": 1024**3,
    "gb": 1000**3,
    "t": 1024**4,
    "tib": 1024**4,
    "tb": 1000**4,
}

_SIZE_RE = re.compile(r"^\s*([0-9]+(?:\.[0-9]+)?)\s*([a-zA-Z]*)\s*$")

KiB = 1024
MiB = 1024**2
GiB = 1024**3


def parse_size(text: str | int) -> int:
    """Parse a human size into bytes; raise ValueError naming the accepted forms."""
    if isinstance(text, int):
        if text < 0:
            raise ValueError(f"size must not be negative: {text}")
        return text
    match = _SIZE_RE.match(text)
    unit = match.group(2).lower() if match else ""
    if match is None or unit not in _UNITS:
        raise ValueError(
            f"cannot parse size {text!r}: use a number with an optional unit, "
            "e.g. 8GiB, 512MiB, 1.5G or 4096"
        )
    return int(float(match.group(1)) * _UNITS[unit])


def format_size(n: int | float | None, precision: int = 1) -> str:
    """Format bytes for people: 1536 -> '1.5 KiB'. None -> '-'."""
    if n is None:
        return "-"
    sign = "-" if n < 0 else ""
    value = float(abs(n))
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if value < 1024 or unit == "TiB":
            if unit == "B":
                return f"{sign}{int(value)} B"
            return f"{sign}{value:.{precision}f} {unit}"
        value /= 1024
    raise AssertionError("unreachable")
