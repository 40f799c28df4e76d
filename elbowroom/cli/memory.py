"""`elbowroom memory`: the machine's memory as elbowroom sees it, and the budget it would use.

Standalone, so "ours" is 0: this is the budget a server starting now would have before
loading anything (a running server shows its own numbers at /api/memory).
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from typing import Any

from elbowroom.cli.common import add_common, print_json, settings_from, table
from elbowroom.memory.monitor import Monitor, Sample
from elbowroom.memory.pools import Pool, pool_to_dict
from elbowroom.memory.probe import default_probe
from elbowroom.memory.types import Snapshot
from elbowroom.units import format_size as fs

_DEFAULT_INTERVAL = -1.0  # --watch without SECONDS: settings.monitor_interval


def register(sub: Any) -> None:
    p = sub.add_parser(
        "memory",
        help="show memory (host, cgroup, PSI, GPUs), the budget and the pressure level",
        description="Show the memory snapshot, the reserve rule (host, container or override), "
        "each budget limit candidate (the winner marked *), the load ceiling, the soft/hard "
        "thresholds and the pressure level.",
    )
    add_common(p)
    p.add_argument(
        "--watch",
        nargs="?",
        type=float,
        const=_DEFAULT_INTERVAL,
        default=None,
        metavar="SECONDS",
        help="print one line per sample until Ctrl-C (default every monitor_interval s)",
    )
    p.add_argument(
        "--count", type=int, default=None, metavar="N", help="with --watch: stop after N samples"
    )
    p.set_defaults(func=cmd_memory)


def cmd_memory(args: argparse.Namespace) -> int:
    settings = settings_from(args)
    watch: float | None = args.watch
    if watch is not None and watch != _DEFAULT_INTERVAL and watch <= 0:
        print("elbowroom: --watch SECONDS must be > 0", file=sys.stderr)
        return 2
    if args.count is not None and args.count < 1:
        print("elbowroom: --count must be >= 1", file=sys.stderr)
        return 2
    interval = settings.monitor_interval if watch == _DEFAULT_INTERVAL else watch
    # No server asked: nothing is ours; the budget is the one a server starting now has.
    monitor = Monitor.from_settings(
        settings,
        default_probe(settings),
        own_usage=lambda: 0,
        interval=interval or settings.monitor_interval,
        history_seconds=0,
    )
    try:
        if interval is None:
            sample = monitor.sample_now()
            pools = sample.pools
            if args.json:
                print_json({**sample.to_dict(), "pools": [pool_to_dict(p) for p in pools]})
            else:
                print(render(sample, pools))
            return 0
        return _watch(monitor, interval, args.count, as_json=args.json)
    except OSError as exc:
        print(f"elbowroom: cannot read memory: {exc}", file=sys.stderr)
        return 1


def _watch(monitor: Monitor, interval: float, count: int | None, *, as_json: bool) -> int:
    taken = 0
    try:
        while count is None or taken < count:
            sample = monitor.sample_now()
            if as_json:
                print(json.dumps(sample.to_dict()))  # one JSON object per line
            else:
                if taken % 20 == 0:
                    print(WATCH_HEADER)
                print(watch_line(sample))
            sys.stdout.flush()
            taken += 1
            if count is None or taken < count:
                time.sleep(interval)  # the pace of a live view, not synchronisation
    except KeyboardInterrupt:
        pass  # Ctrl-C is how a watch ends
    return 0


# ---------------------------------------------------------------- rendering


def _snapshot_lines(snap: Snapshot) -> list[str]:
    sizes = table(
        ["memory", "effective", "host"],
        [
            ["total", fs(snap.total), fs(snap.host_total)],
            ["available", fs(snap.available), fs(snap.host_available)],
            ["used", fs(snap.used), fs(snap.host_total - snap.host_available)],
        ],
    )
    facts: list[tuple[str, str]] = [
        ("platform", snap.platform),
        ("swap", f"{fs(snap.swap_used)} used of {fs(snap.swap_total)}"),
    ]
    if snap.cgroup_version is not None:
        limit = fs(snap.cgroup_limit) if snap.cgroup_limit is not None else "unlimited"
        facts.append(
            ("cgroup", f"v{snap.cgroup_version}, limit {limit}, usage {fs(snap.cgroup_usage)}")
        )
    else:
        facts.append(("cgroup", "none found"))
    facts.append(("override", fs(snap.override) if snap.override is not None else "not set"))
    if snap.psi is not None:
        p = snap.psi
        facts.append(
            (
                "PSI (avg10/avg60)",
                f"some {p.some_avg10:.2f}/{p.some_avg60:.2f}%  "
                f"full {p.full_avg10:.2f}/{p.full_avg60:.2f}%",
            )
        )
    else:
        facts.append(("PSI", "not available"))
    if snap.os_pressure is not None:
        facts.append(("macOS pressure", snap.os_pressure))
    if snap.gpu_working_set is not None:
        facts.append(("Metal working set", fs(snap.gpu_working_set)))
    for g in snap.gpus:
        facts.append(
            (f"GPU {g.index}", f"{g.name}: {fs(g.used)} used of {fs(g.total)}, {fs(g.free)} free")
        )
    if not snap.gpus:
        facts.append(("GPUs", "none (NVML found no NVIDIA GPU)"))
    width = max(len(k) for k, _ in facts)
    return [sizes, "", *(f"{k.ljust(width)}  {v}" for k, v in facts)]


def render(sample: Sample, pools: tuple[Pool, ...] = ()) -> str:
    """The people view of one sample: snapshot, candidates, thresholds, level, pools."""
    limit = sample.limit
    rows = [
        ["*" if c.name == limit.winner else "", c.name, fs(c.value), c.why]
        for c in limit.candidates
    ]
    value = limit.value or 1
    lines = [
        *_snapshot_lines(sample.snapshot),
        "",
        f"Budget (ours: {fs(sample.own_usage)}; the smallest candidate wins)",
        f"rule: {limit.rule} ({limit.rule_why})",
        table(["", "candidate", "limit", "why"], rows),
        "",
        f"limit    {fs(limit.value)} ({limit.winner})",
        f"ceiling  {fs(limit.ceiling)} ({limit.ceiling / value:.0%} of the limit: loads stop here)",
        f"soft     {fs(limit.soft)} ({limit.soft / value:.0%} of the limit)",
        f"hard     {fs(limit.hard)} ({limit.hard / value:.0%} of the limit)",
        f"pressure: {sample.level.label}",
        *(f"  - {why}" for why in sample.reasons),
    ]
    if pools:
        lines += ["", *pool_lines(pools)]
    return "\n".join(lines)


def pool_lines(pools: tuple[Pool, ...]) -> list[str]:
    """One row per pool (host RAM or unified memory, each NVIDIA GPU), then each GPU's
    limit candidates: every pool is budgeted on its own (docs/gpu.md)."""
    rows = [
        [
            p.name,
            p.label,
            fs(p.total),
            fs(p.free),
            fs(p.ours),
            fs(p.others),
            fs(p.reserve),
            f"{fs(p.limit.value)} ({p.limit.winner})",
            fs(p.ceiling),
        ]
        for p in pools
    ]
    headers = ["pool", "what", "total", "free", "ours", "others", "reserve", "limit", "ceiling"]
    lines = ["Pools (loads are admitted up to each pool's ceiling, its soft threshold)"]
    lines.append(table(headers, rows))
    for p in pools:
        if p.kind != "gpu":
            continue
        marks = [
            ["*" if c.name == p.limit.winner else "", c.name, fs(c.value), c.why]
            for c in p.limit.candidates
        ]
        lines += ["", f"{p.name} limit candidates", table(["", "candidate", "limit", "why"], marks)]
    return lines


WATCH_HEADER = (
    f"{'time':<8}  {'available':>10}  {'used':>10}  {'cgroup use':>10}  {'psi10':>6}  "
    f"{'limit':>10}  {'winner':<15}  level"
)


def watch_line(sample: Sample) -> str:
    snap = sample.snapshot
    psi = f"{snap.psi.some_avg10:.2f}" if snap.psi is not None else "-"
    clock = time.strftime("%H:%M:%S", time.localtime(sample.wall))
    return (
        f"{clock:<8}  {fs(snap.available):>10}  {fs(snap.used):>10}  "
        f"{fs(snap.cgroup_usage):>10}  {psi:>6}  {fs(sample.limit.value):>10}  "
        f"{sample.limit.winner:<15}  {sample.level.label}"
    )
