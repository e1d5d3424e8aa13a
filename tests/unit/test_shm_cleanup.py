"""Unit tests of shm.cleanup and the ``ipu-emulator cleanup`` command."""

from __future__ import annotations

import os
import secrets
import subprocess
import sys

import posix_ipc
import pytest

from shm import Region, Ring, naming, remove_dead
from shm.cleanup import list_objects
from tools.cli import main as cli_main


def _dead_pid() -> int:
    child = subprocess.Popen([sys.executable, "-c", "pass"])
    child.wait()
    return child.pid


def _leave_orphans(tag: str, pid: int) -> tuple[str, str]:
    """A segment and a semaphore named as if made by ``pid``; return their /dev/shm entries."""
    token = secrets.token_hex(6)
    seg = f"/{naming.PREFIX}_{tag}_{pid}_{token}_region"
    sem = f"/{naming.PREFIX}_{tag}_{pid}_{token}_ring.full"
    posix_ipc.SharedMemory(seg, posix_ipc.O_CREX, mode=0o600, size=4096).close_fd()
    posix_ipc.Semaphore(sem, posix_ipc.O_CREX, mode=0o600).close()
    return seg[1:], "sem." + sem[1:]


def _exists(entry: str) -> bool:
    return os.path.exists(os.path.join("/dev/shm", entry))


def test_cleanup_command_removes_dead_keeps_live_and_reports(capsys) -> None:
    pid = _dead_pid()
    seg, sem = _leave_orphans(naming.current_tag(), pid)
    with Ring.create(16, 2) as live:
        assert cli_main(["cleanup", "--dry-run"]) == 0
        out = capsys.readouterr().out.splitlines()
        assert f"would remove segment /dev/shm/{seg} (creator pid {pid} is dead)" in out
        assert f"would remove semaphore /dev/shm/{sem} (creator pid {pid} is dead)" in out
        assert _exists(seg) and _exists(sem)

        alive = len([o for o in list_objects() if o.pid != pid])
        assert alive >= 1  # at least the live ring: one segment (its semaphores are inside)
        assert cli_main(["cleanup"]) == 0
        out = capsys.readouterr().out.splitlines()
        assert sorted(out[:-1]) == sorted([
            f"removed segment /dev/shm/{seg} (creator pid {pid} is dead)",
            f"removed semaphore /dev/shm/{sem} (creator pid {pid} is dead)"])
        assert out[-1] == (f"removed 2 object(s) of tag {naming.current_tag()!r}; "
                           f"kept {alive} whose creator is alive")
        assert not _exists(seg) and not _exists(sem)
        live_entries = {o.entry for o in list_objects()}
        assert live.name[1:] in live_entries
        assert not any(e.startswith(f"sem.{live.name[1:]}") for e in live_entries)
        live.write(b"alive and well")


def test_remove_dead_by_tag_and_all_tags_dry_run(capsys) -> None:
    pid = _dead_pid()
    other_tag = "x" + secrets.token_hex(4)
    seg, sem = _leave_orphans(other_tag, pid)
    try:
        assert remove_dead() == []  # not our tag: untouched
        assert cli_main(["cleanup", "--all-tags", "--dry-run"]) == 0
        out = capsys.readouterr().out
        assert f"would remove segment /dev/shm/{seg}" in out
        assert "object(s) of all tags" in out
        assert sorted(remove_dead(other_tag)) == sorted([seg, sem])
        assert not _exists(seg) and not _exists(sem)
    finally:
        remove_dead(other_tag)


def test_objects_of_this_live_process_are_never_removed() -> None:
    with Region.create(4096) as region:
        assert remove_dead() == []
        assert _exists(region.name[1:])


def test_cleanup_help_and_bad_option(capsys) -> None:
    with pytest.raises(SystemExit) as info:
        cli_main(["cleanup", "--nope"])
    assert info.value.code == 2
    assert "unrecognized arguments: --nope" in capsys.readouterr().err


def test_unlink_named_removes_a_ring_or_a_region_by_its_name():
    from shm import cleanup

    ring = Ring.create(64, 4)
    region = Region.create(4096)
    ours = {o.name for o in list_objects()}
    assert ring.name in ours and region.name in ours
    assert not [o for o in list_objects() if o.is_semaphore and o.name.startswith(ring.name)]
    assert cleanup.unlink_named(ring.name) == 1    # one segment: the semaphores are inside
    assert cleanup.unlink_named(region.name) == 1
    assert cleanup.unlink_named(region.name) == 0  # gone already
    left = {o.name for o in list_objects()}
    assert not left & {ring.name, region.name}
    ring.close()
    region.close()


def test_unlink_created_by_removes_only_the_objects_of_those_pids():
    from shm import cleanup

    tag = naming.current_tag()
    dead = _dead_pid()
    seg, sem = _leave_orphans(tag, dead)
    mine = Region.create(4096)
    try:
        assert cleanup.unlink_created_by((dead,)) == 2
        entries = set(os.listdir(naming.SHM_DIR))
        assert seg not in entries and sem not in entries
        assert mine.name.lstrip("/") in entries
    finally:
        mine.close()
        mine.unlink()
