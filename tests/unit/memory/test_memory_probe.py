"""Probes against recorded /proc, cgroup, sysctl and vm_stat files (tests/fixtures/memory)."""

from __future__ import annotations

import json
from collections.abc import Callable
from pathlib import Path

import pytest

from elbowroom.config import Settings
from elbowroom.memory.probe import (
    default_probe,
    linux_probe,
    macos_probe,
    parse_meminfo,
    parse_psi,
    snapshot_to_dict,
    with_recent,
)
from elbowroom.memory.types import Psi, Snapshot
from elbowroom.units import GiB, KiB, MiB

FIX = Path(__file__).resolve().parents[2] / "fixtures" / "memory"
HOST16_TOTAL = 16 * GiB
HOST16_AVAILABLE = 9 * GiB


def probe(
    scenario: str, *, override: int | None = None, override_used: Callable[[], int] = lambda: 0
) -> Snapshot:
    base = FIX / scenario
    return linux_probe(
        proc=base / "proc",
        cgroup_root=base / "cgroup",
        nvml=False,
        override=override,
        override_used=override_used,
    )


def test_meminfo_parses_to_bytes() -> None:
    info = parse_meminfo((FIX / "v1_limited/proc/meminfo").read_text())
    assert info["MemTotal"] == 16777216 * KiB
    assert info["MemAvailable"] == HOST16_AVAILABLE
    assert info["SwapTotal"] == 2 * GiB
    assert info["HugePages_Total"] == 0  # a count, not kB


def test_psi_parses_some_and_full() -> None:
    text = (FIX / "v2_limited/cgroup/system.slice/elbowroom.service/memory.pressure").read_text()
    assert parse_psi(text) == Psi(12.5, 6.25, 3.0, 1.2, some_total_us=18734120)
    assert parse_psi("") is None
    assert parse_psi("some avg10=oops\n") is None


def test_the_recent_stall_rate_comes_from_two_readings_of_the_total() -> None:
    """``some_recent``: percent of the time between this process's readings that some task
    stalled, from the file's cumulative ``total`` (µs): none on a first reading or one too
    close to it; over at most the last PSI_RECENT_S seconds."""
    key = "test-psi-recent"

    def at(t: float, total_us: int) -> float | None:
        return with_recent(key, Psi(50.0, 0, 0, 0, some_total_us=total_us), t).some_recent

    assert at(100.0, 5_000_000) is None  # the first reading
    assert at(100.1, 5_050_000) is None  # 0.1 s: too short a span
    assert at(101.0, 5_500_000) == pytest.approx(50.0)  # 0.5 s stalled of 1.0 s
    assert at(102.0, 5_500_000) == pytest.approx(25.0)  # 0.5 s of 2.0 s
    assert at(104.0, 5_500_000) == pytest.approx(0.0)  # since the 102.0 reading: none
    assert at(105.0, 4_000_000) is None  # a counter that went back: no rate


def test_v1_limited_walks_up_and_takes_the_container_limit() -> None:
    snap = probe("v1_limited")
    assert snap.cgroup_version == 1
    assert snap.cgroup_limit == 2 * GiB
    assert snap.cgroup_usage == 1288490188
    assert snap.total == 2 * GiB
    # headroom = limit − (usage − reclaimable): reclaimable is every clean file page no
    # process maps (active 256 MiB + inactive 256 MiB − mapped 67584000 − dirty 135168),
    # more than the inactive list alone (memory/cgroup.py reclaimable)
    assert snap.available == 2 * GiB - (1288490188 - (2 * 268435456 - 67584000 - 135168))
    assert snap.used == snap.total - snap.available
    assert (snap.host_total, snap.host_available) == (HOST16_TOTAL, HOST16_AVAILABLE)
    assert (snap.swap_total, snap.swap_used) == (2 * GiB, 512 * MiB)
    assert snap.psi is not None
    assert (snap.psi.some_avg10, snap.psi.some_avg60) == (0.52, 0.31)
    assert (snap.psi.full_avg10, snap.psi.full_avg60, snap.psi.some_total_us) == (
        0.10,
        0.05,
        18734120,
    )


def test_v1_unlimited_huge_number_means_no_limit() -> None:
    snap = probe("v1_unlimited")
    assert snap.cgroup_version == 1
    assert snap.cgroup_limit is None
    assert snap.cgroup_usage == 3 * GiB
    assert (snap.total, snap.available) == (HOST16_TOTAL, HOST16_AVAILABLE)


