"""PressureGuard: samples in, actions applied to its target, the 503 gate, the thread hop.

The target here is a recording stand-in for the scheduler (the edge); the guard's own
bookkeeping (gate, aborts in flight, runner levels, events, counters) is what is tested.
The real scheduler and real runners are in tests/e2e/test_pressure.py.
"""

from __future__ import annotations

import asyncio
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field, replace

import pytest

from elbowroom.errors import MemoryPressure
from elbowroom.guard.guard import PressureGuard
from elbowroom.guard.ladder import InFlight, LoadedModel
from elbowroom.memory.budget import BudgetConfig, Candidate, Limit
from elbowroom.memory.monitor import Sample
from elbowroom.memory.pools import memory_pools
from elbowroom.memory.types import GpuMemory, Pressure, Snapshot

MiB = 1024**2
pytestmark = pytest.mark.anyio


def sample(own_mib: int, level: Pressure, at: float = 0.0, taken_at: float = 0.0) -> Sample:
    limit = Limit(
        value=1000 * MiB,
        winner="reserve",
        candidates=(Candidate("reserve", 1000 * MiB, "test"),),
        soft=850 * MiB,
        hard=950 * MiB,
    )
    snap = Snapshot(
        "linux", 2000 * MiB, 500 * MiB, 1500 * MiB, 2000 * MiB, 500 * MiB, taken_at=taken_at
    )
    return Sample(at, 1_700_000_000.0 + at, snap, own_mib * MiB, limit, level)


@dataclass
class Recorder:
    loaded: list[LoadedModel] = field(default_factory=list)
    running: list[InFlight] = field(default_factory=list)
    calls: list[tuple[object, ...]] = field(default_factory=list)

    def models(self) -> list[LoadedModel]:
        return list(self.loaded)

    def inflight(self) -> list[InFlight]:
        return list(self.running)

    def set_pressure(self, model: str, level: Pressure) -> None:
        self.calls.append(("set_pressure", model, level))
        self.loaded = [replace(m, runner_level=level) if m.id == model else m for m in self.loaded]

    def follow_pause(self, paused: Callable[[], bool]) -> None:
        self.paused = paused  # the guard's answer, read as the scheduler reads it

    async def unload(self, model: str) -> None:
        self.calls.append(("unload", model))
        self.loaded = [m for m in self.loaded if m.id != model]


def llm(id: str, mib: int, used: float, busy: int = 0) -> LoadedModel:
    return LoadedModel(id, mib * MiB, used, busy=busy, llm=True)


async def settle() -> None:
    """Let the unload tasks the guard started run."""
    for _ in range(3):
        await asyncio.sleep(0)


async def test_soft_pauses_loads_and_unloads_the_lru_idle_model() -> None:
    target = Recorder(loaded=[llm("old", 100, 1.0), llm("new", 100, 2.0), llm("busy", 50, 0.5, 1)])
    guard = PressureGuard(target)
    actions = await guard.apply(sample(900, Pressure.SOFT))
    await settle()
    assert target.paused()
    assert ("unload", "old") in target.calls and ("unload", "new") not in target.calls
    assert ("set_pressure", "busy", Pressure.SOFT) in target.calls
    assert guard.loads_paused and guard.admission_open()
    kinds = [e.kind for e in guard.events()]
    assert len(kinds) == len(actions)
    assert {"pause_loads", "set_pressure", "unload"} <= set(kinds)
    unload = next(e for e in guard.events() if e.kind == "unload")
    assert unload.model == "old" and "900.0 MiB" in unload.message and unload.usage == 900 * MiB
    assert guard.counters[("unload", "soft")] == 1


