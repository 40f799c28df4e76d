"""GPU evidence (issue 10), run where an NVIDIA GPU is: predicted vs measured VRAM, decode
speed through elbowroom vs the engine in-process, a capped GPU pool under alternating
requests, a forced offload refused with 507, and (two GPUs) a split measured per GPU.

    python benchmarks/gpu_bench.py synth  DIR [--tiny]        # random-weight models
    python benchmarks/gpu_bench.py vram   OUT MODEL... [--ctx 2048 8192] [--slots 1 8]
    python benchmarks/gpu_bench.py host   OUT MODEL... [--ctx ...] [--slots ...] [--partial 9]
    python benchmarks/gpu_bench.py report OUT HEADERS_DIR   # host.jsonl against this code
    python benchmarks/gpu_bench.py phases OUT MODEL... [--ctx 4096] [--slots 4] [--modes ...]
    python benchmarks/gpu_bench.py cublas OUT                # cuBLAS's own VRAM and host bytes
    python benchmarks/gpu_bench.py speed  OUT MODEL [--rounds 12] [--tokens 128]
    python benchmarks/gpu_bench.py guard  OUT MODEL                # a neighbour takes VRAM
    python benchmarks/gpu_bench.py capped OUT --cap 16GiB MODEL...
    python benchmarks/gpu_bench.py refuse OUT --cap 16GiB MODEL
    python benchmarks/gpu_bench.py split  OUT MODEL --free GIB,GIB --ctx 2048 --slots 4

Each phase appends JSON lines to OUT/<phase>.jsonl. VRAM is NVML's device memory in use
per GPU, read with the server idle (no runner) and after a model's load through the server
plus one short generation (the CUDA runtime grows at the first generation); elbowroom's
prediction is the placement's per-pool bytes that /api/ps reports for that load. benchmarks/results/
gpu.md has the runs and their commands.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import signal
import socket
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve().parent
TOKENIZER = os.environ.get("GPU_BENCH_TOKENIZER", str(HERE / "smollm2-tokenizer.gguf"))
PROMPT = "Once upon a time, in a city by the sea, "
# ~1,000 tokens: more than one 512-token micro-batch, so a runner is measured after what a
# real prompt allocates (cuBLAS and the host compute buffer appear at the first batched
# prompt; issue 27b). The earlier host runs used PROMPT * 20 (~220 tokens).
LONG_PROMPT = " ".join(
    f"The {i}th traveller said something about the weather and the harbour." for i in range(90)
)

# ~1,850 tokens of gemma3 (fits a 2,048-token slot): a sliding-window model's context checkpoint is
# taken before a prompt's last micro-batch and holds the window plus what that batch
# overlaps: the most it holds (window + n_ubatch cells, what the estimate budgets) comes
# with prompts longer than the window + two micro-batches.
WINDOW_PROMPT = " ".join(
    f"The {i}th traveller said something about the weather and the harbour." for i in range(120)
)


def emit(out: Path, phase: str, row: dict[str, Any]) -> None:
    out.mkdir(parents=True, exist_ok=True)
    with (out / f"{phase}.jsonl").open("a") as fh:
        fh.write(json.dumps(row) + "\n")
    print(phase.upper(), json.dumps(row), flush=True)


def gib(n: float) -> str:
    return f"{n / 2**30:.2f}"


# ------------------------------------------------------------------------- NVML


def nvml_used() -> list[int]:
    """Device memory in use per GPU; [] without NVML (a CPU smoke run)."""
    try:
        import pynvml

        pynvml.nvmlInit()
        n = pynvml.nvmlDeviceGetCount()
        handles = [pynvml.nvmlDeviceGetHandleByIndex(i) for i in range(n)]
        return [int(pynvml.nvmlDeviceGetMemoryInfo(h).used) for h in handles]
    except Exception:
        return []


def nvml_record() -> dict[str, Any]:
    """Every GPU's memory and compute processes (a fixture for the pool tests)."""
    import pynvml

    pynvml.nvmlInit()
    devs = []
    for i in range(pynvml.nvmlDeviceGetCount()):
        h = pynvml.nvmlDeviceGetHandleByIndex(i)
        m = pynvml.nvmlDeviceGetMemoryInfo(h)
        name = pynvml.nvmlDeviceGetName(h)
        procs = [
            {"pid": int(p.pid), "usedGpuMemory": p.usedGpuMemory}
            for p in pynvml.nvmlDeviceGetComputeRunningProcesses(h)
        ]
        devs.append(
            {
                "index": i,
                "name": name.decode() if isinstance(name, bytes) else name,
                "total": int(m.total),
                "free": int(m.free),
                "used": int(m.used),
                "compute_processes": procs,
            }
        )
    return {"driver": str(pynvml.nvmlSystemGetDriverVersion()), "devices": devs}


class Sampler:
    """NVML device used, sampled every 20 ms in a thread: the peak while a phase runs."""

    def __init__(self) -> None:
        self.peak: list[int] = []
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)

    def _run(self) -> None:
        while not self._stop.is_set():
            used = nvml_used()
            self.peak = [max(a, b) for a, b in zip(self.peak, used, strict=False)] or used
            self._stop.wait(0.02)

    def __enter__(self) -> Sampler:
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        self._thread.join()


# ------------------------------------------------------------------------- synth


def synth(out_dir: Path, tiny: bool) -> list[Path]:
    from gpu_synth import SHAPES, TINY, write

    out_dir.mkdir(parents=True, exist_ok=True)
    paths = []
    for name, (arch, layers, embd, heads, kv, ffn, tied) in (TINY if tiny else SHAPES).items():
        path = out_dir / f"{name}.gguf"
        if not path.exists():
            t = time.time()
            write(str(path), arch, layers, embd, heads, kv, ffn, TOKENIZER, tied)
            print(f"wrote {path} ({gib(path.stat().st_size)} GiB) in {time.time() - t:.1f} s")
        paths.append(path)
    return paths


