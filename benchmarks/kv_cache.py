"""KV prefix cache through a real `elbowroom serve`: time to first token of an agent step
over a long shared prefix, when the prefix is recomputed, restored from the engine's RAM
prompt cache, or restored from elbowroom's disk tier after a restart. Plus the swap that
no peer handles: room for one LLM, A → B → A again.

Workload: SmolLM2-135M, a ~1,850-token agent prefix (tools, rules) + a short varying step,
greedy, 8 streamed tokens, one slot (so another client's request really overwrites the
live context between two steps; with more slots elbowroom keeps a conversation on its own
slot and the question would not arise).

- recompute: ``ELBOWROOM_KV_CACHE=0`` (no RAM grant, no disk tier): every step after another
  client's request prefills the whole prompt.
- RAM hit: the default grant; the engine restores the prefix from its prompt cache.
- disk hit: each round stops the server (its runner saves its slots to the disk tier) and
  starts a new one on the same cache folder; the first step is measured.
- swap: ``ELBOWROOM_OVERRIDE_MEMORY`` leaves room for one LLM; A (SmolLM2, the long prompt)
  → B (gemma3-270m) evicts A → A again. Its TTFT is compared with A's reload time plus two
  warm hits (the issue's target), reload time read two ways: the runner's load alone, and
  A's first token when it comes back with a short prompt (B → A with nothing to restore).

Every configuration runs in each round (interleaved), ``--rounds`` rounds (>= 7 for a
recording), medians with min-max, the load average before and after each round.

    .venv/bin/python benchmarks/kv_cache.py [--rounds 7]

Writes benchmarks/results/kv_cache.{md,json}.
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

from serverproc import ServerProcess  # noqa: E402

from elbowroom.config import load_settings  # noqa: E402
from elbowroom.models.bundled import gemma_path  # noqa: E402

A, B = "smollm2-135m", "gemma3-270m"
MAX_TOKENS = 8
PREFIX = (
    "You are an agent that operates a warehouse system. You can call tools by writing a "
    "line that starts with CALL. Rules follow.\n"
    + "".join(
        f"Rule {i}: when an order for item {i} arrives, check shelf {i % 17}, confirm the "
        f"count with the inventory tool, and report the aisle number {i % 23} briefly.\n"
        for i in range(60)
    )
)
OTHER = [{"role": "user", "content": "Say one word about the weather."}]


def step(n: int) -> list[dict[str, str]]:
    return [
        {"role": "system", "content": PREFIX},
        {"role": "user", "content": f"Observation {n}: order {n * 7} arrived. Next action?"},
    ]


def ttft(server: ServerProcess, model: str, messages: list[dict[str, str]]) -> tuple[float, int]:
    """Seconds to the first streamed token, and the cached tokens the server reported."""
    client = server.openai()
    start = time.perf_counter()
    first: float | None = None
    cached = 0
    stream = client.chat.completions.create(
        model=model,
        messages=messages,  # type: ignore[arg-type]
        max_tokens=MAX_TOKENS,
        temperature=0,
        stream=True,
        stream_options={"include_usage": True},
    )
    for chunk in stream:
        if first is None and chunk.choices and chunk.choices[0].delta.content:
            first = time.perf_counter() - start
        if chunk.usage is not None and chunk.usage.prompt_tokens_details is not None:
            cached = chunk.usage.prompt_tokens_details.cached_tokens or 0
    return (first if first is not None else time.perf_counter() - start), cached


def serve(home: Path, *args: str, env: dict[str, str] | None = None) -> ServerProcess:
    base = {"ELBOWROOM_SLOTS": "1", "ELBOWROOM_THREADS": "2"}
    return ServerProcess(home, "--preload", A, *args, env={**base, **(env or {})}).start()


def load_avg() -> str:
    return " ".join(f"{x:.2f}" for x in os.getloadavg())


def run_round(
    i: int, homes: dict[str, Path], out: dict[str, list[dict[str, Any]]], swap_memory: str
) -> None:
    # recompute and RAM hit: warm the prefix, another client's request, then the step.
    for name, env in (("recompute", {"ELBOWROOM_KV_CACHE": "0"}), ("ram_hit", {})):
        server = serve(homes[name], env=env)
        try:
            ttft(server, A, step(1000 + i))
            ttft(server, A, OTHER)
            seconds, cached = ttft(server, A, step(i))
            out[name].append({"ttft": seconds, "cached": cached})
        finally:
            server.stop()
    # disk hit: the previous server of this home saved its slot at shutdown.
    server = serve(homes["disk_hit"])
    try:
        seconds, cached = ttft(server, A, step(i))
        out["disk_hit"].append({"ttft": seconds, "cached": cached})
        ttft(server, A, step(2000 + i))  # leaves a prefix state for the next round's restart
    finally:
        server.stop()
    # swap: room for one of the two LLMs at a time.
    # A small RAM grant: the swap is about the disk tier and the reload, and the grant is
    # budgeted with each model.
    swap_env = {"ELBOWROOM_OVERRIDE_MEMORY": swap_memory, "ELBOWROOM_KV_RAM_MAX": "32MiB"}
    server = serve(homes["swap"], env=swap_env)
    try:
        ttft(server, A, step(3000 + i))
        warm, _ = ttft(server, A, step(3000 + i))
        ttft(server, B, OTHER)  # evicts A (its runner saves its slot on the way out)
        loaded = [r["id"] for r in server.ps()]
        back, cached = ttft(server, A, step(3000 + i))
        reload_s = next(r["load_seconds"] for r in server.ps() if r["id"] == A)
        # A's return with nothing to restore: B again (evicts A, saving its slot), then A
        # with a short prompt. Its first token is the cost of the swap itself (B out, A in,
        # one short prefill), which the KV cache cannot change.
        ttft(server, B, OTHER)
        bare, _ = ttft(server, A, OTHER)
        out["swap"].append(
            {
                "ttft": back,
                "cached": cached,
                "warm": warm,
                "reload": reload_s,
                "reload_ttft": bare,
                "evicted": A not in loaded,
            }
        )
    finally:
        server.stop()


def summary(values: list[float]) -> str:
    lo, mid, hi = min(values), statistics.median(values), max(values)
    return f"{mid * 1000:.0f} ms ({lo * 1000:.0f}–{hi * 1000:.0f})"


def report(out: dict[str, Any], rounds: list[dict[str, str]]) -> str:
    med = {k: statistics.median(r["ttft"] for r in v) for k, v in out.items() if v}
    lines = [
        "# KV prefix cache through the server: time to first token",
        "",
        f"SmolLM2-135M Q4_1, 1 slot, 2 threads, greedy, {MAX_TOKENS} streamed tokens; an agent "
        "step over a shared ~1,850-token prefix. Medians over the rounds with min–max. "
        f"Machine: {platform.machine()}, {os.cpu_count()} CPUs; {time.strftime('%Y-%m-%d %H:%M')}.",
        "",
        "| configuration | TTFT median (min–max) | cached tokens (median) | vs recompute |",
        "|---|---:|---:|---:|",
    ]
    for name, label in (
        ("recompute", "recompute (no cache)"),
        ("ram_hit", "RAM hit (engine prompt cache)"),
        ("disk_hit", "disk hit after a restart"),
        ("swap", "A after A → B → A (reload + disk hit)"),
    ):
        rows = out[name]
        cached = statistics.median(r["cached"] for r in rows)
        lines.append(
            f"| {label} | {summary([r['ttft'] for r in rows])} | {cached:.0f} | "
            f"{med['recompute'] / med[name]:.1f}x |"
        )
    swap = out["swap"]
    reload_m = statistics.median(r["reload"] for r in swap)
    warm_m = statistics.median(r["warm"] for r in swap)
    target = reload_m + 2 * warm_m
    bare = [r["reload_ttft"] for r in swap if "reload_ttft" in r]
    bare_m = statistics.median(bare) if bare else float("nan")
    swap_target = bare_m + 2 * warm_m
    lines += [
        "",
        "Swap: A's runner loads in "
        f"{reload_m * 1000:.0f} ms; A's first token when it comes back with a short prompt "
        f"(B evicted, A loaded, nothing to restore) {summary(bare) if bare else '—'}; warm hit "
        f"{warm_m * 1000:.0f} ms (medians); A was evicted by B in "
        f"{sum(r['evicted'] for r in swap)}/{len(swap)} rounds.",
        "",
        "The issue's swap target reads \"A's first token after coming back ≤ its reload time + "
        "2× a warm hit\". Two readings of *reload time*, both reported: the runner's load "
        "alone (`load_seconds` in `/api/ps`), and A's whole return without a prefix to "
        "restore (B's eviction and slot save, the settle wait, A's load, a short prefill). "
        "The second isolates what the KV cache adds to a swap.",
        "",
        "Targets:",
        "",
        f"- {'met' if med['ram_hit'] * 30 <= med['recompute'] else 'NOT met'}: RAM hit >= 30x "
        f"faster than recompute: {med['recompute'] / med['ram_hit']:.1f}x",
        f"- {'met' if med['disk_hit'] * 10 <= med['recompute'] else 'NOT met'}: disk hit >= 10x "
        f"faster than recompute: {med['recompute'] / med['disk_hit']:.1f}x",
        f"- {'met' if med['swap'] <= target else 'NOT met'}: A after the swap <= runner load + "
        f"2x warm hit: {med['swap'] * 1000:.0f} ms vs {target * 1000:.0f} ms",
        f"- {'met' if med['swap'] <= swap_target else 'NOT met'}: A after the swap <= A's return "
        f"without a prefix + 2x warm hit: {med['swap'] * 1000:.0f} ms vs "
        f"{swap_target * 1000:.0f} ms",
        "",
        "Load average (1, 5, 15 min) before → after each round:",
        "",
        *[f"- round {i + 1}: {r['before']} → {r['after']}" for i, r in enumerate(rounds)],
        "",
        f"Command: `.venv/bin/python benchmarks/kv_cache.py --rounds {len(rounds)}`",
    ]
    return "\n".join(lines) + "\n"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rounds", type=int, default=7)
    parser.add_argument(
        "--swap-memory",
        default="743MiB",
        help="override that leaves room for one of the two LLMs (the result says if it did)",
    )
    parser.add_argument("--out", type=Path, default=REPO / "benchmarks" / "results")
    args = parser.parse_args()
    with tempfile.TemporaryDirectory(prefix="elbowroom-kvbench-") as tmp:
        homes = {k: Path(tmp) / k for k in ("recompute", "ram_hit", "disk_hit", "swap")}
        gemma = gemma_path(load_settings())  # assembled by scripts/setup.sh
        for h in homes.values():
            bundled = h / "data" / "elbowroom" / "bundled"
            bundled.mkdir(parents=True)
            (bundled / gemma.name).symlink_to(gemma)
        out: dict[str, list[dict[str, Any]]] = {k: [] for k in homes}
        rounds = []
        # The disk tier needs a first server to save a state before round 1 measures a hit.
        warm = serve(homes["disk_hit"])
        ttft(warm, A, step(2000))
        warm.stop()
        for i in range(args.rounds):
            before = load_avg()
            run_round(i, homes, out, args.swap_memory)
            rounds.append({"before": before, "after": load_avg()})
            print(
                f"round {i + 1}/{args.rounds}: "
                + ", ".join(f"{k} {v[-1]['ttft'] * 1000:.0f} ms" for k, v in out.items()),
                flush=True,
            )
    args.out.mkdir(parents=True, exist_ok=True)
    data = {"results": out, "rounds": rounds}
    (args.out / "kv_cache.json").write_text(json.dumps(data, indent=2))
    text = report(out, rounds)
    (args.out / "kv_cache.md").write_text(text)
    print(text)


if __name__ == "__main__":
    main()