async def test_a_sample_measured_before_an_unload_completed_does_not_unload_again() -> None:
    target = Recorder(loaded=[llm("a", 100, 1.0), llm("b", 100, 2.0)])
    guard = PressureGuard(target)
    await guard.apply(sample(900, Pressure.SOFT, taken_at=time.monotonic()))
    measured_before = time.monotonic()
    await settle()  # the unload of "a" completes now, after that measurement
    assert target.calls.count(("unload", "a")) == 1
    # this sample was measured before the completion: it still counts a's 100 MiB
    await guard.apply(sample(900, Pressure.SOFT, taken_at=measured_before))
    await settle()
    assert ("unload", "b") not in target.calls
    assert guard.state()["unloading"] == ["a"]
    # a sample taken afterwards shows the memory back; a still-high reading means real excess
    await guard.apply(sample(900, Pressure.SOFT, taken_at=time.monotonic()))
    await settle()
    assert ("unload", "b") in target.calls


async def test_hard_closes_admission_until_back_under_soft() -> None:
    target = Recorder(loaded=[llm("x", 100, 1.0, busy=1)])
    guard = PressureGuard(target, retry_after=7.0)
    await guard.apply(sample(960, Pressure.HARD))
    assert not guard.admission_open()
    with pytest.raises(MemoryPressure) as info:
        guard.check_admission()
    err = info.value
    assert err.status == 503 and err.type == "memory_pressure"
    assert err.headers() == {"Retry-After": "7"}
    assert err.details["usage"] == 960 * MiB and err.details["hard_threshold"] == 950 * MiB

    await guard.apply(sample(900, Pressure.SOFT))  # under hard but not under soft: still shut
    assert not guard.admission_open()
    await guard.apply(sample(500, Pressure.NORMAL))
    assert guard.admission_open() and not guard.loads_paused
    guard.check_admission()
    assert not target.paused() and "resume_loads" in [e.kind for e in guard.events()]
    assert target.calls[-1] == ("set_pressure", "x", Pressure.NORMAL)


async def test_one_abort_at_a_time_newest_then_largest() -> None:
    target = Recorder(loaded=[llm("small", 100, 1.0, busy=1), llm("big", 400, 1.0, busy=1)])
    # bytes 0: the guard fills each request's bytes from its model's (the scheduler adapter
    # measures the runners once per sample, for models())
    target.running = [InFlight("r-big", "big", 1.0, 0), InFlight("r-small", "small", 2.0, 0)]
    guard = PressureGuard(target)
    await guard.apply(sample(990, Pressure.HARD, at=1))
    assert guard.aborting() == {"r-small": "small"}
    assert ("set_pressure", "small", Pressure.HARD) in target.calls
    assert ("set_pressure", "big", Pressure.SOFT) in target.calls
    await settle()
    assert ("unload", "small") in target.calls  # over hard in bytes: its model goes too
    assert guard.counters[("unload", "busy")] == 1

    # the abort has not landed yet: the next hard sample chooses nothing new
    target.calls.clear()
    await guard.apply(sample(990, Pressure.HARD, at=2))
    assert guard.aborting() == {"r-small": "small"} and target.calls == []

    # it landed (the request is gone): the largest is next
    target.running = target.running[:1]
    await guard.apply(sample(990, Pressure.HARD, at=3))
    assert guard.aborting() == {"r-big": "big"}
    assert ("set_pressure", "big", Pressure.HARD) in target.calls
    assert guard.counters[("abort", "newest")] == 1 and guard.counters[("abort", "largest")] == 1


async def test_disabled_guard_records_samples_and_never_acts() -> None:
    target = Recorder(loaded=[llm("a", 100, 1.0)])
    target.running = [InFlight("r", "a", 1.0, 100 * MiB)]
    guard = PressureGuard(target, enabled=False)
    s = sample(999, Pressure.HARD)
    assert await guard.apply(s) == []
    assert guard.latest is s and guard.admission_open() and not guard.loads_paused
    assert target.calls == [] and guard.events() == []


async def test_samples_from_the_monitor_thread_are_applied_on_the_loop() -> None:
    target = Recorder(loaded=[llm("a", 100, 1.0)])
    guard = PressureGuard(target)
    await guard.start()
    try:
        seen: list[int] = []

        def monitor_thread() -> None:
            seen.append(threading.get_ident())
            guard.on_sample(sample(900, Pressure.SOFT))

        t = threading.Thread(target=monitor_thread)
        t.start()
        t.join()
        deadline = time.monotonic() + 5
        while ("unload", "a") not in target.calls:
            assert time.monotonic() < deadline, "the guard never applied the sample"
            await asyncio.sleep(0.01)
        assert seen and seen[0] != threading.get_ident()
        assert guard.loads_paused
    finally:
        await guard.close()
    guard.on_sample(sample(100, Pressure.NORMAL))  # after close: recorded, not applied
    assert guard.latest is not None and guard.latest.own_usage == 100 * MiB


