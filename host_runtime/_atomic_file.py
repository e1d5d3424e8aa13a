"""Files written whole or not at all, and never through a link someone put in their place.

``poprt`` and the PopEF ``Writer`` write their outputs here::

    with AtomicFile(path) as f:     # f: a binary file
        f.write(...)                # an exception: nothing at ``path`` changes

1. The output's folder is opened once (``O_DIRECTORY``); every later step names
   files relative to that descriptor, so a folder renamed or replaced by a
   symlink meanwhile changes nothing.
2. A new file ``.<name>.<random>.tmp`` is created in that folder with
   ``O_CREAT|O_EXCL|O_NOFOLLOW`` and mode 0600: it cannot be a file or link that
   existed before, and nobody else can read it while it is incomplete.
3. On success it is flushed, ``fsync``'d, given the mode a normal new file would
   get (0666 less the umask), and ``os.replace``'d onto ``name``: a symlink at
   ``name`` is replaced itself, its target is never opened. On failure the
   temporary file is removed and ``path`` is as it was.

Checking a path and then opening it (``exists()``/``resolve()``, then ``open``)
leaves a window in which a symlink put at the path is written through; here
there is no such window.
"""

from __future__ import annotations

import os
import secrets
from types import TracebackType
from typing import BinaryIO, cast

__all__ = ["AtomicFile", "umask"]

_FLAGS = os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC
_MAX_TMP_STEM = 200      # a name's bytes kept in the temporary name (NAME_MAX is 255)


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


class AtomicFile:
    """A file that appears at ``path`` whole on ``commit()`` (or a clean ``with`` exit),
    written through ``.file``; ``abort()`` (or an exception) leaves ``path`` untouched.
    Raises OSError (with ``filename`` set to ``path``) when the folder or the temporary
    file cannot be created."""

    def __init__(self, path: str | os.PathLike[str]) -> None:
        self.path = os.fspath(path)
        folder, self._name = os.path.split(os.path.abspath(self.path))
        if not self._name:
            raise IsADirectoryError(21, "Is a directory", self.path)
        self._dir = os.open(folder, os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)
        self._tmp: str | None = None
        try:
            stem = self._name[:_MAX_TMP_STEM]
            while True:
                tmp = f".{stem}.{secrets.token_hex(6)}.tmp"
                try:
                    # opened relative to the folder's descriptor; the file's .name is the
                    # full path (onnx.save and messages read it)
                    self.file: BinaryIO = cast(BinaryIO, open(
                        os.path.join(folder, tmp), "wb",
                        opener=lambda _p, _f: os.open(tmp, _FLAGS, 0o600, dir_fd=self._dir)))
                    break
                except FileExistsError:   # a name taken (by chance or on purpose): another
                    continue
            self._tmp = tmp
        except BaseException:
            os.close(self._dir)
            raise

    @property
    def done(self) -> bool:
        return self._tmp is None

    def commit(self) -> None:
        """Make the file appear at ``path``, whole (idempotent once done)."""
        tmp = self._tmp
        if tmp is None:
            return
        try:
            self.file.flush()
            os.fsync(self.file.fileno())
            os.fchmod(self.file.fileno(), 0o666 & ~umask())
            self.file.close()
            os.replace(tmp, self._name, src_dir_fd=self._dir, dst_dir_fd=self._dir)
            self._tmp = None
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
        try:
            self.file.close()
        except OSError:
            pass
        if tmp is not None:
            try:
                os.unlink(tmp, dir_fd=self._dir)
            except OSError:
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
