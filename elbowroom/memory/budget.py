"""The memory budget. PURE: no I/O, no clock; every input is a parameter.

    limit    = min(total − OS reserve, tiered fraction × total,
                   Metal working set (where known), available + ours − safety margin)
    soft     = limit × soft_fraction   (shrink caches, unload idle models, pause loads)
    hard     = limit × hard_fraction   (abort the newest/largest generation, 503)
    fits     = committed + needed ≤ limit

docs/memory.md explains every number and why it was chosen.
"""

from __future__ import annotations

from dataclasses import dataclass

from elbowroom.config import Settings
from elbowroom.memory.types import Pressure, Snapshot
from elbowroom.units import GiB, MiB, format_size

__all__ = [
    "FRACTION_TIERS",
    "RESERVE_TIERS",
    "Assessment",
    "BudgetConfig",
    "Candidate",
    "Fit",
    "Limit",
    "assess",
    "fits",
    "limit_to_dict",
    "memory_limit",
    "os_reserve",
    "pressure_level",
    "ram_fraction",
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


@dataclass(frozen=True, slots=True)
class BudgetConfig:
    os_reserve: int | None = None  # None: tiered by total (os_reserve())
    soft_fraction: float = 0.85
    hard_fraction: float = 0.95
    safety_margin: int = 256 * MiB
    psi_soft: float = 10.0  # PSI some avg10 (%) that raises the level to soft
    psi_hard: float = 40.0  # ... and to hard

    def __post_init__(self) -> None:
        if not 0 < self.soft_fraction < self.hard_fraction <= 1:
            raise ValueError("need 0 < soft_fraction < hard_fraction <= 1")
        if self.safety_margin < 0 or (self.os_reserve is not None and self.os_reserve < 0):
            raise ValueError("safety_margin and os_reserve must not be negative")

    @classmethod
    def from_settings(cls, s: Settings) -> BudgetConfig:
        return cls(
            os_reserve=s.os_reserve,
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

    @property
    def ceiling(self) -> int:
        """The load ceiling: bytes our models may be admitted to hold. It is the soft
        threshold, so a fresh load never starts a pressure episode by itself."""
        return self.soft


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
            "fraction", int(total * frac), f"{frac:.0%} of total {fs(total)} (tier for this size)"
        ),
    ]
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
            max(0, snap.available + own_usage - cfg.safety_margin),
            f"available {fs(snap.available)} + ours {fs(own_usage)}"
            f" − safety margin {fs(cfg.safety_margin)}",
        )
    )
    winner = min(cands, key=lambda c: c.value)  # the first listed wins a tie
    return Limit(
        value=winner.value,
        winner=winner.name,
        candidates=tuple(cands),
        soft=int(winner.value * cfg.soft_fraction),
        hard=int(winner.value * cfg.hard_fraction),
    )


@dataclass(frozen=True, slots=True)
class Assessment:
    level: Pressure
    reasons: tuple[str, ...]  # one sentence per signal that raised the level


def assess(snap: Snapshot, own_usage: int, limit: Limit, cfg: BudgetConfig) -> Assessment:
    """The pressure level and the signals that set it.

    Our usage against the thresholds, then machine-wide exhaustion (effective available
    under the safety margin → hard, under twice it → soft; both floors shrink to 5 % / 15 %
    of total on machines where the margin would be most of the memory), then PSI and the
    macOS pressure level — which only ever raise the level.
    """
    fs = format_size
    found: list[tuple[Pressure, str]] = []
    if own_usage > 0 and own_usage >= limit.hard:
        found.append((Pressure.HARD, f"ours {fs(own_usage)} ≥ hard threshold {fs(limit.hard)}"))
    elif own_usage > 0 and own_usage >= limit.soft:
        found.append((Pressure.SOFT, f"ours {fs(own_usage)} ≥ soft threshold {fs(limit.soft)}"))
    hard_floor = min(cfg.safety_margin, int(snap.total * (1 - cfg.hard_fraction)))
    soft_floor = min(2 * cfg.safety_margin, int(snap.total * (1 - cfg.soft_fraction)))
    if snap.available < hard_floor:
        found.append(
            (Pressure.HARD, f"available {fs(snap.available)} < {fs(hard_floor)} (machine-wide)")
        )
    elif snap.available < soft_floor:
        found.append(
            (Pressure.SOFT, f"available {fs(snap.available)} < {fs(soft_floor)} (machine-wide)")
        )
    if snap.psi is not None:
        some = snap.psi.some_avg10
        if some >= cfg.psi_hard:
            found.append((Pressure.HARD, f"PSI some avg10 {some:.1f}% ≥ {cfg.psi_hard:g}%"))
        elif some >= cfg.psi_soft:
            found.append((Pressure.SOFT, f"PSI some avg10 {some:.1f}% ≥ {cfg.psi_soft:g}%"))
    if snap.os_pressure == "critical":
        found.append((Pressure.HARD, "macOS memory pressure is critical"))
    elif snap.os_pressure == "warn":
        found.append((Pressure.SOFT, "macOS memory pressure is warn"))
    level = max((lvl for lvl, _ in found), default=Pressure.NORMAL)
    return Assessment(level, tuple(why for _, why in found))


def pressure_level(snap: Snapshot, own_usage: int, limit: Limit, cfg: BudgetConfig) -> Pressure:
    """NORMAL / SOFT / HARD (see assess() for the signals)."""
    return assess(snap, own_usage, limit, cfg).level


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
    the load ceiling (the limit's soft threshold)."""
    if needed < 0 or committed < 0:
        raise ValueError(f"needed and committed must not be negative: {needed}, {committed}")
    fs = format_size
    ceiling = limit.ceiling
    room = max(0, ceiling - committed)
    over = committed + needed - ceiling
    ok = over <= 0
    where = (
        f"the {fs(ceiling)} load ceiling (soft threshold of the {fs(limit.value)} limit, "
        f"{limit.winner})"
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
        "soft": limit.soft,
        "hard": limit.hard,
        "candidates": [
            {"name": c.name, "value": c.value, "why": c.why, "winner": c.name == limit.winner}
            for c in limit.candidates
        ],
    }
