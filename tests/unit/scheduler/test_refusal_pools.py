"""The 507 body: a GPU pool's refusal speaks of that pool only (issue 27)."""

from __future__ import annotations

from elbowroom.scheduler.policy import HOST, Refuse
from elbowroom.scheduler.refusal import insufficient_memory
from elbowroom.units import GiB, MiB

SERVER = 80 * MiB


def refuse(pool: str) -> Refuse:
    gpu = {"needed": 16 * GiB, "available": 12 * GiB, "evictable": 1 * GiB, "limit": 13 * GiB}
    host = {"needed": 1 * GiB, "available": 90 * GiB, "evictable": 0, "limit": 95 * GiB}
    nums = gpu if pool == "gpu0" else host
    return Refuse(
        model="big",
        needed=nums["needed"],
        available=nums["available"],
        limit=nums["limit"],
        committed=1 * GiB,
        evictable=nums["evictable"],
        loaded=(),
        pool=pool,
        pools={HOST: {**host, "committed": 0}, "gpu0": {**gpu, "committed": 1 * GiB}},
    )


def test_a_gpu_pool_507_holds_no_host_server_bytes() -> None:
    err = insufficient_memory(refuse("gpu0"), SERVER, None)
    assert err.details["limit"] == 13 * GiB == err.details["pools"]["gpu0"]["limit"]
    assert "server process" not in err.message
    assert "13.0 GiB load ceiling" in err.message


def test_a_host_pool_507_reports_the_ceiling_with_the_server_s_share() -> None:
    err = insufficient_memory(refuse(HOST), SERVER, None)
    assert err.details["limit"] == 95 * GiB + SERVER
    assert err.details["server_usage"] == SERVER
    assert "the server process itself holds 80.0 MiB" in err.message
