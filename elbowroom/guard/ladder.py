"""The pressure guard's response ladder: PURE. What to do about one memory sample.

No I/O, no clock, no asyncio: the guard (``guard.py``) builds the inputs from a monitor
sample and the scheduler, calls ``plan`` and applies the actions it returns. Each sample
is planned afresh, so every step is re-checked against the next reading.

The rungs, in order (each level does everything the levels below it do):

- normal: resume loads, tell LLM runners level 0,
  re-open admission once the hard episode is over.
- soft (usage over ``soft_fraction`` of the limit, or PSI over ``psi_soft``):
  pause new loads; tell LLM runners level 1 (they write nothing under pressure: a slot
  save stalls the engine and adds its state to the page cache; an unload at soft still
  saves the runner's slots as it closes); unload
  idle unpinned models, least recently used first (keep-alive does not protect them),
  until the bytes over the soft threshold are freed; stop a load in progress unless
  those unloads alone cover the excess (a load paused a moment too late is still a load
  into memory that is running out). When usage is not over in bytes (the
  level comes from PSI, which is a 10 s average and lags), one model goes when the level
  rises and no more: unloading one per sample would empty the server for a stall that has
  already ended. Usage is counted net of the unloads still under way (``Reading.freeing``),
  so one excess is never answered twice.
- hard (over ``hard_fraction``, or PSI over ``psi_hard``): refuse new requests with 503
  + Retry-After until back under soft; unload every idle unpinned model and stop every
  load in progress; then abort ONE
  generation per sample (first the newest: least work lost; then the largest: most memory
  freed), and only when the unloads in progress cannot get usage under the hard threshold.
  An abort frees little by itself (an LLM's KV cache is allocated when it loads), so when
  usage is over the hard threshold in bytes the aborted model is unloaded too, as soon as
  its requests have ended (its runner stays at level 2 meanwhile, refusing new work): a
  503 with Retry-After now instead of the kernel's OOM killer a moment later, which takes
  whatever it picks (a runner with all its requests, or someone else's process).
  While an abort has not landed yet, no second one is chosen; a PSI-driven hard episode
  (usage under the hard threshold in bytes) aborts at most one and evicts nothing. Idle
  *pinned* models go only at hard when nothing else is left to free; a busy pinned model
  has its generation aborted but is never evicted.

GPU pools (``gpus``: one ``PoolReading`` per NVIDIA GPU, our bytes there against that
pool's thresholds) climb the same rungs with only the models that hold bytes on that GPU,
and they go first: a GPU at soft unloads its idle models; a GPU at hard chooses the
sample's one abort among the generations running on it (then evicts that model when the
GPU is over its hard threshold in bytes) before host RAM's rungs may abort anything.
VRAM freed is what relieves a GPU; host RAM's rungs would pick by host bytes and could
abort CPU work that holds nothing on the card. The gates (loads paused, admission closed)
follow the highest level of any pool.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, replace

from elbowroom.memory.types import Pressure
from elbowroom.scheduler.policy import lru_prefix
from elbowroom.units import format_size


@dataclass(frozen=True, slots=True)
class InFlight:
    """One request being served."""

    request_id: str
    model: str
    started_at: float  # clock seconds
    bytes: int  # its runner's resident bytes: the most aborting it can free
    abortable: bool = True  # LLM generations check the pressure level every 16 tokens
    aborting: bool = False  # an abort was sent and has not landed yet


@dataclass(frozen=True, slots=True)
class LoadedModel:
    """One loaded model as the guard sees it."""

    id: str
    bytes: int  # measured resident bytes
    last_used: float  # clock seconds
    busy: int = 0  # requests in flight
    pinned: bool = False
    llm: bool = False  # its runner takes pressure levels (slot saves, per-token checks)
    runner_level: Pressure = Pressure.NORMAL  # the level last sent to its runner
    pools: tuple[tuple[str, int], ...] = ()  # bytes it holds in GPU pools ("gpu0", ...)
    loading: bool = False  # a load in progress (guard/adapter.py): stopped at soft or hard

    def pool_bytes(self, pool: str) -> int:
        return sum(b for p, b in self.pools if p == pool)


@dataclass(frozen=True, slots=True)
class Reading:
    """The numbers of one sample the ladder compares (bytes).

    ``usage`` is net of ``freeing``: the bytes of unloads under way (or finished after the
    sample was measured) that the measurement still counted.
    """

    usage: int
    limit: int
    soft: int  # usage at which the level turns soft
    hard: int  # ... and hard
    freeing: int = 0


@dataclass(frozen=True, slots=True)
class PoolReading:
    """One GPU pool's level and numbers: our bytes there against its own thresholds."""

    name: str  # "gpu0"
    level: Pressure
    reading: Reading
    why: str | None = None


