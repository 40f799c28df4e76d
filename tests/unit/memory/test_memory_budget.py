"""The pure budget: reserve tiers, limit candidates, thresholds, pressure, fits()."""

from __future__ import annotations

import dataclasses
import json
from typing import Any

import pytest

from elbowroom.config import Settings
from elbowroom.memory.budget import (
    BudgetConfig,
    assess,
    container_margin,
    fits,
    limit_to_dict,
    memory_limit,
    os_reserve,
    ram_fraction,
    rule_of,
)
from elbowroom.memory.types import Pressure, Psi, Snapshot
from elbowroom.units import GiB, MiB

CFG = BudgetConfig()


def snap(total: int, available: int, **kw: Any) -> Snapshot:
    base = Snapshot("linux", total, available, total - available, total, available)
    return dataclasses.replace(base, **kw)


@pytest.mark.parametrize(
    ("total", "reserve"),
    [
        (16 * GiB, 4 * GiB),
        (24 * GiB, 6 * GiB),
        (64 * GiB, 6 * GiB),
        (64 * GiB + 1, 8 * GiB),
        (128 * GiB, 8 * GiB),
        (512 * GiB, 12 * GiB),
        # never more than half: small boards and containers still get a budget
        (6 * GiB, 3 * GiB),
        (512 * MiB, 256 * MiB),
    ],
)
def test_os_reserve_tiers(total: int, reserve: int) -> None:
    assert os_reserve(total) == reserve


def test_fraction_tiers() -> None:
    assert [ram_fraction(t * GiB) for t in (8, 16, 32, 64, 96, 128, 256)] == [
        0.80,
        0.80,
        0.85,
        0.85,
        0.90,
        0.90,
        0.92,
    ]


def test_small_machine_is_bound_by_the_reserve() -> None:
    limit = memory_limit(snap(16 * GiB, 14 * GiB), 0, CFG)
    assert limit.winner == "reserve"
    assert limit.value == 12 * GiB
    assert [c.name for c in limit.candidates] == ["reserve", "fraction", "available"]


def test_large_machine_is_bound_by_the_fraction() -> None:
    limit = memory_limit(snap(256 * GiB, 250 * GiB), 0, CFG)
    assert limit.winner == "fraction"
    assert limit.value == int(256 * GiB * 0.92)
    assert "92%" in limit.candidates[1].why


def test_busy_machine_is_bound_by_what_is_available_plus_ours() -> None:
    # 64 GiB machine, 10 GiB available, our runners hold 6 GiB of the used part
    limit = memory_limit(snap(64 * GiB, 10 * GiB), 6 * GiB, CFG)
    assert limit.winner == "available"
    assert limit.value == 16 * GiB - 256 * MiB
    assert "safety margin 256.0 MiB" in limit.candidates[-1].why


def test_metal_working_set_is_a_candidate() -> None:
    limit = memory_limit(snap(96 * GiB, 90 * GiB, gpu_working_set=72 * GiB), 0, CFG)
    assert limit.winner == "gpu_working_set"
    assert limit.value == 72 * GiB


def test_discrete_gpus_do_not_bound_host_memory() -> None:
    from elbowroom.memory.types import GpuMemory

    gpus = (GpuMemory(0, "H100", 80 * GiB, 80 * GiB, 0), GpuMemory(1, "H100", 80 * GiB, 0, 0))
    limit = memory_limit(snap(32 * GiB, 30 * GiB, gpus=gpus), 0, CFG)
    assert {c.name for c in limit.candidates} == {"reserve", "fraction", "available"}
    assert limit.value == 26 * GiB


def test_configured_reserve_and_thresholds() -> None:
    cfg = BudgetConfig(os_reserve=1 * GiB, load_fraction=0.4, soft_fraction=0.5, hard_fraction=0.75)
    limit = memory_limit(snap(8 * GiB, 8 * GiB), 0, cfg)
    assert limit.candidates[0].value == 7 * GiB
    assert "set by os_reserve" in limit.candidates[0].why
    assert limit.winner == "fraction"  # 80% of 8 GiB = 6.4 GiB < 7 GiB
    assert (limit.ceiling, limit.soft, limit.hard) == (
        int(limit.value * 0.4),
        int(limit.value * 0.5),
        int(limit.value * 0.75),
    )


def test_reserve_larger_than_total_gives_zero_not_negative() -> None:
    limit = memory_limit(snap(2 * GiB, 2 * GiB), 0, BudgetConfig(os_reserve=4 * GiB))
    assert limit.value == 0 and limit.winner == "reserve"


