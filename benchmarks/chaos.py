"""Chaos: mixed load on every bundled model in a memory cgroup smaller than all of them, with
a noisy neighbour in the same cgroup; once with the pressure guard, once without.

    sudo .venv/bin/python benchmarks/chaos.py [--duration 180] [--limit 896MiB] [--quick]

Per mode: `elbowroom serve` runs inside its own cgroup v1 memory cgroup (a real limit: the
kernel OOM-kills past it). Client threads (official openai client, no retries) send a
random mix of chat to both LLMs, transcriptions, speech and embeddings; a neighbour process
in the same cgroup allocates and frees hundreds of MiB. A sampler reads the cgroup's usage
and OOM-kill counter. Everything is on loopback, every loop has a deadline, and the cgroups
are removed at the end. Writes benchmarks/results/chaos.{json,md,png}.

The models' summed footprint is measured first (each loaded alone, no cgroup), so the
report can show the limit is below it.
"""

from __future__ import annotations

import argparse
import contextlib
import io
import json
import os
import platform
import random
import re
import signal
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from dataclasses import asdict, dataclass, field
from datetime import datetime
from pathlib import Path
from typing import Any

import httpx
import openai
from cgroup_v1 import NEIGHBOUR, Cgroup, v1_available

from elbowroom.units import MiB, format_size, parse_size

REPO = Path(__file__).resolve().parents[1]
RESULTS = Path(__file__).parent / "results"
MODELS = ["smollm2-135m", "gemma3-270m", "whisper-tiny.en", "piper-en-us-joe", "minilm-l6-v2"]
# (endpoint, model, weight): the request mix
MIX = [
    ("chat", "smollm2-135m", 3),
    ("chat", "gemma3-270m", 2),
    ("transcription", "whisper-tiny.en", 2),
    ("speech", "piper-en-us-joe", 2),
    ("embeddings", "minilm-l6-v2", 3),
]
_LISTENING = re.compile(r"elbowroom listening on (http://\S+)")
_LOG_TIME = re.compile(r"^(\d{4}-\d\d-\d\d \d\d:\d\d:\d\d,\d{3}) .*?(elbowroom\.\w+): (.*)$")


# --- the cgroup and the processes in it -------------------------------------------------


class Server:
    """`elbowroom serve` in a subprocess (inside ``cgroup`` when given)."""

    def __init__(self, home: Path, args: list[str], cgroup: Cgroup | None, tag: str) -> None:
        env = {k: v for k, v in os.environ.items() if not k.startswith("ELBOWROOM_")}
        env.update(
            XDG_DATA_HOME=str(home / "data"),
            XDG_CACHE_HOME=str(home / "cache"),
            XDG_CONFIG_HOME=str(home / "config"),
            PYTHONUNBUFFERED="1",
            ELBOWROOM_MONITOR_INTERVAL="0.5",
        )
        argv = [sys.executable, "-m", "elbowroom", "serve", "--port", "0", *args]
        cmd = cgroup.command(*argv) if cgroup is not None else argv
        self.log_path = home / f"server-{tag}.log"
        with open(self.log_path, "wb") as log:
            self.proc = subprocess.Popen(
                cmd,
                cwd=REPO,
                env=env,
                stdout=log,
                stderr=subprocess.STDOUT,
                start_new_session=True,
            )
        self.url = until(self._listening, 240, "the server to listen")
        self.http = httpx.Client(base_url=self.url, timeout=300)

    def _listening(self) -> str | None:
        if self.proc.poll() is not None:
            raise RuntimeError(f"server exited {self.proc.returncode}: {self.log()[-2000:]}")
        m = _LISTENING.search(self.log())
        return m.group(1) if m else None

    def log(self) -> str:
        return self.log_path.read_text(errors="replace")

    def stop(self) -> int | None:
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(timeout=60)
            except subprocess.TimeoutExpired:
                os.killpg(self.proc.pid, signal.SIGKILL)
                self.proc.wait(timeout=30)
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.killpg(self.proc.pid, signal.SIGKILL)
        return self.proc.returncode


def until(condition: Any, timeout: float, what: str) -> Any:
    deadline = time.monotonic() + timeout
    while True:
        value = condition()
        if value:
            return value
        if time.monotonic() > deadline:
            raise TimeoutError(f"timed out after {timeout:.0f} s waiting for {what}")
        time.sleep(0.1)


