"""Placement of an LLM's layers over GPU pools (pure), on the recorded model shapes."""

from __future__ import annotations

from typing import Any

import pytest
from gpu_layouts import recorded, shape

from elbowroom.engines.options import Offload
from elbowroom.memory.budget import BudgetConfig
from elbowroom.memory.pools import memory_pools
from elbowroom.memory.types import GpuMemory, Snapshot
from elbowroom.scheduler.offload import split_bytes
from elbowroom.scheduler.placement import GpuRoom, gpu_context, place, unified
from elbowroom.units import GiB, MiB

LLAMA = shape("llama1b.gguf")  # 17 units, ~3.0 GiB fully offloaded at 2048 x 1
QWEN = shape("qwen05b.gguf")  # 25 units, tied output


def full_bytes(ctx: int = 2048, slots: int = 1) -> int:
    return split_bytes(LLAMA, ctx, slots, "f16", [LLAMA.units]).gpu[0]


def test_full_offload_on_the_gpu_with_most_room() -> None:
    rooms = [GpuRoom(0, 4 * GiB), GpuRoom(1, 20 * GiB)]
    p = place(LLAMA, 2048, 1, "f16", rooms)
    assert p.mode == "gpu" and p.devices == (1,) and p.counts == (17,)
    assert p.split == "100% GPU"
    assert p.pool_bytes == {"gpu1": full_bytes()}
    assert p.offload() == Offload(17, devices=(1,))


def test_split_over_two_gpus_in_proportion_to_room() -> None:
    need = full_bytes()
    # Neither GPU holds it alone; together they do (a split costs a second CUDA context
    # and pipeline copies of the compute buffers), GPU 1 having more room than GPU 0.
    rooms = [GpuRoom(0, int(need * 0.7)), GpuRoom(1, int(need * 0.95))]
    p = place(LLAMA, 2048, 1, "f16", rooms)
    assert p.mode == "gpu" and p.devices == (0, 1) and sum(p.counts) == 17
    assert p.counts[1] > p.counts[0]
    for pool, b in p.pool_bytes.items():
        assert b <= {"gpu0": rooms[0].room, "gpu1": rooms[1].room}[pool]
    offload = p.offload()
    assert offload.devices == (0, 1)
    assert offload.tensor_split == tuple(float(c) for c in p.counts)


def test_partial_offload_when_vram_is_short() -> None:
    room = full_bytes() // 2
    p = place(LLAMA, 2048, 1, "f16", [GpuRoom(0, room)])
    assert p.mode == "partial" and 1 <= p.n_gpu_layers < LLAMA.units
    assert p.bytes is not None and p.bytes.gpu[0] <= room
    # The most that fit: one more unit would not.
    more = split_bytes(LLAMA, 2048, 1, "f16", [p.n_gpu_layers + 1])
    assert more.gpu[0] > room
    cpu, gpu = p.split.split()[0].split("/")
    assert p.split.endswith("CPU/GPU") and int(cpu.rstrip("%")) + int(gpu.rstrip("%")) == 100
    # What does not fit stays in host RAM: weights file-backed, KV anonymous.
    assert p.bytes.host_file > LLAMA.input_bytes


def test_longer_context_means_fewer_layers_on_the_gpu() -> None:
    room = full_bytes() // 2
    short = place(LLAMA, 2048, 8, "f16", [GpuRoom(0, room)])
    long = place(LLAMA, 8192, 8, "f16", [GpuRoom(0, room)])
    assert long.n_gpu_layers < short.n_gpu_layers  # each layer's KV costs 4x more


def test_cpu_when_no_gpu_has_room_for_a_layer() -> None:
    p = place(LLAMA, 2048, 1, "f16", [GpuRoom(0, 200 * MiB)])
    assert p.mode == "cpu" and p.bytes is None and p.split == "100% CPU"
    assert p.offload() == Offload(0, devices=())
    assert place(LLAMA, 2048, 1, "f16", []).mode == "cpu"


def test_gpu_layers_overrides() -> None:
    rooms = [GpuRoom(0, 40 * GiB)]
    assert place(LLAMA, 2048, 1, "f16", rooms, gpu_layers=0).mode == "cpu"
    five = place(LLAMA, 2048, 1, "f16", rooms, gpu_layers=5)
    assert five.mode == "partial" and five.n_gpu_layers == 5
    # -1 = everything, even where it cannot fit: the policy then refuses (507), not an OOM.
    forced = place(LLAMA, 2048, 1, "f16", [GpuRoom(0, 1 * GiB)], gpu_layers=-1)
    assert forced.mode == "gpu" and forced.pool_bytes["gpu0"] > 1 * GiB


def test_context_sized_so_the_kv_fits_the_gpu() -> None:
    # Room for the model and ~4,000 tokens of KV on each of 8 slots.
    room = full_bytes(4096, 8) + 100 * MiB
    ctx = gpu_context(LLAMA, 8, "f16", [GpuRoom(0, room)], cap=32768, min_ctx=512)
    assert ctx % 256 == 0 and 4096 <= ctx < 4608
    assert split_bytes(LLAMA, ctx, 8, "f16", [17]).gpu[0] <= room
    assert split_bytes(LLAMA, ctx + 256, 8, "f16", [17]).gpu[0] > room
    assert gpu_context(LLAMA, 8, "f16", [GpuRoom(0, 1 * GiB)], 32768, 512) == 0


@pytest.mark.parametrize("layers, mode", [(None, "gpu"), (-1, "gpu"), (10, "partial"), (0, "cpu")])
def test_unified_memory_offloads_to_metal(layers: int | None, mode: str) -> None:
    p = unified(QWEN, layers)
    assert p.mode == mode
    if mode != "cpu":
        assert p.offload() == Offload(layers if layers and layers > 0 else 25)
        assert p.pool_bytes == {}


@pytest.mark.parametrize("row", recorded("h200x2_splits.json")["splits"], ids=lambda r: r["model"])
def test_recorded_unequal_gpus_get_the_split_that_was_measured(row: dict[str, Any]) -> None:
    # NVML as recorded on two H200s that other processes had filled unequally.
    gpus = tuple(
        GpuMemory(d["index"], d["name"], d["total"], d["free"], d["used"])
        for d in row["nvml"]["devices"]
    )
    snap = Snapshot("linux", 256 * GiB, 250 * GiB, 6 * GiB, 256 * GiB, 250 * GiB, gpus=gpus)
    pools = memory_pools(snap, 0, {}, BudgetConfig())
    rooms = [GpuRoom(p.device or 0, p.ceiling) for p in pools if p.kind == "gpu"]
    assert rooms[0].room < rooms[1].room  # unequal free memory
    layout = shape(row["model"])
    # Neither GPU holds the model alone; the split follows their room, as it did there.
    assert split_bytes(layout, row["ctx"], row["slots"], "f16", [layout.units]).gpu[0] > max(
        r.room for r in rooms
    )
    p = place(layout, row["ctx"], row["slots"], "f16", rooms)
    assert p.mode == "gpu" and p.devices == (0, 1)
    assert list(p.counts) == row["layers_per_device"]
