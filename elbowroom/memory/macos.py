"""macOS memory facts from ``sysctl`` and ``vm_stat`` (text in, numbers out).

Used by ``probe.macos_probe``; the command runner is injected so tests feed recorded output.
"""

from __future__ import annotations

import re
import subprocess

from elbowroom.units import GiB, MiB

__all__ = [
    "SYSCTL_NAMES",
    "metal_working_set",
    "parse_swapusage",
    "parse_sysctl",
    "parse_vm_stat",
    "pressure_level_name",
    "run_command",
    "wired_limit",
]


def run_command(cmd: list[str]) -> str:
    # sysctl exits non-zero when one of several names is unknown but still prints the
    # others, so the exit status is not checked; missing values simply stay missing.
    done = subprocess.run(cmd, capture_output=True, text=True, timeout=10, check=False)
    return done.stdout


SYSCTL_NAMES = [
    "hw.memsize",
    "vm.swapusage",
    "kern.memorystatus_vm_pressure_level",
    "hw.optional.arm64",
    "iogpu.wired_limit_mb",
]
_PRESSURE_LEVELS = {1: "normal", 2: "warn", 4: "critical"}


def parse_sysctl(text: str) -> dict[str, str]:
    """``sysctl name...`` output (``name: value`` lines) as a dict."""
    out: dict[str, str] = {}
    for line in text.splitlines():
        name, sep, value = line.partition(":")
        if sep:
            out[name.strip()] = value.strip()
    return out


def parse_vm_stat(text: str) -> tuple[int, dict[str, int]]:
    """``vm_stat`` output -> (page size, {"Pages free": n, ...})."""
    match = re.search(r"page size of (\d+) bytes", text)
    page = int(match.group(1)) if match else 4096
    pages: dict[str, int] = {}
    for line in text.splitlines()[1:]:
        name, sep, value = line.rpartition(":")
        value = value.strip().rstrip(".")
        if sep and value.isdigit():
            pages[name.strip().strip('"')] = int(value)
    return page, pages


def parse_swapusage(text: str | None) -> tuple[int, int]:
    """``total = 2048.00M  used = 1126.25M  free = ...`` -> (total, used) bytes."""
    if not text:
        return 0, 0
    scale = {"K": 1024, "M": MiB, "G": GiB}
    found = {
        k: int(float(n) * scale[u])
        for k, n, u in re.findall(r"(total|used) = ([\d.]+)([KMG])", text)
    }
    return found.get("total", 0), found.get("used", 0)


def metal_working_set(total: int, sysctl: dict[str, str]) -> int | None:
    """Metal's recommendedMaxWorkingSetSize without linking Metal.

    ``iogpu.wired_limit_mb`` (when a user raised it) is what the GPU may wire; otherwise
    macOS recommends about 2/3 of RAM up to 36 GiB and 3/4 above (measured values of
    recommendedMaxWorkingSetSize on M-series Macs). Intel Macs have no unified GPU memory.
    """
    if sysctl.get("hw.optional.arm64") != "1":
        return None
    wired = sysctl.get("iogpu.wired_limit_mb", "0")
    if wired.isdigit() and int(wired) > 0:
        return min(total, int(wired) * MiB)
    return total * 2 // 3 if total <= 36 * GiB else total * 3 // 4


def wired_limit(sysctl: dict[str, str]) -> int | None:
    """``iogpu.wired_limit_mb`` in bytes when a user set it; None for 0 (macOS's default)
    or where the key does not exist (Intel Macs, macOS before 14)."""
    wired = sysctl.get("iogpu.wired_limit_mb", "0")
    return int(wired) * MiB if wired.isdigit() and int(wired) > 0 else None


def pressure_level_name(sysctl: dict[str, str]) -> str | None:
    """kern.memorystatus_vm_pressure_level (1/2/4) as normal | warn | critical."""
    level = sysctl.get("kern.memorystatus_vm_pressure_level", "")
    return _PRESSURE_LEVELS.get(int(level)) if level.isdigit() else None