def test_config_from_settings_and_validation() -> None:
    s = Settings(os_reserve=2 * GiB, safety_margin=64 * MiB, psi_soft=5.0, psi_hard=20.0)
    cfg = BudgetConfig.from_settings(s)
    assert (cfg.os_reserve, cfg.safety_margin, cfg.psi_soft, cfg.psi_hard) == (
        2 * GiB,
        64 * MiB,
        5.0,
        20.0,
    )
    with pytest.raises(ValueError, match="soft_fraction"):
        BudgetConfig(soft_fraction=0.9, hard_fraction=0.8)
    # the load ceiling must stay below the soft threshold
    with pytest.raises(ValueError, match="load_fraction"):
        BudgetConfig(load_fraction=0.9, soft_fraction=0.9)
    with pytest.raises(ValueError, match="container_margin"):
        BudgetConfig(container_margin=-1)


# ---------------------------------------------------------------- pressure


def level(s: Snapshot, own: int, cfg: BudgetConfig = CFG) -> Pressure:
    return assess(s, own, memory_limit(s, own, cfg), cfg).level


def test_pressure_from_our_usage_against_thresholds() -> None:
    s = snap(16 * GiB, 12 * GiB)
    limit = memory_limit(s, 0, CFG)
    assert assess(s, int(limit.value * 0.80), limit, CFG).level is Pressure.NORMAL
    assert assess(s, limit.soft, limit, CFG).level is Pressure.SOFT
    assert assess(s, limit.hard, limit, CFG).level is Pressure.HARD


def test_pressure_from_machine_wide_exhaustion() -> None:
    assert level(snap(16 * GiB, 200 * MiB), 0) is Pressure.HARD  # < safety margin
    assert level(snap(16 * GiB, 400 * MiB), 0) is Pressure.SOFT  # < twice the margin
    assert level(snap(16 * GiB, 600 * MiB), 0) is Pressure.NORMAL


def test_exhaustion_floors_shrink_on_small_totals() -> None:
    # a 512 MiB container would otherwise be "soft" forever (margin 256 MiB × 2)
    assert level(snap(512 * MiB, 300 * MiB), 0) is Pressure.NORMAL
    assert level(snap(512 * MiB, 20 * MiB), 0) is Pressure.HARD


def test_psi_only_raises_the_level() -> None:
    calm = snap(16 * GiB, 12 * GiB)
    assert level(dataclasses.replace(calm, psi=Psi(10.0, 0, 0, 0)), 0) is Pressure.SOFT
    assert level(dataclasses.replace(calm, psi=Psi(40.0, 0, 0, 0)), 0) is Pressure.HARD
    # PSI calm does not lower a hard level set by exhaustion
    starved = dataclasses.replace(snap(16 * GiB, 100 * MiB), psi=Psi(0.0, 0, 0, 0))
    assert level(starved, 0) is Pressure.HARD


def test_psi_that_has_stopped_does_not_hold_the_level_up() -> None:
    """Issue 24's arena: elbowroom started right after the router had thrashed in a tight
    container; PSI avg10 still read 85.8 % (it trails by ~10 s), so the guard refused every
    request for 21 s though nothing stalled any more and our models held 53 MiB. The level
    takes the lower of avg10 and the stall rate over the last PSI_RECENT_S seconds."""
    calm = snap(16 * GiB, 12 * GiB)

    def psi(avg10: float, recent: float | None) -> Snapshot:
        return dataclasses.replace(calm, psi=Psi(avg10, 0, 0, 0, some_recent=recent))

    assert level(psi(85.8, 0.0), 0) is Pressure.NORMAL  # stopped: history only
    assert level(psi(85.8, 12.0), 0) is Pressure.SOFT  # easing
    assert level(psi(45.0, 90.0), 0) is Pressure.HARD  # going on: avg10 rules, as before
    assert level(psi(45.0, None), 0) is Pressure.HARD  # no earlier reading: avg10
    s = psi(85.8, 12.0)
    reasons = assess(s, 0, memory_limit(s, 0, CFG), CFG).reasons
    assert reasons == ("PSI some 12.0% over the last 2 s (avg10 85.8%) ≥ 10%",)


def test_macos_pressure_level_raises() -> None:
    calm = snap(16 * GiB, 12 * GiB)
    assert level(dataclasses.replace(calm, os_pressure="warn"), 0) is Pressure.SOFT
    assert level(dataclasses.replace(calm, os_pressure="critical"), 0) is Pressure.HARD
    assert level(dataclasses.replace(calm, os_pressure="normal"), 0) is Pressure.NORMAL


