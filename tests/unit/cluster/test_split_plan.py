"""The split plan (pure): layers in proportion to room, each node's share term by term."""

from __future__ import annotations

import pytest
from bundled_models import bundled_spec

from elbowroom.cluster.share import share_plan
from elbowroom.cluster.split import SplitError
from elbowroom.cluster.split_plan import (
    RPC_SERVER_RUNTIME,
    engine_bytes,
    plan_rooms,
    plan_split,
    share_compute,
)
from elbowroom.config import Settings
from elbowroom.models.estimate import compute_bytes, kv_bytes
from elbowroom.units import MiB

SMOLLM2 = "smollm2-135m"


def test_layers_follow_room_and_each_share_holds_its_terms() -> None:
    spec = bundled_spec(SMOLLM2)
    info = spec.gguf
    assert info is not None and info.layer_bytes is not None
    settings = Settings(ctx=2048, slots=2)
    plan = plan_split(spec, settings, {"b": 1000 * MiB, "a": 2000 * MiB, "tiny": 10 * MiB})
    assert dict(plan.split.layers) == {"a": 20, "b": 10}, "largest room first; tiny left out"
    assert plan.home == "a"
    a, b = plan.shares["a"], plan.shares["b"]
    assert a.weights == sum(info.layer_bytes[:20])
    assert b.weights == sum(info.layer_bytes[20:]) + info.output_bytes  # output: last node
    assert a.kv + b.kv == kv_bytes(info, 2048, 2, "f16") and a.kv == 2 * b.kv
    assert a.engine == engine_bytes(spec, 2048, 2, "f16") > info.input_bytes and b.engine == 0
    assert a.compute > b.compute > compute_bytes(info, 2048, 2)  # pipeline copies
    assert a.runtime == b.runtime == RPC_SERVER_RUNTIME
    assert plan.need == {"a": a.total, "b": b.total}
    # The node's scheduler reserves the whole share; all but the idle RPC server arrives
    # once the engine loads.
    p = share_plan(plan, "b")
    assert p.request.needed == b.total and p.request.model == "smollm2-135m~share"
    assert p.footprint.working == b.total - RPC_SERVER_RUNTIME


def test_share_compute_matches_llama_cpps_buffers_on_this_build() -> None:
    """llama.cpp's reported RPC compute buffers (this build, SmolLM2, f16 KV): 18.91 MiB
    on a device after the first and 29.05 on the first at n_ctx 512 x 1 slot, 24.91 and
    35.05 at 2048, 20.91 and 31.05 at 1024 x 2 slots. The prediction covers each, within
    1.1 MiB (tests/e2e/test_split_engine.py reads them from a real split)."""
    info = bundled_spec(SMOLLM2).gguf
    assert info is not None
    for (ctx, slots), (first, other) in {
        (512, 1): (29.05, 18.91),
        (2048, 1): (35.05, 24.91),
        (1024, 2): (31.05, 20.91),
    }.items():
        for is_first, reported in ((True, first), (False, other)):
            predicted = share_compute(info, ctx, slots, first=is_first) / MiB
            assert reported <= predicted <= reported + 1.1, (ctx, slots, is_first, predicted)


def test_a_share_that_does_not_fit_names_its_node() -> None:
    spec = bundled_spec(SMOLLM2)
    settings = Settings(ctx=512, slots=1)
    with pytest.raises(SplitError, match=r"node a would hold .* and the split's engine"):
        plan_split(spec, settings, {"a": 150 * MiB, "b": 140 * MiB})
    with pytest.raises(SplitError, match="at least two nodes"):
        plan_split(spec, settings, {"a": 900 * MiB, "b": MiB})


def test_rooms_are_free_bytes_then_with_idle_models_evicted() -> None:
    free, evict = plan_rooms([("a", 100, 50), ("b", 0, 70), ("c", 0, 0)])
    assert free == {"a": 100} and evict == {"a": 150, "b": 70}
