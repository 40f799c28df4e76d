"""Cluster placement, pressure aggregation, the layer split and the RPC bind rule: pure."""

from __future__ import annotations

import pytest

from elbowroom.cluster.pressure import cluster_pressure
from elbowroom.memory.types import Pressure
from elbowroom.models.spec import Holding, ModelKind
from elbowroom.scheduler.node_placement import ClusterRefusal, NodeOption, choose
from elbowroom.scheduler.policy import (
    Admit,
    Evict,
    LoadRequest,
    ModelState,
    Refuse,
    State,
    Wait,
    decide,
)

GiB = 1024**3


def option(
    name: str,
    limit: int,
    models: tuple[ModelState, ...] = (),
    need: int = GiB,
    pressure: Pressure = Pressure.NORMAL,
    alive: bool = True,
) -> NodeOption:
    state = State(models, limit)
    decision = decide(state, LoadRequest("m", need))
    used = {m.id: m.last_used for m in models}
    newest = max(used[i] for i in decision.ids) if isinstance(decision, Evict) else None
    return NodeOption(
        node=f"id-{name}",
        name=name,
        decision=decision,
        needed=need,
        available=state.available,
        limit=limit,
        pressure=pressure,
        alive=alive,
        evicts_used=newest,
    )


def model(
    mid: str, size: int, *, busy: int = 0, pinned: bool = False, used: float = 0.0
) -> ModelState:
    return ModelState(
        mid, ModelKind.LLM, Holding.MMAP, size, pinned=pinned, busy=busy, last_used=used
    )


