"""The memory budget. PURE: no I/O, no clock; every input is a parameter.

Which rule applies depends on where the effective total comes from:

    host (a machine's own RAM):
        limit = min(total − tiered OS reserve, tiered fraction × total,
                    Metal working set (where known), available + ours − safety margin)
    container (a cgroup limit) or override (ELBOWROOM_OVERRIDE_MEMORY):
        margin = container_margin knob, else max(5 % × total, 32 MiB), at most total / 2
        limit = min(total − margin, Metal working set (where known), available + ours)

    ceiling  = limit × load_fraction   (the scheduler admits loads up to here)
    soft     = limit × soft_fraction   (shrink caches, unload idle models, pause loads)
    hard     = limit × hard_fraction   (abort the newest/largest generation, 503)
    fits     = committed + needed ≤ ceiling

docs/memory.md explains every number and why it was chosen.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

from elbowroom.config import Settings
from elbowroom.memory.types import PSI_RECENT_S, Pressure, Snapshot
from elbowroom.units import GiB, MiB, format_size

__all__ = [
    "CONTAINER_MARGIN_FLOOR",
    "CONTAINER_MARGIN_FRACTION",
    "FRACTION_TIERS",
    "RESERVE_TIERS",
    "Assessment",
    "BudgetConfig",
    "Candidate",
    "Fit",
    "Limit",
    "assess",
    "container_margin",
    "exhaustion_floors",
    "fits",
    "limit_of",
    "limit_to_dict",
    "memory_limit",
    "os_reserve",
    "ram_fraction",
    "rule_of",
]

# (total up to, reserve): what the OS, the desktop and our own server process keep.
RESERVE_TIERS: tuple[tuple[float, int], ...] = (
    (16 * GiB, 4 * GiB),
    (64 * GiB, 6 * GiB),
    (128 * GiB, 8 * GiB),
    (float("inf"), 12 * GiB),
)

# (total up to, fraction): the reserve alone would hand 97 % of a 512 GiB machine to
# models; page tables, the page cache of the weights we mmap and everything else grow with
# the machine, so big machines are capped by a fraction too. Small machines are bound by
# the reserve instead (16 GiB: total − 4 GiB = 75 % < 80 %).
FRACTION_TIERS: tuple[tuple[float, float], ...] = (
    (16 * GiB, 0.80),
    (64 * GiB, 0.85),
    (128 * GiB, 0.90),
    (float("inf"), 0.92),
)

# Inside a cgroup or override limit, the OS, the desktop and other apps live outside the
# limit: what the container needs kept free is room for page cache and the runtime's own
# growth, which scales with the limit but never needs the host's gigabytes. 5 % keeps the
# load ceiling near 80 % of the limit (0.95 × load_fraction 0.85); the floor covers the
# page cache of a small container's Python runtime and libraries.
CONTAINER_MARGIN_FRACTION = 0.05
CONTAINER_MARGIN_FLOOR = 32 * MiB


@dataclass(frozen=True, slots=True)
class BudgetConfig:
    os_reserve: int | None = None  # None: tiered by total (os_reserve())
    container_margin: int | None = None  # None: container_margin(total)
    load_fraction: float = 0.85
    soft_fraction: float = 0.90
    hard_fraction: float = 0.95
    safety_margin: int = 256 * MiB
    psi_soft: float = 10.0  # PSI some (%, the lower of avg10 and the last 2 s): soft
    psi_hard: float = 40.0  # ... and to hard

    def __post_init__(self) -> None:
        if not 0 < self.load_fraction < self.soft_fraction < self.hard_fraction <= 1:
            raise ValueError("need 0 < load_fraction < soft_fraction < hard_fraction <= 1")
        negative = [
            name
            for name in ("safety_margin", "os_reserve", "container_margin")
            if (getattr(self, name) or 0) < 0
        ]
        if negative:
            raise ValueError(f"{', '.join(negative)} must not be negative")

    @classmethod
    def from_settings(cls, s: Settings) -> BudgetConfig:
        return cls(
            os_reserve=s.os_reserve,
            container_margin=s.container_margin,
            load_fraction=s.load_fraction,
            soft_fraction=s.soft_fraction,
            hard_fraction=s.hard_fraction,
            safety_margin=s.safety_margin,
            psi_soft=s.psi_soft,
            psi_hard=s.psi_hard,
        )


def os_reserve(total: int) -> int:
    """Bytes left to the OS: ≤16 GiB → 4 GiB, ≤64 → 6, ≤128 → 8, else 12.

    Never more than half of ``total``: a 4 GiB board or a 512 MiB container would
    otherwise get a budget of nothing at all.
    """
    tier = next(reserve for upto, reserve in RESERVE_TIERS if total <= upto)
    return min(tier, total // 2)


def ram_fraction(total: int) -> float:
    """The share of ``total`` models may use at most (FRACTION_TIERS)."""
    return next(frac for upto, frac in FRACTION_TIERS if total <= upto)


def container_margin(total: int) -> int:
    """Bytes kept free inside a container (cgroup or override) limit: 5 % of it, at least
    32 MiB, never more than half of it."""
    wanted = max(CONTAINER_MARGIN_FLOOR, int(total * CONTAINER_MARGIN_FRACTION))
    return min(wanted, total // 2)


Rule = Literal["host", "container", "override", "gpu"]


def rule_of(snap: Snapshot) -> tuple[Rule, str]:
    """Where the effective total comes from, and a sentence saying so.

    The override wins a tie with a cgroup limit: it is what the user asked for.
    """
    fs = format_size
    if snap.override is not None and snap.total == snap.override < snap.host_total:
        return "override", (
            f"ELBOWROOM_OVERRIDE_MEMORY {fs(snap.override)} caps the host's "
            f"{fs(snap.host_total)}: a container margin, not the host's OS reserve"
        )
    limit = snap.cgroup_limit
    if limit is not None and snap.total == limit < snap.host_total:
        return "container", (
            f"cgroup v{snap.cgroup_version} limit {fs(limit)} on a {fs(snap.host_total)} host:"
            " the OS lives outside it, so a container margin, not the host's OS reserve"
        )
    return "host", (
        f"the machine's own {fs(snap.total)}: the tiered OS reserve keeps room for the OS "
        "and other apps"
    )


@dataclass(frozen=True, slots=True)
class Candidate:
    name: str  # "reserve" | "fraction" | "gpu_working_set" | "available"
    value: int
    why: str


@dataclass(frozen=True, slots=True)
class Limit:
    value: int
    winner: str
    candidates: tuple[Candidate, ...]
    soft: int
    hard: int
    # The load ceiling: bytes our models may be admitted to hold. Below the soft threshold,
    # so a full budget does not start a pressure episode by itself, and what a loaded model
    # grows into (its prompt-cache grant, a batch's activations) has room before soft.
    ceiling: int = 0
    rule: Rule = "host"  # which reserve rule applied (rule_of)
    rule_why: str = ""


def memory_limit(snap: Snapshot, own_usage: int, cfg: BudgetConfig) -> Limit:
    """The most our runners may hold now: the smallest candidate, with its reason.

    ``own_usage`` is what our runners hold already; it is counted as used in
    ``snap.available`` and so is given back in the "available" candidate.

    Discrete NVIDIA GPUs are not candidates: their memory is their own and does not
    bound host RAM (a sum of GPU totals is not a host limit). Only unified memory that
    the OS reports a working set for (Metal) caps the host budget.
    """
    total = snap.total
    fs = format_size
    rule, rule_why = rule_of(snap)
    safety = cfg.safety_margin
    if rule == "host":
        if cfg.os_reserve is not None:
            reserve, how = cfg.os_reserve, "set by os_reserve"
        else:
            reserve, how = os_reserve(total), "tier for this size"
        frac = ram_fraction(total)
        cands = [
            Candidate(
                "reserve",
                max(0, total - reserve),
                f"total {fs(total)} − OS reserve {fs(reserve)} ({how})",
            ),
            Candidate(
                "fraction",
                int(total * frac),
                f"{frac:.0%} of total {fs(total)} (tier for this size)",
            ),
        ]
    else:
        if cfg.container_margin is not None:
            margin, how = cfg.container_margin, "set by container_margin"
        else:
            margin = container_margin(total)
            how = (
                f"{CONTAINER_MARGIN_FRACTION:.0%} of the limit, at least "
                f"{fs(CONTAINER_MARGIN_FLOOR)}"
            )
        kind = "cgroup limit" if rule == "container" else "override"
        cands = [
            Candidate(
                "container",
                max(0, total - margin),
                f"{kind} {fs(total)} − container margin {fs(margin)} ({how})",
            )
        ]
        # Inside a cgroup, available is exact accounting against a hard wall (limit − usage
        # + reclaimable page cache), and everything else in the container (our server,
        # neighbours) is already subtracted: the thresholds keep their share of it free
        # (hard at 95 % leaves 5 %), so no host-sized safety margin is taken off again; it
        # would be most of a small container.
        safety = 0
    if snap.gpu_working_set is not None:
        cands.append(
            Candidate(
                "gpu_working_set",
                snap.gpu_working_set,
                f"Metal recommended working set {fs(snap.gpu_working_set)}",
            )
        )
    cands.append(
        Candidate(
            "available",
            max(0, snap.available + own_usage - safety),
            f"available {fs(snap.available)} + ours {fs(own_usage)}"
            + (f" − safety margin {fs(safety)}" if rule == "host" else " (the container's own)"),
        )
    )
    return limit_of(cands, cfg, rule, rule_why)


def limit_of(cands: list[Candidate], cfg: BudgetConfig, rule: Rule, rule_why: str) -> Limit:
    """The smallest candidate (the first listed wins a tie) and the thresholds on it: one
    place for the arithmetic every pool (host, unified, GPU) shares."""
    winner = min(cands, key=lambda c: c.value)
    return Limit(
        value=winner.value,
        winner=winner.name,
        candidates=tuple(cands),
        soft=int(winner.value * cfg.soft_fraction),
        hard=int(winner.value * cfg.hard_fraction),
        ceiling=int(winner.value * cfg.load_fraction),
        rule=rule,
        rule_why=rule_why,
    )


@dataclass(frozen=True, slots=True)
class Assessment:
    level: Pressure
    reasons: tuple[str, ...]  # one sentence per signal that raised the level


def exhaustion_floors(total: int, rule: Rule, cfg: BudgetConfig) -> tuple[int, int]:
    """The available bytes under which the level is soft and hard (``assess``), for an
    effective ``total`` under the reserve ``rule``: (soft floor, hard floor)."""
    if rule == "host":
        hard_floor = min(cfg.safety_margin, int(total * (1 - cfg.hard_fraction)))
        soft_floor = min(2 * cfg.safety_margin, int(total * (1 - cfg.load_fraction)))
        return soft_floor, hard_floor
    # A container loaded to its ceiling keeps (1 − load_fraction) of what the server and
    # neighbours leave it free: soft when less than half that share of the whole container
    # is left (7.5 %), so a container with neighbours loaded to its ceiling is not soft
    # yet; hard under half of (1 − hard_fraction) (2.5 %), before the OOM killer.
    # Proportional to the container, not to the container_margin knob (what a user holds
    # back is no measure of how close the OOM killer is); at least 32 / 16 MiB.
    soft_floor = max(CONTAINER_MARGIN_FLOOR, int(total * (1 - cfg.load_fraction) / 2))
    hard_floor = max(CONTAINER_MARGIN_FLOOR // 2, int(total * (1 - cfg.hard_fraction) / 2))
    return soft_floor, hard_floor


def assess(snap: Snapshot, own_usage: int, limit: Limit, cfg: BudgetConfig) -> Assessment:
    """The pressure level and the signals that set it.

    Our usage against the thresholds, then exhaustion (host: effective available under the
    safety margin → hard, under twice it → soft, both floors shrinking to (1 − hard_fraction)
    / (1 − load_fraction) of total where the margin would be most of the memory; container
    and override: under (1 − hard_fraction) / 2 of total → hard, under (1 − load_fraction) / 2
    → soft, at least 16 / 32 MiB), then PSI and the macOS pressure level — which only ever
    raise the level.
    """
    fs = format_size
    found: list[tuple[Pressure, str]] = []
    if own_usage > 0 and own_usage >= limit.hard:
        found.append((Pressure.HARD, f"ours {fs(own_usage)} ≥ hard threshold {fs(limit.hard)}"))
    elif own_usage > 0 and own_usage >= limit.soft:
        found.append((Pressure.SOFT, f"ours {fs(own_usage)} ≥ soft threshold {fs(limit.soft)}"))
    soft_floor, hard_floor = exhaustion_floors(snap.total, limit.rule, cfg)
    if snap.available < hard_floor:
        found.append(
            (Pressure.HARD, f"available {fs(snap.available)} < {fs(hard_floor)} (machine-wide)")
        )
    elif snap.available < soft_floor:
        found.append(
            (Pressure.SOFT, f"available {fs(snap.available)} < {fs(soft_floor)} (machine-wide)")
        )
    if snap.psi is not None:
        # avg10 trails the stalls by about ten seconds: stalls that have stopped (a process
        # that thrashed and was stopped a moment ago, before this server started) still
        # raise it. The level takes the lower of avg10 and the stall rate over the last
        # PSI_RECENT_S seconds: pressure both sustained and current. While stalls go on,
        # the recent rate is the higher one, so a rise is seen as soon as before.
        some = snap.psi.some_avg10
        what = f"PSI some avg10 {some:.1f}%"
        recent = snap.psi.some_recent
        if recent is not None and recent < some:
            some = recent
            what = (
                f"PSI some {recent:.1f}% over the last {PSI_RECENT_S:g} s "
                f"(avg10 {snap.psi.some_avg10:.1f}%)"
            )
        if some >= cfg.psi_hard:
            found.append((Pressure.HARD, f"{what} ≥ {cfg.psi_hard:g}%"))
        elif some >= cfg.psi_soft:
            found.append((Pressure.SOFT, f"{what} ≥ {cfg.psi_soft:g}%"))
    if snap.os_pressure == "critical":
        found.append((Pressure.HARD, "macOS memory pressure is critical"))
    elif snap.os_pressure == "warn":
        found.append((Pressure.SOFT, "macOS memory pressure is warn"))
    level = max((lvl for lvl, _ in found), default=Pressure.NORMAL)
    return Assessment(level, tuple(why for _, why in found))


@dataclass(frozen=True, slots=True)
class Fit:
    ok: bool
    needed: int
    committed: int
    limit: int
    available: int  # limit − committed, never below 0
    shortfall: int  # committed + needed − limit, 0 when it fits
    reason: str


def fits(needed: int, committed: int, limit: Limit) -> Fit:
    """Whether ``needed`` more bytes fit beside ``committed`` (runners + reservations) under
    the load ceiling (``limit.ceiling``, below the soft threshold)."""
    if needed < 0 or committed < 0:
        raise ValueError(f"needed and committed must not be negative: {needed}, {committed}")
    fs = format_size
    ceiling = limit.ceiling
    room = max(0, ceiling - committed)
    over = committed + needed - ceiling
    ok = over <= 0
    where = (
        f"the {fs(ceiling)} load ceiling of the {fs(limit.value)} limit "
        f"({limit.winner}, {limit.rule} rule)"
    )
    if ok:
        reason = f"{fs(needed)} fits: {fs(room)} of {where} is free with {fs(committed)} committed"
    else:
        reason = (
            f"needs {fs(needed)} but only {fs(room)} of {where} is free with "
            f"{fs(committed)} committed: short by {fs(over)}"
        )
    return Fit(ok, needed, committed, ceiling, room, max(0, over), reason)


def limit_to_dict(limit: Limit) -> dict[str, object]:
    """A JSON-ready dict of a Limit; each candidate says whether it won."""
    return {
        "value": limit.value,
        "winner": limit.winner,
        "rule": limit.rule,
        "rule_why": limit.rule_why,
        "ceiling": limit.ceiling,
        "soft": limit.soft,
        "hard": limit.hard,
        "candidates": [
            {"name": c.name, "value": c.value, "why": c.why, "winner": c.name == limit.winner}
            for c in limit.candidates
        ],
    }
