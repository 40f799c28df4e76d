"""A stream dropped without closing, then the same prefix again (issue 21, item 6).

The sequence, with the official openai client, each round on a prefix of its own (~2,400
SmolLM2 tokens: benchmarks/kv_cache.py's agent prefix under a per-round first line):

1. stream a step over the prefix, read it to its first token and ``return`` from the loop
   (neither closed nor read on: the connection stays open) — its time to first token is
   this round's **cold** prefill of the prefix;
2. an unrelated short request;
3. the same prefix with another question (non-streamed, 8 tokens, greedy) — **hit**: its
   whole time, and the ``cached_tokens`` it reports.

A round counts as a hit when step 3 reused the prefix (cached_tokens within two blocks of
its prompt). Ratio = cold / hit per round. Step 3 waits for the slot that holds the prefix
while the dropped stream's answer runs on (llama_slots.Slots.acquire), so its time includes
that answer's remaining tokens. Medians with min-max, the load average before each round.

The baseline, in the same run: a second server whose runners never wait for a busy slot
(``llama_slots.MIN_WAIT_CHARS`` set out of reach through a ``sitecustomize`` on its
``PYTHONPATH``: the code before the wait). Rounds alternate between the two servers (which
goes first alternates too), and each round starts once both servers' earlier answers
have ended (ps ``busy`` 0), so one's dropped answer does not slow the other's round.

    .venv/bin/python benchmarks/dropped_stream.py [--rounds 10]

Writes benchmarks/results/dropped_stream.{md,json}.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO / "tests" / "e2e"))
sys.path.insert(0, str(REPO / "benchmarks"))

from kv_cache import OTHER, PREFIX  # noqa: E402
from serverproc import ServerProcess  # noqa: E402

MODEL = "smollm2-135m"
BLOCK = 64


def messages(i: int, question: str) -> list[dict[str, str]]:
    return [
        {"role": "system", "content": f"Site {i} of the warehouse network.\n{PREFIX}"},
        {"role": "user", "content": question},
    ]


def dropped(client: Any, i: int) -> float:
    """The issue's client: first token, then ``return`` inside the loop. Its TTFT."""
    start = time.perf_counter()
    stream = client.chat.completions.create(
        model=MODEL, messages=messages(i, f"Order {i * 7} arrived. Next action?"), stream=True
    )
    for chunk in stream:
        if chunk.choices and chunk.choices[0].delta.content:
            return time.perf_counter() - start
    return time.perf_counter() - start


def timed(server: ServerProcess, msgs: list[dict[str, str]]) -> tuple[float, int, int]:
    start = time.perf_counter()
    out = server.openai(timeout=900).chat.completions.create(
        model=MODEL,
        messages=msgs,  # type: ignore[arg-type]
        max_tokens=8,
        temperature=0,
    )
    seconds = time.perf_counter() - start
    usage = out.usage
    assert usage is not None and usage.prompt_tokens_details is not None
    return seconds, usage.prompt_tokens, usage.prompt_tokens_details.cached_tokens or 0


def load_avg() -> str:
    return " ".join(f"{x:.2f}" for x in os.getloadavg())


def summary(values: list[float], unit: str = "s") -> str:
    lo, mid, hi = min(values), statistics.median(values), max(values)
    if unit == "x":
        return f"{mid:.2f}x ({lo:.2f}–{hi:.2f})"
    return f"{mid:.2f} s ({lo:.2f}–{hi:.2f})"


NO_WAIT = (
    "import elbowroom.engines.llama_slots as s\n"
    "s.MIN_WAIT_CHARS = 1 << 60  # the baseline: never wait for a busy slot\n"
)


def idle(server: ServerProcess, deadline_s: float = 600.0) -> None:
    """Until no request runs on ``server`` (a dropped answer has ended)."""
    end = time.monotonic() + deadline_s
    while any(r.get("busy") for r in server.ps()) and time.monotonic() < end:
        time.sleep(0.5)


