"""Nothing the emulator writes goes through a path another user controls
(``ipu_emulator.safe_files``): lock files, logs, traces, outputs, the daemon's state.

The attacks need a second user: as root (this machine and CI), the attacker's steps run
in a child process started as a fixed unprivileged uid (no user is created, nothing to
clean up); otherwise those tests are skipped. Root bypasses permission checks, so what
holds it back is ``O_NOFOLLOW`` and the owner checks on folders."""

from __future__ import annotations

import fcntl
import json
import os
import shutil
import stat
import subprocess
import sys
import tempfile
import time

import pytest

from ipu_emulator import safe_files
from ipu_emulator.errors import UnsafePathError
from ipu_emulator.system import IpuLocks
from ipu_emulator.trace import _session as trace_session

OTHER = 54321   # the second user's uid and gid (no account needed)
REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
as_root = pytest.mark.skipif(os.geteuid() != 0, reason="acting as a second user needs root "
                             "(a child process started as another uid)")


def as_other_user(*commands: list[str]) -> None:
    """Run each command (``mkdir``, ``ln -s``) as uid/gid OTHER, a child process started
    with ``subprocess``'s ``user=`` (no fork hooks of this process run in it); fails if
    one fails."""
    for argv in commands:
        subprocess.run(argv, user=OTHER, group=OTHER, extra_groups=[], check=True, timeout=60,
                       cwd="/", capture_output=True)


@pytest.fixture
def shared():
    """A folder every user may write (mode 1777, like /tmp), outside pytest's 0700 tree."""
    d = tempfile.mkdtemp(prefix="ipuemu-shared-", dir="/tmp")
    os.chmod(d, 0o1777)
    yield d
    shutil.rmtree(d, ignore_errors=True)


@pytest.fixture
def precious(tmp_path):
    """A 0600 file of ours the attacker wants overwritten."""
    p = tmp_path / "precious"
    p.write_bytes(b"keep me")
    p.chmod(0o600)
    return p


def _intact(p) -> None:
    assert p.read_bytes() == b"keep me" and stat.S_IMODE(p.stat().st_mode) == 0o600


# -- the home and its folders -----------------------------------------------------------------

@as_root
def test_a_lock_planted_by_another_user_in_a_shared_home_is_never_opened(shared, precious):
    home = os.path.join(shared, "home")
    os.mkdir(home)
    os.chmod(home, 0o777)   # IPU_EMULATOR_HOME set to a folder others may write
    as_other_user(["mkdir", "-m", "777", os.path.join(home, "locks")],
                  ["ln", "-s", str(precious), os.path.join(home, "locks", "ipu0.lock")])
    assert os.lstat(os.path.join(home, "locks", "ipu0.lock")).st_uid == OTHER
    with pytest.raises(UnsafePathError, match=rf"^the emulator home {home} is writable by other "
                                              r"users \(mode 777\); refusing to write in it: "
                                              rf"run 'chmod go-w {home}'"):
        IpuLocks.try_acquire(os.path.join(home, "locks"), (0,))
    _intact(precious)
    os.chmod(home, 0o700)   # the home fixed: the other user's locks folder is still refused
    with pytest.raises(UnsafePathError, match=rf"the lock folder {home}/locks belongs to uid "
                                              rf"{OTHER}, not to this user \(uid 0\)"):
        IpuLocks.try_acquire(os.path.join(home, "locks"), (0,))
    _intact(precious)


@as_root
def test_a_home_made_by_another_user_is_refused(shared):
    home = os.path.join(shared, "theirs")
    as_other_user(["mkdir", "-m", "755", home])
    with pytest.raises(UnsafePathError, match=rf"the emulator home {home} belongs to uid {OTHER}"):
        IpuLocks.try_acquire(os.path.join(home, "locks"), (0,))
    assert os.listdir(home) == []


@as_root
def test_a_home_that_is_another_users_symlink_is_refused(shared, tmp_path):
    ours = tmp_path / "ours"
    ours.mkdir(mode=0o700)
    home = os.path.join(shared, "home")
    as_other_user(["ln", "-s", str(ours), home])
    with pytest.raises(UnsafePathError, match=rf"the emulator home {home} is a symlink or not "
                                              r"a folder; refusing to follow it"):
        IpuLocks.try_acquire(os.path.join(home, "locks"), (0,))
    assert list(ours.iterdir()) == []


