"""Soak: many mixed requests over every bundled model, then idle-out; nothing may be left.

    .venv/bin/python benchmarks/soak.py [--rounds 5] [--requests 200] [--concurrency 4]

Starts `elbowroom serve` (fresh data/cache/config folders, gemma3-270m linked from the
user's data folder when prepared there, ELBOWROOM_KEEP_ALIVE and ELBOWROOM_RESIDENT_IDLE =
--idle, --ctx 512), runs a warm-up (--warmup requests: lazy
imports, thread pools and allocator arenas settle) and waits until every runner has idled
out. That state is the baseline: the anonymous bytes (smaps_rollup) of the server and all
its children, the server's open fds and threads, and its child processes. Then, --rounds
times: --requests requests at --concurrency (chat, chat stream, stream cancelled after its
first chunk, transcription, speech, embeddings; round-robin over the bundled models of each
kind, with the official openai client), idle-out, sample again.

Targets, per round: anonymous bytes within 5 % of the baseline; no more fds (the client's
pooled connections are closed before each sample; the fds are also listed by kind, so a
socket, a pipe and a file are told apart), no more child processes, threads at most the
baseline's plus the executor's workers (they stay idle). Each sample notes the server's
uptime: its memory monitor keeps one sample a second for monitor_history (600) s, a ring
that fills during the first rounds by design (~2 KB a sample).
Writes benchmarks/results/soak.{json,md}.

--trace DIR runs the server under soak_trace.py and takes a heap probe at each sample
(tracemalloc, glibc's and Python's allocator statistics): where the bytes went.
"""

from __future__ import annotations

import argparse
import itertools
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
from collections import Counter
from concurrent.futures import ThreadPoolExecutor
from datetime import datetime
from pathlib import Path
from typing import Any

import httpx
import openai
import psutil
from proctree import process_memory, readings, wait_for

from elbowroom.units import MiB, format_size

REPO = Path(__file__).resolve().parents[1]
RESULTS = Path(__file__).parent / "results"
MEMORY_TOLERANCE = 0.05
RING_SAMPLES = 600  # monitor_history / monitor_interval at their defaults
THREAD_SLACK = 8  # idle executor workers a round may leave (bounded by the pool, not a leak)
SENTENCE = "The quick brown fox jumps over the lazy dog, and memory comes back when idle."
KINDS = ("chat", "stream", "cancel", "transcribe", "speak", "embed")
_LISTENING = re.compile(r"elbowroom listening on (http://\S+)")


def ring_sample_bytes(samples: int = 200) -> int:
    """Bytes one sample in the memory monitor's ring buffer holds, measured here with the
    server's own code and this machine's probe (tracemalloc over ``samples`` recorded)."""
    import gc
    import tracemalloc

    from elbowroom.config import Settings
    from elbowroom.memory.monitor import Monitor
    from elbowroom.memory.probe import default_probe

    settings = Settings()
    monitor = Monitor.from_settings(
        settings, default_probe(settings), own_usage=lambda: 60 * MiB, history_seconds=1e6
    )
    monitor.sample_now()  # first-call caches (the probe's paths, the cgroup) out of the count
    tracemalloc.start()
    try:
        gc.collect()
        before = tracemalloc.get_traced_memory()[0]
        for _ in range(samples):
            monitor.sample_now()
        gc.collect()
        return (tracemalloc.get_traced_memory()[0] - before) // samples
    finally:
        tracemalloc.stop()


def fd_kinds(pid: int) -> dict[str, int]:
    """The server's open fds by what they point at (socket, pipe, anon_inode:[eventpoll],
    a path): a count alone cannot tell a leak from a connection the client keeps open."""
    kinds: Counter[str] = Counter()
    for fd in os.listdir(f"/proc/{pid}/fd"):
        try:
            target = os.readlink(f"/proc/{pid}/fd/{fd}")
        except FileNotFoundError:  # closed meanwhile
            continue
        kinds[re.sub(r":\[\d+\]$", "", target)] += 1
    return dict(sorted(kinds.items()))


