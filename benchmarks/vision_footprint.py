"""Vision footprint: predicted vs measured bytes of vision models, through a real server,
side by side with the same text model alone (the baseline).

No vision-language model can be downloaded here: each vision case is a copy of the bundled
SmolLM2-135M beside a genuine projector with random weights (tests/vision_gguf.py, gemma3
type) of a different shape, so the encoder term varies:

  text   SmolLM2 alone (the text estimate's own error: the baseline)
  v448   448 px, patch 14, pool 2: 1,024 patches, 2 layers x 192, 256 tokens per image
  v896   896 px, patch 14, pool 4: 4,096 patches, 2 layers x 192, 256 tokens per image
  deep   448 px, patch 14, pool 2: 1,024 patches, 8 layers x 384 (weights ~40 MiB)

Each round starts a fresh server (its own data folder: no measurement is remembered, so
every number is a prediction), and per model: loads it (POST /api/models/ID/load), reads
the predicted bytes and the runner's measured anonymous + file-backed bytes (at load,
against the prediction less what appears with serving), sends one chat with a 640 x 480 PNG
(no image for the text model), reads the runner again (in use, against the whole
prediction), and unloads it. Target: within ±10 % in both states.

    .venv/bin/python benchmarks/vision_footprint.py [--quick] [--rounds N]

writes benchmarks/results/vision_footprint.{json,md}; ``--quick`` is a smoke run (one round,
text and v448 or ``--cases``, results in a temporary folder). Exits 1 when a case misses
the target.
"""

from __future__ import annotations

import argparse
import base64
import io
import json
import os
import platform
import shutil
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO / "tests"))
sys.path.insert(0, str(REPO / "tests" / "e2e"))

import numpy as np  # noqa: E402
from serverproc import ServerProcess  # noqa: E402
from vision_gguf import write_projector  # noqa: E402

from elbowroom.config import load_settings  # noqa: E402
from elbowroom.memory.process import measure_pid  # noqa: E402
from elbowroom.models.catalog import discover  # noqa: E402
from elbowroom.models.estimate import footprint  # noqa: E402
from elbowroom.units import MiB  # noqa: E402

TARGET = 0.10
RESULTS = REPO / "benchmarks" / "results"
TEXT = "smollm2-135m"
CASES: dict[str, dict[str, int] | None] = {
    "text": None,
    "v448": {"image_size": 448, "scale_factor": 2},
    "v896": {"image_size": 896, "scale_factor": 4},
    "deep": {"image_size": 448, "scale_factor": 2, "n_layer": 8, "n_embd": 384, "n_ff": 1536},
}
SERVER_ARGS = ("--ctx", "1024", "--slots", "2")


def make_models(root: Path, names: list[str]) -> Path:
    """One folder per vision case: a hard link (or copy) of SmolLM2 and its projector."""
    src = next(s for s in discover(load_settings(environ={})).list() if s.id == TEXT).path
    for name in names:
        shape = CASES[name]
        if shape is None:
            continue
        folder = root / name
        folder.mkdir(parents=True, exist_ok=True)
        try:
            os.link(src, folder / f"{name}.gguf")
        except OSError:
            shutil.copyfile(src, folder / f"{name}.gguf")
        write_projector(folder / f"mmproj-{name}.gguf", **shape)
    return root


def picture() -> str:
    from PIL import Image

    pixels = np.random.default_rng(7).integers(0, 255, (480, 640, 3), dtype=np.uint8)
    buf = io.BytesIO()
    Image.fromarray(pixels).save(buf, "PNG")
    return "data:image/png;base64," + base64.b64encode(buf.getvalue()).decode()


def one_model(server: ServerProcess, models: Path, name: str, image: str) -> dict[str, Any]:
    model = TEXT if name == "text" else name
    with server.http() as http:
        r = http.post(f"/api/models/{model}/load")
        r.raise_for_status()
    row = next(r for r in server.ps() if r["id"] == model)
    settings = load_settings(environ={"ELBOWROOM_MODELS_DIR": str(models)})
    fp = footprint(discover(settings).get(model), row["n_ctx"], row["slots"], row["kv_type"])
    assert fp.total == row["predicted"], (fp.total, row["predicted"])
    parts: list[dict[str, Any]] = [{"type": "text", "text": "Describe it in one word."}]
    if name != "text":
        parts.append({"type": "image_url", "image_url": {"url": image}})
    out = server.openai().chat.completions.create(
        model=model,
        messages=[{"role": "user", "content": parts}],  # type: ignore[list-item,misc]
        max_tokens=2,
    )
    used = measure_pid(int(row["pid"]))
    with server.http() as http:
        http.post(f"/api/models/{model}/unload").raise_for_status()
    return {
        "predicted_at_load": fp.at_load,
        "measured_at_load": row["anonymous"] + row["file_backed"],
        "predicted_in_use": fp.total,
        "measured_in_use": used.anonymous + used.file_backed,
        "prompt_tokens": out.usage.prompt_tokens if out.usage else None,
    }


