"""Shared e2e fixtures: ``server_factory`` starts real servers (serverproc.ServerProcess)
that are stopped when the module ends.

gemma3-270m ships in chunks that ``prepare`` assembles into the data folder (253 MB). The
session does that at most once (``gemma_settings`` in tests/conftest.py), and every server's
own data folder links to that copy.
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from serverproc import ServerFactory, ServerProcess

from elbowroom.config import Settings
from elbowroom.models.bundled import gemma_path


@pytest.fixture(scope="session")
def gemma_file(gemma_settings: Settings | None) -> Path | None:
    """The assembled gemma3-270m GGUF (tests/conftest.py), or None when its packages are not
    installed."""
    return gemma_path(gemma_settings) if gemma_settings is not None else None


def link_gemma(home: Path, gemma: Path | None) -> None:
    """Make ``gemma`` visible in the data folder ServerProcess gives a server in ``home``."""
    if gemma is None:
        return
    target = home / "data" / "elbowroom" / "bundled" / gemma.name
    if not target.exists():
        target.parent.mkdir(parents=True, exist_ok=True)
        target.symlink_to(gemma)


@pytest.fixture(scope="module")
def server_factory(
    tmp_path_factory: pytest.TempPathFactory, gemma_file: Path | None
) -> Iterator[ServerFactory]:
    """Start servers that are stopped when the module ends:
    ``server_factory("--ctx", "1024", env={...}, api_key=..., home=path)``."""
    started: list[ServerProcess] = []

    def start(*args: str, home: Path | None = None, **kw: Any) -> ServerProcess:
        home = home or tmp_path_factory.mktemp("server")
        link_gemma(home, gemma_file)
        server = ServerProcess(home, *args, **kw)
        started.append(server)
        return server.start()

    yield start
    for server in started:
        server.stop()
