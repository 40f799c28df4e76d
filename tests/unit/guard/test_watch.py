"""The pressure watch: a real cgroup v1 wakes a sample the moment a neighbour crosses a
threshold; under pressure it samples fast; with no pressure it stays asleep."""

from __future__ import annotations

import itertools
import os
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest
from cgroup_v1 import NEIGHBOUR, Cgroup, v1_available

from elbowroom.guard.watch import THRESHOLDS, PressureWatch, open_sources
from elbowroom.memory.types import Pressure

MiB = 1024**2


def wait_until(cond: Callable[[], bool], timeout: float, what: str) -> None:
    deadline = time.monotonic() + timeout
    while not cond():
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        time.sleep(0.01)


class Calls:
    def __init__(self) -> None:
        self.lock = threading.Lock()
        self.records: list[bool] = []

    def __call__(self, record: bool) -> None:
        with self.lock:
            self.records.append(record)

    def count(self, record: bool | None = None) -> int:
        with self.lock:
            return sum(1 for r in self.records if record is None or r is record)


def test_fast_sampling_only_while_the_level_is_soft_or_hard() -> None:
    calls = Calls()
    level = [Pressure.NORMAL]
    watch = PressureWatch(calls, lambda: level[0], [], fast_interval=0.02, linger=0.0)
    watch.start()
    try:
        time.sleep(0.2)  # a window in which a wrong tick would show: asleep at normal
        assert calls.count() == 0
        level[0] = Pressure.SOFT
        watch.nudge()  # what the guard does when a regular sample raises the level
        wait_until(lambda: calls.count(False) >= 5, 10, "five fast samples at soft")
        level[0] = Pressure.NORMAL
        settled = calls.count()
        wait_until(lambda: calls.count() <= settled + 1, 1, "the fast ticks to stop")
        before = calls.count()
        stop_at = time.monotonic() + 0.3
        while time.monotonic() < stop_at:  # a window in which a fast tick would show
            assert calls.count() <= before + 1
            time.sleep(0.02)
    finally:
        watch.stop()
    assert watch.wakeups == 0 and watch.fast_samples >= 5


@pytest.fixture
def cgroup() -> Iterator[Cgroup]:
    if not v1_available():
        pytest.skip("needs root and a cgroup v1 memory hierarchy")
    cg = Cgroup(f"elbowroom-watch-{os.getpid()}", 256 * MiB)
    try:
        yield cg
    finally:
        cg.remove()


def test_a_cgroup_threshold_crossing_wakes_a_sample_at_once(cgroup: Cgroup, tmp_path: Path) -> None:
    member = subprocess.Popen(
        cgroup.command(sys.executable, "-c", NEIGHBOUR),
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
    )
    assert member.stdin is not None and member.stdout is not None
    try:
        member.stdin.write(b"+0\n")
        member.stdin.flush()
        assert member.stdout.readline().startswith(b"ok")  # it is in the cgroup now
        found = open_sources(membership=Path(f"/proc/{member.pid}/cgroup"))
        names = [s.name for s in found]
        assert f"cgroup usage {THRESHOLDS[0]:.0%}" in names, names
        # The machine-wide PSI trigger answers to the other processes on this machine too:
        # not part of what this test controls.
        sources = [s for s in found if s.name.startswith("cgroup")]
        for s in found:
            if s not in sources:
                s.close()
        calls = Calls()
        watch = PressureWatch(calls, lambda: Pressure.NORMAL, sources, fast_interval=0.05)
        watch.start()
        try:
            # Below every threshold: nothing fires, nothing is sampled.
            base = cgroup.usage
            assert base < 0.8 * cgroup.limit
            time.sleep(0.3)  # a window in which a wrong wake-up would show
            assert calls.count() == 0
            need = int(0.82 * cgroup.limit - base) // MiB + 1
            t0 = time.monotonic()
            member.stdin.write(f"+{need}\n".encode())
            member.stdin.flush()
            assert member.stdout.readline().startswith(b"ok")
            wait_until(lambda: calls.count(True) >= 1, 5, "a sample woken by the threshold")
            assert time.monotonic() - t0 < 2.0
            assert watch.wakeups >= 1
        finally:
            watch.stop()
    finally:
        member.kill()
        member.wait()


