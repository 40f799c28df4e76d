"""An MLX model's memory after its runner stops: how long until it is really back.

mlx-knife's ADR-016 problem: in one long-lived process MLX frees lazily, so a model switch
can load the next model before the last one's memory is back. In elbowroom unloading is the
runner's exit. This measures, per round: the MLX runner's anonymous bytes before the stop,
the time from ``stop()`` to the process reaped (``Supervisor.stop``), and the time until the
host's MemAvailable shows 90 % of those bytes back (the scheduler's settle rule,
scheduler/settle.py), polled every 5 ms. The machine is shared: other processes allocate
meanwhile, so the settle time is an upper bound (a round that times out says so).

    .venv/bin/python benchmarks/mlx_switch.py [--rounds 5]

Writes benchmarks/results/mlx_switch.{json,md}.
"""

from __future__ import annotations

import argparse
import asyncio
import dataclasses
import json
import os
import platform
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))
sys.path.insert(0, str(Path(__file__).resolve().parent))

from mlx_decode import float32_copy
from mlx_models import smollm2_mlx

from elbowroom.config import Settings
from elbowroom.engines.requests import TextRequest
from elbowroom.models.catalog import _mlx_model
from elbowroom.models.estimate import footprint
from elbowroom.runtime.supervisor import Supervisor
from elbowroom.scheduler.policy import LoadRequest
from elbowroom.scheduler.sizing import Plan, start_options

RESULTS = Path(__file__).parent / "results"
MiB = 1024**2
TIMEOUT = 10.0


def available() -> int:
    with open("/proc/meminfo") as f:
        for line in f:
            if line.startswith("MemAvailable:"):
                return int(line.split()[1]) * 1024
    raise RuntimeError("no MemAvailable")


async def one_round(spec: Any) -> dict[str, Any]:
    settings = Settings(ctx=1024, kv_cache=False)
    fp = footprint(spec, 1024, 1)
    plan = Plan(LoadRequest(spec.id, fp.total), fp, 1024, "f16", 1)
    runner = Supervisor(spec, lambda *_: None, settings=settings)
    await runner.start(start_options(settings, spec, plan))
    req = TextRequest(kind="completion", prompt="Hello there", max_tokens=4, temperature=0)
    async for _ in runner.request("completion", req):
        pass
    held = runner.measure().anonymous
    before = available()
    t0 = time.perf_counter()
    await runner.stop(5.0)
    reaped = time.perf_counter() - t0
    target = before + int(held * 0.9)
    settled: float | None = None
    while time.perf_counter() - t0 < TIMEOUT:
        if available() >= target:
            settled = time.perf_counter() - t0
            break
        await asyncio.sleep(0.005)
    return {"anonymous": held, "reaped_s": reaped, "settled_s": settled}


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--rounds", type=int, default=5)
    args = ap.parse_args()
    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        folder = float32_copy(smollm2_mlx(Path(tmp) / "src"), Path(tmp) / "smollm2-mlx")
        spec = dataclasses.replace(_mlx_model(folder), id="smollm2-mlx")
        for i in range(args.rounds):
            row = asyncio.run(one_round(spec))
            row.update(round=i, loadavg=os.getloadavg()[0])
            rows.append(row)
            print(json.dumps(row), flush=True)
    reaped = [r["reaped_s"] * 1000 for r in rows]
    settled = [r["settled_s"] * 1000 for r in rows if r["settled_s"] is not None]
    meta = {
        "machine": f"{platform.machine()} {platform.system()}, {os.cpu_count()} cores (shared)",
        "rounds": args.rounds,
        "timeouts": sum(r["settled_s"] is None for r in rows),
    }
    RESULTS.mkdir(exist_ok=True)
    (RESULTS / "mlx_switch.json").write_text(json.dumps({"meta": meta, "rows": rows}, indent=1))

    def spread(xs: list[float]) -> str:
        if not xs:
            return "n/a"
        return f"{statistics.median(xs):.0f} ms ({min(xs):.0f}–{max(xs):.0f})"

    held = statistics.median(r["anonymous"] for r in rows) / MiB
    loads = ", ".join(f"{r['loadavg']:.1f}" for r in rows)
    lines = [
        "# MLX model switch: memory back after the runner stops",
        "",
        f"{meta['machine']}; SmolLM2-135M-Instruct as MLX (float32 scales), {held:.0f} MiB "
        f"anonymous in its runner; {args.rounds} rounds; `benchmarks/mlx_switch.py`. The "
        f"machine was shared with other work (load average per round {loads}).",
        "",
        "| | median (range) |",
        "|---|---:|",
        f"| stop → runner reaped | {spread(reaped)} |",
        f"| stop → 90 % of its anonymous bytes available again | {spread(settled)} |",
        "",
        f"Rounds where the memory did not show up within {TIMEOUT:.0f} s: {meta['timeouts']}.",
        "The scheduler waits for exactly this before it loads the next model",
        "(scheduler/settle.py), so a switch never sizes a load on memory not yet back.",
    ]
    (RESULTS / "mlx_switch.md").write_text("\n".join(lines) + "\n")
    print("\n".join(lines))


if __name__ == "__main__":
    main()