@dataclass(frozen=True, slots=True)
class Gate:
    """What the guard enforces right now (its state between samples)."""

    loads_paused: bool = False
    admission_open: bool = True
    aborts: int = 0  # aborts sent in the current hard episode


# --- actions: each carries the numbers its log line shows -------------------------------


@dataclass(frozen=True, slots=True)
class PauseLoads:
    level: Pressure
    usage: int
    soft: int
    why: str | None = None  # when the level is not from these numbers (the trend)
    pool: str = "host"  # the pool whose numbers these are

    def message(self) -> str:
        return (
            f"pausing model loads{_on(self.pool)}: {_over(self.usage, self.soft, 'soft', self.why)}"
        )


@dataclass(frozen=True, slots=True)
class ResumeLoads:
    usage: int
    soft: int

    def message(self) -> str:
        return f"resuming model loads: {_under(self.usage, self.soft, 'soft')}"


@dataclass(frozen=True, slots=True)
class SetPressure:
    """Send a level to an LLM runner: 2 refuses and aborts generation (1 is recorded: an
    unload at soft saves the slots, one at hard does not)."""

    model: str
    level: Pressure
    previous: Pressure

    def message(self) -> str:
        return f"runner {self.model}: pressure {self.previous.label} -> {self.level.label}"


@dataclass(frozen=True, slots=True)
class Unload:
    model: str
    bytes: int
    level: Pressure
    usage: int
    threshold: int  # the threshold usage is over
    pinned: bool = False
    busy: bool = False  # evicted with its generations aborted: goes once they have ended
    pool: str = "host"  # the pool whose pressure chose it (usage/threshold are that pool's)
    pool_bytes: int = 0  # what it holds in that pool, when that is a GPU
    why: str | None = None  # the signal that set the level when usage is not over
    loading: bool = False  # a load in progress: its runner is killed, its waiters get 503

    @property
    def cause(self) -> str | None:
        """What kind of unload this is when not an idle model's (the counters' reason)."""
        if self.loading:
            return "loading"
        if self.pinned:
            return "pinned"
        return "busy" if self.busy else None

    def message(self) -> str:
        if self.loading:
            return (
                f"stopping the load of {self.model} ({format_size(self.bytes)} so far) at "
                f"{self.level.label} pressure: "
                f"{_over(self.usage, self.threshold, self.level.label, self.why)}"
            )
        what = "pinned model" if self.pinned else "idle model"
        if self.busy:
            what = "busy model (its generations aborted)"
        return (
            f"unloading {what} {self.model} ({_held(self.bytes, self.pool, self.pool_bytes)})"
            f" at {self.level.label} pressure{_on(self.pool)}: "
            f"{_over(self.usage, self.threshold, self.level.label, self.why)}"
        )


@dataclass(frozen=True, slots=True)
class Abort:
    request_id: str
    model: str
    reason: str  # "newest" | "largest"
    started_at: float
    bytes: int
    usage: int
    hard: int
    pool: str = "host"
    pool_bytes: int = 0  # what the runner holds in that pool, when that is a GPU
    why: str | None = None  # the signal that set the level when usage is not over

    def message(self) -> str:
        return (
            f"aborting the {self.reason} generation {self.request_id} on {self.model} "
            f"(runner holds {_held(self.bytes, self.pool, self.pool_bytes)}): "
            f"{_over(self.usage, self.hard, 'hard', self.why)}"
        )


