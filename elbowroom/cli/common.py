"""Helpers every command shares: common flags, settings from flags, table and JSON output."""

from __future__ import annotations

import argparse
import json
import sys
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from elbowroom.config import Settings, load_settings


def add_common(p: argparse.ArgumentParser) -> None:
    p.add_argument("--json", action="store_true", help="print JSON for machines")
    p.add_argument("--config", type=Path, default=None, help="TOML settings file")
    p.add_argument(
        "--override-memory",
        default=None,
        help="make the machine look this small, e.g. 8GiB (env ELBOWROOM_OVERRIDE_MEMORY)",
    )


def settings_from(args: argparse.Namespace, **flags: Any) -> Settings:
    flags.setdefault("override_memory", getattr(args, "override_memory", None))
    return load_settings(flags, config_file=getattr(args, "config", None))


def print_json(data: Any) -> None:
    json.dump(data, sys.stdout, indent=2, default=str)
    sys.stdout.write("\n")


def table(headers: Sequence[str], rows: Sequence[Sequence[Any]]) -> str:
    """A plain aligned text table; numbers right-aligned."""
    cells = [[str(c) for c in headers]] + [
        [("-" if c is None else str(c)) for c in r] for r in rows
    ]
    widths = [max(len(row[i]) for row in cells) for i in range(len(headers))]
    numeric = [
        all(_looks_numeric(r[i]) for r in cells[1:]) and len(cells) > 1 for i in range(len(headers))
    ]
    lines = []
    for n, row in enumerate(cells):
        parts = [
            (c.rjust(widths[i]) if numeric[i] and n > 0 else c.ljust(widths[i]))
            for i, c in enumerate(row)
        ]
        lines.append("  ".join(parts).rstrip())
    return "\n".join(lines)


def _looks_numeric(text: str) -> bool:
    head = text.split(" ")[0].replace(".", "", 1).replace("-", "", 1).rstrip("%")
    return head.isdigit()
