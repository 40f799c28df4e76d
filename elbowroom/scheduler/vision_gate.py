"""The vision gate in the scheduler's load path (models/vision.py has the rule).

- A vision model's context is sized inside the gate (``sizing_state``): auto-sizing would
  otherwise grow its KV until the footprint crosses the gate and refuse a model that fits
  at a smaller context.
- ``check``: the plan's footprint against ``vision_gate`` x the pool's limit: a vision
  model above it is refused (507 with the numbers), a text model is logged.
- ``settle_target``: switching to a vision model waits after the eviction until
  ``vision_settle_factor`` x its bytes are available (the seed waited for 20 GB before a
  13.5 GB vision model), bounded by what the eviction can give back; on the deadline it
  goes on with a warning, as the plain settle wait does.
"""

from __future__ import annotations

import dataclasses

from elbowroom.config import Settings
from elbowroom.models import vision
from elbowroom.models.spec import ModelSpec
from elbowroom.scheduler.policy import State
from elbowroom.scheduler.sizing import Plan, unevictable_bytes


def cap(spec: ModelSpec, settings: Settings, pool_limit: int) -> int | None:
    """The most a vision model may hold (None: no cap for this model)."""
    if not spec.vision or settings.vision_gate >= 1:
        return None
    return int(settings.vision_gate * pool_limit)


def sizing_state(state: State, spec: ModelSpec, settings: Settings, pool_limit: int) -> State:
    """``state`` for plan_load: for a vision model, a limit that leaves it no more than the
    gate allows (its context is sized inside it)."""
    most = cap(spec, settings, pool_limit)
    if most is None:
        return state
    limit = min(state.limit, most + unevictable_bytes(state, spec.id))
    return dataclasses.replace(state, limit=limit)


def check(spec: ModelSpec, plan: Plan, settings: Settings, pool_limit: int) -> vision.GateCheck:
    """The gate's verdict on ``plan`` (raises 507 for a vision model above it)."""
    verdict = vision.gate(
        spec.id, spec.vision, plan.footprint.total, pool_limit, settings.vision_gate
    )
    vision.enforce(verdict)
    return verdict


def settle_target(needed: int, factor: float, before_available: int, freed: int) -> int:
    """PURE: bytes to wait for after evicting ``freed`` bytes to load a vision model that
    needs ``needed``: ``factor`` x needed, never more than the eviction can bring back."""
    return min(int(factor * needed), before_available + freed)
