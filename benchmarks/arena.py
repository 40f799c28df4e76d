"""The arena: elbowroom vs llama.cpp's router mode on the same multi-model agent work, in the
same real memory cgroup (v1), side by side in one run.

    sudo .venv/bin/python benchmarks/arena.py [--quick] [--seeds 1,2,3] [--logs DIR]

Systems (same GGUF files, threads, slots and context per slot):

- ``elbowroom``: ``elbowroom serve`` with its defaults (``--ctx``/``--slots`` and
  ``ELBOWROOM_THREADS`` set to the shared values);
- ``router``: ``llama-server --models-dir DIR`` (router mode: one child llama-server per
  model, the least recently used stopped once more than ``--models-max`` (4) run), started
  the way llama.cpp's tools/server/README.md says, its defaults (``--cache-ram`` 8 GiB per
  child) plus the shared ``-t``/``-np``/``-c``;
- ``router-tuned``: the same with ``--models-max`` set to the number of models the
  container holds and ``--cache-ram`` lowered to elbowroom's RAM prompt-cache grant.

llama-server is the engine benchmark's cached build of the llama.cpp that the installed
xllamacpp vendors (``engine_speed.llama_server_binary``; the first run builds it once).

Models: the bundled SmolLM2 and gemma3 and synthesized held-out shapes (``SHAPES``: real
architectures, random weights, 300-900 MiB; ``synth_models.py``'s generator) — more than
the two smaller containers hold.

Work (seeded, the same requests for every system): ``clients`` closed-loop clients, each
running agent-like sessions: a ~1,500-token system prompt (one of two agents'), growing turn
by turn (the user's message and a recorded assistant reply), each turn on a model chosen the
way an agent framework routes (stay, or switch to another model with ``P_SWITCH``); ~10 %
of streams are dropped after the first token without closing the connection, ~10 % are
cancelled (closed) after the first token. A refusal or a 5xx is retried after Retry-After
(at most twice), as the official clients do.

Cells (fresh cgroup, fresh server, per system): the containers ``L`` (everything fits),
``M`` (two LLMs fit), ``S`` (the largest LLM barely fits), sized from elbowroom's measured
footprints in a warm-up; phases ``work`` (the sessions; in L this is plain throughput, as
everything fits) and ``neighbour`` (the sessions while a process in the same cgroup grows
to ``NEIGHBOUR_FRAC`` of the limit after admission, holds and frees, repeatedly; run in M).
Systems are interleaved in an order that rotates with the seed.

Metrics per system, container and phase: served / refused (by status) / failed (5xx other
than 503/507, dropped connections, timeouts); OOM kills (the cgroup's ``oom_kill``
counter) and their victims (the kernel log); p50/p95 first token, overall and on the first
request after a model switch; aggregate tok/s; peak cgroup usage
(``memory.max_usage_in_bytes``); wall time; the load average. Medians over seeds with
min-max ranges. Writes benchmarks/results/arena.{json,md,png}.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import math
import os
import random
import re
import signal
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from collections import Counter
from collections.abc import Iterable, Sequence
from dataclasses import asdict, dataclass, field
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

import httpx

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))
sys.path.insert(0, str(Path(__file__).resolve().parent))

from cgroup_v1 import CGROUP_V1, NEIGHBOUR, Cgroup, v1_available  # noqa: E402
from synth_models import Shape  # noqa: E402

RESULTS = Path(__file__).parent / "results"
SYSTEMS = ("elbowroom", "router", "router-tuned")
PHASES = ("work", "neighbour", "swap")
# The recorded run's cells; S/swap holds the headline target (first token after a switch).
CELLS = ("L/work", "M/neighbour", "S/work", "S/swap")
QUICK_CELLS = CELLS[:3]  # --quick: under 10 minutes
BUNDLED = ("smollm2-135m", "gemma3-270m")
# Held-out shapes of 300-900 MiB: wide embedding and output matrices (memory) over two
# layers, so that a 1,500-token prefill costs no more than SmolLM2's on 2 shared cores.
SHAPES: tuple[Shape, ...] = (
    Shape("arena-llama-470m-f16", "llama", 2, 2048, 16, 4, 128, 2048, "f16"),
    Shape("arena-qwen2-400m-q8_0", "qwen2", 2, 3072, 24, 2, 128, 1536, "q8_0"),
)
THREADS = 2
SLOTS = 4
CTX = 2560  # per slot: the longest session (~1,500 tokens + 5 turns) fits with room
P_SWITCH = 0.5
P_DROP = 0.1
P_CANCEL = 0.1
SYSTEM_WORDS = 1050  # ~1,500 SmolLM2 tokens of common words, numbers and punctuation
MIN_SERVED = 5  # a comparison of speed or served counts needs this many served requests
GRACE_S = 15.0  # after the window: requests still running are cut (the server is stopped)
RETRIES = 2
NEIGHBOUR_FRAC = 0.35  # of the container's limit
NEIGHBOUR_RATE = 96  # MiB/s
STEP_MIB = 16
_LISTENING = re.compile(r"elbowroom listening on (http://\S+)")


def log(msg: str) -> None:
    print(msg, file=sys.stderr, flush=True)


# ---- the work: seeded, pure -------------------------------------------------------------------

_WORDS_TEXT = (
    "the of and to in is it you that he was for on are with as his they be at one have this "
    "from or had by word but what some we can out other were all there when up use your how "
    "said an each she which do their time if will way about many then them write would like "
    "so these her long make thing see him two has look more day could go come did number "
    "sound no most people my over know water than call first who may down side been now "
    "find any new work part take get place made live where after back little only round man "
    "year came show every good me give our under name very through just form sentence great "
    "think say help low line differ turn cause much mean before move right boy old too same "
    "tell does set three want air well also play small end put home read hand port large"
)
_WORDS = _WORDS_TEXT.split()


@dataclass(frozen=True, slots=True)
class Turn:
    model: str
    user: str
    reply: str  # the recorded assistant reply appended after this turn (same on every system)
    behaviour: str  # "read" | "drop" (stop reading, leave open) | "cancel" (close early)
    switch: bool  # the session's previous turn was on another model


@dataclass(frozen=True, slots=True)
class Session:
    client: int
    index: int
    agent: int  # which system prompt (every session of an agent shares it)
    turns: tuple[Turn, ...]


def _text(rng: random.Random, words: int) -> str:
    out = []
    for i in range(words):
        w = rng.choice(_WORDS)
        if i % 13 == 12:
            w += f" {rng.randrange(1000)}."
        out.append(w)
    return " ".join(out)


AGENTS = ("coder",)


def system_prompts(seed: int, words: int = SYSTEM_WORDS) -> list[str]:
    """The agents' long system prompts (tool descriptions, rules) for ``seed``."""
    rng = random.Random(f"arena-system-{seed}")
    return [
        f"You are agent {name}. Follow these rules and use these tools. " + _text(rng, words)
        for name in AGENTS
    ]


