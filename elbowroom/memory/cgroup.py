"""Memory cgroups (v1 and v2): find ours, walk up to the mount root, keep the tightest.

Used by the Linux probe. Reads files only; ``cgroup_root`` and the membership text are
parameters, so tests point them at recorded fixtures.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path, PurePosixPath

__all__ = ["CgroupReading", "oom_kill_count", "read_cgroup", "read_text"]

# cgroup v1 writes "no limit" as PAGE_COUNTER_MAX × page size (9223372036854771712 on
# x86-64); anything this large is not a real limit on any machine that exists.
_UNLIMITED = 1 << 60


def read_text(path: Path) -> str | None:
    """A small kernel file's text, or None when it is missing or unreadable."""
    try:
        return path.read_text()
    except (OSError, UnicodeDecodeError):
        return None


def _read_int(path: Path) -> int | None:
    text = read_text(path)
    if text is None:
        return None
    text = text.strip()
    if text == "max":
        return None
    try:
        value = int(text)
    except ValueError:
        return None
    return None if value >= _UNLIMITED else value


def _stat_value(text: str | None, *keys: str) -> int:
    """The first of ``keys`` found in a memory.stat file (bytes), else 0."""
    if not text:
        return 0
    stat = dict(line.split(None, 1) for line in text.splitlines() if " " in line)
    for key in keys:
        if key in stat:
            try:
                return int(stat[key])
            except ValueError:
                return 0
    return 0


@dataclass(frozen=True, slots=True)
class CgroupReading:
    """The memory cgroup boundary that binds this process, after walking up the hierarchy.

    ``limit`` is the smallest limit on the way up (None: unlimited); ``usage`` and
    ``headroom`` belong to the level that set it (the leaf when unlimited).
    """

    version: int
    path: Path
    limit: int | None
    usage: int | None
    headroom: int | None
    pressure_file: Path | None = None  # v2 memory.pressure of the binding level


def _membership(text: str) -> dict[int, str]:
    """``/proc/self/cgroup`` -> {1: v1 memory path, 2: v2 path} for what is present."""
    found: dict[int, str] = {}
    for line in text.splitlines():
        parts = line.strip().split(":", 2)
        if len(parts) != 3:
            continue
        hid, controllers, path = parts
        if hid == "0" and controllers == "":
            found[2] = path
        elif "memory" in controllers.split(","):
            found[1] = path
    return found


def _locate(mount: Path, cg_path: str) -> Path | None:
    """The directory of ``cg_path`` under ``mount``.

    In a container the path in /proc/self/cgroup is often the host's (``/docker/<id>``)
    while the mount shows the container's own cgroup as its root, so drop leading
    components until a directory exists; the mount root itself is the last resort.
    """
    if not mount.is_dir():
        return None
    parts = PurePosixPath(cg_path).parts[1:]
    for start in range(len(parts) + 1):
        candidate = mount.joinpath(*parts[start:])
        if candidate.is_dir():
            return candidate
    return mount


_FILES = {
    1: ("memory.limit_in_bytes", "memory.usage_in_bytes"),
    2: ("memory.max", "memory.current"),
}

# memory.stat keys per version: (inactive file, active file, mapped file, dirty, writeback).
_STAT_KEYS: dict[int, tuple[tuple[str, ...], ...]] = {
    1: (
        ("total_inactive_file", "inactive_file"),
        ("total_active_file", "active_file"),
        ("total_mapped_file", "mapped_file"),
        ("total_dirty", "dirty"),
        ("total_writeback", "writeback"),
    ),
    2: (
        ("inactive_file",),
        ("active_file",),
        ("file_mapped",),
        ("file_dirty",),
        ("file_writeback",),
    ),
}


def reclaimable(version: int, stat: str | None) -> int:
    """Page cache the kernel reclaims before this cgroup OOMs: every file page that is
    clean and mapped by no process, on either LRU list.

    Which list a page is on says nothing here, and counting by list made the headroom move
    while nothing was allocated or freed (issue 24's arena). When a process that mapped a
    model exits (an unload), the kernel moves the pages it had read to the *active* list —
    measured here, 324 MiB of a 461 MiB GGUF — so ``limit − (usage − inactive)`` *fell* by
    that much because a model was unloaded (every swap waited the whole settle timeout).
    And a freshly loaded model's mapped weights sit on the *inactive* list (428 of its
    461 MiB) until serving touches them and the kernel activates them: counted while
    inactive, they left the headroom as the model ran, which the pressure guard read as a
    neighbour growing 0.24–2.5 GiB/s and paused the next load for up to 0.9 s. Mapped pages
    (the loaded models' weights, counted in their runners' bytes) and dirty or in-flight
    ones are not counted."""
    inactive, active, mapped, dirty, writeback = (
        _stat_value(stat, *keys) for keys in _STAT_KEYS[version]
    )
    return max(active + inactive - mapped - dirty - writeback, 0)


