"""Measure what a model really holds: load it in a child process and read its memory.

This is where the constants in ``estimate.py`` come from, and how the estimate-accuracy
benchmark and test check them. The child loads the model, then runs one small request;
after each stage it prints a line and waits, so the parent reads ``/proc/PID/smaps_rollup``
(``memory.process.measure_pid``) from outside, as the server measures its runners.
LLMs load with ``llama_cpp.Llama`` and the engine's options (n_batch 512, flash attention
for quantized KV): the engine's KV prefix cache is granted memory separately and is not part
of a footprint, and the child then imports only llama_cpp, so its numbers exclude
elbowroom's runner modules (about 2 MiB, added in estimate.py). Resident engines load
through elbowroom's own engine classes, so their session options are what is measured.

Stages: ``imported`` (resident engines: the libraries imported, no weights yet),
``loaded`` (after load), ``used`` (after one short request: what estimates predict),
and with ``long_prompt=True`` for LLMs ``prefilled`` (after ~1,500 prompt tokens, to show how
much more a long prefill touches).

Run ``python -m elbowroom.models.calibrate MODEL_ID [N_CTX] [KV_TYPE]`` to measure one model.
"""

from __future__ import annotations

import json
import subprocess
import sys
import threading
from dataclasses import dataclass, field
from typing import Any

from elbowroom.memory.process import measure_pid
from elbowroom.memory.types import ProcessMemory
from elbowroom.models.spec import ModelSpec

THREADS = 2  # the engines' default thread count


@dataclass(frozen=True, slots=True)
class LoadMeasurement:
    model_id: str
    n_ctx: int
    kv_type: str
    stages: dict[str, ProcessMemory] = field(default_factory=dict)

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
    long_prompt: bool = False,
    timeout: float = 300.0,
) -> LoadMeasurement:
    """Load ``spec`` in a child process and measure it after each stage."""
    job = {
        "engine": spec.engine,
        "path": str(spec.path),
        "options": dict(spec.options),
        "n_ctx": n_ctx,
        "kv_type": kv_type,
        "long_prompt": long_prompt,
    }
    proc = subprocess.Popen(
        [sys.executable, "-c", _CHILD, json.dumps(job)],
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
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
    if proc.returncode != 0 or "used" not in stages:
        err = proc.stderr.read() if proc.stderr else ""
        raise CalibrationError(
            f"measuring {spec.id} failed (exit {proc.returncode}): {err.strip()[-2000:]}"
        )
    if proc.stderr:
        proc.stderr.close()
    proc.stdout.close()
    return LoadMeasurement(spec.id, n_ctx, kv_type, stages)


# The child: only the engine's library is imported. Each stage prints its name and waits.
_CHILD = r"""
import json, sys
from pathlib import Path
import numpy as np

job = json.loads(sys.argv[1])
engine, path, opts = job["engine"], job["path"], job["options"]
THREADS = 2

def stage(name):
    print(name, flush=True)
    sys.stdin.readline()

def tone(seconds, scale):
    t = np.arange(16000 * seconds) / 16000
    return scale * np.sin(2 * np.pi * 440 * t)

if engine == "llama":
    import llama_cpp
    types = {"f16": 1, "q8_0": 8, "q4_0": 2}  # GGML_TYPE_*
    kv = job["kv_type"]
    llm = llama_cpp.Llama(
        model_path=path, n_ctx=job["n_ctx"], n_batch=min(job["n_ctx"], 512),
        n_threads=THREADS, use_mmap=True, type_k=types[kv], type_v=types[kv],
        flash_attn=kv != "f16", verbose=False,
    )
    stage("loaded")
    llm.create_completion("The capital of France is", max_tokens=8, temperature=0)
    stage("used")
    if job["long_prompt"]:
        n = min(job["n_ctx"] - 32, 1500)
        words = llm.tokenize(b" hello world", add_bos=False)
        llm.reset()
        llm.eval([llm.token_bos()] + (words * n)[: n - 1])
        stage("prefilled")
else:
    # Resident engines: elbowroom's own engine class, so its session options count.
    import importlib, tempfile, wave
    from elbowroom.engines.base import create_engine
    libs = {"whisper": ["faster_whisper", "av"], "pocketsphinx": ["pocketsphinx", "av"],
            "piper": ["piper", "onnxruntime"], "onnx-embed": ["onnxruntime", "tokenizers"]}
    for name in libs.get(engine, []):
        importlib.import_module(name)
    stage("imported")  # the runtime before any weights: splits runtime from weights
    from elbowroom.models.spec import Holding, ModelKind, ModelSpec
    spec = ModelSpec(id="calibration", kind=ModelKind.ASR, engine=engine, path=Path(path),
                     size_bytes=0, holding=Holding.RESIDENT, source="calibrate", options=opts)
    eng = create_engine(engine)
    eng.load(spec, {"threads": THREADS, **opts})
    stage("loaded")
    if engine in ("whisper", "pocketsphinx"):
        wav = Path(tempfile.mkdtemp()) / "tone.wav"
        with wave.open(str(wav), "wb") as out:
            out.setnchannels(1); out.setsampwidth(2); out.setframerate(16000)
            out.writeframes(tone(3, 3000).astype(np.int16).tobytes())
        eng.run("transcribe", {"audio_path": str(wav)}, lambda _: None, lambda: False)
    elif engine == "piper":
        eng.run("speech", {"input": "Hello there, this is a short test sentence.",
                           "response_format": "wav"}, lambda _: None, lambda: False)
    elif engine == "onnx-embed":
        inputs = ["a short sentence to embed, number %d" % i for i in range(8)]
        eng.run("embed", {"inputs": inputs}, lambda _: None, lambda: False)
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
    spec = discover(load_settings()).get(argv[0])
    n_ctx = int(argv[1]) if len(argv) > 1 else (2048 if spec.gguf else 0)
    kv_type = argv[2] if len(argv) > 2 else "f16"
    m = measure_load(spec, n_ctx, kv_type, long_prompt=spec.gguf is not None)
    fp = footprint(spec, n_ctx, kv_type=kv_type)
    out: dict[str, Any] = {"model": spec.id, "n_ctx": n_ctx, "kv_type": kv_type}
    for name, mem in m.stages.items():
        out[name] = {"anonymous": mem.anonymous, "file_backed": mem.file_backed}
        print(
            f"{name:>9}: anonymous {format_size(mem.anonymous)}, "
            f"file-backed {format_size(mem.file_backed)}"
        )
    print(
        f"predicted: anonymous {format_size(fp.anonymous)}, "
        f"file-backed {format_size(fp.file_backed)}"
    )
    return 0


if __name__ == "__main__":
    sys.exit(_main(sys.argv[1:]))
