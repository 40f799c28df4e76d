"""A stream dropped without closing, then the same prefix again (issue 21, item 6).

The sequence, with the official openai client, each round on a prefix of its own (~1,830
SmolLM2 tokens, the issue's size: benchmarks/kv_cache.py's agent prefix cut to 46 rules,
under a per-round first line):

1. stream a step over the prefix (no ``max_tokens``, the engine's default sampling, as the
   issue's client), read it to its first token and ``return`` from the loop (neither closed
   nor read on: the connection stays open) — its time to first token is this round's
   **cold** prefill of the prefix;
2. an unrelated short request;
3. the same prefix with another question (streamed, 8 tokens, greedy) — **hit**: its time
   to first token (the prefill the cache saves, as cold is) and its whole time, and the
   ``cached_tokens`` it reports.

A round counts as a hit when step 3 reused the prefix (cached_tokens within two blocks of
its prompt). Ratio = cold / hit per round. With preemption (server/stream/resume.py) step 3 ends
the dropped answer's generation, takes its slot and the answer resumes on another slot;
the resumed stream's stall (preemption to its next token) is read from the server log.
Medians with min-max, the load average before each round.

The baseline, in the same run: a second server with ``ELBOWROOM_KV_PREEMPT=false`` (the
code before preemption: step 3 waits for the busy slot at most the estimated recompute
time, then recomputes). Rounds alternate between the two servers (which goes first
alternates too). At the end of a round its dropped stream is closed (its client's garbage
collector would, later), and the next round starts once both servers are idle (ps
``busy`` 0), so one's dropped answer does not slow the other's round.

    .venv/bin/python benchmarks/dropped_stream.py [--rounds 10]

Writes benchmarks/results/dropped_stream.{md,json}.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import re
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO / "tests" / "e2e"))
sys.path.insert(0, str(REPO / "benchmarks"))

from kv_cache import OTHER  # noqa: E402
from serverproc import ServerProcess  # noqa: E402

MODEL = "smollm2-135m"
BLOCK = 64
RULES = 46  # ~1,830 tokens with the chat template, the prefix
PREFIX = (
    "You are an agent that operates a warehouse system. You can call tools by writing a "
    "line that starts with CALL. Rules follow.\n"
    + "".join(
        f"Rule {i}: when an order for item {i} arrives, check shelf {i % 17}, confirm the "
        f"count with the inventory tool, and report the aisle number {i % 23} briefly.\n"
        for i in range(RULES)
    )
)
STALL = re.compile(r"resumed a preempted stream .*: stalled ([0-9.]+) s")
# The runner's log of a preemption (engines/llama.py): the cancel and the slot save, from
# the preempted ticket's close to the saved state (the waiting request takes the slot next).
SAVED = re.compile(r"saved preempted slot \d+ in ([0-9.]+) ms")


def messages(i: int, question: str) -> list[dict[str, str]]:
    return [
        {"role": "system", "content": f"Site {i} of the warehouse network.\n{PREFIX}"},
        {"role": "user", "content": question},
    ]


def dropped(client: Any, i: int, kept: list[Any]) -> float:
    """The issue's client: first token, then ``return`` inside the loop. Its TTFT."""
    start = time.perf_counter()
    stream = client.chat.completions.create(
        model=MODEL, messages=messages(i, f"Order {i * 7} arrived. Next action?"), stream=True
    )
    kept.append(stream)  # closed at the end of the round, not before
    for chunk in stream:
        if chunk.choices and chunk.choices[0].delta.content:
            return time.perf_counter() - start
    return time.perf_counter() - start


def hit_request(client: Any, i: int) -> tuple[float, float, int, int]:
    """Step 3: (time to first token, whole time, prompt tokens, cached tokens)."""
    start = time.perf_counter()
    first = None
    usage = None
    stream = client.chat.completions.create(
        model=MODEL,
        messages=messages(i, "Which aisle for item 12?"),  # type: ignore[arg-type]
        max_tokens=8,
        temperature=0,
        stream=True,
        stream_options={"include_usage": True},
    )
    for chunk in stream:
        if first is None and chunk.choices and chunk.choices[0].delta.content:
            first = time.perf_counter() - start
        if chunk.usage is not None:
            usage = chunk.usage
    whole = time.perf_counter() - start
    assert usage is not None and usage.prompt_tokens_details is not None
    cached = usage.prompt_tokens_details.cached_tokens or 0
    return first if first is not None else whole, whole, usage.prompt_tokens, cached


