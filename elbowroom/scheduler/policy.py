"""The scheduler's decisions as pure functions over a frozen picture of its state.

No I/O, no clock reads, no asyncio: the loop (``loop.py``) builds a ``State`` from its
runners and a memory snapshot, asks ``decide``/``expired`` what to do, and
applies the answer. Everything here is a function of its arguments, so every rule is
tested without processes.

Eviction order for a load (``decide``): only idle (no request in flight), unpinned, fully
loaded models are candidates, least recently used first; the load evicts the shortest
prefix of that order that makes it fit. Busy models are never evicted for a load: when
only they stand in the way, the load waits for them (``Wait``); when even evicting every
model would not make room, the load is refused with the numbers and what to change.

Pools: host RAM is ``bytes``/``limit``; each GPU pool ("gpu0", ...) has its own ceiling in
``State.pool_limits``, and a model or load holds ``pools`` bytes there. A load fits when
every pool it needs fits. Eviction frees the pool that is short: a model is taken (least
recently used first) only when it holds bytes in a pool still short, so a VRAM shortfall
evicts models on that GPU, not CPU-only ones. A refusal names the pool that cannot fit.
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, Protocol, TypeVar

from elbowroom.models.estimate import CTX_STEP
from elbowroom.models.spec import Holding, ModelKind
from elbowroom.units import format_size

HOST = "host"  # the host RAM pool's name in shortfalls and refusals


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
    pools: Mapping[str, int] = field(default_factory=dict)  # bytes in GPU pools ("gpu0")

    @property
    def idle(self) -> bool:
        return self.busy == 0 and not self.loading


@dataclass(frozen=True, slots=True)
class State:
    models: tuple[ModelState, ...]
    # The load ceiling less the server process's own bytes: what our models may hold (below
    # the soft threshold). The scheduler always passes this, from its last observation.
    limit: int
    pool_limits: Mapping[str, int] = field(default_factory=dict)  # GPU pools' ceilings

    @property
    def committed(self) -> int:
        return sum(m.bytes for m in self.models)

    @property
    def available(self) -> int:
        return max(0, self.limit - self.committed)

    def pool_committed(self, pool: str) -> int:
        if pool == HOST:
            return self.committed
        return sum(m.pools.get(pool, 0) for m in self.models)

    def pool_ceiling(self, pool: str) -> int:
        return self.limit if pool == HOST else self.pool_limits.get(pool, 0)

    def pool_available(self, pool: str) -> int:
        return max(0, self.pool_ceiling(pool) - self.pool_committed(pool))

    def get(self, model_id: str) -> ModelState | None:
        return next((m for m in self.models if m.id == model_id), None)

    def without(self, model_id: str) -> State:
        kept = tuple(m for m in self.models if m.id != model_id)
        return State(kept, self.limit, self.pool_limits)


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
    needed: int  # predicted host bytes of the model once loaded
    context: ContextCost | None = None  # LLMs only
    pools: Mapping[str, int] = field(default_factory=dict)  # predicted bytes per GPU pool

    def needs(self) -> dict[str, int]:
        """Bytes per pool, host first."""
        return {HOST: self.needed, **{p: b for p, b in self.pools.items() if b > 0}}


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
    # The pool that cannot fit ("host" or a GPU pool such as "gpu0"): needed, available,
    # evictable, limit and committed above are that pool's numbers.
    pool: str = HOST
    pools: Mapping[str, Mapping[str, int]] = field(default_factory=dict)  # every pool asked

    @property
    def shortfall(self) -> int:
        return max(0, self.needed - self.available - self.evictable)

    def message(self) -> str:
        where = "" if self.pool == HOST else f" in GPU pool {self.pool}"
        ceiling = (
            f"{format_size(self.limit)} load ceiling (load_fraction of the "
            f"{'memory' if self.pool == HOST else self.pool} limit)"
        )
        room = self.available + self.evictable
        if room >= self.limit:  # nothing is held: the whole ceiling is too small
            text = f"model {self.model!r} needs {format_size(self.needed)}{where}, more than the "
            text += f"whole {ceiling}"
        else:
            text = (
                f"model {self.model!r} needs {format_size(self.needed)}{where} but only "
                f"{format_size(room)} of the {ceiling} can be made free"
            )
        if self.suggestions:
            text += ": " + "; or ".join(s.message for s in self.suggestions)
        return text

    def details(self) -> dict[str, Any]:
        """The numbers of the 507 body (bytes as ints)."""
        return {
            "model": self.model,
            "pool": self.pool,
            "pools": {name: dict(nums) for name, nums in self.pools.items()},
            "needed": self.needed,
            "available": self.available,
            "evictable": self.evictable,
            "shortfall": self.shortfall,
            "ceiling": self.limit,  # the load ceiling the load was judged against
            "limit": self.limit,  # the same number, under its old name (kept for clients)
            "committed": self.committed,
            "loaded": [_loaded_entry(m) for m in self.loaded],
            "suggestions": [s.to_dict() for s in self.suggestions],
        }


Decision = Admit | Evict | Wait | Refuse


def _loaded_entry(m: ModelState) -> dict[str, Any]:
    entry: dict[str, Any] = {
        "id": m.id,
        "bytes": m.bytes,
        "pinned": m.pinned,
        "busy": m.busy,
        "loading": m.loading,
    }
    if m.pools:
        entry["pools"] = dict(m.pools)
    return entry


def eviction_order(models: Iterable[ModelState]) -> list[ModelState]:
    """Idle, unpinned, loaded models, least recently used first (ties by id: deterministic)."""
    candidates = [m for m in models if m.idle and not m.pinned]
    return sorted(candidates, key=lambda m: (m.last_used, m.id))


class HasBytes(Protocol):
    @property
    def bytes(self) -> int: ...


_B = TypeVar("_B", bound=HasBytes)


def lru_prefix(order: Sequence[_B], need: int) -> tuple[list[_B], int]:
    """The shortest prefix of ``order`` (least recently used first) whose bytes reach
    ``need``, and the bytes it frees (all of ``order`` when none does). The scheduler's
    507 suggestions and the pressure guard's unloads pick with it."""
    freed = 0
    taken: list[_B] = []
    for m in order:
        if freed >= need:
            break
        taken.append(m)
        freed += m.bytes
    return taken, freed


