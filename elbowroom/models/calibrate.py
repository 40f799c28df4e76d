"""Measure what a model really holds: load it in a child process and read its memory.

This is where the constants in ``estimate.py`` come from, and how the estimate-accuracy
benchmark and tests check them. The child loads the model, then runs requests; after each
stage it prints a line and waits, so the parent reads ``/proc/PID/smaps_rollup``
(``memory.process.measure_pid``) from outside, as the server measures its runners.

LLMs load through llama.cpp's server engine (``xllamacpp.Server``) with the options
elbowroom's runner gives it (``engine_params``): n_ctx = per-slot context × slots,
n_parallel = slots, the KV cache type (flash attention on: quantized V needs it, and
``auto`` turns it on on CPU anyway), n_batch/n_ubatch 2048/512, warmup on, n_gpu_layers 0,
no automatic parameter fitting, and the RAM prompt cache ``cache_ram_mib`` (a grant the
budget hands out separately). The child imports only xllamacpp, so its numbers exclude
elbowroom's runner modules (added in estimate.py). Resident engines load through elbowroom's
own engine classes, so their session options are what is measured.

Stages: ``imported`` (the library imported, no weights yet), ``loaded`` (after load: what
an LLM's estimate predicts and what the server records), ``used`` (after one short
request), and for LLMs with ``busy=True`` ``busy`` (every slot served a ~300-token prompt
at once: what use adds), with ``heavy=N`` ``heavy`` (N rounds of different long prompts on
every slot: the prompt cache fills up to its grant). llama.cpp's own report of its buffers
(model, KV, compute, output, repacked weights) comes back in ``buffers`` so a miss can be
attributed to a term.

Run ``python -m elbowroom.models.calibrate MODEL_ID_OR_GGUF [N_CTX] [SLOTS] [KV_TYPE]``.
"""

from __future__ import annotations

import json
import re
import subprocess
import sys
import tempfile
import threading
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from elbowroom.memory.process import measure_pid
from elbowroom.memory.types import ProcessMemory
from elbowroom.models.estimate import CTX_CHECKPOINTS, N_UBATCH
from elbowroom.models.spec import ModelSpec

THREADS = 2  # the engines' default thread count


def engine_params(
    path: str, n_ctx: int, slots: int, kv_type: str, cache_ram_mib: int, threads: int = THREADS
) -> dict[str, Any]:
    """The ``xllamacpp.CommonParams`` an LLM runner loads with (engines/llama.py), as plain
    values: the memory-relevant ones.

    ``n_ctx`` is the per-slot context (the plan's); the engine gets ``n_ctx × slots``.
    """
    return {
        "model.path": path,
        "n_ctx": n_ctx * slots,
        "n_parallel": slots,
        "kv_unified": False,  # each slot owns its n_ctx
        "n_batch": N_UBATCH,
        "n_ubatch": N_UBATCH,
        "cache_type_k": kv_type,
        "cache_type_v": kv_type,
        "flash_attn": kv_type != "f16",  # True: on; False: llama.cpp's auto (on for CPU)
        "cache_ram_mib": cache_ram_mib,
        "n_ctx_checkpoints": CTX_CHECKPOINTS,
        "n_gpu_layers": 0,
        "fit_params": False,  # fitting could change n_ctx behind the budget's back
        "ctx_shift": False,
        "warmup": True,
        "threads": threads,
    }


@dataclass(frozen=True, slots=True)
class LoadMeasurement:
    model_id: str
    n_ctx: int  # per slot
    slots: int
    kv_type: str
    stages: dict[str, ProcessMemory] = field(default_factory=dict)
    buffers: dict[str, float] = field(default_factory=dict)  # llama.cpp's log, MiB by kind

    @property
    def loaded(self) -> ProcessMemory:
        return self.stages["loaded"]

    @property
    def used(self) -> ProcessMemory:
        return self.stages["used"]


class CalibrationError(RuntimeError):
    pass


def measure_load(
    spec: ModelSpec,
    n_ctx: int = 0,
    kv_type: str = "f16",
    *,
    slots: int = 1,
    cache_ram_mib: int = 0,
    busy: bool = False,
    heavy: int = 0,
    timeout: float = 300.0,
) -> LoadMeasurement:
    """Load ``spec`` in a child process and measure it after each stage."""
    return measure_path(
        spec.engine,
        spec.path,
        spec.id,
        n_ctx,
        kv_type,
        slots=slots,
        options=dict(spec.options),
        cache_ram_mib=cache_ram_mib,
        busy=busy,
        heavy=heavy,
        timeout=timeout,
    )


