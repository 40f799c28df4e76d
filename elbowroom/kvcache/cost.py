"""Restore or recompute? A cost model fed by measurements.

Restoring costs the entry's bytes over the tier's restore bandwidth (fetch + copy into
the context); recomputing costs the saved tokens over the prefill speed. Both rates start
from a prior and then follow real restores and prefills (exponentially weighted), so a
slow disk or a fast GPU prefill changes the decision without a knob.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass


class Tier(enum.StrEnum):
    RAM = "ram"
    DISK = "disk"


# Priors err towards restoring: a wrong "restore" costs milliseconds and teaches the model
# its real bandwidth; a wrong "recompute" would never be measured again.
PRIOR_RESTORE_BPS: dict[Tier, float] = {Tier.RAM: 2e9, Tier.DISK: 300e6}
PRIOR_PREFILL_TPS = 500.0
ALPHA = 0.3  # weight of a new sample
_MIN_SECONDS = 1e-4  # shorter samples are timer noise
# A prefill of a handful of tokens measures per-call overhead, not prefill speed.
MIN_PREFILL_SAMPLE = 32


@dataclass(frozen=True, slots=True)
class Estimate:
    restore_s: float
    recompute_s: float

    @property
    def restore(self) -> bool:
        return self.restore_s < self.recompute_s


class CostModel:
    def __init__(
        self,
        restore_bps: dict[Tier, float] | None = None,
        prefill_tps: float = PRIOR_PREFILL_TPS,
    ) -> None:
        self._bps = dict(PRIOR_RESTORE_BPS if restore_bps is None else restore_bps)
        self._tps = prefill_tps

    def restore_bps(self, tier: Tier) -> float:
        return self._bps[tier]

    @property
    def prefill_tps(self) -> float:
        return self._tps

    def estimate(self, tier: Tier, nbytes: int, tokens_saved: int) -> Estimate:
        return Estimate(
            restore_s=nbytes / self._bps[tier],
            recompute_s=tokens_saved / self._tps,
        )

    def observe_restore(self, tier: Tier, nbytes: int, seconds: float) -> None:
        if nbytes > 0 and seconds >= _MIN_SECONDS:
            self._bps[tier] = _ewma(self._bps[tier], nbytes / seconds)

    def observe_prefill(self, n_tokens: int, seconds: float) -> None:
        if n_tokens >= MIN_PREFILL_SAMPLE and seconds >= _MIN_SECONDS:
            self._tps = _ewma(self._tps, n_tokens / seconds)

    def snapshot(self) -> dict[str, float]:
        return {
            "restore_bps_ram": self._bps[Tier.RAM],
            "restore_bps_disk": self._bps[Tier.DISK],
            "prefill_tps": self._tps,
        }


def _ewma(old: float, sample: float) -> float:
    return (1 - ALPHA) * old + ALPHA * sample
