"""The response ladder: every rung as a pure function of its inputs."""

from __future__ import annotations

from elbowroom.guard.ladder import (
    Abort,
    CloseAdmission,
    Gate,
    InFlight,
    LoadedModel,
    OpenAdmission,
    PauseLoads,
    PoolReading,
    Reading,
    ResumeLoads,
    SetPressure,
    Unload,
    next_gate,
    plan,
)
from elbowroom.memory.types import Pressure

MiB = 1024**2
N, S, H = Pressure.NORMAL, Pressure.SOFT, Pressure.HARD
# limit 1000 MiB: soft at 850, hard at 950
LIMIT, SOFT, HARD = 1000 * MiB, 850 * MiB, 950 * MiB


def reading(usage_mib: int) -> Reading:
    return Reading(usage=usage_mib * MiB, limit=LIMIT, soft=SOFT, hard=HARD)


def model(id: str, mib: int, used: float, **kw: object) -> LoadedModel:
    return LoadedModel(id=id, bytes=mib * MiB, last_used=used, **kw)  # type: ignore[arg-type]


def of(kind: type, actions: list) -> list:
    return [a for a in actions if isinstance(a, kind)]


def test_normal_with_nothing_to_undo_does_nothing() -> None:
    models = [model("a", 100, 1.0, llm=True)]
    assert plan(N, N, [], models, reading=reading(500), gate=Gate()) == []


def test_soft_pauses_loads_and_tells_llm_runners_level_1() -> None:
    models = [model("llm", 100, 5.0, llm=True, busy=1), model("tts", 100, 6.0, busy=1)]
    actions = plan(S, N, [], models, reading=reading(860), gate=Gate())
    assert of(PauseLoads, actions) == [PauseLoads(S, 860 * MiB, SOFT)]
    # only the LLM runner takes levels; nothing idle to unload
    assert of(SetPressure, actions) == [SetPressure("llm", S, N)]
    assert of(Unload, actions) == []
    assert of(CloseAdmission, actions) == []


def test_soft_unloads_idle_lru_until_the_excess_is_freed() -> None:
    models = [
        model("newest", 300, 9.0),
        model("oldest", 40, 1.0),
        model("middle", 200, 5.0),
        model("pinned", 500, 0.0, pinned=True),
        model("busy", 500, 0.5, busy=1),
    ]
    # 100 MiB over soft: the oldest (40) is not enough, the middle (200) completes it
    actions = plan(S, N, [], models, reading=reading(950 - 1), gate=Gate())
    assert [u.model for u in of(Unload, actions)] == ["oldest", "middle"]
    u = of(Unload, actions)[0]
    assert (u.bytes, u.usage, u.threshold) == (40 * MiB, 949 * MiB, SOFT)
    assert "oldest" in u.message() and "over the soft threshold" in u.message()


def test_soft_counts_usage_net_of_the_unloads_under_way() -> None:
    models = [model("idle", 200, 2.0)]
    # 900 measured, 300 of it being freed: 600 is under soft, nothing more to unload ...
    freeing = Reading(usage=600 * MiB, limit=LIMIT, soft=SOFT, hard=HARD, freeing=300 * MiB)
    for prev in (N, S):  # ... not even the PSI rising-edge one
        assert of(Unload, plan(S, prev, [], models, reading=freeing, gate=Gate())) == []
    # still 50 over after the freeing: the next model goes
    short = Reading(usage=900 * MiB, limit=LIMIT, soft=SOFT, hard=HARD, freeing=100 * MiB)
    assert [u.model for u in of(Unload, plan(S, S, [], models, reading=short, gate=Gate()))] == [
        "idle"
    ]


def test_psi_soft_unloads_one_model_on_the_rising_edge_only() -> None:
    models = [model("a", 100, 1.0), model("b", 100, 2.0)]
    # usage under soft in bytes: the level comes from PSI
    rising = plan(S, N, [], models, reading=reading(500), gate=Gate())
    assert [u.model for u in of(Unload, rising)] == ["a"]
    staying = plan(S, S, [], models[1:], reading=reading(500), gate=Gate(loads_paused=True))
    assert of(Unload, staying) == []


