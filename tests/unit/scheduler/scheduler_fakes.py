"""The edges of the scheduler, faked: a small machine, its runners, catalog and estimates.

The scheduler is the thing under test; these stand in for the processes and the model
layer. The fake machine's available memory moves when fake runners start and stop, with
an optional lag (probe readings before freed memory shows up), like a real cgroup or GPU.
"""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import math
import time
from collections.abc import AsyncGenerator, AsyncIterator, Callable, Coroutine
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, cast

from elbowroom.config import Settings
from elbowroom.engines.options import EngineOptions, LlamaOptions
from elbowroom.errors import ModelNotFound, RunnerCrashed
from elbowroom.memory.types import ZERO_PROCESS_MEMORY, ProcessMemory, Snapshot
from elbowroom.models.spec import Footprint, GGUFInfo, Holding, ModelKind, ModelSpec
from elbowroom.runtime.protocol import ExitCallback, ReadyInfo, RunnerState
from elbowroom.scheduler.inputs import Measurements
from elbowroom.scheduler.loop import Scheduler
from elbowroom.units import KiB, MiB

GGUF = GGUFInfo(
    architecture="llama", name="fake", n_layers=30, n_heads=9, n_kv_heads=3, head_dim_k=64,
    head_dim_v=64, n_embd=576, trained_ctx=8192, file_type="Q4_1", has_chat_template=True,
)  # fmt: skip
Stream = AsyncGenerator[dict[str, Any], None]
KV_PER_TOKEN = {"f16": 64 * KiB, "q8_0": 34 * KiB, "q4_0": 18 * KiB}


class FakeClock:
    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now

    async def sleep(self, seconds: float) -> None:
        # The scheduler polls with this: time passes, and other tasks get to run.
        self.now += seconds
        await asyncio.sleep(0)


class FakeMachine:
    """Total memory, what others use, and what each fake runner holds."""

    def __init__(self, total: int = 1000 * MiB) -> None:
        self.total = total
        self.other = 0
        self.held: dict[int, int] = {}
        self.releasing: list[list[int]] = []  # [bytes, probe readings until it shows]
        self.lag = 0  # readings before a stopped runner's memory shows as available
        self.loading = 0
        self.max_loading = 0
        self.starts: list[str] = []
        self.pending_at_start: list[int] = []  # bytes not yet released when a load began
        self.start_gate: asyncio.Event | None = None  # when set, loads wait for it
        self.fail_starts: dict[str, BaseException] = {}  # model id -> what its start raises
        self.holds: dict[str, asyncio.Event] = {}  # model id -> requests wait for it

    def pending(self) -> int:
        return sum(n for n, _ in self.releasing)

    def probe(self) -> Snapshot:
        pending = self.pending()
        for item in self.releasing:
            item[1] -= 1
        self.releasing = [item for item in self.releasing if item[1] > 0]
        used = min(self.total, self.other + sum(self.held.values()) + pending)
        available = self.total - used
        return Snapshot(
            platform="linux",
            total=self.total,
            available=available,
            used=used,
            host_total=self.total,
            host_available=available,
            taken_at=time.monotonic(),
        )

    def allocate(self, pid: int, n: int) -> None:
        self.held[pid] = n

    def release(self, pid: int) -> None:
        n = self.held.pop(pid, 0)
        if n and self.lag > 0:
            self.releasing.append([n, self.lag])


_pids = itertools.count(1000)


def context_of(options: EngineOptions) -> tuple[int, int, str]:
    """(n_ctx, slots, kv_type) of a runner's start options; an engine without a context
    has none."""
    if isinstance(options, LlamaOptions):
        return options.n_ctx, options.slots, options.kv_type
    return 0, 1, "f16"


