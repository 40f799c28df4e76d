"""Fixtures shared by every test folder."""

from __future__ import annotations

import pytest

from elbowroom.config import Settings, load_settings
from elbowroom.models.bundled import bundled_specs, prepare, unprepared


@pytest.fixture(scope="session")
def gemma_settings(tmp_path_factory: pytest.TempPathFactory) -> Settings | None:
    """Settings whose data dir holds the assembled gemma3-270m, or None when its packages
    are not installed.

    gemma ships in chunks that ``prepare`` joins (253 MB), so a session does it at most
    once: it uses the copy setup made in the default data dir, or assembles one into a
    session folder.
    """
    default = load_settings(environ={})
    if any(spec.id == "gemma3-270m" for spec in bundled_specs(default)):
        return default  # setup assembled it already
    if "gemma3-270m" not in unprepared(default):
        return None
    settings = Settings(data_dir=tmp_path_factory.mktemp("gemma"))
    prepare(settings)
    return settings