def _walk(version: int, mount: Path, leaf: Path) -> CgroupReading | None:
    limit_file, usage_file = _FILES[version]
    tightest: CgroupReading | None = None  # the level with the smallest limit
    headroom: int | None = None  # the least headroom of any limited level
    leaf_usage: int | None = None
    level = leaf
    while True:
        usage = _read_int(level / usage_file)
        if level == leaf:
            leaf_usage = usage
        limit = _read_int(level / limit_file)
        if version == 2:
            # memory.high throttles and reclaims hard: past it a process crawls, so for
            # planning it is as much a ceiling as memory.max.
            high = _read_int(level / "memory.high")
            if high is not None and (limit is None or high < limit):
                limit = high
        if limit is not None:
            spare = reclaimable(version, read_text(level / "memory.stat"))
            room = max(0, limit - max(0, (usage or 0) - spare))
            headroom = room if headroom is None else min(headroom, room)
            if tightest is None or tightest.limit is None or limit < tightest.limit:
                pressure = level / "memory.pressure" if version == 2 else None
                tightest = CgroupReading(version, level, limit, usage, room, pressure)
        if level == mount or mount not in level.parents:
            break
        level = level.parent
    if tightest is not None:
        # An ancestor whose siblings filled it can leave less room than our own limit.
        return CgroupReading(
            version, tightest.path, tightest.limit, tightest.usage, headroom, tightest.pressure_file
        )
    if leaf_usage is None:
        return None  # no memory controller here
    return CgroupReading(version, leaf, None, leaf_usage, None)


def read_cgroup(membership: str, cgroup_root: Path) -> CgroupReading | None:
    """The binding memory cgroup from ``/proc/<pid>/cgroup`` text and the cgroup mount root.

    v1's memory hierarchy is ``<root>/memory``; v2 is ``<root>`` itself on a pure-v2 system
    or ``<root>/unified`` on a hybrid one. Where both hold a memory controller, the
    one with the least headroom wins.
    """
    paths = _membership(membership)
    readings: list[CgroupReading] = []
    if 1 in paths:
        mount = cgroup_root / "memory"
        leaf = _locate(mount, paths[1])
        if leaf is not None and (r := _walk(1, mount, leaf)) is not None:
            readings.append(r)
    if 2 in paths:
        is_v2_root = (cgroup_root / "cgroup.controllers").exists()
        mount = cgroup_root if is_v2_root else cgroup_root / "unified"
        leaf = _locate(mount, paths[2])
        if leaf is not None and (r := _walk(2, mount, leaf)) is not None:
            readings.append(r)
    if not readings:
        return None
    limited = [r for r in readings if r.limit is not None]
    if limited:
        return min(limited, key=lambda r: (r.limit or 0, r.headroom or 0))
    return readings[0]


def oom_kill_count(
    membership: Path = Path("/proc/self/cgroup"), cgroup_root: Path = Path("/sys/fs/cgroup")
) -> int | None:
    """How many processes the kernel's OOM killer took in our memory cgroup (the leaf:
    where our runners live): v1 ``memory.oom_control``'s ``oom_kill``, v2
    ``memory.events``' ``oom_kill``; None where neither can be read."""
    try:
        paths = _membership(membership.read_text())
    except OSError:
        return None
    places: list[tuple[Path, str, str]] = []
    if 1 in paths:
        places.append((cgroup_root / "memory", paths[1], "memory.oom_control"))
    if 2 in paths:
        v2 = (
            cgroup_root
            if (cgroup_root / "cgroup.controllers").exists()
            else cgroup_root / "unified"
        )
        places.append((v2, paths[2], "memory.events"))
    for mount, path, name in places:
        leaf = _locate(mount, path)
        text = read_text(leaf / name) if leaf is not None else None
        if text is None:
            continue
        value = _stat_value(text, "oom_kill")
        if "oom_kill" in text:
            return value
    return None
