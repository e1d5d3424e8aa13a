"""Files written so that nobody else's link, file or folder is ever written through.

Every file the project creates or appends is written one of two ways:

- **In a folder of ours** (the emulator home and its ``locks/``, ``logs/``,
  ``daemon/`` folders; lock files, logs, the daemon's state): the folder is opened
  once with ``O_DIRECTORY|O_NOFOLLOW`` and checked on its descriptor (``fstat``):
  a symlink, a folder of another user, or one that group or others may write is
  refused with ``UnsafePathError``. Files are then opened relative to that
  descriptor with ``O_NOFOLLOW`` (``open_private_file``, ``open_log``): a link
  planted in their place is refused, never followed.

- **Where the user names** (a PopEF or ONNX output, a trace, a metrics text file;
  possibly in a shared folder such as /tmp): ``AtomicFile`` creates
  ``.NAME.<hex>.tmp`` next to it with ``O_CREAT|O_EXCL|O_NOFOLLOW`` (a name that
  existed before, file or link, is never opened), writes it, and renames it over
  ``NAME``: a symlink at ``NAME`` is replaced, its target never opened. A file it
  replaces keeps its mode (a 0600 PopEF stays 0600); a new one gets 0666 less the
  umask.

A writer holds an ``flock`` on its temporary file from the moment it creates it.
Temporary files of a writer that was killed (unlocked, ours, older than
``STALE_AFTER`` seconds) are removed by the next ``AtomicFile`` writer in the same
folder (``remove_stale_temps``) and by ``ipu-emulator cleanup --temp-files FOLDER``.

Checking a path and then opening it by name (``exists()``, ``resolve()``, then
``open``) leaves a window in which a link put at the path is written through; every
step here works on descriptors, so there is no such window.
"""

from __future__ import annotations

import errno
import fcntl
import os
import re
import secrets
import stat
import time
from types import TracebackType
from typing import BinaryIO, cast

from ipu_emulator.errors import UnsafePathError

__all__ = [
    "AtomicFile",
    "UnsafePathError",
    "umask",
    "open_private_dir",
    "open_private_file",
    "open_in",
    "open_log",
    "write_atomic",
    "remove_stale_temps",
    "stale_temps",
    "STALE_AFTER",
    "LOG_LIMIT",
    "open_regular",
    "NotRegularFileError",
]

_KINDS = {stat.S_IFIFO: "FIFO", stat.S_IFDIR: "folder", stat.S_IFCHR: "character device",
          stat.S_IFBLK: "block device", stat.S_IFSOCK: "socket"}


class NotRegularFileError(OSError):
    """:func:`open_regular` found something else at the path; ``kind`` says what (a
    ``FIFO``, a ``folder``, a ``character device``, ...)."""

    def __init__(self, kind: str, path: str) -> None:
        super().__init__(errno.EINVAL, f"not a regular file but a {kind}", path)
        self.kind = kind

_DIR_FLAGS = os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC
_TMP_FLAGS = os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC
_MAX_TMP_STEM = 200      # a name's bytes kept in the temporary name (NAME_MAX is 255)
_TMP_RE = re.compile(r"^\.(?P<stem>.+)\.[0-9a-f]{12}\.tmp$")
STALE_AFTER = 2.0        # seconds: younger unlocked temporaries may be a writer starting
LOG_LIMIT = 4 << 20      # a log past this is moved to NAME.1 when it is next opened


def umask() -> int:
    """This process's umask, read without changing it (Linux >= 4.7: /proc/self/status);
    elsewhere set and restored at once."""
    try:
        with open("/proc/self/status", encoding="ascii") as f:
            for line in f:
                if line.startswith("Umask:"):
                    return int(line.split()[1], 8)
    except (OSError, ValueError):
        pass
    old = os.umask(0o022)     # pragma: no cover - kernels without the Umask line
    os.umask(old)
    return old


# -- folders of ours ----------------------------------------------------------------------

