"""The scheduler with GPU pools: placement reaches the runner's options, loads evict by
VRAM, partial offload when a model cannot fit, 507 naming the GPU pool when forced."""

from __future__ import annotations

import dataclasses
import re
from pathlib import Path
from typing import Any

import pytest
from gpu_layouts import calib, synth_tensors
from scheduler_fakes import (
    FakeCatalog,
    FakeClock,
    FakeEstimator,
    FakeMachine,
    FakeMeasurements,
    FakeRunner,
    context_of,
    request,
    run,
)

from elbowroom.config import Settings
from elbowroom.engines.options import EngineOptions, LlamaOptions, Offload
from elbowroom.errors import InsufficientMemory
from elbowroom.memory.types import GpuMemory, Snapshot
from elbowroom.models.gguf_meta import tensor_bytes_by_layer
from elbowroom.models.spec import GGUFInfo, Holding, ModelKind, ModelSpec
from elbowroom.runtime.protocol import ExitCallback, RunnerState
from elbowroom.scheduler.loop import Scheduler
from elbowroom.scheduler.offload import Layout, split_bytes
from elbowroom.units import GiB, MiB

GPU_TOTAL = 8 * GiB  # ceiling: 0.85 x (8 GiB - 512 MiB reserve) = 6.375 GiB


def llm(model_id: str, layers: int) -> ModelSpec:
    shape = {**calib()["models"]["llama1b.gguf"], "layers": layers}
    blocks, inp, out = tensor_bytes_by_layer(synth_tensors(shape), layers)
    info = GGUFInfo(
        architecture="llama", name=model_id, n_layers=layers, n_heads=32, n_kv_heads=8,
        head_dim_k=64, head_dim_v=64, n_embd=2048, trained_ctx=8192, file_type="F16",
        has_chat_template=False, n_vocab=49152, layer_bytes=blocks, input_bytes=inp,
        output_bytes=out, n_ff=8192,
    )  # fmt: skip
    size = sum(blocks or ()) + inp + out
    return ModelSpec(model_id, ModelKind.LLM, "llama", Path("/fake") / model_id, size,
                     Holding.MMAP, "path", gguf=info)  # fmt: skip


def vram(r: FakeRunner) -> int:
    """What the fake runner's GPU holds: the offload arithmetic for its start options."""
    o = r.options
    if r.state is not RunnerState.READY or not isinstance(o, LlamaOptions):
        return 0
    if not o.offload.n_gpu_layers:
        return 0
    assert r.spec.gguf is not None
    layout = Layout.from_info(r.spec.gguf)
    return split_bytes(layout, o.n_ctx, o.slots, o.kv_type, [o.offload.n_gpu_layers]).gpu[0]


@dataclasses.dataclass
class GpuHarness:
    sched: Scheduler
    runners: list[FakeRunner]
    peak: list[int]

    def offload(self, model_id: str) -> Offload:
        r = next(r for r in reversed(self.runners) if r.spec.id == model_id)
        assert isinstance(r.options, LlamaOptions)
        return r.options.offload

    def loaded(self) -> list[str]:
        return sorted(row["id"] for row in self.sched.ps())


def gpu_harness(*specs: ModelSpec, **overrides: Any) -> GpuHarness:
    settings = Settings(**{
        "os_reserve": 0, "safety_margin": 0, "slots": 1, "ctx": 2048, "max_ctx": 8192,
        "data_dir": Path("/nonexistent/elbowroom-test"),
        "kv_cache_dir": Path("/nonexistent/elbowroom-test/kv"), **overrides,
    })  # fmt: skip
    machine, clock, runners, peak = FakeMachine(64 * GiB), FakeClock(), [], [0]
    estimator = FakeEstimator()

    def probe() -> Snapshot:
        used = sum(vram(r) for r in runners)
        peak[0] = max(peak[0], used)
        gpu = GpuMemory(0, "Fake GPU", GPU_TOTAL, GPU_TOTAL - used, used)
        return dataclasses.replace(machine.probe(), gpus=(gpu,))

    def factory(s: ModelSpec, on_exit: ExitCallback) -> FakeRunner:
        def size_of(options: EngineOptions) -> int:
            n_ctx, slots, _ = context_of(options)
            return estimator.footprint(s, n_ctx, slots).total

        runner = FakeRunner(machine, s, on_exit, size_of)
        runners.append(runner)
        return runner

    sched = Scheduler(settings, FakeCatalog(*specs), probe=probe, runner_factory=factory,
                      measured=FakeMeasurements(), clock=clock, sleep=clock.sleep,
                      estimator=estimator)  # fmt: skip
    return GpuHarness(sched, runners, peak)


A, B, C = llm("a", 16), llm("b", 16), llm("c", 22)  # 2.8, 2.8 and 3.5 GiB on the GPU
BIG = llm("big", 64)  # 8.4 GiB: more than the whole pool


def test_alternating_models_place_evict_by_vram_and_partially_offload() -> None:
    h = gpu_harness(A, B, C, BIG)

    async def scenario() -> None:
        await request(h, "a")
        await request(h, "b")
        assert h.loaded() == ["a", "b"]  # 5.6 GiB: both fit the 6.375 GiB ceiling
        assert h.offload("a") == Offload(17, devices=(0,))
        await request(h, "c")  # 3.5 GiB more: the least recently used GPU model goes
        assert h.loaded() == ["b", "c"]
        # The eviction says what it gave back in VRAM, not only in host memory.
        evicted = [e for e in h.sched.events.since() if e.kind == "evict" and e.model == "a"]
        assert len(evicted) == 1 and evicted[0].detail["freed_pools"]["gpu0"] > 2 * GiB
        assert re.search(r"freed .* host, .* gpu0$", evicted[0].message)
        await request(h, "big")  # cannot fit even alone: everything idle is evicted ...
        assert h.loaded() == ["big"]
        assert 0 < h.offload("big").n_gpu_layers < 65  # ... and part of it stays on the CPU
        row = h.sched.ps()[0]
        assert row["processor"].endswith("CPU/GPU") and row["placement"]["mode"] == "partial"
        await request(h, "a")  # back to a small one: big is evicted for it
        assert h.loaded() == ["a"] and h.offload("a").n_gpu_layers == 17

    run(scenario())
    # VRAM never went past the ceiling the pool allows.
    assert h.peak[0] <= int(0.85 * (GPU_TOTAL - 512 * MiB))


def test_forced_full_offload_that_cannot_fit_is_a_507_naming_the_gpu_pool() -> None:
    h = gpu_harness(A, BIG, gpu_layers=-1)

    async def scenario() -> None:
        await request(h, "a")
        with pytest.raises(InsufficientMemory) as err:
            await request(h, "big")
        details = err.value.details
        assert details["pool"] == "gpu0"
        assert details["pools"]["gpu0"]["needed"] > details["pools"]["gpu0"]["limit"]
        assert "GPU pool gpu0" in str(err.value)
        assert h.loaded() == ["a"]  # nothing was evicted for a load that can never fit

    run(scenario())


def test_memory_report_lists_every_pool() -> None:
    h = gpu_harness(A)

    async def scenario() -> None:
        await request(h, "a")
        report = h.sched.memory_report()
        names = [p["name"] for p in report["pools"]]
        assert names == ["host", "gpu0"]
        gpu0 = report["pools"][1]
        assert gpu0["ours"] == vram(h.runners[0]) and gpu0["ceiling"] < GPU_TOTAL

    run(scenario())
