"""KV prefix cache: time to first token with no cache, llama-cpp-python's LlamaRAMCache, and
elbowroom's cache hitting its RAM tier and its disk tier. Side by side, in one run.

Two workloads on SmolLM2-135M (n_ctx 4096, greedy, same tokens for every configuration):

- chat: a 10-turn conversation over a long system prompt; each turn sends the whole
  history (the assistant turns are the model's own answers, recorded once beforehand);
- agent: a loop over a fixed ~2,000-token prefix (tools, instructions) with short varying
  suffixes (the step's observation).

Before every measured request another client's short, unrelated request runs on the same
model, so the live context never holds the prefix: a fast answer can only come from a
cache. The first request of each workload fills the caches and is not counted; the
configurations run one after another (one model in memory at a time), and medians are
reported. Every configuration's output is compared with the no-cache output.

    .venv/bin/python benchmarks/kv_cache.py [--turns 10] [--steps 6] [--prefix-tokens 2000]

Writes benchmarks/results/kv_cache.{md,json}.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import sys
import tempfile
import time
from collections.abc import Callable, Iterator
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from elbowroom.config import load_settings  # noqa: E402
from elbowroom.engines.llama import DEFAULT_N_BATCH, LlamaEngine  # noqa: E402
from elbowroom.models.catalog import discover  # noqa: E402
from elbowroom.models.spec import ModelSpec  # noqa: E402
from elbowroom.units import format_size  # noqa: E402

MODEL = "smollm2-135m"
N_CTX = 4096
MAX_TOKENS = 16
OTHER = [{"role": "user", "content": "Say one word about the weather."}]
CONFIGS = ("no cache", "LlamaRAMCache", "elbowroom RAM tier", "elbowroom disk tier")


@dataclass
class Result:
    config: str
    workload: str
    ttft: list[float] = field(default_factory=list)  # wall seconds, measured requests
    cpu: list[float] = field(default_factory=list)  # CPU seconds (all threads) to first token
    prompt_tokens: list[int] = field(default_factory=list)
    cached_tokens: list[int] = field(default_factory=list)
    outputs: list[str] = field(default_factory=list)
    bytes_held: int = 0  # cache bytes at the end (RAM; on disk for the disk tier)
    after_restart: float | None = None  # TTFT of the first request after a restart

    @property
    def median(self) -> float:
        return statistics.median(self.ttft)

    @property
    def best(self) -> float:
        return min(self.ttft)


@dataclass(frozen=True)
class Reply:
    ttft: float
    cpu: float
    text: str
    prompt_tokens: int
    cached_tokens: int  # -1: not reported


# ---- workloads ---------------------------------------------------------------------------


def system_prompt() -> str:
    rules = " ".join(
        f"Rule {i}: keep answers short, cite the aisle number, and never invent prices."
        for i in range(30)
    )
    return "You are the assistant of a hardware store. " + rules


def agent_prefix(target_tokens: int, count: Callable[[str], int]) -> str:
    tools = []
    i = 0
    while True:
        tools.append(
            f"Tool {i}: name=tool_{i}; input: a JSON object with fields path, mode and limit; "
            f"output: the lines it found, one per row, or an error message."
        )
        text = "You are an agent. You can call these tools.\n" + "\n".join(tools)
        if count(text) >= target_tokens:
            return text + "\nAnswer with the next tool call only.\n"
        i += 1


def agent_prompts(prefix: str, steps: int) -> list[str]:
    return [f"{prefix}Observation {k}: {k * 7} rows.\nCall:" for k in range(steps)]


def chat_histories(engine: LlamaEngine, turns: int) -> list[list[dict[str, str]]]:
    """The conversation's requests, with the model's own answers as assistant turns."""
    history: list[dict[str, str]] = [{"role": "system", "content": system_prompt()}]
    requests = []
    for t in range(turns):
        history.append({"role": "user", "content": f"Question {t}: where do I find item {t}?"})
        requests.append(list(history))
        answer = engine.run(
            "chat", {"messages": history, "temperature": 0, "max_tokens": 24}, _no, _never
        )
        history.append({"role": "assistant", "content": answer["text"]})
    return requests


def _no(_: dict[str, Any]) -> None:
    pass


def _never() -> bool:
    return False


# ---- configurations ----------------------------------------------------------------------


class ElbowroomRunner:
    """Our engine; kv options decide no cache / RAM tier / disk tier."""

    def __init__(self, spec: ModelSpec, options: dict[str, Any]) -> None:
        self.engine = LlamaEngine()
        self.engine.load(spec, {"n_ctx": N_CTX, "seed": 1, **options})

    def request(self, op: str, payload: dict[str, Any]) -> Reply:
        start, cpu_start = time.perf_counter(), time.process_time()
        first: list[tuple[float, float]] = []

        def emit(_: dict[str, Any]) -> None:
            if not first:
                first.append((time.perf_counter(), time.process_time()))

        out = self.engine.run(
            op, {**payload, "temperature": 0, "max_tokens": MAX_TOKENS}, emit, _never
        )
        end, cpu_end = first[0] if first else (time.perf_counter(), time.process_time())
        usage = out["usage"]
        return Reply(
            end - start,
            cpu_end - cpu_start,
            out["text"],
            usage["prompt_tokens"],
            usage["cached_tokens"],
        )

    def tokens(self, op: str, payload: dict[str, Any]) -> list[int]:
        return self.engine._tokenize(op, payload)[0]

    def bytes_held(self) -> int:
        s = self.engine.stats().get("kv_cache")
        return int(s["bytes_ram"] + s["bytes_disk"]) if s else 0

    def close(self) -> None:
        self.engine.close()


class LlamaCacheRunner:
    """llama-cpp-python's high-level API with its own LlamaRAMCache, fed the same tokens."""

    def __init__(self, spec: ModelSpec, tokenizer: ElbowroomRunner) -> None:
        import llama_cpp
        from llama_cpp.llama_cache import LlamaRAMCache

        self.tok = tokenizer
        self.llm = llama_cpp.Llama(
            model_path=str(spec.path),
            n_ctx=N_CTX,
            n_batch=min(N_CTX, DEFAULT_N_BATCH),
            seed=1,
            verbose=False,
        )
        self.cache = LlamaRAMCache(capacity_bytes=8 << 30)
        self.llm.set_cache(self.cache)

    def request(self, op: str, payload: dict[str, Any]) -> Reply:
        tokens = self.tok.tokens(op, payload)
        start, cpu_start = time.perf_counter(), time.process_time()
        stream: Iterator[Any] = self.llm.create_completion(
            prompt=tokens, max_tokens=MAX_TOKENS, temperature=0.0, stream=True
        )  # type: ignore[assignment]
        pieces = [next(stream)["choices"][0]["text"]]
        ttft, cpu = time.perf_counter() - start, time.process_time() - cpu_start
        pieces += [chunk["choices"][0]["text"] for chunk in stream]
        return Reply(ttft, cpu, "".join(pieces), len(tokens), -1)

    def bytes_held(self) -> int:
        # cache_size counts only the llama.cpp state; each entry also keeps a copy of the
        # logits rows (scores) and the input ids, which are just as resident.
        return sum(
            s.llama_state_size + s.scores.nbytes + s.input_ids.nbytes
            for s in self.cache.cache_state.values()
        )

    def close(self) -> None:
        self.llm.close()


