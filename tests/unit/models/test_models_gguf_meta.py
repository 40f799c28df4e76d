"""GGUF metadata: the real bundled files, files written by the gguf package, and junk."""

from __future__ import annotations

from pathlib import Path

import pytest
from gguf_files import write_gguf

from elbowroom.models.gguf_meta import InvalidModel, read_gguf_info


def test_smollm2_metadata(smollm2_path: Path) -> None:
    info = read_gguf_info(smollm2_path)
    assert info.architecture == "llama"
    assert (info.n_layers, info.n_heads, info.n_kv_heads) == (30, 9, 3)
    assert (info.head_dim_k, info.head_dim_v) == (64, 64)  # defaulted: 576 / 9
    assert info.n_embd == 576
    assert info.trained_ctx == 8192
    assert info.file_type == "Q4_1"
    assert info.has_chat_template is True
    assert info.sliding_window is None
    assert info.n_vocab == 49152
    assert info.kv_heads_per_layer is None
    assert info.mmproj is None
    assert info.n_params is not None and 130e6 < info.n_params < 140e6
    # what the estimate's file, compute and repack terms read (tests/bundled_models.py)
    assert info.n_ff == 1536 and info.n_expert == 0
    assert info.tensor_bytes == 96_576_768  # llama.cpp maps 92.10 MiB
    # tied: token_embd (Q8_0) is the output projection's weight too
    assert info.matmul_bytes == (("Q4_1", 66_355_200), ("Q8_0", 30_081_024))


def test_gemma3_metadata(gemma_path: Path) -> None:
    info = read_gguf_info(gemma_path)
    assert info.architecture == "gemma3"
    assert (info.n_layers, info.n_heads, info.n_kv_heads) == (18, 4, 1)
    assert (info.head_dim_k, info.head_dim_v) == (256, 256)  # explicit key/value_length
    assert info.trained_ctx == 32768
    assert info.sliding_window == 512
    assert info.file_type == "Q4_K_M"
    assert info.has_chat_template is False  # a base model
    assert info.n_vocab == 262144  # counted from the token list, which is skipped over
    assert info.n_ff == 2048 and info.tensor_bytes == 246_587_904  # llama.cpp: 235.16 MiB
    # tied: token_embd (Q8_0) is the output projection's weight too
    assert dict(info.matmul_bytes) == {
        "Q4_K": 13_271_040,
        "Q5_0": 43_591_680,
        "Q6_K": 9_676_800,
        "Q8_0": 179_824_640,
    }


def test_per_layer_kv_heads_and_default_head_dim(tmp_path: Path) -> None:
    path = write_gguf(
        tmp_path / "elm.gguf",
        arch="openelm",
        layers=3,
        embd=96,
        heads=[4, 6, 6],
        kv_heads=[1, 2, 0],
    )
    info = read_gguf_info(path)
    assert info.kv_heads_per_layer == (1, 2, 0)
    assert info.n_kv_heads == 2 and info.n_heads == 6
    assert info.head_dim_k == info.head_dim_v == 96 // 6
    assert info.n_vocab == 300


def test_missing_kv_heads_means_multi_head_attention(tmp_path: Path) -> None:
    info = read_gguf_info(write_gguf(tmp_path / "mha.gguf", kv_heads=None, heads=8))
    assert info.n_kv_heads == 8 and info.kv_heads_per_layer is None


def test_chat_template_and_mmproj_beside(tmp_path: Path) -> None:
    model = write_gguf(tmp_path / "vision.gguf", chat_template="{{ messages }}")
    projector = write_gguf(tmp_path / "mmproj-vision-f16.gguf", arch="clip")
    info = read_gguf_info(model)
    assert info.has_chat_template is True
    assert info.mmproj == projector


@pytest.mark.parametrize(
    ("name", "content"),
    [
        ("text.gguf", b"this is not a model at all\n" * 10),
        ("empty.gguf", b""),
        ("wrong-version.gguf", b"GGUF" + (99).to_bytes(4, "little") + b"\0" * 64),
    ],
)
def test_junk_is_a_clear_invalid_model(tmp_path: Path, name: str, content: bytes) -> None:
    path = tmp_path / name
    path.write_bytes(content)
    with pytest.raises(InvalidModel) as err:
        read_gguf_info(path)
    assert err.value.status == 400
    assert str(path) in err.value.message


def test_truncated_gguf_is_invalid(tmp_path: Path, smollm2_path: Path) -> None:
    path = tmp_path / "cut.gguf"
    with smollm2_path.open("rb") as src:
        path.write_bytes(src.read(200_000))  # stops inside the token list
    with pytest.raises(InvalidModel, match="not a readable GGUF"):
        read_gguf_info(path)


def test_folder_and_missing_file_are_invalid(tmp_path: Path) -> None:
    with pytest.raises(InvalidModel):
        read_gguf_info(tmp_path)
    with pytest.raises(InvalidModel):
        read_gguf_info(tmp_path / "absent.gguf")


def test_gguf_without_architecture_is_invalid(tmp_path: Path) -> None:
    from gguf import GGUFWriter

    path = tmp_path / "bare.gguf"
    writer = GGUFWriter(str(path), "llama", use_temp_file=False)
    writer.kv_data[0].pop("general.architecture", None)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    with pytest.raises(InvalidModel, match=r"general\.architecture"):
        read_gguf_info(path)


def test_moe_and_window_pattern_keys(tmp_path: Path) -> None:
    import numpy as np
    from gguf import GGUFWriter

    path = tmp_path / "moe.gguf"
    w = GGUFWriter(str(path), "qwen3moe")
    w.add_block_count(2)
    w.add_embedding_length(64)
    w.add_head_count(4)
    w.add_feed_forward_length(256)
    w.add_expert_count(8)
    w.add_expert_used_count(2)
    w.add_expert_feed_forward_length(128)
    w.add_sliding_window(128)
    w.add_sliding_window_pattern(3)
    w.add_token_list([f"t{i}" for i in range(304)])
    w.add_tensor("token_embd.weight", np.zeros((304, 64), dtype=np.float32))
    w.add_tensor("output.weight", np.zeros((304, 64), dtype=np.float32))
    w.add_tensor("blk.0.ffn_up_exps.weight", np.zeros((8, 128, 64), dtype=np.float16))
    w.add_tensor("blk.0.attn_norm.weight", np.ones(64, dtype=np.float32))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    info = read_gguf_info(path)
    assert (info.n_expert, info.n_expert_used, info.n_ff_expert) == (8, 2, 128)
    assert (info.sliding_window, info.swa_pattern) == (128, 3)
    assert info.tensor_bytes == 304 * 64 * 4 * 2 + 8 * 128 * 64 * 2 + 64 * 4
    # untied: token_embd is only looked up; 1-D norms multiply nothing
    assert dict(info.matmul_bytes) == {"F32": 304 * 64 * 4, "F16": 8 * 128 * 64 * 2}
