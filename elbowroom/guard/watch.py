"""Pressure events: the kernel wakes the guard, instead of the guard waiting for its next tick.

The monitor samples every ``monitor_interval`` (1 s): a neighbour that grows 100 MiB/s
crosses the soft and hard thresholds and reaches a small container's limit between two
samples, and the kernel kills before the guard has looked. This thread asks for a sample
(``Monitor.sample_now``) the moment the kernel says memory is getting short:

- cgroup v1: ``memory.usage_in_bytes`` thresholds through ``cgroup.event_control`` (an
  eventfd signalled when usage crosses each of ``THRESHOLDS`` × the cgroup's limit, both
  ways) and ``memory.pressure_level`` at ``medium`` (the cgroup is reclaiming hard);
- cgroup v1, re-armed as the budget moves: a usage threshold at the cgroup usage where the
  guard's picture turns soft and one where it turns hard (``arm``: the guard computes them
  after every sample it applies, ``guard.arm_points``), so the crossing that matters wakes
  the guard, not only the nearest fixed fraction;
- cgroup v2: the binding cgroup's ``memory.events`` (the kernel flags the file when a
  ``high``, ``max`` or ``oom`` event is counted; POLLPRI);
- PSI triggers (Linux ≥ 5.2): the shortest window the kernel takes from us, ``some 50 ms in
  500 ms`` (privileged), else ``some 100 ms in 1 s``, else ``some 150 ms in 2 s``
  (unprivileged triggers need a window that is a multiple of 2 s), written to the binding
  cgroup v2's ``memory.pressure``, else ``/proc/pressure/memory``; the kernel raises POLLPRI.

And while the last sample was soft or hard (or an event came within ``linger`` seconds)
it samples every ``fast_interval``: under pressure the next 0.9 s are what matter. A
sample probes the machine and measures every runner, which is cheap on an idle machine but
not on one that is short of memory (reclaim, a stalled /proc read), so the pace is held to
at most ``COST_SHARE`` of one core: the interval is at least ``1 / COST_SHARE`` times what
a sample took.

Sources that cannot be opened (no cgroup, no PSI, no permission, macOS) are left out with
a debug line; with none the watch only does the fast sampling. Linux only.
"""

from __future__ import annotations

import contextlib
import logging
import os
import select
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

from elbowroom.memory.cgroup import read_cgroup
from elbowroom.memory.types import Pressure

__all__ = ["THRESHOLDS", "PressureWatch", "Source", "open_sources"]

log = logging.getLogger("elbowroom.guard")

# Fractions of the cgroup limit whose crossing wakes a sample: where a small container
# goes from comfortable (80 %) to the OOM killer's edge; dense near the top, where each
# step is a fraction of a second at a fast neighbour's pace.
THRESHOLDS = (0.80, 0.85, 0.90, 0.93, 0.95, 0.97, 0.99)
# "some" stall of 10 % of the window: memory is short enough that tasks wait. The kernel's
# shortest window is 500 ms; unprivileged processes may only use multiples of 2 s (Linux
# ≥ 6.5), so each is tried in turn and the first the kernel takes is kept.
PSI_TRIGGERS = ("some 50000 500000", "some 100000 1000000", "some 150000 2000000")
PSI_TRIGGER = PSI_TRIGGERS[1]
PSI_TRIGGER_UNPRIVILEGED = PSI_TRIGGERS[2]
# A re-armed threshold that moved less than this keeps its old registration.
REARM_STEP = 4 * 1024 * 1024
# The most of one core the extra samples may take (memory is short; CPU may be too).
COST_SHARE = 0.1


