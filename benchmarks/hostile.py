"""/health latency while each hostile request of issue 28 runs, against idle rounds.

Starts `elbowroom serve` (fresh folders, `--ctx 1024`, the module settings of
tests/e2e/test_hostile.py: `max_body` 128 MiB, `header_timeout` 2 s, `body_timeout` 3 s,
`max_connections` 96), then runs rounds; each round measures /health from a thread
(sequential GETs, 20 ms apart) once with nothing else going on (the baseline) and once
during each attack, in that order, so that baseline and attacks share the machine's load:

- grammar: a chat request whose `response_format` enum has 30,000 values (refused 400);
- nested: a chat request whose schema pattern nests `{0,1024}` three deep, inside every
  schema bound (served: 200; as GBNF it held the engine for good);
- integers: four 32 MB bodies of 4,299-digit integers at once (refused 400);
- heads: 400 connections that send half a request head and stall;
- bodies: four connections declaring 32 MiB bodies and a 128 MiB /api/chat that send
  nothing, while a 400 KB request is served (the stalled ones end with 408).

Then the cost left inside the bounds: another slot's 2-token chat while a request with a
`max_schema_members` (256) enum grammar or the nested pattern runs, against the same
2-token chat beside a plain request, interleaved. And what one client learns of another's
prompt (docs/security.md, "What `cached_tokens` tells another client"): client A sends a
fresh ~900-token prompt, then client B the same prompt, plainly (prefix reuse, the
default) or with `cache_salt`; B's time and `cached_tokens`, interleaved.

    python benchmarks/hostile.py --rounds 5   # writes results/hostile.{json,md}
    # one attack against the idle baseline, nothing else (no 2-token or prefix rounds):
    python benchmarks/hostile.py --rounds 5 --only integers --out hostile_integers
"""

from __future__ import annotations

import argparse
import json
import os
import re
import secrets
import socket
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Callable
from datetime import UTC, datetime
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit

import httpx

REPO = Path(__file__).resolve().parents[1]
RESULTS = Path(__file__).with_name("results")
MODEL = "smollm2-135m"
HI = [{"role": "user", "content": "Say hi."}]
_LISTENING = re.compile(r"elbowroom listening on (http://\S+)")


def wait_for(condition: Callable[[], Any], timeout: float, what: str) -> Any:
    deadline = time.monotonic() + timeout
    while True:
        try:
            value = condition()
        except (httpx.HTTPError, OSError):
            value = None
        if value:
            return value
        if time.monotonic() > deadline:
            raise SystemExit(f"timed out waiting for {what}")
        time.sleep(0.1)


def start_server(home: Path) -> tuple[subprocess.Popen[bytes], str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith("ELBOWROOM_")}
    env.update(
        XDG_DATA_HOME=str(home / "data"),
        XDG_CACHE_HOME=str(home / "cache"),
        XDG_CONFIG_HOME=str(home / "config"),
        ELBOWROOM_MAX_BODY="128MiB",
        ELBOWROOM_MAX_CHARS="100000000",
        ELBOWROOM_HEADER_TIMEOUT="2",
        ELBOWROOM_BODY_TIMEOUT="3",
        ELBOWROOM_MAX_CONNECTIONS="96",
        PYTHONUNBUFFERED="1",
    )
    log_path = home / "server.log"
    with open(log_path, "wb") as log:
        server = subprocess.Popen(
            [sys.executable, "-m", "elbowroom", "serve", "--port", "0", "--ctx", "1024"],
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


class Probe:
    def __init__(self, url: str) -> None:
        self.url = url + "/health"
        self.latencies: list[float] = []
        self.failures = 0
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)

    def __enter__(self) -> Probe:
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        self._thread.join(timeout=60)

    def _run(self) -> None:
        with httpx.Client(timeout=30) as client:
            while not self._stop.is_set():
                began = time.perf_counter()
                try:
                    ok = client.get(self.url).status_code == 200
                except httpx.HTTPError:
                    ok = False
                self.latencies.append(time.perf_counter() - began)
                self.failures += not ok
                self._stop.wait(0.02)


