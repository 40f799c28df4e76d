"""MLX prompt cache's disk tier across a restart: first token restored vs recomputed.

SmolLM2-135M-Instruct as MLX (converted from the bundled GGUF, float32 scales: what the
engine computes in on a CPU). Each round uses a new ~270-token prompt: a server loads the
model and answers it cold (recompute: time to the first streamed token), stops gracefully
(the runner saves its slot's state to the disk tier), a new server on the same data folder
loads the model and answers the same prompt (restore from disk). The model is loaded before
each timed request, so both times are prompt work only. Rounds are sequential (a round needs
its own restart); medians with ranges; the load average is recorded (shared machine).

    .venv/bin/python benchmarks/mlx_kv_restart.py [--rounds 5]

Writes benchmarks/results/mlx_kv_restart.{json,md}.
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

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))
sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests" / "e2e"))

from mlx_decode import float32_copy  # type: ignore[import-not-found]
from mlx_models import smollm2_mlx
from serverproc import ServerProcess

RESULTS = Path(__file__).parent / "results"
MODEL = "smollm2-mlx"
TOPICS = ["rivers", "glaciers", "lighthouses", "orchards", "volcanoes", "libraries", "comets"]


def prompt_for(i: int) -> str:
    topic = TOPICS[i % len(TOPICS)]
    body = f"Here are careful notes about {topic}, numbered. " + " ".join(
        f"Note {n}: {topic} change slowly and are worth observing with patience." for n in range(18)
    )
    return body + f" Summarize the notes about {topic} in one sentence."


def first_token(server: ServerProcess, prompt: str) -> tuple[float, int]:
    with server.http() as http:
        r = http.post(f"/api/models/{MODEL}/load", timeout=300)
        r.raise_for_status()
    client = server.openai(timeout=600)
    t = time.perf_counter()
    stream = client.completions.create(
        model=MODEL,
        prompt=prompt,
        max_tokens=2,
        temperature=0,
        stream=True,
        stream_options={"include_usage": True},
    )
    first: float | None = None
    cached = 0
    for chunk in stream:
        if first is None and chunk.choices and chunk.choices[0].text:
            first = time.perf_counter() - t
        if chunk.usage is not None and chunk.usage.prompt_tokens_details is not None:
            cached = chunk.usage.prompt_tokens_details.cached_tokens or 0
    return (first if first is not None else time.perf_counter() - t), cached


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--rounds", type=int, default=5)
    args = ap.parse_args()
    rows: list[dict[str, Any]] = []
    with tempfile.TemporaryDirectory() as tmp:
        root = Path(tmp)
        models = root / "models"
        float32_copy(smollm2_mlx(root / "src"), models / MODEL)
        home = root / "home"
        home.mkdir()
        flags = ("--ctx", "1024", "--models-dir", str(models))
        for i in range(args.rounds):
            prompt = prompt_for(i)
            a = ServerProcess(home, *flags).start()
            try:
                cold, cached_cold = first_token(a, prompt)
            finally:
                a.stop()
            b = ServerProcess(home, *flags).start()
            try:
                warm, cached_warm = first_token(b, prompt)
            finally:
                b.stop()
            row = {
                "round": i,
                "recompute_s": cold,
                "restore_s": warm,
                "speedup": cold / warm,
                "cached_tokens_cold": cached_cold,
                "cached_tokens_restored": cached_warm,
                "loadavg": os.getloadavg()[0],
            }
            rows.append(row)
            print(json.dumps(row), flush=True)

    def spread(xs: list[float], unit: str = "") -> str:
        return f"{statistics.median(xs):.2f}{unit} ({min(xs):.2f}–{max(xs):.2f})"

    speed = [r["speedup"] for r in rows]
    meta = {
        "machine": f"{platform.machine()} {platform.system()}, {os.cpu_count()} cores (shared)",
        "rounds": args.rounds,
        "median_speedup": statistics.median(speed),
    }
    RESULTS.mkdir(exist_ok=True)
    (RESULTS / "mlx_kv_restart.json").write_text(json.dumps({"meta": meta, "rows": rows}, indent=1))
    loads = ", ".join(f"{r['loadavg']:.1f}" for r in rows)
    lines = [
        "# MLX prompt cache: disk tier after a restart vs recompute (first token)",
        "",
        f"{meta['machine']}; SmolLM2-135M-Instruct as MLX 4-bit (float32 scales); a ~270-token"
        f" prompt per round, new each round; {args.rounds} rounds; "
        "`benchmarks/mlx_kv_restart.py`. The machine was shared with other work: load average "
        f"per round {loads}.",
        "",
        "| | time to first token, median (range) |",
        "|---|---:|",
        f"| recompute (cold server) | {spread([r['recompute_s'] for r in rows], ' s')} |",
        f"| restore from the disk tier after a restart | "
        f"{spread([r['restore_s'] for r in rows], ' s')} |",
        f"| speedup | {spread(speed, '×')} |",
        "",
        "cached tokens reported after the restart: "
        + ", ".join(str(r["cached_tokens_restored"]) for r in rows)
        + " (cold: "
        + ", ".join(str(r["cached_tokens_cold"]) for r in rows)
        + ").",
    ]
    (RESULTS / "mlx_kv_restart.md").write_text("\n".join(lines) + "\n")
    print("\n".join(lines))


if __name__ == "__main__":
    main()
