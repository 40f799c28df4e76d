"""How close the footprint estimates are to what the bundled models really hold.

Each case loads a model in a child process (elbowroom.models.calibrate: the engine's own
library and options), runs one short request, and reads /proc/PID/smaps_rollup from the
parent. The prediction is ``estimate.footprint`` with no measurements remembered. Target:
the predicted total (anonymous + file-backed) within 10 % of the measured one.

LLMs also show ``prefilled``: after ~1,500 prompt tokens, how much more of llama.cpp's
compute buffer a long prefill touches (not part of the prediction; see docs/models.md).

    .venv/bin/python benchmarks/estimate_accuracy.py [--quick]

writes benchmarks/results/estimate_accuracy.{json,md}. ``--quick`` measures SmolLM2 only.
Exits 1 when a case misses the target.
"""

from __future__ import annotations

import argparse
import json
import platform
import sys
import time
from pathlib import Path
from typing import Any

from elbowroom.config import load_settings
from elbowroom.models.calibrate import measure_load
from elbowroom.models.catalog import discover
from elbowroom.models.estimate import footprint
from elbowroom.models.spec import ModelSpec
from elbowroom.units import MiB

TARGET = 0.10
RESULTS = Path(__file__).parent / "results"
LLM_CASES = [(512, "f16"), (8192, "f16"), (8192, "q8_0"), (8192, "q4_0")]


def error(predicted: int, measured: int) -> float:
    return (predicted - measured) / measured if measured else float("inf")


def run_case(spec: ModelSpec, n_ctx: int, kv_type: str) -> dict[str, Any]:
    m = measure_load(spec, n_ctx, kv_type, long_prompt=spec.gguf is not None)
    fp = footprint(spec, n_ctx, kv_type=kv_type)
    used = m.used
    row: dict[str, Any] = {
        "model": spec.id,
        "engine": spec.engine,
        "n_ctx": n_ctx,
        "kv_type": kv_type,
        "predicted": {"anonymous": fp.anonymous, "file_backed": fp.file_backed, "total": fp.total},
        "measured": {
            "anonymous": used.anonymous,
            "file_backed": used.file_backed,
            "total": used.resident,
        },
        "stages": {
            k: {"anonymous": v.anonymous, "file_backed": v.file_backed} for k, v in m.stages.items()
        },
        "error_total": error(fp.total, used.resident),
        "error_anonymous": error(fp.anonymous, used.anonymous),
    }
    row["ok"] = abs(row["error_total"]) <= TARGET
    return row


def cases(quick: bool) -> list[tuple[ModelSpec, int, str]]:
    specs = discover(load_settings()).list()
    out: list[tuple[ModelSpec, int, str]] = []
    for spec in specs:
        if spec.source != "bundled" or (quick and spec.id != "smollm2-135m"):
            continue
        if spec.gguf is not None:
            out.extend((spec, n, kv) for n, kv in LLM_CASES)
        else:
            out.append((spec, 0, "f16"))
    return out


def mib(n: int) -> str:
    return f"{n / MiB:.1f}"


def markdown(rows: list[dict[str, Any]], meta: dict[str, Any]) -> str:
    lines = [
        "# Estimate accuracy",
        "",
        f"Measured {meta['date']} on {meta['machine']} (Python {meta['python']}) with"
        " `benchmarks/estimate_accuracy.py`. Sizes in MiB; error = (predicted − measured) /"
        f" measured; target ±{TARGET:.0%} on the total. `prefill +` is how much more"
        " anonymous memory a ~1,500-token prompt touched (not predicted).",
        "",
        "| model | n_ctx | kv | predicted anon | measured anon | predicted file | measured file"
        " | predicted total | measured total | error total | error anon | prefill + | ok |",
        "|---|--:|---|--:|--:|--:|--:|--:|--:|--:|--:|--:|---|",
    ]
    for r in rows:
        p, m = r["predicted"], r["measured"]
        pre = r["stages"].get("prefilled")
        extra = mib(pre["anonymous"] - m["anonymous"]) if pre else "-"
        lines.append(
            f"| {r['model']} | {r['n_ctx'] or '-'} | {r['kv_type'] if r['n_ctx'] else '-'}"
            f" | {mib(p['anonymous'])} | {mib(m['anonymous'])} | {mib(p['file_backed'])}"
            f" | {mib(m['file_backed'])} | {mib(p['total'])} | {mib(m['total'])}"
            f" | {r['error_total']:+.1%} | {r['error_anonymous']:+.1%} | {extra}"
            f" | {'yes' if r['ok'] else '**no**'} |"
        )
    worst = max(rows, key=lambda r: abs(r["error_total"]))
    lines += [
        "",
        f"Worst total error: {worst['error_total']:+.1%} ({worst['model']}, n_ctx"
        f" {worst['n_ctx']}, {worst['kv_type']}).",
        "",
    ]
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="SmolLM2 only")
    args = parser.parse_args(argv)
    rows = []
    for spec, n_ctx, kv_type in cases(args.quick):
        row = run_case(spec, n_ctx, kv_type)
        print(
            f"{spec.id:<16} n_ctx={n_ctx:<5} {kv_type:<5} total err {row['error_total']:+.1%}"
            f"  anon err {row['error_anonymous']:+.1%}",
            flush=True,
        )
        rows.append(row)
    meta = {
        "date": time.strftime("%Y-%m-%d"),
        "machine": f"{platform.machine()} {platform.system()} {platform.release()}",
        "python": platform.python_version(),
        "target": TARGET,
    }
    RESULTS.mkdir(parents=True, exist_ok=True)
    (RESULTS / "estimate_accuracy.json").write_text(
        json.dumps({"meta": meta, "rows": rows}, indent=1) + "\n"
    )
    (RESULTS / "estimate_accuracy.md").write_text(markdown(rows, meta))
    return 0 if all(r["ok"] for r in rows) else 1


if __name__ == "__main__":
    sys.exit(main())