def test_hard_closes_admission_unloads_every_idle_unpinned_model() -> None:
    models = [
        model("a", 100, 1.0),
        model("b", 100, 2.0),
        model("p", 100, 0.0, pinned=True),
        model("busy", 100, 3.0, busy=1, llm=True),
    ]
    actions = plan(H, S, [], models, reading=reading(960), gate=Gate(loads_paused=True))
    assert of(CloseAdmission, actions) == [CloseAdmission(5.0, 960 * MiB, HARD)]
    assert [u.model for u in of(Unload, actions)] == ["a", "b"]
    assert of(PauseLoads, actions) == []  # already paused


def test_hard_does_not_abort_when_the_unloads_are_enough() -> None:
    models = [model("idle", 200, 1.0), model("llm", 300, 2.0, busy=1, llm=True)]
    inflight = [InFlight("r1", "llm", 10.0, 300 * MiB)]
    actions = plan(H, S, inflight, models, reading=reading(1000), gate=Gate())
    assert of(Abort, actions) == []
    assert [u.model for u in of(Unload, actions)] == ["idle"]


def test_hard_aborts_the_newest_generation_first_then_the_largest() -> None:
    models = [
        model("small", 100, 1.0, busy=1, llm=True),
        model("big", 400, 2.0, busy=1, llm=True),
    ]
    inflight = [
        InFlight("old-big", "big", 1.0, 400 * MiB),
        InFlight("new-small", "small", 5.0, 100 * MiB),
        InFlight("newer-asr", "asr", 6.0, 50 * MiB, abortable=False),
    ]
    first = plan(H, S, inflight, models, reading=reading(990), gate=Gate())
    aborts = of(Abort, first)
    assert [(a.request_id, a.reason) for a in aborts] == [("new-small", "newest")]
    # the runner of the target gets level 2 (its 16-token check aborts), the other level 1
    assert set(of(SetPressure, first)) == {SetPressure("small", H, N), SetPressure("big", S, N)}
    assert "newest generation new-small" in aborts[0].message()
    # 40 MiB over hard in bytes and nothing idle: the aborted model goes too, once its
    # requests have ended (the abort alone frees no KV cache)
    assert of(Unload, first) == [Unload("small", 100 * MiB, H, 990 * MiB, HARD, busy=True)]
    assert "busy model" in of(Unload, first)[0].message()

    gate = next_gate(Gate(), H, first)
    assert gate == Gate(loads_paused=True, admission_open=False, aborts=1)
    # the abort landed (new-small is gone), still hard: now the largest
    second_small = plan(H, H, inflight[:1], [models[1]], reading=reading(990), gate=gate)
    assert [a.request_id for a in of(Abort, second_small)] == ["old-big"]
    models2 = [model("small", 100, 1.0, llm=True, runner_level=H), models[1]]
    models2[1] = model("big", 400, 2.0, busy=1, llm=True, runner_level=S)
    # small went idle and is unloaded (100 MiB), which is not enough for 150 MiB over hard
    second = plan(H, H, inflight[:1], models2, reading=reading(1100), gate=gate)
    assert [(u.model, u.busy) for u in of(Unload, second)] == [("small", False), ("big", True)]
    assert [(a.request_id, a.reason) for a in of(Abort, second)] == [("old-big", "largest")]
    # the first target's runner drops back to level 1 so new work there is not aborted
    assert SetPressure("big", H, S) in second


def test_hard_never_aborts_a_second_while_one_is_pending() -> None:
    models = [model("x", 100, 1.0, busy=1, llm=True, runner_level=H)]
    inflight = [
        InFlight("pending", "x", 1.0, 100 * MiB, aborting=True),
        InFlight("other", "y", 2.0, 100 * MiB),
    ]
    gate = Gate(loads_paused=True, admission_open=False, aborts=1)
    actions = plan(H, H, inflight, models, reading=reading(999), gate=gate)
    assert of(Abort, actions) == []
    assert of(SetPressure, actions) == []  # x stays at 2 until its generation is gone


