"""A runner spawned by a node's agent does not run the actor's ``__main__`` again (issue 27).

In a Ray actor ``__main__`` is Ray's worker script; multiprocessing's spawn re-runs the
parent's main module in the child, so every runner on a node imported Ray (+43 MiB). Here
the parent's ``__main__`` is a stand-in script that leaves a mark when it runs.
"""

from __future__ import annotations

import multiprocessing
import sys
import types
from collections.abc import Iterator
from pathlib import Path

import pytest
from placeholder_spec import SPEC

from elbowroom.cluster.agent import spawn_bare
from elbowroom.engines.options import EngineOptions
from elbowroom.models.spec import ModelSpec
from elbowroom.runtime.supervisor import spawn_worker


def quiet(conn: object, spec: ModelSpec, options: EngineOptions) -> None:
    """The child's whole work: nothing (the question is what ran before it)."""


@pytest.fixture
def marking_main(tmp_path: Path) -> Iterator[Path]:
    mark = tmp_path / "main-ran"
    script = tmp_path / "fake_ray_worker.py"
    script.write_text(f"open({str(mark)!r}, 'w').close()\n")
    fake = types.ModuleType("__main__")
    fake.__file__ = str(script)
    saved = sys.modules["__main__"]
    sys.modules["__main__"] = fake
    try:
        yield mark
    finally:
        sys.modules["__main__"] = saved


def run(spawn: object, mark: Path) -> bool:
    _parent, child = multiprocessing.Pipe()
    proc = spawn(child, SPEC, EngineOptions(), target=quiet)  # type: ignore[operator]
    proc.join(60)
    assert proc.exitcode == 0
    main = sys.modules["__main__"]
    assert main.__file__ is not None and main.__file__.endswith("fake_ray_worker.py")
    return mark.exists()


def test_a_plain_spawn_runs_the_parent_s_main_in_the_child(marking_main: Path) -> None:
    assert run(spawn_worker, marking_main)  # the cost the agent avoids


def test_the_agent_spawns_its_runners_without_the_actor_s_main(marking_main: Path) -> None:
    assert not run(spawn_bare, marking_main)
