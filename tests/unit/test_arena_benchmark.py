"""The arena benchmark's pure parts (benchmarks/arena.py; the arena itself needs root,
cgroup v1 and a llama-server build): the seeded work, how an answer is counted, the
statistics, and the cgroup's OOM counter and the kernel's victims."""

from __future__ import annotations

from arena import (
    Rec,
    classify,
    messages,
    oom_victims,
    percentile,
    spread,
    summarize,
    swap_workload,
    system_prompts,
    targets,
    workload,
)
from cgroup_v1 import oom_control

MODELS = ["a", "b", "c", "d"]


def test_workload_is_the_seeds_own() -> None:
    one = workload(1, MODELS, clients=4, sessions=2, turns=5)
    assert one == workload(1, MODELS, clients=4, sessions=2, turns=5)
    assert one != workload(2, MODELS, clients=4, sessions=2, turns=5)
    assert system_prompts(1) == system_prompts(1) != system_prompts(2)
    turns = [t for client in one for s in client for t in s.turns]
    assert len(turns) == 4 * 2 * 5
    assert {t.model for t in turns} <= set(MODELS)
    # a switch is exactly a turn on another model than the session's previous turn
    for client in one:
        for s in client:
            assert not s.turns[0].switch
            for prev, turn in zip(s.turns, s.turns[1:], strict=False):
                assert turn.switch == (turn.model != prev.model)


def test_workload_mixes_switches_drops_and_cancels() -> None:
    turns = [t for c in workload(3, MODELS, 8, 4, 6) for s in c for t in s.turns]
    kinds = {t.behaviour for t in turns}
    assert kinds == {"read", "drop", "cancel"}
    assert 0.2 < sum(t.switch for t in turns) / len(turns) < 0.6


def test_the_swap_phase_alternates_two_models_and_reads_every_stream() -> None:
    [[s]] = swap_workload(1, ["a", "b"], 6)
    assert swap_workload(1, ["a", "b"], 6) == [[s]] != swap_workload(2, ["a", "b"], 6)
    assert [t.model for t in s.turns] == ["a", "b"] * 3
    assert [t.switch for t in s.turns] == [False] + [True] * 5
    assert {t.behaviour for t in s.turns} == {"read"}


def test_a_session_grows_turn_by_turn_on_one_system_prompt() -> None:
    s = workload(1, MODELS, 1, 1, 4)[0][0]
    prompt = system_prompts(1)[s.agent]
    assert 1000 <= len(prompt.split()) <= 1600
    first, third = messages(prompt, s, 0), messages(prompt, s, 2)
    assert [m["role"] for m in first] == ["system", "user"]
    assert len(third) == 6 and third[:2] == first
    assert third[2] == {"role": "assistant", "content": s.turns[0].reply}
    assert third[-1]["content"] == s.turns[2].user


def test_classify_tells_refusals_from_failures() -> None:
    assert classify(200, "", True, True, "read") == "served"
    assert classify(200, "", True, False, "cancel") == "served"  # the client stopped it
    assert classify(200, "", True, False, "read") == "failed:dropped"  # the server did
    assert classify(200, "timeout", False, False, "read") == "failed:timeout"
    assert classify(503, "", False, False, "read") == "refused"
    assert classify(507, "", False, False, "read") == "refused"
    assert classify(500, "", False, False, "read") == "failed:5xx"
    assert classify(404, "", False, False, "read") == "client_error"
    assert classify(0, "timeout", False, False, "read") == "failed:timeout"
    assert classify(0, "dropped", False, False, "read") == "failed:dropped"
    # still running when the window closed and the server was stopped: not the system's fault
    assert classify(200, "cut", False, False, "read") == "cut"