def measure_path(
    engine: str,
    path: Path,
    model_id: str,
    n_ctx: int = 0,
    kv_type: str = "f16",
    *,
    slots: int = 1,
    options: dict[str, str] | None = None,
    cache_ram_mib: int = 0,
    busy: bool = False,
    heavy: int = 0,
    timeout: float = 300.0,
) -> LoadMeasurement:
    """``measure_load`` for a file that is not in a catalog (the held-out benchmark)."""
    job = {
        "engine": engine,
        "path": str(path),
        "options": options or {},
        "params": engine_params(str(path), n_ctx, slots, kv_type, cache_ram_mib),
        "busy": busy,
        "heavy": heavy,
    }
    # The engine's log goes to a file (never a full pipe); a random-weight model's output
    # in it may be broken UTF-8.
    with tempfile.TemporaryFile("w+", errors="replace") as log:
        proc = subprocess.Popen(
            [sys.executable, "-c", _CHILD, json.dumps(job)],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            stderr=log,
            text=True,
        )
        watchdog = threading.Timer(timeout, proc.kill)  # a hung load must not hang the caller
        watchdog.start()
        stages: dict[str, ProcessMemory] = {}
        assert proc.stdin is not None and proc.stdout is not None
        try:
            for line in proc.stdout:
                stage = line.strip()
                if stage == "done":
                    break
                stages[stage] = measure_pid(proc.pid)
                proc.stdin.write("next\n")
                proc.stdin.flush()
            proc.stdin.close()
            proc.wait(timeout=timeout)
        finally:
            watchdog.cancel()
            if proc.poll() is None:
                proc.kill()
                proc.wait()
            proc.stdout.close()
        log.seek(0)
        text = log.read()
    if proc.returncode != 0 or "used" not in stages:
        raise CalibrationError(
            f"measuring {model_id} failed (exit {proc.returncode}): {text.strip()[-2000:]}"
        )
    return LoadMeasurement(model_id, n_ctx, slots, kv_type, stages, parse_buffers(text))


_BUFFER = re.compile(r"(\w+)\s+(model|KV|compute|output) buffer size =\s+([\d.]+) MiB")


def parse_buffers(log: str) -> dict[str, float]:
    """llama.cpp's buffer report, MiB by kind: ``model:CPU_Mapped``, ``KV``, ``compute``..."""
    out: dict[str, float] = {}
    for dev, kind, mib in _BUFFER.findall(log):
        key = f"model:{dev}" if kind == "model" else kind
        out[key] = out.get(key, 0.0) + float(mib)
    return out


