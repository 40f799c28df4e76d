"""Chaos: memory that grows after admission, in a real cgroup v1 memory cgroup; the same
seeds with the pressure guard and with ``--no-memory-guard``, side by side in one run.

    sudo .venv/bin/python benchmarks/chaos.py [--seeds 1,2,3] [--duration 90] [--quick]
        [--scenarios protected,plain,fast] [--logs DIR]

Three scenarios (each seed runs in each, each in both modes):

- ``protected``: the neighbour stands for the rest of the machine (the user's desktop,
  a database), which the kernel must not kill: the server starts with ``oom_score_adj``
  1000 (its runners inherit it; the same choice as the neighbour at -1000, which needs
  CAP_SYS_RESOURCE that containers lack), so when the cgroup runs out the OOM killer
  takes one of *ours* — a runner with every request on it, or the server. This is what
  the guard is for: give memory back (unload, abort with a 503 and Retry-After) before
  the kernel picks a victim. The metric: OOM kills of our processes and the requests
  they took with them.
- ``plain``: an ordinary neighbour; the kernel kills the largest process, which is the
  neighbour. The metric: how often elbowroom's memory made the kernel kill someone else.
- ``fast`` (issue 23): protected's server score, a neighbour growing 320 MiB/s to 896 MiB
  three times in the run, two LLMs at ``--ctx 2048`` streaming ~1,000-token prompts and
  embeddings beside them (``SCENARIOS``).

Per seed and mode, `elbowroom serve` runs inside its own memory cgroup (a real limit: the
kernel OOM-kills past it) with two things that grow after the scheduler admitted its loads:

- a neighbour process in the same cgroup that allocates (and touches) memory faster than
  loads are admitted, up to a ceiling, holds it, frees it and rests: its own pattern per
  seed (rate, ceiling, hold and rest drawn from the seed);
- the LLM runners' RAM prompt caches: every chat request is a distinct long prompt, so
  each LLM runner's cache fills toward its grant (``ELBOWROOM_KV_RAM_MAX``), which the
  scheduler does not charge at load time.

Client threads (official openai client; a refused request, 503/507, is sent again after its
Retry-After, at most twice, like a real client) send chat to
both LLMs, transcriptions, speech and embeddings. A sampler reads the cgroup's usage,
failcnt and OOM-kill counter. Both modes of a seed see the same neighbour pattern and the
same request sequence. Everything is on loopback, every loop has a deadline, and the
cgroups are removed at the end. Writes benchmarks/results/chaos.{json,md,png}.
"""

from __future__ import annotations

import argparse
import contextlib
import io
import itertools
import json
import math
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
from collections.abc import Callable
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
# (endpoint, model, weight): the request mix; chat weighs most because the LLM prompt
# caches are one of the two things that grow after admission
MIX = [
    ("chat", "smollm2-135m", 4),
    ("chat", "gemma3-270m", 2),
    ("transcription", "whisper-tiny.en", 1),
    ("speech", "piper-en-us-joe", 1),
    ("embeddings", "minilm-l6-v2", 2),
]
CTX = 1024  # per slot; a prompt of PROMPT_WORDS common words is ~650 tokens
PROMPT_WORDS = 600
# The fast neighbour: two LLMs streaming ~1,000-token prompts at ctx 2048 and embeddings
# beside them (no audio: the LLMs' prefills are what grows)
FAST_MIX = [
    ("chat", "smollm2-135m", 3),
    ("chat", "gemma3-270m", 2),
    ("embeddings", "minilm-l6-v2", 2),
]


@dataclass(frozen=True, slots=True)
class Scenario:
    """What differs between scenarios: the server's score, the load, the neighbour."""

    name: str
    adj: int | None  # the server's oom_score_adj (its runners inherit it, then go above)
    ctx: int = CTX
    prompt_words: int = PROMPT_WORDS
    mix: tuple[tuple[str, str, int], ...] = tuple(MIX)
    stream: bool = False
    # a fixed neighbour (rate MiB/s, ceiling MiB, bursts) instead of the seed's random one
    fixed: tuple[int, int, int] | None = None
    timeout: float = 30.0  # the client's, per request (a stream: per read)


SCENARIOS = {
    "protected": Scenario("protected", 1000),
    "plain": Scenario("plain", None),
    # issue 23: 1.25 GiB, a neighbour growing 320 MiB/s to 896 MiB three times in 75 s, the
    # server at oom_score_adj 1000, two LLMs at ctx 2048 streaming ~1,000-token prompts
    "fast": Scenario(
        "fast",
        1000,
        ctx=2048,
        prompt_words=900,
        mix=tuple(FAST_MIX),
        stream=True,
        fixed=(320, 896, 3),
        timeout=90.0,  # ~1,000-token prefills on a shared 2-core machine
    ),
}
KEEP_LOGS: Path | None = None  # --logs: where each run's server log is copied
_LISTENING = re.compile(r"elbowroom listening on (http://\S+)")
_LOG_TIME = re.compile(r"^(\d{4}-\d\d-\d\d \d\d:\d\d:\d\d,\d{3}) .*?(elbowroom\.\w+): (.*)$")


# --- the cgroup and the processes in it -------------------------------------------------


