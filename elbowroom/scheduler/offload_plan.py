"""The GPU side of a load plan: pools in, placement and per-pool bytes out.

``plan_load`` sizes an LLM for host RAM; ``place_on_gpus`` then decides where its layers
go (``placement.place``) with the room each GPU pool has for it, resizes the context when
the whole model fits on the GPU(s) (the KV cache then lives in VRAM, so VRAM bounds it),
and turns the plan's request into per-pool bytes: host RAM for what stays on the CPU,
one entry per GPU pool used. ``model_pools`` is the other direction: what a loaded model
holds in each GPU pool now. Pure given its inputs.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping, Sequence

from elbowroom.config import Settings
from elbowroom.memory.pools import Pool
from elbowroom.models.estimate import context_cap, kv_bytes_per_token
from elbowroom.models.spec import Footprint, ModelSpec
from elbowroom.scheduler.offload import Layout
from elbowroom.scheduler.placement import GpuRoom, Placement, gpu_context, place, unified
from elbowroom.scheduler.policy import LoadRequest, State
from elbowroom.scheduler.sizing import Plan

__all__ = ["gpu_rooms", "model_pools", "place_on_gpus"]


def gpu_rooms(state: State, pools: Sequence[Pool], model_id: str) -> list[GpuRoom]:
    """Each GPU pool's room for a load of ``model_id``: its ceiling minus what models that
    cannot be evicted (busy, pinned, loading) hold there."""
    rooms = []
    for pool in pools:
        if pool.kind != "gpu" or pool.device is None:
            continue
        fixed = sum(
            m.pools.get(pool.name, 0)
            for m in state.models
            if m.id != model_id and (m.pinned or not m.idle)
        )
        rooms.append(GpuRoom(pool.device, max(0, pool.ceiling - fixed), pool.label))
    return rooms


def place_on_gpus(
    plan: Plan, spec: ModelSpec, settings: Settings, state: State, pools: Sequence[Pool]
) -> Plan:
    """``plan`` with a placement; unchanged for non-LLMs and machines without NVIDIA GPUs."""
    info = spec.gguf
    if info is None or info.layer_bytes is None or plan.n_ctx <= 0:
        return plan
    layout = Layout.from_info(info)
    rooms = gpu_rooms(state, pools, spec.id)
    if not rooms:
        if any(p.kind == "unified" for p in pools):
            return dataclasses.replace(plan, placement=unified(layout, settings.gpu_layers))
        return plan
    n_ctx = plan.n_ctx
    if settings.ctx is None and settings.gpu_layers != 0:
        cap = context_cap(spec, settings.max_ctx)
        on_gpu = gpu_context(layout, plan.slots, plan.kv_type, rooms, cap, settings.min_ctx)
        n_ctx = on_gpu or n_ctx
    placement = place(layout, n_ctx, plan.slots, plan.kv_type, rooms, settings.gpu_layers)
    if placement.bytes is None:
        return dataclasses.replace(plan, placement=placement)
    b = placement.bytes
    per_token = kv_bytes_per_token(info, plan.kv_type)
    footprint = Footprint(
        weights=spec.size_bytes,
        file_backed=b.host_file,
        anonymous=b.host_anonymous,
        kv_bytes_per_token=per_token,
        kv_bytes=per_token * n_ctx * plan.slots,
        overhead=max(0, b.host_anonymous),
        n_ctx=n_ctx,
        slots=plan.slots,
        kv_type=plan.kv_type,
    )
    # No context suggestions: the request's bytes are split over pools, and a GPU pool's
    # refusal suggests placement changes instead.
    request = LoadRequest(spec.id, b.host, None, placement.pool_bytes)
    return dataclasses.replace(
        plan, request=request, footprint=footprint, n_ctx=n_ctx, placement=placement
    )


def model_pools(placement: Placement | None, measured_gpu: int | None) -> dict[str, int]:
    """What a model holds per GPU pool: the placement's prediction, rescaled to NVML's
    measurement of the runner's GPU bytes when there is one (the prediction says how the
    bytes divide between GPUs; NVML reports one total per process)."""
    if placement is None or placement.bytes is None:
        return {}
    predicted = placement.pool_bytes
    total = sum(predicted.values())
    if not measured_gpu or total <= 0:
        return predicted
    return {pool: b * measured_gpu // total for pool, b in predicted.items()}


def gpu_usage(per_model: Sequence[Mapping[str, int]]) -> dict[int, int]:
    """Our runners' bytes per GPU index (the pools' ``ours``)."""
    out: dict[int, int] = {}
    for pools in per_model:
        for name, b in pools.items():
            index = int(name.removeprefix("gpu"))
            out[index] = out.get(index, 0) + b
    return out