def snapshot(pid: int) -> dict[str, Any]:
    """What the server tree holds now: anonymous bytes, fds, threads, children."""
    root = psutil.Process(pid)
    children = root.children(recursive=True)
    fds = fd_kinds(pid)
    mems = [process_memory(proc.pid) for proc in [root, *children]]
    anonymous = sum(m.anonymous for m in mems if m is not None)
    server = mems[0]
    return {
        "anonymous": anonymous,
        "server_anonymous": server.anonymous if server is not None else 0,
        "fds": sum(fds.values()),
        "fd_kinds": fds,
        "threads": root.num_threads(),
        "children": sorted(c.pid for c in children),
        "child_cmds": [" ".join(c.cmdline())[:80] for c in children],
    }


def sample(pid: int, seconds: float = 3.0) -> dict[str, Any]:
    """Medians over a few seconds (the monitor thread allocates and frees a little)."""
    taken = readings(lambda: snapshot(pid), seconds)
    last = taken[-1]
    return {
        "anonymous": int(statistics.median(r["anonymous"] for r in taken)),
        "server_anonymous": int(statistics.median(r["server_anonymous"] for r in taken)),
        "fds": int(statistics.median(r["fds"] for r in taken)),
        "threads": int(statistics.median(r["threads"] for r in taken)),
        "fd_kinds": last["fd_kinds"],
        "children": last["children"],
        "child_cmds": last["child_cmds"],
        "samples": len(taken),
    }


class Workload:
    """One request of each kind, on the bundled models the server lists."""

    def __init__(self, url: str, models: dict[str, list[str]], max_tokens: int) -> None:
        self.url = url
        self.client = self._client()
        self.models = models
        self.max_tokens = max_tokens
        self._next = {kind: itertools.cycle(ids) for kind, ids in models.items() if ids}
        self.audio = self.client.audio.speech.create(
            model="tts-1", voice="alloy", input=SENTENCE, response_format="wav"
        ).content

    def _client(self) -> openai.OpenAI:
        return openai.OpenAI(base_url=self.url + "/v1", api_key="unused", max_retries=0)

    def hang_up(self) -> None:
        """Close the client's pooled connections: the server's fds for them are not leaks."""
        self.client.close()
        self.client = self._client()

    def kinds(self) -> list[str]:
        need = {"chat": "llm", "stream": "llm", "cancel": "llm", "transcribe": "asr"}
        need |= {"speak": "tts", "embed": "embedding"}
        return [k for k in KINDS if need[k] in self._next]

    def model(self, kind: str) -> str:
        return next(self._next[kind])

    def run(self, kind: str, i: int) -> str:
        """Send one request; the outcome's name ("ok", or the error's class)."""
        messages = [{"role": "user", "content": f"Count to three. ({i})"}]
        try:
            if kind == "chat":
                self.client.chat.completions.create(
                    model=self.model("llm"), messages=messages, max_tokens=self.max_tokens
                )
            elif kind == "stream":
                for _ in self.client.chat.completions.create(
                    model=self.model("llm"),
                    messages=messages,
                    max_tokens=self.max_tokens,
                    stream=True,
                ):
                    pass
            elif kind == "cancel":
                stream = self.client.chat.completions.create(
                    model=self.model("llm"), messages=messages, max_tokens=256, stream=True
                )
                next(iter(stream))
                stream.close()  # the client goes away mid-stream
            elif kind == "transcribe":
                self.client.audio.transcriptions.create(
                    model=self.model("asr"), file=("a.wav", self.audio)
                )
            elif kind == "speak":
                self.client.audio.speech.create(
                    model=self.model("tts"), voice="alloy", input=f"{SENTENCE} {i}"
                )
            else:
                self.client.embeddings.create(
                    model=self.model("embedding"), input=[SENTENCE, f"request {i}"]
                )
        except openai.APIStatusError as exc:
            return f"{exc.status_code}"
        except openai.APIError as exc:
            return type(exc).__name__
        return "ok"


def run_requests(work: Workload, n: int, concurrency: int, offset: int) -> dict[str, Any]:
    kinds = work.kinds()
    jobs = [(kinds[i % len(kinds)], offset + i) for i in range(n)]
    began = time.monotonic()
    with ThreadPoolExecutor(concurrency) as pool:
        outcomes = list(pool.map(lambda job: (job[0], work.run(*job)), jobs))
    by_kind: dict[str, Counter[str]] = {}
    for kind, outcome in outcomes:
        by_kind.setdefault(kind, Counter())[outcome] += 1
    return {
        "requests": n,
        "seconds": round(time.monotonic() - began, 1),
        "outcomes": {k: dict(v) for k, v in by_kind.items()},
        "ok": sum(1 for _, o in outcomes if o == "ok"),
    }