def test_links_in_our_own_home_are_refused_not_followed(tmp_path, precious):
    home = tmp_path / "home"
    (home / "locks").mkdir(parents=True, mode=0o700)
    (home / "logs").mkdir(mode=0o700)
    (home / "locks" / "ipu0.lock").symlink_to(precious)
    (home / "logs" / "ipu0.log").symlink_to(precious)
    with pytest.raises(UnsafePathError, match=rf"^{home}/locks/ipu0.lock is a symlink; refusing "
                                              r"to write through it"):
        IpuLocks.try_acquire(str(home / "locks"), (0,))
    with pytest.raises(UnsafePathError, match=rf"^{home}/logs/ipu0.log is a symlink"):
        safe_files.open_log(home / "logs" / "ipu0.log")
    _intact(precious)
    (home / "locks" / "ipu0.lock").unlink()   # the link removed: the lock works again
    locks = IpuLocks.try_acquire(str(home / "locks"), (0,))
    assert isinstance(locks, IpuLocks)
    locks.release()
    st = (home / "locks" / "ipu0.lock").stat()
    assert stat.S_ISREG(st.st_mode) and stat.S_IMODE(st.st_mode) == 0o600


def test_a_fifo_or_a_folder_at_a_log_is_refused_without_blocking(tmp_path):
    logs = tmp_path / "home" / "logs"
    logs.mkdir(parents=True, mode=0o700)
    os.mkfifo(logs / "ipu0.log")
    with pytest.raises(UnsafePathError, match=r"is not a regular file of this user"):
        safe_files.open_log(logs / "ipu0.log")


def test_a_home_writable_by_others_is_refused_and_a_private_one_made_0700(tmp_path):
    home = tmp_path / "home"
    fd = safe_files.open_private_dir(home / "logs", what="log folder", check_parent=True)
    os.close(fd)
    assert stat.S_IMODE(home.stat().st_mode) == 0o700
    assert stat.S_IMODE((home / "logs").stat().st_mode) == 0o700
    home.chmod(0o770)
    with pytest.raises(UnsafePathError, match=r"is writable by other users \(mode 770\)"):
        safe_files.open_log(home / "logs" / "ipu0.log")


def test_a_log_past_its_limit_is_rotated_once(tmp_path, monkeypatch):
    monkeypatch.setattr(safe_files, "LOG_LIMIT", 10)
    log = tmp_path / "home" / "logs" / "ipu0.log"
    for text in (b"first run, long\n", b"second\n"):
        fd = safe_files.open_log(log)
        os.write(fd, text)
        os.close(fd)
    assert log.read_bytes() == b"second\n"
    assert (log.parent / "ipu0.log.1").read_bytes() == b"first run, long\n"


# -- files where the user names them ----------------------------------------------------------

@as_root
def test_a_trace_into_a_shared_folder_replaces_planted_links(shared, precious):
    path = os.path.join(shared, "t.json")
    # the other user plants the final name and the old temporary name pattern
    as_other_user(["ln", "-s", str(precious), path],
                  ["ln", "-s", str(precious), f"{path}.{os.getpid()}.tmp"])
    trace_session.write({"traceEvents": [{"ph": "M", "pid": 1}]}, path)
    _intact(precious)
    st = os.lstat(path)
    assert stat.S_ISREG(st.st_mode) and st.st_uid == 0
    with open(path, encoding="utf-8") as f:
        assert json.load(f) == {"traceEvents": [{"ph": "M", "pid": 1}]}


def test_a_replaced_file_keeps_its_mode(tmp_path):
    out = tmp_path / "model.popef"
    out.write_bytes(b"old")
    out.chmod(0o600)
    safe_files.write_atomic(out, b"new")
    assert out.read_bytes() == b"new" and stat.S_IMODE(out.stat().st_mode) == 0o600
    out.chmod(0o640)
    safe_files.write_atomic(out, b"newer")
    assert stat.S_IMODE(out.stat().st_mode) == 0o640
    fresh = tmp_path / "fresh.popef"
    safe_files.write_atomic(fresh, b"x")
    assert stat.S_IMODE(fresh.stat().st_mode) == 0o666 & ~safe_files.umask()


def _old(path, age=60.0) -> None:
    t = time.time() - age
    os.utime(path, (t, t))