class FakeRunner:
    def __init__(
        self,
        machine: FakeMachine,
        spec: ModelSpec,
        on_exit: ExitCallback,
        size_of: Callable[[EngineOptions], int],
    ) -> None:
        self.spec = spec
        self.machine = machine
        self.size_of = size_of  # bytes the process will hold, given its start options
        self.nbytes = 0
        self._on_exit = on_exit
        self._pid: int | None = None
        self._state = RunnerState.NEW
        self.exit_cause: str | None = None
        self.options: EngineOptions | None = None
        self.dead = asyncio.Event()
        self.in_request = 0
        self.stops = 0
        self.stopped = asyncio.Event()  # stop() was called (a load waiting ends)
        self.loading_bytes = 0  # what measure() says while it loads

    @property
    def pid(self) -> int | None:
        return self._pid

    @property
    def state(self) -> RunnerState:
        return self._state

    async def start(self, options: EngineOptions) -> ReadyInfo:
        self.options = options
        self.nbytes = self.size_of(options)
        self._state = RunnerState.STARTING
        m = self.machine
        m.loading += 1
        m.max_loading = max(m.max_loading, m.loading)
        m.pending_at_start.append(m.pending())
        try:
            if m.start_gate is not None:
                waits = [asyncio.ensure_future(e.wait()) for e in (m.start_gate, self.stopped)]
                _, pending = await asyncio.wait(waits, return_when=asyncio.FIRST_COMPLETED)
                for w in pending:
                    w.cancel()
            if self.stopped.is_set():  # stopped while it loaded, as the supervisor says
                self._state = RunnerState.CRASHED
                raise RunnerCrashed(f"the runner of {self.spec.id} was stopped while it loaded")
            failure = m.fail_starts.get(self.spec.id)
            if failure is not None:
                self._state = RunnerState.CRASHED
                raise failure
            self._pid = next(_pids)
            m.allocate(self._pid, self.nbytes)
            m.starts.append(self.spec.id)
            self._state = RunnerState.READY
        finally:
            m.loading -= 1
        return ReadyInfo(
            pid=self._pid,
            load_seconds=0.5,
            measured=ProcessMemory(self.nbytes, 0, pids=(self._pid,)),
            facts={"n_ctx": options.n_ctx if isinstance(options, LlamaOptions) else None},
        )

    async def request(self, kind: str, payload: dict[str, Any]) -> AsyncIterator[dict[str, Any]]:
        self.in_request += 1
        try:
            hold = self.machine.holds.get(self.spec.id)
            if hold is not None:  # in flight until the test releases it or the process dies
                waits = [asyncio.ensure_future(e.wait()) for e in (hold, self.dead)]
                _, pending = await asyncio.wait(waits, return_when=asyncio.FIRST_COMPLETED)
                for w in pending:
                    w.cancel()
            if self._state is not RunnerState.READY:
                raise RunnerCrashed(f"the runner of {self.spec.id} died: {self.exit_cause}")
            yield {"type": "done", "text": "ok"}
        finally:
            self.in_request -= 1

    async def stop(self, grace: float) -> None:
        self.stops += 1
        self.stopped.set()
        if self._pid is not None and self._state is RunnerState.READY:
            self.machine.release(self._pid)
        self._state = RunnerState.STOPPED

    def measure(self) -> ProcessMemory:
        if self._state is RunnerState.READY:
            return ProcessMemory(self.nbytes, 0)
        if self._state is RunnerState.STARTING and self.loading_bytes:
            return ProcessMemory(self.loading_bytes, 0)
        return ZERO_PROCESS_MEMORY

    async def stats(self) -> dict[str, Any]:
        return {}

    def set_pressure(self, level: int) -> None:
        pass

    def crash(self, cause: str = "killed by signal SIGKILL") -> None:
        """The process dies on its own: memory back at once, requests in flight fail."""
        if self._pid is not None:
            self.machine.release(self._pid)
        self._state = RunnerState.CRASHED
        self.exit_cause = cause
        self.dead.set()
        self._on_exit(self, cause)


def spec(
    model_id: str,
    kind: ModelKind = ModelKind.EMBEDDING,
    size_mib: int = 100,
) -> ModelSpec:
    llm = kind is ModelKind.LLM
    return ModelSpec(
        id=model_id,
        kind=kind,
        engine="llama" if llm else "onnx-embed",
        path=Path("/fake") / model_id,
        size_bytes=size_mib * MiB,
        holding=Holding.MMAP if llm else Holding.RESIDENT,
        source="path",
        gguf=GGUF if llm else None,
    )


class FakeCatalog:
    def __init__(self, *specs: ModelSpec) -> None:
        self.specs = {s.id: s for s in specs}

    def get(self, model_id: str) -> ModelSpec:
        try:
            return self.specs[model_id]
        except KeyError:
            raise ModelNotFound(model_id) from None


class FakeEstimator:
    """Resident models hold their size; an LLM holds its size (file-backed) + 64 KiB of f16
    KV per token and slot. A remembered measurement, when there is one, is the prediction."""

    def footprint(
        self,
        spec: ModelSpec,
        n_ctx: int,
        slots: int = 1,
        kv_type: str = "f16",
        measured: Measurements | None = None,
    ) -> Footprint:
        per_token = KV_PER_TOKEN[kv_type] * slots if spec.gguf is not None else 0
        kv = per_token * n_ctx
        seen = measured.lookup(spec, n_ctx, slots, kv_type) if measured is not None else None
        if seen is not None:
            return Footprint(
                spec.size_bytes, seen.file_backed, seen.anonymous,
                per_token, kv, 0, n_ctx, slots, kv_type, measured=True,
            )  # fmt: skip
        if spec.gguf is not None:
            return Footprint(
                spec.size_bytes, spec.size_bytes, kv, per_token, kv, 0, n_ctx, slots, kv_type
            )
        return Footprint(spec.size_bytes, 0, spec.size_bytes)

    def auto_context(
        self,
        spec: ModelSpec,
        budget_bytes: int,
        settings_max_ctx: int,
        min_ctx: int,
        slots: int = 1,
        kv_type: str = "f16",
        measured: Measurements | None = None,
    ) -> int:
        assert spec.gguf is not None
        per_token = KV_PER_TOKEN[kv_type] * slots
        fit = math.floor((budget_bytes - spec.size_bytes) / per_token / 256) * 256
        ctx = min(fit, settings_max_ctx, spec.gguf.trained_ctx)
        return ctx if ctx >= min_ctx else 0


