"""Parallel requests on MLX: mlx-lm's batch generation vs one sequence at a time.

Does ``mlx_lm``'s ``batch_generate`` (its ``BatchGenerator``: prompts prefilled together,
one decode step for every sequence at once) serve 2 and 4 concurrent requests faster than
generating them one after another, as elbowroom's MLX engine does? Same process, same
model: SmolLM2-135M-Instruct converted from the bundled GGUF (tests/mlx_models.py), with
float32 scales and biases as the engine computes on a CPU (benchmarks/mlx_decode.py says
why). N different prompts (~10 tokens each), greedy, ``--tokens`` new tokens each.
Aggregate throughput = all new tokens / wall time (prefill included, as a client sees it).
Rounds interleave the two ways (order alternating) for N = 2 and 4; medians with ranges;
the load average per round (the machine is shared).

    .venv/bin/python benchmarks/mlx_batch.py [--rounds 5] [--tokens 16]

Writes benchmarks/results/mlx_batch.{json,md}. Question: is batching > 1.2x at N = 4?
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import re
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))

from mlx_decode import float32_copy
from mlx_models import smollm2_mlx

RESULTS = Path(__file__).parent / "results"
PROMPTS = [
    "Once upon a time, in a small village by the sea,",
    "The three most important inventions of the last century are",
    "Here is a recipe for a simple tomato soup:",
    "The best way to learn a new programming language is",
]
TARGET = 1.2


def sequential(model: Any, tokenizer: Any, prompts: list[list[int]], tokens: int) -> int:
    from mlx_lm.generate import stream_generate
    from mlx_lm.sample_utils import make_sampler

    n = 0
    for p in prompts:
        for _ in stream_generate(
            model, tokenizer, p, max_tokens=tokens, sampler=make_sampler(temp=0.0)
        ):
            n += 1
    return n


def batched(model: Any, tokenizer: Any, prompts: list[list[int]], tokens: int) -> int:
    from mlx_lm.generate import batch_generate

    out = batch_generate(model, tokenizer, prompts, max_tokens=tokens, return_token_ids=True)
    return sum(len(t) for t in out.token_ids) if out.token_ids else len(out.texts) * tokens


def timed(fn: Any, *args: Any) -> tuple[float, int]:
    t = time.perf_counter()
    n = fn(*args)
    return time.perf_counter() - t, n


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--tokens", type=int, default=16)
    args = ap.parse_args()
    import mlx.core as mx
    from mlx_lm import load

    with tempfile.TemporaryDirectory() as tmp:
        root = Path(tmp)
        folder = float32_copy(smollm2_mlx(root / "src"), root / "smollm2-mlx")
        model, tokenizer = load(str(folder))
    prompts = [tokenizer.encode(p) for p in PROMPTS]
    ways = {"sequential": sequential, "batch_generate": batched}
    for fn in ways.values():  # warm-up: kernels, first allocations
        fn(model, tokenizer, prompts[:2], 2)
    rows: list[dict[str, Any]] = []
    for i in range(args.rounds):
        for n in (2, 4):
            order = list(ways.items())
            if i % 2:
                order.reverse()
            row: dict[str, Any] = {"round": i, "n": n, "loadavg": os.getloadavg()[0]}
            for name, fn in order:
                mx.clear_cache()
                secs, got = timed(fn, model, tokenizer, prompts[:n], args.tokens)
                row[name] = {"seconds": secs, "tokens": got, "tok_s": got / secs}
            row["speedup"] = row["batch_generate"]["tok_s"] / row["sequential"]["tok_s"]
            rows.append(row)
            print(json.dumps(row), flush=True)

    versions = subprocess.run(
        [sys.executable, "-m", "pip", "list"], capture_output=True, text=True
    ).stdout
    found = re.findall(r"^(mlx(?:-lm|-cpu)?)\s+(\S+)", versions, re.M)
    mlx_v = ", ".join(f"{name} {version}" for name, version in found)
    summary: dict[str, Any] = {}
    for n in (2, 4):
        mine = [r for r in rows if r["n"] == n]
        summary[str(n)] = {
            "speedup": [r["speedup"] for r in mine],
            "sequential_tok_s": [r["sequential"]["tok_s"] for r in mine],
            "batch_tok_s": [r["batch_generate"]["tok_s"] for r in mine],
            "median_speedup": statistics.median(r["speedup"] for r in mine),
        }
    meta = {
        "machine": f"{platform.machine()} {platform.system()}, {os.cpu_count()} cores (shared)",
        "loadavg_end": os.getloadavg(),
        "versions": mlx_v,
        "tokens": args.tokens,
        "rounds": args.rounds,
        "target": f"batch_generate > {TARGET}x sequential at N = 4",
        "met": summary["4"]["median_speedup"] > TARGET,
    }
    RESULTS.mkdir(exist_ok=True)
    out = {"meta": meta, "summary": summary, "rows": rows}
    (RESULTS / "mlx_batch.json").write_text(json.dumps(out, indent=1))

    def spread(xs: list[float]) -> str:
        return f"{statistics.median(xs):.2f} ({min(xs):.2f}–{max(xs):.2f})"

    loads = ", ".join(f"{r['loadavg']:.1f}" for r in rows)
    lines = [
        "# MLX parallel requests: mlx-lm's batch_generate vs one sequence at a time",
        "",
        f"{meta['machine']}; {mlx_v}; SmolLM2-135M-Instruct from the bundled GGUF (Q4_1 as "
        f"MLX 4-bit, float32 scales); N different ~10-token prompts, greedy, {args.tokens} new "
        f"tokens each; aggregate tok/s = all new tokens / wall time (prefill included); "
        f"{args.rounds} interleaved rounds; `benchmarks/mlx_batch.py`. The machine was shared "
        f"with other work: load average per measurement {loads}.",
        "",
        "| N | sequential tok/s | batch_generate tok/s | speedup (median, range) |",
        "|---:|---:|---:|---:|",
    ]
    for n in (2, 4):
        s = summary[str(n)]
        lines.append(
            f"| {n} | {spread(s['sequential_tok_s'])} | {spread(s['batch_tok_s'])} | "
            f"{spread(s['speedup'])} |"
        )
    verdict = "met" if meta["met"] else "not met"
    lines += ["", f"Question: batching > {TARGET:.2f}x at N = 4: **{verdict}**."]
    (RESULTS / "mlx_batch.md").write_text("\n".join(lines) + "\n")
    print("\n".join(lines))


if __name__ == "__main__":
    main()