# --- warm-up: footprints and a WAV to transcribe -----------------------------------------


def warm_up(home: Path) -> tuple[dict[str, int], bytes]:
    """Load each model alone (no cgroup) for its measured bytes; synthesize a WAV."""
    from elbowroom.config import Settings
    from elbowroom.models.bundled import prepare

    for line in prepare(Settings(data_dir=home / "data" / "elbowroom")):  # gemma3's chunks
        print("  " + line, flush=True)
    server = Server(home, ["--ctx", "1024"], None, "warmup")
    try:
        sizes: dict[str, int] = {}
        for model in MODELS:
            server.http.post(f"/api/models/{model}/load").raise_for_status()
            rows = server.http.get("/api/ps").json()["models"]
            sizes[model] = next(int(r["bytes"]) for r in rows if r["id"] == model)
            server.http.post(f"/api/models/{model}/unload").raise_for_status()
            print(f"  {model}: {format_size(sizes[model])}", flush=True)
        wav = server.http.post(
            "/v1/audio/speech",
            json={
                "model": "piper-en-us-joe",
                "input": "Please transcribe this short sentence.",
                "voice": "joe",
                "response_format": "wav",
            },
        )
        wav.raise_for_status()
        return sizes, wav.content
    finally:
        server.stop()


# --- load: clients, neighbour, sampler ------------------------------------------------------


@dataclass(slots=True)
class Result:
    t0: float
    t1: float
    endpoint: str
    model: str
    status: int  # 200 ok; HTTP status; 0 for a connection error or timeout
    error: str = ""  # error type from the body, or the exception name


def client(
    url: str, wav: bytes, rng: random.Random, stop_at: float, start: float, out: list[Result]
) -> None:
    api = openai.OpenAI(base_url=url + "/v1", api_key="unused", max_retries=0, timeout=120)
    weights = [w for *_, w in MIX]
    while time.monotonic() < stop_at:
        endpoint, model, _ = rng.choices(MIX, weights)[0]
        t0 = time.monotonic()
        status, error, retry_after = 200, "", 0.0
        try:
            if endpoint == "chat":
                api.chat.completions.create(
                    model=model,
                    max_tokens=rng.randint(16, 64),
                    temperature=0.7,
                    messages=[{"role": "user", "content": rng.choice(PROMPTS)}],
                )
            elif endpoint == "transcription":
                api.audio.transcriptions.create(model=model, file=("a.wav", io.BytesIO(wav)))
            elif endpoint == "speech":
                api.audio.speech.create(
                    model=model, voice="joe", input=rng.choice(PROMPTS), response_format="wav"
                )
            else:
                api.embeddings.create(model=model, input=[rng.choice(PROMPTS) for _ in range(4)])
        except openai.APIStatusError as exc:
            status = exc.status_code
            body = exc.body if isinstance(exc.body, dict) else {}
            body = body["error"] if isinstance(body.get("error"), dict) else body
            error = f"{body.get('type') or '?'}/{body.get('code') or '-'}"
            with contextlib.suppress(ValueError):
                retry_after = float(exc.response.headers.get("retry-after", 0))
        except openai.APIError as exc:  # connection refused / reset, timeout
            status, error = 0, type(exc).__name__
        out.append(Result(t0 - start, time.monotonic() - start, endpoint, model, status, error))
        if status == 507:
            retry_after = 1.0  # "cannot fit now": no Retry-After, but hammering helps nobody
        if retry_after:  # a polite client honours Retry-After (a pause, not synchronization)
            time.sleep(min(retry_after, max(0.0, stop_at - time.monotonic())))


PROMPTS = [
    "Explain in two sentences why the sky is blue.",
    "Write a haiku about memory.",
    "List three uses for a paperclip.",
    "What is the capital of France? Answer briefly.",
    "Describe a cat to someone who has never seen one.",
]


