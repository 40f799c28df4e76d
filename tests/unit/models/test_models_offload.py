"""Per-device bytes of a GPU split, checked against loads recorded on an H200."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
from gpu_layouts import calib, recorded, shape, synth_layout

from elbowroom.models.accuracy import check
from elbowroom.models.gguf_meta import read_gguf_info, tensor_bytes_by_layer
from elbowroom.scheduler.offload import SPLIT_FIRST_EXTRA, UBATCH, Layout, split_bytes, unit_devices
from elbowroom.units import MiB

VOCAB = 49152


def test_tied_output_is_a_second_copy_of_the_embeddings() -> None:
    tensors = [("token_embd.weight", 100), ("output_norm.weight", 4), ("blk.0.x", 10)]
    assert tensor_bytes_by_layer(tensors, 1) == ((10,), 100, 104)
    untied = [*tensors, ("output.weight", 50)]
    assert tensor_bytes_by_layer(untied, 1) == ((10,), 100, 54)
    assert tensor_bytes_by_layer([], 3) == (None, 0, 0)


def test_real_gguf_tensors_add_up(smollm2_path: Path) -> None:
    info = read_gguf_info(smollm2_path)
    assert info.layer_bytes is not None and len(info.layer_bytes) == info.n_layers == 30
    assert info.n_ff == 1536
    # SmolLM2 ties its output to the embeddings: everything on disk is counted once, plus
    # the embeddings' second copy in the output layer.
    # The gguf package's own reader (slow, ~2 s, but independent of ours) says what is on disk.
    from gguf import GGUFReader

    on_disk = sum(int(t.n_bytes) for t in GGUFReader(smollm2_path).tensors)
    assert sum(info.layer_bytes) + info.input_bytes + info.output_bytes == (
        on_disk + info.input_bytes
    )
    layout = Layout.from_info(info)
    assert layout.units == 31 and layout.n_vocab == 49152


def test_units_follow_llama_cpp_n_gpu_layers() -> None:
    # n_gpu_layers=3 on 4 blocks: the output layer and the last two blocks.
    assert unit_devices(4, [3]) == [None, None, 0, 0, 0]
    assert unit_devices(4, [2, 3]) == [0, 0, 1, 1, 1]
    assert unit_devices(4, []) == [None] * 5
    with pytest.raises(ValueError):
        unit_devices(4, [6])


# ngl=0 rows were loaded with the GPU visible (CUDA context + op offload: ~0.8 GB of VRAM).
# elbowroom hides the GPUs from a CPU-placed runner instead (engines.llama.select_gpus).
GPU_ROWS = [r for r in calib()["loads"] if r["ngl"] > 0]


@pytest.mark.parametrize(
    "row", GPU_ROWS, ids=lambda r: f"{r['model']}-{r['ctx']}x{r['slots']}-ngl{r['ngl']}"
)
def test_predicts_recorded_vram_within_two_percent(row: dict[str, Any]) -> None:
    shape = calib()["models"][row["model"]]
    layout = synth_layout(shape)
    units = min(row["ngl"], layout.units)
    b = split_bytes(layout, row["ctx"], row["slots"], "f16", [units])
    measured = row["gpu_used_delta"][0]
    assert abs(b.gpu[0] - measured) <= 0.02 * measured, (b.gpu[0], measured)


def test_kv_moves_with_its_layers() -> None:
    shape = calib()["models"]["llama1b.gguf"]
    layout = synth_layout(shape)
    full = split_bytes(layout, 4096, 4, "f16", [17])
    half = split_bytes(layout, 4096, 4, "f16", [9])
    kv_block = 2 * 8 * 64 * 2 * 4096 * 4  # K+V × kv heads × head dim × f16 × tokens
    # 8 blocks left the GPU: their weights and KV are host bytes now; op offload borrows
    # a quarter block of VRAM for prompt batches while blocks stay on the CPU.
    moved = 8 * (layout.block_bytes[0] + kv_block)
    assert full.gpu[0] - half.gpu[0] == moved - layout.block_bytes[0] // 4
    assert half.host_anonymous - full.host_anonymous == 8 * kv_block
    assert half.host_file - full.host_file == 8 * layout.block_bytes[0]
    assert 0.4 < half.gpu_share < 0.6 and full.gpu_share > 0.9


def test_two_gpus_hold_their_runs_and_the_output_device_the_logits() -> None:
    layout = synth_layout(calib()["models"]["llama1b.gguf"])
    b = split_bytes(layout, 2048, 1, "f16", [8, 9])
    # The second device holds the output layer and its logits buffer; the first the extra
    # a split's first GPU was measured to hold.
    logits = 4 * UBATCH * VOCAB
    assert b.gpu[1] - b.gpu[0] > layout.output_bytes + logits - SPLIT_FIRST_EXTRA - 10 * MiB
    assert b.host_file < split_bytes(layout, 2048, 1, "f16", [0]).host_file


SERVER_LOADS = recorded("h200_server_vram.json")["loads"]


@pytest.mark.parametrize(
    "row", SERVER_LOADS, ids=lambda r: f"{r['model']}-{r['ctx']}x{r['slots']}-{r['processor']}"
)
def test_predicts_vram_of_loads_through_the_server_within_one_percent(row: dict[str, Any]) -> None:
    # Two of the four models (qwen3b, llama8b) were not in the fit: out of sample.
    if row["processor"] == "100% CPU":
        assert row["measured_gpu"] == {"gpu0": 0, "gpu1": 0}  # hidden from the runner
        return
    layout = shape(row["model"])
    b = split_bytes(layout, row["ctx"], row["slots"], "f16", row["layers_per_device"])
    measured = row["measured_gpu"]["gpu0"]
    assert abs(b.gpu[0] - measured) <= 0.01 * measured, (b.gpu[0], measured)


@pytest.mark.parametrize("row", recorded("h200x2_splits.json")["splits"], ids=lambda r: r["model"])
def test_predicts_each_gpu_of_a_recorded_split_within_two_percent(row: dict[str, Any]) -> None:
    layout = shape(row["model"])
    b = split_bytes(layout, row["ctx"], row["slots"], "f16", row["layers_per_device"])
    for i, pool in enumerate(("gpu0", "gpu1")):
        measured = row["measured_gpu"][pool]
        assert abs(b.gpu[i] - measured) <= 0.02 * measured, (pool, b.gpu[i], measured)


def _first_batch_rows() -> list[dict[str, object]]:
    path = Path(__file__).parents[3] / "benchmarks" / "results" / "gpu_first_batch_h100.jsonl"
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


def test_an_h100_runner_after_its_first_batched_prompt_is_the_base_fitted_on_the_h200() -> None:
    """Issue 27b: the H100 holds the H200's ~104 MiB step too, once a prompt is batched (in
    process, f16, 2,048 x 1): the device base is the settled runner's, not one card's."""
    rows = _first_batch_rows()
    assert rows
    for row in rows:
        name = str(row["model"]).removesuffix(".gguf")
        layout = shape(name)
        predicted = split_bytes(layout, 2048, 1, "f16", [layout.units]).gpu[0]
        measured = int(float(str(row["vram_mib"])) * MiB)
        acc = check(f"{name} {row['cfg']} {row['stage']}", predicted, measured)
        long_first = str(row["cfg"]).startswith("D")  # config D: the long prompt came first
        if row["stage"] == "load" or (row["stage"] == "short16" and not long_first):
            # before the step (a 4-token prompt does not take it): over by about the step
            assert 0.03 < acc.error < 0.08, acc
        else:
            assert abs(acc.error) < 0.005, acc  # settled: within half a percent
