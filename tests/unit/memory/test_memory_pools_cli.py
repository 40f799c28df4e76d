"""`elbowroom memory` shows every pool: host RAM here, GPUs from a recorded NVML reading."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from elbowroom.cli import main
from elbowroom.cli.memory import render
from elbowroom.memory.budget import BudgetConfig
from elbowroom.memory.monitor import Monitor
from elbowroom.memory.pools import memory_pools
from elbowroom.memory.types import GpuMemory, Snapshot
from elbowroom.units import GiB

FIX = Path(__file__).parents[2] / "fixtures" / "gpu"


def test_json_lists_the_pools(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["memory", "--json", "--override-memory", "2GiB"]) == 0
    data = json.loads(capsys.readouterr().out)
    host = data["pools"][0]
    assert host["name"] == "host" and host["total"] == 2 * GiB
    assert host["limit"]["value"] == data["limit"]["value"]  # the same budget


def test_table_shows_each_gpu_pool_and_its_candidates() -> None:
    dev = json.loads((FIX / "h200_nvml_loaded.json").read_text())["devices"][0]
    gpu = GpuMemory(0, dev["name"], dev["total"], dev["free"], dev["used"])
    snap = Snapshot("linux", 64 * GiB, 60 * GiB, 4 * GiB, 64 * GiB, 60 * GiB, gpus=(gpu,))
    cfg = BudgetConfig()
    sample = Monitor(lambda: snap, own_usage=lambda: 0, cfg=cfg, history_seconds=0).sample_now()
    pools = memory_pools(snap, 0, {}, cfg, gpu_override=24 * GiB)
    out = render(sample, pools)
    row = next(line for line in out.splitlines() if line.startswith("gpu0 "))
    assert "NVIDIA H200" in row and "24.0 GiB" in row and "(override)" in row
    assert "gpu0 limit candidates" in out
    assert any(line.startswith("*") and "override" in line for line in out.splitlines())