def _prefix_freeing(order: Sequence[ModelState], need: int) -> list[ModelState] | None:
    """The shortest prefix of ``order`` whose bytes reach ``need``; None if all cannot."""
    taken, freed = lru_prefix(order, need)
    return taken if freed >= need else None


def _held(m: ModelState, pool: str) -> int:
    return m.bytes if pool == HOST else m.pools.get(pool, 0)


def shortfalls(state: State, request: LoadRequest) -> dict[str, int]:
    """Bytes each pool is short of for ``request`` (pools that fit are left out)."""
    out = {}
    for pool, need in request.needs().items():
        short = need - state.pool_available(pool)
        if short > 0:
            out[pool] = short
    return out


def _covering(models: Sequence[ModelState], short: Mapping[str, int]) -> list[ModelState] | None:
    """Models from ``models`` (in order) that free every shortfall: a model is taken only
    while it holds bytes in a pool still short. None when all of them cannot."""
    left = dict(short)
    taken: list[ModelState] = []
    for m in models:
        if all(v <= 0 for v in left.values()):
            break
        if any(left[p] > 0 and _held(m, p) > 0 for p in left):
            taken.append(m)
            for p in left:
                left[p] -= _held(m, p)
    return taken if all(v <= 0 for v in left.values()) else None


def decide(state: State, request: LoadRequest) -> Decision:
    # A (re)load replaces whatever the model held: its old bytes are not in the way.
    state = state.without(request.model)
    short = shortfalls(state, request)
    if not short:
        return Admit()
    order = eviction_order(state.models)
    taken = _covering(order, short)
    if taken is not None:
        return Evict(tuple(m.id for m in taken), sum(m.bytes for m in taken))
    busy = sorted(
        (m for m in state.models if m.busy > 0 and not m.pinned), key=lambda m: (m.last_used, m.id)
    )
    if busy and _covering(order + busy, short) is not None:
        return Wait(tuple(m.id for m in busy))
    return refuse(state, request)


def _pool_numbers(state: State, request: LoadRequest) -> dict[str, dict[str, int]]:
    order = eviction_order(state.models)
    out = {}
    for pool, need in request.needs().items():
        out[pool] = {
            "needed": need,
            "available": state.pool_available(pool),
            "evictable": sum(_held(m, pool) for m in order),
            "limit": state.pool_ceiling(pool),
            "committed": state.pool_committed(pool),
        }
    return out


def refuse(state: State, request: LoadRequest) -> Refuse:
    """The refusal for ``request``, with what would make it fit, most practical first.

    It names the pool that cannot fit even after every idle model is evicted (a GPU pool
    before host RAM when both cannot); its numbers are the refusal's."""
    state = state.without(request.model)
    numbers = _pool_numbers(state, request)
    hopeless = [p for p, n in numbers.items() if n["needed"] > n["available"] + n["evictable"]]
    short = [p for p, n in numbers.items() if n["needed"] > n["available"]]
    ranked = sorted(hopeless or short or [HOST], key=lambda p: (p == HOST, p))
    pool = ranked[0]
    if pool != HOST:
        return _refuse_gpu(state, request, pool, numbers)
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
        pool=HOST,
        pools=numbers,
    )


def _refuse_gpu(
    state: State, request: LoadRequest, pool: str, numbers: dict[str, dict[str, int]]
) -> Refuse:
    n = numbers[pool]
    room = n["available"] + n["evictable"]
    suggestions = [
        Suggestion(
            "gpu_layers",
            f"leave gpu_layers unset (auto) so that what does not fit in {pool}'s "
            f"{format_size(room)} stays on the CPU, or set --gpu-layers 0",
            None,
        )
    ]
    pinned = [m for m in state.models if m.pinned and _held(m, pool) > 0]
    for m in sorted(pinned, key=lambda m: (m.last_used, m.id)):
        suggestions.append(
            Suggestion(
                "unload_pinned",
                f"unload pinned model {m.id!r} ({format_size(_held(m, pool))} in {pool}): "
                f"POST /api/models/{m.id}/unload",
                m.id,
            )
        )
    return Refuse(
        model=request.model,
        needed=n["needed"],
        available=n["available"],
        limit=n["limit"],
        committed=n["committed"],
        evictable=n["evictable"],
        loaded=tuple(state.models),
        suggestions=tuple(suggestions),
        pool=pool,
        pools=numbers,
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