class Neighbour:
    """The noisy neighbour process; restarted when the kernel OOM-kills it (as a real
    neighbour's supervisor would), each death recorded."""

    def __init__(self, cg: Cgroup) -> None:
        self.cg = cg
        self.deaths: list[float] = []
        self.held = 0
        self._proc = self._spawn()

    def _spawn(self) -> subprocess.Popen[bytes]:
        cmd = self.cg.command(sys.executable, "-c", NEIGHBOUR)
        return subprocess.Popen(cmd, stdin=subprocess.PIPE, stdout=subprocess.PIPE)

    def send(self, cmd: str, now: float) -> None:
        proc = self._proc
        assert proc.stdin is not None and proc.stdout is not None
        try:
            proc.stdin.write(cmd.encode() + b"\n")
            proc.stdin.flush()
            line = proc.stdout.readline().split()
        except (BrokenPipeError, OSError):
            line = []
        if len(line) == 2:
            self.held = int(line[1]) // MiB
            return
        proc.wait()  # it died (OOM-killed): what it held is gone; start a new one
        self.deaths.append(now)
        self.held = 0
        self._proc = self._spawn()

    def close(self) -> None:
        with contextlib.suppress(OSError):
            if self._proc.stdin is not None:
                self._proc.stdin.close()
        try:
            self._proc.wait(timeout=10)
        except subprocess.TimeoutExpired:
            self._proc.kill()
            self._proc.wait()


def neighbour(
    cg: Cgroup,
    rng: random.Random,
    max_mib: int,
    stop_at: float,
    start: float,
    timeline: list[tuple[float, int]],
    deaths: list[float],
) -> None:
    """Walk toward random targets in 32 MiB steps every 0.5 s, hold each 2-6 s."""
    n = Neighbour(cg)
    try:
        while time.monotonic() < stop_at:
            target = rng.randrange(0, max_mib + 1, 32)
            while n.held != target and time.monotonic() < stop_at:
                step = f"+{min(32, target - n.held)}" if n.held < target else "-32"
                n.send(step, time.monotonic() - start)
                timeline.append((time.monotonic() - start, n.held))
                time.sleep(0.5)  # the neighbour's pace (64 MiB/s), part of the workload
            hold_until = time.monotonic() + rng.uniform(2, 6)
            while time.monotonic() < min(hold_until, stop_at):
                time.sleep(0.25)
        n.send("-", time.monotonic() - start)
        timeline.append((time.monotonic() - start, n.held))
    finally:
        n.close()
        deaths.extend(n.deaths)


def sampler(
    cg: Cgroup, stop: threading.Event, start: float, out: list[tuple[float, int, int]]
) -> None:
    while not stop.is_set():
        with contextlib.suppress(OSError, ValueError):
            out.append((time.monotonic() - start, cg.usage, cg.oom_kills))
        stop.wait(0.25)


# --- one run ---------------------------------------------------------------------------------


@dataclass(slots=True)
class Run:
    mode: str
    limit: int
    duration: float
    results: list[Result] = field(default_factory=list)
    usage: list[tuple[float, int, int]] = field(default_factory=list)
    neighbour: list[tuple[float, int]] = field(default_factory=list)
    history: list[dict[str, Any]] = field(default_factory=list)
    events: list[dict[str, Any]] = field(default_factory=list)
    log_events: list[dict[str, Any]] = field(default_factory=list)
    oom_kills: int = 0
    neighbour_deaths: list[float] = field(default_factory=list)
    server_exit: int | None = None
    server_died: bool = False


