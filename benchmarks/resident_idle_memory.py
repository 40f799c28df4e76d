"""Resident engines give their memory back: anonymous bytes of `elbowroom serve` and its
runners before the first request vs after every resident engine has idled out.

    .venv/bin/python benchmarks/resident_idle_memory.py [--rounds 3] [--idle 3]

Starts a server with ELBOWROOM_RESIDENT_IDLE=--idle (fresh data/cache/config folders),
samples the anonymous memory (smaps_rollup) of the server's whole process tree while it is
idle, then sends --rounds rounds of speech (piper), transcription (whisper and
pocketsphinx) and embeddings (MiniLM) with the official openai client, waits until
/api/ps lists no runner and every runner pid is gone, and samples again. Target: the two
totals within 10 MB. Writes benchmarks/results/resident_idle_memory.{json,md}.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import re
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from datetime import datetime
from pathlib import Path
from typing import Any

import httpx
import openai
import psutil
from proctree import process_memory, readings, tree, wait_for

from elbowroom.units import MiB, format_size

REPO = Path(__file__).resolve().parents[1]
RESULTS = Path(__file__).parent / "results"
TARGET = 10 * 1000**2  # 10 MB
SENTENCE = "The quick brown fox jumps over the lazy dog. Memory comes back when we are idle."
_LISTENING = re.compile(r"elbowroom listening on (http://\S+)")


def tree_memory(pid: int) -> dict[str, Any]:
    """Anonymous and file-backed bytes of ``pid`` and all its descendants."""
    anonymous = file_backed = 0
    pids = []
    parts = []
    for proc in tree(pid):
        mem = process_memory(proc.pid)
        if mem is None:
            continue
        anonymous += mem.anonymous
        file_backed += mem.file_backed
        pids.append(proc.pid)
        parts.append({"pid": proc.pid, "what": _what(proc), "anonymous": mem.anonymous})
    return {"anonymous": anonymous, "file_backed": file_backed, "pids": pids, "parts": parts}


def _what(proc: psutil.Process) -> str:
    try:
        cmd = " ".join(proc.cmdline())
    except psutil.Error:
        return "?"
    if "resource_tracker" in cmd:
        return "multiprocessing resource tracker"
    if "elbowroom serve" in cmd or "-m elbowroom" in cmd:
        return "server"
    return "runner" if "multiprocessing" in cmd else cmd[:60]


def sample(pid: int, seconds: float = 3.0) -> dict[str, Any]:
    """Median over a few seconds: the server's monitor thread allocates and frees a little."""
    taken = readings(lambda: tree_memory(pid), seconds)
    return {
        "anonymous": int(statistics.median(r["anonymous"] for r in taken)),
        "file_backed": int(statistics.median(r["file_backed"] for r in taken)),
        "pids": taken[-1]["pids"],
        "parts": taken[-1]["parts"],
        "samples": len(taken),
    }


