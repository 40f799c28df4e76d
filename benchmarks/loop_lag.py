"""The server's event-loop stalls during hostile.py's integer-body attack, and collections.

Starts `elbowroom serve` as benchmarks/hostile.py does, with a probe loaded into the server
process (a ``sitecustomize`` module put on its PYTHONPATH; it acts only in the process whose
argv has ``serve``, not in runners): a callback on the server's event loop every 5 ms records
how late it ran (the loop's lag: /health waits at least that long), and ``gc.callbacks``
records how long each garbage collection held the interpreter. Then runs the attack (four
32 MB bodies of 4,299-digit integers) ``--rounds`` times with /health polled as hostile.py
does, and reports per round: /health p99, the loop's longest lag and its lags over 20 ms
inside the attack, and collections over 5 ms inside it. Lags outside the attack (startup,
the first chat's imports) are left out. ``time.perf_counter`` is CLOCK_MONOTONIC, shared by
the server's process and this one.

    python benchmarks/loop_lag.py --rounds 5   # writes results/loop_lag.{json,md}
    # the server without its gc.freeze() of startup's objects, for comparison:
    python benchmarks/loop_lag.py --rounds 5 --no-freeze --out loop_lag_no_freeze
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
import time
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).parent))
import hostile  # the server start, the /health probe and the attack

RESULTS = Path(__file__).with_name("results")

PROBE = """
import os, sys
if os.environ.get("LOOP_LAG_OUT") and "serve" in sys.argv:
    import asyncio.runners, atexit, gc, json, time
    lags, collections, started = [], [], {}

    def tick(loop, due):
        now = time.perf_counter()
        lags.append((now, now - due))
        loop.call_later(0.005, tick, loop, time.perf_counter() + 0.005)

    lazy_init = asyncio.runners.Runner._lazy_init
    def init(self):  # the server's loop, as asyncio.Runner makes it (called more than once)
        lazy_init(self)
        if not started.get("ticking"):
            started["ticking"] = True
            self._loop.call_soon(tick, self._loop, time.perf_counter())
    asyncio.runners.Runner._lazy_init = init
    if os.environ.get("LOOP_LAG_NO_FREEZE"):
        gc.freeze = lambda: None  # the server as it was: startup's objects left to gc

    def on_gc(phase, info):
        if phase == "start":
            started["t"] = time.perf_counter()
        elif "t" in started:
            now = time.perf_counter()
            collections.append((now, info["generation"], now - started.pop("t")))
    gc.callbacks.append(on_gc)

    def dump():
        with open(os.environ["LOOP_LAG_OUT"], "w") as f:
            json.dump({"lags": list(lags), "collections": list(collections)}, f)
    atexit.register(dump)
"""


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--out", default="loop_lag")
    parser.add_argument("--no-freeze", action="store_true", help="the server without gc.freeze")
    args = parser.parse_args()
    if args.no_freeze:
        os.environ["LOOP_LAG_NO_FREEZE"] = "1"
    home = Path(tempfile.mkdtemp(prefix="loop-lag-bench-"))
    (home / "probe").mkdir()
    (home / "probe" / "sitecustomize.py").write_text(PROBE)
    dump = home / "lags.json"
    os.environ["PYTHONPATH"] = os.pathsep.join(
        [str(home / "probe"), *filter(None, [os.environ.get("PYTHONPATH")])]
    )
    os.environ["LOOP_LAG_OUT"] = str(dump)
    server, url = hostile.start_server(home)
    rounds: list[dict[str, Any]] = []
    try:
        hostile.chat(url, {}, 2)  # load the model (and import what a first chat imports)
        for _ in range(args.rounds):
            load = os.getloadavg()[0]
            began = time.perf_counter()
            with hostile.Probe(url) as probe:
                outcome = hostile.attack_integers(url)
            rounds.append(
                {
                    "window": (began, time.perf_counter()),
                    "load_1m": load,
                    "health_p99": hostile.p99(probe.latencies),
                    "health_n": len(probe.latencies),
                    "outcome": outcome,
                }
            )
    finally:
        server.terminate()
        server.wait(timeout=60)
    seen = json.loads(dump.read_text())
    for row in rounds:
        start, end = row["window"]
        lags = [lag for t, lag in seen["lags"] if start <= t <= end]
        row["lag_max"] = max(lags, default=0.0)
        row["lags_over_20ms"] = sorted(round(lag * 1000, 1) for lag in lags if lag > 0.02)
        row["gc_over_5ms"] = [
            (generation, round(took * 1000, 1))
            for t, generation, took in seen["collections"]
            if start <= t <= end and took > 0.005
        ]
    loads = [r["load_1m"] for r in rounds]
    result = {
        "date": datetime.now(UTC).isoformat(timespec="seconds"),
        "cpus": os.cpu_count(),
        "rounds": rounds,
    }
    RESULTS.mkdir(exist_ok=True)
    (RESULTS / f"{args.out}.json").write_text(json.dumps(result, indent=2))
    lines = [
        "# The server's event loop during the integer-body attack (issue 28)",
        "",
        f"{result['date']}, {args.rounds} rounds, {os.cpu_count()} CPUs, 1-minute load average "
        f"median {statistics.median(loads):.2f} ({min(loads):.2f}-{max(loads):.2f}); a machine "
        "shared with other work. "
        f"`python benchmarks/loop_lag.py{' --no-freeze' if args.no_freeze else ''}`.",
        "",
        "| round | /health p99 ms | loop lag max ms | lags > 20 ms | collections > 5 ms "
        "(generation, ms) | outcome |",
        "|---|---|---|---|---|---|",
    ]
    for i, row in enumerate(rounds, 1):
        lines.append(
            f"| {i} | {row['health_p99'] * 1000:.1f} | {row['lag_max'] * 1000:.1f} | "
            f"{row['lags_over_20ms'] or '-'} | {row['gc_over_5ms'] or '-'} | {row['outcome']} |"
        )
    lines.append("")
    (RESULTS / f"{args.out}.md").write_text("\n".join(lines))
    print("\n".join(lines))


if __name__ == "__main__":
    main()