# ------------------------------------------------------------------------- vram


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


class Server:
    """``python -m elbowroom serve`` in a subprocess, its log in a file."""

    def __init__(self, models: list[Path], log: Path, env: dict[str, str], *args: str) -> None:
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.data = tempfile.mkdtemp(prefix="elbowroom-gpu-")
        cmd = [sys.executable, "-m", "elbowroom", "serve", "--port", str(self.port), *args]
        for m in models:
            cmd += ["--model", str(m)]
        full_env = {**os.environ, "ELBOWROOM_DATA_DIR": self.data, **env}
        self.log = log
        self._fh = log.open("w")
        # cwd: not the checkout, whose ./elbowroom would shadow the one on PYTHONPATH.
        # cwd: not the checkout, whose ./elbowroom would shadow the one on PYTHONPATH.
        self.proc = subprocess.Popen(
            cmd,
            stdout=self._fh,
            stderr=subprocess.STDOUT,
            env=full_env,
            start_new_session=True,
            cwd=self.data,
        )
        import httpx

        deadline = time.time() + 60
        while time.time() < deadline:
            try:
                if httpx.get(self.url + "/v1/models", timeout=2).status_code == 200:
                    return
            except httpx.HTTPError:
                pass
            if self.proc.poll() is not None:
                break
            time.sleep(0.2)
        raise RuntimeError(f"server did not start: {log.read_text()[-3000:]}")

    def close(self) -> None:
        if self.proc.poll() is None:
            os.killpg(self.proc.pid, signal.SIGTERM)
            try:
                self.proc.wait(30)
            except subprocess.TimeoutExpired:
                os.killpg(self.proc.pid, signal.SIGKILL)
        self._fh.close()


def settled(idle: list[int], slack: int = 64 * 2**20, timeout: float = 15) -> list[int]:
    """NVML's reading once every GPU is back near ``idle`` (an unloaded runner's VRAM is
    handed back when its process ends)."""
    deadline = time.time() + timeout
    while True:
        used = nvml_used()
        if all(u <= i + slack for u, i in zip(used, idle, strict=False)) or time.time() > deadline:
            return used
        time.sleep(0.05)


def measure_load(server: Server, model: str, idle: list[int]) -> dict[str, Any]:
    """Load ``model`` through the server with one short generation; its placement's
    predicted bytes per GPU pool beside NVML's device memory in use before and after."""
    import httpx

    before = settled(idle)
    t = time.time()
    r = httpx.post(
        server.url + "/v1/completions",
        json={"model": model, "prompt": PROMPT * 20, "max_tokens": 16, "temperature": 0},
        timeout=300,
    )
    seconds = time.time() - t
    after = nvml_used()
    row = next((x for x in ps_rows(server.url) if x["id"] == model), {})
    placement = row.get("placement") or {}
    predicted = placement.get("gpu_bytes", {})
    measured = {f"gpu{i}": a - b for i, (a, b) in enumerate(zip(after, before, strict=False))}
    httpx.post(f"{server.url}/api/models/{model}/unload", timeout=60)
    return {
        "model": model,
        "status": r.status_code,
        "ctx": row.get("n_ctx"),
        "slots": row.get("slots"),
        "processor": row.get("processor"),
        "n_gpu_layers": placement.get("n_gpu_layers"),
        "layers_per_device": placement.get("layers_per_device"),
        "predicted_gpu": predicted,
        "measured_gpu": measured,
        "nvml_runner": row.get("gpu"),
        "predicted_host": row.get("predicted"),
        "measured_host": (row.get("anonymous") or 0) + (row.get("file_backed") or 0),
        "error_pct": {
            pool: round(100 * (b - measured[pool]) / measured[pool], 2)
            for pool, b in predicted.items()
            if measured.get(pool)
        },
        "seconds": round(seconds, 2),
    }


def vram(out: Path, models: list[Path], ctxs: list[int], slots_list: list[int]) -> None:
    """One server per (context, slots); each model loaded, measured, unloaded in turn."""
    idle = nvml_used()
    for ctx in ctxs:
        for slots in slots_list:
            log = out / f"vram_{ctx}x{slots}.log"
            server = Server(models, log, {}, "--ctx", str(ctx), "--slots", str(slots))
            try:
                for path in models:
                    emit(out, "vram", measure_load(server, path.stem, idle))
            finally:
                server.close()
    # A CPU placement keeps off the GPU entirely: the runner is shown no GPU.
    env = {"ELBOWROOM_GPU_LAYERS": "0"}
    server = Server(models[:1], out / "vram_cpu.log", env, "--ctx", "2048")
    try:
        emit(out, "vram", measure_load(server, models[0].stem, idle))
    finally:
        server.close()


# ------------------------------------------------------------------------- host