def run(
    mode: str,
    home: Path,
    limit: int,
    duration: float,
    clients: int,
    neighbour_mib: int,
    wav: bytes,
    seed: int,
) -> Run:
    cg = Cgroup(f"elbowroom-chaos-{os.getpid()}-{mode}", limit)
    out = Run(mode, limit, duration)
    stop = threading.Event()
    threads: list[threading.Thread] = []
    server: Server | None = None
    try:
        args = ["--ctx", "1024"] + (["--no-memory-guard"] if mode == "no-guard" else [])
        server = Server(home, args, cg, mode)
        wall0 = time.time()
        start = time.monotonic()
        stop_at = start + duration
        rng = random.Random(seed)
        threads.append(threading.Thread(target=sampler, args=(cg, stop, start, out.usage)))
        threads.append(
            threading.Thread(
                target=neighbour,
                args=(
                    cg,
                    random.Random(rng.random()),
                    neighbour_mib,
                    stop_at,
                    start,
                    out.neighbour,
                    out.neighbour_deaths,
                ),
            )
        )
        for _ in range(clients):
            threads.append(
                threading.Thread(
                    target=client,
                    args=(
                        server.url,
                        wav,
                        random.Random(rng.random()),
                        stop_at,
                        start,
                        out.results,
                    ),
                )
            )
        for t in threads:
            t.start()
        for t in threads[1:]:
            t.join(timeout=duration + 300)
        stop.set()
        threads[0].join(timeout=10)
        out.server_died = server.proc.poll() is not None
        if not out.server_died:
            with contextlib.suppress(httpx.HTTPError, ValueError):
                mem = server.http.get("/api/memory", params={"history": "true"}).json()
                out.history = [
                    {
                        "t": h["wall"] - wall0,
                        "own": h["own_usage"],
                        "limit": h["limit"]["value"],
                        "soft": h["limit"]["soft"],
                        "hard": h["limit"]["hard"],
                        "level": h["level"],
                    }
                    for h in mem.get("history", [])
                    if h["wall"] >= wall0
                ]
            with contextlib.suppress(httpx.HTTPError, ValueError):
                guard = server.http.get("/api/guard", params={"events": 100000}).json()
                out.events = [
                    {**e, "t": e["wall"] - wall0}
                    for e in guard.get("events", [])
                    if e["wall"] >= wall0
                ]
        out.oom_kills = cg.oom_kills
        out.server_exit = server.stop()
        out.log_events = parse_log(server.log(), wall0)
    finally:
        stop.set()
        if server is not None:
            server.stop()
        cg.remove()
    return out


def parse_log(text: str, wall0: float) -> list[dict[str, Any]]:
    """Loads, unloads and runner deaths from the server log, on the run's clock."""
    events = []
    for line in text.splitlines():
        m = _LOG_TIME.match(line)
        if not m:
            continue
        t = datetime.strptime(m.group(1), "%Y-%m-%d %H:%M:%S,%f").timestamp() - wall0
        msg = m.group(3)
        kind = None
        if msg.startswith("loaded "):
            kind = "load"
        elif msg.startswith("unloaded "):
            kind = "unload"
        elif " exited: " in msg and msg.startswith("runner of"):
            kind = "runner_died"
        if kind and t >= 0:
            events.append({"t": t, "kind": kind, "message": msg})
    return events


# --- report ----------------------------------------------------------------------------------


def refusal(x: Result) -> bool:
    """503 and 507 are the designed answers under pressure, except a 503 that reports a
    runner that died under the request (an OOM kill, typically): that one is a failure."""
    return x.status == 507 or (x.status == 503 and not x.error.endswith("/runner_crashed"))


def summarize(r: Run) -> dict[str, Any]:
    served = [x for x in r.results if x.status == 200]
    refused = [x for x in r.results if refusal(x)]
    failed = [x for x in r.results if x.status != 200 and not refusal(x)]
    lat = sorted(x.t1 - x.t0 for x in served)
    by_type: dict[str, int] = {}
    for x in refused:
        key = f"{x.status} {x.error or '?'}"
        by_type[key] = by_type.get(key, 0) + 1
    fail_types: dict[str, int] = {}
    for x in failed:
        key = f"{x.status} {x.error or '?'}"
        fail_types[key] = fail_types.get(key, 0) + 1
    peak = max((u for _, u, _ in r.usage), default=0)
    return {
        "mode": r.mode,
        "duration_s": r.duration,
        "requests": len(r.results),
        "served": len(served),
        "refused": len(refused),
        "refused_by_type": by_type,
        "failed": len(failed),
        "failed_by_type": fail_types,
        "p50_s": round(statistics.median(lat), 3) if lat else None,
        "p95_s": round(lat[int(0.95 * (len(lat) - 1))], 3) if lat else None,
        "oom_kills": r.oom_kills,
        "runner_deaths": sum(1 for e in r.log_events if e["kind"] == "runner_died"),
        "neighbour_deaths": len(r.neighbour_deaths),
        "server_died": r.server_died,
        "server_exit": r.server_exit,
        "peak_usage": peak,
        "limit": r.limit,
        "peak_fraction": round(peak / r.limit, 3),
        "guard_actions": _count(e["kind"] for e in r.events),
        "loads": sum(1 for e in r.log_events if e["kind"] == "load"),
        "unloads": sum(1 for e in r.log_events if e["kind"] == "unload"),
        "served_by_endpoint": _count(x.endpoint for x in served),
    }


