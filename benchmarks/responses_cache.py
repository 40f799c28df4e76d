"""A stored conversation continued by ``previous_response_id`` vs sending it whole to a
server that has to recompute it: time to first token through ``/v1/responses``.

Workload: SmolLM2-135M, one slot, 2 threads, a ~2,000-token conversation (instructions and
three user/assistant turns) stored by a first ``POST /v1/responses``, then a short new
question, greedy, 8 streamed tokens, the official openai client (``responses.create(...,
stream=True)``; TTFT = the first ``response.output_text.delta``). Between two
measurements another client's request runs on the one slot, so the live context never
holds the conversation when a measurement starts.

- recompute: the whole conversation sent as ``input`` items (no ``previous_response_id``)
  to a server with ``ELBOWROOM_KV_CACHE=0`` (the model loaded, no prompt cache, no disk
  tier): every token of it is prefilled.
- cold: the same on a server just started without the model (load + prefill): what a
  client of a server without stored conversations pays after a restart.
- continuation (RAM): ``previous_response_id`` on the caching server: the engine's prompt
  cache restores the conversation's state.
- continuation after eviction: the model is unloaded first (``POST
  /api/models/{id}/unload``: its runner saves the slot to the disk tier); the TTFT includes
  loading the model again and the disk tier's restore.
- continuation after a restart: the caching server is stopped and started again on the
  same folders (the model preloaded); the stored response and the KV state both come from
  disk.

Every configuration runs in each round (interleaved), ``--rounds`` (>= 5), medians with
min-max, the load average before and after each round.

    .venv/bin/python benchmarks/responses_cache.py [--rounds 5]

Writes benchmarks/results/responses_cache.{md,json}.
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

from serverproc import ServerProcess, wait_for  # noqa: E402

MODEL = "smollm2-135m"
MAX_TOKENS = 8
INSTRUCTIONS = (
    "You are the support assistant of a warehouse. Answer briefly and name the shelf.\n"
    + "".join(
        f"Rule {i}: an order for item {i} is checked on shelf {i % 17} and reported with "
        f"aisle {i % 23}.\n"
        for i in range(20)
    )
)
TURNS = [
    (
        f"Order batch {t}: "
        + " ".join(
            f"item {t * 40 + k} x{(k * 7) % 9 + 1} for customer C{k % 13};" for k in range(40)
        ),
        f"Batch {t} noted: {40} lines, shelves checked, nothing missing. Ready for the next batch.",
    )
    for t in range(3)
]
OTHER = "Say one word about the weather."


def conversation_items() -> list[dict[str, Any]]:
    items: list[dict[str, Any]] = []
    for user, assistant in TURNS:
        items.append({"role": "user", "content": user})
        items.append({"role": "assistant", "content": assistant})
    items.append({"role": "user", "content": "Summarize the batches in one line."})
    return items


def question(n: int) -> str:
    return f"Question {n}: on which shelf is item {n * 3}?"


def ttft(server: ServerProcess, **kw: Any) -> dict[str, Any]:
    """Seconds to the first streamed text, and the usage the completed response reported."""
    client = server.openai()
    start = time.perf_counter()
    first: float | None = None
    usage: Any = None
    rid = ""
    with client.responses.stream(
        model=MODEL, max_output_tokens=MAX_TOKENS, temperature=0, **kw
    ) as stream:
        for event in stream:
            if first is None and event.type == "response.output_text.delta":
                first = time.perf_counter() - start
            if event.type in ("response.completed", "response.incomplete"):
                usage = event.response.usage
                rid = event.response.id
    return {
        "ttft": first if first is not None else time.perf_counter() - start,
        "input_tokens": usage.input_tokens if usage is not None else 0,
        "cached": usage.input_tokens_details.cached_tokens if usage is not None else 0,
        "id": rid,
    }


def other(server: ServerProcess) -> None:
    """Another client on the one slot: the live context no longer holds the conversation."""
    server.openai().responses.create(
        model=MODEL, input=OTHER, max_output_tokens=4, temperature=0, store=False
    )


def serve(home: Path, *args: str, env: dict[str, str] | None = None) -> ServerProcess:
    base = {"ELBOWROOM_SLOTS": "1", "ELBOWROOM_THREADS": "2"}
    home.mkdir(parents=True, exist_ok=True)
    return ServerProcess(home, "--ctx", "4096", *args, env={**base, **(env or {})}).start()


def load_avg() -> str:
    return " ".join(f"{x:.2f}" for x in os.getloadavg())


def summary(values: list[float]) -> str:
    lo, mid, hi = min(values), statistics.median(values), max(values)
    return f"{mid * 1000:.0f} ms ({lo * 1000:.0f}–{hi * 1000:.0f})"


LABELS = {
    "recompute": "whole conversation, model loaded, no cache (recompute)",
    "cold": "whole conversation to a fresh server (load + recompute)",
    "continuation": "`previous_response_id` (RAM prompt cache)",
    "after_eviction": "`previous_response_id` after the model was unloaded (reload + disk tier)",
    "after_restart": "`previous_response_id` after a server restart (disk tier)",
}


def per_round(out: dict[str, list[dict[str, Any]]], name: str) -> list[float]:
    return [r["ttft"] / c["ttft"] for r, c in zip(out["recompute"], out[name], strict=True)]


def report(
    out: dict[str, list[dict[str, Any]]], rounds: list[dict[str, str]], n_in: int, when: str
) -> str:
    med = {k: statistics.median(r["ttft"] for r in v) for k, v in out.items()}
    lines = [
        "# Stored conversations through /v1/responses: time to first token",
        "",
        f"SmolLM2-135M Q4_1, 1 slot, 2 threads, greedy, {MAX_TOKENS} streamed tokens; a stored "
        f"conversation of {n_in} prompt tokens (instructions + 3 turns + a new question), "
        "continued by `previous_response_id` vs sent whole. Medians over the rounds with "
        f"min–max. Machine: {platform.machine()}, {os.cpu_count()} CPUs, **shared with other "
        f"work** (see the load averages); {when}.",
        "",
        "| configuration | TTFT median (min–max) | cached tokens (median) | recompute ÷ this |",
        "|---|---:|---:|---:|",
    ]
    for name, label in LABELS.items():
        rows = out[name]
        cached = statistics.median(r["cached"] for r in rows)
        lines.append(
            f"| {label} | {summary([r['ttft'] for r in rows])} | {cached:.0f} | "
            f"{med['recompute'] / med[name]:.2f}x |"
        )
    ratio = {k: med["recompute"] / med[k] for k in ("continuation", "after_eviction")}
    cold_ratio = med["cold"] / med["after_eviction"]
    lines += [
        "",
        "Target: a continuation's first token ≥ 10× faster than sending the whole conversation "
        "to a cold server, also after the model was evicted and reloaded.",
        "",
        f"- {'met' if ratio['continuation'] >= 10 else 'NOT met'}: continuation vs recompute "
        f"{ratio['continuation']:.2f}x",
        f"- {'met' if ratio['after_eviction'] >= 10 else 'NOT met'}: after eviction (its TTFT "
        f"includes loading the model) vs recompute with the model already loaded "
        f"{ratio['after_eviction']:.2f}x; vs a cold server that loads the model too "
        f"{cold_ratio:.2f}x",
        f"- after a restart vs recompute: {med['recompute'] / med['after_restart']:.2f}x",
        "",
        "Per-round ratios (that round's recompute ÷ that round's continuation), min–max: "
        + "; ".join(
            f"{k} {min(per_round(out, k)):.2f}–{max(per_round(out, k)):.2f}x"
            for k in ("continuation", "after_eviction", "after_restart")
        ),
        "",
        "Per round (ms): "
        + "; ".join(
            f"round {i + 1}: " + ", ".join(f"{k} {out[k][i]['ttft'] * 1000:.0f}" for k in LABELS)
            for i in range(len(rounds))
        ),
        "",
        "Load average (1, 5, 15 min) before → after each round:",
        "",
        *[f"- round {i + 1}: {r['before']} → {r['after']}" for i, r in enumerate(rounds)],
        "",
        f"Command: `.venv/bin/python benchmarks/responses_cache.py --rounds {len(rounds)}`",
    ]
    return "\n".join(lines) + "\n"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--out", type=Path, default=REPO / "benchmarks" / "results")
    parser.add_argument(
        "--from-json", type=Path, default=None, help="write the report of a recorded run again"
    )
    args = parser.parse_args()
    if args.from_json is not None:
        data = json.loads(args.from_json.read_text())
        text = report(data["results"], data["rounds"], data["prompt_tokens"], data["recorded"])
        (args.out / "responses_cache.md").write_text(text)
        print(text)
        return
    items = conversation_items()
    out: dict[str, list[dict[str, Any]]] = {k: [] for k in LABELS}
    rounds = []
    with tempfile.TemporaryDirectory(prefix="elbowroom-respbench-") as tmp:
        homes = {k: Path(tmp) / k for k in ("recompute", "cached", "cold")}
        recompute = serve(homes["recompute"], "--preload", MODEL, env={"ELBOWROOM_KV_CACHE": "0"})
        cached = serve(homes["cached"], "--preload", MODEL)
        try:
            # The stored conversation: its last answer is part of every continuation.
            stored = cached.openai().responses.create(
                model=MODEL,
                instructions=INSTRUCTIONS,
                input=items,  # type: ignore[arg-type]
                max_output_tokens=24,
                temperature=0,
            )
            whole = [*items, {"role": "assistant", "content": stored.output_text}]
            for i in range(args.rounds):
                before = load_avg()
                ask = question(i)
                # recompute: another client first, then the whole conversation.
                other(recompute)
                out["recompute"].append(
                    ttft(
                        recompute,
                        instructions=INSTRUCTIONS,
                        input=[*whole, {"role": "user", "content": ask}],
                        store=False,
                    )
                )
                # cold: a fresh server, the model not loaded.
                cold = serve(homes["cold"] / str(i))
                try:
                    out["cold"].append(
                        ttft(
                            cold,
                            instructions=INSTRUCTIONS,
                            input=[*whole, {"role": "user", "content": ask}],
                            store=False,
                        )
                    )
                finally:
                    cold.stop()
                # continuation: another client first, then previous_response_id.
                other(cached)
                cont = {"instructions": INSTRUCTIONS, "previous_response_id": stored.id}
                out["continuation"].append(ttft(cached, input=ask, store=False, **cont))
                # after eviction: the runner saves its slot on the way out.
                with cached.http() as http:
                    http.post(f"/api/models/{MODEL}/unload").raise_for_status()
                wait_for(lambda s=cached: s.ps() == [], timeout=120, what="the unload")
                out["after_eviction"].append(ttft(cached, input=ask, store=False, **cont))
                # after a restart: the same folders, the model preloaded.
                other(cached)
                cached.stop()
                cached = serve(homes["cached"], "--preload", MODEL)
                out["after_restart"].append(ttft(cached, input=ask, store=False, **cont))
                rounds.append({"before": before, "after": load_avg()})
                print(
                    f"round {i + 1}/{args.rounds}: "
                    + ", ".join(
                        f"{k} {v[-1]['ttft'] * 1000:.0f} ms ({v[-1]['cached']} cached)"
                        for k, v in out.items()
                    ),
                    flush=True,
                )
        finally:
            recompute.stop()
            cached.stop()
    n_in = int(statistics.median(r["input_tokens"] for r in out["recompute"]))
    args.out.mkdir(parents=True, exist_ok=True)
    when = time.strftime("%Y-%m-%d %H:%M")
    data = {"results": out, "rounds": rounds, "prompt_tokens": n_in, "recorded": when}
    (args.out / "responses_cache.json").write_text(json.dumps(data, indent=2))
    text = report(out, rounds, n_in, when)
    (args.out / "responses_cache.md").write_text(text)
    print(text)


if __name__ == "__main__":
    main()