def idle_out(url: str, timeout: float) -> float:
    began = time.monotonic()
    pids: set[int] = set()

    def empty() -> bool:
        rows = httpx.get(url + "/api/ps", timeout=30).json()["models"]
        pids.update(int(r["pid"]) for r in rows if r.get("pid"))
        return not rows

    wait_for(empty, timeout, "every runner to idle out")
    wait_for(lambda: not any(psutil.pid_exists(p) for p in pids), 30, "runner pids gone")
    return round(time.monotonic() - began, 1)


def ring_growth(base: dict[str, Any], after: dict[str, Any], sample_bytes: int) -> int:
    """Bytes the monitor's ring buffer gained between two samples (an estimate: one sample
    a second, at most RING_SAMPLES): bounded by design, and counted in the totals."""
    held = [min(RING_SAMPLES, m["uptime"]) for m in (base, after)]
    return (held[1] - held[0]) * sample_bytes


def judge(base: dict[str, Any], after: dict[str, Any]) -> dict[str, Any]:
    delta = after["anonymous"] - base["anonymous"]
    checks = {
        "memory": abs(delta) <= MEMORY_TOLERANCE * base["anonymous"],
        "fds": after["fds"] <= base["fds"],
        "threads": after["threads"] <= base["threads"] + THREAD_SLACK,
        "children": len(after["children"]) <= len(base["children"]),
    }
    return {
        "delta_anonymous": delta,
        "delta_percent": round(100 * delta / base["anonymous"], 2),
        "checks": checks,
        "met": all(checks.values()),
    }


def link_gemma(home: Path) -> None:
    """gemma3-270m is assembled once into the user's data folder (`elbowroom ... prepare`);
    the fresh data folder links to it, as the e2e tests do."""
    from elbowroom.config import load_settings
    from elbowroom.models.bundled import gemma_path

    source = gemma_path(load_settings())
    target = home / "data" / "elbowroom" / "bundled" / source.name
    if source.is_file() and not target.exists():
        target.parent.mkdir(parents=True, exist_ok=True)
        target.symlink_to(source)


def start_server(
    home: Path, idle: float, trace: Path | None = None, extra_env: dict[str, str] | None = None
) -> tuple[subprocess.Popen[bytes], str]:
    link_gemma(home)
    env = {k: v for k, v in os.environ.items() if not k.startswith("ELBOWROOM_")}
    env.update(
        XDG_DATA_HOME=str(home / "data"),
        XDG_CACHE_HOME=str(home / "cache"),
        XDG_CONFIG_HOME=str(home / "config"),
        ELBOWROOM_RESIDENT_IDLE=str(idle),
        ELBOWROOM_KEEP_ALIVE=str(idle),
        PYTHONUNBUFFERED="1",
    )
    env.update(extra_env or {})
    entry = ["-m", "elbowroom"]
    if trace is not None:
        env["SOAK_TRACE_DIR"] = str(trace)
        entry = [str(Path(__file__).with_name("soak_trace.py"))]
    log_path = home / "server.log"
    with open(log_path, "wb") as log:
        server = subprocess.Popen(
            [sys.executable, *entry, "serve", "--port", "0", "--ctx", "512"],
            cwd=REPO,
            env=env,
            stdout=log,
            stderr=subprocess.STDOUT,
            start_new_session=True,
        )
    url = wait_for(
        lambda: (m := _LISTENING.search(log_path.read_text(errors="replace"))) and m[1],
        120,
        "the server to listen",
    )
    wait_for(lambda: httpx.get(url + "/health", timeout=2).status_code == 200, 30, "health")
    return server, url


