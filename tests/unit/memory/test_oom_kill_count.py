"""The cgroup's OOM-kill counter, from recorded v1 and v2 files (the real one is read by
tests/e2e/test_pressure_events.py)."""

from __future__ import annotations

from pathlib import Path

from elbowroom.memory.cgroup import oom_kill_count


def test_v1_memory_oom_control(tmp_path: Path) -> None:
    leaf = tmp_path / "memory" / "app"
    leaf.mkdir(parents=True)
    (leaf / "memory.oom_control").write_text("oom_kill_disable 0\nunder_oom 0\noom_kill 4\n")
    membership = tmp_path / "cgroup"
    membership.write_text("9:memory:/app\n")
    assert oom_kill_count(membership, tmp_path) == 4


def test_v2_memory_events(tmp_path: Path) -> None:
    (tmp_path / "cgroup.controllers").write_text("memory\n")
    leaf = tmp_path / "svc"
    leaf.mkdir()
    (leaf / "memory.events").write_text("low 0\nhigh 12\nmax 3\noom 2\noom_kill 1\n")
    membership = tmp_path / "cgroup"
    membership.write_text("0::/svc\n")
    assert oom_kill_count(membership, tmp_path) == 1


def test_none_where_there_is_no_counter(tmp_path: Path) -> None:
    (tmp_path / "memory" / "app").mkdir(parents=True)
    membership = tmp_path / "cgroup"
    membership.write_text("9:memory:/app\n")
    assert oom_kill_count(membership, tmp_path) is None
    assert oom_kill_count(tmp_path / "missing", tmp_path) is None
