"""The measured-footprint store: a real JSON file in a temporary folder."""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest
from bundled_models import SMOLLM2_INFO

from elbowroom.memory.types import ProcessMemory
from elbowroom.models.estimate import footprint, kv_bytes_per_token, max_context
from elbowroom.models.measured import MeasuredStore
from elbowroom.models.spec import Holding, ModelKind, ModelSpec
from elbowroom.units import MiB

INFO = SMOLLM2_INFO
MEM = ProcessMemory(anonymous=200 * MiB, file_backed=120 * MiB, swap=1, gpu=2)


@pytest.fixture
def weights(tmp_path: Path) -> Path:
    path = tmp_path / "m.gguf"
    path.write_bytes(b"GGUF" + b"\0" * 1000)
    return path


def llm(path: Path) -> ModelSpec:
    return ModelSpec(
        id="m",
        kind=ModelKind.LLM,
        engine="llama",
        path=path,
        size_bytes=path.stat().st_size,
        holding=Holding.MMAP,
        source="path",
        gguf=INFO,
    )


def test_round_trip_through_a_new_store(tmp_path: Path, weights: Path) -> None:
    path = tmp_path / "state" / "measured.json"
    MeasuredStore(path).record(llm(weights), 4096, 1, "f16", MEM)
    again = MeasuredStore(path).lookup(llm(weights), 4096, 1, "f16")
    assert again == ProcessMemory(200 * MiB, 120 * MiB, 1, 2)
    assert [p.name for p in path.parent.iterdir()] == ["measured.json"]  # no temp left over
    assert json.loads(path.read_text())["version"] == 2


def test_nothing_known_is_none(tmp_path: Path, weights: Path) -> None:
    assert MeasuredStore(tmp_path / "absent.json").lookup(llm(weights), 512, 1, "f16") is None


def test_recording_again_keeps_the_larger_value(tmp_path: Path, weights: Path) -> None:
    store = MeasuredStore(tmp_path / "m.json")
    store.record(llm(weights), 4096, 1, "f16", MEM)
    store.record(llm(weights), 4096, 1, "f16", ProcessMemory(150 * MiB, 130 * MiB))
    got = store.lookup(llm(weights), 4096, 1, "f16")
    assert got is not None and (got.anonymous, got.file_backed) == (200 * MiB, 130 * MiB)


def test_recording_what_is_known_writes_nothing(tmp_path: Path, weights: Path) -> None:
    path = tmp_path / "m.json"
    store = MeasuredStore(path)
    store.record(llm(weights), 4096, 1, "f16", MEM)
    written = path.stat().st_ino, path.stat().st_mtime_ns  # a save replaces the file
    store.record(llm(weights), 4096, 1, "f16", ProcessMemory(150 * MiB, 30 * MiB))
    assert (path.stat().st_ino, path.stat().st_mtime_ns) == written
    assert not [p for p in tmp_path.iterdir() if p.name.startswith(".measured-")]
    store.record(llm(weights), 4096, 1, "f16", ProcessMemory(250 * MiB, 30 * MiB))
    assert path.stat().st_ino != written[0]  # a larger value is written


def test_llm_measurement_is_rescaled_by_kv_arithmetic(tmp_path: Path, weights: Path) -> None:
    store = MeasuredStore(tmp_path / "m.json")
    store.record(llm(weights), 4096, 1, "f16", MEM)
    per_token = kv_bytes_per_token(INFO, "f16")
    bigger = store.lookup(llm(weights), 8192, 1, "f16")
    assert bigger is not None
    assert bigger.anonymous == MEM.anonymous + per_token * 4096
    assert bigger.file_backed == MEM.file_backed
    q8 = store.lookup(llm(weights), 4096, 1, "q8_0")
    assert q8 is not None
    assert q8.anonymous == MEM.anonymous - (per_token - kv_bytes_per_token(INFO, "q8_0")) * 4096
    # a second slot owns its own context and logits row
    two = store.lookup(llm(weights), 4096, 2, "f16")
    assert two is not None and two.anonymous == MEM.anonymous + per_token * 4096 + 49152 * 4


def test_nearest_measurement_is_used(tmp_path: Path, weights: Path) -> None:
    store = MeasuredStore(tmp_path / "m.json")
    store.record(llm(weights), 512, 1, "f16", ProcessMemory(60 * MiB, 120 * MiB))
    store.record(llm(weights), 8192, 1, "f16", ProcessMemory(240 * MiB, 120 * MiB))
    got = store.lookup(llm(weights), 7936, 1, "f16")
    assert got is not None
    assert got.anonymous == 240 * MiB - kv_bytes_per_token(INFO, "f16") * 256