def timed(client: Any, msgs: list[dict[str, str]]) -> tuple[float, int, int]:
    start = time.perf_counter()
    out = client.chat.completions.create(
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


def idle(server: ServerProcess, deadline_s: float = 600.0) -> None:
    """Until no request runs on ``server`` (a dropped answer has ended)."""
    end = time.monotonic() + deadline_s
    while any(r.get("busy") for r in server.ps()) and time.monotonic() < end:
        time.sleep(0.5)


def stalls(server: ServerProcess) -> list[float]:
    return [float(m) for m in STALL.findall(server.log_path.read_text(errors="replace"))]


def saves(server: ServerProcess) -> list[float]:
    return [float(m) / 1000 for m in SAVED.findall(server.log_path.read_text(errors="replace"))]


def one_round(server: ServerProcess, i: int, variant: str) -> dict[str, Any]:
    load = load_avg()
    # One client for the round's three requests, as the client: each is timed from
    # its call, never with the client's construction (~15-25 ms of the openai library's
    # own here, which the hit's time used to include and the cold one did not).
    client = server.openai(timeout=900)
    kept: list[Any] = []  # the dropped stream stays open, as in the issue, for the round
    before = len(stalls(server))
    saved_before = len(saves(server))
    cold = dropped(client, i, kept)
    timed(client, OTHER)  # type: ignore[arg-type]
    hit_ttft, hit, n_prompt, cached = hit_request(client, i)
    for stream in kept:  # the round is over: end the dropped answer
        stream.close()
    resumed = stalls(server)[before:]
    saved = saves(server)[saved_before:]
    return {
        "variant": variant,
        "round": i,
        "cold_ttft": cold,
        "hit_ttft": hit_ttft,
        "hit": hit,
        "ratio": cold / hit_ttft,
        "ratio_whole": cold / hit,
        "prompt_tokens": n_prompt,
        "cached_tokens": cached,
        "reused": cached >= n_prompt - 2 * BLOCK,
        "resumed_stall": resumed[0] if resumed else None,
        "preempt_cancel_save": saved[0] if saved else None,
        "load_before": load,
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=10)
    args = parser.parse_args()
    env = {"ELBOWROOM_THREADS": "2"}
    servers: dict[str, ServerProcess] = {}
    rows: list[dict[str, Any]] = []
    try:
        for variant, extra in (("preempt", {}), ("baseline", {"ELBOWROOM_KV_PREEMPT": "false"})):
            home = Path(tempfile.mkdtemp(prefix=f"dropped-stream-{variant}-"))
            started = ServerProcess(home, "--preload", MODEL, env={**env, **extra}).start()
            servers[variant] = started
            timed(started.openai(timeout=900), messages(-1, "Warm-up: which aisle for item 3?"))
        for i in range(args.rounds):
            order = ["preempt", "baseline"] if i % 2 == 0 else ["baseline", "preempt"]
            for variant in order:
                for s in servers.values():
                    idle(s)
                # Each variant gets prefixes of its own: no state of one helps the other.
                n = i if variant == "preempt" else 1000 + i
                row = one_round(servers[variant], n, variant)
                rows.append(row)
                print(json.dumps(row), flush=True)
    finally:
        for s in servers.values():
            s.stop()
    write(rows)


def variant_lines(rows: list[dict[str, Any]], name: str) -> list[str]:
    reused = sum(r["reused"] for r in rows)
    fast = sum(r["reused"] and r["ratio"] >= 30 for r in rows)
    fast_whole = sum(r["reused"] and r["ratio_whole"] >= 30 for r in rows)
    lines = [
        f"| {name}: cold (the dropped stream's first token) | "
        f"{summary([r['cold_ttft'] for r in rows])} |",
        f"| {name}: hit, first token | {summary([r['hit_ttft'] for r in rows])} |",
        f"| {name}: hit, whole (8 tokens) | {summary([r['hit'] for r in rows])} |",
        f"| {name}: cold / hit first token | {summary([r['ratio'] for r in rows], 'x')} |",
        f"| {name}: cold / hit whole | {summary([r['ratio_whole'] for r in rows], 'x')} |",
        f"| {name}: prefix reused / ≥ 30x (first token) / ≥ 30x (whole) | {reused} of "
        f"{len(rows)} / {fast} of {len(rows)} / {fast_whole} of {len(rows)} |",
    ]
    stalled = [r["resumed_stall"] for r in rows if r.get("resumed_stall") is not None]
    if stalled:
        lines.append(
            f"| {name}: preempted stream's stall ({len(stalled)} resumed) | {summary(stalled)} |"
        )
    cost = [r["preempt_cancel_save"] for r in rows if r.get("preempt_cancel_save") is not None]
    if cost:
        lines.append(
            f"| {name}: preemption's cancel + slot save ({len(cost)}; the hit waits for it) | "
            f"{summary(cost)} |"
        )
    return lines


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
        *variant_lines([r for r in rows if r["variant"] == "preempt"], "preempt (this code)"),
        *variant_lines(
            [r for r in rows if r["variant"] == "baseline"], "baseline (kv_preempt off)"
        ),
        "",
        "Reused: cached_tokens within two blocks of the prompt. The baseline's hit waits for "
        "the dropped stream's answer to end (the slot that holds the prefix is busy until "
        "then), at most the estimated recompute time, then recomputes. With preemption the "
        "hit ends that answer's generation, takes its slot, and the answer resumes on another "
        "slot from the saved slot state (its stall: preemption to its next token; the "
        "continuation restores and decodes once the hit has its first token).",
    ]
    (out / "dropped_stream.md").write_text("\n".join(lines) + "\n")
    (out / "dropped_stream.json").write_text(json.dumps(rows, indent=1) + "\n")
    print("\n".join(lines))


if __name__ == "__main__":
    main()