def test_best_fit_takes_the_tightest_node_that_fits() -> None:
    opts = [option("big", 8 * GiB), option("small", 2 * GiB), option("tiny", GiB // 2)]
    chosen = choose("m", opts)
    assert isinstance(chosen, NodeOption) and chosen.name == "small"
    assert isinstance(opts[2].decision, type(opts[2].decision))  # refused there, not chosen


def test_eviction_goes_where_it_frees_fewest_bytes() -> None:
    a = option("a", 2 * GiB, (model("x", 2 * GiB),))
    b = option("b", 2 * GiB, (model("y", GiB + GiB // 2), model("z", GiB // 4, used=5)))
    assert isinstance(a.decision, Evict) and isinstance(b.decision, Evict)
    chosen = choose("m", [a, b])
    assert isinstance(chosen, NodeOption) and chosen.name == "b"


def test_eviction_follows_one_lru_order_across_the_cluster() -> None:
    """a's idle model was used at t=10, b's at t=50 (b's frees fewer bytes): the least
    recently used model of the cluster goes, so the load lands on a."""
    a = option("a", 2 * GiB, (model("old", 2 * GiB, used=10),))
    b = option("b", 2 * GiB, (model("new", GiB + GiB // 2, used=50),))
    chosen = choose("m", [b, a])
    assert isinstance(chosen, NodeOption) and chosen.name == "a"
    # b must evict two (used at t=20 and t=30, 1.75 GiB), a one (t=40, 1.2 GiB): walking
    # the cluster's LRU order, b's victims are all taken (at t=30) before a's: b, though
    # it evicts more bytes
    b = option("b", 2 * GiB, (model("x", GiB // 4, used=20), model("y", 3 * GiB // 2, used=30)))
    a = option("a", 2 * GiB, (model("z", 6 * GiB // 5, used=40),))
    assert isinstance(b.decision, Evict) and b.decision.ids == ("x", "y")
    assert isinstance(a.decision, Evict) and a.decision.freed < b.decision.freed
    chosen = choose("m", [a, b])
    assert isinstance(chosen, NodeOption) and chosen.name == "b"


def test_fits_now_beats_evicting_elsewhere() -> None:
    busyish = option("a", 4 * GiB, (model("x", 3 * GiB + GiB // 2),))
    free = option("b", 8 * GiB)
    chosen = choose("m", [busyish, free])
    assert isinstance(chosen, NodeOption) and chosen.name == "b"


def test_wait_when_only_busy_models_stand_in_the_way() -> None:
    a = option("a", 2 * GiB, (model("x", 2 * GiB, busy=1),))
    assert isinstance(a.decision, Wait)
    chosen = choose("m", [a, option("b", GiB // 2)])
    assert isinstance(chosen, NodeOption) and chosen.name == "a"


def test_hard_pressure_and_dead_nodes_are_skipped() -> None:
    hard = option("a", 8 * GiB, pressure=Pressure.HARD)
    dead = option("b", 8 * GiB, alive=False)
    ok = option("c", 16 * GiB)
    chosen = choose("m", [hard, dead, ok])
    assert isinstance(chosen, NodeOption) and chosen.name == "c"


def test_refusal_names_every_node_numbers() -> None:
    opts = [
        option("a", GiB, (model("p", GiB // 2, pinned=True),), need=3 * GiB),
        option("b", 2 * GiB, need=3 * GiB),
        option("c", 64 * GiB, need=3 * GiB, alive=False),
    ]
    refusal = choose("big", opts)
    assert isinstance(refusal, ClusterRefusal)
    text = refusal.message()
    assert "fits on no node" in text
    assert "a: needs 3.0 GiB" in text and "b: needs 3.0 GiB" in text and "c: gone" in text
    nodes = {n["name"]: n for n in refusal.details()["nodes"]}
    assert nodes["b"]["limit"] == 2 * GiB and nodes["b"]["refusal"]["needed"] == 3 * GiB
    assert nodes["c"]["alive"] is False


def test_refusal_text_reads_as_sentences_and_names_the_ceiling() -> None:
    """A node with nothing held says its whole ceiling is too small (not "2.0 GiB can be
    made free of 2.0 GiB"); one with a pinned model says how much of its ceiling can be
    made free; the message ends as a sentence (the router appends the split's reason);
    the body calls the number ``ceiling`` (``limit`` kept, the same number)."""
    opts = [
        option("a", 2 * GiB, need=3 * GiB),
        option("b", 2 * GiB, (model("p", GiB, pinned=True),), need=3 * GiB),
    ]
    refusal = choose("big", opts)
    assert isinstance(refusal, ClusterRefusal)
    text = refusal.message()
    assert "a: needs 3.0 GiB, more than its whole 2.0 GiB load ceiling" in text
    assert "b: needs 3.0 GiB, only 1.0 GiB of its 2.0 GiB load ceiling can be made free" in text
    assert "made free of" not in text and text.endswith("--ctx.")
    for node in refusal.details()["nodes"]:
        assert node["ceiling"] == node["limit"] == 2 * GiB
        assert node["refusal"]["ceiling"] == node["refusal"]["limit"] == 2 * GiB


def test_single_machine_refusal_text_and_ceiling_field() -> None:
    state = State((), 2 * GiB)
    refused = decide(state, LoadRequest("big", 3 * GiB))
    assert isinstance(refused, Refuse)
    text = refused.message()
    assert text.startswith("model 'big' needs 3.0 GiB, more than the whole 2.0 GiB load ceiling")
    assert refused.details()["ceiling"] == 2 * GiB


def test_empty_cluster_refuses_clearly() -> None:
    refusal = choose("m", [])
    assert isinstance(refusal, ClusterRefusal) and "no live node" in refusal.message()


def test_six_models_on_three_unequal_nodes_never_overcommit() -> None:
    """Place models one after another, updating each node's state as the loop would."""
    limits = {"a": 3 * GiB, "b": 2 * GiB, "c": GiB}
    states = {n: State((), lim) for n, lim in limits.items()}
    sizes = [GiB, GiB // 2, GiB + GiB // 4, GiB // 2, GiB // 4, GiB]
    for i, size in enumerate(sizes):
        opts = [
            NodeOption(n, n, decide(s, LoadRequest(f"m{i}", size)), size, s.available, s.limit)
            for n, s in states.items()
        ]
        chosen = choose(f"m{i}", opts)
        assert isinstance(chosen, NodeOption), chosen
        assert isinstance(chosen.decision, Admit)
        s = states[chosen.node]
        states[chosen.node] = State((*s.models, model(f"m{i}", size)), s.limit)
    for s in states.values():
        assert s.committed <= s.limit
    assert sum(s.committed for s in states.values()) == sum(sizes)


def test_cluster_pressure_is_the_worst_node() -> None:
    p = cluster_pressure({"a": Pressure.NORMAL, "b": Pressure.HARD, "c": Pressure.SOFT})
    assert p.level is Pressure.HARD and p.worst == ("b",)
    assert p.to_dict()["nodes"] == {"a": "normal", "b": "hard", "c": "soft"}
    calm = cluster_pressure({"a": Pressure.NORMAL, "b": Pressure.NORMAL})
    assert calm.level is Pressure.NORMAL and calm.worst == ("a", "b")
    assert cluster_pressure({}).level is Pressure.NORMAL


@pytest.mark.parametrize("level", list(Pressure))
def test_cluster_pressure_follows_one_node(level: Pressure) -> None:
    assert cluster_pressure({"a": Pressure.NORMAL, "b": level}).level is level


def test_one_machine_never_imports_ray() -> None:
    """Without --cluster nothing imports Ray (an optional extra), even with it installed."""
    import subprocess
    import sys

    code = (
        "import sys, elbowroom.cli, elbowroom.server.app, elbowroom.config as c;"
        "c.load_settings(environ={});"
        "import elbowroom.scheduler.node_placement, elbowroom.cluster.split, elbowroom.cluster.rpc;"
        "assert 'ray' not in sys.modules, 'ray was imported'"
    )
    subprocess.run([sys.executable, "-c", code], check=True, timeout=120)
