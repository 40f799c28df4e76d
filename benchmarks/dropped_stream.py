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


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=10)
    args = parser.parse_args()
    home = Path(tempfile.mkdtemp(prefix="dropped-stream-"))
    server = ServerProcess(home, "--preload", MODEL, env={"ELBOWROOM_THREADS": "2"}).start()
    rows: list[dict[str, Any]] = []
    kept = []  # the dropped streams' clients stay alive, as in the issue
    try:
        timed(server, messages(-1, "Warm-up: which aisle for item 3?"))
        for i in range(args.rounds):
            load = load_avg()
            client = server.openai(timeout=900)
            kept.append(client)
            cold = dropped(client, i)
            timed(server, OTHER)  # type: ignore[arg-type]
            hit, n_prompt, cached = timed(server, messages(i, "Which aisle for item 12?"))
            row = {
                "round": i,
                "cold_ttft": cold,
                "hit": hit,
                "ratio": cold / hit,
                "prompt_tokens": n_prompt,
                "cached_tokens": cached,
                "reused": cached >= n_prompt - 2 * BLOCK,
                "load_before": load,
            }
            rows.append(row)
            print(json.dumps(row), flush=True)
    finally:
        server.stop()
    write(rows)


def write(rows: list[dict[str, Any]]) -> None:
    out = REPO / "benchmarks" / "results"
    reused = sum(r["reused"] for r in rows)
    fast = sum(r["reused"] and r["ratio"] >= 30 for r in rows)
    lines = [
        "# A stream dropped without closing, then the same prefix (issue 21, item 6)",
        "",
        f"SmolLM2-135M, 4 slots, 2 threads; {len(rows)} rounds, each on a prefix of its own "
        f"(~{statistics.median(r['prompt_tokens'] for r in rows):.0f} tokens). Machine: "
        f"{platform.machine()}, {os.cpu_count()} CPUs, shared with other work (load average "
        f"before each round in the JSON); {time.strftime('%Y-%m-%d %H:%M')}.",
        "",
        "| measure | median (min–max) |",
        "|---|---:|",
        f"| cold: the dropped stream's first token | {summary([r['cold_ttft'] for r in rows])} |",
        f"| hit: the same prefix after the drop | {summary([r['hit'] for r in rows])} |",
        f"| cold / hit | {summary([r['ratio'] for r in rows], 'x')} |",
        "",
        f"The prefix was reused (cached_tokens within two blocks of the prompt) in "
        f"**{reused} of {len(rows)}** rounds; ≥ 30x faster than cold in **{fast} of "
        f"{len(rows)}**.",
        "",
        "The hit waits for the dropped stream's answer to end (the slot that holds the "
        "prefix is busy until then), so its time is that answer's remaining tokens plus "
        "the short prefill.",
    ]
    (out / "dropped_stream.md").write_text("\n".join(lines) + "\n")
    (out / "dropped_stream.json").write_text(json.dumps(rows, indent=1) + "\n")
    print("\n".join(lines))


if __name__ == "__main__":
    main()