def _count(items: Any) -> dict[str, int]:
    out: dict[str, int] = {}
    for i in items:
        out[i] = out.get(i, 0) + 1
    return dict(sorted(out.items()))


def plot(runs: list[Run], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(len(runs), 1, figsize=(12, 4.2 * len(runs)), sharex=True)
    axes = axes if len(runs) > 1 else [axes]
    for ax, r in zip(axes, runs, strict=True):
        mib = 1 / MiB
        if r.usage:
            ax.plot(
                [t for t, _, _ in r.usage],
                [u * mib for _, u, _ in r.usage],
                color="black",
                lw=1.2,
                label="cgroup usage",
            )
        ax.axhline(r.limit * mib, color="red", lw=1.5, label="cgroup limit (OOM kill past it)")
        if r.neighbour:
            ax.step(
                [t for t, _ in r.neighbour],
                [n for _, n in r.neighbour],
                where="post",
                color="tab:gray",
                lw=0.8,
                alpha=0.7,
                label="neighbour holds",
            )
        if r.history:
            ts = [h["t"] for h in r.history]
            ax.plot(
                ts, [h["own"] * mib for h in r.history], color="tab:blue", lw=1, label="our runners"
            )
            ax.plot(
                ts,
                [h["soft"] * mib for h in r.history],
                color="tab:orange",
                lw=0.8,
                ls="--",
                label="soft threshold",
            )
            ax.plot(
                ts,
                [h["hard"] * mib for h in r.history],
                color="tab:red",
                lw=0.8,
                ls="--",
                label="hard threshold",
            )
        ooms = [t for (t, _, k), (_, _, k0) in zip(r.usage[1:], r.usage, strict=False) if k > k0]
        top = r.limit * mib * 1.05
        marks = [
            ([e["t"] for e in r.log_events if e["kind"] == "load"], "^", "tab:green", "load"),
            ([e["t"] for e in r.log_events if e["kind"] == "unload"], "v", "tab:purple", "unload"),
            ([e["t"] for e in r.events if e["kind"] == "abort"], "X", "tab:red", "abort"),
            (ooms, "*", "darkred", "OOM kill"),
        ]
        for i, (ts, marker, color, label) in enumerate(marks):
            if ts:
                ax.scatter(
                    ts,
                    [top * (1 - 0.03 * i)] * len(ts),
                    marker=marker,
                    color=color,
                    s=40,
                    label=label,
                    zorder=3,
                )
        s = summarize(r)
        ax.set_title(
            f"{r.mode}: {s['served']} served, {s['refused']} refused, "
            f"{s['failed']} failed, {s['oom_kills']} OOM kills, "
            f"peak {s['peak_fraction']:.0%} of limit"
        )
        ax.set_ylabel("MiB")
        ax.legend(loc="center left", fontsize=7, bbox_to_anchor=(1.0, 0.5))
        ax.grid(alpha=0.3)
    axes[-1].set_xlabel("seconds")
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def markdown(summaries: list[dict[str, Any]], meta: dict[str, Any]) -> str:
    rows = [
        ("OOM kills (target 0)", "oom_kills"),
        ("runner processes that died", "runner_deaths"),
        ("neighbour processes that died", "neighbour_deaths"),
        ("server process died", "server_died"),
        ("requests", "requests"),
        ("served (2xx)", "served"),
        ("refused 503/507", "refused"),
        ("failed any other way (target 0)", "failed"),
        ("p50 latency of served (s)", "p50_s"),
        ("p95 latency of served (s)", "p95_s"),
        ("peak cgroup usage / limit", "peak_fraction"),
        ("model loads / unloads", None),
    ]
    head = "| | " + " | ".join(s["mode"] for s in summaries) + " |"
    lines = [head, "|---|" + "---|" * len(summaries)]
    for label, key in rows:
        if key is None:
            vals = [f"{s['loads']} / {s['unloads']}" for s in summaries]
        elif key == "peak_fraction":
            vals = [
                f"{format_size(s['peak_usage'])} / {format_size(s['limit'])} "
                f"({s['peak_fraction']:.0%})"
                for s in summaries
            ]
        else:
            vals = [str(s[key]) for s in summaries]
        lines.append(f"| {label} | " + " | ".join(vals) + " |")
    detail = []
    for s in summaries:
        detail.append(
            f"- **{s['mode']}** refused by type: {s['refused_by_type'] or '-'}; "
            f"failed by type: {s['failed_by_type'] or '-'}; guard actions: "
            f"{s['guard_actions'] or '-'}; served by endpoint: "
            f"{s['served_by_endpoint']}"
        )
    sizes = ", ".join(f"{m} {format_size(b)}" for m, b in meta["footprints"].items())
    return "\n".join(
        [
            "# Chaos benchmark: the pressure guard under a noisy neighbour",
            "",
            f"Run {meta['date']} on {meta['machine']}; `benchmarks/chaos.py {meta['argv']}`.",
            "",
            f"Each mode ran `elbowroom serve` (monitor_interval 0.5 s) for "
            f"{meta['duration']:.0f} s inside a cgroup v1 "
            f"memory cgroup limited to **{format_size(meta['limit'])}**, below the "
            f"**{format_size(meta['footprint_sum'])}** the five models hold together "
            f"(measured alone: {sizes}). {meta['clients']} client threads (openai client, "
            "no retries) sent a random mix of chat to both LLMs, transcriptions, speech and "
            f"embeddings, while a neighbour process in the same cgroup walked between 0 and "
            f"{meta['neighbour_mib']} MiB in 32 MiB steps every 0.5 s. Same seed for both modes.",
            "",
            *lines,
            "",
            *detail,
            "",
            "![timeline](chaos.png)",
            "",
            "Refusals are the designed answer under pressure (503 + Retry-After, or 507 with the "
            "numbers); a failure is anything else (a 500, a dropped connection, a timeout).",
            "",
        ]
    )


def _without_out(argv: list[str]) -> list[str]:
    """The command line as the report shows it: where the results went is not a parameter."""
    out, skip = [], False
    for arg in argv:
        if skip or arg.startswith("--out="):
            skip = False
            continue
        if arg == "--out":
            skip = True
            continue
        out.append(arg)
    return out


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--duration", type=float, default=180.0, help="seconds per mode")
    p.add_argument("--limit", default="896MiB", help="the cgroup's memory limit")
    p.add_argument("--clients", type=int, default=4)
    p.add_argument("--neighbour", type=int, default=640, help="MiB the neighbour holds at most")
    p.add_argument("--seed", type=int, default=7)
    p.add_argument("--modes", default="guard,no-guard")
    p.add_argument("--quick", action="store_true", help="30 s per mode (a smoke run)")
    p.add_argument("--out", type=Path, default=RESULTS)
    args = p.parse_args()
    if not v1_available():
        print(
            "chaos.py needs root and a cgroup v1 memory hierarchy at /sys/fs/cgroup/memory",
            file=sys.stderr,
        )
        return 2
    duration = 30.0 if args.quick else args.duration
    limit = parse_size(args.limit)
    with tempfile.TemporaryDirectory(prefix="elbowroom-chaos-") as tmp:
        home = Path(tmp)
        print("warm-up: measuring each model alone", flush=True)
        sizes, wav = warm_up(home)
        runs = []
        for mode in args.modes.split(","):
            print(f"{mode}: {duration:.0f} s under a {format_size(limit)} cgroup", flush=True)
            runs.append(
                run(mode, home, limit, duration, args.clients, args.neighbour, wav, args.seed)
            )
            print("  " + json.dumps(summarize(runs[-1])), flush=True)
    summaries = [summarize(r) for r in runs]
    meta = {
        "date": time.strftime("%Y-%m-%d"),
        "machine": f"{platform.machine()}, {os.cpu_count()} CPUs, "
        f"{format_size(os.sysconf('SC_PAGE_SIZE') * os.sysconf('SC_PHYS_PAGES'))} RAM",
        "argv": " ".join(_without_out(sys.argv[1:])),
        "duration": duration,
        "limit": limit,
        "footprints": sizes,
        "footprint_sum": sum(sizes.values()),
        "clients": args.clients,
        "neighbour_mib": args.neighbour,
    }
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "chaos.json").write_text(
        json.dumps(
            {
                "meta": meta,
                "summaries": summaries,
                "runs": [{**asdict(r), "results": [asdict(x) for x in r.results]} for r in runs],
            },
            indent=1,
            default=str,
        )
    )
    (args.out / "chaos.md").write_text(markdown(summaries, meta))
    plot(runs, args.out / "chaos.png")
    print(f"wrote {args.out}/chaos.{{json,md,png}}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