# ---- the run -----------------------------------------------------------------------------


OPTIONS: dict[str, dict[str, Any]] = {
    "no cache": {"kv_cache": False},
    "LlamaRAMCache": {"kv_cache": False},  # our engine only tokenizes for it
    "elbowroom RAM tier": {"kv_cache": True, "kv_ram_max": 4 << 30},
    # A zero RAM grant: every entry goes straight to disk, every hit reads a file.
    "elbowroom disk tier": {"kv_cache": True, "kv_ram_max": 0},
}


def open_runner(name: str, spec: ModelSpec, kv_dir: Path) -> Any:
    ours = ElbowroomRunner(
        spec, {**OPTIONS[name], "kv_cache_dir": str(kv_dir), "kv_disk_max": 8 << 30}
    )
    return LlamaCacheRunner(spec, ours) if name == "LlamaRAMCache" else ours


def close_runner(runner: Any) -> None:
    runner.close()
    if isinstance(runner, LlamaCacheRunner):
        runner.tok.close()


def run_workload(
    workload: str, requests: list[tuple[str, dict[str, Any]]], spec: ModelSpec, kv_root: Path
) -> list[Result]:
    """All configurations loaded at once, taking turns request by request, so that a busy
    machine slows each of them alike."""
    dirs = {name: kv_root / workload / name.replace(" ", "_") for name in CONFIGS}
    runners = {name: open_runner(name, spec, dirs[name]) for name in CONFIGS}
    results = {name: Result(name, workload) for name in CONFIGS}
    try:
        for i, (op, payload) in enumerate(requests):
            for name, runner in runners.items():
                runner.request("chat", {"messages": OTHER})  # another client's request
                reply = runner.request(op, payload)
                res = results[name]
                res.outputs.append(reply.text)
                if i == 0:
                    continue  # fills the caches
                res.ttft.append(reply.ttft)
                res.cpu.append(reply.cpu)
                res.prompt_tokens.append(reply.prompt_tokens)
                res.cached_tokens.append(reply.cached_tokens)
                print(
                    f"  {workload:5} #{i} {name:20} ttft {reply.ttft * 1000:8.1f} ms "
                    f"(cpu {reply.cpu * 1000:8.1f} ms), prompt {reply.prompt_tokens}, "
                    f"cached {reply.cached_tokens}",
                    flush=True,
                )
        for name, runner in runners.items():
            results[name].bytes_held = runner.bytes_held()
        # Restart: a graceful unload writes the RAM tier to disk; a new runner indexes the
        # directory and answers the last request from the disk tier.
        name = "elbowroom disk tier"
        close_runner(runners.pop(name))
        fresh = runners[name] = open_runner(name, spec, dirs[name])
        fresh.request("chat", {"messages": OTHER})
        op, payload = requests[-1]
        results[name].after_restart = fresh.request(op, payload).ttft
    finally:
        for runner in runners.values():
            close_runner(runner)
    return list(results.values())


