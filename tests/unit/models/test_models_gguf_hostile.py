"""Crafted GGUF files: every one is a clear InvalidModel, fast, and discovery goes on."""

from __future__ import annotations

import json
import resource
import time
from pathlib import Path

import pytest
from crafted_gguf import (
    gguf,
    i32,
    int_array,
    model_kvs,
    nested_arrays,
    string_array_header,
    text,
    u32,
    write_hostile_models,
)

from elbowroom.cli import main
from elbowroom.config import Settings
from elbowroom.models.catalog import discover
from elbowroom.models.gguf_meta import InvalidModel, read_gguf_info


def read(tmp_path: Path, data: bytes) -> object:
    path = tmp_path / "m.gguf"
    path.write_bytes(data)
    return read_gguf_info(path)


def test_a_hand_built_header_reads(tmp_path: Path) -> None:
    info = read(tmp_path, gguf(model_kvs(context_length=4096, attention__head_count_kv=2)))
    assert info.n_layers == 2 and info.n_kv_heads == 2 and info.trained_ctx == 4096  # type: ignore[attr-defined]
    assert info.head_dim_k == 16  # type: ignore[attr-defined]


@pytest.mark.parametrize(
    ("kvs", "reason"),
    [
        ([*model_kvs(), nested_arrays("x", 2000)], "array of arrays"),
        ([*model_kvs(), nested_arrays("x", 2)], "array of arrays"),
        ([*model_kvs(), string_array_header("tokenizer.ggml.tokens", 10**7)], "10000000 strings"),
        ([*model_kvs(), string_array_header("t", 1000)], "past the end"),
        ([*model_kvs(), i32("llama.attention.head_count_kv", -4)], "head_count_kv = -4"),
        ([*model_kvs(attention__head_count=1 << 20)], "head_count = 1048576"),
        ([*model_kvs(block_count=0)], "block_count = 0"),
        ([*model_kvs(), u32("llama.context_length", 1 << 31)], "context_length"),
        ([*model_kvs(), text("llama.attention.key_length", "64")], "not an integer"),
        ([*model_kvs(), u32("llama.block_count", 3)], "duplicate"),
    ],
)
def test_crafted_headers_are_invalid_models(tmp_path: Path, kvs: list[bytes], reason: str) -> None:
    began = time.perf_counter()
    with pytest.raises(InvalidModel) as err:
        read(tmp_path, gguf(kvs))
    assert reason in err.value.message
    assert str(tmp_path / "m.gguf") in err.value.message
    assert time.perf_counter() - began < 0.5


def test_absurd_counts_are_refused_before_looping(tmp_path: Path) -> None:
    import struct

    for n_tensors, n_kv in ((0, 1 << 40), (1 << 40, 0)):
        data = b"GGUF" + struct.pack("<IQQ", 3, n_tensors, n_kv)
        with pytest.raises(InvalidModel, match="implausible"):
            read(tmp_path, data)


def test_a_ten_million_number_array_is_skipped_not_read(tmp_path: Path) -> None:
    """The old reader took 260 MB and 4 s; this one skips it by arithmetic."""
    data = gguf([*model_kvs(), int_array("x.big", 10**7)])
    before = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    began = time.perf_counter()
    info = read(tmp_path, data)
    assert time.perf_counter() - began < 0.5
    grown_kib = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss - before
    assert grown_kib < 20 * 1024  # the file is mmap'd, its pages never touched
    assert info.n_layers == 2  # type: ignore[attr-defined]


def test_discovery_lists_crafted_files_as_problems(tmp_path: Path) -> None:
    expected = write_hostile_models(tmp_path / "models")
    catalog = discover(Settings(models_dir=tmp_path / "models", data_dir=tmp_path / "data"))
    reasons = {p.path.name: p.reason for p in catalog.problems}
    assert set(reasons) == set(expected)
    for name, why in expected.items():
        assert why in reasons[name]
    assert "smollm2-135m" in catalog  # the bundled models are still there


def test_ls_json_shows_the_problems(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("ELBOWROOM_DATA_DIR", str(tmp_path / "data"))
    monkeypatch.setenv("XDG_CONFIG_HOME", str(tmp_path / "config"))  # no user config file
    write_hostile_models(tmp_path / "models")
    code = main(
        [
            "ls",
            "--json",
            "--override-memory",
            "8GiB",
            "--models-dir",
            str(tmp_path / "models"),
        ]
    )
    assert code == 0
    data = json.loads(capsys.readouterr().out)
    assert sorted(Path(p["path"]).name for p in data["problems"]) == [
        "array-1e7.gguf",
        "negative-kv.gguf",
        "nested-2000.gguf",
    ]


def test_the_vocabulary_s_longest_token_is_kept(smollm2_path: Path) -> None:
    info = read_gguf_info(smollm2_path)
    assert info.tokenizer_model == "gpt2"
    assert info.max_token_bytes is not None and 8 <= info.max_token_bytes <= 1024
