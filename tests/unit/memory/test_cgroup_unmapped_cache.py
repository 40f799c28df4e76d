"""An unloaded model's weights in a cgroup (found by issue 24's arena, benchmarks/arena.py).

Measured in a real cgroup v1 here: a process maps a 461 MiB GGUF and reads it; while it
maps it, 428 MiB sit on the inactive file list. When it exits (an unload), unmapping moves
the recently read pages to the *active* list: ``total_active_file`` 33 → 357 MiB,
``total_inactive_file`` 428 → 104 MiB, ``total_mapped_file`` 461 → 0, usage unchanged.
The cgroup headroom ``limit − (usage − inactive_file)`` (memory/cgroup.py) therefore drops
by 324 MiB *because a model was unloaded*, although those pages are clean, mapped by no
one and reclaimed by the kernel before it OOM-kills. In the arena's swap phase (one LLM
fits, an agent alternates two) this made every swap wait the scheduler's whole
``unload_settle_timeout`` (10 s: "freed memory did not show up within 10.0 s"), the guard
pause loads ("memory held by other processes grows 623 MiB/s") and the prompt-cache grants
shrink (512 → 39 MiB). The fix (counting clean unmapped file pages as reclaimable:
``max(inactive_file, active_file + inactive_file − mapped_file − dirty − writeback)``)
is ``memory/cgroup.py``'s ``reclaimable``."""

from __future__ import annotations

from pathlib import Path

from elbowroom.memory.cgroup import read_cgroup, reclaimable

MiB = 1 << 20


def _cgroup(root: Path, stat: str) -> Path:
    leaf = root / "memory" / "arena"
    leaf.mkdir(parents=True)
    (leaf / "memory.limit_in_bytes").write_text(str(1024 * MiB))
    (leaf / "memory.usage_in_bytes").write_text(str(461 * MiB))
    (leaf / "memory.stat").write_text(stat)
    return root


def test_unloading_a_mapped_model_never_lowers_the_cgroup_headroom(tmp_path: Path) -> None:
    mapped = (
        f"total_active_file {33 * MiB}\ntotal_inactive_file {428 * MiB}\n"
        f"total_mapped_file {461 * MiB}\ntotal_cache {461 * MiB}\n"
    )
    exited = (
        f"total_active_file {357 * MiB}\ntotal_inactive_file {104 * MiB}\n"
        f"total_mapped_file 0\ntotal_cache {461 * MiB}\ntotal_dirty 0\ntotal_writeback 0\n"
    )
    before = read_cgroup("5:memory:/arena\n", _cgroup(tmp_path / "a", mapped))
    after = read_cgroup("5:memory:/arena\n", _cgroup(tmp_path / "b", exited))
    assert before is not None and after is not None
    assert before.headroom == (1024 - 461) * MiB  # mapped pages are not reclaimable
    assert after.headroom is not None and after.headroom >= before.headroom


def test_dirty_and_mapped_pages_are_not_reclaimable(tmp_path: Path) -> None:
    """Only clean, unmapped file pages count beyond the inactive list: a page being written
    back or mapped by a loaded model is not dropped before an OOM kill."""
    stat = (
        f"total_active_file {300 * MiB}\ntotal_inactive_file {100 * MiB}\n"
        f"total_mapped_file {150 * MiB}\ntotal_dirty {40 * MiB}\ntotal_writeback {10 * MiB}\n"
    )
    reading = read_cgroup("5:memory:/arena\n", _cgroup(tmp_path, stat))
    assert reading is not None
    assert reading.headroom == (1024 - 461 + (400 - 150 - 40 - 10)) * MiB


def test_v2_reads_its_own_stat_names() -> None:
    stat = (
        f"active_file {200 * MiB}\ninactive_file {50 * MiB}\nfile_mapped {100 * MiB}\n"
        f"file_dirty {MiB}\nfile_writeback 0\n"
    )
    assert reclaimable(2, stat) == 149 * MiB
    assert reclaimable(2, f"inactive_file {50 * MiB}\nfile_mapped {900 * MiB}\n") == 0


def test_a_loaded_model_s_weights_moving_between_the_lists_do_not_move_the_headroom() -> None:
    """Right after a load its mapped weights sit on the inactive list; serving activates them.
    Nothing was allocated, so the reclaimable bytes (and the headroom, and the memory the
    pressure guard attributes to others) stay put: counted by list, 428 MiB of a runner's
    weights looked like a neighbour growing and paused the next load (issue 24's arena)."""
    loaded = (
        f"total_active_file {33 * MiB}\ntotal_inactive_file {528 * MiB}\n"
        f"total_mapped_file {461 * MiB}\ntotal_dirty 0\ntotal_writeback 0\n"
    )
    served = (
        f"total_active_file {461 * MiB}\ntotal_inactive_file {100 * MiB}\n"
        f"total_mapped_file {461 * MiB}\ntotal_dirty 0\ntotal_writeback 0\n"
    )
    assert reclaimable(1, loaded) == reclaimable(1, served) == 100 * MiB