def workload(
    seed: int,
    models: Sequence[str],
    clients: int,
    sessions: int,
    turns: int,
    weights: Sequence[float] | None = None,
) -> list[list[Session]]:
    """Per client, its sessions in order. Deterministic in every argument."""
    rng = random.Random(f"arena-work-{seed}")
    out: list[list[Session]] = []
    for c in range(clients):
        mine = []
        for s in range(sessions):
            agent = rng.randrange(len(AGENTS))
            model = rng.choices(list(models), weights=weights)[0]
            made: list[Turn] = []
            for t in range(turns):
                switch = False
                if t > 0 and rng.random() < P_SWITCH:
                    model = rng.choice([m for m in models if m != model])
                    switch = True
                r = rng.random()
                behaviour = "drop" if r < P_DROP else "cancel" if r < P_DROP + P_CANCEL else "read"
                user = f"Step {t + 1}: " + _text(rng, rng.randrange(20, 60))
                reply = _text(rng, rng.randrange(10, 30))
                made.append(Turn(model, user, reply, behaviour, switch))
            mine.append(Session(c, s, agent, tuple(made)))
        out.append(mine)
    return out


def swap_workload(seed: int, models: Sequence[str], turns: int) -> list[list[Session]]:
    """The ``swap`` phase: one agent alternating between two models turn by turn (every
    turn after the first is a switch), each stream read to its end: the cost of a swap
    alone, with nothing else running."""
    rng = random.Random(f"arena-swap-{seed}")
    made = [
        Turn(
            models[t % 2],
            f"Step {t + 1}: " + _text(rng, rng.randrange(20, 60)),
            _text(rng, rng.randrange(10, 30)),
            "read",
            t > 0,
        )
        for t in range(turns)
    ]
    return [[Session(0, 0, 0, tuple(made))]]


def messages(system: str, session: Session, upto: int) -> list[dict[str, str]]:
    """The chat of ``session`` as sent on turn ``upto``: the system prompt, every earlier
    turn with its recorded reply, and this turn's user message."""
    msgs = [{"role": "system", "content": system}]
    for turn in session.turns[:upto]:
        msgs.append({"role": "user", "content": turn.user})
        msgs.append({"role": "assistant", "content": turn.reply})
    msgs.append({"role": "user", "content": session.turns[upto].user})
    return msgs


# ---- outcomes and statistics: pure ------------------------------------------------------------


@dataclass(slots=True)
class Rec:
    client: int
    session: int
    turn: int
    model: str
    switch: bool
    behaviour: str
    sent: float = 0.0  # seconds since the cell began
    ttft: float | None = None
    end: float = 0.0
    status: int = 0  # the last attempt's HTTP status; 0: no answer
    outcome: str = "unsent"  # served | refused | failed | client_error | cut | unsent
    failure: str = ""  # 5xx | dropped | timeout (when failed)
    error: str = ""
    tokens: int = 0
    prompt_tokens: int = 0
    attempts: list[str] = field(default_factory=list)  # each try: "200", "503", "dropped" ...
    # The engine's own timings of the prefill (llama-server's ``timings``; the router
    # relays them): tokens computed, tokens reused from a cache, the prefill's milliseconds.
    # elbowroom answers in OpenAI's shape: cached tokens only (usage.prompt_tokens_details,
    # in whole cache blocks).
    prefill_tokens: int | None = None
    cached_tokens: int | None = None
    prefill_ms: float | None = None


def classify(status: int, error: str, first: bool, finished: bool, behaviour: str) -> str:
    """One attempt's outcome: served | refused | failed:<kind> | client_error | cut (still
    running when the cell's window closed and the server was stopped)."""
    if error == "cut":
        return "cut"
    if status == 200:
        if finished or (first and behaviour != "read"):
            return "served"
        return "failed:timeout" if error == "timeout" else "failed:dropped"
    if status in (503, 507, 429):
        return "refused"
    if status >= 500:
        return "failed:5xx"
    if status >= 400:
        return "client_error"
    return "failed:timeout" if error == "timeout" else "failed:dropped"


def retryable(outcome: str) -> bool:
    return outcome == "refused" or outcome.startswith("failed")


def percentile(values: Sequence[float], q: float) -> float | None:
    """The q-th percentile (0-100) by linear interpolation; None for no values."""
    xs = sorted(v for v in values if v is not None and not math.isnan(v))
    if not xs:
        return None
    k = (len(xs) - 1) * q / 100
    lo, hi = math.floor(k), math.ceil(k)
    return xs[lo] + (xs[hi] - xs[lo]) * (k - lo)


def summarize(recs: Sequence[Rec], wall: float) -> dict[str, Any]:
    """One cell's request metrics."""
    served = [r for r in recs if r.outcome == "served"]
    refused_by = Counter(a for r in recs for a in r.attempts if a in ("503", "507", "429"))
    failed = Counter(r.failure for r in recs if r.outcome == "failed")
    ttft = [r.ttft for r in served if r.ttft is not None]
    switch = [r.ttft for r in served if r.ttft is not None and r.switch]
    # tokens a switch's prompt did not recompute (restored from a cache: the KV tiers)
    reused = [float(r.cached_tokens) for r in served if r.switch and r.cached_tokens is not None]
    tokens = sum(r.tokens for r in served)
    return {
        "requests": len(recs),
        "served": len(served),
        "refused": sum(1 for r in recs if r.outcome == "refused"),
        "refusals_by_status": dict(sorted(refused_by.items())),
        "failed": sum(failed.values()),
        "failed_by_kind": dict(sorted(failed.items())),
        "client_error": sum(1 for r in recs if r.outcome == "client_error"),
        "unsent": sum(1 for r in recs if r.outcome == "unsent"),
        "cut": sum(1 for r in recs if r.outcome == "cut"),
        "attempt_5xx": sum(1 for r in recs for a in r.attempts if a.startswith("5")),
        "ttft_p50": percentile(ttft, 50),
        "ttft_p95": percentile(ttft, 95),
        "switch_ttft_p50": percentile(switch, 50),
        "switch_ttft_p95": percentile(switch, 95),
        "switch_n": len(switch),
        "switch_cached_p50": percentile(reused, 50),
        "tokens": tokens,
        "tok_s": tokens / wall if wall > 0 else 0.0,
        "wall_s": wall,
    }


def spread(values: Iterable[float | None]) -> dict[str, float | None]:
    """Median with its min-max range over seeds (None where no seed had a value)."""
    xs = [v for v in values if v is not None]
    if not xs:
        return {"median": None, "min": None, "max": None, "n": 0}
    return {"median": statistics.median(xs), "min": min(xs), "max": max(xs), "n": len(xs)}


_KILLED = re.compile(r"Killed process (\d+) \(([^)]*)\).*?anon-rss:(\d+)kB")
_MEMCG = re.compile(r"oom-kill:.*?oom_memcg=(\S+?),task_memcg=\S*?,task=([^,]*),pid=(\d+)")


