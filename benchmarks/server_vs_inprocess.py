"""Decode speed and time to first token: through `elbowroom serve` vs llama-cpp-python in-process.

Same model file, chat template, prompt, greedy sampling, n_ctx, batch and thread count, in
the same run. Rounds alternate (server, in-process, server, ...) so that a busy machine
slows both sides alike; medians and best rounds are reported, and the CPU seconds each
request cost (the model's process, the server process, the HTTP client), which contention
does not inflate. Each round's prompt starts with a different number, so neither side
reuses a cached prompt prefix (elbowroom's KV prefix cache is also off for the server).
Afterwards it records the idle memory of the server process and of the runner with the
model loaded.

    .venv/bin/python benchmarks/server_vs_inprocess.py [--rounds 5] [--max-tokens 128]

Writes benchmarks/results/server_vs_inprocess.{md,json}.
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
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import httpx
import openai

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from elbowroom.config import load_settings  # noqa: E402
from elbowroom.engines.llama import DEFAULT_N_BATCH  # noqa: E402
from elbowroom.memory.process import measure_pid  # noqa: E402
from elbowroom.models.catalog import discover  # noqa: E402
from elbowroom.units import format_size  # noqa: E402

MODEL = "smollm2-135m"
PROMPT = "Write a long, detailed story about a lighthouse keeper and a storm."


@dataclass(frozen=True)
class Run:
    side: str  # "server" | "in-process"
    ttft: float  # seconds from sending the request to the first content token
    tokens: int  # completion tokens
    decode_tps: float  # tokens after the first / seconds after the first
    # CPU seconds the request cost: the model's process (runner, or this process
    # in-process), the server process, and this process as the HTTP client.
    cpu_model: float
    cpu_server: float = 0.0
    cpu_client: float = 0.0


def cpu_seconds(pid: int) -> float:
    """utime + stime of a process (all its threads), from /proc."""
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def prompt(round_no: int) -> list[dict[str, str]]:
    return [{"role": "user", "content": f"{round_no}. {PROMPT}"}]


def decode_rate(tokens: int, first: float, last: float) -> float:
    return (tokens - 1) / (last - first) if tokens > 1 and last > first else 0.0


# --- in-process


def load_inprocess(path: Path, n_ctx: int, threads: int | None) -> Any:
    import llama_cpp

    return llama_cpp.Llama(
        model_path=str(path),
        n_ctx=n_ctx,
        n_batch=min(n_ctx, DEFAULT_N_BATCH),
        n_threads=threads,
        n_threads_batch=threads,
        use_mmap=True,
        verbose=False,
    )


def run_inprocess(llm: Any, round_no: int, max_tokens: int) -> Run:
    cpu = time.process_time()
    sent = time.perf_counter()
    first = last = 0.0
    tokens = 0
    for chunk in llm.create_chat_completion(
        messages=prompt(round_no), max_tokens=max_tokens, temperature=0.0, stream=True
    ):
        if chunk["choices"][0]["delta"].get("content"):
            last = time.perf_counter()
            first = first or last
            tokens += 1  # llama-cpp-python streams one chunk per generated token
    return Run(
        "in-process",
        first - sent,
        tokens,
        decode_rate(tokens, first, last),
        cpu_model=time.process_time() - cpu,
    )


# --- server


class Server:
    def __init__(self, home: Path, n_ctx: int, threads: int | None) -> None:
        env = {k: v for k, v in os.environ.items() if not k.startswith("ELBOWROOM_")}
        env.update(
            XDG_DATA_HOME=str(home / "data"),
            XDG_CACHE_HOME=str(home / "cache"),
            XDG_CONFIG_HOME=str(home / "config"),
            ELBOWROOM_KV_CACHE="false",
            PYTHONUNBUFFERED="1",
        )
        if threads:
            env["ELBOWROOM_THREADS"] = str(threads)
        self.log = home / "server.log"
        cmd = [
            sys.executable,
            "-m",
            "elbowroom",
            "serve",
            "--port",
            "0",
            "--ctx",
            str(n_ctx),
            "--preload",
            MODEL,
        ]
        with open(self.log, "wb") as out:
            self.proc = subprocess.Popen(
                cmd, cwd=REPO, env=env, stdout=out, stderr=subprocess.STDOUT, start_new_session=True
            )
        deadline = time.monotonic() + 300
        while not (m := re.search(r"listening on (http://\S+)", self.log.read_text())):
            if self.proc.poll() is not None or time.monotonic() > deadline:
                raise SystemExit(f"server did not start:\n{self.log.read_text()}")
            time.sleep(0.2)
        self.url = m.group(1)
        self.client = openai.OpenAI(
            base_url=self.url + "/v1", api_key="x", max_retries=0, timeout=600
        )

    def runner_pid(self) -> int:
        rows = httpx.get(self.url + "/api/ps", timeout=30).json()["models"]
        return int(next(r for r in rows if r["id"] == MODEL)["pid"])

    def run(self, round_no: int, max_tokens: int) -> Run:
        runner = self.runner_pid()
        cpu = (cpu_seconds(runner), cpu_seconds(self.proc.pid), time.process_time())
        sent = time.perf_counter()
        first = last = 0.0
        tokens = 0
        stream = self.client.chat.completions.create(
            model=MODEL,
            messages=prompt(round_no),
            max_tokens=max_tokens,
            temperature=0,
            stream=True,
            stream_options={"include_usage": True},
        )
        for chunk in stream:
            if chunk.choices and chunk.choices[0].delta.content:
                last = time.perf_counter()
                first = first or last
            if chunk.usage is not None:
                tokens = chunk.usage.completion_tokens
        return Run(
            "server",
            first - sent,
            tokens,
            decode_rate(tokens, first, last),
            cpu_model=cpu_seconds(runner) - cpu[0],
            cpu_server=cpu_seconds(self.proc.pid) - cpu[1],
            cpu_client=time.process_time() - cpu[2],
        )

    def idle_memory(self) -> dict[str, Any]:
        rows = httpx.get(self.url + "/api/ps", timeout=30).json()["models"]
        runner = next(r for r in rows if r["id"] == MODEL)
        server = measure_pid(self.proc.pid)
        return {
            "server_anonymous": server.anonymous,
            "server_file_backed": server.file_backed,
            "runner_anonymous": runner["anonymous"],
            "runner_file_backed": runner["file_backed"],
            "n_ctx": runner["n_ctx"],
        }

    def stop(self) -> None:
        self.proc.send_signal(signal.SIGTERM)
        try:
            self.proc.wait(timeout=60)
        except subprocess.TimeoutExpired:
            os.killpg(self.proc.pid, signal.SIGKILL)
            self.proc.wait()


# --- report


def summarize(runs: list[Run], side: str) -> dict[str, float]:
    mine = [r for r in runs if r.side == side]
    return {
        "ttft_median_s": statistics.median(r.ttft for r in mine),
        "ttft_best_s": min(r.ttft for r in mine),
        "decode_tps_median": statistics.median(r.decode_tps for r in mine),
        "decode_tps_best": max(r.decode_tps for r in mine),
        "tokens_median": statistics.median(r.tokens for r in mine),
        "cpu_ms_per_token_model": 1000 * statistics.median(r.cpu_model / r.tokens for r in mine),
        "cpu_ms_per_token_server": 1000 * statistics.median(r.cpu_server / r.tokens for r in mine),
        "cpu_ms_per_token_client": 1000 * statistics.median(r.cpu_client / r.tokens for r in mine),
    }


def write_report(result: dict[str, Any], out: Path) -> None:
    s, i, mem = result["server"], result["in_process"], result["idle_memory"]
    ratio, best = result["decode_ratio"], result["decode_ratio_best"]
    cpu_ratio = result["cpu_ratio"]
    lines = [
        "# Server vs in-process (llama-cpp-python)",
        "",
        f"Command: `.venv/bin/python benchmarks/server_vs_inprocess.py --rounds "
        f"{result['rounds']} --max-tokens {result['max_tokens']}`",
        "",
        f"Model `{MODEL}` ({Path(result['model_path']).name}), chat template from the GGUF, "
        f"greedy, n_ctx {result['n_ctx']}, n_batch {result['n_batch']}, threads "
        f"{result['threads'] or 'llama.cpp default'}, max_tokens {result['max_tokens']}, "
        f"{result['rounds']} alternating rounds per side after one warm-up each. Server: "
        "`elbowroom serve` with the KV prefix cache off, read with the openai client "
        "(streaming, include_usage). In-process: `Llama.create_chat_completion(stream=True)` "
        "on a `Llama` made with the engine's arguments.",
        "",
        f"Machine: {result['machine']}; load average at start {result['loadavg_start']}, "
        f"at end {result['loadavg_end']}. With the 2 cores shared with other work, wall-clock "
        "numbers swing by 2x or more between rounds, and CPU time is inflated too (llama.cpp's "
        "threads spin while they wait for a descheduled peer): compare the sides within a "
        "run, and prefer a quiet machine for absolute numbers.",
        "",
        "| | decode tok/s (median) | decode tok/s (best) | TTFT (median) | TTFT (best) "
        "| CPU ms/token: model | server | client |",
        "|---|---:|---:|---:|---:|---:|---:|---:|",
        f"| server (HTTP, SSE, runner process) | {s['decode_tps_median']:.1f} "
        f"| {s['decode_tps_best']:.1f} | {s['ttft_median_s'] * 1000:.0f} ms "
        f"| {s['ttft_best_s'] * 1000:.0f} ms | {s['cpu_ms_per_token_model']:.1f} "
        f"| {s['cpu_ms_per_token_server']:.2f} | {s['cpu_ms_per_token_client']:.2f} |",
        f"| llama-cpp-python in-process | {i['decode_tps_median']:.1f} "
        f"| {i['decode_tps_best']:.1f} | {i['ttft_median_s'] * 1000:.0f} ms "
        f"| {i['ttft_best_s'] * 1000:.0f} ms | {i['cpu_ms_per_token_model']:.1f} | - | - |",
        "",
        f"**Decode ratio server / in-process: {ratio:.3f} by medians, {best:.3f} by best "
        f"rounds** (target ≥ 0.95). The runner spends {cpu_ratio:.2f}x the CPU per token that "
        "llama-cpp-python in-process does; the server process adds "
        f"{s['cpu_ms_per_token_server']:.2f} ms of CPU per token (the pipe, asyncio and SSE, "
        "plus the 1 Hz memory monitor that also runs when idle) and the openai client "
        f"{s['cpu_ms_per_token_client']:.2f} ms: work on other cores when one is free, but "
        "competing with the decode when none is.",
        "",
        f"## Idle memory with `{MODEL}` loaded (n_ctx {mem['n_ctx']})",
        "",
        "| process | anonymous | file-backed |",
        "|---|---:|---:|",
        f"| server (`elbowroom serve`) | {format_size(mem['server_anonymous'])} | "
        f"{format_size(mem['server_file_backed'])} |",
        f"| runner (llama.cpp, the model) | {format_size(mem['runner_anonymous'])} | "
        f"{format_size(mem['runner_file_backed'])} |",
        "",
        "Every round:",
        "",
        "| side | TTFT ms | tokens | decode tok/s | CPU s model | CPU s server | CPU s client |",
        "|---|---:|---:|---:|---:|---:|---:|",
    ]
    lines += [
        f"| {r['side']} | {r['ttft'] * 1000:.0f} | {r['tokens']} | {r['decode_tps']:.1f} "
        f"| {r['cpu_model']:.2f} | {r['cpu_server']:.2f} | {r['cpu_client']:.2f} |"
        for r in result["runs"]
    ]
    out.with_suffix(".md").write_text("\n".join(lines) + "\n")
    out.with_suffix(".json").write_text(json.dumps(result, indent=2) + "\n")


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rounds", type=int, default=8)
    parser.add_argument("--max-tokens", type=int, default=128)
    parser.add_argument("--ctx", type=int, default=2048)
    parser.add_argument("--threads", type=int, default=None)
    parser.add_argument(
        "--out", type=Path, default=REPO / "benchmarks" / "results" / "server_vs_inprocess.md"
    )
    args = parser.parse_args()

    settings = load_settings(environ={})
    path = discover(settings).get(MODEL).path
    load_start = os.getloadavg()
    runs: list[Run] = []
    with tempfile.TemporaryDirectory(prefix="elbowroom-bench-") as tmp:
        server = Server(Path(tmp), args.ctx, args.threads)
        try:
            llm = load_inprocess(path, args.ctx, args.threads)
            server.run(0, 8)  # warm-ups: first-request costs are not decode speed
            run_inprocess(llm, 0, 8)
            for n in range(1, args.rounds + 1):
                for run in (server.run(n, args.max_tokens), run_inprocess(llm, n, args.max_tokens)):
                    runs.append(run)
                    print(
                        f"{run.side:>10}: ttft {run.ttft * 1000:6.0f} ms, {run.tokens} tokens,"
                        f" {run.decode_tps:6.1f} tok/s",
                        flush=True,
                    )
            del llm
            memory = server.idle_memory()
        finally:
            server.stop()
    s, i = summarize(runs, "server"), summarize(runs, "in-process")
    result = {
        "model_path": str(path),
        "rounds": args.rounds,
        "max_tokens": args.max_tokens,
        "n_ctx": args.ctx,
        "n_batch": min(args.ctx, DEFAULT_N_BATCH),
        "threads": args.threads,
        "machine": f"{platform.machine()}, {os.cpu_count()} CPUs, "
        f"Python {platform.python_version()}",
        "loadavg_start": [round(x, 2) for x in load_start],
        "loadavg_end": [round(x, 2) for x in os.getloadavg()],
        "server": s,
        "in_process": i,
        "decode_ratio": s["decode_tps_median"] / i["decode_tps_median"],
        "decode_ratio_best": s["decode_tps_best"] / i["decode_tps_best"],
        "cpu_ratio": s["cpu_ms_per_token_model"] / i["cpu_ms_per_token_model"],
        "idle_memory": memory,
        "runs": [asdict(r) for r in runs],
    }
    args.out.parent.mkdir(parents=True, exist_ok=True)
    write_report(result, args.out)
    print(args.out.with_suffix(".md").read_text())
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