def test_v1_in_a_container_falls_back_to_the_mount_root() -> None:
    # /proc/self/cgroup names the host's /docker/<id>, the mount shows only the container.
    snap = probe("v1_container")
    assert snap.cgroup_limit == 768 * MiB
    assert snap.total == 768 * MiB
    # every file page here is mapped (mapped_file 67584000 > the 64 MiB of page cache):
    # none is reclaimable, whichever LRU list holds it (memory/cgroup.py reclaimable)
    assert snap.available == 768 * MiB - 128 * MiB


def test_v2_limited_uses_memory_max_and_the_cgroup_psi() -> None:
    snap = probe("v2_limited")
    assert snap.cgroup_version == 2
    assert snap.cgroup_limit == 512 * MiB
    assert snap.total == 512 * MiB
    assert snap.available == 512 * MiB - (201326592 - 32 * MiB)
    # the service's own PSI (12.5), not the host's calm 0.52
    assert snap.psi is not None and snap.psi.some_avg10 == 12.5


def test_v2_nested_takes_smallest_limit_and_least_headroom() -> None:
    snap = probe("v2_nested")
    # the leaf's memory.high (3 GiB) is tighter than the parent's memory.max (4 GiB)...
    assert snap.cgroup_limit == 3 * GiB
    assert snap.total == 3 * GiB
    assert snap.cgroup_usage == 1 * GiB
    # ...but the parent, filled by siblings to 3.5 GiB, leaves only 512 MiB plus its clean
    # unmapped page cache (512 MiB active file − 48 MiB mapped), less than the leaf's room
    assert snap.available == 512 * MiB + (512 - 48) * MiB


def test_v2_unlimited_max_means_no_limit_and_host_psi() -> None:
    snap = probe("v2_unlimited")
    assert snap.cgroup_version == 2
    assert snap.cgroup_limit is None
    assert snap.cgroup_usage == 2 * GiB
    assert (snap.total, snap.available) == (HOST16_TOTAL, HOST16_AVAILABLE)
    assert snap.psi is not None and snap.psi.some_avg10 == 45.1


def test_v2_container_namespace_root() -> None:
    snap = probe("v2_container")
    assert (snap.cgroup_version, snap.cgroup_limit) == (2, 1 * GiB)
    # reclaimable: 100 MiB of file pages − 48 MiB mapped (more than 50 MiB inactive)
    assert snap.available == 1 * GiB - (300 * MiB - (100 * MiB - 48 * MiB))


def test_old_kernel_without_memavailable_psi_or_cgroup() -> None:
    snap = probe("old_kernel")
    # MemFree + Cached + Buffers − Shmem
    assert snap.host_available == (1048576 + 4718592 + 312456 - 262144) * KiB
    assert snap.psi is None
    assert snap.cgroup_version is None and snap.cgroup_limit is None


def test_self_cgroup_points_at_another_membership_file(tmp_path: Path) -> None:
    other = tmp_path / "cgroup"
    other.write_text("4:memory:/docker\n")
    base = FIX / "v1_limited"
    snap = linux_probe(
        proc=base / "proc", cgroup_root=base / "cgroup", self_cgroup=other, nvml=False
    )
    assert snap.cgroup_limit is None  # /docker itself is unlimited
    assert snap.cgroup_usage == 1610612736


# ---------------------------------------------------------------- the override


def test_override_caps_total_and_charges_our_tree() -> None:
    snap = probe("v1_unlimited", override=4 * GiB, override_used=lambda: 1 * GiB)
    assert snap.total == 4 * GiB
    assert snap.available == 3 * GiB  # 4 GiB − the 1 GiB our tree holds
    assert snap.override == 4 * GiB
    assert snap.host_total == HOST16_TOTAL


def test_override_never_raises_what_is_really_available() -> None:
    # larger than the cgroup limit: the cgroup still wins
    snap = probe("v1_limited", override=8 * GiB)
    assert snap.total == 2 * GiB
    assert snap.available == 2 * GiB - (1288490188 - (2 * 268435456 - 67584000 - 135168))
    # tighter than the cgroup: the override wins
    snap = probe("v1_limited", override=1 * GiB, override_used=lambda: 100 * MiB)
    assert (snap.total, snap.available) == (1 * GiB, 1 * GiB - 100 * MiB)