def _check_private(fd: int, path: str, what: str) -> None:
    st = os.fstat(fd)
    if not stat.S_ISDIR(st.st_mode):   # pragma: no cover - O_DIRECTORY refuses first
        raise UnsafePathError(f"the {what} {path} is not a folder")
    uid = os.geteuid()
    if st.st_uid != uid:
        raise UnsafePathError(
            f"the {what} {path} belongs to uid {st.st_uid}, not to this user (uid {uid}); "
            "refusing to write in a folder another user controls: use a folder of your own")
    if st.st_mode & 0o022:
        raise UnsafePathError(
            f"the {what} {path} is writable by other users (mode {stat.S_IMODE(st.st_mode):o}); "
            f"refusing to write in it: run 'chmod go-w {path}' or use another folder")


def _open_dir(name: str, path: str, what: str, dir_fd: int | None) -> int:
    try:
        return os.open(name, _DIR_FLAGS, dir_fd=dir_fd)
    except OSError as exc:
        if exc.errno in (errno.ELOOP, errno.ENOTDIR):
            raise UnsafePathError(
                f"the {what} {path} is a symlink or not a folder; refusing to follow it "
                "(someone else may have put it there): remove it or use another folder") from None
        exc.filename = path
        raise


def open_private_dir(path: str | os.PathLike[str], *, what: str = "folder",
                     check_parent: bool = False) -> int:
    """A descriptor of folder ``path`` (created 0700 with missing parents if absent),
    refused with ``UnsafePathError`` unless it is a real folder (not a symlink) owned by
    this user and not writable by group or others. ``check_parent``: the folder above
    gets the same checks (``path`` is then opened relative to it): for ``locks/`` and
    ``logs/`` inside the emulator home. The caller closes the descriptor."""
    full = os.path.abspath(os.fspath(path))
    parent, name = os.path.split(full)
    if not name:   # "/"
        return _open_private(full, full, what, None)
    if check_parent:
        pfd = open_private_dir(parent, what="emulator home")
    else:
        try:
            os.makedirs(parent, 0o700, exist_ok=True)
        except FileExistsError:
            pass   # a file or dangling link there: opening the folder names it
        pfd = os.open(parent, os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)
    try:
        try:
            os.mkdir(name, 0o700, dir_fd=pfd)
        except FileExistsError:
            pass
        except OSError as exc:
            exc.filename = full
            raise
        return _open_private(name, full, what, pfd)
    finally:
        os.close(pfd)


def _open_private(name: str, full: str, what: str, dir_fd: int | None) -> int:
    """The folder ``name`` (relative to ``dir_fd``) opened and checked private."""
    fd = _open_dir(name, full, what, dir_fd)
    try:
        _check_private(fd, full, what)
    except BaseException:
        os.close(fd)
        raise
    return fd


def open_in(dir_fd: int, name: str, flags: int, mode: int, path: str) -> int:
    """``os.open(name, flags | O_NOFOLLOW, mode, dir_fd=dir_fd)`` of a regular file of
    this user (``path`` names it in errors); a symlink or anything else there:
    ``UnsafePathError``."""
    try:
        fd = os.open(name, flags | os.O_NOFOLLOW | os.O_CLOEXEC | os.O_NONBLOCK, mode,
                     dir_fd=dir_fd)
    except OSError as exc:
        if exc.errno == errno.ELOOP:
            raise UnsafePathError(
                f"{path} is a symlink; refusing to write through it (someone else may have "
                "put it there): remove it") from None
        if exc.errno in (errno.ENXIO, errno.EISDIR):   # a FIFO without reader, a folder
            raise UnsafePathError(f"{path} is not a regular file of this user; refusing to "
                                  "write it: remove it") from None
        exc.filename = path
        raise
    st = os.fstat(fd)
    if not stat.S_ISREG(st.st_mode) or st.st_uid != os.geteuid():
        os.close(fd)
        raise UnsafePathError(
            f"{path} is not a regular file of this user (uid {st.st_uid}, mode "
            f"{st.st_mode:o}); refusing to write it: remove it")
    os.set_blocking(fd, True)
    return fd


def open_private_file(path: str | os.PathLike[str], flags: int, mode: int = 0o600, *,
                      what: str = "folder", check_parent: bool = False) -> int:
    """``os.open(path, flags | O_NOFOLLOW, mode)`` relative to its folder, which
    ``open_private_dir`` checks (``what`` and ``check_parent`` as there). A symlink at
    ``path``, or something other than a regular file of this user: ``UnsafePathError``."""
    full = os.path.abspath(os.fspath(path))
    folder, name = os.path.split(full)
    dfd = open_private_dir(folder, what=what, check_parent=check_parent)
    try:
        return open_in(dfd, name, flags, mode, full)
    finally:
        os.close(dfd)


