"""policy.decide / expired: every rule, no processes, no clock."""

from __future__ import annotations

from elbowroom.models.spec import Holding, ModelKind
from elbowroom.scheduler.policy import (
    Admit,
    ContextCost,
    Evict,
    LoadRequest,
    ModelState,
    Refuse,
    State,
    Wait,
    decide,
    expired,
)
from elbowroom.units import MiB


def m(
    id: str,
    mib: int,
    *,
    last_used: float = 0.0,
    busy: int = 0,
    pinned: bool = False,
    loading: bool = False,
    expires_at: float | None = None,
) -> ModelState:
    return ModelState(
        id=id,
        kind=ModelKind.LLM,
        holding=Holding.MMAP,
        bytes=mib * MiB,
        pinned=pinned,
        busy=busy,
        last_used=last_used,
        expires_at=expires_at,
        loading=loading,
    )


def state(limit_mib: int, *models: ModelState) -> State:
    return State(models=models, limit=limit_mib * MiB)


def req(mib: int, model: str = "new", context: ContextCost | None = None) -> LoadRequest:
    return LoadRequest(model=model, needed=mib * MiB, context=context)


# --- decide: admit


def test_admits_when_it_fits_exactly() -> None:
    s = state(1000, m("a", 400))
    assert decide(s, req(600)) == Admit()


def test_admits_into_an_empty_machine() -> None:
    assert decide(state(100), req(100)) == Admit()


def test_reservations_of_loading_models_count_as_committed() -> None:
    s = state(1000, m("loading", 500, loading=True))
    assert not isinstance(decide(s, req(600)), Admit)


# --- decide: evict


def test_evicts_least_recently_used_first() -> None:
    s = state(
        1000, m("old", 300, last_used=1), m("mid", 300, last_used=2), m("new", 300, last_used=3)
    )
    d = decide(s, req(300, model="x"))
    assert d == Evict(("old",), 300 * MiB)


def test_evicts_the_minimal_lru_prefix_not_the_biggest() -> None:
    # 100 free, need 500: the LRU prefix old(200)+mid(300) reaches it; "big" would alone,
    # but it is the most recently used, so LRU order wins.
    s = state(
        1000,
        m("big", 400, last_used=9),
        m("old", 200, last_used=1),
        m("mid", 300, last_used=2),
    )
    d = decide(s, req(500, model="x"))
    assert isinstance(d, Evict)
    assert d.ids == ("old", "mid")
    assert d.freed == 500 * MiB


def test_never_evicts_busy_or_pinned_or_loading_models() -> None:
    s = state(
        1000,
        m("busy", 300, last_used=0, busy=1),
        m("pinned", 300, last_used=0, pinned=True),
        m("loading", 100, last_used=0, loading=True),
        m("idle", 200, last_used=5),
    )
    d = decide(s, req(300, model="x"))
    assert d == Evict(("idle",), 200 * MiB)


def test_never_evicts_the_model_being_loaded() -> None:
    # x's own (stale) entry is replaced by the load, so it is neither committed nor evicted.
    s = state(1000, m("x", 600, last_used=0), m("other", 300, last_used=1))
    d = decide(s, req(800, model="x"))
    assert d == Evict(("other",), 300 * MiB)


def test_lru_ties_break_by_id() -> None:
    s = state(300, m("b", 100, last_used=1), m("a", 100, last_used=1), m("c", 100, last_used=1))
    assert decide(s, req(100, model="x")) == Evict(("a",), 100 * MiB)


# --- decide: wait for busy models


def test_waits_when_only_busy_models_stand_in_the_way() -> None:
    s = state(1000, m("busy", 600, busy=2, last_used=3), m("idle", 200, last_used=1))
    d = decide(s, req(500, model="x"))
    assert d == Wait(("busy",))


def test_does_not_wait_for_busy_pinned_models() -> None:
    s = state(1000, m("busy", 600, busy=1, pinned=True))
    assert isinstance(decide(s, req(500, model="x")), Refuse)


# --- decide: refuse with the numbers and suggestions