# The child: only the engine's library is imported. Each stage prints its name and waits.
_CHILD = r"""
import json, sys, threading
from pathlib import Path

job = json.loads(sys.argv[1])
engine, path, opts = job["engine"], job["path"], job["options"]
THREADS = 2

def stage(name):
    print(name, flush=True)
    sys.stdin.readline()

if engine == "llama":
    # What a runner imports before its engine loads: the worker, the engine's module and
    # the library; the "imported" stage is then the runner's own baseline.
    import multiprocessing.connection
    import elbowroom.runtime.worker
    from elbowroom.engines.registry import create_engine
    create_engine("llama")
    import xllamacpp as x
    stage("imported")
    prm = job["params"]
    types = {"f16": x.ggml_type.GGML_TYPE_F16, "q8_0": x.ggml_type.GGML_TYPE_Q8_0,
             "q4_0": x.ggml_type.GGML_TYPE_Q4_0}
    fa = x.llama_flash_attn_type
    p = x.CommonParams()
    p.model.path = prm["model.path"]
    p.n_ctx, p.n_parallel, p.kv_unified = prm["n_ctx"], prm["n_parallel"], prm["kv_unified"]
    p.n_batch, p.n_ubatch = prm["n_batch"], prm["n_ubatch"]
    p.n_ctx_checkpoints, p.ctx_shift = prm["n_ctx_checkpoints"], prm["ctx_shift"]
    p.cache_type_k, p.cache_type_v = types[prm["cache_type_k"]], types[prm["cache_type_v"]]
    on, auto = fa.LLAMA_FLASH_ATTN_TYPE_ENABLED, fa.LLAMA_FLASH_ATTN_TYPE_AUTO
    p.flash_attn_type = on if prm["flash_attn"] else auto
    p.cache_ram_mib = prm["cache_ram_mib"]
    p.n_gpu_layers = prm["n_gpu_layers"]
    p.fit_params = prm["fit_params"]
    p.warmup = prm["warmup"]
    p.cpuparams.n_threads = p.cpuparams_batch.n_threads = prm["threads"]
    p.verbosity = 10  # the buffer report is logged at debug level
    srv = x.Server(p)
    stage("loaded")
    srv.handle_completions({"prompt": "The capital of France is", "max_tokens": 8,
                            "temperature": 0})
    stage("used")
    def together(prompts):
        def one(i, prompt):
            srv.handle_completions({"prompt": prompt, "max_tokens": 16,
                                    "temperature": 0.7, "seed": i})
        threads = [threading.Thread(target=one, args=(i, p)) for i, p in enumerate(prompts)]
        [t.start() for t in threads]
        [t.join() for t in threads]
    slots = prm["n_parallel"]
    words = lambda tag, n: " ".join("%s%d" % (tag, i) for i in range(n))  # ~2 tokens each
    if job["busy"]:
        together(["%d %s" % (i, words("w", 150)) for i in range(slots)])  # ~300 tokens each
        stage("busy")
    # Heavy use: rounds of different long prompts on every slot, so the engine's prompt
    # cache fills up to its grant (cache_ram_mib) and slots are reused.
    n = min(200, max(16, prm["n_ctx"] // slots // 2 - 40))
    for r in range(job["heavy"]):
        together(["%d %d %s" % (r, i, words("h%d." % r, n)) for i in range(slots)])
    if job["heavy"]:
        stage("heavy")
else:
    # Resident engines: elbowroom's own engine class, so its session options count.
    import importlib, tempfile, wave
    import numpy as np
    from elbowroom.engines.registry import create_engine
    from elbowroom.engines.options import EngineOptions
    libs = {"whisper": ["faster_whisper", "av"], "pocketsphinx": ["pocketsphinx", "av"],
            "piper": ["piper", "onnxruntime"], "onnx-embed": ["onnxruntime", "tokenizers"]}
    for name in libs.get(engine, []):
        importlib.import_module(name)
    stage("imported")  # the runtime before any weights: splits runtime from weights
    from elbowroom.models.spec import Holding, ModelKind, ModelSpec
    from elbowroom.engines.requests import EmbedRequest, SpeechRequest, TranscribeRequest
    spec = ModelSpec(id="calibration", kind=ModelKind.ASR, engine=engine, path=Path(path),
                     size_bytes=0, holding=Holding.RESIDENT, source="calibrate", options=opts)
    eng = create_engine(engine)
    eng.load(spec, EngineOptions(threads=THREADS))  # the spec carries the engine's files
    stage("loaded")
    def tone(seconds, scale):
        t = np.arange(16000 * seconds) / 16000
        return scale * np.sin(2 * np.pi * 440 * t)
    if engine in ("whisper", "pocketsphinx"):
        wav = Path(tempfile.mkdtemp()) / "tone.wav"
        with wave.open(str(wav), "wb") as out:
            out.setnchannels(1); out.setsampwidth(2); out.setframerate(16000)
            out.writeframes(tone(3, 3000).astype(np.int16).tobytes())
        eng.run("transcribe", TranscribeRequest(audio_path=str(wav)), lambda _: None,
                lambda: False)
    elif engine == "piper":
        eng.run("speech", SpeechRequest(input="Hello there, this is a short test sentence.",
                                        response_format="wav"), lambda _: None, lambda: False)
    elif engine == "onnx-embed":
        inputs = ["a short sentence to embed, number %d" % i for i in range(8)]
        eng.run("embed", EmbedRequest(inputs=tuple(inputs)), lambda _: None, lambda: False)
    else:
        raise SystemExit("no calibration request for engine " + engine)
    stage("used")
print("done", flush=True)
"""


def _main(argv: list[str]) -> int:
    from elbowroom.config import load_settings
    from elbowroom.models.catalog import discover
    from elbowroom.models.estimate import footprint
    from elbowroom.units import format_size

    if not argv:
        print(__doc__)
        return 2
    settings = load_settings()
    target = Path(argv[0])
    if target.exists():  # a file outside the catalog: list it too, then find it by path
        settings = settings.replace(model_paths=(target,))
    catalog = discover(settings)
    found = [s for s in catalog if s.path.resolve() == target.resolve()]
    spec = found[0] if found else catalog.get(argv[0])
    n_ctx = int(argv[1]) if len(argv) > 1 else (2048 if spec.gguf else 0)
    slots = int(argv[2]) if len(argv) > 2 else 1
    kv_type = argv[3] if len(argv) > 3 else "f16"
    m = measure_load(spec, n_ctx, kv_type, slots=slots, busy=spec.gguf is not None)
    fp = footprint(spec, n_ctx, slots, kv_type)
    for name, mem in m.stages.items():
        print(
            f"{name:>9}: anonymous {format_size(mem.anonymous)}, "
            f"file-backed {format_size(mem.file_backed)}"
        )
    print(
        f"predicted: anonymous {format_size(fp.anonymous - fp.working)} at load"
        f" (+ {format_size(fp.working)} in use), file-backed {format_size(fp.file_backed)}"
    )
    print("llama.cpp buffers (MiB):", json.dumps(m.buffers))
    return 0


if __name__ == "__main__":
    sys.exit(_main(sys.argv[1:]))