def test_the_next_writer_removes_a_killed_writers_temporaries_only(tmp_path):
    stale = tmp_path / ".model.popef.0123456789ab.tmp"
    stale.write_bytes(b"\0" * 4096)
    _old(stale)
    young = tmp_path / ".model.popef.aaaaaaaaaaaa.tmp"   # a writer starting this moment
    young.write_bytes(b"y")
    locked = tmp_path / ".model.popef.bbbbbbbbbbbb.tmp"  # a writer alive: holds its lock
    locked.write_bytes(b"l")
    _old(locked)
    other = tmp_path / ".other.popef.cccccccccccc.tmp"   # another name's killed writer
    other.write_bytes(b"o")
    _old(other)
    mine = tmp_path / ".notes.txt.tmp"                  # not a writer's temporary: kept
    mine.write_bytes(b"m")
    _old(mine)
    link = tmp_path / ".model.popef.dddddddddddd.tmp"
    link.symlink_to(tmp_path / "nowhere")
    fd = os.open(locked, os.O_RDONLY)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX)
        safe_files.write_atomic(tmp_path / "model.popef", b"data")
    finally:
        os.close(fd)
    left = sorted(p.name for p in tmp_path.iterdir())
    assert left == sorted(["model.popef", young.name, locked.name, link.name, mine.name])
    # now that its lock is free the locked one goes too; the young one and the link stay
    assert safe_files.stale_temps(tmp_path) == [locked.name]
    assert safe_files.remove_stale_temps(tmp_path, "other.popef") == []
    assert safe_files.remove_stale_temps(tmp_path) == [locked.name]
    assert sorted(p.name for p in tmp_path.iterdir()) == sorted(["model.popef", young.name,
                                                                  link.name, mine.name])


def test_a_writer_killed_mid_write_leaves_a_temporary_the_cleanup_command_removes(tmp_path):
    script = ("import os, sys\nfrom ipu_emulator.safe_files import AtomicFile\n"
              "f = AtomicFile(sys.argv[1]); f.file.write(b'x' * 100000); f.file.flush()\n"
              "os._exit(9)   # killed before commit\n")
    env = dict(os.environ, PYTHONPATH=REPO)
    subprocess.run([sys.executable, "-c", script, str(tmp_path / "m.popef")], env=env,
                   check=False, timeout=60)
    tmps = [p for p in tmp_path.iterdir() if p.name.endswith(".tmp")]
    assert len(tmps) == 1 and not (tmp_path / "m.popef").exists()
    _old(tmps[0])
    proc = subprocess.run([sys.executable, "-m", "tools.cli", "cleanup", "--temp-files",
                           str(tmp_path)], env=env, cwd=REPO, capture_output=True, text=True,
                          timeout=60)
    assert proc.returncode == 0, proc.stderr
    assert f"removed {tmp_path}/{tmps[0].name}" in proc.stdout
    assert list(tmp_path.iterdir()) == []


@as_root
def test_serialize_ir_into_a_shared_folder_replaces_a_planted_link(shared, precious):
    import onnx

    from host_runtime.poprt import _compile_api
    from host_runtime.poprt._options import CompilerOptions
    from tools.generate_simple_popef import build_simple_model

    dest = os.path.join(shared, "ir.onnx")
    as_other_user(["ln", "-s", str(precious), dest])
    opts = CompilerOptions()
    opts.serialize_ir = True
    opts.serialized_ir_dest = dest
    result = _compile_api.compile_result(build_simple_model(), None, opts)
    _intact(precious)
    st = os.lstat(dest)
    assert stat.S_ISREG(st.st_mode) and st.st_uid == 0
    assert onnx.load(dest) == result.output_model


@as_root
def test_poprt_exec_save_outputs_into_a_shared_folder_replaces_a_planted_link(
        shared, precious, tmp_path):
    import numpy as np

    from tools.generate_simple_popef import write_simple_popef
    from tools.poprt_exec import main as poprt_exec

    path = str(tmp_path / "simple.popef")
    write_simple_popef(path)
    out = os.path.join(shared, "tensor_C.npy")
    as_other_user(["ln", "-s", str(precious), out])
    assert poprt_exec(["poprt_run_popef", "--popef", path, "--iteration", "1",
                       "--saveOutputs", shared]) == 0
    _intact(precious)
    st = os.lstat(out)
    assert stat.S_ISREG(st.st_mode) and st.st_uid == 0
    assert np.load(out).shape == (1, 4)


@pytest.mark.skipif(not os.path.isfile("/proc/version"), reason="needs Linux's /proc")
def test_a_folder_that_takes_no_new_file_is_named_by_the_path_asked_for():
    # (/proc takes no new file, even as root: the temporary file fails, not the target)
    with pytest.raises(FileNotFoundError) as exc:
        safe_files.write_atomic("/proc/version", b"x")
    assert exc.value.filename == "/proc/version"
    assert "a temporary file beside it cannot be made" in str(exc.value)
    assert ".tmp" not in str(exc.value)