def p99(values: list[float]) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(len(ordered) * 0.99))]


def post_raw(url: str, body: bytes, path: str = "/v1/chat/completions") -> int:
    r = httpx.post(url + path, content=body, headers={"content-type": "application/json"})
    return r.status_code


def half_sent(url: str, head: str) -> socket.socket:
    parts = urlsplit(url)
    sock = socket.create_connection((parts.hostname, parts.port), timeout=30)
    sock.sendall(head.encode())
    return sock


def attack_idle(url: str) -> str:
    time.sleep(2.0)
    return "-"


def attack_grammar(url: str) -> str:
    schema = {"enum": [secrets.token_hex(4) for _ in range(30_000)]}
    fmt = {"type": "json_schema", "json_schema": {"name": "x", "schema": schema}}
    r = httpx.post(
        url + "/v1/chat/completions",
        json={"model": MODEL, "messages": HI, "response_format": fmt},
        timeout=120,
    )
    time.sleep(1.0)
    return str(r.status_code)


INTS = b'{"model": "smollm2-135m", "seed": [' + b",".join([b"7" * 4299] * 7400) + b"]}"


# Inside every schema bound (52 bytes, each repetition at max_schema_repeat): as GBNF the
# engine's loop never let go of it; sent as an llguidance grammar (engines/llama_grammar.py).
NESTED = {"type": "string", "pattern": "^(((a?){0,1024}){0,1024}){0,1024}$"}
NESTED_FMT = {
    "response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": NESTED}}
}


def attack_nested(url: str) -> str:
    r = httpx.post(
        url + "/v1/chat/completions",
        json={"model": MODEL, "messages": HI, "max_tokens": 24, **NESTED_FMT},
        timeout=300,
    )
    return str(r.status_code)


def attack_integers(url: str) -> str:
    sender = (
        "import sys, httpx; r = httpx.post(sys.argv[1], content=sys.stdin.buffer.read(), "
        "headers={'content-type': 'application/json'}, timeout=120); print(r.status_code)"
    )
    procs = [
        subprocess.Popen(
            [sys.executable, "-c", sender, url + "/v1/chat/completions"],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
        )
        for _ in range(4)
    ]
    for p in procs:
        assert p.stdin is not None
        p.stdin.write(INTS)
        p.stdin.close()
    codes = []
    for p in procs:
        assert p.stdout is not None
        codes.append(p.stdout.read().decode().strip())
        p.wait(timeout=120)
    return ",".join(sorted(set(codes)))


def attack_heads(url: str) -> str:
    socks = [half_sent(url, "POST /v1/chat/completions HTTP/1.1\r\nHost: x") for _ in range(400)]
    time.sleep(3.0)  # past header_timeout
    closed = 0
    for s in socks:
        s.setblocking(False)
        try:
            s.recv(65536)
            closed += 1
        except BlockingIOError:
            pass
        except ConnectionResetError:
            closed += 1
        s.close()
    return f"{closed}/400 closed"


def attack_bodies(url: str) -> str:
    head = (
        "POST {p} HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Type: application/json\r\n"
        "Content-Length: {n}\r\n\r\n{{"
    )
    socks = [half_sent(url, head.format(p="/v1/chat/completions", n=32 << 20)) for _ in range(4)]
    socks.append(half_sent(url, head.format(p="/api/chat", n=128 << 20)))
    big = {"model": "no-such-model", "messages": [{"role": "user", "content": "z" * 400_000}]}
    code = httpx.post(url + "/v1/chat/completions", json=big, timeout=30).status_code
    answers = []
    for s in socks:
        s.settimeout(30)
        answers.append(s.recv(64)[9:12].decode(errors="replace"))
        s.close()
    return f"{code}; stalled {','.join(sorted(set(answers)))}"


