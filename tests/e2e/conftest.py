"""Shared e2e fixtures: ``server_factory`` starts real servers (serverproc.ServerProcess)
that are stopped when the module ends.

gemma3-270m ships in chunks that ``prepare`` assembles into the data folder (253 MB). The
session does that at most once: it links the copy setup made in the default data folder,
or assembles one into a session folder, and every server's own data folder links to it.
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from serverproc import ServerFactory, ServerProcess


@pytest.fixture(scope="session")
def gemma_file(tmp_path_factory: pytest.TempPathFactory) -> Path | None:
    """The assembled gemma3-270m GGUF, or None when its packages are not installed."""
    from elbowroom.config import Settings, load_settings
    from elbowroom.models.bundled import bundled_specs, gemma_path, prepare, unprepared

    default = load_settings(environ={})
    if any(spec.id == "gemma3-270m" for spec in bundled_specs(default)):
        return gemma_path(default)  # setup assembled it already
    if "gemma3-270m" not in unprepared(default):
        return None
    settings = Settings(data_dir=tmp_path_factory.mktemp("gemma"))
    prepare(settings)
    return gemma_path(settings)


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