def error(measured: int, predicted: int) -> float:
    return (measured - predicted) / predicted


def summarize(rows: list[dict[str, Any]]) -> dict[str, Any]:
    out: dict[str, Any] = {}
    for state in ("at_load", "in_use"):
        errs = [error(r[f"measured_{state}"], r[f"predicted_{state}"]) for r in rows]
        out[state] = {
            "median": statistics.median(errs),
            "min": min(errs),
            "max": max(errs),
            "predicted": rows[0][f"predicted_{state}"],
            "measured_median": statistics.median(r[f"measured_{state}"] for r in rows),
        }
    out["ok"] = all(abs(out[s][k]) <= TARGET for s in ("at_load", "in_use") for k in ("min", "max"))
    out["prompt_tokens"] = rows[0]["prompt_tokens"]
    return out


def markdown(result: dict[str, Any]) -> str:
    meta = result["meta"]
    lines = [
        "# Vision footprint: predicted vs measured",
        "",
        f"{meta['rounds']} rounds, one fresh server each ({' '.join(SERVER_ARGS)}, no prompt-"
        f"cache grant); {meta['machine']}; load average before {meta['loadavg_before']}, "
        f"after {meta['loadavg_after']}. Error = (measured − predicted) / predicted, median "
        f"and range over the rounds; target ±{TARGET:.0%}. `benchmarks/vision_footprint.py`.",
        "",
        "| case | tokens (prompt) | at load: predicted | measured | error (range) "
        "| in use: predicted | measured | error (range) | ok |",
        "|---|---|---|---|---|---|---|---|---|",
    ]
    for name, s in result["cases"].items():
        a, u = s["at_load"], s["in_use"]
        lines.append(
            f"| {name} | {s['prompt_tokens']} | {a['predicted'] / MiB:.1f} MiB "
            f"| {a['measured_median'] / MiB:.1f} MiB | {a['median']:+.1%} "
            f"({a['min']:+.1%} .. {a['max']:+.1%}) | {u['predicted'] / MiB:.1f} MiB "
            f"| {u['measured_median'] / MiB:.1f} MiB | {u['median']:+.1%} "
            f"({u['min']:+.1%} .. {u['max']:+.1%}) | {'yes' if s['ok'] else 'NO'} |"
        )
    lines += [
        "",
        "`text` is the baseline: SmolLM2 alone, a chat without an image. The vision cases "
        "are the same file with a random-weight projector beside it, and the chat carries "
        "one 640 x 480 PNG.",
    ]
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--quick", action="store_true", help="one round, text and v448 (smoke)")
    ap.add_argument("--cases", default=None, help=f"comma-separated, of {', '.join(CASES)}")
    args = ap.parse_args(argv)
    names = ["text", "v448"] if args.quick else list(CASES)
    if args.cases:
        names = [n for n in args.cases.split(",") if n in CASES]
    rounds = 1 if args.quick else args.rounds
    loadavg_before = " ".join(f"{x:.2f}" for x in os.getloadavg())
    per_case: dict[str, list[dict[str, Any]]] = {n: [] for n in names}
    image = picture()
    with tempfile.TemporaryDirectory(prefix="vision-bench-") as tmp:
        models = make_models(Path(tmp) / "models", names)
        for i in range(rounds):
            home = Path(tmp) / f"round{i}"
            home.mkdir()
            env = {"ELBOWROOM_KV_RAM_MAX": "0", "ELBOWROOM_MODELS_DIR": str(models)}
            server = ServerProcess(home, *SERVER_ARGS, env=env).start()
            try:
                for name in names:
                    per_case[name].append(one_model(server, models, name, image))
                    print(f"round {i + 1}/{rounds} {name}: {per_case[name][-1]}", flush=True)
            finally:
                server.stop()
    result = {
        "meta": {
            "rounds": rounds,
            "machine": f"{platform.machine()}, {os.cpu_count()} CPUs, {platform.system()}",
            "loadavg_before": loadavg_before,
            "loadavg_after": " ".join(f"{x:.2f}" for x in os.getloadavg()),
            "when": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()),
        },
        "cases": {name: summarize(rows) for name, rows in per_case.items()},
        "rounds": per_case,
    }
    out = RESULTS if not args.quick else Path(tempfile.mkdtemp(prefix="vision-bench-out-"))
    out.mkdir(parents=True, exist_ok=True)
    (out / "vision_footprint.json").write_text(json.dumps(result, indent=2) + "\n")
    (out / "vision_footprint.md").write_text(markdown(result))
    print(markdown(result))
    print(f"wrote {out / 'vision_footprint.md'}")
    return 0 if all(s["ok"] for s in result["cases"].values()) else 1


if __name__ == "__main__":
    sys.exit(main())
