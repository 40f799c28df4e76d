"""The monitor: synchronous samples, the ring buffer, the background thread, failures."""

from __future__ import annotations

import json
import threading
from collections.abc import Iterator

import pytest

from elbowroom.config import Settings
from elbowroom.memory.budget import BudgetConfig
from elbowroom.memory.monitor import Monitor, Sample
from elbowroom.memory.probe import default_probe
from elbowroom.memory.types import GpuMemory, Pressure, Snapshot
from elbowroom.units import GiB, MiB

CFG = BudgetConfig()
WAIT = 10.0  # seconds a condition may take before the test fails


class Readings:
    """A probe at the edge: hands out one reading per call (the last one repeats)."""

    def __init__(self, *available: int, fail_first: int = 0) -> None:
        self.available = list(available)
        self.calls = 0
        self.fail_first = fail_first

    def __call__(self) -> Snapshot:
        self.calls += 1
        if self.calls <= self.fail_first:
            raise OSError("meminfo vanished")
        avail = self.available[min(self.calls - self.fail_first, len(self.available)) - 1]
        return Snapshot("linux", 16 * GiB, avail, 16 * GiB - avail, 16 * GiB, avail)


class Ticks:
    def __init__(self) -> None:
        self.now = 100.0

    def __call__(self) -> float:
        self.now += 1.0
        return self.now


@pytest.fixture
def monitors() -> Iterator[list[Monitor]]:
    made: list[Monitor] = []
    yield made
    for m in made:
        m.stop()


def test_sample_now_computes_limit_and_level() -> None:
    seen: list[Sample] = []
    mon = Monitor(
        Readings(12 * GiB, 100 * MiB),
        own_usage=lambda: 1 * GiB,
        cfg=CFG,
        clock=Ticks(),
        wall_clock=lambda: 1_700_000_000.0,
        on_sample=seen.append,
    )
    assert mon.latest is None
    first = mon.sample_now()
    assert first.level is Pressure.NORMAL and first.reasons == ()
    assert first.own_usage == 1 * GiB
    assert first.limit.value == 12 * GiB  # 16 GiB − 4 GiB reserve
    second = mon.sample_now()
    # the limit collapsed to available + ours − margin: both signals say hard
    assert second.level is Pressure.HARD
    assert len(second.reasons) == 2
    assert "ours 1.0 GiB ≥ hard threshold" in second.reasons[0]
    assert "machine-wide" in second.reasons[1]
    assert second.wall == 1_700_000_000.0
    assert (first.at, second.at) == (101.0, 102.0)
    assert mon.latest is second
    assert mon.history() == [first, second] == seen


def test_history_is_a_ring_buffer_of_history_over_interval() -> None:
    mon = Monitor(
        Readings(*(g * GiB for g in range(1, 9))),
        own_usage=lambda: 0,
        cfg=CFG,
        interval=2.0,
        history_seconds=10.0,
    )
    samples = [mon.sample_now() for _ in range(8)]
    assert mon.history() == samples[-5:]  # 10 s of history at one sample per 2 s


def test_background_thread_samples_until_stopped(monitors: list[Monitor]) -> None:
    three = threading.Event()
    count = 0

    def on_sample(_: Sample) -> None:
        nonlocal count
        count += 1
        if count == 3:
            three.set()

    mon = Monitor(
        Readings(8 * GiB), own_usage=lambda: 0, cfg=CFG, interval=0.01, on_sample=on_sample
    )
    monitors.append(mon)
    mon.start()
    mon.start()  # idempotent: still one thread
    assert three.wait(WAIT)
    mon.stop()
    assert not mon.running
    stopped_at = len(mon.history())
    assert stopped_at >= 3
    assert len(mon.history()) == stopped_at  # nothing samples after stop() returned


def test_a_failing_probe_does_not_kill_the_thread(
    monitors: list[Monitor], caplog: pytest.LogCaptureFixture
) -> None:
    got = threading.Event()
    probe = Readings(8 * GiB, fail_first=2)
    mon = Monitor(probe, own_usage=lambda: 0, cfg=CFG, interval=0.01, on_sample=lambda s: got.set())
    monitors.append(mon)
    mon.start()
    assert got.wait(WAIT)
    assert probe.calls >= 3
    assert "memory sample failed" in caplog.text
    with pytest.raises(OSError):
        Monitor(Readings(1, fail_first=1), own_usage=lambda: 0, cfg=CFG).sample_now()