class Server:
    """`elbowroom serve` in a subprocess (inside ``cgroup`` when given)."""

    def __init__(
        self,
        home: Path,
        args: list[str],
        cgroup: Cgroup | None,
        tag: str,
        env_extra: dict[str, str] | None = None,
        oom_score_adj: int | None = None,
    ) -> None:
        env = {k: v for k, v in os.environ.items() if not k.startswith("ELBOWROOM_")}
        env.update(
            XDG_DATA_HOME=str(home / "data"),
            XDG_CACHE_HOME=str(home / "cache"),
            XDG_CONFIG_HOME=str(home / "config"),
            PYTHONUNBUFFERED="1",
            **(env_extra or {}),
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
                preexec_fn=None if oom_score_adj is None else _oom_score_adj(oom_score_adj),
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


def _oom_score_adj(value: int) -> Callable[[], None]:
    def set_it() -> None:  # in the child before exec: the server and its runners inherit it
        with open("/proc/self/oom_score_adj", "w") as f:
            f.write(str(value))

    return set_it


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
    server = Server(home, ["--ctx", str(CTX)], None, "warmup")
    try:
        sizes: dict[str, int] = {}
        for model in MODELS:
            server.http.post(f"/api/models/{model}/load").raise_for_status()
            rows = server.http.get("/api/elbowroom/ps").json()["models"]
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


# --- the neighbour: a pattern per seed ----------------------------------------------------

STEP_MIB = 16  # the neighbour allocates in steps of this size


@dataclass(frozen=True, slots=True)
class Burst:
    """Rest at zero, then grow at ``rate`` MiB/s to ``ceiling`` MiB, hold, free it all."""

    rest_s: float
    rate: int
    ceiling: int
    hold_s: float


def neighbour_pattern(
    rng: random.Random, duration: float, limit_mib: int, ceiling: tuple[float, float], rate: int
) -> list[Burst]:
    """Bursts that fill ``duration``: ceilings drawn in ``ceiling`` (fractions of the limit),
    rates between ``rate`` and twice it (MiB/s, faster than a load is admitted)."""
    bursts: list[Burst] = []
    t = 0.0
    while t < duration:
        b = Burst(
            rest_s=round(rng.uniform(4, 10), 1),
            rate=rng.randrange(rate, 2 * rate + 1, STEP_MIB),
            ceiling=rng.randrange(
                int(limit_mib * ceiling[0]), int(limit_mib * ceiling[1]) + 1, STEP_MIB
            ),
            hold_s=round(rng.uniform(3, 8), 1),
        )
        bursts.append(b)
        t += b.rest_s + b.ceiling / b.rate + b.hold_s
    return bursts


def fixed_pattern(
    rng: random.Random, duration: float, rate: int, ceiling: int, bursts: int
) -> list[Burst]:
    """``bursts`` bursts at ``rate`` MiB/s to ``ceiling`` MiB within ``duration``: the rests
    and holds drawn from the seed, scaled so that all of them fit."""
    grow = ceiling / rate
    rests = [rng.uniform(4, 12) for _ in range(bursts)]
    holds = [rng.uniform(4, 8) for _ in range(bursts)]
    room = duration - bursts * grow - 1.0
    scale = min(1.0, room / (sum(rests) + sum(holds)))
    return [
        Burst(round(r * scale, 1), rate, ceiling, round(h * scale, 1))
        for r, h in zip(rests, holds, strict=True)
    ]


class Neighbour:
    """The neighbour process; restarted when the kernel OOM-kills it (as a real
    neighbour's supervisor would), each death recorded."""

    def __init__(self, cg: Cgroup) -> None:
        self.cg = cg
        self.deaths: list[float] = []
        self.held = 0
        self._proc = self._spawn()

    def _spawn(self) -> subprocess.Popen[bytes]:
        cmd = self.cg.command(sys.executable, "-c", NEIGHBOUR)
        return subprocess.Popen(cmd, stdin=subprocess.PIPE, stdout=subprocess.PIPE)

    def send(self, cmd: str, now: float) -> bool:
        """False when the neighbour died on this command (it is started again)."""
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
            return True
        proc.wait()  # it died (OOM-killed): what it held is gone; start a new one
        self.deaths.append(now)
        self.held = 0
        self._proc = self._spawn()
        return False

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
    pattern: list[Burst],
    stop_at: float,
    start: float,
    timeline: list[tuple[float, int]],
    deaths: list[float],
) -> None:
    """Play ``pattern``; a burst whose neighbour was OOM-killed goes on to its rest."""

    def wait(seconds: float) -> None:  # the pattern's pace, not synchronization
        time.sleep(max(0.0, min(seconds, stop_at - time.monotonic())))

    n = Neighbour(cg)
    try:
        for b in pattern:
            wait(b.rest_s)
            step_s = STEP_MIB / b.rate
            while n.held < b.ceiling and time.monotonic() < stop_at:
                t = time.monotonic()
                alive = n.send(f"+{STEP_MIB}", t - start)
                timeline.append((time.monotonic() - start, n.held))
                if not alive:
                    break
                wait(step_s - (time.monotonic() - t))
            wait(b.hold_s)
            n.send("-", time.monotonic() - start)
            timeline.append((time.monotonic() - start, n.held))
            if time.monotonic() >= stop_at:
                break
    finally:
        n.close()
        deaths.extend(n.deaths)


# --- the clients -------------------------------------------------------------------------------


@dataclass(slots=True)
class Result:
    t0: float
    t1: float
    endpoint: str
    model: str
    status: int  # 200 ok; HTTP status; 0 for a connection error or timeout
    error: str = ""  # error type/code from the body, or the exception name
    message: str = ""
    attempt: int = 0  # 0 the first try, 1.. a retry of the same request


# A refused request (503/507 before any output) is retried like a real client does (the
# official clients retry 5xx, honouring Retry-After): the same request after Retry-After
# (1 s when the answer has none), at most this many times.
RETRIES = 2


def retry_delay(status: int, retry_after: float, attempt: int) -> float | None:
    """Seconds to wait before retrying a request answered ``status`` on try ``attempt``
    (0 the first), or None when it is not retried: only refusals (503, 507), at most
    ``RETRIES`` times."""
    if status not in (503, 507) or attempt >= RETRIES:
        return None
    return retry_after if retry_after > 0 else 1.0