def smaps_breakdown(pid: int) -> dict[str, Any]:
    """A runner's resident bytes by what is mapped (issue 27): the GGUF, each library, the
    NVIDIA device files, anonymous memory; with Anonymous and Locked (pinned) bytes each."""
    groups: dict[str, dict[str, int]] = {}
    name = "?"
    try:
        text = Path(f"/proc/{pid}/smaps").read_text()
    except OSError:
        return {}
    for line in text.splitlines():
        head = line.split()
        if head and "-" in head[0] and not head[0].endswith(":"):
            path = head[5] if len(head) > 5 else ""
            if path.endswith(".gguf"):
                name = "gguf"
            elif path.startswith("/dev/"):
                name = path
            elif not path or path.startswith("["):
                name = path or "[anon]"
            else:
                name = Path(path).name
            continue
        if len(head) == 3 and head[2] == "kB" and head[0] in ("Rss:", "Anonymous:", "Locked:"):
            g = groups.setdefault(name, {"rss": 0, "anon": 0, "locked": 0, "maps": 0})
            key = {"Rss:": "rss", "Anonymous:": "anon", "Locked:": "locked"}[head[0]]
            g[key] += int(head[1]) * 1024
            if key == "rss":
                g["maps"] += 1
    rollup = Path(f"/proc/{pid}/smaps_rollup").read_text()
    fields = {
        ln.split(":")[0]: int(ln.split()[1]) * 1024
        for ln in rollup.splitlines()[1:]
        if ln.strip().endswith("kB")
    }
    top = sorted(groups.items(), key=lambda kv: -kv[1]["rss"])
    return {"rollup": fields, "groups": dict(top[:25])}


# Prompts for the other slots: each begins differently (the runner gives a request the free
# slot sharing the longest beginning, else the least recently used one), so every slot
# serves once and holds what a served slot holds (sampler arrays, context checkpoints).
SLOT_WORDS = ("Apples", "Bridges", "Candles", "Dunes", "Engines", "Forests", "Glaciers")


def _complete(url: str, model: str, prompt: str, tokens: int = 16) -> Any:
    import httpx

    body = {"model": model, "prompt": prompt, "max_tokens": tokens, "temperature": 0}
    return httpx.post(url + "/v1/completions", json=body, timeout=600)


def serve_all_slots(url: str, model: str, slots: int, long: bool = False) -> list[int]:
    """One request per other slot, all at once (the engine batches them): ~220 tokens, or
    ~1,850 (``long``) for a sliding-window model, whose context checkpoint per slot grows
    with the prompt up to its window and a micro-batch."""
    from concurrent.futures import ThreadPoolExecutor

    body = WINDOW_PROMPT if long else PROMPT * 20
    prompts = [f"{SLOT_WORDS[i % len(SLOT_WORDS)]} {i}. {body}" for i in range(slots - 1)]
    with ThreadPoolExecutor(max(1, slots - 1)) as pool:
        return [r.status_code for r in pool.map(lambda p: _complete(url, model, p, 8), prompts)]


def windowed(path: Path) -> bool:
    """Whether the model has sliding-window layers (context checkpoints per slot)."""
    from elbowroom.models.estimate import swa_layers
    from elbowroom.models.gguf_meta import read_gguf_info

    return any(swa_layers(read_gguf_info(path)))


def reading(url: str, model: str, before: list[int]) -> dict[str, Any]:
    """A loaded runner as elbowroom and the kernel see it, with NVML's device memory in use
    now minus ``before``: the prediction, anonymous / file-backed bytes, smaps by mapping."""
    after = nvml_used()
    row = next((x for x in ps_rows(url) if x["id"] == model), {})
    smaps = smaps_breakdown(int(row["pid"])) if row.get("pid") else {}
    placement = row.get("placement") or {}
    return {
        "ctx": row.get("n_ctx"),
        "slots": row.get("slots"),
        "processor": row.get("processor"),
        "n_gpu_layers": placement.get("n_gpu_layers"),
        "predicted_gpu": placement.get("gpu_bytes", {}),
        "measured_gpu": {
            f"gpu{i}": a - b for i, (a, b) in enumerate(zip(after, before, strict=False))
        },
        "nvml_runner": row.get("gpu"),
        "predicted_host": row.get("predicted"),
        "anonymous": row.get("anonymous"),
        "file_backed": row.get("file_backed"),
        "smaps": smaps,
    }


# The runner measured as it would be after real use, never after a shortcut: no disk tier
# (a prefix restored from it skips the prompt's batches, and with them what the first
# batched prompt allocates: cuBLAS on the GPU, issue 27c), no prompt cache (a grant beside
# the footprint).
FRESH_ENV = {"ELBOWROOM_KV_RAM_MAX": "0", "ELBOWROOM_KV_DISK_MAX": "0"}


def host(
    out: Path,
    models: list[Path],
    ctxs: list[int],
    slots_list: list[int],
    partial: int,
    only: tuple[str, ...] = ("cpu", "partial", "gpu"),
    prompt: str = LONG_PROMPT,
) -> None:
    """Host (and VRAM) bytes of runners on the CPU, partly and fully offloaded, beside the
    prediction, with the runner's smaps grouped by mapping: what the CUDA build holds.
    Each runner serves a ~1,000-token prompt, then every other slot one request."""
    idle = nvml_used()
    modes = {"cpu": "0", "partial": str(partial), "gpu": "-1"}
    for mode in only:
        layers = modes[mode]
        for ctx in ctxs:
            for slots in slots_list:
                log = out / f"host_{mode}_{ctx}x{slots}.log"
                env = {"ELBOWROOM_GPU_LAYERS": layers, **FRESH_ENV}
                args = ("--ctx", str(ctx), "--slots", str(slots))
                server = Server(models, log, env, *args)
                try:
                    for path in models:
                        before = settled(idle)
                        t = time.time()
                        swa = windowed(path)
                        first = WINDOW_PROMPT if swa else prompt
                        r = _complete(server.url, path.stem, first)
                        others = serve_all_slots(server.url, path.stem, slots, swa)
                        seconds = time.time() - t
                        row = {"model": path.stem, "mode": mode, "status": r.status_code}
                        row |= reading(server.url, path.stem, before)
                        row |= {
                            "seconds": round(seconds, 2),
                            "prompt_tokens": (r.json().get("usage") or {}).get("prompt_tokens")
                            if r.status_code == 200
                            else None,
                            "slot_status": others,
                            "error": None if r.status_code == 200 else r.text[:400],
                        }
                        emit(out, "host", row)
                        import httpx

                        httpx.post(f"{server.url}/api/models/{path.stem}/unload", timeout=60)
                finally:
                    server.close()