def main() -> None:
    p = argparse.ArgumentParser(description=(__doc__ or "").split("\n\n")[0])
    p.add_argument("--turns", type=int, default=10)
    p.add_argument("--steps", type=int, default=6)
    p.add_argument("--prefix-tokens", type=int, default=2000)
    p.add_argument("--out", type=Path, default=REPO / "benchmarks" / "results" / "kv_cache")
    p.add_argument(
        "--render", action="store_true", help="only rewrite the .md from the recorded .json"
    )
    args = p.parse_args()
    if args.render:
        recorded = json.loads(args.out.with_suffix(".json").read_text())
        meta = recorded["meta"]
        args.turns, args.steps = meta["turns"], meta["agent_steps"]
        replay = [Result(**raw) for raw in recorded["raw"]]
        write(replay, args, meta["agent_prefix_tokens"], meta)
        return

    spec = discover(load_settings({})).get(MODEL)
    setup = ElbowroomRunner(spec, {"kv_cache": False})
    print("recording the conversation's answers ...", flush=True)
    histories = chat_histories(setup.engine, args.turns)

    def count(text: str) -> int:
        return len(setup.tokens("completion", {"prompt": text}))

    prefix = agent_prefix(args.prefix_tokens, count)
    work: dict[str, list[tuple[str, dict[str, Any]]]] = {
        "chat": [("chat", {"messages": h}) for h in histories],
        "agent": [("completion", {"prompt": a}) for a in agent_prompts(prefix, args.steps)],
    }
    prefix_tokens = count(prefix)
    setup.close()

    results: list[Result] = []
    with tempfile.TemporaryDirectory(prefix="kvbench-") as kv_root:
        for workload, requests in work.items():
            print(f"{workload} ...", flush=True)
            results.extend(run_workload(workload, requests, spec, Path(kv_root)))
    write(results, args, prefix_tokens)