_WORDS_TEXT = (
    "the of and to in is it you that he was for on are with as his they be at one have this "
    "from or had by word but what some we can out other were all there when up use your how "
    "said an each she which do their time if will way about many then them write would like "
    "so these her long make thing see him two has look more day could go come did number "
    "sound no most people my over know water than call first who may down side been now "
    "find any new work part take get place made live where after back little only round man "
    "year came show every good me give our under name very through just form sentence great "
    "think say help low line differ turn cause much mean before move right boy old too same "
    "tell does set three want air well also play small end put home read hand port large "
    "spell add even land here must big high such follow act why ask men change went light"
)
WORDS = _WORDS_TEXT.split()


def long_prompt(rng: random.Random, words: int = PROMPT_WORDS) -> str:
    """A distinct long prompt: no two share a prefix, so each becomes its own entry in the
    runner's RAM prompt cache when its slot is reused."""
    return "Summarize these notes in one line: " + " ".join(rng.choice(WORDS) for _ in range(words))


def client(
    url: str,
    wav: bytes,
    rng: random.Random,
    stop_at: float,
    start: float,
    out: list[Result],
    scenario: Scenario = SCENARIOS["plain"],
) -> None:
    api = openai.OpenAI(
        base_url=url + "/v1", api_key="unused", max_retries=0, timeout=scenario.timeout
    )
    mix = list(scenario.mix)
    weights = [w for *_, w in mix]
    # a refused request to send again: (endpoint, model, prompt, max_tokens, attempt)
    retry: tuple[str, str, str, int, int] | None = None
    while time.monotonic() < stop_at:
        if retry is not None:
            endpoint, model, prompt, max_tokens, attempt = retry
        else:
            endpoint, model, _ = rng.choices(mix, weights)[0]
            # drawn for every request: the sequence stays the same
            prompt, attempt = long_prompt(rng, scenario.prompt_words), 0
            max_tokens = rng.randint(8, 32) if endpoint == "chat" else 0
        t0 = time.monotonic()
        status, error, message, retry_after = 200, "", "", 0.0
        refused_up_front = False  # an HTTP error status, not an error event mid-stream
        try:
            if endpoint == "chat" and scenario.stream:
                stream = api.chat.completions.create(
                    model=model,
                    max_tokens=max_tokens,
                    temperature=0.7,
                    messages=[{"role": "user", "content": prompt}],
                    stream=True,
                )
                for _chunk in stream:  # a mid-stream error event raises APIError here
                    pass
            elif endpoint == "chat":
                api.chat.completions.create(
                    model=model,
                    max_tokens=max_tokens,
                    temperature=0.7,
                    messages=[{"role": "user", "content": prompt}],
                )
            elif endpoint == "transcription":
                api.audio.transcriptions.create(model=model, file=("a.wav", io.BytesIO(wav)))
            elif endpoint == "speech":
                api.audio.speech.create(
                    model=model, voice="joe", input=prompt[35:200], response_format="wav"
                )
            else:
                api.embeddings.create(model=model, input=[prompt[i : i + 300] for i in (35, 400)])
        except openai.APIStatusError as exc:
            status = exc.status_code
            refused_up_front = True
            body = exc.body if isinstance(exc.body, dict) else {}
            body = body["error"] if isinstance(body.get("error"), dict) else body
            error = f"{body.get('type') or '?'}/{body.get('code') or '-'}"
            message = str(body.get("message") or "")[:200]
            with contextlib.suppress(ValueError):
                retry_after = float(exc.response.headers.get("retry-after", 0))
        except openai.APIError as exc:  # connection refused / reset, timeout, stream error
            status, error = 0, type(exc).__name__
            body = getattr(exc, "body", None)
            if isinstance(body, dict):  # an error event mid-stream: its type and message
                body = body["error"] if isinstance(body.get("error"), dict) else body
                error = f"{body.get('type') or '?'}/{body.get('code') or '-'}"
                message = str(body.get("message") or "")[:200]
                if body.get("type") == "memory_pressure":
                    status = 503
        out.append(
            Result(
                t0 - start,
                time.monotonic() - start,
                endpoint,
                model,
                status,
                error,
                message,
                attempt,
            )
        )
        delay = retry_delay(status, retry_after, attempt) if refused_up_front else None
        retry = (endpoint, model, prompt, max_tokens, attempt + 1) if delay is not None else None
        if delay is None and status == 507:
            delay = 1.0  # "cannot fit now": no Retry-After, but hammering helps nobody
        elif delay is None and retry_after:
            delay = retry_after
        if delay:  # a polite client honours Retry-After (a pause, not synchronization)
            time.sleep(min(delay, max(0.0, stop_at - time.monotonic())))


def sampler(
    cg: Cgroup, stop: threading.Event, start: float, out: list[tuple[float, int, int, int]]
) -> None:
    while not stop.is_set():
        with contextlib.suppress(OSError, ValueError):
            out.append((time.monotonic() - start, cg.usage, cg.oom_kills, cg.failcnt))
        stop.wait(0.25)


# --- one run ---------------------------------------------------------------------------------


@dataclass(slots=True)
class Run:
    seed: int
    mode: str
    scenario: str
    limit: int
    duration: float
    pattern: list[Burst] = field(default_factory=list)
    results: list[Result] = field(default_factory=list)
    usage: list[tuple[float, int, int, int]] = field(default_factory=list)
    neighbour: list[tuple[float, int]] = field(default_factory=list)
    history: list[dict[str, Any]] = field(default_factory=list)
    events: list[dict[str, Any]] = field(default_factory=list)
    log_events: list[dict[str, Any]] = field(default_factory=list)
    oom_kills: int = 0
    failcnt: int = 0
    neighbour_deaths: list[float] = field(default_factory=list)
    server_exit: int | None = None
    server_died: bool = False
    watch: dict[str, Any] | None = None  # the guard's pressure watch: sources, wakeups
    reaction: dict[str, Any] | None = None  # the guard's reaction times (ms percentiles)