@dataclass(frozen=True, slots=True)
class CloseAdmission:
    retry_after: float
    usage: int
    hard: int
    pool: str = "host"  # the pool whose numbers these are
    why: str | None = None  # the signal that set the level when usage is not over

    def message(self) -> str:
        return (
            f"refusing new requests (503, Retry-After {self.retry_after:g} s): "
            f"{_over(self.usage, self.hard, 'hard', self.why)}{_on(self.pool)}"
        )


@dataclass(frozen=True, slots=True)
class OpenAdmission:
    usage: int
    soft: int

    def message(self) -> str:
        return f"admitting requests again: {_under(self.usage, self.soft, 'soft')}"


Action = PauseLoads | ResumeLoads | SetPressure | Unload | Abort | CloseAdmission | OpenAdmission


def _over(usage: int, threshold: int, name: str, why: str | None = None) -> str:
    """Why the level is ``name``: our usage when it is over the threshold, else the signal
    that moved the level (``why``: PSI, the machine's available memory, the trend)."""
    if usage > threshold:
        return f"usage {format_size(usage)} is over the {name} threshold {format_size(threshold)}"
    if why:
        return (
            f"memory pressure: {why} (our usage {format_size(usage)} is under the {name} "
            f"threshold {format_size(threshold)})"
        )
    return (
        f"memory pressure (usage {format_size(usage)}, {name} threshold {format_size(threshold)})"
    )


def _on(pool: str) -> str:
    return "" if pool == "host" else f" on {pool}"


def _held(host: int, pool: str, pool_bytes: int) -> str:
    """A model's bytes: host RAM, and on a GPU pool what it holds there as well."""
    if pool == "host":
        return format_size(host)
    return f"{format_size(pool_bytes)} on {pool}, {format_size(host)} host RAM"


def _under(usage: int, threshold: int, name: str) -> str:
    return f"usage {format_size(usage)} is under the {name} threshold {format_size(threshold)}"


# --- the ladder ---------------------------------------------------------------------------


def plan(
    level: Pressure,
    prev: Pressure,
    inflight: Sequence[InFlight],
    models: Sequence[LoadedModel],
    *,
    reading: Reading,
    gate: Gate,
    retry_after: float = 5.0,
    unloading: frozenset[str] = frozenset(),
    gpus: Sequence[PoolReading] = (),
    why: str | None = None,
) -> list[Action]:
    """The actions for one sample at host ``level`` (``prev``: the previous sample's;
    ``unloading``: models the guard's unloads are still taking away, left alone; ``gpus``:
    the GPU pools' levels, which go first; ``why``: the reason for ``level`` when it is not
    in ``reading``'s numbers, for the log).

    Order matters and is the order to apply them in: gates first (so nothing new starts
    while memory is being freed), then runner levels, unloads, and at most one abort.
    """
    actions: list[Action] = []
    soft_or_worse = level >= Pressure.SOFT
    hard = level >= Pressure.HARD
    # The gates follow the highest pool; their numbers are that pool's.
    top = max(gpus, key=lambda g: g.level, default=None)
    overall, gate_reading, gate_why, gate_pool = level, reading, why, "host"
    if top is not None and top.level > level:
        overall, gate_reading, gate_why, gate_pool = top.level, top.reading, None, top.name

    if overall >= Pressure.SOFT and not gate.loads_paused:
        actions.append(
            PauseLoads(overall, gate_reading.usage, gate_reading.soft, gate_why, gate_pool)
        )
    if overall >= Pressure.HARD and gate.admission_open:
        actions.append(
            CloseAdmission(
                retry_after, gate_reading.usage, gate_reading.hard, gate_pool, why=gate_why
            )
        )
    # Admission re-opens only under soft (not merely under hard): a server that flaps
    # between refusing and admitting would push usage straight back up.
    if overall == Pressure.NORMAL:
        if gate.loads_paused:
            actions.append(ResumeLoads(reading.usage, reading.soft))
        if not gate.admission_open:
            actions.append(OpenAdmission(reading.usage, reading.soft))

    candidates = [m for m in models if m.id not in unloading]
    unloads, abort = _gpu_rungs(gpus, inflight, candidates, gate)
    chosen = {u.model for u in unloads}
    host = _unloads(level, prev, candidates, reading) if soft_or_worse else []
    unloads += [u for u in host if u.model not in chosen]
    freed = sum(u.bytes for u in unloads)  # host bytes: GPU unloads free host RAM too

    if hard and abort is None:
        abort = _abort(inflight, gate.aborts, reading, freed)
        nothing_else = freed == 0 and reading.freeing == 0 and not unloads
        if abort is None and nothing_else and not any(i.aborting for i in inflight):
            unloads = _pinned_unloads(candidates, reading)
        evict = _evict(abort, candidates, reading, freed)
        if evict is not None and evict.model not in chosen:
            unloads.append(evict)

    aborting_models = {i.model for i in inflight if i.aborting} | set(unloading)
    if abort is not None:
        aborting_models.add(abort.model)
    gone = {u.model for u in unloads if not u.busy}
    for m in models:
        if not m.llm or m.id in gone:
            continue
        want = Pressure.HARD if m.id in aborting_models else min(overall, Pressure.SOFT)
        if want != m.runner_level:
            actions.append(SetPressure(m.id, Pressure(want), m.runner_level))

    if why is not None:  # host actions name the signal that set the level (the log's why)
        unloads = [u if u.pool != "host" else replace(u, why=why) for u in unloads]
        if abort is not None and abort.pool == "host":
            abort = replace(abort, why=why)
    actions.extend(unloads)
    if abort is not None:
        actions.append(abort)
    return actions