def test_psi_hard_aborts_at_most_once_per_episode() -> None:
    models = [model("x", 100, 1.0, busy=2, llm=True)]
    inflight = [InFlight("a", "x", 1.0, 100 * MiB), InFlight("b", "x", 2.0, 100 * MiB)]
    first = plan(H, S, inflight, models, reading=reading(700), gate=Gate())
    assert [a.request_id for a in of(Abort, first)] == ["b"]
    again = plan(H, H, inflight[:1], models, reading=reading(700), gate=next_gate(Gate(), H, first))
    assert of(Abort, again) == []


def test_hard_unloads_an_idle_pinned_model_only_when_nothing_else_is_left() -> None:
    models = [model("p1", 100, 2.0, pinned=True), model("p2", 100, 1.0, pinned=True)]
    actions = plan(H, S, [], models, reading=reading(990), gate=Gate())
    unloads = of(Unload, actions)
    assert [(u.model, u.pinned) for u in unloads] == [("p2", True)]
    # with an abortable generation, the abort comes first and the pin holds
    busy = [*models, model("llm", 100, 3.0, busy=1, llm=True)]
    with_gen = plan(
        H, S, [InFlight("r", "llm", 3.0, 100 * MiB)], busy, reading=reading(990), gate=Gate()
    )
    assert len(of(Abort, with_gen)) == 1
    assert [(u.model, u.busy) for u in of(Unload, with_gen)] == [("llm", True)]  # not a pin


def test_admission_reopens_only_under_soft() -> None:
    closed = Gate(loads_paused=True, admission_open=False, aborts=2)
    models = [model("llm", 100, 1.0, llm=True, pinned=True, runner_level=H)]
    soft = plan(S, H, [], models, reading=reading(900), gate=closed)
    assert of(OpenAdmission, soft) == [] and of(ResumeLoads, soft) == []
    assert of(SetPressure, soft) == [SetPressure("llm", S, H)]

    normal = plan(N, S, [], models, reading=reading(500), gate=closed)
    assert of(OpenAdmission, normal) == [OpenAdmission(500 * MiB, SOFT)]
    assert of(ResumeLoads, normal) == [ResumeLoads(500 * MiB, SOFT)]
    assert of(SetPressure, normal) == [SetPressure("llm", N, H)]
    assert next_gate(closed, N, normal) == Gate()


def test_every_action_has_a_log_line_with_numbers() -> None:
    models = [model("idle", 200, 1.0), model("llm", 300, 2.0, busy=1, llm=True)]
    inflight = [InFlight("r1", "llm", 10.0, 300 * MiB)]
    actions = plan(H, N, inflight, models, reading=reading(1200), gate=Gate())
    assert {type(a) for a in actions} == {PauseLoads, CloseAdmission, SetPressure, Unload, Abort}
    for a in actions:
        line = a.message()
        assert line and ("MiB" in line or "pressure" in line), line


def test_hard_evicts_the_aborted_model_only_for_a_byte_excess_and_never_a_pinned_one() -> None:
    inflight = [InFlight("r", "llm", 3.0, 300 * MiB)]
    busy = model("llm", 300, 3.0, busy=1, llm=True)
    # PSI-driven hard (usage under the hard threshold in bytes): one abort, no eviction
    psi = plan(H, S, inflight, [busy], reading=reading(700), gate=Gate())
    assert len(of(Abort, psi)) == 1 and of(Unload, psi) == []
    # idle unloads that cover the excess: no abort, no eviction
    idle = model("idle", 200, 1.0)
    enough = plan(H, S, inflight, [busy, idle], reading=reading(1000), gate=Gate())
    assert of(Abort, enough) == [] and [u.model for u in of(Unload, enough)] == ["idle"]
    # a pinned busy model has its generation aborted but stays loaded
    pinned = model("llm", 300, 3.0, busy=1, llm=True, pinned=True)
    kept = plan(H, S, inflight, [pinned], reading=reading(1000), gate=Gate())
    assert len(of(Abort, kept)) == 1 and of(Unload, kept) == []


