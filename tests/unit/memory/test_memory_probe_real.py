"""The Linux probe on the real machine: /proc/meminfo, and real memory cgroups (as root)."""

from __future__ import annotations

import contextlib
import json
import os
import re
import shutil
import subprocess
import sys
import time
import uuid
from collections.abc import Iterator
from pathlib import Path

import pytest

from elbowroom.memory.probe import gpu_memory, linux_probe
from elbowroom.memory.process import measure_pid
from elbowroom.units import MiB

pytestmark = pytest.mark.skipif(not sys.platform.startswith("linux"), reason="Linux probe")

CGROUP_ROOT = Path("/sys/fs/cgroup")
LIMIT = 512 * MiB
# MemAvailable moves whenever any process on the machine allocates. Reading it before and
# after the probe brackets the probe's own read when it moves one way; the slack covers
# an allocation that is made and freed again within the microseconds between the reads.
SLACK = 64 * MiB


def _meminfo_kb(field: str) -> int:
    text = Path("/proc/meminfo").read_text()
    match = re.search(rf"^{field}:\s+(\d+) kB$", text, re.M)
    assert match, field
    return int(match.group(1)) * 1024


def test_linux_probe_agrees_with_proc_meminfo() -> None:
    before = _meminfo_kb("MemAvailable")
    snap = linux_probe(nvml=False)
    after = _meminfo_kb("MemAvailable")
    assert snap.host_total == _meminfo_kb("MemTotal")
    assert min(before, after) - SLACK <= snap.host_available <= max(before, after) + SLACK
    assert snap.swap_total == _meminfo_kb("SwapTotal")
    assert snap.total <= snap.host_total
    assert 0 <= snap.available <= snap.total
    if snap.cgroup_limit is None:
        assert (snap.total, snap.available) == (snap.host_total, snap.host_available)


# ---------------------------------------------------------------- real cgroups


def _v1_parent() -> Path:
    """Our own v1 memory cgroup (new cgroups go beside us, under our limits)."""
    mount = CGROUP_ROOT / "memory"
    for line in Path("/proc/self/cgroup").read_text().splitlines():
        _, controllers, path = line.split(":", 2)
        if "memory" in controllers.split(","):
            own = mount / path.lstrip("/")
            return own if own.is_dir() else mount
    return mount


def _v2_parent() -> Path:
    root = CGROUP_ROOT if (CGROUP_ROOT / "cgroup.controllers").exists() else CGROUP_ROOT / "unified"
    return root


def _write(path: Path, text: str) -> None:
    try:
        path.write_text(text)
    except OSError as exc:
        pytest.skip(f"cannot write {path}: {exc}")


def _rmdir(path: Path) -> None:
    # An exited member may still be uncharging for a moment: EBUSY until it is done.
    deadline = time.monotonic() + 10
    while True:
        try:
            path.rmdir()
            return
        except FileNotFoundError:
            return
        except OSError:
            if time.monotonic() > deadline:
                raise
            time.sleep(0.05)  # polling a kernel state with a deadline, not synchronising


@contextlib.contextmanager
def limited_cgroup(version: int, *, nested: bool) -> Iterator[Path]:
    """A new memory cgroup limited to LIMIT; with ``nested`` the process goes into an
    unlimited child of it, so the probe must walk up to find the limit. Removed after."""
    if os.geteuid() != 0:
        pytest.skip("creating memory cgroups needs root")
    parent = _v1_parent() if version == 1 else _v2_parent()
    if version == 1 and not (parent / "memory.limit_in_bytes").exists():
        pytest.skip("no cgroup v1 memory hierarchy")
    if version == 2:
        controllers = parent / "cgroup.subtree_control"
        if not controllers.exists() or "memory" not in controllers.read_text().split():
            pytest.skip(f"the v2 memory controller is not enabled under {parent}")
    top = parent / f"elbowroom-test-{os.getpid()}-{uuid.uuid4().hex[:8]}"
    try:
        top.mkdir()
    except OSError as exc:
        pytest.skip(f"cannot create {top}: {exc}")
    made = [top]
    try:
        _write(top / ("memory.limit_in_bytes" if version == 1 else "memory.max"), str(LIMIT))
        leaf = top
        if nested:
            if version == 2:
                _write(top / "cgroup.subtree_control", "+memory")
            leaf = top / "leaf"
            leaf.mkdir()
            made.append(leaf)
        yield leaf
    finally:
        for path in reversed(made):
            _rmdir(path)