def write(
    results: list[Result],
    args: argparse.Namespace,
    prefix_tokens: int,
    recorded: dict[str, Any] | None = None,
) -> None:
    by = {(r.config, r.workload): r for r in results}
    rows: list[dict[str, Any]] = []
    for workload in ("chat", "agent"):
        base = by[("no cache", workload)]
        theirs = by[("LlamaRAMCache", workload)]
        for name in CONFIGS:
            r = by[(name, workload)]
            rows.append(
                {
                    "workload": workload,
                    "config": name,
                    "ttft_median_ms": round(r.median * 1000, 1),
                    "ttft_last_ms": round(r.ttft[-1] * 1000, 1),
                    "ttft_best_ms": round(r.best * 1000, 1),
                    "speedup_vs_no_cache": round(base.median / r.median, 1),
                    "best_speedup_vs_no_cache": round(base.best / r.best, 1),
                    "speedup_vs_llamaramcache": round(theirs.median / r.median, 2),
                    "best_speedup_vs_llamaramcache": round(theirs.best / r.best, 2),
                    "prompt_tokens_median": int(statistics.median(r.prompt_tokens)),
                    "cached_tokens_median": (
                        int(statistics.median(r.cached_tokens)) if r.cached_tokens[0] >= 0 else None
                    ),
                    "bytes_held": r.bytes_held,
                    "same_output_as_no_cache": r.outputs == base.outputs,
                    "ttft_after_restart_ms": (
                        round(r.after_restart * 1000, 1) if r.after_restart is not None else None
                    ),
                }
            )
    meta = recorded or {
        "model": MODEL,
        "n_ctx": N_CTX,
        "max_tokens": MAX_TOKENS,
        "turns": args.turns,
        "agent_steps": args.steps,
        "agent_prefix_tokens": prefix_tokens,
        "machine": f"{platform.machine()}, {os.cpu_count()} CPUs",
        "load_average": os.getloadavg(),
        "date": time.strftime("%Y-%m-%d %H:%M"),
    }
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.with_suffix(".json").write_text(
        json.dumps({"meta": meta, "rows": rows, "raw": [asdict(r) for r in results]}, indent=2)
    )
    lines = [
        "# KV prefix cache: time to first token",
        "",
        f"SmolLM2-135M Q4_1, n_ctx {N_CTX}, greedy, {MAX_TOKENS} tokens per reply; "
        f"chat: {args.turns} turns; agent: {args.steps} steps over a "
        f"{prefix_tokens}-token prefix. Before each request another client's short request "
        "ran on the same model, so the live context never held the prefix. All four "
        "configurations were loaded together and took turns request by request. Medians over "
        "the measured requests (the first, which fills the caches, is not counted) and the "
        "best one, which a busy machine disturbs least. Bytes held: RAM for the RAM caches, "
        "disk for the disk tier. Machine: "
        f"{meta['machine']}, shared with other work (load average at the end "
        f"{', '.join(f'{x:.1f}' for x in meta['load_average'])}); {meta['date']}.",
        "",
        "| workload | configuration | TTFT median | TTFT best | TTFT last "
        "| vs no cache (median / best) | vs LlamaRAMCache (median / best) | cached tokens "
        "| bytes held | same output | TTFT after restart |",
        "|---|---|---:|---:|---:|---:|---:|---:|---:|---|---:|",
    ]
    for row in rows:
        cached = row["cached_tokens_median"]
        restart = row["ttft_after_restart_ms"]
        lines.append(
            f"| {row['workload']} | {row['config']} | {row['ttft_median_ms']:.1f} ms "
            f"| {row['ttft_best_ms']:.1f} ms | {row['ttft_last_ms']:.1f} ms "
            f"| {row['speedup_vs_no_cache']:.1f}x / {row['best_speedup_vs_no_cache']:.1f}x "
            f"| {row['speedup_vs_llamaramcache']:.2f}x "
            f"/ {row['best_speedup_vs_llamaramcache']:.2f}x "
            f"| {'-' if cached is None else cached} | {format_size(row['bytes_held'])} "
            f"| {'yes' if row['same_output_as_no_cache'] else 'NO'} "
            f"| {'-' if restart is None else f'{restart:.1f} ms'} |"
        )
    lines += ["", *targets(by)]
    args.out.with_suffix(".md").write_text("\n".join(lines) + "\n")
    print("\n".join(lines))


def targets(by: dict[tuple[str, str], Result]) -> list[str]:
    """The goals for the agent workload (a prefix of 2,000 tokens or more), on medians."""
    base, theirs = by[("no cache", "agent")], by[("LlamaRAMCache", "agent")]
    ram, disk = by[("elbowroom RAM tier", "agent")], by[("elbowroom disk tier", "agent")]
    ratios = [base.median / ram.median, base.median / disk.median, theirs.median / ram.median]
    checks = [
        (f"RAM-tier hit >= 30x faster than recompute: {ratios[0]:.1f}x", 30),
        (f"disk-tier hit >= 10x faster than recompute: {ratios[1]:.1f}x", 10),
        (f"RAM-tier hit >= 3x faster than a LlamaRAMCache hit: {ratios[2]:.2f}x", 3),
    ]
    lines = ["Targets (agent workload, medians):", ""]
    for (text, goal), ratio in zip(checks, ratios, strict=True):
        lines.append(f"- {'met' if ratio >= goal else 'MISSED'}: {text}")
    held = "no more" if ram.bytes_held <= theirs.bytes_held else "MORE"
    lines.append(
        f"- {'met' if held == 'no more' else 'MISSED'}: with {held} bytes held than "
        f"LlamaRAMCache: {format_size(ram.bytes_held)} vs {format_size(theirs.bytes_held)}"
    )
    return lines


if __name__ == "__main__":
    main()
