"""place_on_gpus: a host-sized plan becomes a placement with per-pool bytes."""

from __future__ import annotations

import dataclasses
from pathlib import Path

from gpu_layouts import calib, synth_tensors

from elbowroom.config import Settings
from elbowroom.engines.options import LlamaOptions, Offload
from elbowroom.memory.budget import BudgetConfig
from elbowroom.memory.pools import memory_pools
from elbowroom.memory.types import GpuMemory, Snapshot
from elbowroom.models.gguf_meta import tensor_bytes_by_layer
from elbowroom.models.spec import Footprint, GGUFInfo, Holding, ModelKind, ModelSpec
from elbowroom.scheduler.offload_plan import gpu_usage, model_pools, place_on_gpus
from elbowroom.scheduler.policy import LoadRequest, ModelState, State
from elbowroom.scheduler.sizing import Plan, start_options
from elbowroom.units import GiB, MiB

SHAPE = calib()["models"]["llama1b.gguf"]
BLOCKS, INPUT, OUTPUT = tensor_bytes_by_layer(synth_tensors(SHAPE), SHAPE["layers"])
INFO = GGUFInfo(
    architecture="llama", name="llama1b", n_layers=16, n_heads=32, n_kv_heads=8, head_dim_k=64,
    head_dim_v=64, n_embd=2048, trained_ctx=32768, file_type="F16", has_chat_template=False,
    n_vocab=49152, layer_bytes=BLOCKS, input_bytes=INPUT, output_bytes=OUTPUT, n_ff=8192,
)  # fmt: skip
SPEC = ModelSpec("llama1b", ModelKind.LLM, "llama", Path("/m/llama1b.gguf"), 2_350_858_304,
                 Holding.MMAP, "path", gguf=INFO)  # fmt: skip
CPU_PLAN = Plan(LoadRequest("llama1b", 3 * GiB), Footprint(SPEC.size_bytes, 0, 0), 2048, "f16", 4)


def pools(*free_gib: float, total_gib: float = 80) -> tuple:  # type: ignore[type-arg]
    gpus = tuple(
        GpuMemory(i, "NVIDIA H100", int(total_gib * GiB), int(f * GiB), int((total_gib - f) * GiB))
        for i, f in enumerate(free_gib)
    )
    snap = Snapshot("linux", 64 * GiB, 60 * GiB, 4 * GiB, 64 * GiB, 60 * GiB, gpus=gpus)
    return memory_pools(snap, 0, {}, BudgetConfig())


def test_no_gpu_leaves_the_plan_alone() -> None:
    assert place_on_gpus(CPU_PLAN, SPEC, Settings(), State((), 10 * GiB), pools()) is CPU_PLAN


def test_fully_offloaded_model_gets_the_gpu_context_and_pool_bytes() -> None:
    plan = place_on_gpus(CPU_PLAN, SPEC, Settings(), State((), 10 * GiB), pools(70))
    assert plan.placement is not None and plan.placement.mode == "gpu"
    assert plan.n_ctx == 4096  # max_ctx: the KV fits the GPU, not host RAM
    assert set(plan.request.pools) == {"gpu0"} and plan.request.pools["gpu0"] > 3 * GiB
    # Host holds the embeddings (mmap) and the runtime, far less than the CPU plan.
    assert plan.request.needed < 1 * GiB
    opts = start_options(Settings(), SPEC, plan)
    assert isinstance(opts, LlamaOptions)
    assert opts.offload == Offload(17, devices=(0,)) and opts.n_ctx == 4096


def test_busy_models_vram_is_not_room_but_idle_models_is() -> None:
    busy = ModelState("other", ModelKind.LLM, Holding.MMAP, 1 * GiB, busy=1,
                      pools={"gpu0": 6 * GiB})  # fmt: skip
    p = pools(8, total_gib=8.5)  # ceiling 0.85 x (8.5 - 0.5) GiB = 6.8 GiB
    busy_plan = place_on_gpus(CPU_PLAN, SPEC, Settings(ctx=2048), State((busy,), 10 * GiB), p)
    assert busy_plan.placement is not None and busy_plan.placement.mode == "cpu"
    idle = dataclasses.replace(busy, busy=0)
    idle_plan = place_on_gpus(CPU_PLAN, SPEC, Settings(ctx=2048), State((idle,), 10 * GiB), p)
    assert idle_plan.placement is not None and idle_plan.placement.mode == "gpu"


def test_gpu_layers_zero_keeps_the_model_off_the_gpus() -> None:
    plan = place_on_gpus(CPU_PLAN, SPEC, Settings(gpu_layers=0), State((), 10 * GiB), pools(70))
    assert plan.placement is not None and plan.placement.mode == "cpu"
    assert plan.request is CPU_PLAN.request
    opts = start_options(Settings(), SPEC, plan)
    assert isinstance(opts, LlamaOptions) and opts.offload == Offload(0, devices=())


def test_measured_vram_rescales_the_split() -> None:
    plan = place_on_gpus(CPU_PLAN, SPEC, Settings(ctx=2048), State((), 10 * GiB), pools(70))
    predicted = model_pools(plan.placement, None)
    assert predicted == plan.request.pools
    measured = model_pools(plan.placement, predicted["gpu0"] - 100 * MiB)
    assert measured == {"gpu0": predicted["gpu0"] - 100 * MiB}
    assert gpu_usage([measured, {"gpu1": 5}]) == {0: predicted["gpu0"] - 100 * MiB, 1: 5}