def bundled_models(url: str) -> dict[str, list[str]]:
    cards = httpx.get(url + "/v1/models", timeout=30).json()["data"]
    models: dict[str, list[str]] = {}
    for card in cards:
        models.setdefault(card["kind"], []).append(card["id"])
    return models


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--requests", type=int, default=200, help="per round")
    parser.add_argument("--warmup", type=int, default=30)
    parser.add_argument("--concurrency", type=int, default=4)
    parser.add_argument("--max-tokens", type=int, default=16)
    parser.add_argument("--idle", type=float, default=10.0, help="keep-alive / resident idle")
    parser.add_argument("--out", default="soak", help="results/<out>.{json,md}")
    parser.add_argument(
        "--trace",
        type=Path,
        help="run the server under soak_trace.py; heap probes at each sample land in DIR",
    )
    parser.add_argument(
        "--env",
        action="append",
        default=[],
        metavar="NAME=VALUE",
        help="set in the server's environment (e.g. ELBOWROOM_TRIM_WHEN_IDLE=false)",
    )
    args = parser.parse_args()
    extra_env = dict(item.split("=", 1) for item in args.env)

    home = Path(tempfile.mkdtemp(prefix="elbowroom-soak-"))
    ring_bytes = ring_sample_bytes()
    load_start = os.getloadavg()
    server, url = start_server(home, args.idle, args.trace, extra_env)
    began = time.monotonic()

    def take() -> dict[str, Any]:
        # The server's uptime says how full its memory monitor's ring buffer is: one sample
        # a second for the last monitor_history (600) s, ~2 KB each, counted like the rest.
        return {**sample(server.pid), "uptime": round(time.monotonic() - began)}

    probes = itertools.count()

    def probe() -> None:
        if args.trace is not None:  # the heap as each sample saw it (soak_trace.py)
            n = next(probes)
            server.send_signal(signal.SIGUSR1)
            wait_for((args.trace / f"{n}.pickle").is_file, 120, f"heap probe {n}")

    try:
        cold = take()
        probe()
        models = bundled_models(url)
        work = Workload(url, models, args.max_tokens)
        warm = run_requests(work, args.warmup, args.concurrency, 0)
        warm_idle = idle_out(url, args.idle + 180)
        work.hang_up()
        base = take()
        probe()
        rounds = []
        for r in range(args.rounds):
            ran = run_requests(work, args.requests, args.concurrency, (r + 1) * 100_000)
            idle = idle_out(url, args.idle + 180)
            work.hang_up()
            after = take()
            probe()
            rounds.append({"round": r, **ran, "idle_out_seconds": idle, "after": after})
            rounds[-1].update(judge(base, after))
            rounds[-1]["ring_growth_estimate"] = ring_growth(base, after, ring_bytes)
            print(f"round {r}: {ran['ok']}/{ran['requests']} ok, {rounds[-1]['delta_percent']} %")
    finally:
        server.send_signal(signal.SIGTERM)
        try:
            server.wait(timeout=60)
        except subprocess.TimeoutExpired:
            os.killpg(server.pid, signal.SIGKILL)
            server.wait(timeout=10)

    result = {
        "date": datetime.now().isoformat(timespec="seconds"),
        "command": " ".join([".venv/bin/python", "benchmarks/soak.py", *sys.argv[1:]]),
        "machine": {
            "arch": platform.machine(),
            "cpus": os.cpu_count(),
            "python": platform.python_version(),
            "load_start": [round(x, 2) for x in load_start],
            "load_end": [round(x, 2) for x in os.getloadavg()],
        },
        "models": models,
        "settings": vars(args),
        "ring_sample_bytes": ring_bytes,
        "cold": cold,
        "warmup": {**warm, "idle_out_seconds": warm_idle},
        "baseline": base,
        "rounds": rounds,
        "met": all(r["met"] for r in rounds),
        "exit_code": server.returncode,
    }
    RESULTS.mkdir(exist_ok=True)
    (RESULTS / f"{args.out}.json").write_text(json.dumps(result, indent=2, default=str) + "\n")
    (RESULTS / f"{args.out}.md").write_text(report(result))
    print(report(result))