@dataclass(frozen=True, slots=True)
class Setup:
    limit: int
    duration: float
    clients: int
    kv_ram_max: int
    monitor_interval: float
    ceiling: tuple[float, float]
    rate: int


def run(seed: int, mode: str, scenario: str, home: Path, setup: Setup, wav: bytes) -> Run:
    cg = Cgroup(f"elbowroom-chaos-{os.getpid()}-{scenario}-{seed}-{mode}", setup.limit)
    rng = random.Random(seed)
    sc = SCENARIOS[scenario]
    prng = random.Random(rng.random())
    pattern = (
        fixed_pattern(prng, setup.duration, *sc.fixed)
        if sc.fixed is not None
        else neighbour_pattern(prng, setup.duration, setup.limit // MiB, setup.ceiling, setup.rate)
    )
    out = Run(seed, mode, scenario, setup.limit, setup.duration, pattern)
    stop = threading.Event()
    threads: list[threading.Thread] = []
    server: Server | None = None
    try:
        args = ["--ctx", str(sc.ctx)] + (["--no-memory-guard"] if mode == "no-guard" else [])
        env = {
            "ELBOWROOM_MONITOR_INTERVAL": str(setup.monitor_interval),
            "ELBOWROOM_KV_RAM_MAX": str(setup.kv_ram_max),
        }
        server = Server(home, args, cg, f"{scenario}-{seed}-{mode}", env, sc.adj)
        wall0 = time.time()
        start = time.monotonic()
        stop_at = start + setup.duration
        threads.append(threading.Thread(target=sampler, args=(cg, stop, start, out.usage)))
        threads.append(
            threading.Thread(
                target=neighbour,
                args=(
                    cg,
                    pattern,
                    stop_at,
                    start,
                    out.neighbour,
                    out.neighbour_deaths,
                ),
            )
        )
        for _ in range(setup.clients):
            crng = random.Random(rng.random())
            threads.append(
                threading.Thread(
                    target=client, args=(server.url, wav, crng, stop_at, start, out.results, sc)
                )
            )
        for t in threads:
            t.start()
        for t in threads[1:]:
            t.join(timeout=setup.duration + sc.timeout + 15)  # a request times out
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
                guard = server.http.get("/api/guard", params={"events": 1000}).json()
                out.events = [
                    {**e, "t": e["wall"] - wall0}
                    for e in guard.get("events", [])
                    if e["wall"] >= wall0
                ]
                out.watch = guard.get("watch")
                out.reaction = guard.get("reaction")
        out.oom_kills = cg.oom_kills
        out.failcnt = cg.failcnt
        out.server_exit = server.stop()
        out.log_events = parse_log(server.log(), wall0)
        if KEEP_LOGS is not None:  # for a reader who wants the server's own account
            KEEP_LOGS.mkdir(parents=True, exist_ok=True)
            (KEEP_LOGS / server.log_path.name).write_text(server.log())
    finally:
        stop.set()
        if server is not None:
            server.stop()
        cg.remove()
    return out


def parse_log(text: str, wall0: float) -> list[dict[str, Any]]:
    """Loads, unloads and runner deaths (with their cause) from the server log."""
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


def outcome(x: Result) -> str:
    """What one request came to. 503/507 are the designed answers under pressure; a 503
    that reports a runner dead under the request (an OOM kill, typically) is a failure."""
    if x.status == 200:
        return "served"
    if x.status == 507:
        return "507"
    if x.status == 503 and x.error.endswith("runner_crashed"):
        return "failed"
    if x.status == 503 and x.message.startswith("generation aborted"):
        return "aborted"
    if x.status == 503:
        return "503"
    return "failed"


def _why(x: Result) -> str:
    """A refusal's or failure's reason in a few words (its error code, or what its message
    says it waited on)."""
    if x.status == 200:
        return ""
    if "loads are paused" in x.message:
        return "loads paused"
    if x.message.startswith("generation aborted"):
        return "aborted"
    return x.error.split("/")[-1] if x.error.split("/")[-1] not in ("", "-") else x.error


def client_time(results: list[Result]) -> dict[str, dict[str, float]]:
    """Where the clients' time went: per endpoint, outcome and reason, the number of
    requests and the seconds they held a client (closed loop: a client waiting on one
    request sends no other)."""
    out: dict[str, dict[str, float]] = {}
    for x in results:
        o = outcome(x)
        key = f"{x.endpoint} {o}" + (f" ({_why(x)})" if o != "served" else "")
        row = out.setdefault(key, {"n": 0, "s": 0.0})
        row["n"] += 1
        row["s"] = round(row["s"] + (x.t1 - x.t0), 1)
    return dict(sorted(out.items()))


def _time_table(summaries: list[dict[str, Any]], scenario: str) -> list[str]:
    """Request-seconds by endpoint and outcome, totals over the seeds, guard vs no guard."""
    sums: dict[str, dict[str, list[float]]] = {}
    for s in summaries:
        if s["scenario"] != scenario or "client_time" not in s:
            continue
        for key, row in s["client_time"].items():
            cell = sums.setdefault(key, {}).setdefault(s["mode"], [0, 0.0])
            cell[0] += row["n"]
            cell[1] += row["s"]
    if not sums:
        return []

    def cell(key: str, mode: str) -> str:
        n, secs = sums[key].get(mode, [0, 0.0])
        return f"{int(n)} / {secs:.0f} s" if n else "-"

    return [
        f"Where the clients' time went in **{scenario}** (requests / seconds they held a "
        "client, totals over the seeds; a request still running at the end is counted to "
        "its end):",
        "",
        "| endpoint, outcome (reason) | guard | no-guard |",
        "|---|---|---|",
        *(f"| {k} | {cell(k, 'guard')} | {cell(k, 'no-guard')} |" for k in sorted(sums)),
        "",
    ]


def level_seconds(history: list[dict[str, Any]]) -> dict[str, float]:
    """Seconds the monitor's samples spent at each level (each sample lasts until the next)."""
    out = {"soft": 0.0, "hard": 0.0}
    for h, nxt in itertools.pairwise(history):
        if h["level"] in out:
            out[h["level"]] += nxt["t"] - h["t"]
    return {k: round(v, 1) for k, v in out.items()}


def _dropped(x: Result) -> bool:
    """A connection refused or reset (the server killed), not a client timeout."""
    return x.status == 0 and x.error == "APIConnectionError"


def summarize(r: Run) -> dict[str, Any]:
    outcomes = [outcome(x) for x in r.results]
    served = [x for x, o in zip(r.results, outcomes, strict=True) if o == "served"]
    lat = sorted(x.t1 - x.t0 for x in served)
    failed_types = _count(
        f"{x.status} {x.error or '?'}"
        for x, o in zip(r.results, outcomes, strict=True)
        if o == "failed"
    )
    peak = max((u for _, u, _, _ in r.usage), default=0)
    deaths = [e["message"] for e in r.log_events if e["kind"] == "runner_died"]
    causes = [d.split(" exited: ", 1)[1].split(";")[0] for d in deaths]
    return {
        "seed": r.seed,
        "mode": r.mode,
        "scenario": r.scenario,
        "duration_s": r.duration,
        "oom_kills": r.oom_kills,
        # The kernel's kills of our processes: runners SIGKILLed without our asking (the
        # supervisor's own SIGKILL after a stop grace is logged as a stop, not an exit),
        # and the server itself.
        "ours_killed": sum("SIGKILL" in c for c in causes) + int(r.server_died),
        "lost_to_kills": sum(
            1
            for x, o in zip(r.results, outcomes, strict=True)
            if o == "failed" and (x.error.endswith("runner_crashed") or _dropped(x))
        ),
        "failcnt": r.failcnt,
        "runner_deaths": len(deaths),
        "runner_death_causes": causes,
        "neighbour_deaths": len(r.neighbour_deaths),
        "server_died": r.server_died,
        "server_exit": r.server_exit,
        "requests": len(r.results),
        "retries": sum(1 for x in r.results if x.attempt > 0),
        "served_on_retry": sum(1 for x in served if x.attempt > 0),
        "served": outcomes.count("served"),
        "refused_503": outcomes.count("503"),
        "aborted": outcomes.count("aborted"),
        "refused_507": outcomes.count("507"),
        "failed": outcomes.count("failed"),
        "failed_by_type": failed_types,
        "p50_s": round(statistics.median(lat), 3) if lat else None,
        "p95_s": round(lat[math.ceil(0.95 * len(lat)) - 1], 3) if lat else None,  # nearest rank
        "peak_usage": peak,
        "limit": r.limit,
        "peak_fraction": round(peak / r.limit, 3),
        "level_seconds": level_seconds(r.history),
        "guard_actions": _count(e["kind"] for e in r.events),
        "loads": sum(1 for e in r.log_events if e["kind"] == "load"),
        "unloads": sum(1 for e in r.log_events if e["kind"] == "unload"),
        "served_by_endpoint": _count(x.endpoint for x in served),
        "neighbour_peak_mib": max((n for _, n in r.neighbour), default=0),
        "watch": r.watch,
        "reaction_ms": reaction_ms(r),
        "client_time": client_time(r.results),
    }


def reaction_ms(r: Run) -> dict[str, Any]:
    """The kernel's notification -> the guard's first relief action, per notification the
    run kept in /api/guard's events (count, median, p99 by nearest rank, max, ms)."""
    times = sorted(e["reaction"] * 1000 for e in r.events if e.get("reaction") is not None)
    # relief a later (fast) sample took within 2 s of a notification: ms after it
    later = sorted(
        round(e["after_notification"] * 1000, 1)
        for e in r.events
        if e.get("after_notification") is not None
    )
    relief = [
        e for e in r.events if e["kind"] in ("pause_loads", "close_admission", "unload", "abort")
    ]
    if not times:
        return {"count": 0, "after_notification": later, "relief_actions": len(relief)}
    return {
        "after_notification": later,
        "relief_actions": len(relief),
        "count": len(times),
        "p50": round(statistics.median(times), 2),
        "p99": round(times[math.ceil(0.99 * len(times)) - 1], 2),
        "max": round(times[-1], 2),
        "values": [round(t, 2) for t in times],
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

    seeds = list(dict.fromkeys((r.scenario, r.seed) for r in runs))  # plot rows
    modes = list(dict.fromkeys(r.mode for r in runs))
    fig, axes = plt.subplots(
        len(seeds), len(modes), figsize=(7 * len(modes), 3.6 * len(seeds)), squeeze=False
    )
    mib = 1 / MiB
    for r in runs:
        ax = axes[seeds.index((r.scenario, r.seed))][modes.index(r.mode)]
        if r.usage:
            ts = [u[0] for u in r.usage]
            ax.plot(ts, [u[1] * mib for u in r.usage], color="black", lw=1.2, label="cgroup usage")
        ax.axhline(r.limit * mib, color="red", lw=1.5, label="cgroup limit")
        if r.neighbour:
            ax.step(
                [t for t, _ in r.neighbour],
                [n for _, n in r.neighbour],
                where="post",
                color="tab:gray",
                lw=0.8,
                label="neighbour holds",
            )
        if r.history:
            ts = [h["t"] for h in r.history]
            ax.plot(ts, [h["own"] * mib for h in r.history], color="tab:blue", lw=1, label="ours")
            for key, color in (("soft", "tab:orange"), ("hard", "tab:red")):
                ax.plot(
                    ts,
                    [h[key] * mib for h in r.history],
                    color=color,
                    lw=0.8,
                    ls="--",
                    label=f"{key} threshold",
                )
        ooms = [b[0] for a, b in itertools.pairwise(r.usage) if b[2] > a[2]]
        top = r.limit * mib * 1.05
        marks = [
            ([e["t"] for e in r.log_events if e["kind"] == "load"], "^", "tab:green", "load"),
            ([e["t"] for e in r.log_events if e["kind"] == "unload"], "v", "tab:purple", "unload"),
            ([e["t"] for e in r.events if e["kind"] == "abort"], "X", "tab:red", "abort"),
            (ooms, "*", "darkred", "OOM kill"),
            (
                [e["t"] for e in r.log_events if e["kind"] == "runner_died"],
                "P",
                "black",
                "runner died",
            ),
        ]
        for i, (ts, marker, color, label) in enumerate(marks):
            if ts:
                y = [top * (1 - 0.03 * i)] * len(ts)
                ax.scatter(ts, y, marker=marker, color=color, s=30, label=label, zorder=3)
        s = summarize(r)
        ax.set_title(
            f"{r.scenario} seed {r.seed}, {r.mode}: {s['oom_kills']} OOM kills "
            f"({s['ours_killed']} ours), {s['served']} served, "
            f"peak {s['peak_fraction']:.0%}",
            fontsize=9,
        )
        ax.set_ylabel("MiB")
        ax.grid(alpha=0.3)
    axes[0][-1].legend(loc="center left", fontsize=7, bbox_to_anchor=(1.0, 0.5))
    for ax in axes[-1]:
        ax.set_xlabel("seconds")
    fig.tight_layout()
    fig.savefig(path, dpi=100)


COLUMNS: list[tuple[str, Callable[[dict[str, Any]], str]]] = [
    ("OOM kills", lambda s: str(s["oom_kills"])),
    ("ours killed", lambda s: str(s["ours_killed"])),
    ("lost to kills", lambda s: str(s["lost_to_kills"])),
    ("neighbour killed", lambda s: str(s["neighbour_deaths"])),
    ("failcnt", lambda s: str(s["failcnt"])),
    ("runners died", lambda s: str(s["runner_deaths"])),
    ("served", lambda s: str(s["served"])),
    ("503", lambda s: str(s["refused_503"])),
    ("aborted", lambda s: str(s["aborted"])),
    ("507", lambda s: str(s["refused_507"])),
    ("failed", lambda s: str(s["failed"])),
    ("p50 / p95 s", lambda s: f"{s['p50_s']} / {s['p95_s']}"),
    ("peak / limit", lambda s: f"{s['peak_fraction']:.0%}"),
    ("soft / hard s", lambda s: f"{s['level_seconds']['soft']} / {s['level_seconds']['hard']}"),
    (
        "reaction p50 / p99 ms (n)",
        lambda s: (
            f"{s['reaction_ms']['p50']} / {s['reaction_ms']['p99']} ({s['reaction_ms']['count']})"
            if s["reaction_ms"].get("count")
            else "-"
        ),
    ),
]
TOTALS = [
    "oom_kills",
    "ours_killed",
    "lost_to_kills",
    "neighbour_deaths",
    "runner_deaths",
    "served",
    "refused_503",
    "aborted",
    "refused_507",
    "failed",
]


def _watch(w: dict[str, Any] | None) -> str:
    if not w:
        return "-"
    return f"{w['wakeups']} kernel wake-ups, {w['fast_samples']} fast samples"


def markdown(summaries: list[dict[str, Any]], meta: dict[str, Any]) -> str:
    head = "| scenario | seed | mode | " + " | ".join(c for c, _ in COLUMNS) + " |"
    lines = [head, "|---|---|---|" + "---|" * len(COLUMNS)]
    for s in summaries:
        lines.append(
            f"| {s['scenario']} | {s['seed']} | {s['mode']} | "
            + " | ".join(f(s) for _, f in COLUMNS)
            + " |"
        )
    totals = [
        "| scenario | mode | " + " | ".join(TOTALS) + " |",
        "|---|---|" + "---|" * len(TOTALS),
    ]
    for scenario, mode in dict.fromkeys((s["scenario"], s["mode"]) for s in summaries):
        rows = [s for s in summaries if (s["scenario"], s["mode"]) == (scenario, mode)]
        totals.append(
            f"| {scenario} | {mode} | "
            + " | ".join(str(sum(s[k] for s in rows)) for k in TOTALS)
            + " |"
        )
    verdicts = []
    for scenario in dict.fromkeys(s["scenario"] for s in summaries):
        g = [s for s in summaries if s["scenario"] == scenario and s["mode"] == "guard"]
        n = [s for s in summaries if s["scenario"] == scenario and s["mode"] == "no-guard"]
        if not g or not n:
            continue
        kills_g = sum(s["ours_killed"] + s["neighbour_deaths"] for s in g)
        lost_g = sum(s["lost_to_kills"] for s in g)
        kills_n = sum(s["ours_killed"] + s["neighbour_deaths"] for s in n)
        lost_n = sum(s["lost_to_kills"] for s in n)
        served_g, served_n = sum(s["served"] for s in g), sum(s["served"] for s in n)
        ratio = served_g / served_n if served_n else float("nan")
        times = sorted(t for s in g for t in s["reaction_ms"].get("values", []))
        later = sorted(t for s in g for t in s["reaction_ms"].get("after_notification", []))
        relief = sum(s["reaction_ms"].get("relief_actions", 0) for s in g)
        react = (
            f"reaction (notification -> first relief action) over {len(times)} notifications: "
            f"median {statistics.median(times):.2f} ms, p99 "
            f"{times[math.ceil(0.99 * len(times)) - 1]:.2f} ms, max {times[-1]:.2f} ms"
            if times
            else "no notification's own sample led to a relief action"
        )
        react += (
            f"; of {relief} relief actions, {len(times)} came from a notification's own "
            f"sample, {len(later)} from a fast sample within 2 s after one"
            + (f" ({later[len(later) // 2]:.0f} ms after it, median)" if later else "")
            + f" and {relief - len(times) - len(later)} from the monitor's own samples "
            "(no notification within 2 s)"
        )
        verdicts.append(
            f"- **{scenario}**: OOM kills (ours + neighbour) with the guard {kills_g}, without "
            f"{kills_n}; requests lost to kills with {lost_g}, without {lost_n}; served with "
            f"the guard {served_g} vs {served_n} without = **{ratio:.2f}**; {react}"
        )
    detail = [
        f"- {s['scenario']} seed {s['seed']} **{s['mode']}**: runner deaths "
        f"{s['runner_death_causes'] or '-'}; failed by type {s['failed_by_type'] or '-'}; "
        f"guard actions {s['guard_actions'] or '-'}; pressure watch {_watch(s['watch'])}; "
        f"loads/unloads {s['loads']}/{s['unloads']}; neighbour peak {s['neighbour_peak_mib']} MiB; "
        f"served by endpoint {s['served_by_endpoint']}"
        for s in summaries
    ]
    patterns = [
        f"- seed {seed}: "
        + "; ".join(
            f"rest {b['rest_s']} s, +{b['rate']} MiB/s to {b['ceiling']} MiB, hold {b['hold_s']} s"
            for b in pattern
        )
        for seed, pattern in meta["patterns"].items()
    ]
    sizes = ", ".join(f"{m} {format_size(b)}" for m, b in meta["footprints"].items())
    return "\n".join(
        [
            "# Chaos benchmark: memory that grows after admission",
            "",
            *(
                [
                    "**Smoke run** (`--quick`: one seed, 30 s per mode): it checks that the "
                    "benchmark works, it is not a measurement.",
                    "",
                ]
                if meta["quick"]
                else []
            ),
            f"Run {meta['date']} on {meta['machine']}, load average before the run "
            f"{meta['loadavg_before']}, after {meta['loadavg_after']}; "
            f"`sudo .venv/bin/python benchmarks/chaos.py {meta['argv']}` "
            f"({meta['wall_s']:.0f} s in all).",
            "",
            f"Per seed, `elbowroom serve --ctx {CTX}` ran {meta['duration']:.0f} s with the "
            "guard and the same seed with `--no-memory-guard`, inside a cgroup v1 memory cgroup "
            f"of **{format_size(meta['limit'])}** (monitor_interval {meta['monitor_interval']} s, "
            f"kv_ram_max **{format_size(meta['kv_ram_max'])}** per LLM runner). The five models "
            f"measured alone, before any prompt is cached: {sizes} (sum "
            f"{format_size(meta['footprint_sum'])}). Two things grow after the scheduler "
            f"admitted its loads: a neighbour process in the cgroup (its pattern per seed "
            f"below: grows {meta['rate']}–{2 * meta['rate']} MiB/s to "
            f"{meta['ceiling'][0]:.0%}–{meta['ceiling'][1]:.0%} of the limit, holds, frees, "
            f"rests), and each LLM runner's RAM prompt cache (every chat request is a distinct "
            f"~{PROMPT_WORDS}-word prompt; the cache fills toward its grant). "
            f"{meta['clients']} client threads (openai client; a refused request, 503/507, "
            "sent again after its Retry-After, at most twice) sent chat to both LLMs, "
            "transcriptions, speech and embeddings. "
            "The **fast** scenario differs: `--ctx 2048`, its own neighbour (320 MiB/s to "
            "896 MiB, three bursts, rests and holds from the seed: the patterns below), "
            "~1,000-token prompts (900 words) streamed to both LLMs and embeddings (no audio), "
            "a client timeout of 90 s (30 s in the others).",
            "",
            "Scenarios: **protected** — the neighbour stands for the rest of the machine, "
            "which the kernel may not kill (the server and its runners run with "
            "`oom_score_adj` 1000), so when the cgroup runs out the OOM killer must take one "
            "of ours, a runner with its requests or the server: "
            "*ours killed* and *lost to kills* are what the guard is there to keep at 0. "
            "**plain** — an ordinary neighbour, the largest process, so the kernel kills it: "
            "*neighbour killed* counts how often our memory cost someone else their process. "
            "**fast** (issue 23) — a neighbour growing 320 MiB/s to 896 MiB three times in "
            "the run, the server at `oom_score_adj` 1000 (so its runners cannot be ordered "
            "below it: every one of ours is at 1000), two LLMs at `--ctx 2048` streaming "
            "~1,000-token prompts (900 words) and embeddings beside them.",
            "",
            *lines,
            "",
            "Totals over the seeds:",
            "",
            *totals,
            "",
            "With the guard against without, per scenario (the targets of issue 23: 0 OOM "
            "kills and 0 requests lost with the guard where the run without has some, served "
            "with ≥ 0.60 of served without; reaction p99 ≤ 20 ms):",
            "",
            *verdicts,
            "",
            *(
                line
                for scenario in dict.fromkeys(s["scenario"] for s in summaries)
                for line in _time_table(summaries, scenario)
            ),
            "Columns: *OOM kills* the cgroup's `memory.oom_control` oom_kill counter; *ours "
            "killed* our runners the kernel SIGKILLed (plus the server, if it died); *lost to "
            "kills* requests that failed because the process serving them was killed (503 "
            "`runner_crashed`, dropped connections); *neighbour killed* the neighbour's OOM "
            "deaths; *failcnt* "
            "`memory.failcnt` (times usage hit the limit); *runners died* runner processes "
            "the server saw exit (causes below); *503* refusals under pressure (the guard's "
            "hard level, paused loads, full queues); *aborted* generations the guard ended "
            "(503 `memory_pressure`); *507* loads that could not fit; *failed* anything else "
            "(a runner that died under the request, a dropped connection, a timeout); *soft / "
            "hard s* seconds the monitor's samples spent at that level (without the guard the "
            "monitor still samples; nothing reacts).",
            "",
            *detail,
            "",
            "Neighbour patterns:",
            "",
            *patterns,
            "",
            "![timeline](chaos.png)",
            "",
        ]
    )


def render(json_path: Path, out: Path) -> int:
    """The markdown of a recorded run again, from its JSON (the client-time table is
    computed from the runs' results, so a run recorded before it existed gets it too)."""
    data = json.loads(json_path.read_text())
    summaries = data["summaries"]
    for s, r in zip(summaries, data["runs"], strict=True):
        s["client_time"] = client_time([Result(**x) for x in r["results"]])
    meta = {**data["meta"], "patterns": {int(k): v for k, v in data["meta"]["patterns"].items()}}
    out.mkdir(parents=True, exist_ok=True)
    (out / "chaos.md").write_text(markdown(summaries, meta))
    print(f"wrote {out}/chaos.md")
    return 0


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
    p.add_argument("--seeds", default="1,2,3", help="comma-separated; each runs in both modes")
    p.add_argument("--duration", type=float, default=90.0, help="seconds per seed and mode")
    p.add_argument("--limit", default="1280MiB", help="the cgroup's memory limit")
    p.add_argument("--kv-ram-max", default="256MiB", help="RAM prompt cache grant per LLM")
    p.add_argument("--clients", type=int, default=4)
    p.add_argument(
        "--ceiling",
        default="0.6,0.72",
        help="the neighbour's ceilings are drawn in this range (fractions of the limit)",
    )
    p.add_argument("--rate", type=int, default=64, help="neighbour growth, MiB/s (up to 2x)")
    p.add_argument("--monitor-interval", type=float, default=0.5)
    p.add_argument("--modes", default="guard,no-guard")
    p.add_argument(
        "--scenarios",
        default="protected,plain,fast",
        help="protected: the kernel may not kill the neighbour; plain: it may; fast: issue 23",
    )
    p.add_argument("--quick", action="store_true", help="one seed, 30 s per mode (a smoke run)")
    p.add_argument("--out", type=Path, default=RESULTS)
    p.add_argument("--logs", type=Path, default=None, help="copy each run's server log here")
    p.add_argument(
        "--render",
        type=Path,
        default=None,
        help="write --out/chaos.md again from this chaos.json (no run)",
    )
    args = p.parse_args()
    if args.render is not None:
        return render(args.render, args.out)
    global KEEP_LOGS
    KEEP_LOGS = args.logs
    if not v1_available():
        print(
            "chaos.py needs root and a cgroup v1 memory hierarchy at /sys/fs/cgroup/memory",
            file=sys.stderr,
        )
        return 2
    seeds = [int(s) for s in args.seeds.split(",")][: 1 if args.quick else None]
    lo, hi = (float(x) for x in args.ceiling.split(","))
    setup = Setup(
        limit=parse_size(args.limit),
        duration=30.0 if args.quick else args.duration,
        clients=args.clients,
        kv_ram_max=parse_size(args.kv_ram_max),
        monitor_interval=args.monitor_interval,
        ceiling=(lo, hi),
        rate=args.rate,
    )
    wall = time.monotonic()
    loadavg_before = " ".join(f"{x:.2f}" for x in os.getloadavg())
    with tempfile.TemporaryDirectory(prefix="elbowroom-chaos-") as tmp:
        home = Path(tmp)
        print("warm-up: measuring each model alone", flush=True)
        sizes, wav = warm_up(home)
        runs = []
        for scenario in args.scenarios.split(","):
            for seed in seeds:
                for mode in args.modes.split(","):
                    print(
                        f"{scenario}, seed {seed}, {mode}: {setup.duration:.0f} s under a "
                        f"{format_size(setup.limit)} cgroup",
                        flush=True,
                    )
                    runs.append(run(seed, mode, scenario, home, setup, wav))
                    print("  " + json.dumps(summarize(runs[-1])), flush=True)
    summaries = [summarize(r) for r in runs]
    meta = {
        "date": time.strftime("%Y-%m-%d"),
        "machine": f"{platform.machine()}, {os.cpu_count()} CPUs, "
        f"{format_size(os.sysconf('SC_PAGE_SIZE') * os.sysconf('SC_PHYS_PAGES'))} RAM",
        "loadavg_before": loadavg_before,
        "loadavg_after": " ".join(f"{x:.2f}" for x in os.getloadavg()),
        "argv": " ".join(_without_out(sys.argv[1:])),
        "wall_s": time.monotonic() - wall,
        "quick": args.quick,
        "footprints": sizes,
        "footprint_sum": sum(sizes.values()),
        "patterns": {r.seed: [asdict(b) for b in r.pattern] for r in runs},
        **{k: v for k, v in asdict(setup).items()},
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