def phases(
    out: Path,
    models: list[Path],
    ctx: int,
    slots: int,
    partial: int,
    only: tuple[str, ...] = ("cpu", "partial", "gpu"),
) -> None:
    """What a runner holds at each step of its use (issue 27c): right after load, after a
    4-token prompt, after a ~1,000-token prompt, after every slot served; on the CPU, partly
    and fully offloaded. Then, on the GPU with the disk tier on, the same prompt again after
    a reload (restored from disk): whether a restored prefix skips what a batch allocates."""
    import httpx

    idle = nvml_used()
    modes = {"cpu": "0", "partial": str(partial), "gpu": "-1"}
    for mode in only:
        layers = modes[mode]
        env = {"ELBOWROOM_GPU_LAYERS": layers, **FRESH_ENV}
        args = ("--ctx", str(ctx), "--slots", str(slots))
        server = Server(models, out / f"phases_{mode}.log", env, *args)
        try:
            for path in models:
                name = path.stem
                before = settled(idle)
                url = server.url
                for stage in ("load", "short", "long", "slots"):
                    if stage == "load":
                        httpx.post(f"{url}/api/models/{name}/load", json={}, timeout=600)
                    elif stage == "short":
                        _complete(url, name, "Hello there", 8)
                    elif stage == "long":
                        _complete(url, name, LONG_PROMPT)
                    else:
                        serve_all_slots(url, name, slots, windowed(path))
                    row = {"model": name, "mode": mode, "stage": stage}
                    emit(out, "phases", row | reading(url, name, before))
                httpx.post(f"{server.url}/api/models/{name}/unload", timeout=60)
        finally:
            server.close()
    if "gpu" not in only:
        return
    # The disk tier on (its own cache dir): load, long prompt, unload, load, the same prompt.
    cache = tempfile.mkdtemp(prefix="elbowroom-kv-")
    env = {
        "ELBOWROOM_GPU_LAYERS": "-1",
        "ELBOWROOM_KV_RAM_MAX": "0",
        "ELBOWROOM_KV_CACHE_DIR": cache,
    }
    server = Server(
        models, out / "phases_restore.log", env, "--ctx", str(ctx), "--slots", str(slots)
    )
    try:
        for path in models:
            name = path.stem
            for stage in ("first", "restored"):
                before = settled(idle)
                r = _complete(server.url, name, LONG_PROMPT)
                usage = r.json().get("usage", {}) if r.status_code == 200 else {}
                row = {"model": name, "mode": "gpu", "stage": stage, "usage": usage}
                emit(out, "phases", row | reading(server.url, name, before))
                httpx.post(f"{server.url}/api/models/{name}/unload", timeout=60)
    finally:
        server.close()


def _self_memory() -> dict[str, float]:
    fields = {
        ln.split(":")[0]: int(ln.split()[1]) / 1024
        for ln in Path("/proc/self/smaps_rollup").read_text().splitlines()[1:]
        if ln.strip().endswith("kB")
    }
    return {"anon_mib": fields["Anonymous"], "file_mib": fields["Rss"] - fields["Anonymous"]}


def cublas_probe(out: Path) -> None:
    """What cuBLAS alone costs, in a fresh process with the engine's libraries loaded
    (issue 27c): NVML device memory and this process's anonymous / file-backed bytes after
    the CUDA context, after cublasCreate, after the first f16 GEMM (llama.cpp's path for a
    batched prompt on f16 weights; quantized weights take its own MMQ kernels instead)."""
    import ctypes

    import xllamacpp  # noqa: F401  (maps libcudart / libcublas as the runner does)

    idle = nvml_used()
    cudart = ctypes.CDLL("libcudart.so.13")
    cublas = ctypes.CDLL("libcublas.so.13")

    def note(stage: str) -> None:
        used = nvml_used()
        vram = (used[0] - idle[0]) / 2**20 if used and idle else 0.0
        emit(out, "cublas", {"stage": stage, "vram_mib": round(vram, 1), **_self_memory()})

    note("libraries")
    assert cudart.cudaFree(None) == 0
    note("context")
    m, n, k = 2048, 512, 2048  # one 2,048 × 2,048 f16 weight times a 512-token batch
    ptrs = [ctypes.c_void_p() for _ in range(3)]
    for ptr, size in zip(ptrs, (m * k * 2, k * n * 2, m * n * 4), strict=True):
        assert cudart.cudaMalloc(ctypes.byref(ptr), ctypes.c_size_t(size)) == 0
    note("buffers")
    handle = ctypes.c_void_p()
    assert cublas.cublasCreate_v2(ctypes.byref(handle)) == 0
    note("cublasCreate")
    alpha, beta = ctypes.c_float(1.0), ctypes.c_float(0.0)
    for stage in ("gemm", "gemm_again"):
        rc = cublas.cublasGemmEx(
            handle,
            1,
            0,
            m,
            n,
            k,
            ctypes.byref(alpha),
            ptrs[0],
            2,
            k,
            ptrs[1],
            2,
            k,
            ctypes.byref(beta),
            ptrs[2],
            0,
            m,
            68,
            -1,
        )  # A^T (f16) × B (f16) → C (f32), compute 32F, default algorithm
        assert rc == 0, rc
        assert cudart.cudaDeviceSynchronize() == 0
        note(stage)


