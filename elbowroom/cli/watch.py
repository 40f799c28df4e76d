"""`elbowroom ps --watch`: the dashboard's picture in the terminal, redrawn every second.

``render(data)`` is pure (a dashboard document in, a rich renderable out) so the layout is
tested without a server or a terminal; ``watch`` polls and redraws with ``rich.live``.
"""

from __future__ import annotations

import json
import sys
import time
from collections.abc import Callable
from datetime import datetime
from typing import Any

from rich import box
from rich.console import Console, Group
from rich.live import Live
from rich.table import Table
from rich.text import Text

from elbowroom.units import format_size

_LEVEL_STYLE = {"normal": "bold green", "soft": "bold yellow", "hard": "bold red"}
_KIND_STYLE = {
    "load": "green",
    "unload": "dim",
    "evict": "yellow",
    "abort": "red",
    "crash": "red",
    "load_failed": "red",
    "refused_503": "red",
    "refused_507": "magenta",
}


def _size(value: Any) -> str:
    return "-" if value is None else format_size(int(value))


def _countdown(model: dict[str, Any]) -> str:
    if model.get("pinned"):
        return "never (pinned)"
    seconds = model.get("expires_in")
    if seconds is None:
        return "never"
    s = int(seconds)
    return f"{s // 60}m{s % 60:02d}s" if s >= 60 else f"{s}s"


def _kv(kv: dict[str, Any] | None) -> str:
    if not kv:
        return "-"
    tiers = ", ".join(f"{t['tier']} {t['entries']}/{format_size(t['bytes'])}" for t in kv["tiers"])
    rate = kv.get("hit_rate")
    return f"{tiers}; {'-' if rate is None else f'{rate:.0%}'} hits"


def _table(title: str) -> Table:
    return Table(title=title, title_justify="left", box=box.SIMPLE_HEAD)


def render(data: dict[str, Any]) -> Group:
    pressure = data.get("pressure", {})
    level = str(pressure.get("level") or "?")
    head = Text("elbowroom  pressure ")
    head.append(level, style=_LEVEL_STYLE.get(level, "bold"))
    if pressure.get("loads_paused"):
        head.append("  loads paused", style="yellow")
    if not pressure.get("admission_open", True):
        head.append("  refusing new work", style="red")
    head.append(f"   {datetime.fromtimestamp(data.get('now', 0)).strftime('%H:%M:%S')}")

    pools = _table("memory pools")
    for col in ("POOL", "TOTAL", "USED", "AVAIL", "LIMIT", "SOFT", "HARD", "COMMITTED"):
        if col == "POOL":
            pools.add_column(col, no_wrap=True, overflow="ellipsis", min_width=10)
        else:
            pools.add_column(col, justify="right", no_wrap=True)
    for p in data.get("pools", []):
        pools.add_row(
            str(p.get("name")),
            *(_size(p.get(k)) for k in ("total", "used", "available", "limit", "soft", "hard")),
            _size(p.get("committed")),
        )

    models = _table("loaded models")
    # The GPU column only where a GPU holds something (most machines have none).
    gpu = any(m.get("gpu") for m in data.get("models", []))
    names = ("MODEL", "KIND", "STATE", "SLOTS", "QUEUE", "ANON", "FILE", "GPU", "UNLOADS IN", "KV")
    cols = [c for c in names if gpu or c != "GPU"]
    for col in cols:
        if col == "MODEL":
            models.add_column(col, no_wrap=True, overflow="ellipsis", min_width=12)
        elif col == "KV":
            models.add_column(col, overflow="fold")
        else:
            models.add_column(col, no_wrap=True, justify="right" if col != "STATE" else "left")
    for m in data.get("models", []):
        cells = [
            str(m.get("id")) + (" (pinned)" if m.get("pinned") else ""),
            str(m.get("kind")),
            str(m.get("state")),
            f"{m.get('slots_busy', 0)}/{m.get('slots', 1)}",
            str(m.get("queue", 0)),
            _size(m.get("anonymous")),
            _size(m.get("file_backed")),
            *([_size(m.get("gpu"))] if gpu else []),
            _countdown(m),
            _kv(m.get("kv")),
        ]
        models.add_row(*cells)
    if not data.get("models"):
        models.add_row("no models loaded", *([""] * (len(cols) - 1)))

    events = _table("recent events")
    events.show_header = False
    events.add_column("TIME", no_wrap=True)
    events.add_column("KIND", no_wrap=True)
    events.add_column("WHAT", ratio=1, overflow="fold")
    for e in data.get("events", [])[-8:]:
        kind = str(e.get("kind"))
        events.add_row(
            datetime.fromtimestamp(float(e.get("wall", 0))).strftime("%H:%M:%S"),
            Text(kind, style=_KIND_STYLE.get(kind, "")),
            str(e.get("message", "")),
        )
    return Group(head, pools, models, events)


def watch(
    fetch: Callable[[], dict[str, Any] | None],
    *,
    interval: float = 1.0,
    as_json: bool = False,
    count: int | None = None,
    console: Console | None = None,
) -> int:
    """Poll ``fetch`` every ``interval`` seconds and redraw (or print one JSON line per poll
    with ``as_json``); ``count`` stops after that many polls (tests). Ctrl-C ends it."""
    polls = 0
    try:
        if as_json:
            while count is None or polls < count:
                data = fetch()
                if data is None:
                    return 1
                sys.stdout.write(json.dumps(data, separators=(",", ":")) + "\n")
                sys.stdout.flush()
                polls += 1
                if count is None or polls < count:
                    time.sleep(interval)
            return 0
        data = fetch()
        if data is None:
            return 1
        with Live(render(data), console=console, refresh_per_second=4, screen=False) as live:
            polls = 1
            while count is None or polls < count:
                time.sleep(interval)
                data = fetch()
                if data is None:
                    return 1
                live.update(render(data))
                polls += 1
    except KeyboardInterrupt:
        return 0
    return 0