def one_round(server: ServerProcess, i: int, variant: str, kept: list[Any]) -> dict[str, Any]:
    load = load_avg()
    client = server.openai(timeout=900)
    kept.append(client)  # the dropped streams' clients stay alive, as in the issue
    cold = dropped(client, i)
    timed(server, OTHER)  # type: ignore[arg-type]
    hit, n_prompt, cached = timed(server, messages(i, "Which aisle for item 12?"))
    return {
        "variant": variant,
        "round": i,
        "cold_ttft": cold,
        "hit": hit,
        "ratio": cold / hit,
        "prompt_tokens": n_prompt,
        "cached_tokens": cached,
        "reused": cached >= n_prompt - 2 * BLOCK,
        "load_before": load,
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=10)
    args = parser.parse_args()
    patch = Path(tempfile.mkdtemp(prefix="dropped-stream-nowait-"))
    (patch / "sitecustomize.py").write_text(NO_WAIT)
    env = {"ELBOWROOM_THREADS": "2"}
    servers: dict[str, ServerProcess] = {}
    rows: list[dict[str, Any]] = []
    kept: list[Any] = []
    try:
        for variant, extra in (("wait", {}), ("baseline", {"PYTHONPATH": str(patch)})):
            home = Path(tempfile.mkdtemp(prefix=f"dropped-stream-{variant}-"))
            started = ServerProcess(home, "--preload", MODEL, env={**env, **extra}).start()
            servers[variant] = started
            timed(started, messages(-1, "Warm-up: which aisle for item 3?"))
        for i in range(args.rounds):
            order = ["wait", "baseline"] if i % 2 == 0 else ["baseline", "wait"]
            for variant in order:
                for s in servers.values():
                    idle(s)
                # Each variant gets prefixes of its own: no state of one helps the other.
                n = i if variant == "wait" else 1000 + i
                row = one_round(servers[variant], n, variant, kept)
                rows.append(row)
                print(json.dumps(row), flush=True)
    finally:
        for s in servers.values():
            s.stop()
    write(rows)


def variant_lines(rows: list[dict[str, Any]], name: str) -> list[str]:
    reused = sum(r["reused"] for r in rows)
    fast = sum(r["reused"] and r["ratio"] >= 30 for r in rows)
    return [
        f"| {name}: cold (the dropped stream's first token) | "
        f"{summary([r['cold_ttft'] for r in rows])} |",
        f"| {name}: hit (the same prefix after the drop) | {summary([r['hit'] for r in rows])} |",
        f"| {name}: cold / hit | {summary([r['ratio'] for r in rows], 'x')} |",
        f"| {name}: prefix reused / ≥ 30x faster than cold | {reused} of {len(rows)} / "
        f"{fast} of {len(rows)} |",
    ]


def write(rows: list[dict[str, Any]]) -> None:
    out = REPO / "benchmarks" / "results"
    loads = [float(r["load_before"].split()[0]) for r in rows]
    lines = [
        "# A stream dropped without closing, then the same prefix (issue 21, item 6)",
        "",
        f"SmolLM2-135M, 4 slots, 2 threads; {len(rows) // 2} interleaved rounds per variant, "
        "each on a prefix of its own "
        f"(~{statistics.median(r['prompt_tokens'] for r in rows):.0f} tokens). Machine: "
        f"{platform.machine()}, {os.cpu_count()} CPUs, shared with other work (load average "
        f"before each round in the JSON); {time.strftime('%Y-%m-%d %H:%M')}.",
        "",
        f"1-minute load average before the rounds: median {statistics.median(loads):.2f} "
        f"({min(loads):.2f}–{max(loads):.2f}).",
        "",
        "| measure | median (min–max) |",
        "|---|---:|",
        *variant_lines([r for r in rows if r["variant"] == "wait"], "this code"),
        *variant_lines([r for r in rows if r["variant"] == "baseline"], "baseline (no wait)"),
        "",
        "Reused: cached_tokens within two blocks of the prompt. The hit of *this code* waits "
        "for the dropped stream's answer to end (the slot that holds the prefix is busy until "
        "then), at most the estimated recompute time, so its time is that answer's remaining "
        "tokens plus the short prefill.",
    ]
    (out / "dropped_stream.md").write_text("\n".join(lines) + "\n")
    (out / "dropped_stream.json").write_text(json.dumps(rows, indent=1) + "\n")
    print("\n".join(lines))


if __name__ == "__main__":
    main()