async def test_a_full_gpu_aborts_and_evicts_the_work_on_that_gpu_first() -> None:
    # An 80 GiB card (injected NVML reading) where another process left 1 GiB free: hard
    # on gpu0 by free memory, while host RAM is normal. The GPU model's generation is
    # aborted, though the CPU model's is newer (the host ladder's pick).
    GiB = 1024 * MiB
    on_gpu = replace(llm("gpu-llm", 200, 1.0, busy=1), pools=(("gpu0", 30 * GiB),))
    on_cpu = llm("cpu-llm", 300, 1.0, busy=1)
    target = Recorder(loaded=[on_gpu, on_cpu])
    target.running = [InFlight("g", "gpu-llm", 1.0, 0), InFlight("c", "cpu-llm", 5.0, 0)]
    cfg = BudgetConfig()
    guard = PressureGuard(target, budget=cfg)
    card = GpuMemory(0, "NVIDIA H100", total=80 * GiB, free=1 * GiB, used=79 * GiB)
    s = sample(500, Pressure.NORMAL, at=1)
    snap = replace(s.snapshot, gpus=(card,))
    # the pools as the monitor computes them from that reading and our 30 GiB on the card
    s = replace(s, snapshot=snap, pools=memory_pools(snap, 500 * MiB, {0: 30 * GiB}, cfg))
    await guard.apply(s)
    assert guard.aborting() == {"g": "gpu-llm"}
    assert ("set_pressure", "gpu-llm", Pressure.HARD) in target.calls
    assert ("set_pressure", "cpu-llm", Pressure.HARD) not in target.calls
    assert not guard.admission_open()  # hard on a GPU closes admission too
    assert guard.state()["gpu_levels"] == {"gpu0": "hard"}
    events = guard.events()
    abort = next(e for e in events if e.kind == "abort")
    assert "on gpu0" in abort.message
    # without the GPU reading the same sample is normal and nothing is done
    plain = PressureGuard(Recorder(loaded=[on_gpu, on_cpu]), budget=cfg)
    assert await plain.apply(sample(500, Pressure.NORMAL, at=1)) == []


async def test_the_log_names_the_signal_that_moved_the_level_not_our_small_usage() -> None:
    """PSI raised the level while our usage is far under the thresholds: the pause, the
    unload and the 503 gate say PSI did (the log used to give only the usage
    and the threshold it is under)."""
    target = Recorder(loaded=[llm("idle", 100, 1.0), llm("busy", 50, 2.0, busy=1)])
    target.running = [InFlight("r1", "busy", 5.0, 50 * MiB)]
    guard = PressureGuard(target)
    psi = "PSI some avg10 19.5% ≥ 10%"
    actions = await guard.apply(replace(sample(52, Pressure.SOFT), reasons=(psi,)))
    pause = next(a for a in actions if type(a).__name__ == "PauseLoads")
    assert psi in pause.message() and "our usage 52.0 MiB is under the soft" in pause.message()
    unload = next(a for a in actions if type(a).__name__ == "Unload")
    assert psi in unload.message()
    hard = "PSI some avg10 55.0% ≥ 40%"
    actions = await guard.apply(replace(sample(52, Pressure.HARD, at=1.0), reasons=(hard,)))
    close = next(a for a in actions if type(a).__name__ == "CloseAdmission")
    assert hard in close.message(), close.message()
    # Over the threshold in bytes, the usage is the reason given.
    guard = PressureGuard(Recorder())
    (pause,) = await guard.apply(replace(sample(900, Pressure.SOFT), reasons=("ours",)))
    assert pause.message().endswith("usage 900.0 MiB is over the soft threshold 850.0 MiB")