def report(out: Path, headers: Path) -> list[dict[str, Any]]:
    """``host.jsonl`` of a run against THIS checkout's predictions, computed from each
    model's GGUF header (``HEADERS_DIR/NAME.header``, the file's first data-offset bytes,
    made a sparse file of the recorded size here): host bytes (CPU-only with the CUDA
    build's terms, or the offload plan's host side) and VRAM, with the rule applied."""
    from elbowroom.models.accuracy import Accuracy
    from elbowroom.models.bundled import gguf_llm
    from elbowroom.models.engine_build import CUDA, EngineBuild
    from elbowroom.models.estimate import footprint
    from elbowroom.scheduler.offload import Layout, split_bytes

    sizes = json.loads((headers / "sizes.json").read_text())
    tmp = Path(tempfile.mkdtemp(prefix="gpu-report-"))
    specs = {}
    for name, size in sizes.items():
        path = tmp / f"{name}.gguf"
        with path.open("wb") as fh:
            fh.write((headers / f"{name}.header").read_bytes())
            fh.truncate(size)
        specs[name] = gguf_llm(name, path, source="path")
    build = EngineBuild(CUDA, amx=True)  # the device machine: CUDA source build, AMX Xeon
    results = []
    for line in (out / "host.jsonl").read_text().splitlines():
        r = json.loads(line)
        spec = specs[r["model"]]
        ctx, slots = r["ctx"], r["slots"]
        measured_host = r["anonymous"] + r["file_backed"]
        if r["mode"] == "cpu":
            host_pred, gpu_pred = footprint(spec, ctx, slots, build=build).total, 0
        else:
            assert spec.gguf is not None
            b = split_bytes(Layout.from_info(spec.gguf), ctx, slots, "f16", [r["n_gpu_layers"]])
            host_pred, gpu_pred = b.host, b.gpu[0]
        what = f"{r['model']} {r['mode']} {ctx}x{slots}"
        row = {
            "model": r["model"],
            "mode": r["mode"],
            "ctx": ctx,
            "slots": slots,
            "host": Accuracy(what + " host", host_pred, measured_host),
            "gpu": Accuracy(what + " vram", gpu_pred, r["measured_gpu"].get("gpu0", 0))
            if r["mode"] != "cpu"
            else None,
        }
        results.append(row)
    print(
        "| model | where | ctx × slots | host predicted MiB | measured | error "
        "| VRAM predicted MiB | measured | error |"
    )
    print("|---|---|---|---:|---:|---:|---:|---:|---:|")
    for row in results:
        h, g = row["host"], row["gpu"]
        vram = (
            f"{g.predicted / 2**20:.0f} | {g.measured / 2**20:.0f} | {g.error:+.1%}"
            if g is not None
            else "0 | 0 | —"
        )
        print(
            f"| {row['model']} | {row['mode']} | {row['ctx']} × {row['slots']} "
            f"| {h.predicted / 2**20:.0f} | {h.measured / 2**20:.0f} | {h.error:+.1%} | {vram} |"
        )
    accs = [a for row in results for a in (row["host"], row["gpu"]) if a is not None]
    broken = [str(a) for a in accs if not a.ok]
    off = [str(a) for a in accs if a.ok and not a.on_target]
    print(f"\n{len(accs)} predictions: {len(broken)} more than 5 % under, {len(off)} over +10 %")
    for text in broken + off:
        print("  ", text)
    return results


# ------------------------------------------------------------------------- speed


def engine_params(path: Path, ctx: int, slots: int, port: int = 0) -> Any:
    """The engine in-process, configured as elbowroom configures its runner; with ``port``
    its own HTTP listener is on that loopback port (llama-server's path: C++ HTTP + SSE)."""
    import xllamacpp as xlc

    p = xlc.CommonParams()
    p.model.path = str(path)
    p.n_ctx = ctx * slots
    p.n_parallel = slots
    p.kv_unified = False
    p.n_batch = p.n_ubatch = 512
    p.flash_attn_type = xlc.llama_flash_attn_type.LLAMA_FLASH_ATTN_TYPE_AUTO
    p.n_gpu_layers = 999
    p.fit_params = False
    p.cache_ram_mib = 512
    p.ctx_shift = False
    if port:
        p.hostnames = ["127.0.0.1"]
        p.port = port
    return xlc.Server(p)


def body(i: int, tokens: int, model: str | None = None) -> dict[str, Any]:
    b: dict[str, Any] = {
        "prompt": f"Story {i}: {PROMPT}",
        "max_tokens": tokens,
        "temperature": 0,
        "stream": True,
        "stream_options": {"include_usage": True},
    }
    if model is not None:
        b["model"] = model
    return b


def usage_tokens(chunks: list[Any]) -> int:
    """completion_tokens from the stream's usage chunk (the binding hands dicts or JSON)."""
    for raw in reversed(chunks):
        try:
            usage = (raw if isinstance(raw, dict) else json.loads(raw)).get("usage")
        except ValueError:
            continue
        if usage:
            return int(usage["completion_tokens"])
    raise RuntimeError(f"no usage in the stream: {chunks[-2:]}")


def in_process(srv: Any, i: int, tokens: int) -> int:
    chunks: list[Any] = []

    def take(ch: Any) -> bool:
        chunks.append(ch)
        return False  # go on

    srv.handle_completions(body(i, tokens), take)
    return usage_tokens(chunks)


_CLIENT: Any = None


def _client() -> Any:
    """This process's HTTP client, kept alive between requests as the openai SDK keeps its
    own. A new connection per request would add a Nagle/delayed-ACK stall (~35 ms measured
    on the H200 machine: the request's headers and body go out in two writes) to the first
    token of every HTTP system alike, which is the client's cost, not the server's."""
    global _CLIENT
    if _CLIENT is None:
        import httpx

        _CLIENT = httpx.Client(timeout=120)
    return _CLIENT