def test_assess_names_every_signal() -> None:
    s = dataclasses.replace(snap(16 * GiB, 100 * MiB), psi=Psi(55.0, 0, 0, 0))
    limit = memory_limit(s, 0, CFG)
    verdict = assess(s, 0, limit, CFG)
    assert verdict.level is Pressure.HARD
    assert len(verdict.reasons) == 2
    assert "machine-wide" in verdict.reasons[0]
    assert "PSI some avg10 55.0%" in verdict.reasons[1]


# ---------------------------------------------------------------- fits


def test_fits_and_shortfall_against_the_load_ceiling() -> None:
    limit = memory_limit(snap(16 * GiB, 14 * GiB), 0, CFG)  # 12 GiB (reserve)
    assert limit.ceiling == int(12 * GiB * 0.85) < limit.soft == int(12 * GiB * 0.90)
    ok = fits(2 * GiB, 8 * GiB, limit)
    assert ok.ok and ok.shortfall == 0 and ok.available == limit.ceiling - 8 * GiB
    assert "fits" in ok.reason
    # 11 GiB fit under the 12 GiB limit but not under the ceiling.
    bad = fits(3 * GiB, 8 * GiB, limit)
    assert not bad.ok
    assert bad.shortfall == 11 * GiB - limit.ceiling
    assert (bad.needed, bad.committed, bad.limit) == (3 * GiB, 8 * GiB, limit.ceiling)
    assert bad.reason == (
        "needs 3.0 GiB but only 2.2 GiB of the 10.2 GiB load ceiling of the 12.0 GiB limit "
        "(reserve, host rule) is free with 8.0 GiB committed: short by 819.2 MiB"
    )


def test_fits_when_committed_already_exceeds_the_ceiling() -> None:
    limit = memory_limit(snap(16 * GiB, 14 * GiB), 0, CFG)
    f = fits(0, 11 * GiB, limit)
    assert not f.ok and f.available == 0 and f.shortfall == 11 * GiB - limit.ceiling


def test_fits_rejects_negative_sizes() -> None:
    limit = memory_limit(snap(16 * GiB, 14 * GiB), 0, CFG)
    with pytest.raises(ValueError):
        fits(-1, 0, limit)


def test_limit_to_dict_marks_the_winner() -> None:
    data = json.loads(json.dumps(limit_to_dict(memory_limit(snap(16 * GiB, 14 * GiB), 0, CFG))))
    assert data["winner"] == "reserve"
    assert [c["winner"] for c in data["candidates"]] == [True, False, False]


# ---------------------------------------------------------------- which rule


def cgroup_snap(limit: int, available: int, host: int = 24 * GiB, **kw: Any) -> Snapshot:
    """A snapshot as the probe makes it inside a memory cgroup of ``limit`` bytes."""
    base = Snapshot("linux", limit, available, limit - available, host, host - GiB)
    return dataclasses.replace(base, cgroup_version=1, cgroup_limit=limit, **kw)


@pytest.mark.parametrize(
    ("total", "margin"),
    [
        (800 * MiB, 40 * MiB),  # 5 %
        (400 * MiB, 32 * MiB),  # the floor
        (48 * MiB, 24 * MiB),  # never more than half
        (8 * GiB, int(8 * GiB * 0.05)),
    ],
)
def test_container_margin_formula(total: int, margin: int) -> None:
    assert container_margin(total) == margin


def test_rule_follows_where_the_total_comes_from() -> None:
    assert rule_of(snap(16 * GiB, 14 * GiB))[0] == "host"
    assert rule_of(cgroup_snap(800 * MiB, 700 * MiB))[0] == "container"
    over = dataclasses.replace(snap(16 * GiB, 14 * GiB), total=8 * GiB, override=8 * GiB)
    rule, why = rule_of(over)
    assert rule == "override" and "ELBOWROOM_OVERRIDE_MEMORY 8.0 GiB" in why
    # a cgroup limit above the host's RAM does not bind: the host rule applies
    loose = dataclasses.replace(snap(16 * GiB, 14 * GiB), cgroup_version=2, cgroup_limit=64 * GiB)
    assert rule_of(loose)[0] == "host"


def test_container_keeps_a_margin_not_half_of_itself() -> None:
    # The case: an 800 MiB cgroup got limit 400 MiB (an "OS reserve" of half of it)
    # and a 340 MiB ceiling. Now: 800 − 40 MiB margin = 760 MiB; the ceiling 0.85 × 760.
    limit = memory_limit(cgroup_snap(800 * MiB, 780 * MiB), 0, CFG)
    assert limit.rule == "container" and limit.winner == "container"
    assert [c.name for c in limit.candidates] == ["container", "available"]
    assert limit.value == 760 * MiB
    assert limit.ceiling == int(760 * MiB * 0.85)  # 646 MiB: 80.75 % of the cgroup
    assert limit.ceiling < limit.soft < limit.hard < limit.value
    assert "container margin 40.0 MiB (5% of the limit, at least 32.0 MiB)" in (
        limit.candidates[0].why
    )
    # the available candidate takes no host-sized safety margin off again
    assert limit.candidates[1].value == 780 * MiB