@dataclass
class FakeMeasurements:
    records: dict[tuple[str, int, int, str], ProcessMemory] = field(default_factory=dict)

    def record(
        self, spec: ModelSpec, n_ctx: int, slots: int, kv_type: str, mem: ProcessMemory
    ) -> None:
        self.records[(spec.id, n_ctx, slots, kv_type)] = mem

    def lookup(self, spec: ModelSpec, n_ctx: int, slots: int, kv_type: str) -> ProcessMemory | None:
        return self.records.get((spec.id, n_ctx, slots, kv_type))


@dataclass
class Harness:
    sched: Scheduler
    machine: FakeMachine
    clock: FakeClock
    runners: list[FakeRunner]
    measured: FakeMeasurements
    paused: bool = False  # the pressure guard's answer, as the scheduler follows it

    def pause_loads(self, paused: bool) -> None:
        """Stand in for the pressure guard pausing (or resuming) new loads."""
        self.paused = paused

    def runner(self, model_id: str) -> FakeRunner:
        """The latest runner made for ``model_id``."""
        return next(r for r in reversed(self.runners) if r.spec.id == model_id)

    def loaded(self) -> list[str]:
        return sorted(row["id"] for row in self.sched.ps())


def harness(
    *specs: ModelSpec,
    actual: dict[str, int] | None = None,
    when_idle: Callable[[], object] | None = None,
    **overrides: Any,
) -> Harness:
    """A scheduler over a 1000 MiB fake machine whose limit is 800 MiB (the 80 % tier; no
    OS reserve, no safety margin). ``actual`` overrides a model's real bytes (MiB);
    ``when_idle`` is the scheduler's (the real heap trim when None)."""
    base: dict[str, Any] = {
        "os_reserve": 0,
        "safety_margin": 0,
        "slots": 1,  # the sizing arithmetic in these tests is per one sequence
        "max_ctx": 8192,
        "data_dir": Path("/nonexistent/elbowroom-test"),
        "kv_cache_dir": Path("/nonexistent/elbowroom-test/kv"),
    }
    settings = Settings(**{**base, **overrides})
    machine, clock = FakeMachine(), FakeClock()
    runners: list[FakeRunner] = []
    estimator, measured = FakeEstimator(), FakeMeasurements()

    def factory(s: ModelSpec, on_exit: ExitCallback) -> FakeRunner:
        def size_of(options: EngineOptions) -> int:
            # What the estimate predicts for these options, unless the test says otherwise.
            if actual is not None and s.id in actual:
                return actual[s.id] * MiB
            return estimator.footprint(s, *context_of(options)).total

        runner = FakeRunner(machine, s, on_exit, size_of)
        runners.append(runner)
        return runner

    sched = Scheduler(
        settings,
        FakeCatalog(*specs),
        probe=machine.probe,
        runner_factory=factory,
        measured=measured,
        clock=clock,
        sleep=clock.sleep,
        estimator=estimator,
        when_idle=when_idle,
    )
    h = Harness(sched, machine, clock, runners, measured)
    sched.follow_pause(lambda: h.paused)
    return h


def run(coro: Coroutine[Any, Any, Any], timeout: float = 20.0) -> Any:
    """Run one scenario on a fresh event loop; a hang fails the test instead of blocking."""
    return asyncio.run(asyncio.wait_for(coro, timeout))


async def until(condition: Callable[[], bool], timeout: float = 5.0) -> None:
    """Let other tasks run until ``condition`` holds (deadline in real seconds)."""
    deadline = time.monotonic() + timeout
    while not condition():
        if time.monotonic() > deadline:
            raise AssertionError("condition not reached before the deadline")
        await asyncio.sleep(0.001)


async def request(h: Harness, model_id: str, **kw: Any) -> str:
    """One request through the scheduler, as the server makes it."""
    async with (
        h.sched.use(model_id, **kw) as runner,
        contextlib.aclosing(cast(Stream, runner.request("embed", {}))) as items,
    ):
        async for item in items:
            if item.get("type") == "done":
                return str(item["text"])
    raise AssertionError("no done event")
