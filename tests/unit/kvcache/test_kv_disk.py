"""The disk tier on a real directory: atomic files, restart, damage, cap, disk full."""

from __future__ import annotations

import os
import shutil
import stat
import subprocess
from collections.abc import Iterator
from pathlib import Path

import pytest

from elbowroom.kvcache.disk import DiskTier
from elbowroom.kvcache.fileformat import ENGINE_MAGIC

KEY = '{"model": "m", "n_ctx": 512}'
PREFIX = "aaaa"
TOKENS = tuple(range(100))


def engine_state(n: int) -> bytes:
    """Random bytes that start like the engine's slot files (a cut-off entry is known by it)."""
    return ENGINE_MAGIC + os.urandom(n - len(ENGINE_MAGIC))


def tier(d: Path, cap: int = 10_000_000, key: str = KEY, prefix: str = PREFIX) -> DiskTier:
    t = DiskTier(d, cap, key, prefix)
    t.scan()
    return t


def only_file(d: Path) -> Path:
    (path,) = [p for p in d.iterdir() if p.name.endswith(".kv")]
    return path


def test_write_read_and_restart(tmp_path: Path) -> None:
    t = tier(tmp_path)
    state = os.urandom(50_000)
    assert t.write("e1", TOKENS, state).written
    assert t.read("e1") == bytearray(state)
    assert [p.name for p in tmp_path.iterdir()] == [f"{PREFIX}-e1.kv"]  # no temp left
    again = DiskTier(tmp_path, 10_000_000, KEY, PREFIX)
    (entry,) = again.scan()
    assert (entry.eid, entry.tokens, entry.payload_bytes) == ("e1", TOKENS, 50_000)
    assert again.nbytes == entry.nbytes == only_file(tmp_path).stat().st_size
    assert again.read("e1") == bytearray(state)


def test_corrupt_payload_is_a_miss_and_removed(tmp_path: Path) -> None:
    t = tier(tmp_path)
    t.write("e1", TOKENS, os.urandom(20_000))
    path = only_file(tmp_path)
    with path.open("r+b") as f:
        f.seek(100)  # the payload: the trailer's own checksum guards the rest
        f.write(b"\x00" * 10)
    assert t.read("e1") is None
    assert not path.exists() and len(t) == 0 and t.nbytes == 0


def test_link_to_gives_the_engine_the_verified_entry(tmp_path: Path) -> None:
    t = tier(tmp_path / "kv")
    state = os.urandom(3_000_000)
    t.write("e1", TOKENS, state)
    dest = tmp_path / "restore.bin"
    dest.write_bytes(b"left over")  # a crash's leftover is replaced
    assert t.link_to("e1", dest)
    assert dest.is_symlink() and dest.resolve() == only_file(tmp_path / "kv")
    # The engine reads its own slot file from the start and ignores the trailer.
    assert dest.read_bytes()[: len(state)] == state
    assert not t.link_to("nope", tmp_path / "other.bin")
    assert not (tmp_path / "other.bin").exists()