def through_server(url: str, model: str | None, i: int, tokens: int) -> int:
    chunks = []
    with _client().stream("POST", url + "/v1/completions", json=body(i, tokens, model)) as r:
        r.raise_for_status()
        for line in r.iter_lines():
            if line.startswith("data: ") and line != "data: [DONE]":
                chunks.append(line[6:])
    return usage_tokens(chunks)


def aggregate(fn: Any, streams: int, tokens: int) -> float:
    """Aggregate tok/s of ``streams`` concurrent calls of ``fn`` in threads (the in-process
    engine: its callbacks run in the engine's threads, the GIL is only taken per chunk)."""
    counts = [0] * streams
    errors: list[BaseException] = []

    def one(i: int) -> None:
        try:
            counts[i] = fn(i, tokens)
        except BaseException as exc:
            errors.append(exc)

    threads = [threading.Thread(target=one, args=(i,)) for i in range(streams)]
    t = time.perf_counter()
    for th in threads:
        th.start()
    for th in threads:
        th.join()
    if errors:
        raise errors[0]
    return sum(counts) / (time.perf_counter() - t)


def _http_stream(args: tuple[str, str | None, int, int]) -> int:
    return through_server(*args)


class HttpClients:
    """One client process per stream for the HTTP systems. With eight streams in threads of
    one Python process, the client's own SSE parsing (~2,000 events/s under one GIL) was a
    ceiling that the in-process baseline did not share; separate processes take it away, so
    the comparison is of the servers. The pool is started once and warmed up, so a round
    pays only the hand-off of a task (~1 ms) on top of the streams."""

    def __init__(self, streams: int) -> None:
        import concurrent.futures
        import multiprocessing

        ctx = multiprocessing.get_context("forkserver")
        self.pool = concurrent.futures.ProcessPoolExecutor(streams, mp_context=ctx)
        self.streams = streams
        list(self.pool.map(_noop, range(streams * 2)))  # start every worker

    def aggregate(self, url: str, model: str | None, streams: int, tokens: int) -> float:
        t = time.perf_counter()
        jobs = [(url, model, i, tokens) for i in range(streams)]
        counts = list(self.pool.map(_http_stream, jobs))
        return sum(counts) / (time.perf_counter() - t)

    def close(self) -> None:
        self.pool.shutdown()


def _noop(_: int) -> None:
    _client()  # made in the worker before the first timed round


def bootstrap_ratio(a: list[float], b: list[float], n: int = 4000) -> list[float]:
    """95 % bootstrap interval of median(a) / median(b), each list resampled with replacement
    (the rounds of each system are the samples; interleaving pairs them in time only)."""
    import random

    rng = random.Random(27)
    ratios = sorted(
        statistics.median(rng.choices(a, k=len(a))) / statistics.median(rng.choices(b, k=len(b)))
        for _ in range(n)
    )
    return [round(ratios[int(0.025 * n)], 2), round(ratios[int(0.975 * n) - 1], 2)]


def speed(out: Path, path: Path, rounds: int, tokens: int, ctx: int = 2048, slots: int = 8) -> None:
    server = Server(
        [path], out / f"speed_{path.stem}.log", {}, "--slots", str(slots), "--ctx", str(ctx)
    )
    stack = contextlib.ExitStack()
    try:
        import httpx

        model = path.stem
        httpx.post(f"{server.url}/api/models/{model}/load", timeout=120).raise_for_status()
        ps = ps_rows(server.url)
        port = free_port()
        srv = engine_params(path, ctx, slots, port)

        def engine(i: int, n: int) -> int:
            return in_process(srv, i, n)

        clients = HttpClients(8)
        stack.callback(clients.close)

        def engine_http(streams: int, n: int) -> float:  # the same engine via its own HTTP
            return clients.aggregate(f"http://127.0.0.1:{port}", None, streams, n)

        def elbowroom(streams: int, n: int) -> float:
            return clients.aggregate(server.url, model, streams, n)

        def in_proc(streams: int, n: int) -> float:
            return aggregate(engine, streams, n)

        systems = (("engine", in_proc), ("engine_http", engine_http), ("elbowroom", elbowroom))
        runs: dict[str, list[float]] = {}
        for streams in (1, 8):
            for _, fn in systems:
                fn(streams, 16)  # warm-up
            for r in range(rounds):  # interleaved, the order rotated: drift hits all alike
                for name, fn in systems[r % 3 :] + systems[: r % 3]:
                    runs.setdefault(f"{name}_{streams}", []).append(fn(streams, tokens))
        row: dict[str, Any] = {
            "model": model,
            "tokens": tokens,
            "rounds": rounds,
            "ctx": ctx,
            "slots": slots,
            "placement": ps[0].get("processor") if ps else None,
            "load_avg": os.getloadavg(),
            "clients": "one process per stream, keep-alive connection (HTTP systems)",
        }
        for key, vals in runs.items():
            row[key] = [round(v, 1) for v in vals]
            row[f"{key}_median"] = round(statistics.median(vals), 1)
            row[f"{key}_range"] = [round(min(vals), 1), round(max(vals), 1)]
        for streams in (1, 8):
            s_ = runs[f"elbowroom_{streams}"]
            for base, key in (("engine_http", "ratio_http"), ("engine", "ratio")):
                b_ = runs[f"{base}_{streams}"]
                row[f"{key}_{streams}"] = round(statistics.median(s_) / statistics.median(b_), 2)
                row[f"{key}_{streams}_ci95"] = bootstrap_ratio(s_, b_)
        emit(out, "speed", row)
    finally:
        stack.close()
        server.close()


# ------------------------------------------------------------------------- guard on a GPU

