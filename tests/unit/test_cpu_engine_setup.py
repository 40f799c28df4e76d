"""scripts/cpu_engine.sh (ELBOWROOM_ENGINE_BUILD=source in setup.sh): a cached build is
installed without compiling, and a machine without a compiler gets a clear error. The
build itself (14 minutes on 2 cores) was run by hand: docs/runners.md."""

from __future__ import annotations

import os
import re
import subprocess
import sys
import venv
import zipfile
from pathlib import Path

ROOT = Path(__file__).parents[2]
SCRIPT = ROOT / "scripts" / "cpu_engine.sh"
VERSION = re.search(r'"xllamacpp==([^"]+)"', (ROOT / "pyproject.toml").read_text())


def fake_wheel(folder: Path, version: str) -> Path:
    """A wheel named like the engine's whose module says it is the cached build."""
    folder.mkdir(parents=True)
    wheel = folder / f"xllamacpp-{version}-py3-none-any.whl"
    info = f"xllamacpp-{version}.dist-info"
    with zipfile.ZipFile(wheel, "w") as z:
        z.writestr("xllamacpp/__init__.py", "BUILT_HERE = True\n")
        z.writestr(
            f"{info}/METADATA", f"Metadata-Version: 2.1\nName: xllamacpp\nVersion: {version}\n"
        )
        z.writestr(
            f"{info}/WHEEL", "Wheel-Version: 1.0\nRoot-Is-Purelib: true\nTag: py3-none-any\n"
        )
        z.writestr(f"{info}/RECORD", "")
    return wheel


def cache_name(version: str) -> str:
    """The cached wheel's folder: the version, the machine and the script's build options."""
    flags = subprocess.run(
        ["bash", "-c", f'source <(sed -n "/^cpu_flags()/,/^}}/p" {SCRIPT}); cpu_flags'],
        capture_output=True,
        text=True,
        check=True,
    ).stdout.strip()
    digest = subprocess.run(
        ["cksum"], input=flags, capture_output=True, text=True, check=True
    ).stdout.split()[0]
    return f"xllamacpp-{version}-cpu-{os.uname().machine}-{digest}"


def run(tmp_path: Path, venv_dir: Path, path: str) -> subprocess.CompletedProcess[str]:
    env = {**os.environ, "PATH": path, "ELBOWROOM_VENV": str(venv_dir)}
    env["ELBOWROOM_CACHE"] = str(tmp_path / "cache")
    return subprocess.run(
        ["bash", str(SCRIPT)], capture_output=True, text=True, env=env, timeout=120
    )


def test_a_cached_build_is_installed_without_compiling(tmp_path: Path) -> None:
    assert VERSION is not None
    venv_dir = tmp_path / "venv"
    # The base interpreter's pip where it has one (seconds), else the venv's own (~10 s).
    venv.create(venv_dir, with_pip=False, system_site_packages=True)
    probe = subprocess.run([venv_dir / "bin" / "python", "-m", "pip", "--version"], check=False)
    if probe.returncode != 0:
        venv.create(venv_dir, with_pip=True, clear=True)
    fake_wheel(tmp_path / "cache" / "wheels" / cache_name(VERSION[1]), VERSION[1])
    done = run(tmp_path, venv_dir, os.environ["PATH"])
    assert done.returncode == 0, done.stderr
    py = venv_dir / "bin" / "python"
    out = subprocess.run(
        [py, "-c", "import xllamacpp; print(xllamacpp.BUILT_HERE)"],
        capture_output=True,
        text=True,
        check=True,
    )
    assert out.stdout.strip() == "True"


def test_no_compiler_is_a_clear_error(tmp_path: Path) -> None:
    venv_dir = Path(sys.executable).parents[1]  # never reached: the check comes first
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    tools = ("bash", "dirname", "sed", "uname", "ls", "grep", "head", "cat", "mktemp", "rm")
    tools += ("cut", "cksum")
    for tool in tools:
        found = next(
            (
                Path(p) / tool
                for p in os.environ["PATH"].split(os.pathsep)
                if (Path(p) / tool).exists()
            ),
            None,
        )
        if found is not None:
            (bin_dir / tool).symlink_to(found)
    done = run(tmp_path, venv_dir, str(bin_dir))
    assert done.returncode == 1
    assert "needs a C++ compiler and cmake" in done.stderr