def oom_victims(kernel_log: str, cgroup: str) -> list[dict[str, Any]]:
    """The processes the kernel killed for ``cgroup``'s limit (``/name``), from dmesg."""
    ours: set[int] = set()
    for m in _MEMCG.finditer(kernel_log):
        if m.group(1).rstrip("/") == cgroup.rstrip("/"):
            ours.add(int(m.group(3)))
    out = []
    for m in _KILLED.finditer(kernel_log):
        pid = int(m.group(1))
        if pid in ours:
            out.append({"pid": pid, "comm": m.group(2), "anon_mib": int(m.group(3)) // 1024})
    return out


# ---- the systems ------------------------------------------------------------------------------


def free_port() -> int:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def until(cond: Any, timeout: float, what: str) -> Any:
    deadline = time.monotonic() + timeout
    while True:
        value = cond()
        if value:
            return value
        if time.monotonic() > deadline:
            raise TimeoutError(f"timed out after {timeout:.0f} s waiting for {what}")
        time.sleep(0.2)


class Proc:
    """A server started inside ``cg`` (when given), its output in ``log_path``."""

    url = ""

    def __init__(self, cmd: list[str], env: dict[str, str], cg: Cgroup | None, log_path: Path):
        self.log_path = log_path
        argv = cg.command(*cmd) if cg is not None else cmd
        with open(log_path, "wb") as out:
            self.proc = subprocess.Popen(
                argv,
                cwd=REPO,
                env=env,
                stdout=out,
                stderr=subprocess.STDOUT,
                start_new_session=True,
            )

    def log(self) -> str:
        return self.log_path.read_text(errors="replace")

    def alive(self) -> bool:
        return self.proc.poll() is None

    def kill(self) -> None:
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.killpg(self.proc.pid, signal.SIGKILL)

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            with contextlib.suppress(subprocess.TimeoutExpired):
                self.proc.wait(timeout=30)
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.killpg(self.proc.pid, signal.SIGKILL)
        with contextlib.suppress(subprocess.TimeoutExpired):
            self.proc.wait(timeout=30)


def base_env() -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith(("ELBOWROOM_", "LLAMA_"))}
    env["PYTHONUNBUFFERED"] = "1"
    return env


def elbowroom_home(home: Path, files: dict[str, Path], gemma: Path) -> dict[str, str]:
    """A fresh XDG home: the synthesized models in its models folder, the assembled bundled
    gemma3 linked where ``prepare`` puts it (so that nothing is copied per cell)."""
    from elbowroom.models.bundled import GEMMA_FILE

    data = home / "data" / "elbowroom"
    (data / "models").mkdir(parents=True, exist_ok=True)
    (data / "bundled").mkdir(parents=True, exist_ok=True)
    (data / "bundled" / GEMMA_FILE).symlink_to(gemma)
    for name, path in files.items():
        if name not in BUNDLED:
            (data / "models" / f"{name}.gguf").symlink_to(path)
    return {
        "XDG_DATA_HOME": str(home / "data"),
        "XDG_CACHE_HOME": str(home / "cache"),
        "XDG_CONFIG_HOME": str(home / "config"),
    }


def start_elbowroom(home: Path, files: dict[str, Path], gemma: Path, cg: Cgroup | None) -> Proc:
    env = base_env() | elbowroom_home(home, files, gemma) | {"ELBOWROOM_THREADS": str(THREADS)}
    cmd = [sys.executable, "-m", "elbowroom", "serve", "--port", "0"]
    cmd += ["--ctx", str(CTX), "--slots", str(SLOTS)]
    p = Proc(cmd, env, cg, home / "server.log")
    p.url = until(lambda: _listening(p), 240, "elbowroom to listen")
    p.cmd = cmd  # type: ignore[attr-defined]
    return p


def _listening(p: Proc) -> str | None:
    if not p.alive():
        raise RuntimeError(f"elbowroom exited {p.proc.returncode}: {p.log()[-2000:]}")
    m = _LISTENING.search(p.log())
    return m.group(1) if m else None


def router_args(tuned: bool, models_max: int, cache_ram_mib: int) -> list[str]:
    """llama-server's router flags beyond ``--models-dir`` and the address."""
    args = ["-t", str(THREADS), "-tb", str(THREADS), "-np", str(SLOTS), "-c", str(CTX * SLOTS)]
    if tuned:
        args += ["--models-max", str(models_max), "--cache-ram", str(cache_ram_mib)]
    return args


def start_router(
    binary: Path, models_dir: Path, home: Path, cg: Cgroup | None, args: list[str]
) -> Proc:
    port = free_port()
    cmd = [str(binary), "--models-dir", str(models_dir), "--host", "127.0.0.1"]
    cmd += ["--port", str(port), *args]
    p = Proc(cmd, base_env(), cg, home / "router.log")
    p.url = f"http://127.0.0.1:{port}"
    p.cmd = cmd  # type: ignore[attr-defined]

    def ready() -> bool:
        if not p.alive():
            raise RuntimeError(f"llama-server exited {p.proc.returncode}: {p.log()[-2000:]}")
        try:
            return httpx.get(p.url + "/models", timeout=5).status_code == 200
        except httpx.HTTPError:
            return False

    until(ready, 120, "llama-server to listen")
    return p


# ---- a client ---------------------------------------------------------------------------------


class Client:
    """Runs its sessions in order, turn after turn, against one system."""

    def __init__(
        self,
        url: str,
        sessions: list[Session],
        prompts: list[str],
        max_tokens: int,
        t0: float,
        deadline: float,
        timeout: float,
    ) -> None:
        self.url = url
        self.sessions = sessions
        self.prompts = prompts
        self.max_tokens = max_tokens
        self.t0 = t0
        self.deadline = deadline
        self.timeout = timeout
        self.recs: list[Rec] = []
        self.cut = threading.Event()  # set before the server is stopped at the window's end
        self.dangling: list[httpx.Response] = []
        self.http = httpx.Client(
            timeout=httpx.Timeout(timeout, connect=10),
            limits=httpx.Limits(max_connections=32, max_keepalive_connections=8),
        )

    def run(self) -> None:
        for s in self.sessions:
            for i, turn in enumerate(s.turns):
                rec = Rec(s.client, s.index, i, turn.model, turn.switch, turn.behaviour)
                self.recs.append(rec)
                if time.monotonic() >= self.deadline:
                    continue  # unsent
                self.request(rec, messages(self.prompts[s.agent], s, i))

    def request(self, rec: Rec, msgs: list[dict[str, str]]) -> None:
        body = {
            "model": rec.model,
            "messages": msgs,
            "max_tokens": self.max_tokens,
            "temperature": 0,
            "stream": True,
            "stream_options": {"include_usage": True},
        }
        rec.sent = time.monotonic() - self.t0
        for attempt in range(RETRIES + 1):
            outcome, retry_after = self.attempt(rec, body)
            if not retryable(outcome) or attempt == RETRIES or self.cut.is_set():
                break
            if time.monotonic() + retry_after >= self.deadline:
                break
            time.sleep(retry_after)  # the client's back-off, as the official clients do
        rec.end = time.monotonic() - self.t0
        rec.outcome, _, rec.failure = outcome.partition(":")

    def attempt(self, rec: Rec, body: dict[str, Any]) -> tuple[str, float]:
        sent = time.monotonic()
        status, error, first, finished = 0, "", False, False
        retry_after = 1.0
        resp: httpx.Response | None = None
        keep = False
        try:
            req = self.http.build_request("POST", self.url + "/v1/chat/completions", json=body)
            resp = self.http.send(req, stream=True)
            status = resp.status_code
            if status != 200:
                text = resp.read()[:300].decode(errors="replace")
                rec.error = f"{status}: {text}"
                with contextlib.suppress(ValueError):
                    retry_after = min(5.0, max(0.5, float(resp.headers.get("retry-after", 1))))
            else:
                for line in resp.iter_lines():
                    if time.monotonic() - sent > 4 * self.timeout:
                        error = "timeout"
                        break
                    if not line.startswith("data: "):
                        continue
                    if line == "data: [DONE]":
                        finished = True
                        break
                    chunk = json.loads(line[6:])
                    if "error" in chunk:
                        rec.error = str(chunk["error"])[:300]
                        break
                    choices = chunk.get("choices") or []
                    delta = (choices[0].get("delta") or {}) if choices else {}
                    if not first and (delta.get("content") or delta.get("reasoning_content")):
                        first = True
                        rec.ttft = time.monotonic() - sent
                        if rec.behaviour == "drop":
                            keep = True  # stop reading; the connection stays open
                            break
                        if rec.behaviour == "cancel":
                            break  # closed below, mid-stream
                    if choices and choices[0].get("finish_reason") and not first:
                        rec.ttft = time.monotonic() - sent  # no text at all: the answer is whole
                        first = True
                    timings = chunk.get("timings")
                    if isinstance(timings, dict) and "prompt_n" in timings:
                        rec.prefill_tokens = int(timings.get("prompt_n") or 0)
                        rec.cached_tokens = int(timings.get("cache_n") or 0)
                        rec.prefill_ms = float(timings.get("prompt_ms") or 0.0)
                    usage = chunk.get("usage")
                    if usage:
                        rec.tokens = int(usage.get("completion_tokens") or 0)
                        rec.prompt_tokens = int(usage.get("prompt_tokens") or 0)
                        # OpenAI's field (elbowroom relays no engine timings: whole blocks)
                        details = usage.get("prompt_tokens_details") or {}
                        if rec.cached_tokens is None and "cached_tokens" in details:
                            rec.cached_tokens = int(details["cached_tokens"] or 0)
                if first and rec.behaviour != "read":
                    rec.tokens = max(rec.tokens, 1)
        except httpx.TimeoutException as exc:
            error = "cut" if self.cut.is_set() else "timeout"
            rec.error = type(exc).__name__
        except (httpx.HTTPError, json.JSONDecodeError) as exc:
            error = "cut" if self.cut.is_set() else "dropped"
            rec.error = f"{type(exc).__name__}: {exc}"[:300]
        finally:
            if resp is not None:
                if keep:
                    self.dangling.append(resp)
                else:
                    resp.close()
        outcome = classify(status, error, first, finished, rec.behaviour)
        rec.status = status
        rec.attempts.append(str(status) if status and error != "cut" else error or "dropped")
        if outcome.startswith("failed") and status == 200:
            rec.attempts[-1] = outcome.split(":")[1]
        return outcome, retry_after

    def close(self) -> None:
        for r in self.dangling:
            with contextlib.suppress(Exception):
                r.close()
        self.http.close()


# ---- the neighbour ----------------------------------------------------------------------------


class Neighbour(threading.Thread):
    """A process in the cell's cgroup that grows to ``ceiling`` MiB after ``delay`` s at
    ``NEIGHBOUR_RATE`` MiB/s, holds, frees, rests, again until stopped; restarted when the
    kernel kills it (each death recorded)."""

    def __init__(self, cg: Cgroup, ceiling: int, delay: float) -> None:
        super().__init__(daemon=True)
        self.cg, self.ceiling, self.delay = cg, ceiling, delay
        self.halt = threading.Event()
        self.deaths = 0
        self.peak = 0

    def _spawn(self) -> subprocess.Popen[bytes]:
        cmd = self.cg.command(sys.executable, "-c", NEIGHBOUR)
        return subprocess.Popen(cmd, stdin=subprocess.PIPE, stdout=subprocess.PIPE)

    def run(self) -> None:
        proc = self._spawn()
        held = 0

        def send(line: str) -> bool:
            nonlocal proc, held
            assert proc.stdin is not None and proc.stdout is not None
            try:
                proc.stdin.write(line.encode() + b"\n")
                proc.stdin.flush()
                words = proc.stdout.readline().split()
            except OSError:
                words = []
            if len(words) == 2:
                held = int(words[1]) >> 20
                self.peak = max(self.peak, held)
                return True
            proc.wait()
            self.deaths += 1
            held = 0
            proc = self._spawn()
            return False

        try:
            self.halt.wait(self.delay)
            while not self.halt.is_set():
                while held < self.ceiling and not self.halt.is_set():
                    if not send(f"+{STEP_MIB}"):
                        break
                    self.halt.wait(STEP_MIB / NEIGHBOUR_RATE)
                self.halt.wait(6)
                send("-")
                self.halt.wait(4)
        finally:
            with contextlib.suppress(OSError):
                if proc.stdin is not None:
                    proc.stdin.close()
            try:
                proc.wait(timeout=10)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()


# ---- one cell ---------------------------------------------------------------------------------


@dataclass(slots=True)
class Plan:
    files: dict[str, Path]
    gemma: Path
    router_dir: Path
    binary: Path
    sizes: dict[str, int]  # container -> bytes
    fits: dict[str, int]  # container -> how many LLMs fit (for router-tuned)
    cache_ram_mib: int
    clients: int
    sessions: int
    turns: int
    max_tokens: int
    cell_s: float
    timeout: float
    weights: list[float]


def evict_page_cache(paths: Iterable[Path]) -> None:
    """Drop the model files' clean pages from the page cache (these files only), so that the
    cell's own processes read them in and the cgroup is charged for them, as in a container
    that starts cold; otherwise the pages stay charged to whoever read them first."""
    for path in paths:
        fd = os.open(path, os.O_RDONLY)
        try:
            os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
        finally:
            os.close(fd)


def kernel_log() -> str:
    try:
        return subprocess.run(["dmesg"], capture_output=True, text=True, timeout=10).stdout
    except (OSError, subprocess.TimeoutExpired):
        return ""


QUIET_PSI = 5.0  # % of time some task stalled on memory, over a second, to start a cell
QUIET_WAIT_S = 60.0


def psi_total_us() -> int | None:
    """The machine's cumulative memory stall time (PSI ``some total=``, µs); None: no PSI."""
    from elbowroom.memory.probe import parse_psi

    try:
        psi = parse_psi(Path("/proc/pressure/memory").read_text())
    except OSError:
        return None
    return psi.some_total_us if psi is not None else None


def wait_for_quiet_memory() -> float | None:
    """Wait (at most QUIET_WAIT_S) until the machine's memory stalls over one second are
    under QUIET_PSI %: the previous cell's server is stopped, but a thrashing one leaves
    the kernel reclaiming for a moment, and every system starts on a machine as quiet.
    Returns the last second's stall percentage (None: no PSI)."""
    deadline = time.monotonic() + QUIET_WAIT_S
    while True:
        before = psi_total_us()
        if before is None:
            return None
        time.sleep(1.0)  # a measurement over one second, not a synchronisation
        after = psi_total_us()
        if after is None:
            return None
        stalled = max(0, after - before) / 1e4  # µs over 1 s, as a percentage
        if stalled < QUIET_PSI or time.monotonic() >= deadline:
            return stalled


def run_cell(
    plan: Plan, system: str, size: str, phase: str, seed: int, work: Path
) -> dict[str, Any]:
    name = f"arena-{os.getpid()}-{seed}-{size}-{phase}-{system}"
    home = Path(tempfile.mkdtemp(prefix=f"{system}-{size}-{phase}-", dir=work))
    limit = plan.sizes[size]
    evict_page_cache(plan.files.values())
    psi_before = wait_for_quiet_memory()
    cg = Cgroup(name, limit)
    load_before = os.getloadavg()[0]
    server: Proc | None = None
    neighbour: Neighbour | None = None
    clients: list[Client] = []
    started = 0.0
    wall = 0.0
    server_alive: bool | None = None
    error = ""
    try:
        if system == "elbowroom":
            server = start_elbowroom(home, plan.files, plan.gemma, cg)
        else:
            args = router_args(system == "router-tuned", plan.fits[size], plan.cache_ram_mib)
            server = start_router(plan.binary, plan.router_dir, home, cg, args)
        prompts = system_prompts(seed)
        if phase == "swap":
            work_ = swap_workload(seed, [s.name for s in SHAPES], 8)
        else:
            work_ = workload(
                seed, list(plan.files), plan.clients, plan.sessions, plan.turns, plan.weights
            )
        t0 = time.monotonic()
        deadline = t0 + plan.cell_s
        clients = [
            Client(server.url, s, prompts, plan.max_tokens, t0, deadline, plan.timeout)
            for s in work_
        ]
        if phase == "neighbour":
            neighbour = Neighbour(cg, int(limit * NEIGHBOUR_FRAC) >> 20, delay=5.0)
            neighbour.start()
        threads = [threading.Thread(target=c.run, daemon=True) for c in clients]
        started = time.monotonic()
        for t in threads:
            t.start()
        for t in threads:
            t.join(timeout=max(0.0, deadline + GRACE_S - time.monotonic()))
        wall = time.monotonic() - started
        if any(t.is_alive() for t in threads):
            # the window is over: what still runs is cut (not a failure of the system)
            for c in clients:
                c.cut.set()
            alive_now = server.alive()
            server.kill()
            for t in threads:
                t.join(timeout=60)
            server_alive = alive_now
    except Exception as exc:  # a system that cannot start is a result, not a crash
        error = f"{type(exc).__name__}: {exc}"[:2000]
        log(f"    {system} {size}/{phase}: {error[:300]}")
    finally:
        if neighbour is not None:
            neighbour.halt.set()
            neighbour.join(timeout=30)
        for c in clients:
            c.close()
        peak = int(cg.read("memory.max_usage_in_bytes"))
        oom_kills = cg.oom_kills
        failcnt = cg.failcnt
        alive = server_alive if server_alive is not None else bool(server and server.alive())
        if server is not None:
            server.stop()
        cg.remove()
    recs = [r for c in clients for r in c.recs]
    out = summarize(recs, wall) if recs else summarize([], 0.0)
    victims = oom_victims(kernel_log(), "/" + name)
    server_log = server.log() if server is not None else ""
    out.update(
        system=system,
        size=size,
        phase=phase,
        seed=seed,
        limit_bytes=limit,
        peak_bytes=peak,
        oom_kills=oom_kills,
        oom_victims=victims,
        failcnt=failcnt,
        neighbour_deaths=neighbour.deaths if neighbour else 0,
        neighbour_peak_mib=neighbour.peak if neighbour else 0,
        server_alive_at_end=alive,
        start_error=error,
        load_before=load_before,
        psi_before=psi_before,
        load_after=os.getloadavg()[0],
        log_lines=notable_lines(server_log, system),
        errors=Counter(r.error[:160] for r in recs if r.error).most_common(8),
        records=[asdict(r) for r in recs],
        command=getattr(server, "cmd", []),
    )
    if KEEP_LOGS is not None and server is not None:
        KEEP_LOGS.mkdir(parents=True, exist_ok=True)
        (KEEP_LOGS / f"{name}.log").write_text(server_log)
    return out


KEEP_LOGS: Path | None = None
_NOTABLE = {
    "elbowroom": re.compile(
        r"(?i)(traceback|\berror\b|killed|signal|\boom\b|exited|evict|refus|abort| 50[037] )"
    ),
    "router": re.compile(
        r"(?i)(\berror\b|killed|signal|exit|failed|terminat|\boom\b|abort|status 5|evict)"
    ),
}


def notable_lines(text: str, system: str, limit: int = 40) -> list[str]:
    """The server's own lines about errors, exits and kills (the first ``limit``)."""
    pat = _NOTABLE["elbowroom" if system == "elbowroom" else "router"]
    lines = [ln.strip()[:240] for ln in text.splitlines() if pat.search(ln)]
    return lines[:limit]


# ---- warm-up: files and footprints ------------------------------------------------------------


def prepare_files(work: Path) -> tuple[dict[str, Path], Path]:
    """Every model's GGUF path (bundled + synthesized) and the assembled gemma3."""
    from synth_models import ensure

    from elbowroom.config import Settings
    from elbowroom.models.bundled import bundled_specs, gemma_path, prepare

    master = Settings(data_dir=work / "master-data")
    for line in prepare(master):
        log("  " + line)
    specs = {s.id: s.path for s in bundled_specs(master)}
    files = {m: specs[m] for m in BUNDLED}
    files.update(ensure(list(SHAPES)))
    return files, gemma_path(master)


def footprints(plan: Plan, work: Path) -> tuple[dict[str, int], int, int]:
    """elbowroom's bytes for each LLM loaded alone (no cgroup), the server's own resident
    bytes and its prompt-cache grant."""
    home = Path(tempfile.mkdtemp(prefix="warmup-", dir=work))
    server = start_elbowroom(home, plan.files, plan.gemma, None)
    try:
        http = httpx.Client(base_url=server.url, timeout=300)
        rss = _rss(server.proc.pid)
        sizes: dict[str, int] = {}
        grant = 0
        for m in plan.files:
            http.post(f"/api/models/{m}/load").raise_for_status()
            rows = http.get("/api/elbowroom/ps").json()["models"]
            row = next(r for r in rows if r["id"] == m)
            sizes[m] = int(row["bytes"])
            stats = row.get("engine_stats") or {}
            kv = stats.get("kv_cache") or {}
            # the engine's RAM prompt cache (llama.cpp's cache_ram): its grant from the budget
            grant = max(grant, int(stats.get("prompt_cache_grant") or kv.get("ram_budget") or 0))
            http.post(f"/api/models/{m}/unload").raise_for_status()
            log(f"  {m}: {sizes[m] >> 20} MiB")
        http.close()
        return sizes, rss, grant
    finally:
        server.stop()


def _rss(pid: int) -> int:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) * 1024
    return 0


