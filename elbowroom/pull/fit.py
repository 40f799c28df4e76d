"""Will a model elbowroom has not downloaded yet fit this machine? (`elbowroom pull`)

The same arithmetic as `elbowroom plan` and a load (``scheduler.planner``: plan_load, GPU
placement, the policy and its 507 suggestions), for a spec built from a remote GGUF header
(``remote_gguf``) or a resident engine's size on the Hub. Nothing is loaded, so nothing is
committed: the question is whether the model fits this machine's load ceiling at all.

Three answers:
- **fits**: it loads as the settings are (auto-sized context, slots, GPU placement);
- **fits at --ctx N**: it loads only with a smaller context than the settings give it
  (``min_ctx`` or ``--ctx`` too large for it); the pull goes on and says so;
- **never fits here**: not even the smallest context fits; the pull is refused with the
  507 a load would get (its numbers and what to change) unless ``--force``.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Any

from elbowroom.config import Settings
from elbowroom.errors import InsufficientMemory
from elbowroom.memory.budget import Limit, fits
from elbowroom.memory.monitor import Monitor
from elbowroom.memory.probe import default_probe
from elbowroom.models.estimate import max_context
from elbowroom.models.measured import MeasuredStore
from elbowroom.models.spec import ModelSpec
from elbowroom.scheduler import policy
from elbowroom.scheduler.inputs import default_estimator
from elbowroom.scheduler.planner import budget_state, plan_and_decide
from elbowroom.scheduler.refusal import insufficient_memory
from elbowroom.units import format_size as fs

FITS = "fits"
FITS_AT_CTX = "fits_at_ctx"
NEVER = "never_fits"


@dataclass(frozen=True, slots=True)
class FitVerdict:
    verdict: str  # FITS, FITS_AT_CTX or NEVER
    footprint: int  # predicted bytes at the context the settings give it
    n_ctx: int  # that context (0: not an LLM, or none fits)
    largest_ctx: int  # the largest context that fits (LLMs), 0 when none does
    ceiling: int  # the load ceiling of this machine's memory limit
    limit: int
    message: str
    error: InsufficientMemory | None  # the 507 a load would get, when it never fits

    @property
    def ok(self) -> bool:
        return self.verdict != NEVER

    def to_dict(self) -> dict[str, Any]:
        return {
            "verdict": self.verdict,
            "footprint": self.footprint,
            "n_ctx": self.n_ctx,
            "largest_ctx": self.largest_ctx,
            "load_ceiling": self.ceiling,
            "memory_limit": self.limit,
            "message": self.message,
        }


def _nothing() -> int:
    return 0


def machine_limit(settings: Settings) -> tuple[Limit, Any]:
    """This machine's memory limit and pools, as a server starting now would see them."""
    monitor = Monitor.from_settings(
        settings, default_probe(settings), own_usage=_nothing, history_seconds=0
    )
    sample = monitor.read()
    return sample.limit, sample.pools


def check_fit(spec: ModelSpec, settings: Settings) -> FitVerdict:
    """Whether ``spec`` (not downloaded yet) can be loaded here; see the module doc."""
    limit, pools = machine_limit(settings)
    measured = MeasuredStore(settings.measurements_path)
    state = budget_state((), limit.ceiling, pools, 0)
    plan, decision = plan_and_decide(
        spec, settings, state, pools, default_estimator(), measured, limit.value
    )
    fp = plan.footprint
    fit = fits(fp.total, 0, limit)
    refusal = decision if isinstance(decision, policy.Refuse) else None
    largest = (
        max_context(spec, limit.ceiling, settings.slots_for(spec.id), settings.kv_type)
        if spec.gguf is not None
        else 0
    )
    where = f"of the {fs(limit.ceiling)} load ceiling ({limit.winner}: {fs(limit.value)})"
    if fit.ok and refusal is None:
        ctx = f" at a {plan.n_ctx}-token context" if plan.n_ctx else ""
        return FitVerdict(
            FITS,
            fp.total,
            plan.n_ctx,
            largest,
            limit.ceiling,
            limit.value,
            f"fits: predicted {fs(fp.total)}{ctx} {where}",
            None,
        )
    if largest > 0:  # the settings' context is too large for it; a smaller one fits
        return FitVerdict(
            FITS_AT_CTX,
            fp.total,
            plan.n_ctx,
            largest,
            limit.ceiling,
            limit.value,
            f"fits at --ctx {largest}: the settings' context ({plan.n_ctx or 'min_ctx'}) "
            f"needs {fs(fp.total)} {where}; serve it with --ctx {largest} (or less)",
            None,
        )
    if refusal is None:  # the policy admitted it, the ceiling did not (no suggestions)
        refusal = policy.Refuse(
            model=spec.id,
            needed=fp.total,
            available=limit.ceiling,
            limit=limit.ceiling,
            committed=0,
            evictable=0,
            loaded=(),
        )
    error = insufficient_memory(refusal, 0, limit)
    if spec.gguf is not None and largest == 0:
        error.message += (
            "; not even the smallest context fits: pick a smaller quant or model, or give "
            "elbowroom more memory (memory_limit, load_fraction)"
        )
    error.message = f"never fits here: {error.message}"
    error.args = (error.message,)
    error.details["fit_check"] = "never fits here"
    error.details["largest_ctx"] = largest
    return FitVerdict(
        NEVER,
        fp.total,
        plan.n_ctx,
        largest,
        limit.ceiling,
        limit.value,
        f"never fits here: {error.message}",
        error,
    )


def with_ctx(settings: Settings, ctx: int | None) -> Settings:
    return dataclasses.replace(settings, ctx=ctx) if ctx is not None else settings
