"""What a load will cost: the context size of an LLM and the predicted footprint.

Pure given its inputs (the estimate functions are pure; the measured store is read-only
here). The plan carries the ``policy.LoadRequest`` that ``planner.plan_and_decide`` asks
the policy about, after ``offload_plan`` placed it on the GPUs.
"""

from __future__ import annotations

from dataclasses import dataclass

from elbowroom.config import Settings
from elbowroom.engines.options import EngineOptions, LlamaOptions, MlxOptions, Offload
from elbowroom.models.estimate import context_cap, prompt_cache_grant
from elbowroom.models.spec import Footprint, ModelSpec
from elbowroom.scheduler.inputs import Estimator, Measurements
from elbowroom.scheduler.placement import Placement
from elbowroom.scheduler.policy import ContextCost, LoadRequest, State


@dataclass(frozen=True, slots=True)
class Plan:
    request: LoadRequest
    footprint: Footprint
    n_ctx: int  # 0 for engines without a context
    kv_type: str
    slots: int
    placement: Placement | None = None  # GPU offload (scheduler.offload_plan); None: CPU
    cache_grant: int = 0  # bytes of RAM prompt cache granted to the engine (LLMs)
    # Where n_ctx came from: "none" (no context), "setting" (settings.ctx), "request" (a
    # request's context, Ollama's num_ctx), "auto" or "min_ctx" (auto-sizing found none
    # that fits), for `elbowroom plan` and logs.
    ctx_source: str = "none"


def has_context(spec: ModelSpec) -> bool:
    """GGUF models (llama.cpp) and MLX models have a context to size."""
    return spec.gguf is not None or spec.mlx is not None


def unevictable_bytes(state: State, model_id: str) -> int:
    """Bytes held by other models that a load cannot evict: busy, pinned, loading."""
    return sum(m.bytes for m in state.models if m.id != model_id and (m.pinned or not m.idle))


def plan_load(
    spec: ModelSpec,
    settings: Settings,
    state: State,
    estimate: Estimator,
    measured: Measurements | None,
    ctx: int | None = None,
) -> Plan:
    """Size the load of ``spec``.

    LLM context: ``ctx`` when a request asked for one (Ollama's ``num_ctx``; capped at the
    model's trained context, never squeezed to fit: the policy waits or refuses), else
    ``settings.ctx`` when given, else ``auto_context`` over the budget left by
    models that cannot be evicted (idle ones may be evicted for a larger context).
    When not even ``min_ctx`` fits, the plan is sized at ``min_ctx``: ``policy.decide``
    then waits for busy models or refuses with the numbers."""
    kv_type, slots = settings.kv_type, settings.slots_for(spec.id)
    if spec.mlx is not None:  # one sequence at a time, its KV in the model's float type
        kv_type, slots = "f16", 1
    if not has_context(spec):
        fp = estimate.footprint(spec, 0, 1, kv_type, measured)
        return Plan(LoadRequest(spec.id, fp.total), fp, 0, kv_type, 1)

    source = "setting"
    if ctx is not None:
        n_ctx, source = min(ctx, context_cap(spec, None) or ctx), "request"
    elif settings.ctx is not None:
        n_ctx = settings.ctx
    else:
        source = "auto"
        budget = state.limit - unevictable_bytes(state, spec.id)
        n_ctx = estimate.auto_context(
            spec, max(0, budget), settings.max_ctx, settings.min_ctx, slots, kv_type, measured
        )
        if n_ctx <= 0:
            n_ctx, source = settings.min_ctx, "min_ctx"
    fp = estimate.footprint(spec, n_ctx, slots, kv_type, measured)
    per_token_q8: float | None = None
    if kv_type == "f16" and spec.mlx is None:
        q8 = estimate.footprint(spec, n_ctx, slots, "q8_0")
        per_token_q8 = q8.kv_bytes / n_ctx
    cost = ContextCost(
        n_ctx=n_ctx,
        kv_type=kv_type,
        fixed=fp.total - fp.kv_bytes,
        per_token=fp.kv_bytes / n_ctx,
        min_ctx=min(settings.min_ctx, n_ctx),
        per_token_q8=per_token_q8,
    )
    # The prompt cache takes only room that is free now: it never evicts another model and
    # never squeezes the context (sized above); a tight budget gets a small grant or none.
    committed = sum(m.bytes for m in state.models if m.id != spec.id)
    wanted = settings.kv_ram_max if settings.kv_cache else 0
    grant = prompt_cache_grant(state.limit - committed, fp, wanted, settings.kv_ram_kv_factor)
    request = LoadRequest(spec.id, fp.total + grant, cost)
    return Plan(request, fp, n_ctx, kv_type, slots, cache_grant=grant, ctx_source=source)


RUNNER_CEILING_FACTOR = 1.5
RUNNER_CEILING_MARGIN = 1024**3


def runner_ceiling(settings: Settings, plan: Plan) -> int:
    """A runner's memory ceiling (``runner_memory_ceiling``): 1.5 x the bytes its load was
    admitted for, plus 1 GiB. A chat template that loops a billion times
    while the model loads took a runner to 23.6 GB, past every budget, before the host's
    OOM killer ended it; a prediction is never more than 5 % under, so a runner within its
    plan never comes near this. 0 (none) for a GPU placement (its driver's mappings) or
    with the knob off."""
    if not settings.runner_memory_ceiling or plan.placement is not None:
        return 0
    planned = plan.request.needed + plan.cache_grant
    return int(RUNNER_CEILING_FACTOR * planned) + RUNNER_CEILING_MARGIN


def start_options(settings: Settings, spec: ModelSpec, plan: Plan) -> EngineOptions:
    """What the runner's engine is loaded with: the options of its kind."""
    ceiling = runner_ceiling(settings, plan)
    if spec.engine == "mlx":
        return MlxOptions(
            memory_ceiling=ceiling,
            threads=settings.threads,
            n_ctx=plan.n_ctx,
            slots=plan.slots,
            # MLX may hold its footprint and the prompt cache's RAM tier, nothing more.
            memory_limit=plan.footprint.total + plan.cache_grant,
            cache_limit=plan.footprint.compute,
            cache_ram_bytes=plan.cache_grant,
            kv_cache=settings.kv_cache,
            kv_cache_dir=str(settings.kv_cache_path),
            kv_disk_max=settings.kv_disk_max,
            kv_block_tokens=settings.kv_block_tokens,
        )
    if spec.engine != "llama":
        return EngineOptions(threads=settings.threads, memory_ceiling=ceiling)
    return LlamaOptions(
        memory_ceiling=ceiling,
        threads=settings.threads,
        n_ctx=plan.n_ctx,
        kv_type=plan.kv_type,
        slots=plan.slots,
        mlock=settings.mlock,
        # The engine's RAM prompt cache: a grant from the budget, never the engine's default.
        cache_ram_bytes=plan.cache_grant,
        prompt_cache_log=True,  # counted from the runner's engine log (engines/llama_log.py)
        kv_cache=settings.kv_cache,
        kv_cache_dir=str(settings.kv_cache_path),
        kv_disk_max=settings.kv_disk_max,
        kv_block_tokens=settings.kv_block_tokens,
        preempt=settings.kv_preempt,
        offload=plan.placement.offload() if plan.placement is not None else Offload(),
    )