def test_summary_counts_and_percentiles() -> None:
    recs = [
        Rec(0, 0, 0, "a", False, "read", ttft=1.0, outcome="served", tokens=10),
        Rec(0, 0, 1, "b", True, "read", ttft=3.0, outcome="served", tokens=10, cached_tokens=1536),
        Rec(1, 0, 0, "a", False, "read", outcome="refused", attempts=["507", "507", "507"]),
        Rec(1, 0, 1, "c", True, "read", outcome="failed", failure="5xx", attempts=["500"]),
        Rec(2, 0, 0, "a", False, "read", outcome="unsent"),
    ]
    s = summarize(recs, wall=4.0)
    assert (s["served"], s["refused"], s["failed"], s["unsent"]) == (2, 1, 1, 1)
    assert s["refusals_by_status"] == {"507": 3}
    assert s["failed_by_kind"] == {"5xx": 1}
    assert s["attempt_5xx"] == 4
    assert s["ttft_p50"] == 2.0 and s["switch_ttft_p50"] == 3.0 and s["switch_n"] == 1
    assert s["tok_s"] == 5.0
    assert s["switch_cached_p50"] == 1536.0  # what the switch restored instead of recomputing
    assert percentile([], 50) is None
    assert percentile([1.0, 2.0, 3.0, 4.0, 5.0], 95) == 4.8
    assert spread([3.0, None, 1.0, 2.0]) == {"median": 2.0, "min": 1.0, "max": 3.0, "n": 3}
    assert spread([None])["median"] is None


def test_the_cgroups_oom_counter_and_the_kernels_victims() -> None:
    text = "oom_kill_disable 0\nunder_oom 0\noom_kill 3\n"
    assert oom_control(text) == {"oom_kill_disable": 0, "under_oom": 0, "oom_kill": 3}
    assert oom_control("oom_kill_disable 0\nunder_oom 1\n")["oom_kill"] == 0  # old kernels
    dmesg = (
        "[1.0] oom-kill:constraint=CONSTRAINT_MEMCG,nodemask=(null),cpuset=/,mems_allowed=0,"
        "oom_memcg=/arena-9-1-S-work-router,task_memcg=/arena-9-1-S-work-router,"
        "task=llama-server,pid=4242,uid=0\n"
        "[1.1] Memory cgroup out of memory: Killed process 4242 (llama-server) "
        "total-vm:1000kB, anon-rss:204800kB, file-rss:0kB, shmem-rss:0kB, UID:0\n"
        "[2.0] oom-kill:constraint=CONSTRAINT_MEMCG,nodemask=(null),cpuset=/,mems_allowed=0,"
        "oom_memcg=/someone-else,task_memcg=/someone-else,task=python,pid=77,uid=0\n"
        "[2.1] Memory cgroup out of memory: Killed process 77 (python) total-vm:1kB, "
        "anon-rss:1024kB, file-rss:0kB\n"
    )
    assert oom_victims(dmesg, "/arena-9-1-S-work-router") == [
        {"pid": 4242, "comm": "llama-server", "anon_mib": 200}
    ]
    assert oom_victims(dmesg, "/arena-9-1-S-work-elbowroom") == []


def _row(system: str, size: str, served: float, switch: float | None) -> dict[str, object]:
    return {
        "size": size,
        "phase": "work",
        "system": system,
        "served": spread([served]),
        "tok_s": spread([served / 10]),
        "switch_ttft_p50": spread([switch]),
        "oom_kills_total": 0,
        "failed_total": 0,
    }


def test_targets_compare_only_cells_with_enough_served() -> None:
    rows = [
        _row("elbowroom", "S", 6, 2.0),
        _row("router", "S", 8, 9.0),
        _row("elbowroom", "M", 2, None),
        _row("router", "M", 1, None),
    ]
    got = {(t["target"], t["cell"]): t["met"] for t in targets(rows)}
    assert got[("served >= router's in a tight container", ("S", "work"))] is False
    assert got[("first token after a switch <= 1/3 of router's", ("S", "work"))] is True
    assert got[("served >= router's in a tight container", ("M", "work"))] is None
    assert got[("0 OOM kills, 0 unexplained 5xx", ("M", "work"))] is True