def _unloads(
    level: Pressure, prev: Pressure, models: Sequence[LoadedModel], reading: Reading
) -> list[Unload]:
    order = sorted(
        (m for m in models if m.busy == 0 and not m.pinned),
        key=lambda m: (m.last_used, m.id),
    )
    loads = sorted((m for m in models if m.loading), key=lambda m: m.id)
    if level >= Pressure.HARD:
        taken = order
        stop = loads
    else:
        excess = reading.usage - reading.soft
        # No byte excess: either unloads under way cover it (wait for them), or the level
        # comes from PSI: one model on the rising edge only.
        first = order[:1] if prev < level and reading.freeing == 0 else []
        taken = lru_prefix(order, excess)[0] if excess > 0 else first
        # A load in progress is new bytes arriving into memory under pressure, as a paused
        # load would be: it is stopped unless the idle unloads alone bring usage under soft
        # (with no byte excess the level comes from the trend or PSI: memory is still
        # rising, and a load finishing into it would take requests that the next rung must
        # then abort, with nothing idle left to unload).
        covered = excess > 0 and sum(m.bytes for m in taken) >= excess
        stop = [] if covered else loads
    threshold = reading.hard if level >= Pressure.HARD else reading.soft
    return [Unload(m.id, m.bytes, level, reading.usage, threshold) for m in taken] + [
        Unload(m.id, m.bytes, level, reading.usage, threshold, pinned=True, loading=True)
        for m in stop
    ]