def test_resident_measurement_applies_at_any_settings(tmp_path: Path, weights: Path) -> None:
    spec = ModelSpec(
        id="w",
        kind=ModelKind.ASR,
        engine="whisper",
        path=weights,
        size_bytes=10,
        holding=Holding.RESIDENT,
        source="path",
    )
    store = MeasuredStore(tmp_path / "m.json")
    store.record(spec, 0, 1, "f16", MEM)
    assert store.lookup(spec, 0, 1, "f16") == MEM
    assert store.lookup(spec, 4096, 2, "q4_0") == MEM


def test_replacing_the_file_forgets_it(tmp_path: Path, weights: Path) -> None:
    store = MeasuredStore(tmp_path / "m.json")
    store.record(llm(weights), 4096, 1, "f16", MEM)
    weights.write_bytes(b"GGUF" + b"\1" * 2000)  # new size: a different identity
    assert store.lookup(llm(weights), 4096, 1, "f16") is None


def test_missing_weights_are_neither_recorded_nor_found(tmp_path: Path, weights: Path) -> None:
    spec = llm(weights)
    weights.unlink()
    store = MeasuredStore(tmp_path / "m.json")
    store.record(spec, 4096, 1, "f16", MEM)
    assert store.lookup(spec, 4096, 1, "f16") is None
    assert not (tmp_path / "m.json").exists()


@pytest.mark.parametrize("junk", ["{not json", "[]", '{"models": {"x": 1}}', ""])
def test_corrupt_file_reads_as_empty_and_is_repaired(
    tmp_path: Path, weights: Path, junk: str
) -> None:
    path = tmp_path / "m.json"
    path.write_text(junk)
    store = MeasuredStore(path)
    assert store.lookup(llm(weights), 4096, 1, "f16") is None
    store.record(llm(weights), 4096, 1, "f16", MEM)
    assert store.lookup(llm(weights), 4096, 1, "f16") == MEM


def test_invalid_entries_are_ignored(tmp_path: Path, weights: Path) -> None:
    path = tmp_path / "m.json"
    store = MeasuredStore(path)
    store.record(llm(weights), 4096, 1, "f16", MEM)
    data = json.loads(path.read_text())
    (entry,) = next(iter(data["models"].values()))["entries"].values()
    entry["anonymous"] = "lots"
    path.write_text(json.dumps(data))
    assert store.lookup(llm(weights), 4096, 1, "f16") is None


def test_footprint_and_max_context_use_the_store(tmp_path: Path, weights: Path) -> None:
    store = MeasuredStore(tmp_path / "m.json")
    spec = llm(weights)
    predicted = footprint(spec, 4096)
    # recorded right after load: 50 MiB more than predicted, before any working memory
    at_load = predicted.anonymous - predicted.working + 50 * MiB
    store.record(spec, 4096, 1, "f16", ProcessMemory(at_load, 120 * MiB))
    fp = footprint(spec, 4096, measured=store)
    assert fp.measured and fp.anonymous == predicted.anonymous + 50 * MiB
    assert fp.at_load == at_load + 120 * MiB
    budget = fp.total
    assert max_context(spec, budget, measured=store) == 4096
    assert max_context(spec, budget) > 4096  # the prediction alone is more optimistic


def test_store_file_is_written_atomically(tmp_path: Path, weights: Path) -> None:
    path = tmp_path / "m.json"
    store = MeasuredStore(path)
    store.record(llm(weights), 512, 1, "f16", MEM)
    inode = os.stat(path).st_ino
    store.record(llm(weights), 1024, 1, "f16", MEM)
    assert os.stat(path).st_ino != inode  # replaced by rename, never rewritten in place
    assert len(json.loads(path.read_text())["models"]) == 1


def test_a_version_1_file_is_ignored(tmp_path: Path, weights: Path) -> None:
    # Version 1 recorded LLMs at unload, prompt cache included (2.4x SmolLM2's own size).
    path = tmp_path / "m.json"
    store = MeasuredStore(path)
    store.record(llm(weights), 4096, 1, "f16", MEM)
    data = json.loads(path.read_text())
    data["version"] = 1
    path.write_text(json.dumps(data))
    assert store.lookup(llm(weights), 4096, 1, "f16") is None
    store.record(llm(weights), 4096, 1, "f16", ProcessMemory(MiB, MiB))
    assert store.lookup(llm(weights), 4096, 1, "f16") == ProcessMemory(MiB, MiB)
