"""Memory pools on recorded NVML readings and recorded macOS sysctl output."""

from __future__ import annotations

import json
from pathlib import Path

from elbowroom.memory.budget import BudgetConfig
from elbowroom.memory.pools import (
    gpu_pool,
    gpu_pressure,
    gpu_reserve,
    host_pool,
    memory_pools,
    pool_to_dict,
)
from elbowroom.memory.probe import macos_probe
from elbowroom.memory.types import GpuMemory, Pressure, Snapshot
from elbowroom.units import GiB, MiB

FIX = Path(__file__).parents[2] / "fixtures"
CFG = BudgetConfig()


def recorded_gpus(name: str) -> tuple[GpuMemory, ...]:
    data = json.loads((FIX / "gpu" / name).read_text())
    return tuple(
        GpuMemory(d["index"], d["name"], d["total"], d["free"], d["used"]) for d in data["devices"]
    )


def host(total: int = 64 * GiB, available: int = 48 * GiB, **kw: object) -> Snapshot:
    return Snapshot("linux", total, available, total - available, total, available, **kw)  # type: ignore[arg-type]


def test_h200_with_our_runner_loaded() -> None:
    # Recorded: one H200 while a 1.1 B model's runner (NVML: 3.01 GB) was loaded.
    (gpu,) = recorded_gpus("h200_nvml_loaded.json")
    pool = gpu_pool(gpu, ours=3_011_510_272, cfg=CFG)
    assert pool.name == "gpu0" and pool.kind == "gpu" and pool.label == "NVIDIA H200"
    assert pool.others == gpu.used - 3_011_510_272  # the driver's own ~0.6 GiB
    assert pool.reserve == 1 * GiB
    # total − reserve (139.4 GiB) is below free + ours − margin (139.7 GiB).
    assert pool.limit.winner == "reserve" and pool.limit.value == gpu.total - GiB
    assert pool.ceiling == int(pool.limit.value * 0.85)
    assert pool_to_dict(pool)["limit"]["winner"] == "reserve"


def test_override_makes_every_gpu_look_small() -> None:
    (gpu,) = recorded_gpus("h200_nvml_loaded.json")
    pool = gpu_pool(gpu, ours=3 * GiB, cfg=CFG, override=10 * GiB)
    assert pool.total == 10 * GiB
    assert pool.free == 7 * GiB  # override − ours, far under the card's real free
    assert pool.reserve == 512 * MiB  # the tier of a 10 GiB card
    assert pool.limit.winner == "override" and pool.limit.value == 10 * GiB - 512 * MiB


def test_two_gpus_of_unequal_free_memory() -> None:
    # Recorded on two H200s while other processes held ~134 and ~132 GiB of them.
    data = json.loads((FIX / "gpu" / "h200x2_splits.json").read_text())
    nvml = data["splits"][0]["nvml"]["devices"]
    gpus = tuple(GpuMemory(d["index"], d["name"], d["total"], d["free"], d["used"]) for d in nvml)
    pools = memory_pools(host(gpus=gpus), 0, {}, CFG)
    assert [p.name for p in pools] == ["host", "gpu0", "gpu1"]
    gpu0, gpu1 = pools[1], pools[2]
    # Another process holds most of each GPU: the limit is what is free, not total − reserve.
    assert gpu0.limit.winner == gpu1.limit.winner == "available"
    assert gpu0.limit.value == gpus[0].free - CFG.safety_margin
    assert gpu0.others == gpus[0].used and gpu0.ours == 0
    assert gpu0.ceiling < gpu1.ceiling


def test_our_bytes_are_given_back_in_the_available_candidate() -> None:
    data = json.loads((FIX / "gpu" / "h200x2_splits.json").read_text())
    nvml = data["splits"][0]["nvml"]["devices"]
    gpus = tuple(GpuMemory(d["index"], d["name"], d["total"], d["free"], d["used"]) for d in nvml)
    mine = memory_pools(host(gpus=gpus), 0, {0: 40 * GiB}, CFG)[1]
    theirs = memory_pools(host(gpus=gpus), 0, {}, CFG)[1]
    assert mine.others == gpus[0].used - 40 * GiB
    assert mine.limit.value == theirs.limit.value + 40 * GiB


def test_reserve_tiers() -> None:
    assert gpu_reserve(8 * GiB) == 512 * MiB
    assert gpu_reserve(24 * GiB) == 1 * GiB
    assert gpu_reserve(1 * GiB) == 256 * MiB  # never more than a quarter


def test_gpu_pressure_levels() -> None:
    gpu = GpuMemory(0, "g", 16 * GiB, 4 * GiB, 12 * GiB)
    calm = gpu_pool(gpu, ours=1 * GiB, cfg=CFG)
    assert gpu_pressure(calm, CFG)[0] == Pressure.NORMAL
    full = gpu_pool(GpuMemory(0, "g", 16 * GiB, 100 * MiB, 16 * GiB - 100 * MiB), 15 * GiB, CFG)
    level, why = gpu_pressure(full, CFG)
    assert level == Pressure.HARD and why is not None and "gpu0" in why


def recorded_mac(name: str, vm: str = "vm_stat_m2_16g.txt"):  # type: ignore[no-untyped-def]
    files = {"sysctl": name, "vm_stat": vm}
    return lambda cmd: (FIX / "memory" / "macos" / files[cmd[0]]).read_text()


def test_apple_silicon_is_one_unified_pool() -> None:
    snap = macos_probe(run=recorded_mac("sysctl_m2_16g.txt"))
    assert snap.gpu_wired_limit is None  # iogpu.wired_limit_mb: 0 (the default)
    pools = memory_pools(snap, 0, {}, CFG)
    assert len(pools) == 1 and pools[0].name == "unified" and pools[0].kind == "unified"
    names = [c.name for c in pools[0].limit.candidates]
    assert "gpu_working_set" in names and "wired_limit" not in names


def test_wired_limit_is_a_candidate_of_the_unified_pool() -> None:
    snap = macos_probe(run=recorded_mac("sysctl_m3max_64g_wired.txt"))
    assert snap.gpu_wired_limit == 40 * GiB
    pool = host_pool(snap, 0, CFG)
    cands = {c.name: c.value for c in pool.limit.candidates}
    # The Metal working set follows the wired limit (listed first); both are candidates.
    assert cands["wired_limit"] == cands["gpu_working_set"] == 40 * GiB
    # With memory free (this vm_stat is a busy 16 GB Mac's), the GPU's wiring limit bounds
    # the pool: below the fraction (54.4 GiB) and the reserve candidate (58 GiB).
    roomy = host(64 * GiB, 60 * GiB, gpu_working_set=48 * GiB, gpu_wired_limit=40 * GiB)
    assert host_pool(roomy, 0, CFG).limit.value == 40 * GiB
    assert host_pool(roomy, 0, CFG).limit.winner == "wired_limit"


def test_intel_mac_has_a_plain_host_pool() -> None:
    snap = macos_probe(run=recorded_mac("sysctl_intel_32g.txt", "vm_stat_intel_32g.txt"))
    (pool,) = memory_pools(snap, 0, {}, CFG)
    assert pool.name == "host" and snap.gpu_wired_limit is None