def container_sizes(fp: dict[str, int], server: int) -> tuple[dict[str, int], dict[str, int]]:
    """L: everything fits; M: the two largest LLMs fit; S: the largest barely fits."""
    big = sorted(fp.values(), reverse=True)
    base = server + (96 << 20)  # the server and the client-side headroom of the container
    sizes = {
        "L": int((base + sum(big)) * 1.25),
        "M": int(base + big[0] + big[1] + (96 << 20)),
        "S": int(base + big[0] * 1.15),
    }
    fits = {"L": len(big), "M": 2, "S": 1}
    return {k: (v >> 20) << 20 for k, v in sizes.items()}, fits


# ---- the report -------------------------------------------------------------------------------

METRICS = (
    "requests",
    "served",
    "refused",
    "failed",
    "cut",
    "attempt_5xx",
    "oom_kills",
    "ttft_p50",
    "ttft_p95",
    "switch_ttft_p50",
    "switch_ttft_p95",
    "switch_cached_p50",
    "tok_s",
    "peak_bytes",
    "wall_s",
    "load_before",
)


def aggregate(cells: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Per system, container and phase: each metric's median and range over seeds."""
    keys = sorted({(c["size"], c["phase"], c["system"]) for c in cells}, key=_order)
    out = []
    for size, phase, system in keys:
        mine = [c for c in cells if (c["size"], c["phase"], c["system"]) == (size, phase, system)]
        row: dict[str, Any] = {"size": size, "phase": phase, "system": system, "seeds": len(mine)}
        for m in METRICS:
            row[m] = spread(c.get(m) for c in mine)
        row["oom_kills_total"] = sum(c["oom_kills"] for c in mine)
        row["failed_total"] = sum(c["failed"] for c in mine)
        row["served_total"] = sum(c["served"] for c in mine)
        row["victims"] = [v | {"seed": c["seed"]} for c in mine for v in c["oom_victims"]]
        out.append(row)
    return out


def _order(key: tuple[str, str, str]) -> tuple[int, int, int]:
    size, phase, system = key
    return ("LMS".index(size), PHASES.index(phase), SYSTEMS.index(system))


def targets(rows: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """The issue's targets, cell by cell, against router (defaults) and router-tuned."""
    by = {(r["size"], r["phase"], r["system"]): r for r in rows}
    out = []
    for r in rows:
        if r["system"] != "elbowroom":
            continue
        cell = (r["size"], r["phase"])
        out.append(
            {
                "target": "0 OOM kills, 0 unexplained 5xx",
                "cell": cell,
                "value": f"{r['oom_kills_total']} kills, {r['failed_total']} failed",
                "met": r["oom_kills_total"] == 0 and r["failed_total"] == 0,
            }
        )
        for peer in ("router", "router-tuned"):
            p = by.get((*cell, peer))
            if p is None:
                continue
            mine, theirs = r["switch_ttft_p50"]["median"], p["switch_ttft_p50"]["median"]
            if mine is not None and theirs is not None:
                out.append(
                    {
                        "target": f"first token after a switch <= 1/3 of {peer}'s",
                        "cell": cell,
                        "value": f"{mine:.2f} vs {theirs:.2f} s ({mine / theirs:.2f}x)",
                        "met": mine <= theirs / 3,
                    }
                )
            few = max(r["served"]["median"] or 0, p["served"]["median"] or 0) < MIN_SERVED
            if r["size"] == "L" and r["phase"] == "work":
                a, b = r["tok_s"]["median"], p["tok_s"]["median"]
                out.append(
                    {
                        "target": f"tok/s >= 0.9x {peer}'s where everything fits",
                        "cell": cell,
                        "value": f"{a:.1f} vs {b:.1f}" + (f" ({a / b:.2f}x)" if b else ""),
                        "met": None if few else a >= 0.9 * b,
                    }
                )
            if r["size"] in ("M", "S") and r["phase"] != "swap":
                a, b = r["served"]["median"], p["served"]["median"]
                out.append(
                    {
                        "target": f"served >= {peer}'s in a tight container",
                        "cell": cell,
                        "value": f"{a:g} vs {b:g}",
                        "met": None if few else a >= b,
                    }
                )
    return out


def _fmt(s: dict[str, Any], scale: float = 1.0, digits: int = 2) -> str:
    if s["median"] is None:
        return "–"
    med, lo, hi = (s[k] / scale for k in ("median", "min", "max"))
    if lo == hi:
        return f"{med:.{digits}f}"
    return f"{med:.{digits}f} ({lo:.{digits}f}–{hi:.{digits}f})"


def _verdict(met: bool | None) -> str:
    if met is None:
        return f"inconclusive (fewer than {MIN_SERVED} served)"
    return "yes" if met else "**no**"


COLD_CACHED = 512  # a switch whose request reused fewer prompt tokens than this was cold


def switch_split(cells: list[dict[str, Any]]) -> list[str]:
    """The first requests after a switch, split by whether the model already held the
    prompt's prefix (warm: at least COLD_CACHED tokens reused) or prefilled it (cold), over
    every seed: the median of all switches depends on how many were cold, which the work's
    order decides as much as the system."""
    groups: dict[tuple[str, str, str], list[tuple[float, float]]] = {}
    for c in cells:
        for r in c.get("records", ()):
            if r["switch"] and r["outcome"] == "served" and r.get("cached_tokens") is not None:
                key = (c["size"], c["phase"], c["system"])
                groups.setdefault(key, []).append((float(r["cached_tokens"]), float(r["ttft"])))
    if not groups:
        return []
    lines = [
        "",
        "## Switches, cold and warm",
        "",
        f"First requests after a switch (streams read to the end, all seeds), split by the "
        f"prompt tokens they reused: *cold* under {COLD_CACHED} (the model prefilled the "
        "shared system prompt), *warm* otherwise; first token in seconds, p50.",
        "",
        "| container | phase | system | switches | cold | cold p50 | warm | warm p50 |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for (size, phase, system), xs in sorted(groups.items()):
        cold = [t for cached, t in xs if cached < COLD_CACHED]
        warm = [t for cached, t in xs if cached >= COLD_CACHED]
        p50 = [percentile(part, 50) for part in (cold, warm)]
        cold_p50, warm_p50 = (f"{v:.2f}" if v is not None else "–" for v in p50)
        lines.append(
            f"| {size} | {phase} | {system} | {len(xs)} | {len(cold)} | {cold_p50} "
            f"| {len(warm)} | {warm_p50} |"
        )
    return lines


def markdown(result: dict[str, Any]) -> str:
    rows, meta = result["rows"], result["meta"]
    lines = [
        "# Arena: elbowroom vs llama.cpp's router mode",
        "",
        f"Recorded {meta['date']} on {meta['machine']} (load average "
        f"{meta['load_min']:.1f}–{meta['load_max']:.1f} before the cells, the arena's own "
        "previous cell included). "
        f"Command: `{meta['command']}`.",
        "",
        "Models: "
        + ", ".join(f"{k} ({v >> 20} MiB by elbowroom)" for k, v in meta["footprints"].items())
        + ". "
        "Containers (cgroup v1 memory limit): "
        + ", ".join(f"{k} {v >> 20} MiB" for k, v in meta["sizes"].items())
        + f". Threads {THREADS}, slots {SLOTS}, context {CTX} per slot on every system; "
        f"router-tuned: `--models-max` {meta['fits']}, `--cache-ram` {meta['cache_ram_mib']} MiB. "
        f"Work per cell: {meta['clients']} clients × {meta['sessions']} session(s) × "
        f"{meta['turns']} turns, max_tokens {meta['max_tokens']}, a ~{meta['system_tokens']}-token "
        f"system prompt, seeds {meta['seeds']}.",
        "",
        "Medians over seeds with (min–max). served / refused / failed / cut count requests "
        "(after the client's retries; cut: still running 15 s after the window closed, when "
        "the server was stopped — not a failure); 5xx tries counts every 5xx answer, retried "
        "or not. Kills: the cgroup's OOM-kill counter summed over seeds. First token in "
        "seconds; its cached tokens: the median prompt tokens a switch's request did not "
        "recompute (the router's own `timings`; elbowroom's usage, in whole cache blocks); "
        "load: the 1-minute load average before the cell. Each cell starts once the "
        f"machine's memory stalls over a second are under {QUIET_PSI:g} % (PSI, at most "
        f"{QUIET_WAIT_S:.0f} s): a server that thrashed in the previous cell leaves none "
        "behind for the next one.",
        "",
        "| container | phase | system | served | refused | failed | cut | 5xx tries | OOM kills "
        "| first token p50 | p95 | after a switch p50 | p95 | its cached tokens | tok/s "
        "| peak MiB | wall s | load |",
        "|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for r in rows:
        lines.append(
            f"| {r['size']} | {r['phase']} | {r['system']} | {_fmt(r['served'], digits=0)} "
            f"| {_fmt(r['refused'], digits=0)} | {_fmt(r['failed'], digits=0)} "
            f"| {_fmt(r['cut'], digits=0)} "
            f"| {_fmt(r['attempt_5xx'], digits=0)} | {r['oom_kills_total']} "
            f"| {_fmt(r['ttft_p50'])} | {_fmt(r['ttft_p95'])} | {_fmt(r['switch_ttft_p50'])} "
            f"| {_fmt(r['switch_ttft_p95'])} | {_fmt(r['switch_cached_p50'], digits=0)} "
            f"| {_fmt(r['tok_s'], digits=1)} "
            f"| {_fmt(r['peak_bytes'], 1 << 20, 0)} | {_fmt(r['wall_s'], digits=0)} "
            f"| {_fmt(r['load_before'], digits=1)} |"
        )
    lines += ["", "## Targets", "", "| target | cell | value | met |", "|---|---|---|---|"]
    for t in result["targets"]:
        lines.append(
            f"| {t['target']} | {'/'.join(t['cell'])} | {t['value']} | {_verdict(t['met'])} |"
        )
    lines += switch_split(result["cells"])
    lines += ["", "## OOM victims (the kernel's log)", ""]
    any_victim = False
    for r in rows:
        for v in r["victims"]:
            any_victim = True
            lines.append(
                f"- {r['system']} {r['size']}/{r['phase']} seed {v['seed']}: pid {v['pid']} "
                f"`{v['comm']}` ({v['anon_mib']} MiB anonymous)"
            )
    if not any_victim:
        lines.append("- none")
    lines += ["", "## The servers' own lines (first seed with any, per cell)", ""]
    for c in result["cells"]:
        if c["log_lines"] and c["seed"] == meta["seeds"][0]:
            lines.append(f"**{c['system']} {c['size']}/{c['phase']}** (seed {c['seed']}):")
            lines.append("```")
            lines += c["log_lines"][:8]
            lines.append("```")
    lines += ["", "## Notes", "", *meta.get("notes", [])]
    return "\n".join(lines) + "\n"


def plot(result: dict[str, Any], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    rows = result["rows"]
    cells = sorted({(r["size"], r["phase"]) for r in rows}, key=lambda c: _order((*c, "router")))
    panels = [
        ("served", "requests served (of all sent)", 1.0),
        ("oom_kills", "OOM kills (per seed)", 1.0),
        ("switch_ttft_p50", "first token after a switch, p50 (s)", 1.0),
        ("tok_s", "aggregate tok/s", 1.0),
    ]
    fig, axes = plt.subplots(1, 4, figsize=(18, 4.2))
    colors = {"elbowroom": "#2a7", "router": "#c44", "router-tuned": "#e90"}
    width = 0.8 / len(SYSTEMS)
    for ax, (metric, title, _) in zip(axes, panels, strict=True):
        for i, system in enumerate(SYSTEMS):
            xs, ys, lo, hi = [], [], [], []
            for j, cell in enumerate(cells):
                r = next(
                    (r for r in rows if (r["size"], r["phase"], r["system"]) == (*cell, system)),
                    None,
                )
                if r is None or r[metric]["median"] is None:
                    continue
                s = r[metric]
                xs.append(j + (i - 1) * width)
                ys.append(s["median"])
                lo.append(s["median"] - s["min"])
                hi.append(s["max"] - s["median"])
            ax.bar(xs, ys, width, yerr=[lo, hi], label=system, color=colors[system], capsize=2)
        ax.set_xticks(range(len(cells)), [f"{s}\n{p}" for s, p in cells])
        ax.set_title(title, fontsize=10)
    axes[0].legend(fontsize=8)
    fig.suptitle(
        "elbowroom vs llama-server router mode, same work in the same cgroup "
        "(medians over seeds, bars: min–max)",
        fontsize=11,
    )
    fig.tight_layout()
    fig.savefig(path, dpi=110)


# ---- main -------------------------------------------------------------------------------------


def write_report(result: dict[str, Any], out: Path) -> None:
    out.parent.mkdir(parents=True, exist_ok=True)
    out.with_suffix(".json").write_text(json.dumps(result, indent=1, default=str))
    out.with_suffix(".md").write_text(markdown(result))
    plot(result, out.with_suffix(".png"))


def report_only(paths: list[Path], out: Path, as_json: bool) -> int:
    """The report of one or more recorded runs (their cells merged; the first run's meta,
    with each run's commands, seeds and load averages)."""
    runs = [json.loads(p.read_text()) for p in paths]
    cells = [c for r in runs for c in r["cells"]]
    meta = dict(runs[0]["meta"])
    meta["command"] = "`; `".join(r["meta"]["command"] for r in runs)
    meta["load_min"] = min(r["meta"]["load_min"] for r in runs)
    meta["load_max"] = max(r["meta"]["load_max"] for r in runs)
    meta["total_wall_s"] = sum(r["meta"]["total_wall_s"] for r in runs)
    meta["notes"] = [n for r in runs for n in r["meta"].get("notes", [])]
    meta["seeds"] = sorted({c["seed"] for c in cells})
    rows = aggregate(cells)
    result = {"meta": meta, "rows": rows, "targets": targets(rows), "cells": cells}
    write_report(result, out)
    print(json.dumps(rows, indent=1, default=str) if as_json else markdown(result))
    return 0


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--quick", action="store_true", help="1 seed, shorter sessions (< 10 min)")
    ap.add_argument("--seeds", default="1,2,3")
    ap.add_argument(
        "--cells",
        help=f"SIZE/PHASE,... (default {','.join(CELLS)}; --quick: {','.join(QUICK_CELLS)})",
    )
    ap.add_argument("--systems", default=",".join(SYSTEMS))
    ap.add_argument("--clients", type=int, default=4)
    ap.add_argument("--turns", type=int, default=4)
    ap.add_argument("--max-tokens", type=int, default=16)
    ap.add_argument("--cell-seconds", type=float, default=75.0, help="each cell's window")
    ap.add_argument("--timeout", type=float, default=120.0, help="per read, per request")
    ap.add_argument("--out", type=Path, default=RESULTS / "arena")
    ap.add_argument("--logs", type=Path, help="keep every server log here")
    ap.add_argument("--json", action="store_true", help="print the summary rows as JSON")
    ap.add_argument(
        "--from-json",
        help="only write the report from recorded runs (comma-separated JSON files, merged)",
    )
    args = ap.parse_args(argv)
    if args.from_json:
        return report_only([Path(p) for p in args.from_json.split(",")], args.out, args.json)
    if not v1_available():
        log(f"needs root and cgroup v1 memory at {CGROUP_V1} (the v2 path is not written yet)")
        return 2
    global KEEP_LOGS
    KEEP_LOGS = args.logs
    seeds = [int(s) for s in args.seeds.split(",")]
    turns, max_tokens, cell_s = args.turns, args.max_tokens, args.cell_seconds
    if args.quick:
        seeds, turns, max_tokens, cell_s = seeds[:1], 3, 8, 30.0
    chosen = args.cells or ",".join(QUICK_CELLS if args.quick else CELLS)
    cells = [tuple(c.split("/")) for c in chosen.split(",")]
    systems = args.systems.split(",")

    import xllamacpp
    from engine_speed import llama_server_binary

    routers = [s for s in systems if s != "elbowroom"]
    binary = llama_server_binary(xllamacpp.__version__, "native") if routers else Path()
    work = Path(tempfile.mkdtemp(prefix="arena-"))
    wall0 = time.monotonic()
    try:
        files, gemma = prepare_files(work)
        router_dir = work / "router-models"
        router_dir.mkdir()
        for name, path in files.items():
            (router_dir / f"{name}.gguf").symlink_to(path)
        plan = Plan(
            files,
            gemma,
            router_dir,
            binary,
            {},
            {},
            0,
            args.clients,
            1,
            turns,
            max_tokens,
            cell_s,
            args.timeout,
            [1.0] * len(files),
        )
        log("warm-up: each LLM alone in elbowroom, for its footprint")
        fp, server_rss, grant = footprints(plan, work)
        plan.sizes, plan.fits = container_sizes(fp, server_rss)
        from elbowroom.config import load_settings

        plan.cache_ram_mib = (grant or load_settings(environ={}).kv_ram_max) >> 20
        log(
            f"containers: { {k: v >> 20 for k, v in plan.sizes.items()} } MiB; "
            f"router-tuned --cache-ram {plan.cache_ram_mib} MiB (elbowroom's largest grant)"
        )
        results: list[dict[str, Any]] = []
        for seed in seeds:
            for size, phase in cells:
                order = systems[seed % len(systems) :] + systems[: seed % len(systems)]
                for system in order:
                    log(f"seed {seed} {size}/{phase}: {system}")
                    c = run_cell(plan, system, size, phase, seed, work)
                    log(
                        f"    served {c['served']}/{c['requests']} refused {c['refused']} "
                        f"failed {c['failed']} {c['failed_by_kind']} kills {c['oom_kills']} "
                        f"switch p50 {c['switch_ttft_p50']} tok/s {c['tok_s']:.1f} "
                        f"peak {c['peak_bytes'] >> 20} MiB wall {c['wall_s']:.0f} s "
                        f"load {c['load_before']:.1f}"
                    )
                    results.append(c)
        sample = system_prompts(seeds[0])[0]
        prompt_tokens = [
            c_r["prompt_tokens"]
            for c in results
            for c_r in c["records"]
            if c_r["turn"] == 0 and c_r["prompt_tokens"] and c_r["model"] != "gemma3-270m"
        ]
        rows = aggregate(results)
        loads = [c["load_before"] for c in results]
        meta = {
            "date": datetime.now(UTC).strftime("%Y-%m-%d %H:%M UTC"),
            "machine": f"{os.cpu_count()} cores",
            "command": " ".join(
                ["sudo .venv/bin/python benchmarks/arena.py", *(argv or sys.argv[1:])]
            ),
            "seeds": seeds,
            "sizes": plan.sizes,
            "fits": plan.fits,
            "footprints": fp,
            "server_rss": server_rss,
            "cache_ram_mib": plan.cache_ram_mib,
            "clients": plan.clients,
            "sessions": plan.sessions,
            "turns": turns,
            "max_tokens": max_tokens,
            "system_words": len(sample.split()),
            "system_tokens": int(statistics.median(prompt_tokens)) if prompt_tokens else 0,
            "load_min": min(loads),
            "load_max": max(loads),
            "total_wall_s": time.monotonic() - wall0,
            "binary": str(binary),
            "notes": [],
        }
        result = {"meta": meta, "rows": rows, "targets": targets(rows), "cells": results}
        out: Path = args.out
        write_report(result, out)
        log(f"wrote {out}.{{json,md,png}} in {meta['total_wall_s']:.0f} s")
        if args.json:
            print(json.dumps(rows, indent=1, default=str))
        else:
            print(out.with_suffix(".md").read_text())
    finally:
        if not args.logs:
            subprocess.run(["rm", "-rf", str(work)], check=False)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
