"""What the load-time chat template check costs (models/template_check.py), beside what it
guards: a SmolLM2 load.

    .venv/bin/python benchmarks/template_check.py [--rounds 7]

Each round, interleaved: the template check of the bundled SmolLM2 with a fresh checker
(a child process rendering its template under the bounds; what the first load of a file
pays), the cached verdict (every later load), and a real SmolLM2 runner start to ready
(supervisor + llama.cpp, n_ctx 512) as the baseline. Medians with ranges, the load average,
the ratio check / load. Target: the check under 25 % of the load it guards.
Writes benchmarks/results/template_check.{json,md}.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import platform
import statistics
import sys
import time
from datetime import datetime
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))

from bundled_models import bundled_spec

from elbowroom.config import Settings
from elbowroom.engines.options import LlamaOptions
from elbowroom.models.template_check import TemplateChecker
from elbowroom.runtime.protocol import Runner
from elbowroom.runtime.supervisor import Supervisor

RESULTS = Path(__file__).parent / "results"
TARGET_RATIO = 0.25


def _load_seconds() -> float:
    spec = bundled_spec("smollm2-135m")

    def on_exit(runner: Runner, cause: str) -> None:
        pass

    async def once() -> float:
        sup = Supervisor(spec, on_exit, settings=Settings())
        started = time.monotonic()
        await sup.start(LlamaOptions(n_ctx=512, kv_cache=False))
        took = time.monotonic() - started
        await sup.stop(5.0)
        return took

    return asyncio.run(once())


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--rounds", type=int, default=7)
    args = ap.parse_args()
    path = bundled_spec("smollm2-135m").path
    check: list[float] = []
    cached: list[float] = []
    load: list[float] = []
    loadavg = []
    for _ in range(args.rounds):
        loadavg.append(os.getloadavg()[0])
        checker = TemplateChecker(3.0, 256 * 1024**2)
        t = time.monotonic()
        checker.check(path, "smollm2-135m")
        check.append(time.monotonic() - t)
        t = time.monotonic()
        checker.check(path, "smollm2-135m")
        cached.append(time.monotonic() - t)
        load.append(_load_seconds())

    def stat(xs: list[float]) -> dict[str, float]:
        return {"median": statistics.median(xs), "min": min(xs), "max": max(xs)}

    machine = f"{platform.machine()}, {os.cpu_count()} CPUs"
    result: dict[str, Any] = {
        "date": datetime.now().isoformat(timespec="seconds"),
        "machine": f"{machine}, Python {platform.python_version()}",
        "rounds": args.rounds,
        "loadavg_1m": stat(loadavg),
        "check_s": stat(check),
        "cached_s": stat(cached),
        "smollm2_load_s": stat(load),
        "ratio_check_to_load": statistics.median(check) / statistics.median(load),
    }
    result["met"] = result["ratio_check_to_load"] < TARGET_RATIO
    RESULTS.mkdir(exist_ok=True)
    (RESULTS / "template_check.json").write_text(json.dumps(result, indent=2) + "\n")

    def row(what: str, xs: dict[str, float], scale: float = 1.0, unit: str = "s") -> str:
        lo, mid, hi = xs["min"] * scale, xs["median"] * scale, xs["max"] * scale
        digits = 0 if unit == "µs" else 3
        return f"| {what} | {mid:.{digits}f} {unit} | {lo:.{digits}f}-{hi:.{digits}f} {unit} |"

    la = result["loadavg_1m"]
    verdict = "met" if result["met"] else "not met"
    lines = [
        "# The load-time chat template check: what it costs",
        "",
        f"`benchmarks/template_check.py`, {result['date']}, {result['machine']};",
        f"{args.rounds} interleaved rounds; 1-minute load average {la['median']:.1f}",
        f"({la['min']:.1f}-{la['max']:.1f}): a machine shared with other work.",
        "",
        "| what | median | range |",
        "|---|---:|---:|",
        row("the check, first time for a file (child process, one render)", result["check_s"]),
        row("the check, cached verdict (every later load)", result["cached_s"], 1e6, "µs"),
        row("baseline: a SmolLM2 runner start to ready", result["smollm2_load_s"]),
        "",
        f"Ratio check / load (medians): **{result['ratio_check_to_load']:.2f}**. Target: the",
        f"check under {TARGET_RATIO:.2f} of the load it guards: **{verdict}**.",
        "",
    ]
    md = "\n".join(lines)
    (RESULTS / "template_check.md").write_text(md)
    print(md)


if __name__ == "__main__":
    main()
