"""policy.decide over several pools: host RAM and GPU pools fit separately, eviction frees
the pool that is short, a refusal names the pool."""

from __future__ import annotations

from elbowroom.models.spec import Holding, ModelKind
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
from elbowroom.units import GiB, MiB


def m(id: str, host_mib: int, gpu0_gib: float = 0, *, last_used: float = 0.0, busy: int = 0,
      pinned: bool = False) -> ModelState:  # fmt: skip
    pools = {"gpu0": int(gpu0_gib * GiB)} if gpu0_gib else {}
    return ModelState(id, ModelKind.LLM, Holding.MMAP, host_mib * MiB, pinned=pinned, busy=busy,
                      last_used=last_used, pools=pools)  # fmt: skip


def state(*models: ModelState, host_mib: int = 10_000, gpu0_gib: float = 10) -> State:
    return State(models, host_mib * MiB, {"gpu0": int(gpu0_gib * GiB)})


def req(host_mib: int, gpu0_gib: float, model: str = "new") -> LoadRequest:
    return LoadRequest(model, host_mib * MiB, pools={"gpu0": int(gpu0_gib * GiB)})


def test_fits_when_every_pool_fits() -> None:
    s = state(m("a", 500, 4))
    assert decide(s, req(500, 5)) == Admit()


def test_vram_shortfall_evicts_models_on_that_gpu_only() -> None:
    # "cpu-old" is least recently used but holds no VRAM: evicting it would not help.
    s = state(m("cpu-old", 2000, last_used=1), m("gpu-a", 300, 4, last_used=2),
              m("gpu-b", 300, 4, last_used=3))  # fmt: skip
    d = decide(s, req(500, 5))
    assert d == Evict(("gpu-a",), 300 * MiB)


def test_both_pools_short_take_models_until_both_fit() -> None:
    s = state(m("cpu-old", 6000, last_used=1), m("gpu-a", 300, 6, last_used=2),
              m("gpu-b", 300, 3, last_used=3), host_mib=8000)  # fmt: skip
    d = decide(s, req(3000, 5))
    # host is short by 1,600 MiB (only cpu-old frees that much), gpu0 by 4 GiB (gpu-a).
    assert isinstance(d, Evict) and d.ids == ("cpu-old", "gpu-a")


def test_waits_for_a_busy_model_holding_vram() -> None:
    s = state(m("busy", 300, 8, busy=1, last_used=1), m("cpu", 300, last_used=0))
    assert decide(s, req(500, 5)) == Wait(("busy",))


def test_refusal_names_the_gpu_pool() -> None:
    s = state(m("pinned", 300, 6, pinned=True), m("idle", 300, 1))
    d = decide(s, req(500, 12))
    assert isinstance(d, Refuse)
    assert d.pool == "gpu0"
    assert d.needed == 12 * GiB and d.limit == 10 * GiB
    assert d.available == 3 * GiB and d.evictable == 1 * GiB
    assert "GPU pool gpu0" in d.message()
    body = d.details()
    assert body["pool"] == "gpu0"
    assert body["pools"]["gpu0"]["needed"] == 12 * GiB
    assert body["pools"]["host"]["needed"] == 500 * MiB
    assert [s.action for s in d.suggestions] == ["gpu_layers", "unload_pinned"]
    assert {"id": "pinned", "bytes": 300 * MiB, "pools": {"gpu0": 6 * GiB}, "pinned": True,
            "busy": 0, "loading": False} in body["loaded"]  # fmt: skip


def test_host_refusal_still_names_host() -> None:
    s = state(m("a", 300, 1), host_mib=1000)
    d = decide(s, req(5000, 1))
    assert isinstance(d, Refuse) and d.pool == "host" and d.details()["pool"] == "host"
