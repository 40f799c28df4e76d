"""A model split over llama.cpp RPC servers on this machine (docs/cluster.md).

Needs the RPC build (``scripts/rpc_engine.sh``: rpc-server and an RPC-enabled
llama-server); skips without it. Two RPC servers on 127.0.0.1 stand for two nodes with
2:1 free memory: the layers follow that ratio (read from the engine's own per-layer
device assignment), each device's compute buffer is what the split plan predicts for a
share (cluster/split_plan.share_compute), and the split model's greedy output equals the
unsplit model's on the same llama.cpp build. (elbowroom's usual engine, the PyPI
xllamacpp wheel, rounds slightly differently: its greedy text for this prompt parts from
both after 5 tokens.)
"""

from __future__ import annotations

import re
import socket
import subprocess
import time
from collections import Counter
from collections.abc import Iterator
from dataclasses import replace
from typing import Any

import pytest
from bundled_models import bundled_spec
from engine_text import engine_answer

from elbowroom.cluster.rpc import rpc_server_args
from elbowroom.cluster.split import split_layers
from elbowroom.cluster.split_plan import share_compute
from elbowroom.engines.llama_rpc import RpcLlamaEngine, default_binary
from elbowroom.engines.options import RpcLlamaOptions
from elbowroom.engines.requests import TextRequest

pytestmark = pytest.mark.slow

RPC_SERVER, LLAMA_SERVER = default_binary("rpc-server"), default_binary("llama-server")
if not (RPC_SERVER.is_file() and LLAMA_SERVER.is_file()):
    pytest.skip(
        "no RPC build: run scripts/rpc_engine.sh (or ELBOWROOM_RPC=1 scripts/setup.sh)",
        allow_module_level=True,
    )

SMOLLM2 = "smollm2-135m"
MiB = 1024**2
ITALY = "The capital of France is Paris. The capital of Italy is"
PROMPT = TextRequest(kind="completion", prompt=ITALY, temperature=0, max_tokens=16)
OPTIONS = RpcLlamaOptions(n_ctx=512, slots=1, kv_type="f16", cache_ram_bytes=0, kv_cache=False)


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port: int = s.getsockname()[1]
        return port


def wait_port(port: int, proc: subprocess.Popen[bytes], deadline: float = 30.0) -> None:
    end = time.monotonic() + deadline
    while time.monotonic() < end:
        if proc.poll() is not None:
            raise AssertionError(f"rpc-server exited with {proc.returncode}")
        try:
            with socket.create_connection(("127.0.0.1", port), timeout=0.5):
                return
        except OSError:
            time.sleep(0.05)  # a child's port opening: nothing else to wait on
    raise AssertionError(f"rpc-server on port {port} did not open within {deadline} s")


@pytest.fixture(scope="module")
def rpc_servers() -> Iterator[list[str]]:
    procs, endpoints = [], []
    try:
        for _ in range(2):
            port = free_port()
            proc = subprocess.Popen(
                rpc_server_args(RPC_SERVER, "127.0.0.1", port),
                stdout=subprocess.DEVNULL,
                stderr=subprocess.DEVNULL,
            )
            procs.append(proc)
            wait_port(port, proc)
            endpoints.append(f"127.0.0.1:{port}")
        yield endpoints
    finally:
        for proc in procs:
            proc.terminate()
            proc.wait(10)


def generate(engine: Any, max_tokens: int) -> tuple[str, float]:
    began = time.monotonic()
    result = engine_answer(engine, replace(PROMPT, max_tokens=max_tokens))
    return result["text"], time.monotonic() - began


def test_split_places_layers_by_free_memory_and_matches_the_unsplit_output(
    rpc_servers: list[str],
) -> None:
    spec = bundled_spec(SMOLLM2)
    assert spec.gguf is not None
    split = split_layers(spec.gguf.n_layers, {"a": 2, "b": 1})  # free memory 2:1
    counts = list(split.layers.values())
    assert counts == [20, 10]

    engine = RpcLlamaEngine()
    facts = engine.load(
        spec,
        replace(
            OPTIONS, rpc_servers=tuple(rpc_servers), rpc_split=tuple(counts), log_level="debug"
        ),
    )
    try:
        assert facts["rpc_split"] == counts and facts["engine"] == "llama-server (RPC)"
        split_text, _ = generate(engine, 24)
        assert engine.log_path is not None
        log = engine.log_path.read_text(errors="replace")
    finally:
        engine.close()
    # llama.cpp's own account of where each repeating layer went.
    placed = Counter(
        dev
        for il, dev in re.findall(r"layer\s+(\d+) assigned to device (\S+?),", log)
        if int(il) < spec.gguf.n_layers
    )
    # RPC devices are numbered in --rpc order: RPC0 is the first endpoint.
    assert placed == {f"RPC{i}": n for i, n in enumerate(counts)}, placed
    # The compute buffer each RPC device reserved, against the split plan's prediction
    # (cluster/split_plan.share_compute): covered, and by less than 1.5 MiB too much.
    reported = {
        ep: float(mib)
        for ep, mib in re.findall(r"RPC\d+\[([\d.:]+)\] compute buffer size =\s+([\d.]+) MiB", log)
    }
    assert set(reported) == set(rpc_servers), reported
    for i, endpoint in enumerate(rpc_servers):
        predicted = share_compute(spec.gguf, 512, 1, first=i == 0) / MiB
        assert reported[endpoint] <= predicted <= reported[endpoint] + 1.5, (i, reported)

    # The unsplit model on the same llama.cpp build (no RPC devices, this CPU).
    plain = RpcLlamaEngine()
    plain.load(spec, OPTIONS)
    try:
        plain_text, _ = generate(plain, 24)
    finally:
        plain.close()
    assert split_text == plain_text and split_text.strip()