@dataclass(slots=True)
class Source:
    """One open kernel notification: ``fd`` to poll (``events``), ``keep`` to close with it."""

    name: str
    fd: int
    events: int
    keep: tuple[int, ...] = ()
    reread: bool = False  # a kernfs file (v2 memory.events): read it again to re-arm

    def drain(self) -> None:
        if self.events & select.POLLIN:  # an eventfd: reset its counter
            with contextlib.suppress(OSError):
                os.read(self.fd, 8)
        elif self.reread:
            with contextlib.suppress(OSError):
                os.lseek(self.fd, 0, os.SEEK_SET)
                os.read(self.fd, 4096)

    def close(self) -> None:
        for fd in (self.fd, *self.keep):
            with contextlib.suppress(OSError):
                os.close(fd)


def _v1_event(cg: Path, file: str, arg: str, name: str) -> Source | None:
    efd = os.eventfd(0, os.EFD_CLOEXEC | os.EFD_NONBLOCK)
    target = -1
    try:
        target = os.open(cg / file, os.O_RDONLY | os.O_CLOEXEC)
        with open(cg / "cgroup.event_control", "w") as ctl:
            ctl.write(f"{efd} {target} {arg}")
    except OSError as exc:
        log.debug("pressure watch: %s not available: %s", name, exc)
        os.close(efd)
        if target >= 0:
            os.close(target)
        return None
    return Source(name, efd, select.POLLIN, (target,))


def _v2_events(cg: Path) -> Source | None:
    """The cgroup v2 ``memory.events`` file: kernfs flags it (POLLPRI) when a counter moves."""
    try:
        fd = os.open(cg / "memory.events", os.O_RDONLY | os.O_CLOEXEC)
    except OSError as exc:
        log.debug("pressure watch: %s/memory.events not available: %s", cg, exc)
        return None
    with contextlib.suppress(OSError):
        os.read(fd, 4096)  # a read arms the notification
    return Source(f"cgroup {cg.name or '/'} memory.events", fd, select.POLLPRI, reread=True)


def v1_cgroup(
    cgroup_root: Path = Path("/sys/fs/cgroup"), membership: Path = Path("/proc/self/cgroup")
) -> Path | None:
    """The binding cgroup v1 memory cgroup's directory (None: no limited v1 cgroup)."""
    try:
        reading = read_cgroup(membership.read_text(), cgroup_root)
    except OSError:
        return None
    if reading is None or reading.version != 1 or reading.limit is None:
        return None
    return reading.path


def arm_threshold(cg: Path, at: int, name: str) -> Source | None:
    """One cgroup v1 usage threshold at ``at`` bytes (fires on crossing, both ways)."""
    return _v1_event(cg, "memory.usage_in_bytes", str(max(1, at)), name)


def _psi(path: Path) -> Source | None:
    for trigger in PSI_TRIGGERS:
        try:
            fd = os.open(path, os.O_RDWR | os.O_NONBLOCK | os.O_CLOEXEC)
        except OSError as exc:
            log.debug("pressure watch: %s not available: %s", path, exc)
            return None
        try:
            os.write(fd, trigger.encode() + b"\0")
        except OSError as exc:
            os.close(fd)
            log.debug("pressure watch: PSI trigger %r on %s refused: %s", trigger, path, exc)
            continue
        return Source(f"psi {path} ({trigger})", fd, select.POLLPRI)
    return None


def open_sources(
    cgroup_root: Path = Path("/sys/fs/cgroup"),
    membership: Path = Path("/proc/self/cgroup"),
    psi_file: Path = Path("/proc/pressure/memory"),
) -> list[Source]:
    """Every notification this process may register: the binding cgroup's (v1 thresholds
    and pressure level, or v2 PSI) and the machine's PSI."""
    sources: list[Source] = []
    try:
        reading = read_cgroup(membership.read_text(), cgroup_root)
    except OSError:
        reading = None
    if reading is not None and reading.version == 1 and reading.limit is not None:
        for fraction in THRESHOLDS:
            at = int(reading.limit * fraction)
            src = _v1_event(
                reading.path, "memory.usage_in_bytes", str(at), f"cgroup usage {fraction:.0%}"
            )
            if src is None:
                break  # no permission for one: none of them will work
            sources.append(src)
        for level in ("medium", "critical"):
            src = _v1_event(
                reading.path, "memory.pressure_level", level, f"cgroup pressure {level}"
            )
            if src is not None:
                sources.append(src)
    if reading is not None and reading.version == 2 and reading.limit is not None:
        src = _v2_events(reading.path)
        if src is not None:
            sources.append(src)
    if reading is not None and reading.pressure_file is not None:
        src = _psi(reading.pressure_file)
        if src is not None:
            sources.append(src)
    if not any(s.events == select.POLLPRI for s in sources):
        src = _psi(psi_file)
        if src is not None:
            sources.append(src)
    return sources


