"""elbowroom against an earlier elbowroom on the arena's work: the same cells, elbowroom only,
the two versions interleaved seed by seed (the order alternates), one run.

    sudo .venv/bin/python benchmarks/arena_ab.py --base 6d79eae [--cells L/work,S/work]
        [--seeds 1,2,3,4,5,6] [--out benchmarks/results/arena_ab]

The base version is a ``git worktree`` of ``--base`` in a temporary folder; its
``benchmarks/arena.py`` runs from there with that folder first on ``PYTHONPATH`` (the
server it starts imports the base's ``elbowroom``), under this checkout's interpreter and
installed packages. Each (seed, version) is one ``arena.py --systems elbowroom`` run: a
warm-up for the footprints, then the cells (benchmarks/arena.py, docs/arena.md).

Writes ``OUT.json`` (every cell of every run) and ``OUT.md``: medians over seeds with
ranges per version and cell, and the new/base ratio of each seed's cell (paired: the two
runs of a seed were back to back).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
RESULTS = ROOT / "benchmarks" / "results"
METRICS = (  # (key, label, digits)
    ("ttft_p50", "first token p50 s", 2),
    ("ttft_p95", "p95 s", 2),
    ("switch_ttft_p50", "after a switch p50 s", 2),
    ("tok_s", "tok/s", 2),
    ("wall_s", "wall s", 1),
)


def run_arena(
    checkout: Path, cells: str, seed: int, out: Path, logs: Path, base: bool
) -> list[dict[str, Any]]:
    env = dict(os.environ)
    if base:
        env["PYTHONPATH"] = str(checkout)
    cmd = [sys.executable, "benchmarks/arena.py", "--cells", cells, "--systems", "elbowroom"]
    cmd += ["--seeds", str(seed), "--out", str(out), "--logs", str(logs)]
    done = subprocess.run(cmd, cwd=checkout, env=env, capture_output=True, text=True)
    if done.returncode != 0:
        raise SystemExit(
            f"arena.py failed ({checkout}):\n{done.stdout[-2000:]}{done.stderr[-2000:]}"
        )
    cells_out: list[dict[str, Any]] = json.loads(out.with_suffix(".json").read_text())["cells"]
    return cells_out


def _med(values: list[float], digits: int) -> str:
    if not values:
        return "–"
    mid, low, high = statistics.median(values), min(values), max(values)
    return f"{mid:.{digits}f} ({low:.{digits}f}–{high:.{digits}f})"


def report(rows: list[dict[str, Any]], base: str, head: str, meta: dict[str, Any]) -> str:
    cells = sorted({(r["size"], r["phase"]) for r in rows})
    lines = [
        f"# Arena A/B: elbowroom {head} against {base}",
        "",
        f"Recorded {meta['recorded']} on {os.cpu_count()} cores. Command: `{meta['command']}`. "
        "Each seed ran both versions back to back (order alternating); every cell is "
        "benchmarks/arena.py's, elbowroom only. Medians over seeds (min–max); load: the "
        "1-minute load average before each cell.",
        "",
        "| cell | version | seeds | served | failed | OOM kills | "
        + " | ".join(label for _, label, _ in METRICS)
        + " | load |",
        "|---|---|---|---|---|---|" + "---|" * len(METRICS) + "---|",
    ]
    for size, phase in cells:
        for version in ("base", "new"):
            cs = [
                r for r in rows if (r["size"], r["phase"], r["version"]) == (size, phase, version)
            ]
            vals = " | ".join(
                _med([c[k] for c in cs if c[k] is not None], d) for k, _, d in METRICS
            )
            lines.append(
                f"| {size}/{phase} | {base if version == 'base' else head} | {len(cs)} | "
                f"{sum(c['served'] for c in cs)}/{sum(c['requests'] for c in cs)} | "
                f"{sum(c['failed'] for c in cs)} | {sum(c['oom_kills'] for c in cs)} | {vals} | "
                f"{_med([c['load_before'] for c in cs], 1)} |"
            )
    lines += ["", "New / base, per seed (paired), and the median:", ""]
    lines += ["| cell | " + " | ".join(label for _, label, _ in METRICS) + " |"]
    lines += ["|---|" + "---|" * len(METRICS)]
    for size, phase in cells:
        by = {
            (r["version"], r["seed"]): r for r in rows if (r["size"], r["phase"]) == (size, phase)
        }
        seeds = sorted({s for v, s in by if v == "new"} & {s for v, s in by if v == "base"})
        parts = []
        for key, _, _ in METRICS:
            ratios = [
                by[("new", s)][key] / by[("base", s)][key]
                for s in seeds
                if by[("new", s)][key] and by[("base", s)][key]
            ]
            parts.append(
                f"{statistics.median(ratios):.2f}× ({', '.join(f'{x:.2f}' for x in ratios)})"
                if ratios
                else "–"
            )
        lines.append(f"| {size}/{phase} | " + " | ".join(parts) + " |")
    return "\n".join(lines) + "\n"


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    ap.add_argument("--base", required=True, help="the earlier version (a git revision)")
    ap.add_argument("--cells", default="L/work,S/work")
    ap.add_argument("--seeds", default="1,2,3,4,5,6")
    ap.add_argument("--out", type=Path, default=RESULTS / "arena_ab")
    ap.add_argument("--json", action="store_true", help="print every cell as JSON")
    args = ap.parse_args()
    head = subprocess.run(
        ["git", "rev-parse", "--short", "HEAD"],
        cwd=ROOT,
        capture_output=True,
        text=True,
        check=True,
    ).stdout.strip()
    work = Path(tempfile.mkdtemp(prefix="arena-ab-"))
    base_tree = work / "base"
    subprocess.run(
        ["git", "worktree", "add", "--detach", str(base_tree), args.base],
        cwd=ROOT,
        check=True,
        capture_output=True,
    )
    rows: list[dict[str, Any]] = []
    try:
        for i, seed in enumerate(int(s) for s in args.seeds.split(",")):
            for version in ("base", "new") if i % 2 == 0 else ("new", "base"):
                tree = base_tree if version == "base" else ROOT
                print(f"seed {seed} {version}: load {os.getloadavg()[0]:.1f}", flush=True)
                out = work / f"{version}-{seed}"
                cells = run_arena(
                    tree, args.cells, seed, out, work / f"logs-{out.name}", version == "base"
                )
                for cell in cells:
                    cell.pop("records", None)
                    rows.append({**cell, "version": version})
    finally:
        subprocess.run(
            ["git", "worktree", "remove", "--force", str(base_tree)], cwd=ROOT, check=False
        )
    meta = {
        "recorded": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()),
        "command": "benchmarks/arena_ab.py " + " ".join(sys.argv[1:]),
        "base": args.base,
        "head": head,
        "logs": str(work),
    }
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.with_suffix(".json").write_text(json.dumps({"meta": meta, "cells": rows}, indent=1))
    text = report(rows, args.base, head, meta)
    args.out.with_suffix(".md").write_text(text)
    print(json.dumps(rows, indent=1) if args.json else text)


if __name__ == "__main__":
    main()