def open_log(path: str | os.PathLike[str], *, check_parent: bool = True) -> int:
    """A descriptor appending to log ``path`` (0600; ``NAME`` moved to ``NAME.1`` first
    when past ``LOG_LIMIT``), opened as ``open_private_file`` does. By default the folder
    above the log's folder (the emulator home) is checked as well."""
    full = os.path.abspath(os.fspath(path))
    folder, name = os.path.split(full)
    dfd = open_private_dir(folder, what="log folder", check_parent=check_parent)
    try:
        try:
            st = os.stat(name, dir_fd=dfd, follow_symlinks=False)
            if stat.S_ISREG(st.st_mode) and st.st_size > LOG_LIMIT:
                os.replace(name, name + ".1", src_dir_fd=dfd, dst_dir_fd=dfd)
        except OSError:
            pass
        return open_in(dfd, name, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o600, full)
    finally:
        os.close(dfd)


# -- temporaries of killed writers --------------------------------------------------------

def stale_temps(folder: str | os.PathLike[str] | int, name: str | None = None, *,
                older_than: float = STALE_AFTER) -> list[str]:
    """The names ``remove_stale_temps`` would remove now (nothing is removed)."""
    return remove_stale_temps(folder, name, older_than=older_than, dry_run=True)


def remove_stale_temps(folder: str | os.PathLike[str] | int, name: str | None = None, *,
                       older_than: float = STALE_AFTER, dry_run: bool = False) -> list[str]:
    """Remove the temporary files ``.NAME.<hex>.tmp`` a killed ``AtomicFile`` writer left
    in ``folder`` (a path or a folder descriptor): regular files of this user, older than
    ``older_than`` seconds, whose writer's lock is free. Only those of ``name`` if given.
    Returns the names removed; a file that cannot be examined is left."""
    own = isinstance(folder, int)
    dfd = folder if isinstance(folder, int) else os.open(
        os.fspath(folder), os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)
    removed: list[str] = []
    stem = name[:_MAX_TMP_STEM] if name is not None else None
    try:
        for entry in os.listdir(dfd):
            m = _TMP_RE.match(entry)
            if m is None or (stem is not None and m.group("stem") != stem):
                continue
            if _remove_if_stale(dfd, entry, older_than, dry_run):
                removed.append(entry)
    finally:
        if not own:
            os.close(dfd)
    return removed


def _remove_if_stale(dfd: int, entry: str, older_than: float, dry_run: bool) -> bool:
    try:
        fd = os.open(entry, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC,
                     dir_fd=dfd)
    except OSError:
        return False
    try:
        st = os.fstat(fd)
        if (not stat.S_ISREG(st.st_mode) or st.st_uid != os.geteuid()
                or time.time() - st.st_mtime < older_than):
            return False
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except OSError:
            return False   # its writer is alive
        try:
            now = os.stat(entry, dir_fd=dfd, follow_symlinks=False)
        except OSError:
            return False
        if (now.st_dev, now.st_ino) != (st.st_dev, st.st_ino):
            return False
        if not dry_run:
            os.unlink(entry, dir_fd=dfd)
        return True
    except OSError:
        return False
    finally:
        os.close(fd)


# -- files where the user names them ------------------------------------------------------

