"""The kill order: each runner's oom_score_adj follows the guard's eviction order."""

from __future__ import annotations

from elbowroom.guard.ladder import LoadedModel
from elbowroom.guard.oomorder import MAX_ADJ, kill_order

MiB = 1024**2


def m(id: str, used: float, busy: int = 0, pinned: bool = False) -> LoadedModel:
    return LoadedModel(id, 100 * MiB, used, busy=busy, pinned=pinned)


def test_idle_lru_is_most_killable_busy_least_all_above_the_server() -> None:
    models = [
        m("busy-one", 5.0, busy=1),
        m("idle-old", 1.0),
        m("busy-many", 4.0, busy=3),
        m("idle-new", 3.0),
        m("idle-pinned", 0.5, pinned=True),
    ]
    order = kill_order(models, base=0)
    ranked = sorted(order, key=lambda k: -order[k])
    assert ranked == ["idle-old", "idle-new", "idle-pinned", "busy-one", "busy-many"]
    assert order["idle-old"] == MAX_ADJ
    assert all(0 < v <= MAX_ADJ for v in order.values())
    # half the range between the idle and the busy: outweighs a size difference of up to
    # half the cgroup's limit in the kernel's badness
    assert (
        min(order[k] for k in ("idle-old", "idle-new", "idle-pinned"))
        - max(order[k] for k in ("busy-one", "busy-many"))
        >= 1
    )
    assert order["busy-many"] < 500 < order["idle-pinned"]


def test_a_model_turning_busy_drops_below_every_idle_one() -> None:
    before = kill_order([m("a", 1.0), m("b", 2.0)], base=0)
    assert before["a"] > before["b"]
    after = kill_order([m("a", 3.0, busy=1), m("b", 2.0)], base=0)
    assert after["a"] < after["b"]


def test_scores_go_above_the_server_s_base() -> None:
    order = kill_order([m("a", 1.0), m("b", 2.0, busy=1)], base=600)
    assert order["a"] == MAX_ADJ and 600 < order["b"] < order["a"]
    # one runner alone: the most killable
    assert kill_order([m("x", 1.0, busy=2)], base=0) == {"x": 500}
    assert kill_order([m("x", 1.0)], base=0) == {"x": MAX_ADJ}


def test_no_room_above_a_server_at_1000() -> None:
    """A server started at 1000 cannot put its runners above it (lowering them needs
    privilege): every runner is at 1000 and the kernel picks the largest."""
    assert kill_order([m("a", 1.0), m("b", 2.0, busy=1)], base=1000) == {"a": 1000, "b": 1000}
