"""scripts/gpu_engine.sh (ELBOWROOM_GPU=cuda in setup.sh): clear errors where it cannot work.

The CUDA paths themselves (wheel index, source build) ran on the device machine; these
check the decisions that need no GPU and no network.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).parents[2]
SCRIPT = ROOT / "scripts" / "gpu_engine.sh"


def run(kind: str, tmp_path: Path, *, smi: str | None) -> subprocess.CompletedProcess[str]:
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir(parents=True)
    if smi is not None:  # a fake driver that reports this CUDA version
        fake = bin_dir / "nvidia-smi"
        fake.write_text(
            f"#!/bin/sh\necho '| NVIDIA-SMI 470.1  Driver Version: 470.1  CUDA Version: {smi} |'\n"
        )
        fake.chmod(0o755)
    # This machine's own driver and CUDA toolkit, if any, are left off the PATH.
    hidden = ("nvidia-smi", "nvcc")
    keep = [
        p
        for p in os.environ["PATH"].split(os.pathsep)
        if not any((Path(p) / h).exists() for h in hidden)
    ]
    path = os.pathsep.join([str(bin_dir), *keep])
    env = {**os.environ, "PATH": path, "ELBOWROOM_VENV": str(Path(sys.executable).parents[1])}
    return subprocess.run(
        ["bash", str(SCRIPT), kind], capture_output=True, text=True, env=env, timeout=60
    )


def test_no_driver_is_a_clear_error(tmp_path: Path) -> None:
    done = run("cuda", tmp_path, smi=None)
    assert done.returncode == 1
    assert "needs an NVIDIA driver (nvidia-smi not found)" in done.stderr


@pytest.mark.skipif(
    shutil.which("nvcc") in ("/bin/nvcc", "/usr/bin/nvcc"), reason="nvcc sits beside bash"
)
def test_old_driver_without_nvcc_names_the_toolkit(tmp_path: Path) -> None:
    # CUDA 11.8: no prebuilt wheel fits (12.8 and 13.2), so it would build: needs nvcc.
    done = run("cuda", tmp_path, smi="11.8")
    assert done.returncode == 1
    assert "nvcc" in done.stderr and "CUDA toolkit" in done.stderr


def test_unknown_kind_and_metal_off_macos(tmp_path: Path) -> None:
    assert "must be cuda or metal" in run("rocm", tmp_path / "a", smi=None).stderr
    if sys.platform != "darwin":
        assert "macOS" in run("metal", tmp_path / "b", smi=None).stderr