class AtomicFile:
    """A file that appears at ``path`` whole on ``commit()`` (or a clean ``with`` exit),
    written through ``.file``; ``abort()`` (or an exception) leaves ``path`` untouched.
    Raises OSError (with ``filename`` set to ``path``) when the folder or the temporary
    file cannot be created. ``mode``: of a new file (default 0666 less the umask); a file
    replaced keeps its own."""

    def __init__(self, path: str | os.PathLike[str], *, mode: int | None = None) -> None:
        self.path = os.fspath(path)
        self._mode = mode
        folder, self._name = os.path.split(os.path.abspath(self.path))
        if not self._name:
            raise IsADirectoryError(21, "Is a directory", self.path)
        self._dir = os.open(folder, os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)
        self._tmp: str | None = None
        try:
            remove_stale_temps(self._dir)   # killed writers' of any name in this folder
            stem = self._name[:_MAX_TMP_STEM]
            while True:
                tmp = f".{stem}.{secrets.token_hex(6)}.tmp"
                try:
                    # opened relative to the folder's descriptor; the file's .name is the
                    # full path (onnx.save and messages read it)
                    self.file: BinaryIO = cast(BinaryIO, open(
                        os.path.join(folder, tmp), "wb",
                        opener=lambda _p, _f: os.open(tmp, _TMP_FLAGS, 0o600, dir_fd=self._dir)))
                    break
                except FileExistsError:   # a name taken (by chance or on purpose): another
                    continue
                except OSError as exc:   # named by the path asked for, not the temporary
                    raise type(exc)(exc.errno, f"{exc.strerror} (a temporary file beside "
                                    "it cannot be made)", self.path) from None
            self._tmp = tmp
            fcntl.flock(self.file.fileno(), fcntl.LOCK_EX)   # "a writer is alive"
        except BaseException:
            if self._tmp is not None:
                self.abort()
            else:
                self._close_dir()
            raise

    @property
    def done(self) -> bool:
        return self._tmp is None

    def _final_mode(self) -> int:
        try:
            st = os.stat(self._name, dir_fd=self._dir, follow_symlinks=False)
        except OSError:
            st = None
        if st is not None and stat.S_ISREG(st.st_mode) and st.st_uid == os.geteuid():
            return stat.S_IMODE(st.st_mode) & 0o777
        if self._mode is not None:
            return self._mode & 0o777
        return 0o666 & ~umask()

    def commit(self) -> None:
        """Make the file appear at ``path``, whole (idempotent once done)."""
        tmp = self._tmp
        if tmp is None:
            return
        try:
            self.file.flush()
            os.fsync(self.file.fileno())
            os.fchmod(self.file.fileno(), self._final_mode())
            os.replace(tmp, self._name, src_dir_fd=self._dir, dst_dir_fd=self._dir)
            self._tmp = None
            self.file.close()
        except OSError as exc:
            self.abort()
            if exc.filename is None or exc.filename == tmp:
                exc.filename = self.path
            raise
        finally:
            if self._tmp is None:
                self._close_dir()

    def abort(self) -> None:
        """Remove the temporary file; ``path`` stays as it was (idempotent)."""
        tmp, self._tmp = self._tmp, None
        if tmp is not None:
            try:
                os.unlink(tmp, dir_fd=self._dir)
            except OSError:
                pass
        try:
            self.file.close()
        except (OSError, AttributeError):
            pass
        self._close_dir()

    def _close_dir(self) -> None:
        fd, self._dir = self._dir, -1
        if fd >= 0:
            os.close(fd)

    def __enter__(self) -> BinaryIO:
        return self.file

    def __exit__(self, exc_type: type[BaseException] | None, exc: BaseException | None,
                 tb: TracebackType | None) -> None:
        if exc_type is None:
            self.commit()
        else:
            self.abort()

    def __del__(self) -> None:
        if getattr(self, "_tmp", None) is not None:
            self.abort()


def write_atomic(path: str | os.PathLike[str], data: bytes, *, mode: int | None = None) -> None:
    """``data`` at ``path``, whole or not at all (``AtomicFile``)."""
    with AtomicFile(path, mode=mode) as f:
        f.write(data)



def open_regular(path: str | os.PathLike[str], mode: str = "rb") -> BinaryIO:
    """``path`` opened for reading if it is a regular file (a symlink to one is fine).
    Anything else is refused without waiting (:class:`NotRegularFileError`, naming the
    path and what it is): a FIFO would block for a writer for ever, a device never end."""
    p = os.fspath(path)
    # not blocking: opening a FIFO waits for a writer
    fd = os.open(p, os.O_RDONLY | os.O_NONBLOCK | os.O_CLOEXEC)
    try:
        kind = stat.S_IFMT(os.fstat(fd).st_mode)
        if kind != stat.S_IFREG:
            raise NotRegularFileError(_KINDS.get(kind, "special file"), p)
        os.set_blocking(fd, True)
        return cast(BinaryIO, os.fdopen(fd, mode))
    except BaseException:
        os.close(fd)
        raise

