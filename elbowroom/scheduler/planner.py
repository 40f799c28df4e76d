"""One load decision as the scheduler makes it and `elbowroom plan` shows it.

Size the load (``sizing.plan_load``), place it on the GPUs (``offload_plan.place_on_gpus``)
and ask the policy (``policy.decide``), all over a ``policy.State`` built from a memory
sample by ``budget_state``. A vision model is sized and placed inside the vision gate
(``vision_gate.sizing_state``); the policy still sees the whole budget. The CLI calls the
same functions with no models loaded, so `plan` and the server cannot disagree. Pure given
its inputs.
"""

from __future__ import annotations

from collections.abc import Sequence

from elbowroom.config import Settings
from elbowroom.memory.pools import Pool
from elbowroom.models.spec import ModelSpec
from elbowroom.scheduler import offload_plan, policy, vision_gate
from elbowroom.scheduler.inputs import Estimator, Measurements
from elbowroom.scheduler.sizing import Plan, plan_load

__all__ = ["budget_state", "plan_and_decide"]


def budget_state(
    models: Sequence[policy.ModelState], ceiling: int, pools: Sequence[Pool], server: int
) -> policy.State:
    """The policy's picture: ``models`` against the load ``ceiling`` less the server
    process's own bytes (they fill the same budget), and each GPU pool's ceiling."""
    gpu_limits = {p.name: p.ceiling for p in pools if p.kind == "gpu"}
    return policy.State(tuple(models), max(0, ceiling - server), gpu_limits)


def plan_and_decide(
    spec: ModelSpec,
    settings: Settings,
    state: policy.State,
    pools: Sequence[Pool],
    estimate: Estimator,
    measured: Measurements | None,
    pool_limit: int,
    ctx: int | None = None,
) -> tuple[Plan, policy.Decision]:
    """The sized and placed plan for loading ``spec`` now, and what the policy says.
    ``pool_limit``: the memory limit (not the load ceiling) the vision gate is a share of.
    ``ctx``: the context a request asked for (``sizing.plan_load``)."""
    sized = vision_gate.sizing_state(state, spec, settings, pool_limit)
    plan = plan_load(spec, settings, sized, estimate, measured, ctx)
    plan = offload_plan.place_on_gpus(plan, spec, settings, sized, pools)
    return plan, policy.decide(state, plan.request)