def workload(client: openai.OpenAI, rounds: int) -> list[dict[str, Any]]:
    log = []
    for i in range(rounds):
        t = time.monotonic()
        wav = client.audio.speech.create(
            model="tts-1", voice="alloy", input=SENTENCE, response_format="wav"
        ).content
        mp3 = client.audio.speech.create(
            model="tts-1", voice="alloy", input=SENTENCE, response_format="mp3"
        ).content
        whisper = client.audio.transcriptions.create(model="whisper-1", file=("a.mp3", mp3))
        sphinx = client.audio.transcriptions.create(model="sphinx-en-us", file=("a.wav", wav))
        vectors = client.embeddings.create(
            model="text-embedding-3-small", input=[SENTENCE] * 16 + [f"round {i}"]
        )
        log.append(
            {
                "round": i,
                "seconds": round(time.monotonic() - t, 2),
                "whisper": whisper.text,
                "sphinx": sphinx.text,
                "embeddings": len(vectors.data),
            }
        )
    return log


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--idle", type=float, default=3.0, help="ELBOWROOM_RESIDENT_IDLE")
    args = parser.parse_args()

    home = Path(tempfile.mkdtemp(prefix="elbowroom-bench-"))
    env = {k: v for k, v in os.environ.items() if not k.startswith("ELBOWROOM_")}
    env.update(
        XDG_DATA_HOME=str(home / "data"),
        XDG_CACHE_HOME=str(home / "cache"),
        XDG_CONFIG_HOME=str(home / "config"),
        ELBOWROOM_RESIDENT_IDLE=str(args.idle),
        PYTHONUNBUFFERED="1",
    )
    log_path = home / "server.log"
    load_start = os.getloadavg()
    with open(log_path, "wb") as log:
        server = subprocess.Popen(
            [sys.executable, "-m", "elbowroom", "serve", "--port", "0"],
            cwd=REPO,
            env=env,
            stdout=log,
            stderr=subprocess.STDOUT,
            start_new_session=True,
        )
    try:
        url = wait_for(
            lambda: (m := _LISTENING.search(log_path.read_text(errors="replace"))) and m[1],
            120,
            "the server to listen",
        )
        wait_for(lambda: httpx.get(url + "/health", timeout=2).status_code == 200, 30, "health")
        before = sample(server.pid)

        client = openai.OpenAI(base_url=url + "/v1", api_key="unused", max_retries=0)
        rounds = workload(client, args.rounds)
        peak_rows = httpx.get(url + "/api/ps", timeout=30).json()["models"]
        runner_pids = {int(r["pid"]) for r in peak_rows if r.get("pid")}
        loaded = {r["id"]: {"anonymous": r["anonymous"], "bytes": r["bytes"]} for r in peak_rows}
        during = tree_memory(server.pid)

        idle_started = time.monotonic()
        wait_for(
            lambda: not httpx.get(url + "/api/ps", timeout=30).json()["models"],
            args.idle + 120,
            "every runner to idle out",
        )
        wait_for(lambda: not any(psutil.pid_exists(p) for p in runner_pids), 30, "runner pids gone")
        idle_seconds = time.monotonic() - idle_started
        after = sample(server.pid)
    finally:
        server.send_signal(signal.SIGTERM)
        try:
            server.wait(timeout=30)
        except subprocess.TimeoutExpired:
            os.killpg(server.pid, signal.SIGKILL)
            server.wait(timeout=10)

    delta = after["anonymous"] - before["anonymous"]
    result = {
        "date": datetime.now().isoformat(timespec="seconds"),
        "command": " ".join(
            [".venv/bin/python", "benchmarks/resident_idle_memory.py", *sys.argv[1:]]
        ),
        "machine": {
            "arch": platform.machine(),
            "cpus": os.cpu_count(),
            "python": platform.python_version(),
            "load_start": [round(x, 2) for x in load_start],
            "load_end": [round(x, 2) for x in os.getloadavg()],
        },
        "resident_idle": args.idle,
        "rounds": rounds,
        "before": before,
        "during": during,
        "loaded_runners": loaded,
        "after": after,
        "idle_out_seconds": round(idle_seconds, 1),
        "delta_anonymous": delta,
        "target": TARGET,
        "met": abs(delta) <= TARGET,
    }
    RESULTS.mkdir(exist_ok=True)
    (RESULTS / "resident_idle_memory.json").write_text(json.dumps(result, indent=2) + "\n")
    (RESULTS / "resident_idle_memory.md").write_text(report(result))
    print(report(result))


def report(r: dict[str, Any]) -> str:
    def mib(n: int) -> str:
        return f"{n / MiB:.1f} MiB"

    lines = [
        "# Resident engines give their memory back",
        "",
        f"Command: `{r['command']}`",
        "",
        f"`elbowroom serve` with `ELBOWROOM_RESIDENT_IDLE={r['resident_idle']:g}`; "
        f"{len(r['rounds'])} rounds of speech (piper, wav + mp3), transcription (whisper-1, "
        "sphinx-en-us) and embeddings (17 inputs) through the openai client. Anonymous bytes "
        "(smaps_rollup) of the server and all its children, median of "
        f"{r['before']['samples']} samples over 3 s.",
        "",
        f"Machine: {r['machine']['arch']}, {r['machine']['cpus']} CPUs, Python "
        f"{r['machine']['python']}; load average {r['machine']['load_start']} at start "
        "(2 cores shared with other work).",
        "",
        "| moment | processes | anonymous | file-backed |",
        "|---|---:|---:|---:|",
        f"| before the first request | {len(r['before']['pids'])} | "
        f"{mib(r['before']['anonymous'])} | {mib(r['before']['file_backed'])} |",
        f"| after the last request (runners loaded) | {len(r['during']['pids'])} | "
        f"{mib(r['during']['anonymous'])} | {mib(r['during']['file_backed'])} |",
        f"| after every runner idled out ({r['idle_out_seconds']} s) | "
        f"{len(r['after']['pids'])} | {mib(r['after']['anonymous'])} | "
        f"{mib(r['after']['file_backed'])} |",
        "",
        f"**Anonymous after − before: {format_size(r['delta_anonymous'])}** "
        f"(target within 10 MB: {'met' if r['met'] else 'NOT met'}).",
        "",
        "Processes (last sample):",
        "",
        "| moment | process | anonymous |",
        "|---|---|---:|",
        *[
            f"| {moment} | {part['what']} | {mib(part['anonymous'])} |"
            for moment in ("before", "after")
            for part in r[moment]["parts"]
        ],
        "",
        "Runners loaded after the last request (from /api/ps; others had idled out already):",
        "",
        "| model | anonymous | total bytes |",
        "|---|---:|---:|",
    ]
    for model, row in r["loaded_runners"].items():
        lines.append(f"| {model} | {mib(row['anonymous'])} | {mib(row['bytes'])} |")
    lines += ["", "Rounds:", "", "| round | seconds | whisper | sphinx |", "|---:|---:|---|---|"]
    for row in r["rounds"]:
        lines.append(f"| {row['round']} | {row['seconds']} | {row['whisper']} | {row['sphinx']} |")
    return "\n".join(lines) + "\n"


if __name__ == "__main__":
    main()