NEIGHBOUR = r"""
import json, sys, time
import torch
want, patience = int(sys.argv[1]), float(sys.argv[2])
held, t0, failed_since, waited = [], time.time(), None, 0.0
free = torch.cuda.mem_get_info()[0]
if free > 2**31:  # the free part at once, then 256 MiB steps into ours
    held.append(torch.empty(free - 2**31, dtype=torch.uint8, device="cuda"))
while sum(x.numel() for x in held) < want:
    try:
        held.append(torch.empty(min(2**28, want - sum(x.numel() for x in held)),
                                dtype=torch.uint8, device="cuda"))
    except torch.cuda.OutOfMemoryError:
        failed_since = failed_since or time.time()
        if time.time() - failed_since > patience:
            break
        time.sleep(0.05)
        continue
    if failed_since is not None:  # memory came after a wait: count it
        waited += time.time() - failed_since
        failed_since = None
    time.sleep(0.02)
if failed_since is not None:
    waited += time.time() - failed_since
got = sum(x.numel() for x in held)
print(json.dumps({"wanted": want, "got": got, "seconds": round(time.time() - t0, 2),
                  "waited_for_memory": round(waited, 2), "ok": got >= want}), flush=True)
"""


def guard(out: Path, path: Path, guarded: bool, streams: int = 8, patience: float = 10) -> None:
    """A neighbour process on the GPU takes VRAM (256 MiB steps) until it needs some of
    what our model holds, while eight long generations run on that model. With the guard
    the GPU pool turns hard, the work on that GPU is aborted (clients get memory_pressure)
    and the model unloaded, and the neighbour gets its memory; without it the neighbour
    waits ``patience`` seconds and gives up (CUDA out of memory)."""
    import httpx

    model = path.stem
    args = ["--slots", str(streams), "--ctx", "8192"] + ([] if guarded else ["--no-memory-guard"])
    server = Server([path], out / f"guard_{'on' if guarded else 'off'}.log", {}, *args)
    outcomes: list[dict[str, Any]] = []
    first = threading.Event()

    def one(i: int) -> None:
        t, n, err = time.time(), 0, None
        try:
            with httpx.stream(
                "POST",
                server.url + "/v1/completions",
                json=body(i, 4000, model),
                timeout=300,
            ) as r:
                for line in r.iter_lines():
                    if line.startswith("data: {") and '"error"' in line:
                        err = json.loads(line[6:])["error"].get("code")
                    elif line.startswith("data: {"):
                        n += 1
                        first.set()
                status = r.status_code
        except httpx.HTTPError as exc:
            status, err = 0, type(exc).__name__
        outcomes.append(
            {"status": status, "events": n, "error": err, "s": round(time.time() - t, 2)}
        )

    try:
        httpx.post(f"{server.url}/api/models/{model}/load", timeout=120).raise_for_status()
        ours = sum(x.get("gpu", 0) for x in ps_rows(server.url))
        threads = [threading.Thread(target=one, args=(i,)) for i in range(streams)]
        started = time.time()
        for th in threads:
            th.start()
        first.wait(60)
        import pynvml

        pynvml.nvmlInit()
        h = pynvml.nvmlDeviceGetHandleByIndex(0)
        free = int(pynvml.nvmlDeviceGetMemoryInfo(h).free)
        want = free + ours // 2  # half of what our model holds must come back
        t0 = time.time()
        nb = subprocess.run(
            [sys.executable, "-c", NEIGHBOUR, str(want), str(patience)],
            capture_output=True,
            text=True,
            timeout=300,
        )
        neighbour = json.loads(nb.stdout.strip().splitlines()[-1]) if nb.stdout else {}
        neighbour["stderr"] = nb.stderr[-300:]
        for th in threads:
            th.join(timeout=120)
        rows = ps_rows(server.url)
        events = httpx.get(server.url + "/api/guard", timeout=10).json()
    finally:
        server.close()
    text = server.log.read_text()
    lines = [ln for ln in text.splitlines() if "pressure" in ln.lower() or "abort" in ln.lower()]
    emit(
        out,
        "guard",
        {
            "guard": guarded,
            "model": model,
            "ours_gpu": ours,
            "neighbour": neighbour,
            "neighbour_started_after_s": round(t0 - started, 2),
            "clients": outcomes,
            "loaded_after": {x["id"]: x.get("state") for x in rows},
            "server_cuda_oom": sum(
                text.lower().count(k) for k in ("out of memory", "cudamalloc failed")
            ),
            "guard_log": lines[-12:],
            "guard_events": [
                {k: e.get(k) for k in ("wall", "kind", "level", "model", "message")}
                for e in (events.get("events") or [])
            ][-12:],
        },
    )


# ------------------------------------------------------------------------- capped pool


def ps_rows(url: str) -> list[dict[str, Any]]:
    import httpx

    data = httpx.get(url + "/api/ps", timeout=10).json()
    rows: list[dict[str, Any]] = data if isinstance(data, list) else data.get("models", [])
    return rows