def test_a_model_being_evicted_is_left_alone_and_kept_at_level_2() -> None:
    # its aborted generation has ended: idle now, but its eviction is under way
    going = model("llm", 300, 3.0, llm=True, runner_level=H)
    other = model("other", 100, 1.0)
    actions = plan(
        H,
        H,
        [],
        [going, other],
        reading=reading(1000),
        gate=Gate(loads_paused=True, admission_open=False, aborts=1),
        unloading=frozenset({"llm"}),
    )
    assert [u.model for u in of(Unload, actions)] == ["other"]
    assert of(SetPressure, actions) == []  # stays at 2: queued requests are refused


def gpu(level: Pressure, ours_mib: int, soft: int = 850, hard: int = 950) -> PoolReading:
    return PoolReading("gpu0", level, Reading(ours_mib * MiB, 1000 * MiB, soft * MiB, hard * MiB))


def test_a_hard_gpu_pool_aborts_and_unloads_gpu_work_first() -> None:
    # host RAM is fine; gpu0 is over its hard threshold
    models = [
        model("cpu-idle", 300, 0.5),  # the LRU idle model, but it holds nothing on the GPU
        model("gpu-idle", 50, 2.0, pools=(("gpu0", 400 * MiB),)),
        model("cpu-llm", 300, 3.0, busy=1, llm=True),
        model("gpu-llm", 100, 3.0, busy=1, llm=True, pools=(("gpu0", 500 * MiB),)),
    ]
    inflight = [
        InFlight("on-gpu", "gpu-llm", 1.0, 100 * MiB),
        InFlight("on-cpu", "cpu-llm", 9.0, 300 * MiB),  # the newest: the host's first pick
    ]
    actions = plan(N, N, inflight, models, reading=reading(500), gate=Gate(), gpus=[gpu(H, 990)])
    # the gates follow the GPU's level, with its numbers
    assert of(PauseLoads, actions) == [PauseLoads(H, 990 * MiB, 850 * MiB, pool="gpu0")]
    assert of(CloseAdmission, actions) == [CloseAdmission(5.0, 990 * MiB, 950 * MiB, "gpu0")]
    assert of(PauseLoads, actions)[0].message().startswith("pausing model loads on gpu0: ")
    # the idle model on the GPU goes (400 MiB of VRAM), not the host's LRU one ...
    unloads = of(Unload, actions)
    assert [(u.model, u.pool, u.bytes) for u in unloads] == [("gpu-idle", "gpu0", 50 * MiB)]
    # its message names what it holds on the GPU beside its host bytes
    assert "gpu-idle (400.0 MiB on gpu0, 50.0 MiB host RAM) at hard pressure on gpu0" in (
        unloads[0].message()
    )
    # ... and 400 MiB covers the 40 MiB over hard: no abort needed
    assert of(Abort, actions) == []

    # nothing idle on the GPU: the generation on the GPU is aborted, not the newer CPU one
    busy_only = [m for m in models if m.id != "gpu-idle"]
    actions = plan(N, N, inflight, busy_only, reading=reading(500), gate=Gate(), gpus=[gpu(H, 990)])
    aborts = of(Abort, actions)
    assert [(a.request_id, a.pool) for a in aborts] == [("on-gpu", "gpu0")]
    assert "(runner holds 500.0 MiB on gpu0, 100.0 MiB host RAM)" in aborts[0].message()
    # over hard in VRAM bytes: the GPU model is evicted once its requests end
    assert [(u.model, u.busy) for u in of(Unload, actions)] == [("gpu-llm", True)]
    # its runner gets level 2; the CPU model only level 1 (the gate is hard, its work runs)
    assert set(of(SetPressure, actions)) == {
        SetPressure("gpu-llm", H, N),
        SetPressure("cpu-llm", S, N),
    }


def test_host_hard_still_aborts_when_no_gpu_is_under_pressure() -> None:
    models = [model("cpu-llm", 300, 3.0, busy=1, llm=True)]
    inflight = [InFlight("on-cpu", "cpu-llm", 9.0, 300 * MiB)]
    actions = plan(H, S, inflight, models, reading=reading(990), gate=Gate(), gpus=[gpu(N, 100)])
    assert [(a.request_id, a.pool) for a in of(Abort, actions)] == [("on-cpu", "host")]
