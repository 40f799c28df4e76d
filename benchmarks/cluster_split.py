"""Split vs unsplit: one model over two llama.cpp RPC servers on this machine.

Capacity, not speed, is the point of a split (docs/cluster.md): this records what the
network hop costs. Side by side in one run, interleaved per round (>= 5 rounds for a
recording; ``--rounds 1 --tokens 16`` is the smoke run), greedy decoding of the same
prompt with the bundled SmolLM2 at 2 threads:

- ``xllamacpp``: elbowroom's normal engine (the PyPI wheel, in-process);
- ``llama-server``: the same engine and build without RPC devices (the split's reference);
- ``split``: the ``llama-rpc`` engine, an RPC-enabled llama-server whose devices are two
  ``rpc-server`` processes on 127.0.0.1, the 30 layers split in proportion to a 2:1 free
  memory (``split.split_layers``: 20 and 10).

Before the rounds, one split load with llama.cpp's debug log checks where the layers went
(its own "layer N assigned to device RPCk" lines) against the plan. Per round: decode
tokens/s (the engine's own ``predicted_n / predicted_ms``), time to first token, whether
the text equals the unsplit text, and for the split each RPC server's resident bytes after
the answer beside its share's prediction (``split_plan``: weights, KV, compute buffer,
runtime). Medians with min-max and the load average before and after each round go to
``results/cluster_split.{json,md}``. Needs ``scripts/rpc_engine.sh``'s build.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import socket
import statistics
import subprocess
import sys
import time
from collections import Counter
from dataclasses import replace
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))
sys.path.insert(0, str(REPO / "tests"))

from bundled_models import bundled_spec  # noqa: E402

from elbowroom.cluster.rpc import rpc_server_args  # noqa: E402
from elbowroom.cluster.split import split_layers  # noqa: E402
from elbowroom.cluster.split_plan import RPC_SERVER_RUNTIME, share_compute  # noqa: E402
from elbowroom.engines.llama import LlamaEngine  # noqa: E402
from elbowroom.engines.llama_rpc import RpcLlamaEngine, default_binary  # noqa: E402
from elbowroom.engines.options import RpcLlamaOptions  # noqa: E402
from elbowroom.engines.requests import TextRequest  # noqa: E402
from elbowroom.memory.process import measure_pid  # noqa: E402
from elbowroom.models.estimate import kv_bytes  # noqa: E402

MODEL = "smollm2-135m"
PROMPT = "1, 2, 3, 4, 5, 6, 7, 8, 9, 10,"  # greedy counting: never stops early
N_CTX = 1024
OPTIONS = RpcLlamaOptions(n_ctx=N_CTX, slots=1, kv_type="f16", cache_ram_bytes=0, threads=2,
                          kv_cache=False)  # fmt: skip
FREE = {"rpc0": 2, "rpc1": 1}  # the two "nodes'" free memory, in proportion
MiB = 1024**2


def loadavg() -> str:
    return " ".join(f"{x:.2f}" for x in os.getloadavg())


def start_rpc(n: int) -> tuple[list[subprocess.Popen[bytes]], list[str]]:
    procs, endpoints = [], []
    for _ in range(n):
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


def placed_layers(spec: Any, endpoints: list[str], split: list[int]) -> dict[str, int]:
    """Load the split once with llama.cpp's debug log: repeating layers per device."""
    engine = RpcLlamaEngine()
    opts = replace(OPTIONS, rpc_servers=tuple(endpoints), rpc_split=tuple(split), log_level="debug")
    engine.load(spec, opts)
    try:
        measure(engine, 4)
        assert engine.log_path is not None
        log = engine.log_path.read_text(errors="replace")
    finally:
        engine.close()
    pattern = r"layer\s+(\d+) assigned to device (\S+?),"
    found = Counter(d for il, d in re.findall(pattern, log) if int(il) < spec.gguf.n_layers)
    return dict(sorted(found.items()))


def predicted_shares(spec: Any, split: list[int]) -> list[int]:
    """Each RPC server's predicted bytes (cluster/split_plan.py, the engine not included):
    its blocks (+ the output layer on the last), its KV, a compute buffer, the runtime."""
    info = spec.gguf
    sizes, out, first = list(info.layer_bytes), [], 0
    per_layer_kv = kv_bytes(info, N_CTX, 1, "f16") // info.n_layers
    for i, n in enumerate(split):
        weights = sum(sizes[first : first + n]) + (info.output_bytes if i == len(split) - 1 else 0)
        compute = share_compute(info, N_CTX, 1, first=i == 0)
        out.append(weights + per_layer_kv * n + compute + RPC_SERVER_RUNTIME)
        first += n
    return out


