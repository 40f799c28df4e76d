"""Decode speed: elbowroom's MLX engine vs ``mlx_lm.server`` on the same model, same run.

The model is SmolLM2-135M-Instruct converted from the bundled GGUF (tests/mlx_models.py),
saved with float32 scales, biases and norms: on a CPU elbowroom's engine computes in float32
(MLX's quantized matmul with float16 scales measured ~30x slower per call on this CPU), and
mlx_lm.server computes in the dtype the folder holds, so both run the same kernels. Both
servers run at once on the same machine; each round asks each server (order alternating) for
the same greedy chat reply with ``max_tokens`` 1 and N: decode rate = (tokens_N - tokens_1) /
(time_N - time_1), which takes the prompt's prefill out (both servers cache the prompt).
Rounds are interleaved; medians with ranges; the load average is recorded (shared machine).

    .venv/bin/python benchmarks/mlx_decode.py [--rounds 5] [--tokens 48]

Writes benchmarks/results/mlx_decode.{json,md}. Target: elbowroom >= 0.95x mlx_lm.server.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import re
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import httpx

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))

from mlx_models import smollm2_mlx

RESULTS = Path(__file__).parent / "results"
PROMPT = [{"role": "user", "content": "Write a long story about a dragon who learns to cook."}]


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def float32_copy(src: Path, dest: Path) -> Path:
    """``src`` with every float tensor in float32 (the packed 4-bit weights unchanged)."""
    import mlx.core as mx

    weights = mx.load(str(src / "model.safetensors"))
    out = {k: (v.astype(mx.float32) if v.dtype == mx.float16 else v) for k, v in weights.items()}
    dest.mkdir(parents=True, exist_ok=True)
    mx.save_safetensors(str(dest / "model.safetensors"), out, metadata={"format": "mlx"})
    config = json.loads((src / "config.json").read_text())
    config["torch_dtype"] = "float32"
    (dest / "config.json").write_text(json.dumps(config))
    for name in ("tokenizer.json", "tokenizer_config.json"):
        (dest / name).write_bytes((src / name).read_bytes())
    return dest


def wait_up(url: str, proc: subprocess.Popen[bytes], what: str) -> None:
    deadline = time.monotonic() + 300
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"{what} exited with {proc.returncode}")
        try:
            if httpx.get(url, timeout=2).status_code < 500:
                return
        except httpx.HTTPError:
            pass
        time.sleep(0.5)
    raise RuntimeError(f"{what} did not come up")


def ask(base: str, model: str, max_tokens: int) -> tuple[float, int]:
    body = {"model": model, "messages": PROMPT, "max_tokens": max_tokens, "temperature": 0}
    t = time.perf_counter()
    r = httpx.post(base + "/v1/chat/completions", json=body, timeout=600)
    elapsed = time.perf_counter() - t
    r.raise_for_status()
    return elapsed, int(r.json()["usage"]["completion_tokens"])


def rate(base: str, model: str, n: int) -> float:
    t1, k1 = ask(base, model, 1)
    tn, kn = ask(base, model, n)
    return (kn - k1) / (tn - t1)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--tokens", type=int, default=48)
    args = ap.parse_args()
    procs: list[subprocess.Popen[bytes]] = []
    with tempfile.TemporaryDirectory() as tmp:
        root = Path(tmp)
        model = float32_copy(smollm2_mlx(root / "src"), root / "models" / "smollm2-mlx")
        logs = root / "logs"
        logs.mkdir()
        try:
            p1, p2 = free_port(), free_port()
            ours = f"http://127.0.0.1:{p1}"
            theirs = f"http://127.0.0.1:{p2}"
            env = {k: v for k, v in os.environ.items() if not k.startswith("ELBOWROOM_")}
            env.update(XDG_DATA_HOME=str(root / "d"), XDG_CACHE_HOME=str(root / "c"))
            procs.append(
                subprocess.Popen(
                    [
                        sys.executable,
                        "-m",
                        "elbowroom",
                        "serve",
                        "--port",
                        str(p1),
                        "--models-dir",
                        str(root / "models"),
                        "--ctx",
                        "1024",
                    ],
                    env=env,
                    stdout=(logs / "ours.log").open("wb"),
                    stderr=subprocess.STDOUT,
                )
            )
            procs.append(
                subprocess.Popen(
                    [
                        sys.executable,
                        "-m",
                        "mlx_lm.server",
                        "--model",
                        str(model),
                        "--port",
                        str(p2),
                    ],
                    stdout=(logs / "theirs.log").open("wb"),
                    stderr=subprocess.STDOUT,
                )
            )
            wait_up(ours + "/health", procs[0], "elbowroom")
            wait_up(theirs + "/v1/models", procs[1], "mlx_lm.server")
            # Warm both (load, first prefill), then interleave.
            rate(ours, "smollm2-mlx", 4)
            rate(theirs, str(model), 4)
            rows: list[dict[str, Any]] = []
            for i in range(args.rounds):
                order = [("elbowroom", ours, "smollm2-mlx"), ("mlx_lm.server", theirs, str(model))]
                if i % 2:
                    order.reverse()
                row: dict[str, Any] = {"round": i, "loadavg": os.getloadavg()[0]}
                for name, base, mid in order:
                    row[name] = rate(base, mid, args.tokens)
                row["ratio"] = row["elbowroom"] / row["mlx_lm.server"]
                rows.append(row)
                print(json.dumps(row), flush=True)
        finally:
            for p in procs:
                p.terminate()
            for p in procs:
                try:
                    p.wait(30)
                except subprocess.TimeoutExpired:
                    p.kill()
    ours_r = [r["elbowroom"] for r in rows]
    theirs_r = [r["mlx_lm.server"] for r in rows]
    ratios = [r["ratio"] for r in rows]
    med = statistics.median(ratios)
    versions = subprocess.run(
        [sys.executable, "-m", "pip", "list"], capture_output=True, text=True
    ).stdout
    mlx_v = " ".join(re.findall(r"^(mlx(?:-lm|-cpu)?\s+\S+)", versions, re.M))
    meta = {
        "machine": f"{platform.machine()} {platform.system()}, {os.cpu_count()} cores (shared)",
        "loadavg_end": os.getloadavg(),
        "versions": mlx_v,
        "tokens": args.tokens,
        "rounds": args.rounds,
        "median_ratio": med,
        "met": med >= 0.95,
    }
    RESULTS.mkdir(exist_ok=True)
    (RESULTS / "mlx_decode.json").write_text(json.dumps({"meta": meta, "rows": rows}, indent=1))

    def spread(xs: list[float]) -> str:
        return f"{statistics.median(xs):.2f} ({min(xs):.2f}–{max(xs):.2f})"

    loads = ", ".join(f"{r['loadavg']:.1f}" for r in rows)
    lines = [
        "# MLX decode: elbowroom's engine vs mlx_lm.server (same model, same run)",
        "",
        f"{meta['machine']}; {mlx_v}; SmolLM2-135M-Instruct from the bundled GGUF (Q4_1 as MLX "
        f"4-bit, float32 scales); greedy chat, {args.tokens} tokens; {args.rounds} interleaved "
        "rounds; `benchmarks/mlx_decode.py`. The machine was shared with other work: load "
        f"average per round {loads}.",
        "",
        "| | decode tok/s, median (range) |",
        "|---|---:|",
        f"| elbowroom (mlx engine) | {spread(ours_r)} |",
        f"| mlx_lm.server | {spread(theirs_r)} |",
        f"| ratio | {spread(ratios)} |",
        "",
        f"Target ≥ 0.95×: **{'met' if meta['met'] else 'not met'}** (median ratio {med:.2f}).",
    ]
    (RESULTS / "mlx_decode.md").write_text("\n".join(lines) + "\n")
    print("\n".join(lines))


if __name__ == "__main__":
    main()