def test_slow_samples_slow_the_fast_pace_to_a_tenth_of_a_core() -> None:
    took: list[float] = []

    def slow_sample(record: bool) -> None:
        took.append(time.monotonic())
        time.sleep(0.05)  # stands for a sample that measures big runners: 50 ms of work

    watch = PressureWatch(slow_sample, lambda: Pressure.HARD, [], fast_interval=0.02)
    watch.start()
    try:
        wait_until(lambda: len(took) >= 4, 10, "four fast samples")
    finally:
        watch.stop()
    assert watch.interval >= 0.4  # ~50 ms / 0.1, not the 20 ms asked for
    gaps = [b - a for a, b in itertools.pairwise(took[1:])]
    assert min(gaps) >= 0.3


def test_a_re_armed_threshold_wakes_a_sample_where_the_fixed_ones_would_not(
    cgroup: Cgroup,
) -> None:
    """No fixed fraction, only the threshold ``arm`` asked for (the guard's soft point):
    crossing it wakes a sample with the time of the wake-up; moving it re-registers."""
    member = subprocess.Popen(
        cgroup.command(sys.executable, "-c", NEIGHBOUR),
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
    )
    assert member.stdin is not None and member.stdout is not None

    def grow(mib: int) -> None:
        assert member.stdin is not None and member.stdout is not None
        member.stdin.write(f"+{mib}\n".encode())
        member.stdin.flush()
        assert member.stdout.readline().startswith(b"ok")

    try:
        grow(0)  # it is in the cgroup now
        calls = Calls()
        events: list[float] = []
        watch = PressureWatch(
            calls,
            lambda: Pressure.NORMAL,
            [],
            fast_interval=0.05,
            linger=0.0,
            on_event=events.append,
            cgroup_v1=cgroup.path,
        )
        watch.start()
        try:
            base = cgroup.usage
            first = base + 64 * MiB
            watch.arm((first,))
            wait_until(lambda: watch.armed == [first], 5, "the threshold registered")
            watch.arm((first + MiB,))  # moved less than REARM_STEP: kept as it is
            watch.arm((base + 40 * MiB,))  # moved: re-registered
            wait_until(lambda: watch.armed == [base + 40 * MiB], 5, "the threshold moved")
            assert watch.rearms == 2
            grow(20)  # under the threshold: nothing
            time.sleep(0.3)  # a window in which a wrong wake-up would show
            assert calls.count() == 0 and events == []
            t0 = time.monotonic()
            grow(32)
            wait_until(lambda: calls.count(True) >= 1, 5, "a sample woken by the threshold")
            assert len(events) >= 1 and events[0] >= t0
        finally:
            watch.stop()
        assert watch.armed == []
    finally:
        member.kill()
        member.wait()


def test_a_limited_cgroup_v2_is_watched_through_memory_events(tmp_path: Path) -> None:
    """A recorded v2 tree (the project's machine is v1): the binding cgroup's memory.events
    is opened for POLLPRI, and re-read to re-arm when it fires."""
    (tmp_path / "cgroup.controllers").write_text("memory\n")
    leaf = tmp_path / "svc"
    leaf.mkdir()
    (leaf / "memory.max").write_text(f"{512 * MiB}\n")
    (leaf / "memory.current").write_text(f"{100 * MiB}\n")
    (leaf / "memory.stat").write_text("inactive_file 0\n")
    (leaf / "memory.events").write_text("low 0\nhigh 0\nmax 0\noom 0\noom_kill 0\n")
    membership = tmp_path / "self-cgroup"
    membership.write_text("0::/svc\n")
    found = open_sources(tmp_path, membership, psi_file=tmp_path / "no-psi")
    try:
        events = [s for s in found if s.name.endswith("memory.events")]
        assert len(events) == 1 and events[0].reread
        events[0].drain()  # reading again is how a kernfs notification is re-armed
    finally:
        for s in found:
            s.close()