def report(r: dict[str, Any]) -> str:
    def mib(n: int) -> str:
        return f"{n / MiB:.1f} MiB"

    s, base = r["settings"], r["baseline"]
    deltas = [x["delta_percent"] for x in r["rounds"]]
    spread = (
        f"median {statistics.median(deltas):+.2f} %, min {min(deltas):+.2f} %, "
        f"max {max(deltas):+.2f} %"
        if deltas
        else "no rounds"
    )
    lines = [
        "# Soak: mixed requests, then idle-out",
        "",
        f"Command: `{r['command']}`",
        "",
        f"`elbowroom serve --ctx 512`, keep-alive and resident idle {s['idle']:g} s; models: "
        + ", ".join(f"{k}: {', '.join(v)}" for k, v in r["models"].items())
        + f". Each round: {s['requests']} requests at concurrency {s['concurrency']}, "
        "round-robin over chat, chat stream, stream cancelled after its first chunk, "
        "transcription, speech and embeddings (official openai client), then every runner "
        f"idles out. Baseline: after a warm-up of {s['warmup']} requests and its idle-out."
        + (f" Server environment: {', '.join(s['env'])}." if s.get("env") else ""),
        "",
        f"Machine: {r['machine']['arch']}, {r['machine']['cpus']} CPUs, Python "
        f"{r['machine']['python']}; load average {r['machine']['load_start']} at start, "
        f"{r['machine']['load_end']} at the end.",
        "",
        "| moment | uptime | anonymous (tree) | server anonymous | of it the monitor ring "
        "since the baseline (est.) | fds | threads | children |",
        "|---|---:|---:|---:|---:|---:|---:|---:|",
        f"| cold start | {r['cold']['uptime']} s | {mib(r['cold']['anonymous'])} | "
        f"{mib(r['cold']['server_anonymous'])} | | {r['cold']['fds']} | {r['cold']['threads']} "
        f"| {len(r['cold']['children'])} |",
        f"| baseline (warm, idle) | {base['uptime']} s | {mib(base['anonymous'])} | "
        f"{mib(base['server_anonymous'])} | | {base['fds']} | {base['threads']} | "
        f"{len(base['children'])} |",
    ]
    for x in r["rounds"]:
        a = x["after"]
        lines.append(
            f"| after round {x['round']} ({x['ok']}/{x['requests']} ok, {x['seconds']} s; "
            f"idle-out {x['idle_out_seconds']} s) | {a['uptime']} s | {mib(a['anonymous'])} | "
            f"{mib(a['server_anonymous'])} | {mib(x['ring_growth_estimate'])} | {a['fds']} | "
            f"{a['threads']} | {len(a['children'])} |"
        )
    kinds = ", ".join(f"{k} {v}" for k, v in base["fd_kinds"].items())
    changed = []
    for x in r["rounds"]:
        now = x["after"]["fd_kinds"]
        moved = [
            f"{k} {base['fd_kinds'].get(k, 0)} → {now.get(k, 0)}"
            for k in sorted(set(base["fd_kinds"]) | set(now))
            if base["fd_kinds"].get(k, 0) != now.get(k, 0)
        ]
        if moved:
            changed.append(f"round {x['round']}: " + ", ".join(moved))
    lines += [
        "",
        f"The server's fds by kind at the baseline: {kinds}; "
        + ("after every round the same." if not changed else "differing: " + "; ".join(changed)),
        "",
        f"The memory monitor keeps one sample a second for monitor_history (600 s): "
        f"{r['ring_sample_bytes']:,} bytes a sample, measured with the server's code here, "
        f"{mib(RING_SAMPLES * r['ring_sample_bytes'])} when full. It fills during the first "
        "ten minutes whatever the requests; its growth since the baseline is estimated from "
        "the uptime and counted in the totals like everything else.",
        "",
        f"Anonymous bytes after each round vs the baseline: {spread} (target within "
        f"{MEMORY_TOLERANCE:.0%}); fds and children no more than the baseline; threads at most "
        f"{THREAD_SLACK} more. "
        + ("**Met in every round.**" if r["met"] else "**NOT met** (the checks are in the JSON)."),
        "",
        "Outcomes per kind (all rounds):",
        "",
        "| kind | outcomes |",
        "|---|---|",
    ]
    total: dict[str, Counter[str]] = {}
    for x in r["rounds"]:
        for kind, outcomes in x["outcomes"].items():
            total.setdefault(kind, Counter()).update(outcomes)
    for kind, outcomes in total.items():
        lines.append(f"| {kind} | {', '.join(f'{k}: {v}' for k, v in sorted(outcomes.items()))} |")
    lines += ["", f"Server exit code at SIGTERM: {r['exit_code']}.", ""]
    lines.append(f"Baseline tree anonymous: {format_size(base['anonymous'])}.")
    return "\n".join(lines) + "\n"


if __name__ == "__main__":
    main()
