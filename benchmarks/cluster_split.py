"""Split vs unsplit: one model over two llama.cpp RPC servers on this machine.

Capacity, not speed, is the point of a split (docs/cluster.md): this records what the
network hop costs. Side by side in one run, interleaved per round (>= 5 rounds for a
recording; ``--rounds 1 --tokens 16`` is the smoke run), greedy decoding of the same
prompt with the bundled SmolLM2 at 2 threads:

- ``xllamacpp``: elbowroom's normal engine (the PyPI wheel, in-process);
- ``llama-server``: the same engine and build without RPC devices (the split's reference);
- ``split``: the ``llama-rpc`` engine, an RPC-enabled llama-server whose devices are two
  ``rpc-server`` processes on 127.0.0.1 holding 20 and 10 of the 30 layers (2:1 free).

Per round: decode tokens/s (the engine's own ``predicted_n / predicted_ms``), time
to first token, and whether the text equals the unsplit text. Medians with min-max and the
load average before and after each round go to ``results/cluster_split.{json,md}``.
Needs ``scripts/rpc_engine.sh``'s build.
"""

from __future__ import annotations

import argparse
import json
import os
import socket
import statistics
import subprocess
import sys
import time
from dataclasses import replace
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))
sys.path.insert(0, str(REPO / "tests"))

from bundled_models import bundled_spec  # noqa: E402

from elbowroom.cluster.rpc import rpc_server_args  # noqa: E402
from elbowroom.engines.llama import LlamaEngine  # noqa: E402
from elbowroom.engines.llama_rpc import RpcLlamaEngine, default_binary  # noqa: E402
from elbowroom.engines.options import RpcLlamaOptions  # noqa: E402
from elbowroom.engines.requests import TextRequest  # noqa: E402

PROMPT = "1, 2, 3, 4, 5, 6, 7, 8, 9, 10,"  # greedy counting: never stops early
OPTIONS = RpcLlamaOptions(n_ctx=1024, slots=1, kv_type="f16", cache_ram_bytes=0, threads=2,
                          kv_cache=False)  # fmt: skip
SPLIT = [20, 10]


def loadavg() -> str:
    return " ".join(f"{x:.2f}" for x in os.getloadavg())


def start_rpc() -> tuple[list[subprocess.Popen[bytes]], list[str]]:
    procs, endpoints = [], []
    for _ in SPLIT:
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            port = s.getsockname()[1]
        args = [*rpc_server_args(default_binary("rpc-server"), "127.0.0.1", port, 2)]
        procs.append(subprocess.Popen(args, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL))
        end = time.monotonic() + 30
        while True:
            try:
                socket.create_connection(("127.0.0.1", port), timeout=0.5).close()
                break
            except OSError:
                if time.monotonic() > end:
                    raise SystemExit("rpc-server did not start") from None
                time.sleep(0.05)
        endpoints.append(f"127.0.0.1:{port}")
    return procs, endpoints


def measure(engine: Any, tokens: int) -> dict[str, Any]:
    began = time.monotonic()
    first: list[float] = []

    def emit(_delta: dict[str, Any]) -> None:
        if not first:
            first.append(time.monotonic())

    request = TextRequest(kind="completion", prompt=PROMPT, temperature=0, max_tokens=tokens)
    result = engine.run("completion", request, emit, lambda: False)
    end = time.monotonic()
    timings = result.get("timings") or {}
    generated = int(result["usage"]["completion_tokens"])
    ttft = (first[0] if first else end) - began
    # The engine's own decode timing (tokens after the prompt over their milliseconds).
    decode = 1000.0 * timings.get("predicted_n", 0) / max(1e-9, timings.get("predicted_ms", 0))
    return {"text": result["text"], "tokens": generated, "ttft": ttft, "tok_s": decode}


def run(rounds: int, tokens: int) -> dict[str, Any]:
    spec = bundled_spec("smollm2-135m")
    procs, endpoints = start_rpc()
    out: dict[str, list[dict[str, Any]]] = {"xllamacpp": [], "llama-server": [], "split": []}
    try:
        for r in range(rounds):
            order = list(out) if r % 2 == 0 else list(out)[::-1]  # interleaved
            for name in order:
                before = loadavg()
                engine: Any
                if name == "split":
                    engine = RpcLlamaEngine()
                    opts = replace(OPTIONS, rpc_servers=tuple(endpoints), rpc_split=tuple(SPLIT))
                elif name == "llama-server":  # the same llama.cpp build, unsplit
                    engine = RpcLlamaEngine()
                    opts = OPTIONS
                else:
                    engine = LlamaEngine()
                    opts = OPTIONS  # LlamaEngine reads only its LlamaOptions part
                engine.load(spec, opts)
                try:
                    row = measure(engine, tokens)
                finally:
                    engine.close()
                row.update(round=r, load_before=before, load_after=loadavg())
                out[name].append(row)
                print(f"round {r} {name}: {row['tok_s']:.1f} tok/s, TTFT {row['ttft']:.2f} s",
                      file=sys.stderr)  # fmt: skip
    finally:
        for p in procs:
            p.terminate()
            p.wait(10)
    reference = out["llama-server"][0]["text"]
    return {
        "rounds": rounds,
        "tokens": tokens,
        "split_layers": SPLIT,
        "identical_text": all(r["text"] == reference for r in out["split"] + out["llama-server"]),
        "results": out,
    }


def spread(values: list[float], fmt: str = "{:.1f}") -> str:
    lo, mid, hi = min(values), statistics.median(values), max(values)
    return f"{fmt.format(mid)} ({fmt.format(lo)}–{fmt.format(hi)})"


def report(data: dict[str, Any]) -> str:
    res = data["results"]
    base = statistics.median(r["tok_s"] for r in res["xllamacpp"])
    lines = [
        "# Split over RPC vs unsplit (SmolLM2-135M, 2 threads, this machine)",
        "",
        f"{data['rounds']} interleaved rounds, {data['tokens']} tokens each, greedy; the split "
        f"puts {data['split_layers']} layers on two rpc-servers on 127.0.0.1. Split text identical "
        "to the unsplit llama-server (same llama.cpp build) in every round: "
        f"{'yes' if data['identical_text'] else 'NO'}.",
        "",
        "| engine | decode tok/s median (min–max) | vs unsplit | TTFT s median (min–max) |",
        "|---|---|---|---|",
    ]
    for name, rows in res.items():
        tok = [r["tok_s"] for r in rows]
        lines.append(
            f"| {name} | {spread(tok)} | {statistics.median(tok) / base:.2f}x | "
            f"{spread([r['ttft'] for r in rows], '{:.2f}')} |"
        )
    lines += ["", "Load average (1/5/15 min) before → after each round:", ""]
    for name, rows in res.items():
        for r in rows:
            lines.append(f"- round {r['round']} {name}: {r['load_before']} → {r['load_after']}")
    return "\n".join(lines) + "\n"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--tokens", type=int, default=128)
    parser.add_argument("--out", type=Path, default=REPO / "benchmarks" / "results")
    args = parser.parse_args()
    if not default_binary("llama-server").is_file():
        raise SystemExit("needs the RPC build: scripts/rpc_engine.sh")
    data = run(args.rounds, args.tokens)
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "cluster_split.json").write_text(json.dumps(data, indent=1))
    (args.out / "cluster_split.md").write_text(report(data))
    print(report(data))


if __name__ == "__main__":
    main()
