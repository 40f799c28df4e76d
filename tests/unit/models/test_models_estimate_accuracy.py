"""The SmolLM2 prediction against a real load (a correctness check, not a timing).

Loads the model with llama.cpp in a child process at n_ctx 512 and 8192, runs a short
generation and reads the child's /proc/PID/smaps_rollup (elbowroom.models.calibrate).
benchmarks/estimate_accuracy.py does the same for every bundled model and records it.
"""

from __future__ import annotations

import sys

import pytest

from elbowroom.config import Settings
from elbowroom.models.bundled import bundled_specs
from elbowroom.models.calibrate import measure_load
from elbowroom.models.estimate import footprint

pytestmark = [
    pytest.mark.slow,
    pytest.mark.skipif(not sys.platform.startswith("linux"), reason="reads /proc smaps_rollup"),
]


@pytest.mark.parametrize("n_ctx", [512, 8192])
def test_smollm2_prediction_within_10_percent(empty_settings: Settings, n_ctx: int) -> None:
    pytest.importorskip("llama_cpp")
    spec = next((s for s in bundled_specs(empty_settings) if s.id == "smollm2-135m"), None)
    if spec is None:
        pytest.skip("the bundled SmolLM2 is not installed")
    measured = measure_load(spec, n_ctx, "f16", timeout=240).used
    predicted = footprint(spec, n_ctx)
    error = (predicted.total - measured.resident) / measured.resident
    assert abs(error) <= 0.10, (
        f"n_ctx {n_ctx}: predicted {predicted.total} (anon {predicted.anonymous}, file "
        f"{predicted.file_backed}), measured {measured.resident} (anon {measured.anonymous}, "
        f"file {measured.file_backed}): {error:+.1%}"
    )
    # The KV cache is most of what n_ctx changes; the anonymous part must track it too.
    assert abs(predicted.anonymous - measured.anonymous) <= 0.15 * measured.anonymous