class PressureWatch:
    """Calls ``sample()`` when a source fires, and every ``fast_interval`` while ``level()``
    (the latest sample's) is soft or hard or an event came less than ``linger`` s ago."""

    def __init__(
        self,
        sample: Callable[[bool], object],
        level: Callable[[], Pressure],
        sources: list[Source],
        *,
        fast_interval: float = 0.1,
        linger: float = 2.0,
        clock: Callable[[], float] = time.monotonic,
        on_event: Callable[[float], None] | None = None,
        cgroup_v1: Path | None = None,
        prime: bool = False,
    ) -> None:
        self._prime = prime  # take one sample at the start (the guard arms from it)
        self._on_event = on_event  # called with the poll's return time before the sample
        self._cgroup = cgroup_v1  # where ``arm`` registers its thresholds
        self._want: tuple[int, ...] = ()  # thresholds asked for (bytes of cgroup usage)
        self._armed: dict[int, Source] = {}  # thresholds registered, by their byte value
        self._arm_lock = threading.Lock()
        self._dirty = False  # ``_want`` changed since the thread last registered it
        self.rearms = 0  # times the armed thresholds changed
        self._fired_at: dict[int, float] = {}  # fd -> when it last fired
        self._sample = sample  # called with record=: whether the monitor keeps it in history
        self._level = level
        self._sources = sources
        self._fast = fast_interval
        self._linger = linger
        self._clock = clock
        self._last_event = -1e18
        self._last_sample = -1e18
        self._cost = 0.0  # seconds a sample took, smoothed
        self._stopping = False
        self._wake_r, self._wake_w = os.pipe2(os.O_NONBLOCK | os.O_CLOEXEC)
        self._thread: threading.Thread | None = None
        self.wakeups = 0  # samples taken because a source fired
        self.fast_samples = 0  # samples taken because pressure was on

    @property
    def sources(self) -> list[str]:
        return [s.name for s in self._sources]

    @property
    def armed(self) -> list[int]:
        """The re-armed cgroup v1 thresholds registered now (bytes of cgroup usage)."""
        with self._arm_lock:
            return sorted(self._armed)

    def arm(self, points: tuple[int, ...]) -> None:
        """Ask for usage thresholds at ``points`` (any thread); the watch thread registers
        them, replacing those that moved more than ``REARM_STEP``. No-op without v1."""
        if self._cgroup is None:
            return
        with self._arm_lock:
            if _close_enough(points, self._want):
                return
            self._want = points
            self._dirty = True
        self.nudge()

    def _rearm(self, poller: select.poll, by_fd: dict[int, Source]) -> None:
        """In the watch thread: make the registered thresholds those asked for."""
        assert self._cgroup is not None
        with self._arm_lock:
            want = self._want
            keep = {
                at: src
                for at, src in self._armed.items()
                if any(abs(at - w) < REARM_STEP for w in want)
            }
            for at, old in self._armed.items():
                if at not in keep:
                    poller.unregister(old.fd)
                    by_fd.pop(old.fd, None)
                    self._fired_at.pop(old.fd, None)
                    old.close()  # closing the eventfd unregisters it in the kernel
            for w in want:
                if any(abs(at - w) < REARM_STEP for at in keep):
                    continue
                new = arm_threshold(self._cgroup, w, f"re-armed threshold {w}")
                if new is None:
                    continue
                keep[w] = new
                by_fd[new.fd] = new
                poller.register(new.fd, new.events)
            if keep.keys() != self._armed.keys():
                self.rearms += 1
            self._armed = keep

    def start(self) -> None:
        if self._thread is None:
            self._thread = threading.Thread(
                target=self._run, name="elbowroom-pressure-watch", daemon=True
            )
            self._thread.start()
            log.info(
                "pressure watch: %s; every %.2g s while soft or hard",
                ", ".join(self.sources) or "no kernel events here",
                self._fast,
            )

    def nudge(self) -> None:
        """The level rose (a regular sample): wake up and start the fast ticks now."""
        with contextlib.suppress(OSError):  # a full pipe already holds a wake-up
            os.write(self._wake_w, b"n")

    def stop(self) -> None:
        thread, self._thread = self._thread, None
        if thread is not None:
            self._stopping = True
            self.nudge()
            thread.join()
        for s in self._sources:
            s.close()
        self._sources = []
        with self._arm_lock:
            for src in self._armed.values():
                src.close()
            self._armed = {}
        for fd in (self._wake_r, self._wake_w):
            with contextlib.suppress(OSError):
                os.close(fd)

    @property
    def interval(self) -> float:
        """Seconds between fast samples now: ``fast_interval``, or more when samples are
        slow (see ``COST_SHARE``)."""
        return max(self._fast, self._cost / COST_SHARE)

    def _pressing(self) -> bool:
        return self._level() >= Pressure.SOFT or self._clock() - self._last_event < self._linger

    def _run(self) -> None:
        poller = select.poll()
        by_fd = {s.fd: s for s in self._sources}
        for s in self._sources:
            poller.register(s.fd, s.events)
        poller.register(self._wake_r, select.POLLIN)
        if self._prime:
            try:
                self._sample(False)
            except Exception:
                log.exception("pressure watch: a sample failed")
        while not self._stopping:
            if self._dirty:
                self._dirty = False
                self._rearm(poller, by_fd)
            timeout = int(self.interval * 1000) if self._pressing() else None
            ready = poller.poll(timeout)
            if any(fd == self._wake_r for fd, _ in ready):
                with contextlib.suppress(OSError):
                    os.read(self._wake_r, 512)
                ready = [(fd, ev) for fd, ev in ready if fd != self._wake_r]
                if not ready:
                    continue  # re-read the level (and the stop flag)
            fired = []
            for fd, revents in ready:
                src = by_fd.get(fd)
                if src is None:
                    continue
                if revents & (select.POLLERR | select.POLLNVAL | select.POLLHUP):
                    log.info("pressure watch: %s went away", src.name)  # cgroup removed
                    poller.unregister(fd)
                    del by_fd[fd]
                    continue
                src.drain()
                fired.append(src)
            now = self._clock()
            if fired:
                self._last_event = now
                log.debug("pressure watch: %s", ", ".join(s.name for s in fired))
                if self._on_event is not None:
                    self._on_event(time.monotonic())
            elif ready:
                continue
            # Usage hovering at a threshold fires on every crossing: one sample per half
            # interval is enough (the fast ticks that follow catch the rest). A source that
            # had not fired within the interval is a new crossing: it samples at once.
            new = [s for s in fired if now - self._fired_at.get(s.fd, -1e18) >= self.interval]
            for src in fired:
                self._fired_at[src.fd] = now
            if not new and now - self._last_sample < self.interval / 2:
                continue
            self._last_sample = now
            if fired:
                self.wakeups += 1
            else:
                self.fast_samples += 1
            started = time.monotonic()
            try:
                self._sample(bool(fired))
            except Exception:
                log.exception("pressure watch: a sample failed")
            took = time.monotonic() - started
            self._cost = took if self._cost == 0.0 else 0.7 * self._cost + 0.3 * took


def _close_enough(a: tuple[int, ...], b: tuple[int, ...]) -> bool:
    return len(a) == len(b) and all(abs(x - y) < REARM_STEP for x, y in zip(a, b, strict=True))