def _gpu_rungs(
    gpus: Sequence[PoolReading],
    inflight: Sequence[InFlight],
    models: Sequence[LoadedModel],
    gate: Gate,
) -> tuple[list[Unload], Abort | None]:
    """The unloads and the (at most one) abort GPU pools ask for, hardest pool first: the
    host's rungs seen through one pool (its models, with their bytes on that GPU). The
    actions carry host bytes: that is what the guard counts as being freed in host RAM."""
    unloads: list[Unload] = []
    abort: Abort | None = None
    host_bytes = {m.id: m.bytes for m in models}
    for g in sorted(gpus, key=lambda g: (-g.level, g.name)):
        if g.level < Pressure.SOFT:
            continue
        on_gpu = [replace(m, bytes=m.pool_bytes(g.name)) for m in models if m.pool_bytes(g.name)]
        ids = {m.id for m in on_gpu}
        # prev = level: GPU levels are in bytes, there is no PSI edge to wait for
        taken = _unloads(g.level, g.level, on_gpu, g.reading)
        freed = sum(u.bytes for u in taken)
        picked = list(taken)
        if g.level >= Pressure.HARD and abort is None:
            here = [
                replace(i, bytes=next(m.bytes for m in on_gpu if m.id == i.model))
                for i in inflight
                if i.model in ids
            ]
            # one abort at a time across all pools: one that has not landed blocks it
            pending = any(i.aborting for i in inflight)
            found = None if pending else _abort(here, gate.aborts, g.reading, freed)
            if found is not None:
                abort = replace(
                    found, pool=g.name, bytes=host_bytes[found.model], pool_bytes=found.bytes
                )
                evict = _evict(found, on_gpu, g.reading, freed)
                if evict is not None:
                    picked.append(evict)
        for u in picked:
            if all(u.model != x.model for x in unloads):
                unloads.append(
                    replace(u, bytes=host_bytes[u.model], pool=g.name, pool_bytes=u.bytes)
                )
    return unloads, abort


def _evict(
    abort: Abort | None, models: Sequence[LoadedModel], reading: Reading, freed: int
) -> Unload | None:
    """The aborted generation's model, unloaded once its requests end: when usage is over
    the hard threshold in bytes and the idle unloads do not cover it."""
    if abort is None or reading.usage - reading.hard <= freed:
        return None
    m = next((m for m in models if m.id == abort.model), None)
    if m is None or m.pinned:
        return None
    return Unload(m.id, m.bytes, Pressure.HARD, reading.usage, reading.hard, busy=m.busy > 0)


def _pinned_unloads(models: Sequence[LoadedModel], reading: Reading) -> list[Unload]:
    """Last resort at hard: the least recently used idle pinned model."""
    pinned = sorted(
        (m for m in models if m.busy == 0 and m.pinned),
        key=lambda m: (m.last_used, m.id),
    )
    return [
        Unload(m.id, m.bytes, Pressure.HARD, reading.usage, reading.hard, pinned=True)
        for m in pinned[:1]
    ]


def _abort(inflight: Sequence[InFlight], aborts: int, reading: Reading, freed: int) -> Abort | None:
    if any(i.aborting for i in inflight):
        return None  # one at a time: re-check once the last abort has landed
    need = reading.usage - reading.hard
    if need > 0 and freed >= need:
        return None  # the unloads under way are enough
    if need <= 0 and (freed > 0 or reading.freeing > 0 or aborts > 0):
        return None  # pressure not in bytes (PSI): unloads first, then one abort at most
    candidates = [i for i in inflight if i.abortable]
    if not candidates:
        return None
    if aborts == 0:
        target, reason = max(candidates, key=lambda i: (i.started_at, i.request_id)), "newest"
    else:
        target = max(candidates, key=lambda i: (i.bytes, i.started_at, i.request_id))
        reason = "largest"
    return Abort(
        target.request_id,
        target.model,
        reason,
        target.started_at,
        target.bytes,
        reading.usage,
        reading.hard,
    )


def next_gate(gate: Gate, level: Pressure, actions: Sequence[Action]) -> Gate:
    """The gate after applying ``actions`` (pure, so the guard and tests agree on it)."""
    paused = gate.loads_paused
    admission = gate.admission_open
    aborts = gate.aborts
    for a in actions:
        if isinstance(a, PauseLoads):
            paused = True
        elif isinstance(a, ResumeLoads):
            paused = False
        elif isinstance(a, CloseAdmission):
            admission = False
        elif isinstance(a, OpenAdmission):
            admission = True
        elif isinstance(a, Abort):
            aborts += 1
    if level == Pressure.NORMAL:
        aborts = 0  # the episode is over: the next one starts with the newest again
    return Gate(paused, admission, aborts)