def test_refuses_when_nothing_can_make_room() -> None:
    s = state(1000, m("a", 300, last_used=1))
    d = decide(s, req(2000, model="x"))
    assert isinstance(d, Refuse)
    assert d.needed == 2000 * MiB
    assert d.available == 700 * MiB
    assert d.evictable == 300 * MiB
    assert d.shortfall == 1000 * MiB
    assert d.limit == 1000 * MiB
    assert d.committed == 300 * MiB
    assert [s.action for s in d.suggestions] == ["free_memory"]
    body = d.details()
    assert body["loaded"] == [
        {"id": "a", "bytes": 300 * MiB, "pinned": False, "busy": 0, "loading": False}
    ]
    assert body["suggestions"][0]["value"] == 1000 * MiB
    assert "x" in d.message() and "1000.0 MiB" in d.message()


def llm_cost(n_ctx: int, *, per_token: float, fixed_mib: int, q8: float | None) -> ContextCost:
    return ContextCost(
        n_ctx=n_ctx,
        kv_type="f16",
        fixed=fixed_mib * MiB,
        per_token=per_token,
        min_ctx=512,
        per_token_q8=q8,
    )


def test_refusal_suggests_a_smaller_context_and_q8_kv() -> None:
    # 8192 ctx at 64 KiB/token = 512 MiB of KV + 100 fixed = 612 MiB; room is 400 MiB.
    cost = llm_cost(8192, per_token=64 * 1024, fixed_mib=100, q8=34 * 1024)
    needed = 100 + 512
    d = decide(state(400), req(needed, context=cost))
    assert isinstance(d, Refuse)
    by_action = {s.action: s for s in d.suggestions}
    # (400 - 100) MiB / 64 KiB = 4800 tokens -> 4608, a multiple of 256.
    assert by_action["ctx"].value == 4608
    assert "--ctx 4608" in by_action["ctx"].message
    # q8_0: 100 MiB + 8192 * 34 KiB = 372 MiB fits in 400.
    assert by_action["kv_type"].value == "q8_0"
    assert "free_memory" not in by_action


def test_no_ctx_suggestion_below_min_ctx() -> None:
    cost = llm_cost(8192, per_token=64 * 1024, fixed_mib=380, q8=None)
    d = decide(state(400), req(380 + 512, context=cost))
    assert isinstance(d, Refuse)
    assert [s.action for s in d.suggestions] == ["free_memory"]


def test_refusal_suggests_unloading_pinned_models() -> None:
    s = state(
        1000,
        m("p1", 300, pinned=True, last_used=1),
        m("p2", 300, pinned=True, last_used=2),
        m("p3", 300, pinned=True, last_used=3),
    )
    d = decide(s, req(600, model="x"))
    assert isinstance(d, Refuse)
    pins = [s.value for s in d.suggestions if s.action == "unload_pinned"]
    assert pins == ["p1", "p2"]  # 100 free + 300 + 300 reaches 600: the minimal LRU prefix
    assert "POST /api/models/p1/unload" in d.message()


def test_refusal_suggests_stopping_busy_pinned_models() -> None:
    s = state(1000, m("bp", 800, pinned=True, busy=1))
    d = decide(s, req(500, model="x"))
    assert isinstance(d, Refuse)
    assert [s.action for s in d.suggestions] == ["stop_busy"]
    assert d.suggestions[0].value == ["bp"]


def test_refuse_excludes_the_requested_model_from_loaded() -> None:
    s = state(100, m("x", 50, loading=True))
    d = decide(s, req(500, model="x"))
    assert isinstance(d, Refuse)
    assert d.loaded == ()


# --- expired


def test_expired_lists_idle_unpinned_models_past_their_keep_alive() -> None:
    s = state(
        1000,
        m("due", 1, expires_at=10),
        m("due-earlier", 1, expires_at=5),
        m("later", 1, expires_at=20),
        m("forever", 1, expires_at=None),
        m("busy", 1, expires_at=1, busy=1),
        m("pinned", 1, expires_at=1, pinned=True),
        m("loading", 1, expires_at=1, loading=True),
    )
    assert expired(s, now=10) == ["due-earlier", "due"]
    assert expired(s, now=4) == []