def test_sample_to_dict_is_json_with_level_label() -> None:
    mon = Monitor(Readings(200 * MiB), own_usage=lambda: 0, cfg=CFG)
    data = json.loads(json.dumps(mon.sample_now().to_dict()))
    assert data["level"] == "hard"
    assert data["snapshot"]["available"] == 200 * MiB
    assert data["limit"]["winner"] == "available"
    assert data["reasons"]


def test_invalid_interval_is_refused() -> None:
    with pytest.raises(ValueError):
        Monitor(Readings(1), own_usage=lambda: 0, cfg=CFG, interval=0)


def test_monitor_over_the_real_probe() -> None:
    mon = Monitor(default_probe(), own_usage=lambda: 0, cfg=CFG)
    sample = mon.sample_now()
    assert 0 < sample.limit.value <= sample.snapshot.total
    assert sample.limit.soft < sample.limit.hard <= sample.limit.value


def test_read_is_fresh_but_neither_recorded_nor_handed_on() -> None:
    seen: list[Sample] = []
    mon = Monitor(Readings(12 * GiB), own_usage=lambda: 0, cfg=CFG, on_sample=seen.append)
    fresh = mon.read()
    assert mon.latest is None and mon.history() == [] and seen == []
    # One picture: the sample's limit is its host pool's, the pools come with it.
    assert fresh.pools[0].name == "host" and fresh.limit == fresh.pools[0].limit
    mon.subscribe(seen.append)
    recorded = mon.sample_now()
    assert seen == [recorded] and mon.latest is recorded


def test_from_settings_builds_the_one_budget_config_and_gpu_pools() -> None:
    settings = Settings(soft_fraction=0.88, override_gpu_memory=8 * GiB)
    gpu = GpuMemory(0, "Test GPU", 24 * GiB, 20 * GiB, 4 * GiB)
    snap = Snapshot("linux", 16 * GiB, 12 * GiB, 4 * GiB, 16 * GiB, 12 * GiB, gpus=(gpu,))
    mon = Monitor.from_settings(
        settings, lambda: snap, own_usage=lambda: 0, own_gpu=lambda: {0: 1 * GiB}
    )
    assert mon.cfg.soft_fraction == 0.88 and mon.interval == settings.monitor_interval
    sample = mon.read()
    host, card = sample.pools
    assert host.limit == sample.limit
    assert card.name == "gpu0" and card.ours == 1 * GiB and card.total == 8 * GiB
    assert sample.limit.soft == int(sample.limit.value * 0.88)


def test_paired_probe_and_usage_come_from_one_reading() -> None:
    """A cluster node's snapshot and our usage come from one reading that another thread
    replaces: with ``pair`` the replacement waits until both are read, so a sample never
    mixes an old snapshot with a newer (grown) usage."""
    lock = threading.Lock()
    reading = {"available": 8 * GiB, "ours": 1 * GiB}
    swapped = threading.Event()

    def replace() -> None:  # the next reading: a loading runner grew by 300 MiB
        with lock:
            reading.update(available=8 * GiB - 300 * MiB, ours=1 * GiB + 300 * MiB)
        swapped.set()

    swapper = threading.Thread(target=replace)

    def probe() -> Snapshot:
        avail = reading["available"]
        swapper.start()
        # Unpaired, the replacement lands here, between the snapshot and our usage.
        swapped.wait(0.3)
        return Snapshot("linux", 16 * GiB, avail, 16 * GiB - avail, 16 * GiB, avail)

    mon = Monitor(probe, own_usage=lambda: reading["ours"], cfg=CFG)
    mon.pair(lock)
    sample = mon.read()
    swapper.join(WAIT)
    assert swapped.is_set()  # the replacement landed once the sample was taken
    assert (sample.snapshot.available, sample.own_usage) == (8 * GiB, 1 * GiB)