def capped(out: Path, models: list[Path], cap: str, order: list[str]) -> None:
    import httpx

    log = out / "capped_server.log"
    base = sum(nvml_used())
    with Sampler() as sampler:
        server = Server(models, log, {"ELBOWROOM_OVERRIDE_GPU_MEMORY": cap}, "--slots", "4")
        try:
            for step, name in enumerate(order):
                t = time.time()
                r = httpx.post(
                    server.url + "/v1/completions",
                    timeout=300,
                    json={"model": name, "prompt": PROMPT, "max_tokens": 16, "temperature": 0},
                )
                rows = ps_rows(server.url)
                emit(
                    out,
                    "capped",
                    {
                        "step": step,
                        "model": name,
                        "status": r.status_code,
                        "seconds": round(time.time() - t, 2),
                        "loaded": {x["id"]: x.get("processor") for x in rows},
                        "n_gpu_layers": {
                            x["id"]: (x.get("placement") or {}).get("n_gpu_layers") for x in rows
                        },
                        "ours_gpu": sum(x.get("gpu", 0) for x in rows),
                        "device_used_over_idle": sum(nvml_used()) - base,
                        "error": None if r.status_code == 200 else r.text[:500],
                    },
                )
            memory = httpx.get(server.url + "/api/memory", timeout=10).json()
        finally:
            server.close()
    text = log.read_text()
    ooms = sum(text.lower().count(s) for s in ("out of memory", "cudamalloc failed", "cuda error"))
    pools = [p for p in memory.get("pools", []) if p["kind"] == "gpu"]
    emit(
        out,
        "capped",
        {
            "summary": True,
            "cap": cap,
            "requests": len(order),
            "peak_device_used_over_idle": sum(sampler.peak) - base,
            "cuda_oom_lines": ooms,
            "gpu_pools": pools,
        },
    )


def refuse(out: Path, path: Path, small: Path, cap: str) -> None:
    import httpx

    env = {"ELBOWROOM_OVERRIDE_GPU_MEMORY": cap, "ELBOWROOM_GPU_LAYERS": "-1"}
    server = Server([path, small], out / "refuse_server.log", env, "--slots", "4")
    try:
        for p in (small, path):
            r = httpx.post(
                server.url + "/v1/completions",
                timeout=300,
                json={"model": p.stem, "prompt": PROMPT, "max_tokens": 8},
            )
            emit(out, "refuse", {"model": p.stem, "status": r.status_code, "body": r.json()})
    finally:
        server.close()


# ------------------------------------------------------------------------- two GPUs


def split(out: Path, path: Path, free_gib: list[float], ctx: int, slots: int) -> None:
    """Other processes take each GPU down to about ``free_gib`` GiB free (unequal free
    memory); elbowroom places the model over both in proportion to what is free, and
    NVML measures each GPU."""
    import pynvml

    pynvml.nvmlInit()
    hogs = []
    # torch's allocator takes the bytes with cudaMalloc; its CUDA context (~0.5 GiB) too.
    code = (
        "import sys, time, torch; i, n = int(sys.argv[1]), float(sys.argv[2]); "
        "x = torch.empty(int(n * 2**30), dtype=torch.uint8, device=f'cuda:{i}'); "
        "print('ready', flush=True); time.sleep(3600)"
    )
    try:
        for i, target in enumerate(free_gib):
            free = pynvml.nvmlDeviceGetMemoryInfo(pynvml.nvmlDeviceGetHandleByIndex(i)).free
            hog = max(0.0, free / 2**30 - target - 0.5)
            p = subprocess.Popen(
                [sys.executable, "-c", code, str(i), str(hog)],
                stdout=subprocess.PIPE,
                text=True,
                start_new_session=True,
            )
            assert p.stdout is not None and p.stdout.readline().strip() == "ready"
            hogs.append(p)
        emit(out, "split", {"nvml": nvml_record(), "target_free_gib": free_gib})
        idle = nvml_used()
        args = ("--ctx", str(ctx), "--slots", str(slots))
        server = Server([path], out / "split_server.log", {}, *args)
        try:
            emit(out, "split", measure_load(server, path.stem, idle))
        finally:
            server.close()
    finally:
        for p in hogs:
            os.killpg(p.pid, signal.SIGKILL)


# ------------------------------------------------------------------------- main


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("phase")
    ap.add_argument("rest", nargs="*")
    ap.add_argument("--ctx", type=int, nargs="+", default=[2048, 8192])
    ap.add_argument("--slots", type=int, nargs="+", default=[1, 8])
    ap.add_argument("--rounds", type=int, default=12)
    ap.add_argument("--tokens", type=int, default=128)
    ap.add_argument("--cap", default="16GiB")
    ap.add_argument("--order", default="")
    ap.add_argument("--free", default="6,7")
    ap.add_argument("--tiny", action="store_true")
    ap.add_argument("--partial", type=int, default=9)
    ap.add_argument("--modes", default="cpu,partial,gpu")
    ap.add_argument("--short", action="store_true", help="host: the ~220-token prompt")
    a = ap.parse_args()
    if a.phase == "synth":
        synth(Path(a.rest[0]), a.tiny)
        return
    if a.phase == "cublas":
        cublas_probe(Path(a.rest[0]))
        return
    if a.phase == "report":
        report(Path(a.rest[0]), Path(a.rest[1]))
        return
    out, models = Path(a.rest[0]), [Path(m) for m in a.rest[1:]]
    out.mkdir(parents=True, exist_ok=True)
    if a.phase == "vram":
        vram(out, models, a.ctx, a.slots)
    elif a.phase == "host":
        prompt = PROMPT * 20 if a.short else LONG_PROMPT
        host(out, models, a.ctx, a.slots, a.partial, tuple(a.modes.split(",")), prompt)
    elif a.phase == "phases":
        phases(out, models, a.ctx[0], a.slots[0], a.partial, tuple(a.modes.split(",")))
    elif a.phase == "speed":
        speed(out, models[0], a.rounds, a.tokens)
    elif a.phase == "guard":
        for guarded in (True, False):
            guard(out, models[0], guarded)
    elif a.phase == "capped":
        order = a.order.split(",") if a.order else [m.stem for m in models] * 2
        capped(out, models, a.cap, order)
    elif a.phase == "refuse":
        refuse(out, models[0], models[1], a.cap)
    elif a.phase == "split":
        split(out, models[0], [float(x) for x in a.free.split(",")], a.ctx[0], a.slots[0])
    else:
        raise SystemExit(f"unknown phase {a.phase}")


if __name__ == "__main__":
    sys.path.insert(0, str(HERE))
    main()