def run(rounds: int, tokens: int) -> dict[str, Any]:
    spec = bundled_spec(MODEL)
    split = list(split_layers(spec.gguf.n_layers, FREE).layers.values())
    procs, endpoints = start_rpc(len(split))
    out: dict[str, list[dict[str, Any]]] = {"xllamacpp": [], "llama-server": [], "split": []}
    try:
        placed = placed_layers(spec, endpoints, split)
        for r in range(rounds):
            order = list(out) if r % 2 == 0 else list(out)[::-1]  # interleaved
            for name in order:
                before = loadavg()
                engine: Any
                if name == "split":
                    engine = RpcLlamaEngine()
                    opts = replace(OPTIONS, rpc_servers=tuple(endpoints), rpc_split=tuple(split))
                elif name == "llama-server":  # the same llama.cpp build, unsplit
                    engine = RpcLlamaEngine()
                    opts = OPTIONS
                else:
                    engine = LlamaEngine()
                    opts = OPTIONS  # LlamaEngine reads only its LlamaOptions part
                engine.load(spec, opts)
                try:
                    row = measure(engine, tokens)
                    if name == "split":
                        row["rpc_resident"] = [measure_pid(p.pid).resident for p in procs]
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
        "free": FREE,
        "split_layers": split,
        "placed_layers": placed,
        "placed_as_planned": placed == {f"RPC{i}": n for i, n in enumerate(split)},
        "predicted_share_bytes": predicted_shares(spec, split),
        "identical_text": all(r["text"] == reference for r in out["split"] + out["llama-server"]),
        "results": out,
    }


def spread(values: list[float], fmt: str = "{:.1f}") -> str:
    lo, mid, hi = min(values), statistics.median(values), max(values)
    return f"{fmt.format(mid)} ({fmt.format(lo)}–{fmt.format(hi)})"


def report(data: dict[str, Any]) -> str:
    res = data["results"]
    base = statistics.median(r["tok_s"] for r in res["llama-server"])  # same build, unsplit
    split_rows = res["split"]
    resident = [
        [r["rpc_resident"][i] for r in split_rows] for i in range(len(data["split_layers"]))
    ]
    lines = [
        "# Split over RPC vs unsplit (SmolLM2-135M, 2 threads, this machine)",
        "",
        f"{data['rounds']} interleaved rounds, {data['tokens']} tokens each, greedy, n_ctx "
        f"{N_CTX}. The split gives two rpc-servers on 127.0.0.1 free memory "
        f"{':'.join(str(v) for v in data['free'].values())}, hence "
        f"{data['split_layers']} of the 30 layers (largest remainder); llama.cpp's own "
        f"per-layer device assignment: {data['placed_layers']} "
        f"({'as planned' if data['placed_as_planned'] else 'NOT as planned'}). Split text "
        "identical to the unsplit llama-server (same llama.cpp build) in every round: "
        f"{'yes' if data['identical_text'] else 'NO'}.",
        "",
        "Capacity, not speed, is the point: the split lets a model larger than any one "
        "machine run at all; the hop between devices costs decode speed.",
        "",
        "| engine | decode tok/s median (min–max) | vs llama-server unsplit "
        "| TTFT s median (min–max) |",
        "|---|---|---|---|",
    ]
    for name, rows in res.items():
        tok = [r["tok_s"] for r in rows]
        lines.append(
            f"| {name} | {spread(tok)} | {statistics.median(tok) / base:.2f}x | "
            f"{spread([r['ttft'] for r in rows], '{:.2f}')} |"
        )
    lines += [
        "",
        "Each RPC server's resident memory after the answer vs its share's prediction "
        "(cluster/split_plan.py: blocks, KV, compute buffer, runtime; the compute buffer "
        "is reserved whole, short prompts touch part of it):",
        "",
        "| device | layers | predicted | resident median (min–max) |",
        "|---|---|---|---|",
    ]
    for i, n in enumerate(data["split_layers"]):
        mib = [v / MiB for v in resident[i]]
        lines.append(
            f"| RPC{i} | {n} | {data['predicted_share_bytes'][i] / MiB:.1f} MiB | "
            f"{spread(mib)} MiB |"
        )
    lines += ["", "Load average (1/5/15 min) before → after each round:", ""]
    for name, rows in res.items():
        for r in rows:
            lines.append(f"- round {r['round']} {name}: {r['load_before']} → {r['load_after']}")
    return "\n".join(lines) + "\n"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--tokens", type=int, default=64)
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
