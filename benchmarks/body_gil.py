"""How long the body gate holds the interpreter lock on a hostile body, in pieces or whole.

The body gate inspects bodies above 256 KiB in worker threads (server/http/limits.py); while
one C call (a translate, a replace, a decode) runs, no other thread of the server runs,
the event loop included. Four bodies of 32 MB of 4,299-digit integers (benchmarks/
hostile.py's attack) are inspected by four threads at once while a heartbeat thread
wakes every millisecond; the longest gap between its wake-ups is how long /health could
have waited on the lock. Interleaved: one call over each whole body in four threads (as
before), ``jsonscan.inspect`` (256 KiB pieces) in four threads, and in turn, as the gate
now runs it (one inspector thread, server/http/limits.py).

    python benchmarks/body_gil.py --rounds 7   # writes results/body_gil.{json,md}
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import statistics
import threading
import time
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

from elbowroom.server.http import jsonscan

RESULTS = Path(__file__).with_name("results")
BODY = b'{"model": "smollm2-135m", "seed": [' + b",".join([b"7" * 4299] * 7400) + b"]}"
LIMITS = jsonscan.Limits(100_000, 64, 100_000_000, 4096, 4, 256)


def whole_inspect(body: bytearray) -> None:
    """The gate before pieces: one translate over the body, json.loads decoding it whole."""
    text = body.translate(None, jsonscan._UNSEEN)
    list(jsonscan._TOKEN.finditer(text))
    json.loads(body, parse_int=jsonscan._int_parser(LIMITS.max_int_digits))


def pieces_inspect(body: bytearray) -> None:
    jsonscan.inspect(body, "/v1/chat/completions", LIMITS)


_ONE = threading.Lock()


def one_at_a_time(body: bytearray) -> None:
    """As the gate runs it: its one inspector thread takes the bodies in turn."""
    with _ONE:
        pieces_inspect(body)


def longest_gap(work: Any) -> float:
    bodies = [bytearray(BODY) for _ in range(4)]
    stop = threading.Event()
    gaps: list[float] = []

    def heartbeat() -> None:
        last = time.perf_counter()
        while not stop.is_set():
            time.sleep(0.001)
            now = time.perf_counter()
            gaps.append(now - last)
            last = now

    def run(body: bytearray) -> None:
        with contextlib.suppress(Exception):  # the 400 for the integers
            work(body)

    beat = threading.Thread(target=heartbeat)
    beat.start()
    time.sleep(0.05)
    workers = [threading.Thread(target=run, args=(b,)) for b in bodies]
    for w in workers:
        w.start()
    for w in workers:
        w.join()
    stop.set()
    beat.join()
    return max(gaps)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--rounds", type=int, default=7)
    args = ap.parse_args()
    ways = {
        "whole, 4 threads (before)": whole_inspect,
        "pieces, 4 threads": pieces_inspect,
        "pieces, one at a time (now)": one_at_a_time,
    }
    seen: dict[str, list[float]] = {k: [] for k in ways}
    loads = []
    for _ in range(args.rounds):
        loads.append(os.getloadavg()[0])
        for name, work in ways.items():
            seen[name].append(longest_gap(work) * 1000)
    med = {k: statistics.median(v) for k, v in seen.items()}
    result = {
        "date": datetime.now(UTC).isoformat(timespec="seconds"),
        "rounds": args.rounds,
        "cpus": os.cpu_count(),
        "loadavg_1m": {"median": statistics.median(loads), "min": min(loads), "max": max(loads)},
        "longest_gap_ms": seen,
    }
    RESULTS.mkdir(exist_ok=True)
    (RESULTS / "body_gil.json").write_text(json.dumps(result, indent=2))
    lines = [
        "# The body gate's longest hold of the interpreter lock (issue 28)",
        "",
        f"{result['date']}, {args.rounds} interleaved rounds, {os.cpu_count()} CPUs, 1-minute "
        f"load average median {statistics.median(loads):.2f} ({min(loads):.2f}-"
        f"{max(loads):.2f}); a machine shared with other work. `python benchmarks/body_gil.py`.",
        "",
        "Four 32 MB bodies of 4,299-digit integers inspected at once; the longest "
        "gap between a 1 ms heartbeat thread's wake-ups, ms:",
        "",
        "| body gate | longest gap ms (median, range) |",
        "|---|---|",
    ]
    for name, values in seen.items():
        lines.append(f"| {name} | {med[name]:.1f} ({min(values):.1f}-{max(values):.1f}) |")
    before, now = med["whole, 4 threads (before)"], med["pieces, one at a time (now)"]
    lines += ["", f"ratio now / before: {now / before:.2f}", ""]
    (RESULTS / "body_gil.md").write_text("\n".join(lines))
    print("\n".join(lines))


if __name__ == "__main__":
    main()
