"""`elbowroom memory`: the machine's memory as elbowroom sees it, and the budget it would use.

Standalone, so "ours" is 0: this is the budget a server starting now would have before
loading anything (a running server shows its own numbers at /api/memory).
"""

from __future__ import annotations

import argparse
import json
import os
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
    p.add_argument(
        "--url",
        default=None,
        help="ask the running server there instead (GET /api/memory): its own numbers, and "
        "over a cluster every node's and their totals",
    )
    p.add_argument(
        "--api-key",
        default=os.environ.get("ELBOWROOM_ADMIN_KEY") or os.environ.get("ELBOWROOM_API_KEY"),
        help="with --url: the admin key, if the server has one",
    )
    p.set_defaults(func=cmd_memory)


def cmd_memory(args: argparse.Namespace) -> int:
    if args.url is not None:
        return _from_server(args)
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


# ---------------------------------------------------------------- a running server


def _from_server(args: argparse.Namespace) -> int:
    from elbowroom.cli.server import _call

    if args.watch is not None:
        print("elbowroom: --watch reads this machine; with --url use `elbowroom ps --watch`",
              file=sys.stderr)  # fmt: skip
        return 2
    report = _call(args, "GET", "/api/memory")
    if report is None:
        return 1
    if args.json:
        print_json(report)
    else:
        print(render_report(report, args.url))
    return 0


def render_report(report: dict[str, Any], url: str) -> str:
    """A running server's ``/api/memory``: this machine's budget, or over a cluster one row
    per node and the totals, each labelled."""
    if report.get("cluster"):
        return _cluster_text(report, url)
    limit: dict[str, Any] = report.get("limit") or {}
    value = int(limit.get("value") or 0) or 1
    ceiling = int(report.get("ceiling") or 0)
    lines = [
        f"server {url}: one machine (these numbers are this machine's)",
        f"limit      {fs(limit.get('value'))} ({limit.get('winner')}, {limit.get('rule')} rule)",
        f"ceiling    {fs(ceiling)} ({ceiling / value:.0%} of the limit: loads stop here)",
        f"committed  {fs(report.get('committed'))} by models, "
        f"{fs(report.get('server_usage'))} by the server itself",
        f"available  {fs(report.get('available'))} under the ceiling",
        f"ours       {fs(report.get('own_usage'))} (models and server, measured)",
        f"pressure: {report.get('pressure')}",
        *(f"  - {why}" for why in report.get("pressure_reasons") or ()),
    ]
    return "\n".join(lines)


def _cluster_text(report: dict[str, Any], url: str) -> str:
    from elbowroom.cli.server import cluster_pressure_text

    totals: dict[str, Any] = report.get("totals") or {}
    rows = []
    for n in report.get("nodes") or ():
        if not n.get("alive"):
            gone = [n.get("name"), "gone", "-", "-", "-", "-", "-"]
            rows.append([*gone, n.get("gone_cause") or "-"])
            continue
        limit = n.get("limit") or {}
        rows.append(
            [
                n.get("name"),
                n.get("pressure") or "-",
                f"{fs(limit.get('value'))} ({limit.get('winner')})",
                fs(n.get("ceiling")),
                fs(n.get("committed")),
                fs(n.get("available")),
                fs(n.get("own_usage")),
                "; ".join(n.get("pressure_reasons") or ()) or "-",
            ]
        )
    headers = ["NODE", "PRESSURE", "LIMIT", "CEILING", "COMMITTED", "FREE", "OURS", "WHY"]
    worst = report.get("worst_node")
    return "\n".join(
        [
            f"server {url}: a cluster of {totals.get('nodes', 0)} live nodes "
            "(each row is one node's own numbers)",
            table(headers, rows),
            "",
            f"cluster total over {totals.get('nodes', 0)} nodes (sums of the rows above): "
            f"limit {fs(totals.get('limit'))}, ceiling {fs(totals.get('ceiling'))}, "
            f"committed {fs(totals.get('committed'))}, free {fs(totals.get('available'))}",
            f"cluster {cluster_pressure_text(report.get('pressure'), worst)}",
        ]
    )
