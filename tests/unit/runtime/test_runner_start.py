"""How a runner process starts (``runner_start``): forked from a forkserver that imported
the runner's code once, so that a model switch does not wait for a fresh interpreter to
import it (0.35-0.55 s of every switch in issue 24's arena), or spawned fresh."""

from __future__ import annotations

import multiprocessing
import os
from typing import Any

import pytest
import start_probe
from placeholder_spec import SPEC

from elbowroom.config import ConfigError, load_settings
from elbowroom.engines.options import EngineOptions
from elbowroom.memory.process import ServerBytes, forkserver_pid, measure_pid
from elbowroom.runtime.supervisor import PRELOAD, spawn_worker


def started(method: str) -> dict[str, Any]:
    parent, child = multiprocessing.Pipe()
    proc = spawn_worker(child, SPEC, EngineOptions(), target=start_probe.report_main, method=method)
    child.close()
    assert parent.poll(120), "the runner process did not report"
    report: dict[str, Any] = parent.recv()
    proc.join(60)
    assert proc.exitcode == 0
    return report


def test_a_forkserver_runner_starts_with_the_runner_code_imported() -> None:
    report = started("forkserver")
    assert set(PRELOAD) <= set(report["modules"])
    # forked from the forkserver (a child of ours), not from this process
    assert report["ppid"] == forkserver_pid() != os.getpid()


def test_a_spawned_runner_imports_everything_itself() -> None:
    report = started("spawn")
    assert "elbowroom.engines.llama" not in report["modules"]
    assert report["ppid"] == os.getpid()


def test_the_server_s_bytes_include_the_forkserver_s() -> None:
    started("forkserver")
    pid = forkserver_pid()
    assert pid is not None
    fs = measure_pid(pid).anonymous
    assert fs > 0
    own = measure_pid(os.getpid()).anonymous
    value = ServerBytes(ttl=0)()
    assert abs(value - (own + fs)) < fs / 2


def test_runner_start_is_forkserver_by_default_and_checked() -> None:
    assert load_settings(environ={}).runner_start == "forkserver"
    assert load_settings(environ={"ELBOWROOM_RUNNER_START": "spawn"}).runner_start == "spawn"
    with pytest.raises(ConfigError, match="runner_start"):
        load_settings(environ={"ELBOWROOM_RUNNER_START": "fork"})
