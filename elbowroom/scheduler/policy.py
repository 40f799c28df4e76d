"""The scheduler's decisions as pure functions over a frozen picture of its state.

No I/O, no clock reads, no asyncio: the loop (``loop.py``) builds a ``State`` from its
runners and a memory snapshot, asks ``decide``/``expired``/``relieve`` what to do, and
applies the answer. Everything here is a function of its arguments, so every rule is
tested without processes.

Eviction order for a load (``decide``): only idle (no request in flight), unpinned, fully
loaded models are candidates, least recently used first; the load evicts the shortest
prefix of that order that makes it fit. Busy models are never evicted for a load: when
only they stand in the way, the load waits for them (``Wait``); when even evicting every
model would not make room, the load is refused with the numbers and what to change.
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
from typing import Any

from elbowroom.memory.types import Pressure
from elbowroom.models.spec import Holding, ModelKind
from elbowroom.units import format_size

# Auto-sized contexts and suggested --ctx values are multiples of this (llama.cpp pads the
# KV cache to 256 cells anyway, so a finer suggestion would not save anything).
CTX_STEP = 256


@dataclass(frozen=True, slots=True)
class ModelState:
    """One loaded (or loading) model as the policy sees it."""

    id: str
    kind: ModelKind
    holding: Holding
    bytes: int  # measured resident (anonymous + file-backed), or predicted while loading
    pinned: bool = False
    busy: int = 0  # requests in flight
    last_used: float = 0.0  # clock seconds
    expires_at: float | None = None  # clock seconds; None: never expires
    loading: bool = False  # its bytes are a reservation for a load in progress

    @property
    def idle(self) -> bool:
        return self.busy == 0 and not self.loading


@dataclass(frozen=True, slots=True)
class State:
    models: tuple[ModelState, ...]
    limit: int  # the load ceiling: bytes our models may hold (below the soft threshold)

    @property
    def committed(self) -> int:
        return sum(m.bytes for m in self.models)

    @property
    def available(self) -> int:
        return max(0, self.limit - self.committed)

    def get(self, model_id: str) -> ModelState | None:
        return next((m for m in self.models if m.id == model_id), None)

    def without(self, model_id: str) -> State:
        return State(tuple(m for m in self.models if m.id != model_id), self.limit)


@dataclass(frozen=True, slots=True)
class ContextCost:
    """How an LLM's predicted bytes depend on its context, for the suggestions of a refusal.

    ``needed = fixed + per_token * n_ctx`` (``per_token`` covers every slot); ``per_token_q8``
    is the same with a q8_0 KV cache (None when already q8_0 or smaller)."""

    n_ctx: int
    kv_type: str
    fixed: int
    per_token: float
    min_ctx: int
    per_token_q8: float | None = None


@dataclass(frozen=True, slots=True)
class LoadRequest:
    model: str
    needed: int  # predicted bytes of the model once loaded
    context: ContextCost | None = None  # LLMs only


@dataclass(frozen=True, slots=True)
class Admit:
    """It fits now: load it."""


@dataclass(frozen=True, slots=True)
class Evict:
    """Unload these (in order), then decide again."""

    ids: tuple[str, ...]
    freed: int  # bytes the evicted models hold


@dataclass(frozen=True, slots=True)
class Wait:
    """It fits once these busy models go idle (and are evicted): wait, then decide again."""

    busy: tuple[str, ...]


@dataclass(frozen=True, slots=True)
class Suggestion:
    action: str  # "ctx" | "kv_type" | "unload_pinned" | "stop_busy" | "free_memory"
    message: str
    value: Any = None

    def to_dict(self) -> dict[str, Any]:
        return {"action": self.action, "message": self.message, "value": self.value}


@dataclass(frozen=True, slots=True)
class Refuse:
    """It cannot fit even after evicting everything evictable."""

    model: str
    needed: int
    available: int  # limit - committed, now
    limit: int
    committed: int
    evictable: int  # bytes that evicting every idle unpinned model would free
    loaded: tuple[ModelState, ...]
    suggestions: tuple[Suggestion, ...] = field(default=())

    @property
    def shortfall(self) -> int:
        return max(0, self.needed - self.available - self.evictable)

    def message(self) -> str:
        text = (
            f"model {self.model!r} needs {format_size(self.needed)} but only "
            f"{format_size(self.available + self.evictable)} of the "
            f"{format_size(self.limit)} load ceiling (load_fraction of the memory limit) "
            "can be made free"
        )
        if self.suggestions:
            text += ": " + "; or ".join(s.message for s in self.suggestions)
        return text

    def details(self) -> dict[str, Any]:
        """The numbers of the 507 body (bytes as ints)."""
        return {
            "model": self.model,
            "needed": self.needed,
            "available": self.available,
            "evictable": self.evictable,
            "shortfall": self.shortfall,
            "limit": self.limit,
            "committed": self.committed,
            "loaded": [
                {
                    "id": m.id,
                    "bytes": m.bytes,
                    "pinned": m.pinned,
                    "busy": m.busy,
                    "loading": m.loading,
                }
                for m in self.loaded
            ],
            "suggestions": [s.to_dict() for s in self.suggestions],
        }


Decision = Admit | Evict | Wait | Refuse


def eviction_order(models: Iterable[ModelState]) -> list[ModelState]:
    """Idle, unpinned, loaded models, least recently used first (ties by id: deterministic)."""
    candidates = [m for m in models if m.idle and not m.pinned]
    return sorted(candidates, key=lambda m: (m.last_used, m.id))


def _prefix_freeing(order: Sequence[ModelState], need: int) -> list[ModelState] | None:
    """The shortest prefix of ``order`` whose bytes reach ``need``; None if all cannot."""
    freed = 0
    taken: list[ModelState] = []
    for m in order:
        if freed >= need:
            break
        taken.append(m)
        freed += m.bytes
    return taken if freed >= need else None


def decide(state: State, request: LoadRequest) -> Decision:
    # A (re)load replaces whatever the model held: its old bytes are not in the way.
    state = state.without(request.model)
    available = state.available
    if request.needed <= available:
        return Admit()
    shortfall = request.needed - available
    order = eviction_order(state.models)
    taken = _prefix_freeing(order, shortfall)
    if taken is not None:
        return Evict(tuple(m.id for m in taken), sum(m.bytes for m in taken))
    evictable = sum(m.bytes for m in order)
    busy = [m for m in state.models if m.busy > 0 and not m.pinned]
    if busy and evictable + sum(m.bytes for m in busy) >= shortfall:
        return Wait(tuple(m.id for m in sorted(busy, key=lambda m: (m.last_used, m.id))))
    return refuse(state, request)


def refuse(state: State, request: LoadRequest) -> Refuse:
    """The refusal for ``request``, with what would make it fit, most practical first."""
    state = state.without(request.model)
    order = eviction_order(state.models)
    evictable = sum(m.bytes for m in order)
    room = state.available + evictable  # the most this load can get without help
    others = list(state.models)
    suggestions: list[Suggestion] = []

    ctx = request.context
    if ctx is not None and ctx.per_token > 0:
        fit = _largest_ctx(room - ctx.fixed, ctx.per_token)
        if ctx.min_ctx <= fit < ctx.n_ctx:
            suggestions.append(
                Suggestion("ctx", f"set --ctx {fit} (context {ctx.n_ctx} does not fit)", fit)
            )
        if ctx.per_token_q8 is not None and ctx.fixed + ctx.per_token_q8 * ctx.n_ctx <= room:
            suggestions.append(
                Suggestion("kv_type", "set --kv-type q8_0 (about halves the KV cache)", "q8_0")
            )

    pinned = sorted(
        (m for m in others if m.pinned and m.busy == 0 and not m.loading),
        key=lambda m: (m.last_used, m.id),
    )
    picked = _prefix_freeing(pinned, request.needed - room)
    if picked is not None:
        for m in picked:
            suggestions.append(
                Suggestion(
                    "unload_pinned",
                    f"unload pinned model {m.id!r} ({format_size(m.bytes)}): "
                    f"POST /api/models/{m.id}/unload",
                    m.id,
                )
            )

    busy = [m for m in others if m.busy > 0]
    if busy and room + sum(m.bytes for m in busy + pinned) >= request.needed:
        ids = [m.id for m in busy]
        suggestions.append(
            Suggestion(
                "stop_busy",
                "wait for or stop the busy model(s) " + ", ".join(repr(i) for i in ids),
                ids,
            )
        )

    if not suggestions:
        suggestions.append(
            Suggestion(
                "free_memory",
                f"free {format_size(request.needed - room)} on the machine, raise the limit "
                "or use a smaller model",
                request.needed - room,
            )
        )
    return Refuse(
        model=request.model,
        needed=request.needed,
        available=state.available,
        limit=state.limit,
        committed=state.committed,
        evictable=evictable,
        loaded=tuple(others),
        suggestions=tuple(suggestions),
    )


def _largest_ctx(budget: int, per_token: float) -> int:
    if budget <= 0:
        return 0
    return math.floor(budget / per_token / CTX_STEP) * CTX_STEP


def expired(state: State, now: float) -> list[str]:
    """Idle unpinned models whose keep-alive has run out, oldest first."""
    due = [
        m
        for m in state.models
        if m.idle and not m.pinned and m.expires_at is not None and m.expires_at <= now
    ]
    return [m.id for m in sorted(due, key=lambda m: (m.expires_at or 0.0, m.id))]


def relieve(state: State, pressure: Pressure, excess: int) -> list[str]:
    """Models to unload under memory pressure (keep-alive does not protect them).

    ``excess`` is how many bytes over the soft threshold elbowroom's usage stands (0 or less
    when the pressure comes from elsewhere, e.g. PSI or other processes). Soft: idle unpinned
    models, least recently used first, until ``excess`` is freed, or the single least recently
    used one when the excess is not ours (the guard calls again while pressure lasts, so
    relief escalates one model at a time). Hard: every idle unpinned model. Busy and pinned
    models are never unloaded here: the guard aborts generations for those.
    """
    if pressure == Pressure.NORMAL:
        return []
    order = eviction_order(state.models)
    if pressure >= Pressure.HARD:
        return [m.id for m in order]
    if excess <= 0:
        return [m.id for m in order[:1]]
    taken = _prefix_freeing(order, excess)
    return [m.id for m in (taken if taken is not None else order)]