# --only's names for the attacks (the idle baseline always runs).
SHORT = {
    "grammar": "grammar bomb (30,000-value enum)",
    "nested": "nested-repeat pattern inside the bounds",
    "integers": "four 32 MB bodies of 4,299-digit integers",
    "heads": "400 half-sent request heads",
    "bodies": "stalled 4 x 32 MiB + 128 MiB bodies",
}

ATTACKS: dict[str, Callable[[str], str]] = {
    "idle (baseline)": attack_idle,
    "grammar bomb (30,000-value enum)": attack_grammar,
    "nested-repeat pattern inside the bounds": attack_nested,
    "four 32 MB bodies of 4,299-digit integers": attack_integers,
    "400 half-sent request heads": attack_heads,
    "stalled 4 x 32 MiB + 128 MiB bodies": attack_bodies,
}


def chat(url: str, extra: dict[str, Any], max_tokens: int) -> float:
    began = time.perf_counter()
    r = httpx.post(
        url + "/v1/chat/completions",
        json={"model": MODEL, "messages": HI, "max_tokens": max_tokens, **extra},
        timeout=300,
    )
    assert r.status_code == 200, r.text[:300]
    return time.perf_counter() - began


def beside(url: str, extra: dict[str, Any]) -> float:
    """A 2-token chat's latency while a 24-token request with ``extra`` runs beside it."""
    other = threading.Thread(target=chat, args=(url, extra, 24))
    other.start()
    time.sleep(0.1)
    took = chat(url, {}, 2)
    other.join()
    return took


def probe_prefix(url: str, salted: bool) -> tuple[float, int]:
    """B's seconds and cached_tokens for the prompt A sent just before."""
    words = " ".join(secrets.token_hex(3) for _ in range(150))
    messages = [{"role": "user", "content": f"Summarize: {words}"}]
    httpx.post(
        url + "/v1/chat/completions",
        json={"model": MODEL, "messages": messages, "max_tokens": 1},
        timeout=300,
    ).raise_for_status()
    extra = {"cache_salt": "client-b"} if salted else {}
    began = time.perf_counter()
    r = httpx.post(
        url + "/v1/chat/completions",
        json={"model": MODEL, "messages": messages, "max_tokens": 1, **extra},
        timeout=300,
    )
    took = time.perf_counter() - began
    r.raise_for_status()
    details = r.json()["usage"].get("prompt_tokens_details") or {}
    return took, int(details.get("cached_tokens") or 0)