# The child joins the cgroup before importing anything, then prints its own snapshot.
CHILD = """
import json, os, sys
from pathlib import Path
Path(sys.argv[1], "cgroup.procs").write_text(str(os.getpid()))
from elbowroom.memory.probe import linux_probe, snapshot_to_dict
print(json.dumps(snapshot_to_dict(linux_probe(nvml=False))))
"""


@pytest.mark.cgroup
@pytest.mark.parametrize("version", [1, 2], ids=["v1", "v2"])
@pytest.mark.parametrize("nested", [False, True], ids=["direct", "nested"])
def test_child_in_a_512mib_cgroup_sees_512mib(version: int, nested: bool) -> None:
    with limited_cgroup(version, nested=nested) as cg:
        done = subprocess.run(
            [sys.executable, "-c", CHILD, str(cg)],
            capture_output=True,
            text=True,
            timeout=120,
        )
    assert done.returncode == 0, done.stderr
    snap = json.loads(done.stdout)
    assert snap["cgroup_version"] == version
    assert snap["cgroup_limit"] == LIMIT
    assert snap["total"] == LIMIT
    assert 0 < snap["available"] < LIMIT  # the child's own interpreter is charged
    assert 0 < snap["cgroup_usage"] < LIMIT
    assert snap["host_total"] > LIMIT


# ---------------------------------------------------------------- NVIDIA GPUs (NVML)

# A CUDA context and a 256 MiB allocation through the driver API: no CUDA toolkit needed.
CUDA_CHILD = """
import ctypes, sys
cuda = ctypes.CDLL("libcuda.so.1")
dev, ctx, ptr = ctypes.c_int(), ctypes.c_void_p(), ctypes.c_uint64()
assert cuda.cuInit(0) == 0
assert cuda.cuDeviceGet(ctypes.byref(dev), 0) == 0
assert cuda.cuCtxCreate_v2(ctypes.byref(ctx), 0, dev) == 0
assert cuda.cuMemAlloc_v2(ctypes.byref(ptr), ctypes.c_size_t(256 << 20)) == 0
print("ready", flush=True)
sys.stdin.read()
"""


def _nvidia_smi() -> str:
    smi = shutil.which("nvidia-smi")
    if smi is None:
        pytest.skip("no NVIDIA driver")
    return smi


def test_gpu_memory_agrees_with_nvidia_smi() -> None:
    out = subprocess.run(
        [_nvidia_smi(), "--query-gpu=index,memory.total", "--format=csv,noheader,nounits"],
        capture_output=True,
        text=True,
        check=True,
    ).stdout
    expected = [tuple(int(x) for x in line.split(",")) for line in out.strip().splitlines()]
    gpus = gpu_memory()
    assert [(g.index, g.total // MiB) for g in gpus] == expected
    assert all(g.used + g.free <= g.total and g.name for g in gpus)


def test_gpu_bytes_of_a_cuda_child_are_measured() -> None:
    _nvidia_smi()
    proc = subprocess.Popen(
        [sys.executable, "-c", CUDA_CHILD], stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True
    )
    try:
        assert proc.stdout is not None and proc.stdout.readline().strip() == "ready"
        mem = measure_pid(proc.pid)
    finally:
        assert proc.stdin is not None
        proc.stdin.close()
        proc.wait(timeout=60)
    assert mem.gpu >= 256 * MiB