def test_override_smaller_than_our_tree_leaves_nothing() -> None:
    snap = probe("v1_unlimited", override=256 * MiB, override_used=lambda: 300 * MiB)
    assert snap.available == 0
    assert snap.used == snap.total == 256 * MiB


def test_default_probe_applies_settings_override() -> None:
    snap = default_probe(Settings(override_memory=3 * GiB))()
    assert snap.total == min(3 * GiB, snap.host_total)
    assert snap.override == 3 * GiB
    assert 0 <= snap.available <= snap.total


# ---------------------------------------------------------------- macOS


def recorded(sysctl: str, vm_stat: str) -> Callable[[list[str]], str]:
    def run(cmd: list[str]) -> str:
        name = {"sysctl": sysctl, "vm_stat": vm_stat}[cmd[0]]
        return (FIX / "macos" / name).read_text()

    return run


def test_macos_apple_silicon() -> None:
    snap = macos_probe(run=recorded("sysctl_m2_16g.txt", "vm_stat_m2_16g.txt"))
    assert snap.platform == "darwin"
    assert snap.total == 16 * GiB
    # free + speculative + inactive + purgeable, 16 KiB pages; compressed is not available
    assert snap.available == (30000 + 8000 + 360000 + 4000) * 16384
    assert snap.swap_total == 2048 * MiB
    assert snap.swap_used == int(1126.25 * MiB)
    assert snap.os_pressure == "normal"
    assert snap.gpu_working_set == 16 * GiB * 2 // 3  # no wired limit set: 2/3 up to 36 GiB
    assert snap.cgroup_version is None


def test_macos_wired_limit_sets_the_working_set() -> None:
    base = recorded("sysctl_m2_16g.txt", "vm_stat_m2_16g.txt")

    def run(cmd: list[str]) -> str:
        text = base(cmd)
        return text.replace("iogpu.wired_limit_mb: 0", "iogpu.wired_limit_mb: 14336")

    assert macos_probe(run=run).gpu_working_set == 14 * GiB


def test_macos_intel_under_pressure_with_override() -> None:
    run = recorded("sysctl_intel_32g.txt", "vm_stat_intel_32g.txt")
    snap = macos_probe(run=run, override=8 * GiB, override_used=lambda: 0)
    assert snap.host_total == 32 * GiB
    assert snap.host_available == (20480 + 4096 + 1900000 + 1024) * 4096
    assert snap.os_pressure == "critical"
    assert snap.gpu_working_set is None  # no unified memory
    # the 8 GiB override caps total; what is really available (7.3 GiB) stays lower
    assert (snap.total, snap.available) == (8 * GiB, snap.host_available)


def test_macos_available_capped_by_wired_and_compressor() -> None:
    vm = (
        "Mach Virtual Memory Statistics: (page size of 4096 bytes)\n"
        "Pages free: 100.\nPages inactive: 900.\nPages purgeable: 500.\n"
        "Pages wired down: 600.\nPages occupied by compressor: 200.\n"
    )
    run = {"sysctl": "hw.memsize: 6144000\n", "vm_stat": vm}
    snap = macos_probe(run=lambda cmd: run[cmd[0]])
    # 1500 pages would be free, but purgeable overlaps inactive: cap at 1500 − 800 pages
    assert snap.available == (1500 - 800) * 4096


def test_macos_without_memsize_is_an_error() -> None:
    with pytest.raises(OSError, match=r"hw\.memsize"):
        macos_probe(run=lambda cmd: "")


def test_snapshot_to_dict_is_json() -> None:
    snap = probe("v2_limited")
    data = json.loads(json.dumps(snapshot_to_dict(snap)))
    assert data["total"] == 512 * MiB
    assert data["psi"]["some_avg10"] == 12.5
    assert data["gpus"] == []
    assert data["cgroup_version"] == 2


def test_the_real_probe_measures_a_recent_stall_rate() -> None:
    """This machine's /proc/pressure/memory, read by the real probe until two readings are
    far enough apart for a rate."""
    import time

    if not Path("/proc/pressure/memory").exists():
        pytest.skip("this kernel has no PSI (/proc/pressure/memory)")
    deadline = time.monotonic() + 10
    while True:
        snap = linux_probe(nvml=False)
        assert snap.psi is not None
        if snap.psi.some_recent is not None:
            break
        assert time.monotonic() < deadline, "no recent PSI rate after 10 s of readings"
        time.sleep(0.05)
    assert 0.0 <= snap.psi.some_recent <= 100.0