def test_link_to_works_from_a_relative_directory(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.chdir(tmp_path)
    t = tier(Path("kv"))
    state = os.urandom(1000)
    t.write("e1", TOKENS, state)
    (tmp_path / "engine").mkdir()
    dest = tmp_path / "engine" / "restore.bin"
    assert t.link_to("e1", dest)
    assert dest.read_bytes()[: len(state)] == state  # resolves from the engine's directory


def test_link_to_refuses_a_corrupt_or_truncated_entry_and_removes_it(tmp_path: Path) -> None:
    t = tier(tmp_path / "kv")
    t.write("e1", TOKENS, os.urandom(20_000))
    t.write("e2", TOKENS[:50], engine_state(20_000))
    paths = {p.name: p for p in (tmp_path / "kv").iterdir()}
    with paths[f"{PREFIX}-e1.kv"].open("r+b") as f:
        f.seek(100)  # the payload
        f.write(b"\x00" * 10)
    os.truncate(paths[f"{PREFIX}-e2.kv"], 1000)
    dest = tmp_path / "restore.bin"
    assert not t.link_to("e1", dest)
    assert not t.link_to("e2", dest)
    assert not dest.exists()  # nothing of a bad state reaches the engine
    assert len(t) == 0 and not list((tmp_path / "kv").iterdir())


def test_truncated_file_is_removed_at_scan(tmp_path: Path) -> None:
    tier(tmp_path).write("e1", TOKENS, engine_state(20_000))
    path = only_file(tmp_path)
    os.truncate(path, path.stat().st_size - 1)
    assert DiskTier(tmp_path, 10_000_000, KEY, PREFIX).scan() == []
    assert not path.exists()


def test_truncated_after_scan_is_removed_at_read(tmp_path: Path) -> None:
    t = tier(tmp_path)
    t.write("e1", TOKENS, engine_state(20_000))
    path = only_file(tmp_path)
    os.truncate(path, 1000)
    assert t.read("e1") is None
    assert not path.exists()


def test_wrong_key_files_are_removed_and_files_not_ours_left_alone(tmp_path: Path) -> None:
    junk = tmp_path / f"{PREFIX}-junk.kv"
    junk.write_bytes(b"not a kv file at all" * 10)
    (tmp_path / f"{PREFIX}-empty.kv").write_bytes(b"")
    other = DiskTier(tmp_path, 10_000_000, '{"model": "other"}', PREFIX)  # same prefix, by force
    other.write("e2", TOKENS, b"x" * 100)
    assert tier(tmp_path).scan() == []
    # Only files with our magic are ever deleted: the others are not indexed, not removed.
    assert sorted(p.name for p in tmp_path.iterdir()) == [f"{PREFIX}-empty.kv", junk.name]


def test_other_keys_files_are_left_alone(tmp_path: Path) -> None:
    mine, theirs = tier(tmp_path), tier(tmp_path, key='{"model": "b"}', prefix="bbbb")
    mine.write("e1", TOKENS, b"a" * 100)
    theirs.write("e1", TOKENS, b"b" * 100)
    assert [e.eid for e in tier(tmp_path).scan()] == ["e1"]
    assert theirs.read("e1") == bytearray(b"b" * 100)


def test_cap_evicts_least_recently_used_across_the_directory(tmp_path: Path) -> None:
    probe = tier(tmp_path)
    probe.write("probe", TOKENS, bytes(10_000))
    one = probe.nbytes
    probe.remove("probe")
    theirs = tier(tmp_path, key='{"model": "b"}', prefix="bbbb")
    mine = tier(tmp_path, cap=3 * one)
    theirs.write("old", TOKENS, bytes(10_000))
    mine.write("a", TOKENS, bytes(10_000))
    mine.write("b", TOKENS, bytes(10_000))
    # Recency is the mtime: make the order explicit instead of relying on clock ticks.
    os.utime(tmp_path / "bbbb-old.kv", (1000, 1000))
    os.utime(tmp_path / f"{PREFIX}-a.kv", (2000, 2000))
    os.utime(tmp_path / f"{PREFIX}-b.kv", (3000, 3000))
    result = mine.write("c", TOKENS, bytes(10_000))
    assert result.written and result.evicted == ()  # the other runner's old file went first
    assert not (tmp_path / "bbbb-old.kv").exists()
    assert mine.read("a") is not None  # a hit makes "a" the most recently used
    result = mine.write("d", TOKENS, bytes(10_000))
    assert result.evicted == ("b",)
    assert (tmp_path / f"{PREFIX}-a.kv").exists()
    assert sum(p.stat().st_size for p in tmp_path.iterdir()) <= 3 * one


def test_entry_bigger_than_cap_is_not_written(tmp_path: Path) -> None:
    t = tier(tmp_path, cap=1000)
    assert not t.write("big", TOKENS, bytes(2000)).written
    assert list(tmp_path.iterdir()) == []


def test_stale_temp_files_of_dead_writers_are_removed(tmp_path: Path) -> None:
    from elbowroom.kvcache.fileformat import MAGIC

    dead = tmp_path / f"{PREFIX}-e1.kv.999999.tmp"
    dead_empty = tmp_path / f"{PREFIX}-e3.kv.999998.tmp"
    not_ours = tmp_path / f"{PREFIX}-e4.kv.999997.tmp"
    live = tmp_path / f"{PREFIX}-e2.kv.1234.tmp"
    # The trailer is written first: a writer that died mid-payload left zeros and it.
    dead_mid = tmp_path / f"{PREFIX}-e5.kv.999996.tmp"
    dead_mid.write_bytes(bytes(500) + b"trailer" + MAGIC)
    dead.write_bytes(MAGIC + b"partial")  # a version 1 writer's
    dead_empty.write_bytes(b"")  # the writer died before its first byte
    not_ours.write_bytes(b"someone else's")
    live.write_bytes(MAGIC + b"partial")
    t = DiskTier(tmp_path, 10_000, KEY, PREFIX, pid_alive=lambda pid: pid == 1234)
    t.scan()
    assert not dead.exists() and not dead_empty.exists() and not dead_mid.exists()
    assert live.exists() and not_ours.exists()


@pytest.fixture
def tiny_fs(tmp_path: Path) -> Iterator[Path]:
    """A real 64 KiB tmpfs, to hit a real ENOSPC."""
    mnt = tmp_path / "tiny"
    mnt.mkdir()
    if os.geteuid() != 0 or shutil.which("mount") is None:
        pytest.skip("needs root to mount a tmpfs")
    done = subprocess.run(
        ["mount", "-t", "tmpfs", "-o", "size=64k", "tmpfs", str(mnt)], capture_output=True
    )
    if done.returncode != 0:
        pytest.skip(f"cannot mount a tmpfs here: {done.stderr.decode().strip()}")
    try:
        yield mnt
    finally:
        subprocess.run(["umount", str(mnt)], check=False)


def test_disk_full_skips_the_write(tiny_fs: Path, caplog: pytest.LogCaptureFixture) -> None:
    t = tier(tiny_fs, cap=10_000_000)
    assert t.write("small", TOKENS, bytes(1000)).written
    result = t.write("big", TOKENS, bytes(200_000))
    assert not result.written
    assert "disk full" in caplog.text
    assert [p.name for p in tiny_fs.iterdir()] == [f"{PREFIX}-small.kv"]  # temp cleaned up
    assert t.read("small") == bytearray(1000) and "big" not in t


def test_unusable_directory_turns_the_tier_off(tmp_path: Path) -> None:
    blocker = tmp_path / "file"
    blocker.write_bytes(b"")
    t = DiskTier(blocker / "kv", 10_000, KEY, PREFIX)  # a file where a folder should be
    assert not t.enabled and t.scan() == []
    assert not t.write("e1", TOKENS, b"x" * 10).written


# --- hardening (docs/security.md) --------------------------------------------------------


def test_directory_0700_and_files_0600(tmp_path: Path) -> None:
    d = tmp_path / "kv"
    t = tier(d)
    t.write("e1", TOKENS, b"x" * 100)
    assert stat.S_IMODE(d.stat().st_mode) == 0o700
    assert stat.S_IMODE(only_file(d).stat().st_mode) == 0o600
    loose = tmp_path / "loose"
    loose.mkdir(mode=0o777)
    os.chmod(loose, 0o777)
    assert tier(loose).enabled
    assert stat.S_IMODE(loose.stat().st_mode) == 0o700  # ours, so tightened


@pytest.mark.skipif(os.geteuid() != 0, reason="needs root to give a folder to another user")
def test_another_user_s_directory_turns_the_tier_off(tmp_path: Path) -> None:
    d = tmp_path / "theirs"
    d.mkdir()
    os.chown(d, 54321, -1)
    t = DiskTier(d, 10_000, KEY, PREFIX)
    assert not t.enabled
    assert not t.write("e1", TOKENS, b"x").written and list(d.iterdir()) == []


def test_a_planted_temp_symlink_is_not_followed(tmp_path: Path) -> None:
    d = tmp_path / "kv"
    t = tier(d)
    victim = tmp_path / "victim"
    victim.write_bytes(b"precious")
    (d / f"{PREFIX}-e1.kv.{os.getpid()}.tmp").symlink_to(victim)
    assert not t.write("e1", TOKENS, b"x" * 100).written
    assert victim.read_bytes() == b"precious"


def test_a_planted_entry_symlink_or_fifo_is_neither_read_nor_hung_on(tmp_path: Path) -> None:
    d = tmp_path / "kv"
    tier(d)
    target = tmp_path / "target.kv"
    tier(tmp_path / "elsewhere").write("x", TOKENS, b"y" * 10)
    target.write_bytes(only_file(tmp_path / "elsewhere").read_bytes())
    (d / f"{PREFIX}-link.kv").symlink_to(target)
    os.mkfifo(d / f"{PREFIX}-fifo.kv")
    assert tier(d).scan() == []  # returns at once: the FIFO is opened non-blocking
    assert target.exists()


def test_eviction_leaves_files_that_are_not_ours(tmp_path: Path) -> None:
    stranger = tmp_path / "zzzz-stranger.kv"
    stranger.write_bytes(b"\0" * 5000)
    os.utime(stranger, (1, 1))  # the oldest file in the directory
    t = tier(tmp_path, cap=3000)
    assert t.write("a", TOKENS, bytes(1000)).written
    assert t.write("b", TOKENS, bytes(1000)).written
    assert stranger.exists()


def test_a_payload_length_over_the_cap_is_corrupt(tmp_path: Path) -> None:
    """A trailer with a valid checksum that claims a huge payload: refused before any
    allocation of that size (the file itself is small)."""
    import struct
    import zlib

    from elbowroom.kvcache.fileformat import _FIXED, GUARD, MAGIC, VERSION

    t = tier(tmp_path, cap=100_000)
    t.write("e1", TOKENS, bytes(1000))
    path = only_file(tmp_path)
    key = KEY.encode()
    body = GUARD + key + struct.pack(f"<{len(TOKENS)}i", *TOKENS)
    fixed = _FIXED.pack(VERSION, 0, len(key), len(TOKENS), 1 << 50, 0, 0, MAGIC)[:28]
    crc = zlib.crc32(fixed, zlib.crc32(body))
    path.write_bytes(bytes(1000) + body + fixed + struct.pack("<I", crc) + MAGIC)
    assert t.read("e1") is None  # refused before allocating 1 PiB
    assert not path.exists()


def test_a_foreign_file_that_lost_nothing_is_left_alone(tmp_path: Path) -> None:
    """A file named like an entry that is neither ours by magic nor the engine's: kept."""
    stranger = tmp_path / f"{PREFIX}-zz.kv"
    stranger.write_bytes(b"not a state" * 100)
    assert tier(tmp_path).scan() == []
    assert stranger.exists()
