"""The pressure guard's response ladder: PURE. What to do about one memory sample.

No I/O, no clock, no asyncio: the guard (``guard.py``) builds the inputs from a monitor
sample and the scheduler, calls ``plan`` and applies the actions it returns. Each sample
is planned afresh, so every step is re-checked against the next reading.

The rungs, in order (each level does everything the levels below it do):

- normal: resume loads, tell LLM runners level 0,
  re-open admission once the hard episode is over.
- soft (usage over ``soft_fraction`` of the limit, or PSI over ``psi_soft``):
  pause new loads; tell LLM runners level 1 (they save their idle slots' KV state to the
  disk tier, so the unloads that follow lose no prefix); unload
  idle unpinned models, least recently used first (keep-alive does not protect them),
  until the bytes over the soft threshold are freed. When usage is not over in bytes (the
  level comes from PSI, which is a 10 s average and lags), one model goes when the level
  rises and no more: unloading one per sample would empty the server for a stall that has
  already ended. Usage is counted net of the unloads still under way (``Reading.freeing``),
  so one excess is never answered twice.
- hard (over ``hard_fraction``, or PSI over ``psi_hard``): refuse new requests with 503
  + Retry-After until back under soft; unload every idle unpinned model; then abort ONE
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
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from elbowroom.memory.types import Pressure
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

    def message(self) -> str:
        return f"pausing model loads: {_over(self.usage, self.soft, 'soft')}"


@dataclass(frozen=True, slots=True)
class ResumeLoads:
    usage: int
    soft: int

    def message(self) -> str:
        return f"resuming model loads: {_under(self.usage, self.soft, 'soft')}"


@dataclass(frozen=True, slots=True)
class SetPressure:
    """Send a level to an LLM runner: >= 1 saves its idle slots to disk, 2 aborts generation."""

    model: str
    level: Pressure
    previous: Pressure

    def message(self) -> str:
        return f"runner {self.model}: pressure {self.previous.label} -> {self.level.label}" + (
            " (it saves its idle slots to the KV disk tier)" if self.level > self.previous else ""
        )


@dataclass(frozen=True, slots=True)
class Unload:
    model: str
    bytes: int
    level: Pressure
    usage: int
    threshold: int  # the threshold usage is over
    pinned: bool = False
    busy: bool = False  # evicted with its generations aborted: goes once they have ended

    def message(self) -> str:
        what = "pinned model" if self.pinned else "idle model"
        if self.busy:
            what = "busy model (its generations aborted)"
        return (
            f"unloading {what} {self.model} ({format_size(self.bytes)}) at "
            f"{self.level.label} pressure: {_over(self.usage, self.threshold, self.level.label)}"
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

    def message(self) -> str:
        return (
            f"aborting the {self.reason} generation {self.request_id} on {self.model} "
            f"(runner holds {format_size(self.bytes)}): {_over(self.usage, self.hard, 'hard')}"
        )


@dataclass(frozen=True, slots=True)
class CloseAdmission:
    retry_after: float
    usage: int
    hard: int

    def message(self) -> str:
        return (
            f"refusing new requests (503, Retry-After {self.retry_after:g} s): "
            f"{_over(self.usage, self.hard, 'hard')}"
        )


@dataclass(frozen=True, slots=True)
class OpenAdmission:
    usage: int
    soft: int

    def message(self) -> str:
        return f"admitting requests again: {_under(self.usage, self.soft, 'soft')}"


Action = PauseLoads | ResumeLoads | SetPressure | Unload | Abort | CloseAdmission | OpenAdmission


def _over(usage: int, threshold: int, name: str) -> str:
    return (
        f"usage {format_size(usage)} is over the {name} threshold {format_size(threshold)}"
        if usage > threshold
        else f"memory pressure (usage {format_size(usage)}, {name} threshold "
        f"{format_size(threshold)})"
    )


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
) -> list[Action]:
    """The actions for one sample at ``level`` (``prev``: the previous sample's level;
    ``unloading``: models the guard's unloads are still taking away, left alone).

    Order matters and is the order to apply them in: gates first (so nothing new starts
    while memory is being freed), then runner levels, unloads, and at most one abort.
    """
    actions: list[Action] = []
    soft_or_worse = level >= Pressure.SOFT
    hard = level >= Pressure.HARD

    if soft_or_worse and not gate.loads_paused:
        actions.append(PauseLoads(level, reading.usage, reading.soft))
    if hard and gate.admission_open:
        actions.append(CloseAdmission(retry_after, reading.usage, reading.hard))
    # Admission re-opens only under soft (not merely under hard): a server that flaps
    # between refusing and admitting would push usage straight back up.
    if level == Pressure.NORMAL:
        if gate.loads_paused:
            actions.append(ResumeLoads(reading.usage, reading.soft))
        if not gate.admission_open:
            actions.append(OpenAdmission(reading.usage, reading.soft))

    candidates = [m for m in models if m.id not in unloading]
    unloads = _unloads(level, prev, candidates, reading) if soft_or_worse else []
    freed = sum(u.bytes for u in unloads)

    abort: Abort | None = None
    if hard:
        abort = _abort(inflight, gate.aborts, reading, freed)
        nothing_else = freed == 0 and reading.freeing == 0
        if abort is None and nothing_else and not any(i.aborting for i in inflight):
            unloads = _pinned_unloads(candidates, reading)
        evict = _evict(abort, candidates, reading, freed)
        if evict is not None:
            unloads.append(evict)

    aborting_models = {i.model for i in inflight if i.aborting} | set(unloading)
    if abort is not None:
        aborting_models.add(abort.model)
    gone = {u.model for u in unloads if not u.busy}
    for m in models:
        if not m.llm or m.id in gone:
            continue
        want = Pressure.HARD if m.id in aborting_models else min(level, Pressure.SOFT)
        if want != m.runner_level:
            actions.append(SetPressure(m.id, Pressure(want), m.runner_level))

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
    if level >= Pressure.HARD:
        taken = order
    else:
        excess = reading.usage - reading.soft
        # No byte excess: either unloads under way cover it (wait for them), or the level
        # comes from PSI: one model on the rising edge only.
        first = order[:1] if prev < level and reading.freeing == 0 else []
        taken = _prefix(order, excess) if excess > 0 else first
    threshold = reading.hard if level >= Pressure.HARD else reading.soft
    return [Unload(m.id, m.bytes, level, reading.usage, threshold) for m in taken]


def _prefix(order: Sequence[LoadedModel], need: int) -> list[LoadedModel]:
    """The shortest LRU prefix whose bytes reach ``need`` (all of them if none does)."""
    taken: list[LoadedModel] = []
    freed = 0
    for m in order:
        if freed >= need:
            break
        taken.append(m)
        freed += m.bytes
    return taken


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