def summary(values: list[float]) -> dict[str, float]:
    return {
        "median": statistics.median(values),
        "min": min(values),
        "max": max(values),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--out", default="hostile")
    parser.add_argument(
        "--only",
        choices=sorted(SHORT),
        action="append",
        help="run only these attacks (and the idle baseline), without the 2-token and "
        "prefix rounds; repeatable",
    )
    args = parser.parse_args()
    attacks = {
        name: attack
        for name, attack in ATTACKS.items()
        if not args.only or name == "idle (baseline)" or name in {SHORT[o] for o in args.only}
    }
    home = Path(tempfile.mkdtemp(prefix="hostile-bench-"))
    server, url = start_server(home)
    loads: list[float] = []
    health: dict[str, list[dict[str, Any]]] = {name: [] for name in attacks}
    grammar: dict[str, list[float]] = {"plain": [], "enum256": [], "nested": []}
    prefix: dict[str, list[tuple[float, int]]] = {"shared": [], "cache_salt": []}
    try:
        chat(url, {}, 2)  # load the model
        enum = {"type": "object", "properties": {"c": {"enum": [f"v{i}" for i in range(255)]}}}
        fmt = {
            "response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": enum}}
        }
        for _ in range(args.rounds):
            loads.append(os.getloadavg()[0])
            for name, attack in attacks.items():
                with Probe(url) as probe:
                    outcome = attack(url)
                health[name].append(
                    {
                        "p50": statistics.median(probe.latencies),
                        "p99": p99(probe.latencies),
                        "max": max(probe.latencies),
                        "n": len(probe.latencies),
                        "failures": probe.failures,
                        "outcome": outcome,
                    }
                )
            if args.only:
                continue
            grammar["plain"].append(beside(url, {}))
            grammar["enum256"].append(beside(url, fmt))
            grammar["nested"].append(beside(url, NESTED_FMT))
            prefix["shared"].append(probe_prefix(url, salted=False))
            prefix["cache_salt"].append(probe_prefix(url, salted=True))
    finally:
        server.terminate()
        server.wait(timeout=60)
    result = {
        "date": datetime.now(UTC).isoformat(timespec="seconds"),
        "rounds": args.rounds,
        "loadavg_1m": summary(loads),
        "cpus": os.cpu_count(),
        "health": health,
        "only": args.only,
    }
    if not args.only:
        result |= {
            "two_token_beside": {k: summary(v) for k, v in grammar.items()},
            "two_token_raw": grammar,
            "prefix_b_seconds": {k: summary([t for t, _ in v]) for k, v in prefix.items()},
            "prefix_raw": prefix,
        }
    command = "".join(f" --only {o}" for o in args.only or ())
    RESULTS.mkdir(exist_ok=True)
    (RESULTS / f"{args.out}.json").write_text(json.dumps(result, indent=2))
    lines = [
        "# /health during hostile requests (issue 28)",
        "",
        f"{result['date']}, {args.rounds} interleaved rounds, {os.cpu_count()} CPUs, 1-minute "
        f"load average median {result['loadavg_1m']['median']:.2f} "
        f"({result['loadavg_1m']['min']:.2f}-{result['loadavg_1m']['max']:.2f}); a machine "
        f"shared with other work. `python benchmarks/hostile.py{command}`.",
        "",
        "| during | /health p50 ms | p99 ms (median, range) | max ms | failed | outcome |",
        "|---|---|---|---|---|---|",
    ]
    for name, rows in health.items():
        p99s = [r["p99"] * 1000 for r in rows]
        lines.append(
            f"| {name} | {statistics.median(r['p50'] * 1000 for r in rows):.1f} | "
            f"{statistics.median(p99s):.1f} ({min(p99s):.1f}-{max(p99s):.1f}) | "
            f"{max(r['max'] * 1000 for r in rows):.1f} | {sum(r['failures'] for r in rows)} | "
            f"{rows[-1]['outcome']} |"
        )
    if args.only:
        lines.append("")
        (RESULTS / f"{args.out}.md").write_text("\n".join(lines))
        print("\n".join(lines))
        return
    plain, bound = result["two_token_beside"]["plain"], result["two_token_beside"]["enum256"]
    nested = result["two_token_beside"]["nested"]
    lines += [
        "",
        "A 2-token chat beside a 24-token request, seconds (median, range):",
        "",
        "| beside | 2-token chat s |",
        "|---|---|",
        f"| a plain request | {plain['median']:.2f} ({plain['min']:.2f}-{plain['max']:.2f}) |",
        f"| a 256-member enum grammar (max_schema_members) | {bound['median']:.2f} "
        f"({bound['min']:.2f}-{bound['max']:.2f}) |",
        f"| ratio | {bound['median'] / plain['median']:.2f} |",
        f"| the nested-repeat pattern (every repeat at max_schema_repeat) | "
        f"{nested['median']:.2f} ({nested['min']:.2f}-{nested['max']:.2f}) |",
        f"| ratio | {nested['median'] / plain['median']:.2f} |",
        "",
        "Client B's request for the ~900-token prompt client A sent just before (1 token out):",
        "",
        "| B sends | seconds (median, range) | cached_tokens seen |",
        "|---|---|---|",
    ]
    for name, pairs in prefix.items():
        secs = result["prefix_b_seconds"][name]
        seen = sorted({c for _, c in pairs})
        lines.append(
            f"| {'plainly (reuse on)' if name == 'shared' else 'with cache_salt'} | "
            f"{secs['median']:.2f} ({secs['min']:.2f}-{secs['max']:.2f}) | {seen} |"
        )
    lines.append("")
    (RESULTS / f"{args.out}.md").write_text("\n".join(lines))
    print("\n".join(lines))


if __name__ == "__main__":
    main()