def test_container_available_still_sees_neighbours() -> None:
    # 800 MiB cgroup: a 200 MiB neighbour and our 60 MiB server leave 540 MiB
    limit = memory_limit(cgroup_snap(800 * MiB, 540 * MiB), 0, CFG)
    assert limit.winner == "available" and limit.value == 540 * MiB
    assert "(the container's own)" in limit.candidates[1].why
    # ... and what our runners hold is given back
    loaded = memory_limit(cgroup_snap(800 * MiB, 240 * MiB), 300 * MiB, CFG)
    assert loaded.value == 540 * MiB


def test_container_margin_knob_and_override_rule() -> None:
    cfg = BudgetConfig(container_margin=100 * MiB)
    limit = memory_limit(cgroup_snap(800 * MiB, 790 * MiB), 0, cfg)
    assert limit.value == 700 * MiB and "set by container_margin" in limit.candidates[0].why
    over = Snapshot("linux", 2 * GiB, 2 * GiB - 10 * MiB, 10 * MiB, 24 * GiB, 20 * GiB)
    over = dataclasses.replace(over, override=2 * GiB)
    limit = memory_limit(over, 0, CFG)
    assert limit.rule == "override" and limit.winner == "container"
    assert limit.value == 2 * GiB - int(2 * GiB * 0.05)
    assert "override 2.0 GiB" in limit.candidates[0].why


def test_container_loaded_to_the_ceiling_is_not_under_pressure() -> None:
    # 800 MiB cgroup, our server holds 60 MiB: limit 740 MiB, ceiling 629 MiB. Loaded to the
    # ceiling, 111 MiB stay available: normal (the host floors, 256 / 512 MiB capped at
    # 5 % / 15 % of the total, would call that soft).
    limit = memory_limit(cgroup_snap(800 * MiB, 740 * MiB), 0, CFG)
    at_ceiling = cgroup_snap(800 * MiB, 740 * MiB - limit.ceiling)
    after = memory_limit(at_ceiling, limit.ceiling, CFG)
    assert after.value == limit.value
    assert assess(at_ceiling, limit.ceiling, after, CFG).level is Pressure.NORMAL
    # soft under 7.5 % of the container (60 MiB), hard under 2.5 % (20 MiB)
    assert level(cgroup_snap(800 * MiB, 61 * MiB), 0) is Pressure.NORMAL
    assert level(cgroup_snap(800 * MiB, 59 * MiB), 0) is Pressure.SOFT
    assert level(cgroup_snap(800 * MiB, 19 * MiB), 0) is Pressure.HARD
    # a small container: at least 32 / 16 MiB (7.5 % of 400 MiB would be 30)
    assert level(cgroup_snap(400 * MiB, 31 * MiB), 0) is Pressure.SOFT
    assert level(cgroup_snap(400 * MiB, 15 * MiB), 0) is Pressure.HARD
    # a large container_margin (what the user holds back) does not move the floors
    big = BudgetConfig(container_margin=400 * MiB)
    assert level(cgroup_snap(800 * MiB, 300 * MiB), 0, big) is Pressure.NORMAL


def test_container_with_a_neighbour_loaded_to_the_ceiling_is_not_under_pressure() -> None:
    # The e2e case: 800 MiB cgroup, a 200 MB neighbour and our ~100 MiB server leave
    # 509 MiB; a model loaded to the 433 MiB ceiling leaves 76 MiB free.
    s = cgroup_snap(800 * MiB, 509 * MiB)
    limit = memory_limit(s, 0, CFG)
    assert limit.winner == "available" and limit.ceiling == int(509 * MiB * 0.85)
    full = cgroup_snap(800 * MiB, 509 * MiB - limit.ceiling)
    assert assess(full, limit.ceiling, memory_limit(full, limit.ceiling, CFG), CFG).level is (
        Pressure.NORMAL
    )


def test_limit_to_dict_names_the_rule() -> None:
    data = limit_to_dict(memory_limit(cgroup_snap(800 * MiB, 780 * MiB), 0, CFG))
    assert data["rule"] == "container" and "cgroup v1 limit 800.0 MiB" in str(data["rule_why"])
    assert data["ceiling"] == int(760 * MiB * 0.85)
